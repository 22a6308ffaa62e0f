"""The IR every stage after tracing works on: ops, tensors, storages and what autograd saved.

Nothing here imports torch, so solvers and the estimator can be tested on hand-made graphs.

Time is counted in op indices: op `i` runs, allocates its new output storages, and a storage whose
`released_after == i` is dropped right after it. Memory is counted per *storage*, never per tensor,
so views and in-place results share the bytes of the storage they alias.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from functools import cached_property
from typing import Any, Literal, TypeVar

_T = TypeVar("_T")

Phase = Literal["forward", "backward"]
StorageKind = Literal["param", "buffer", "input", "constant", "activation", "grad"]

#: Storages that exist before the step starts and survive it.
PERSISTENT_KINDS = frozenset({"param", "buffer", "input", "constant"})

#: An op draws random numbers if its packet name contains one of these: it is never recomputed by
#: the compiled path, and a checkpoint region without one need not keep the RNG state.
RANDOM_MARKERS = (
    "dropout",
    "rand",
    "bernoulli",
    "normal",
    "uniform",
    "multinomial",
    "poisson",
    "exponential",
    "geometric",
    "cauchy",
    "rrelu",
)


@dataclass(frozen=True)
class Storage:
    """One allocation. `released_after` is when the *program* dropped it (None: still held at the end
    of the step); autograd's own hold on saved storages is in `Graph.saved` and `Node.released_after`."""

    id: int
    nbytes: int
    kind: StorageKind
    allocated_at: int | None = None
    released_after: int | None = None


@dataclass(frozen=True)
class Tensor:
    id: int
    storage: int
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    producer: int | None = None
    stride: tuple[int, ...] = ()

    @property
    def expanded(self) -> bool:
        """A broadcast view (stride 0 along a dimension longer than 1): kernels that need dense
        operands copy it to `nbytes` of contiguous memory first."""
        return any(st == 0 and n > 1 for st, n in zip(self.stride, self.shape, strict=False))


@dataclass(frozen=True)
class Op:
    """One aten op. `name` is stable across runs: module path, op, call index (`h.0.attn.mm_1`);
    backward ops are named after the forward op whose autograd node ran them (`h.0.attn.mm_1:bwd.mm_0`)."""

    index: int
    name: str
    target: str
    module: str
    phase: Phase
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    flops: int = 0
    node: int | None = None

    @cached_property
    def short(self) -> str:
        """The op's packet name, `mm` for `aten.mm.default`."""
        parts = self.target.split(".")
        return parts[1] if len(parts) > 1 else parts[0]

    @cached_property
    def random(self) -> bool:
        """Whether the op draws random numbers (dropout, rand, bernoulli_, ...)."""
        return any(m in self.short for m in RANDOM_MARKERS)


@dataclass(frozen=True)
class Node:
    """An autograd node. `forward_op` created it; it ran in backward and released its saved tensors
    after op `released_after` (None: it never ran, its saved tensors live until the step ends)."""

    id: int
    name: str
    forward_op: int | None
    released_after: int | None = None


@dataclass(frozen=True)
class Saved:
    """Autograd saved a tensor of `storage` for `node` (None when no node unpacked it: its node
    never ran, or ran without reading it), made by forward op `forward_op`, packed right after op
    `packed_after` (a checkpoint region's replay stops there when this is its last save).
    `released_after`: when autograd let go of it, for a save no node unpacked (its node destroyed
    with the forward's tensors that led to it, or done with it); None: held to the end of the step.
    `phase` "backward": saved by autograd run inside a custom Function's backward (a reversible
    layer's recomputation), held only until that nested backward has used it. `unpacked_until`:
    the last op before the tensor the unpack handed to its node was dropped (the node's backward
    function returned; the engine's `sum_to` of its gradients and its release come after): a
    value a checkpoint replay re-made, held by nothing else, dies then. Graphs from before these
    were recorded have None in `forward_op`, `packed_after`, `released_after` and
    `unpacked_until`."""

    storage: int
    tensor: int
    node: int | None
    phase: Phase = "forward"
    forward_op: int | None = None
    packed_after: int | None = None
    released_after: int | None = None
    unpacked_until: int | None = None


