"""Graphs at other sizes from traced ones: what lets `remat.answers.fit` search batch and sequence fast.

A step traced at a few batch sizes (or sequence lengths) gives graphs with the same ops, tensors
and storages whose numbers differ: each tensor's shape, stride and bytes and each op's FLOPs is a
polynomial in the size (affine in the batch; in the sequence at most quadratic, from attention
scores). `SizeModel` holds d + 1 traced graphs of one structure and gives the graph at any other
size by interpolating every number through them, in exact integer arithmetic; a number that would
not be a whole non-negative integer there means the model does not hold, and it says so (None).

It is a model, not a trace: `fit` confirms each answer with a trace at that size and compares the
two graphs (`same_graph`), falling back to tracing every size where they differ (a model whose
structure changes with size, e.g. a copy a reshape needs only at some sizes).

Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from math import lcm, prod
from typing import TypeVar

import numpy as np

from remat.graph import Graph, Op, Storage, Tensor

_Record = TypeVar("_Record", Op, Tensor, Storage)


def _info_numbers(graph: Graph) -> list[str]:
    """The keys of `graph.info` that hold whole numbers (parameter counts: a model whose position
    table is sized to the sequence has more parameters at a longer one)."""
    return sorted(
        k for k, v in graph.info.items() if isinstance(v, int) and not isinstance(v, bool)
    )


def _skeleton(graph: Graph) -> tuple[object, ...]:
    """Everything of `graph` but its size-dependent numbers."""
    numeric = set(_info_numbers(graph))
    return (  # ops and storages as tuples of their other fields (compared, never used as records)
        [
            (op.index, op.name, op.target, op.module, op.phase, op.inputs, op.outputs, op.node)
            for op in graph.ops
        ],
        [
            (t.id, t.storage, t.dtype, t.producer, len(t.shape), len(t.stride))
            for t in graph.tensors.values()
        ],
        [(s.id, s.kind, s.allocated_at, s.released_after) for s in graph.storages.values()],
        graph.saved,
        graph.nodes,
        graph.modules,
        {k: (None if k in numeric else v) for k, v in graph.info.items()},
    )


def _numbers(graph: Graph) -> list[int]:
    """The size-dependent numbers of `graph`, in the order `_with_numbers` reads them back."""
    out = [op.flops for op in graph.ops]
    for t in graph.tensors.values():
        out += (t.nbytes, *t.shape, *t.stride)
    out += [s.nbytes for s in graph.storages.values()]
    out += [graph.info[k] for k in _info_numbers(graph)]
    return out


def _copy(record: _Record) -> _Record:
    """A copy of a graph record, to have numbers replaced in its `__dict__`: copying the dict is
    faster than a frozen dataclass's constructor, which sets field by field (most of a 70B step's
    time at each size), and keeps what an op worked out of its name (`Op.short`)."""
    new = object.__new__(type(record))
    new.__dict__.update(record.__dict__)
    return new


def _with_numbers(template: Graph, numbers: list[int]) -> Graph:
    it = iter(numbers)
    ops = []
    for op in template.ops:
        ops.append(new := _copy(op))
        new.__dict__["flops"] = next(it)
    tensors = {}
    for tid, t in template.tensors.items():
        tensors[tid] = new = _copy(t)
        fields = new.__dict__
        fields["nbytes"] = next(it)
        fields["shape"] = tuple(next(it) for _ in t.shape)
        fields["stride"] = tuple(next(it) for _ in t.stride)
    storages = {}
    for sid, st in template.storages.items():
        storages[sid] = new = _copy(st)
        new.__dict__["nbytes"] = next(it)
    info = dict(template.info)
    info.update({k: next(it) for k in _info_numbers(template)})
    return Graph(
        ops=ops,
        tensors=tensors,
        storages=storages,
        saved=template.saved,
        nodes=template.nodes,
        modules=template.modules,
        info=info,
    )


def same_graph(a: Graph, b: Graph) -> bool:
    """Whether two graphs are equal, structure and every number."""
    return _skeleton(a) == _skeleton(b) and _numbers(a) == _numbers(b)


@dataclass(frozen=True)
class SizeModel:
    """Traced graphs of one structure at `sizes`; `at(n)` interpolates the graph at size n through
    them: a polynomial of degree len(sizes) - 1 in n for every number."""

    sizes: tuple[int, ...]
    template: Graph
    numbers: np.ndarray  # (len(sizes), count) Python ints: each graph's `_numbers`

    @classmethod
    def of(cls, traced: dict[int, Graph]) -> SizeModel | None:
        """The model through `traced` (size -> graph), or None when the graphs' structures differ."""
        sizes = tuple(sorted(traced))
        skeleton = _skeleton(traced[sizes[0]])
        if any(_skeleton(traced[n]) != skeleton for n in sizes[1:]):
            return None
        numbers = np.array([_numbers(traced[n]) for n in sizes], dtype=object)
        return cls(sizes, traced[sizes[0]], numbers)

    def at(self, size: int) -> Graph | None:
        """The graph at `size`, or None where some number would not be a whole non-negative
        integer (the model does not hold there)."""
        if size in self.sizes:
            return _with_numbers(self.template, list(self.numbers[self.sizes.index(size)]))
        weights = [
            prod(Fraction(size - xj, xi - xj) for xj in self.sizes if xj != xi) for xi in self.sizes
        ]
        scale = lcm(*(w.denominator for w in weights))
        whole = [int(w * scale) for w in weights]
        total = sum(w * row for w, row in zip(whole, self.numbers, strict=True))
        if any(v % scale or v < 0 for v in total):
            return None
        return _with_numbers(self.template, [v // scale for v in total])
