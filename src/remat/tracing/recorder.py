"""The recorder: `Tracer`, a dispatch mode that records one training step as it runs (every aten op,
the tensors and storages the ops make and the program drops, what autograd saves and which backward
node uses it, the module calls) and freezes the record into a `Graph` (`Tracer.graph`).
`remat.tracing.trace` runs the step under it.

How the ground truth is taken, and why:
- Every aten op is seen by a `TorchDispatchMode` stacked above `FakeTensorMode` (or real tensors when
  `device="cpu"`), so forward *and* backward ops are recorded as autograd actually runs them.
- Storage identity is the address of the C++ `StorageImpl` (`StorageWeakRef.cdata`): it works on
  fake/meta tensors, where `data_ptr()` is 0. We keep a weak reference to every storage seen, so an
  address cannot be reused by another storage during the trace, and `expired()` tells exactly when
  the program dropped its last reference.
- What autograd saves comes from `saved_tensors_hooks`: the pack hook keeps only a description of the
  saved tensor (plus a copy of its data when tracing on real tensors), so the storage's recorded
  lifetime is the program's own; the unpack hook rebuilds a stand-in that maps back to the original
  storage, and `torch._C._current_autograd_node()` names the backward node that consumed it.
- Backward ops are attributed to their autograd node, and a node to the forward op whose output
  first carried it as `grad_fn`; that gives every backward op a module path and a stable name.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from typing import Any, TypeVar

import torch
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    UnsupportedOperatorException,
)
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry
from torch.utils.weak import WeakIdKeyDictionary

from remat.device import emulate, kernel_scratch
from remat.device.targets import CPU, Target
from remat.errors import TraceError
from remat.graph import (
    Graph,
    ModuleCall,
    Node,
    Op,
    Phase,
    Saved,
    Storage,
    StorageKind,
    Tensor,
)
from remat.tracing.kernels import EXTRA_FLOPS, FAKE_KERNELS
from remat.tracing.tensors import (
    dtype_name,
    is_wrapper_op,
    local_tensor,
    rewrapper,
    storage_key,
    storage_nbytes,
)

_WAIT_TENSOR = getattr(getattr(torch.ops, "_c10d_functional", None), "wait_tensor", None)
_WAIT_TENSOR = None if _WAIT_TENSOR is None else _WAIT_TENSOR.default

LOSS_SCOPE = "<loss>"
BACKWARD_SCOPE = "<backward>"
_DATA_DEPENDENT = (DataDependentOutputException, DynamicOutputShapeException)


_Frozen = TypeVar("_Frozen")


def _freeze(record: Any, cls: type[_Frozen]) -> _Frozen:
    """`cls` built from the fields of `record` it has: a record may also carry trace-only state."""
    return cls(**{f.name: getattr(record, f.name) for f in fields(cls)})


@dataclass(slots=True)
class _OpRecord:
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
        return _freeze(self, Op)


@dataclass(slots=True)
class _StorageRecord:
    """A `Storage` being traced: `released_after` is set when the program drops it."""

    id: int
    nbytes: int
    kind: StorageKind
    allocated_at: int | None
    released_after: int | None = None

    def freeze(self) -> Storage:
        return _freeze(self, Storage)


@dataclass(slots=True)
class _NodeRecord:
    """A `Node` being traced, plus the parameter it accumulates the gradient of (AccumulateGrad)."""

    id: int
    name: str
    forward_op: int | None
    param: str | None
    released_after: int | None = None

    def freeze(self) -> Node:
        return _freeze(self, Node)


@dataclass(slots=True)
class _CallRecord:
    """A `ModuleCall` being traced: `open` until the module returns."""

    path: str
    type: str
    first_op: int
    last_op: int
    inputs: tuple[int, ...]
    outputs: tuple[int, ...] = ()
    escaped: tuple[int, ...] = ()
    open: bool = True

    def freeze(self) -> ModuleCall:
        return _freeze(self, ModuleCall)


@dataclass
class _SavedRecord:
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
    forward_op: int | None
    packed_after: int | None
    node: int | None = None
    released_after: int | None = None

    def freeze(self) -> Saved:
        return _freeze(self, Saved)


class _Packed:
    """What autograd holds for a save: the record's key, the tensor itself for a parameter or
    buffer, the rewrapper of a wrapper subclass. Its death is when autograd let go of the save
    (its node ran, or was destroyed unrun with the forward's tensors): it reports that to
    `freed`, which the tracer reads at its next event."""

    __slots__ = ("key", "direct", "rewrap", "freed")

    def __init__(self, key: int, direct: Any, rewrap: Any, freed: list[int]):
        self.key, self.direct, self.rewrap, self.freed = key, direct, rewrap, freed

    def __del__(self) -> None:
        self.freed.append(self.key)


class Tracer(TorchDispatchMode):
    def __init__(self, *, real: bool, target: Target = CPU):
        super().__init__()
        self.real = real
        self.target = target
        self.paused = False
        self.phase: Phase = "forward"
        self.scopes: list[str] = [""]
        self.ops: list[_OpRecord] = []
        self.name_counts: dict[tuple[str, str], int] = defaultdict(int)
        # storages: id -> mutable record; address -> id; weak refs keep addresses unique
        self.storages: dict[int, _StorageRecord] = {}
        self.storage_by_cdata: dict[int, int] = {}
        self.weakrefs: dict[int, StorageWeakRef] = {}
        self.live: dict[int, int] = {}  # storage id -> its weak reference's cdata
        self.stand_in_refs: list[StorageWeakRef] = []
        self.tensors: dict[int, Tensor] = {}
        self.tensor_ids: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.ids = itertools.count()
        # autograd nodes
        self.nodes: dict[int, _NodeRecord] = {}
        self.pending_grad_fn: list[tuple[int, torch.Tensor, Any]] = []
        #: After an op writes a view in place, autograd replays the view to give it its new
        #: grad_fn, through this mode on fake tensors (not on real ones): view ops on the written
        #: view's base (or on their own replayed views) from the same Python call are that
        #: replay, not the program's, and are not recorded. (base and replayed ids, call site)
        self.view_replay: tuple[set[int], tuple[int, int]] | None = None
        self.current_node: int | None = None
        self.saved: dict[int, _SavedRecord] = {}
        self.freed_saves: list[int] = []  # keys of saves autograd let go of since the last event
        self.unpacked_by: dict[int, list[int]] = defaultdict(list)
        self.modules: list[_CallRecord] = []
        self.param_names: dict[int, str] = {}
        #: op index -> its kernel's scratch, measured on this machine (`remat.device.kernel_scratch`)
        self.kernel_scratch: dict[int, int] = {}
        #: the innermost module whose call an exception left (its forward hook still runs)
        self.failed_in: str | None = None
        #: Collectives run on gloo (a CPU process group), which allocates beyond their outputs.
        self.gloo = _process_group_backend() == "gloo" and not target.is_cuda
        #: An op on DTensors is seen twice: first to run it again with this mode on the stack, then
        #: (this flag set) to decline it to DTensor's own dispatch (`run_wrapper_op`).
        self.declining_wrapper_op = False

    # -- storages and tensors --------------------------------------------------------------------
    def storage_id(
        self, t: torch.Tensor, kind: StorageKind, allocated_at: int | None = None
    ) -> int:
        """The storage of `t` (of its local shard, for a DTensor), registered with `kind` if it
        has not been seen."""
        t = local_tensor(t)
        cdata = storage_key(t)
        sid = self.storage_by_cdata.get(cdata)
        if sid is not None:
            return sid
        sid = next(self.ids)
        self.storage_by_cdata[cdata] = sid
        self.weakrefs[sid] = StorageWeakRef(t.untyped_storage())
        self.storages[sid] = _StorageRecord(sid, storage_nbytes(t), kind, allocated_at)
        if allocated_at is not None:
            self.live[sid] = self.weakrefs[sid].cdata
        return sid

    def tensor_id(
        self, t: torch.Tensor, kind: StorageKind = "constant", producer: int | None = None
    ) -> int:
        """The id of tensor object `t`; a new tensor record when `producer` is given (an op's output,
        in-place results included) or when `t` was never seen (a pre-existing constant)."""
        if producer is None and t in self.tensor_ids:
            return self.tensor_ids[t]
        sid = self.storage_id(t, kind, producer)
        tid = next(self.ids)
        self.tensors[tid] = Tensor(
            id=tid,
            storage=sid,
            shape=tuple(int(d) for d in t.shape),
            dtype=dtype_name(t.dtype),
            nbytes=int(t.numel() * t.element_size()),
            producer=producer,
            stride=tuple(int(st) for st in t.stride()),
        )
        self.tensor_ids[t] = tid
        return tid

    # -- events ----------------------------------------------------------------------------------
    def before_event(self) -> None:
        """Runs before every op and hook: attribute the last op's grad_fn, notice a finished
        backward node, and record the storages the program dropped since the last op."""
        last = len(self.ops) - 1
        self.resolve_grad_fns()
        if self.phase == "backward":
            node = torch._C._current_autograd_node()
            nid = None if node is None else self.node_id(node)
            if nid != self.current_node:
                self.finish_node()
                self.current_node = nid
        expired = torch.UntypedStorage._expired  # StorageWeakRef.expired without its frame: hot
        for sid in [s for s, cdata in self.live.items() if expired(cdata)]:
            self.storages[sid].released_after = last
            del self.live[sid]
        while self.freed_saves:
            rec = self.saved[self.freed_saves.pop()]
            rec.released_after, rec.payload = last, None

    def resolve_grad_fns(self) -> None:
        """Attribute the last forward op's outputs' `grad_fn`. Autograd attaches it only after the
        op returns (and after FakeTensor's own metadata queries), and an in-place op's output still
        carries the previous op's node until then: outputs stay pending until their grad_fn differs
        from the one seen inside the op, or until the next recorded op replaces them."""
        unresolved = []
        for index, t, before in self.pending_grad_fn:
            grad_fn = self.read_grad_fn(t)
            if grad_fn is None or grad_fn is before:
                unresolved.append((index, t, before))
            elif self.ops[index].node is None:
                self.ops[index].node = self.node_id(grad_fn, forward_op=index)
        self.pending_grad_fn = unresolved

    def read_grad_fn(self, t: torch.Tensor) -> Any:
        """`t.grad_fn`, with recording paused. Reading it on a view whose base was written in
        place makes autograd replay the view (on fake tensors, through this mode) under the
        view's lock; recording that replay would read the view's `grad_fn` again, a deadlock."""
        paused, self.paused = self.paused, True
        try:
            return t.grad_fn
        finally:
            self.paused = paused

    def node_id(self, node: Any, forward_op: int | None = None) -> int:
        meta = node.metadata
        if "remat.node" not in meta:
            nid = next(self.ids)
            meta["remat.node"] = nid
            variable = getattr(node, "variable", None)  # AccumulateGrad: the leaf it writes
            self.nodes[nid] = _NodeRecord(
                id=nid,
                name=node.name(),
                forward_op=forward_op,
                param=None if variable is None else self.param_names.get(id(variable)),
            )
        return meta["remat.node"]

    def finish_node(self) -> None:
        """The current backward node is done: autograd releases what it saved."""
        if self.current_node is None:
            return
        self.nodes[self.current_node].released_after = len(self.ops) - 1
        for handle in self.unpacked_by.pop(self.current_node, []):
            self.saved[handle].payload = None

    def scope(self) -> tuple[str, str]:
        """(module path, name prefix) of the op about to be recorded."""
        if self.phase == "forward":
            path = self.scopes[-1]
            return path, path
        node = self.nodes.get(self.current_node) if self.current_node is not None else None
        if node is not None and node.param is not None:
            param = node.param
            return param.rpartition(".")[0], f"{param}:grad"
        if node is None or node.forward_op is None:
            return BACKWARD_SCOPE, BACKWARD_SCOPE
        fwd = self.ops[node.forward_op]
        return fwd.module, fwd.name + ":bwd"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.paused:
            return func(*args, **kwargs)
        if is_wrapper_op(args, kwargs):
            return self.run_wrapper_op(func, args, kwargs)
        if func is _WAIT_TENSOR and not self.real:
            # Waiting on a collective returns its result itself (the schema aliases it; the fake
            # kernel would make a second tensor). Not recorded: a real run waits lazily, at the
            # result's first use, so a plan must not name the wait.
            return args[0]
        call = sys._getframe().f_back  # None on autograd's device threads (no Python below)
        call_site = None if call is None else (id(call), call.f_lasti)
        if self.view_replay is not None:
            bases, site = self.view_replay
            if func.is_view and args and id(args[0]) in bases and call_site == site:
                out = func(*args, **kwargs)
                bases.add(id(out))
                return out
        self.before_event()
        try:
            out = self.run_op(func, args, kwargs)
        except TraceError:
            raise
        except Exception as e:
            if self.real:
                raise  # the op failed on the real tensors: the user's own error, unchanged
            module = self.scope()[0] or "<root>"
            first_line = (str(e).strip().splitlines() or [""])[0].rstrip(".")
            if isinstance(e, _DATA_DEPENDENT):
                why = (
                    "has an output whose shape or value depends on tensor data, which fake tensors "
                    "do not have"
                )
            elif isinstance(e, (UnsupportedOperatorException, NotImplementedError)):
                why = "has no fake/meta implementation"
            else:
                why = "fails on fake/meta tensors: its meta kernel rejects these inputs"
            error = TraceError(
                f"op {func} in module '{module}' {why} ({type(e).__name__}: {first_line}). "
                "Trace on real tensors at a size that fits in memory instead: "
                "remat.trace(..., device='cpu') or remat.auto(..., trace_device='cpu') "
                "(CLI: --trace-device cpu, with a smaller --batch/--seq).",
                op=str(func),
                module=module,
                fake_tensor_failure=True,
            )
            raise error from e
        self.record(func, args, kwargs, out, call_site)
        return out

    def run_wrapper_op(self, func, args: tuple, kwargs: dict) -> Any:
        """An op on DTensors (tensor, sequence parallelism) is no rank's op: DTensor's dispatch
        turns it into this rank's ops on its local shards, and the collectives a redistribution
        needs (whose pending results are wrappers too). It is run again with this mode on the
        stack, which declines it the second time (NotImplemented hands it to the subclass's
        dispatch): what is recorded are the inner ops, at this rank's shapes and FLOPs.
        Autograd's node for the op lands on the wrapper outputs; it is attributed to the op that
        made their inner tensors."""
        if self.declining_wrapper_op:
            self.declining_wrapper_op = False
            return NotImplemented
        self.declining_wrapper_op = True
        try:
            with self:
                out = func(*args, **kwargs)
        finally:
            self.declining_wrapper_op = False
        if self.phase == "forward":
            for t in pytree.tree_leaves(out):
                tid = self.tensor_ids.get(local_tensor(t)) if isinstance(t, torch.Tensor) else None
                producer = None if tid is None else self.tensors[tid].producer
                if producer is not None and t is not local_tensor(t):
                    self.pending_grad_fn.append((producer, t, self.read_grad_fn(t)))
        return out

    def run_op(self, func, args: tuple, kwargs: dict) -> Any:
        packet = func._overloadpacket.__name__
        target_kernel = None if self.real else emulate.fake_kernel(self.target, packet)
        if target_kernel is not None:
            return target_kernel(func, args, kwargs)
        meta_dtype, fake_kernel = FAKE_KERNELS.get(packet, (None, None))
        if (
            self.real
            or fake_kernel is None
            or all(
                t.dtype == meta_dtype
                for t in pytree.tree_leaves((args, kwargs))
                if isinstance(t, torch.Tensor) and t.is_floating_point()
            )
        ):
            return func(*args, **kwargs)
        return fake_kernel(*args, **kwargs)

    def record(self, func, args, kwargs, out, call_site: tuple[int, int] | None = None) -> None:
        outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        if not outs:
            return
        self.view_replay = None
        index = len(self.ops)
        arg_tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        inputs = [self.tensor_id(t) for t in arg_tensors]
        outputs = [self.tensor_id(t, "activation", producer=index) for t in outs]
        module, prefix = self.scope()
        short = func._overloadpacket.__name__
        count = self.name_counts[(prefix, short)]
        self.name_counts[(prefix, short)] += 1
        sep = "." if prefix else ""
        flop_fn = flop_registry.get(func._overloadpacket)
        extra = EXTRA_FLOPS.get(short)
        if not self.target.is_cuda and short in kernel_scratch.MEASURED_ON_CPU:
            measured = kernel_scratch.cpu_scratch_bytes(func, args, kwargs, outs)
            if measured is not None:
                self.kernel_scratch[index] = measured
        if self.gloo and func.namespace == "_c10d_functional":
            scratch = kernel_scratch.gloo_collective_scratch_bytes(short, args, outs)
            if scratch:
                self.kernel_scratch[index] = scratch
        self.ops.append(
            _OpRecord(
                index=index,
                name=f"{prefix}{sep}{short}_{count}",
                target=str(func),
                module=module,
                phase=self.phase,
                inputs=tuple(inputs),
                outputs=tuple(outputs),
                flops=int(flop_fn(*args, **kwargs, out_val=out))
                if flop_fn
                else int(extra(*args, **kwargs))
                if extra
                else 0,
                node=self.current_node if self.phase == "backward" else None,
            )
        )
        if self.phase == "forward":
            # A view written in place gets its grad_fn from autograd's replay of the view after
            # the op returns: attribute the op through the base's (its CopySlices, the node that
            # runs in backward), and do not record the replay.
            arg_ids = {id(t) for t in arg_tensors}
            written = {id(t) for t in outs if t._is_view() and id(t) in arg_ids}
            if written and call_site is not None:
                self.view_replay = ({id(t._base) for t in outs if id(t) in written}, call_site)
            holders = [t._base if id(t) in written else t for t in outs]
            self.pending_grad_fn = [(index, h, self.read_grad_fn(h)) for h in holders]

    # -- saved tensor hooks ----------------------------------------------------------------------
    def pack(self, t: torch.Tensor) -> Any:
        self.before_event()
        self.paused = True
        try:
            # A DTensor (tensor parallelism) is described by its local shard, this rank's bytes,
            # and rebuilt around the shard's stand-in in unpack, autograd wanting a DTensor back.
            inner = local_tensor(t)
            tid = self.tensor_id(inner)
            sid = self.tensors[tid].storage
            handle = next(self.ids)
            persistent = self.storages[sid].kind not in ("activation", "grad")
            last = len(self.ops) - 1
            self.saved[handle] = _SavedRecord(
                storage=sid,
                tensor=tid,
                shape=tuple(inner.shape),
                stride=tuple(inner.stride()),
                offset=int(inner.storage_offset()),
                dtype=inner.dtype,
                device=inner.device,
                storage_numel=storage_nbytes(inner) // inner.element_size(),
                payload=inner.untyped_storage().clone() if self.real and not persistent else None,
                forward_op=self.saving_op() if self.phase == "forward" else None,
                packed_after=last if self.phase == "forward" else None,
            )
            if persistent:
                return _Packed(handle, t, None, self.freed_saves)
            return _Packed(handle, None, rewrapper(t), self.freed_saves)
        finally:
            self.paused = False

    def saving_op(self) -> int:
        """The forward op whose node is saving now. Autograd saves an op's inputs before its
        kernel runs (and so before it is recorded) and its outputs after: the op recorded last
        when it ran in the module running now, else the next one (the first of this call)."""
        last = len(self.ops) - 1
        call = next((m for m in reversed(self.modules) if m.open), None)
        in_this_call = call is None or last >= call.first_op
        return (
            last
            if last >= 0 and self.ops[last].module == self.scopes[-1] and in_this_call
            else last + 1
        )

    def unpack(self, packed: _Packed) -> torch.Tensor:
        handle, direct, rewrap = packed.key, packed.direct, packed.rewrap
        self.before_event()
        self.paused = True
        try:
            rec = self.saved[handle]
            if rec.node is None:
                rec.node = self.current_node
            if self.current_node is not None:
                self.unpacked_by[self.current_node].append(handle)
            if direct is not None:
                return direct
            base = torch.empty(rec.storage_numel, dtype=rec.dtype, device=rec.device)
            if rec.payload is not None:
                base.untyped_storage().copy_(rec.payload)
            stand_in = base.as_strided(rec.shape, rec.stride, rec.offset)
            cdata = storage_key(stand_in)
            self.storage_by_cdata[cdata] = rec.storage
            self.stand_in_refs.append(StorageWeakRef(stand_in.untyped_storage()))
            self.tensor_ids[stand_in] = rec.tensor
            return stand_in if rewrap is None else rewrap(stand_in)
        finally:
            self.paused = False

    # -- modules ---------------------------------------------------------------------------------
    def install_module_hooks(self, model: nn.Module) -> list[Any]:
        handles = []
        for path, module in model.named_modules():
            handles.append(module.register_forward_pre_hook(self._enter(path), with_kwargs=True))
            handles.append(
                module.register_forward_hook(self._exit(path), with_kwargs=True, always_call=True)
            )
        return handles

    def _tensor_ids(self, obj: Any) -> tuple[int, ...]:
        self.paused = True
        try:
            return tuple(
                self.tensor_id(t) for t in pytree.tree_leaves(obj) if isinstance(t, torch.Tensor)
            )
        finally:
            self.paused = False

    def _enter(self, path: str) -> Callable:
        def hook(module, args, kwargs):
            self.before_event()
            self.scopes.append(path)
            self.modules.append(
                _CallRecord(
                    path=path,
                    type=type(module).__name__,
                    first_op=len(self.ops),
                    last_op=len(self.ops) - 1,
                    inputs=self._tensor_ids((args, kwargs)),
                )
            )

        return hook

    def _exit(self, path: str) -> Callable:
        def hook(module, args, kwargs, output):
            if self.failed_in is None and sys.exc_info()[1] is not None:
                self.failed_in = path
            self.before_event()
            call = next(m for m in reversed(self.modules) if m.path == path and m.open)
            call.outputs = self._tensor_ids(output)
            call.last_op = len(self.ops) - 1
            call.open = False
            call.escaped = self.escaped(call.first_op, call.last_op, call.outputs)
            if self.scopes[-1] == path:
                self.scopes.pop()

        return hook

    def escaped(self, first_op: int, last_op: int, outputs: tuple[int, ...]) -> tuple[int, ...]:
        """The ops of a module call that just returned whose storages are still alive although no
        output reaches them: something outside the call (a cache, an attribute) holds them. Saves
        are not holders here: the pack hook keeps a description, not the tensor. Nor is autocast's
        cache of its low-precision copies of the parameters (a `_to_copy` of a parameter), which
        lives until the autocast region ends and which a recomputation makes afresh."""
        reached = {self.tensors[t].storage for t in outputs}
        reached |= {self.storage_by_cdata.get(storage_key(t)) for _, t, _ in self.pending_grad_fn}
        return tuple(
            sorted(
                {
                    self.storages[sid].allocated_at
                    for sid in self.live
                    if first_op <= self.storages[sid].allocated_at <= last_op
                    and sid not in reached
                    and not self.autocast_weight_copy(self.storages[sid].allocated_at)
                }
            )
        )

    def autocast_weight_copy(self, op_index: int) -> bool:
        op = self.ops[op_index]
        return op.target == "aten._to_copy.default" and all(
            self.storages[self.tensors[t].storage].kind == "param" for t in op.inputs
        )

    # -- result ----------------------------------------------------------------------------------
    def graph(self, info: dict[str, Any]) -> Graph:
        return Graph(
            ops=[op.freeze() for op in self.ops],
            tensors=self.tensors,
            storages={sid: s.freeze() for sid, s in self.storages.items()},
            saved=[r.freeze() for r in self.saved.values()],
            nodes={nid: n.freeze() for nid, n in self.nodes.items()},
            modules=[m.freeze() for m in self.modules],
            info=info,
        )


@contextlib.contextmanager
def unrecorded_sharding_propagation(tracer: Tracer) -> Iterator[None]:
    """DTensor infers an op's output shapes by running it on fake tensors at global shapes, once
    per op and shapes (cached): no rank runs those, so the tracer pauses through them."""
    try:
        from torch.distributed.tensor._sharding_prop import ShardingPropagator
    except ImportError:  # torch built without distributed: no DTensor to trace
        yield
        return
    infer = ShardingPropagator._propagate_tensor_meta_non_cached

    def paused(self: Any, op_schema: Any) -> Any:
        was, tracer.paused = tracer.paused, True
        try:
            return infer(self, op_schema)
        finally:
            tracer.paused = was

    ShardingPropagator._propagate_tensor_meta_non_cached = paused
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = infer


def _process_group_backend() -> str | None:
    """The default process group's backend ("gloo", "nccl", "fake"), None without one."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None
    return str(dist.get_backend())