@dataclass(frozen=True)
class ModuleCall:
    """One call of a submodule during the forward, covering forward ops `first_op..last_op`.
    `escaped` are the ops of the call whose output storages outlived it outside its outputs: the
    call wrote them into state (a cache, an attribute), which recomputing it would write again.

    How it was called (`remat.tracing.calls`), for regions that run several blocks: `arguments`,
    beside `inputs`, the argument each input tensor was ("0", "hidden_states"; "" when nested in
    one); `repeats`, the paths of the calls that returned after the last op before it began (the
    previous block, and the containers that returned with it) that it was called like: the same
    structure and non-tensor values in and out."""

    path: str
    type: str
    first_op: int
    last_op: int
    inputs: tuple[int, ...] = ()
    outputs: tuple[int, ...] = ()
    escaped: tuple[int, ...] = ()
    arguments: tuple[str, ...] = ()
    output_path: tuple[int | str, ...] | None = None
    repeats: tuple[str, ...] = ()

    @property
    def depth(self) -> int:
        return 0 if not self.path else self.path.count(".") + 1


_CALL_TUPLES = ("inputs", "outputs", "escaped", "arguments", "repeats")


def _call_fields(d: dict) -> dict:
    if d.get("output_path") is not None:
        d["output_path"] = tuple(d["output_path"])
    return d


