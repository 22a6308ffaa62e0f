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

from collections.abc import Sequence
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


def _record_widths(graph: Graph) -> list[int]:
    """How many of `_numbers` each record of `graph` holds, in their order: ops, tensors,
    storages (the info's numbers follow)."""
    return (
        [1] * len(graph.ops)
        + [1 + len(t.shape) + len(t.stride) for t in graph.tensors.values()]
        + [1] * len(graph.storages)
    )


def _with_numbers(template: Graph, numbers: list[int], varying: Sequence[bool]) -> Graph:
    """`template` with the numbers of its `varying` records (and of its info) replaced by
    `numbers`, in `_numbers`' order; the other records are the template's own (equal at every
    size, they are shared: records are immutable)."""
    it, changes = iter(numbers), iter(varying)
    ops = []
    for op in template.ops:
        if next(changes):
            op = _copy(op)
            op.__dict__["flops"] = next(it)
        ops.append(op)
    tensors = {}
    for tid, t in template.tensors.items():
        if next(changes):
            t = _copy(t)
            fields = t.__dict__
            fields["nbytes"] = next(it)
            fields["shape"] = tuple(next(it) for _ in fields["shape"])
            fields["stride"] = tuple(next(it) for _ in fields["stride"])
        tensors[tid] = t
    storages = {}
    for sid, st in template.storages.items():
        if next(changes):
            st = _copy(st)
            st.__dict__["nbytes"] = next(it)
        storages[sid] = st
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
    them: a polynomial of degree len(sizes) - 1 in n for every number. A record whose numbers
    are equal at every traced size is equal at every size (so is the polynomial through them):
    the graphs share it, and only the others' numbers are interpolated (of a 70B step's 51,618
    records, 25,929 are shared: most ops have no FLOPs, parameters and gradients no size)."""

    sizes: tuple[int, ...]
    template: Graph
    #: (len(sizes), count) Python ints: each graph's `_numbers` of the varying records and the info
    numbers: np.ndarray
    #: per record of the template (ops, tensors, storages): whether its numbers vary with size
    varying: tuple[bool, ...]

    @classmethod
    def of(cls, traced: dict[int, Graph]) -> SizeModel | None:
        """The model through `traced` (size -> graph), or None when the graphs' structures differ."""
        sizes = tuple(sorted(traced))
        template = traced[sizes[0]]
        skeleton = _skeleton(template)
        if any(_skeleton(traced[n]) != skeleton for n in sizes[1:]):
            return None
        numbers = np.array([_numbers(traced[n]) for n in sizes], dtype=object)
        widths = _record_widths(template)
        starts = np.cumsum([0, *widths[:-1]])
        differs = (numbers != numbers[0]).any(axis=0)
        varying = np.add.reduceat(differs.astype(np.int64), starts) > 0 if widths else differs[:0]
        columns = np.ones(numbers.shape[1], dtype=bool)  # the info's numbers: always read back
        columns[: sum(widths)] = np.repeat(varying, widths)
        return cls(sizes, template, numbers[:, columns], tuple(bool(v) for v in varying))

    def at(self, size: int) -> Graph | None:
        """The graph at `size`, or None where some number would not be a whole non-negative
        integer (the model does not hold there)."""
        if size in self.sizes:
            row = list(self.numbers[self.sizes.index(size)])
            return _with_numbers(self.template, row, self.varying)
        weights = [
            prod(Fraction(size - xj, xi - xj) for xj in self.sizes if xj != xi) for xi in self.sizes
        ]
        scale = lcm(*(w.denominator for w in weights))
        whole = [int(w * scale) for w in weights]
        total = sum(w * row for w, row in zip(whole, self.numbers, strict=True))
        if any(v % scale or v < 0 for v in total):
            return None
        return _with_numbers(self.template, [v // scale for v in total], self.varying)
