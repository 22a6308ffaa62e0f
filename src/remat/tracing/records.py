"""The records `remat.tracing.recorder.Tracer` keeps while a step runs: mutable twins of the
`Graph`'s frozen `Op`, `Storage`, `Node`, `ModuleCall` and `Saved`, which may carry trace-only state
(a call still `open`, the calls it may repeat), frozen into the graph's types at the end."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

import torch

from remat.graph import ModuleCall, Node, Op, Phase, Saved, Storage, StorageKind
from remat.tracing.calls import CallShape

_Frozen = TypeVar("_Frozen")


def freeze_record(record: Any, cls: type[_Frozen]) -> _Frozen:
    """`cls` built from the fields of `record` it has: a record may also carry trace-only state."""
    return cls(**{f.name: getattr(record, f.name) for f in fields(cls)})


@dataclass(slots=True)
class OpRecord:
    """An `Op` being traced: `node` is set once autograd attaches the op's grad_fn."""

    index: int
    name: str
    target: str
    module: str
    phase: Phase
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    flops: int
    node: int | None

    def freeze(self) -> Op:
        return freeze_record(self, Op)


@dataclass(slots=True)
class StorageRecord:
    """A `Storage` being traced: `released_after` is set when the program drops it."""

    id: int
    nbytes: int
    kind: StorageKind
    allocated_at: int | None
    released_after: int | None = None

    def freeze(self) -> Storage:
        return freeze_record(self, Storage)


@dataclass(slots=True)
class NodeRecord:
    """A `Node` being traced, plus the parameter it accumulates the gradient of (AccumulateGrad)."""

    id: int
    name: str
    forward_op: int | None
    param: str | None
    released_after: int | None = None

    def freeze(self) -> Node:
        return freeze_record(self, Node)


@dataclass(slots=True)
class CallRecord:
    """A `ModuleCall` being traced: `open` until the module returns."""

    path: str
    type: str
    first_op: int
    last_op: int
    inputs: tuple[int, ...]
    outputs: tuple[int, ...] = ()
    escaped: tuple[int, ...] = ()
    arguments: tuple[str, ...] = ()
    output_path: tuple[int | str, ...] | None = None
    repeats: tuple[str, ...] = ()
    open: bool = True
    #: how it was called and what it returned, and the calls it may repeat (`remat.tracing.calls`)
    shape_in: CallShape | None = None
    shape_out: CallShape | None = None
    previous: list[CallRecord] = field(default_factory=list)

    def freeze(self) -> ModuleCall:
        return freeze_record(self, ModuleCall)


@dataclass
class SavedRecord:
    """What the pack hook keeps instead of the tensor: enough to rebuild it in backward."""

    storage: int
    tensor: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype
    device: torch.device
    storage_numel: int
    payload: torch.UntypedStorage | None
    node: int | None = None
    phase: Phase = "forward"
    forward_op: int | None = None
    packed_after: int | None = None
    released_after: int | None = None
    unpacked_until: int | None = None

    def freeze(self) -> Saved:
        return freeze_record(self, Saved)