@dataclass
class Graph:
    ops: list[Op]
    tensors: dict[int, Tensor]
    storages: dict[int, Storage]
    saved: list[Saved]
    nodes: dict[int, Node]
    modules: list[ModuleCall]
    info: dict[str, object] = field(default_factory=dict)
    #: what later stages derive from the graph and keep with it (each op's kernel scratch, which
    #: every simulation adds): not part of the graph's identity, equality or JSON, nor copied
    memo: dict[str, Any] = field(default_factory=dict, init=False, compare=False, repr=False)

    def derived(self, name: str, compute: Callable[[], _T], *reads: object) -> _T:
        """`compute()`, kept in `memo` under `name` while the parts of the graph it `reads` (its
        lists, by identity) are the same objects: worked out once per graph, not per plan."""
        kept = self.memo.get(name)
        if (
            kept is None
            or len(kept[0]) != len(reads)
            or any(a is not b for a, b in zip(kept[0], reads, strict=True))
        ):
            kept = self.memo[name] = (reads, compute())
        return kept[1]

    # -- views -----------------------------------------------------------------------------------
    @cached_property
    def forward_ops(self) -> list[Op]:
        return [op for op in self.ops if op.phase == "forward"]

    @cached_property
    def backward_ops(self) -> list[Op]:
        return [op for op in self.ops if op.phase == "backward"]

    @cached_property
    def op_by_name(self) -> dict[str, Op]:
        return {op.name: op for op in self.ops}

    def storages_of(self, kinds: Iterable[str]) -> Iterator[Storage]:
        wanted = set(kinds)
        return (s for s in self.storages.values() if s.kind in wanted)

    def bytes_of(self, *kinds: str) -> int:
        return sum(s.nbytes for s in self.storages_of(kinds))

    @property
    def param_bytes(self) -> int:
        return self.bytes_of("param")

    @property
    def buffer_bytes(self) -> int:
        return self.bytes_of("buffer")

    @property
    def input_bytes(self) -> int:
        return self.bytes_of("input", "constant")

    @property
    def grad_bytes(self) -> int:
        return self.bytes_of("grad")

    @cached_property
    def saved_storages(self) -> dict[int, list[Saved]]:
        """Storage id -> the saves holding it, for every storage autograd kept in the forward
        that is not a parameter or buffer: the activations of the step."""
        out: dict[int, list[Saved]] = {}
        for s in self.saved:
            if s.phase == "forward" and self.storages[s.storage].kind not in ("param", "buffer"):
                out.setdefault(s.storage, []).append(s)
        return out

    @property
    def activation_bytes(self) -> int:
        """Bytes autograd holds for backward at the end of the forward (params and buffers excluded)."""
        return sum(self.storages[sid].nbytes for sid in self.saved_storages)

    def producer_op(self, storage_id: int) -> Op | None:
        at = self.storages[storage_id].allocated_at
        return None if at is None else self.ops[at]

    @cached_property
    def stateful_calls(self) -> list[ModuleCall]:
        """The module calls that wrote tensors into state outside their outputs (`escaped`)."""
        return [m for m in self.modules if m.escaped]

    @cached_property
    def blocks(self) -> list[ModuleCall]:
        """The repeated blocks of the model (transformer layers, ResNet bottlenecks, chain layers):
        the calls of numbered submodules (`h.3`, `layer2.1`) at the depth where they cover the most
        forward ops, shallowest on a tie. Without them, the calls of modules the forward calls more
        than once, by the same rule: a block run in a loop (a universal transformer), one block
        object at several depths. Empty when the model has neither."""
        numbered = [m for m in self.modules if m.path.rpartition(".")[2].isdigit()]
        return _widest_depth(numbered) or _widest_depth(
            [m for m in self.modules if m.path in self.repeated_paths]
        )

    @cached_property
    def calls_of(self) -> dict[str, list[ModuleCall]]:
        """Each module path -> its calls in the forward, in order."""
        out: dict[str, list[ModuleCall]] = {}
        for m in sorted(self.modules, key=lambda m: m.first_op):
            out.setdefault(m.path, []).append(m)
        return out

    @cached_property
    def repeated_paths(self) -> frozenset[str]:
        """The submodules the forward calls more than once (a block run in a loop, ALBERT's group)."""
        return frozenset(p for p, calls in self.calls_of.items() if p and len(calls) > 1)

    def call_numbers(
        self, modules: tuple[str, ...], first_op: int, last_op: int
    ) -> tuple[int, ...]:
        """Which call of each of `modules` (0: the forward's first) falls in `first_op..last_op`,
        in order, where one of them is called more than once, so that `remat.apply` checkpoints
        those calls alone; () where each is called once."""
        if self.repeated_paths.isdisjoint(modules):
            return ()
        inside = {
            path: iter(
                [n for n, c in enumerate(self.calls_of[path]) if first_op <= c.first_op <= last_op]
            )
            for path in set(modules)
        }
        return tuple(next(inside[path], 0) for path in modules)

    # -- serialisation ---------------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps(
            {
                "ops": [asdict(o) for o in self.ops],
                "tensors": [asdict(t) for t in self.tensors.values()],
                "storages": [asdict(s) for s in self.storages.values()],
                "saved": [asdict(s) for s in self.saved],
                "nodes": [asdict(n) for n in self.nodes.values()],
                "modules": [asdict(m) for m in self.modules],
                "info": self.info,
            }
        )

    @classmethod
    def from_json(cls, text: str) -> Graph:
        d = json.loads(text)

        def tup(obj: dict, *keys: str) -> dict:
            return {k: (tuple(v) if k in keys else v) for k, v in obj.items()}

        return cls(
            ops=[Op(**tup(o, "inputs", "outputs")) for o in d["ops"]],
            tensors={t["id"]: Tensor(**tup(t, "shape", "stride")) for t in d["tensors"]},
            storages={s["id"]: Storage(**s) for s in d["storages"]},
            saved=[Saved(**s) for s in d["saved"]],
            nodes={n["id"]: Node(**n) for n in d["nodes"]},
            modules=[ModuleCall(**_call_fields(tup(m, *_CALL_TUPLES))) for m in d["modules"]],
            info=d["info"],
        )


def _widest_depth(calls: list[ModuleCall]) -> list[ModuleCall]:
    """Of `calls`, those at the depth (two calls or more) whose calls cover the most forward ops,
    shallowest on a tie, in forward order."""
    by_depth: dict[int, list[ModuleCall]] = {}
    for m in calls:
        by_depth.setdefault(m.depth, []).append(m)
    by_depth = {d: found for d, found in by_depth.items() if len(found) >= 2}
    if not by_depth:
        return []

    def coverage(depth: int) -> int:
        return sum(c.last_op - c.first_op + 1 for c in by_depth[depth])

    best = max(sorted(by_depth), key=coverage)
    return sorted(by_depth[best], key=lambda c: c.first_op)
