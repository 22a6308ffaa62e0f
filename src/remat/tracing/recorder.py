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
- Autograd run inside a custom Function's backward (reversible layers) is recorded as it runs: its
  nodes run as a nested graph task inside the Function's node (`enter_node`), its saves are held
  until autograd drops the packed save (`released`: after the node, or with a retained graph),
  its ops and nodes are named after the Function's. Nothing is written on autograd's objects that
  a later trace could read: node ids live under this trace's own metadata key.
"""

from __future__ import annotations

import functools
import itertools
import sys
import weakref
from collections import defaultdict
from collections.abc import Callable
from typing import Any

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
    Phase,
    StorageKind,
    Tensor,
)
from remat.tracing.calls import (
    argument_names,
    call_shape,
    output_path,
    output_tensors,
)
from remat.tracing.kernels import EXTRA_FLOPS, FAKE_KERNELS, with_real_loss_storage
from remat.tracing.records import (
    CallRecord,
    NodeRecord,
    OpRecord,
    SavedRecord,
    StorageRecord,
)
from remat.tracing.tensors import (
    accumulates_in_place,
    dtype_name,
    is_wrapper_op,
    local_tensor,
    rewrapper,
    storage_key,
    storage_nbytes,
    wrapped_tensors,
)

_WAIT_TENSOR = getattr(getattr(torch.ops, "_c10d_functional", None), "wait_tensor", None)
_WAIT_TENSOR = None if _WAIT_TENSOR is None else _WAIT_TENSOR.default

LOSS_SCOPE = "<loss>"
BACKWARD_SCOPE = "<backward>"
_DATA_DEPENDENT = (DataDependentOutputException, DynamicOutputShapeException)
_ADD, _ADD_IN_PLACE = torch.ops.aten.add.Tensor, torch.ops.aten.add_.Tensor


class _Packed:
    """What autograd holds for a save while tracing: the save's handles (one, or one per tensor
    a wrapper around several holds), the tensor itself for a parameter, a buffer or such a
    wrapper, and how to rewrap a stand-in. Autograd drops it when it frees the save, which
    tells the tracer when that is."""

    __slots__ = ("tracer", "handles", "direct", "rewrap")

    def __init__(self, tracer: Tracer, handles: tuple[int, ...], direct: Any, rewrap: Any) -> None:
        self.tracer, self.handles, self.direct, self.rewrap = tracer, handles, direct, rewrap

    def __del__(self) -> None:
        try:
            for handle in self.handles:
                self.tracer.released(handle)
        except Exception as e:  # Python would print and drop it: the next event raises it
            self.tracer.failure = self.tracer.failure or e


_TRACES = itertools.count()


class Tracer(TorchDispatchMode):
    def __init__(self, *, real: bool, target: Target = CPU):
        super().__init__()
        self.real = real
        #: False once the step is over: saves freed afterwards (with the graph) are not events
        self.recording = True
        #: a failure of bookkeeping where it cannot be raised (autograd freeing a save)
        self.failure: Exception | None = None
        self.target = target
        self.paused = False
        self.phase: Phase = "forward"
        self.scopes: list[str] = [""]
        self.ops: list[OpRecord] = []
        self.name_counts: dict[tuple[str, str], int] = defaultdict(int)
        # storages: id -> mutable record; address -> id; weak refs keep addresses unique
        self.storages: dict[int, StorageRecord] = {}
        self.storage_by_cdata: dict[int, int] = {}
        self.weakrefs: dict[int, StorageWeakRef] = {}
        self.live: dict[int, int] = {}  # storage id -> its weak reference's cdata
        self.stand_in_refs: list[StorageWeakRef] = []
        #: save handle -> the cdata of the stand-in its unpack handed to a node, until that dies
        self.handed: dict[int, int] = {}
        self.tensors: dict[int, Tensor] = {}
        self.tensor_ids: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.ids = itertools.count()
        # autograd nodes. A node carries its id in its metadata under a key of this trace only: a
        # node may outlive the trace (a persistent leaf's AccumulateGrad) and be seen by the next.
        # No reference to a node is kept: autograd frees a graph (and what it saved) as it would.
        self.nodes: dict[int, NodeRecord] = {}
        self.node_key = f"remat.node.{next(_TRACES)}"
        #: leaves the step accumulates gradients into that are not the traced parameters (a
        #: tensor attribute with requires_grad, an input, a leaf a custom Function's backward
        #: makes): id -> (the leaf, weakly: the trace must not keep it alive; its .grad before)
        self.outside_leaves: dict[int, tuple[weakref.ref, torch.Tensor | None]] = {}
        #: The backward nodes running, outermost first, with their graph task: a custom Function's
        #: backward that runs autograd itself (reversible layers) runs a nested graph task inside
        #: its node, which finishes only after the nested task's nodes.
        self.running: list[tuple[int, int]] = []
        self.pending_grad_fn: list[tuple[int, torch.Tensor, Any]] = []
        #: Outputs of forward ops run with grad off, weakly: a custom Function's forward runs so,
        #: and its outputs get the Function's node only when `apply` returns, after other ops of
        #: its forward (`save_for_backward(y.detach())`) replaced them in `pending_grad_fn`.
        self.pending_no_grad: list[tuple[int, weakref.ref]] = []
        #: After an op writes a view in place, autograd replays the view to give it its new
        #: grad_fn, through this mode on fake tensors (not on real ones): view ops on the written
        #: view's base (or on their own replayed views) from the same Python call are that
        #: replay, not the program's, and are not recorded. (base and replayed ids, call site)
        self.view_replay: tuple[set[int], tuple[int, int]] | None = None
        self.current_node: int | None = None
        #: The backward node whose post hook ran: until another runs, the engine's ops add its
        #: gradients into the next nodes' inputs (`accumulates_in_place`); the hooks' handles
        self.finished_node: int | None = None
        self.node_hooks: list[Any] = []
        self.saved: dict[int, SavedRecord] = {}
        self.unpacked_by: dict[int, list[int]] = defaultdict(list)
        self.modules: list[CallRecord] = []
        #: the modules a custom Function's backward called (reversible layers recompute theirs)
        self.rerun_in_backward: set[str] = set()
        #: storages of `torch.get_rng_state()` copies the step keeps (`record_rng_state`)
        self.rng_states: set[int] = set()
        #: the module calls that returned since the last op, and how many ops there were then
        self.returned: tuple[int, list[CallRecord]] = (0, [])
        self.param_names: dict[int, str] = {}
        #: op index -> its kernel's scratch, measured on this machine (`remat.device.kernel_scratch`)
        self.kernel_scratch: dict[int, int] = {}
        #: the innermost module whose call an exception left (its forward hook still runs)
        self.failed_in: str | None = None
        #: per open module call, the exception being handled when it began: a module called
        #: inside an `except` block returns normally with that exception still in sys.exc_info()
        self.handling: list[BaseException | None] = []
        #: the op an exception left on real tensors (fake tensors' failures are TraceErrors)
        self.failed_op: str | None = None
        #: Collectives run on gloo (a CPU process group), which allocates beyond their outputs.
        self.gloo = kernel_scratch.process_group_backend() == "gloo" and not target.is_cuda
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
        self.storages[sid] = StorageRecord(sid, storage_nbytes(t), kind, allocated_at)
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
        if self.failure is not None:
            raise self.failure
        last = len(self.ops) - 1
        self.resolve_grad_fns()
        if self.phase == "backward":
            node = torch._C._current_autograd_node()
            nid = None if node is None else self.node_id(node)
            if nid != self.current_node:
                self.enter_node(nid, torch._C._current_graph_task_id())
        expired = torch.UntypedStorage._expired  # StorageWeakRef.expired without its frame: hot
        for sid in [s for s, cdata in self.live.items() if expired(cdata)]:
            self.storages[sid].released_after = last
            del self.live[sid]
        for handle in [h for h, cdata in self.handed.items() if expired(cdata)]:
            self.saved[handle].unpacked_until = last
            del self.handed[handle]

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
        waiting = []
        for index, ref in self.pending_no_grad:
            t = ref()
            if t is None:
                continue
            grad_fn = self.read_grad_fn(t) if torch.is_grad_enabled() else None
            if grad_fn is None:
                waiting.append((index, ref))
            elif self.ops[index].node is None:
                self.ops[index].node = self.node_id(grad_fn, forward_op=index)
        self.pending_no_grad = waiting

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
        nid = meta.get(self.node_key)
        if nid is None:
            nid = next(self.ids)
            meta[self.node_key] = nid
            variable = getattr(node, "variable", None)  # AccumulateGrad: the leaf it writes
            if variable is not None and id(variable) not in self.param_names:
                self.outside_leaves.setdefault(id(variable), (weakref.ref(variable), variable.grad))
            self.nodes[nid] = NodeRecord(
                id=nid,
                name=node.name(),
                forward_op=forward_op,
                param=None if variable is None else self.param_names.get(id(variable)),
            )
            if variable is None:  # a post hook on AccumulateGrad would stop it stealing the grad
                self.node_hooks.append(node.register_hook(functools.partial(self._finished, nid)))
        return nid

    def _finished(self, nid: int, grad_inputs: Any, grad_outputs: Any) -> None:
        self.finished_node = nid

    def remove_node_hooks(self) -> None:
        for handle in self.node_hooks:
            handle.remove()
        self.node_hooks = []

    def enter_node(self, nid: int | None, task: int) -> None:
        """Autograd now runs node `nid` (None: no node) of graph task `task`. The node it ran
        before in the same task is done, and so is every node of a nested task it returns from;
        a task not running yet is nested in the node running now (a custom Function's backward
        that calls `torch.autograd.backward`), which goes on running."""
        tasks = [t for t, _ in self.running]
        if nid is None or task in tasks:
            while self.running and (nid is None or self.running[-1][0] != task):
                self.finish_node(self.running.pop()[1])
            if self.running and self.running[-1][1] != nid:
                self.finish_node(self.running.pop()[1])
        if nid is not None and (not self.running or self.running[-1][1] != nid):
            self.running.append((task, nid))
        self.current_node = nid

    def finish_node(self, nid: int) -> None:
        """Backward node `nid` is done: autograd releases what it saved (unless the backward
        retains the graph: then `released` says when)."""
        node = self.nodes[nid]
        node.released_after = max(node.released_after or -1, len(self.ops) - 1)
        for handle in self.unpacked_by.pop(nid, []):
            self.saved[handle].payload = None

    def released(self, handle: int) -> None:
        """Autograd dropped save `handle`: after its node ran, or, where a backward retained the
        graph (`backward(retain_graph=True)`, as Reformer's reversible layers call it), when the
        graph itself is freed. Its node holds its saves until then."""
        if not self.recording:
            return
        rec = self.saved[handle]
        rec.payload = None
        if rec.node is None:  # no node read it: it died with its node, unrun, or unread
            rec.released_after = len(self.ops) - 1
        node = self.nodes.get(rec.node) if rec.node is not None else None
        if node is not None and node.released_after is not None:
            node.released_after = max(node.released_after, len(self.ops) - 1)

    def finish_backward(self) -> None:
        """The backward is over: every node still running is done."""
        self.enter_node(None, -1)

    def scope(self) -> tuple[str, str]:
        """(module path, name prefix) of the op about to be recorded."""
        if self.phase == "forward":
            path = self.scopes[-1]
            return path, path
        # A node made in backward (by autograd run inside a custom Function's backward) has no
        # forward op: its ops are named after the node running it, the Function's.
        for _, nid in reversed(self.running):
            node = self.nodes[nid]
            if node.param is not None:
                return node.param.rpartition(".")[0], f"{node.param}:grad"
            if node.forward_op is not None:
                fwd = self.ops[node.forward_op]
                return fwd.module, fwd.name + ":bwd"
        return BACKWARD_SCOPE, BACKWARD_SCOPE

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
        try:
            self.before_event()
        except Exception as e:
            raise self.internal_error(e, str(func)) from e
        if (
            func is _ADD
            and self.finished_node is not None
            and self.finished_node == self.current_node
            and not kwargs
            and len(args) == 2
            and accumulates_in_place(*args)
        ):
            func = _ADD_IN_PLACE  # as the engine adds, run without this mode
        try:
            out = self.run_op(func, args, kwargs)
        except TraceError:
            raise
        except Exception as e:
            if self.real:
                self.failed_op = str(func)  # trace.py says the step is not trainable as written
                raise
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
        try:
            self.record(func, args, kwargs, out, call_site)
        except Exception as e:
            raise self.internal_error(e, str(func)) from e
        return out

    def internal_error(self, error: Exception, op: str | None) -> TraceError:
        """A failure of the recorder's own bookkeeping (not of the model, nor of an op on fake
        tensors) as a `TraceError` naming the module and op. On fake tensors it is marked
        `fake_tensor_failure`, so that `remat.auto` still tries the real CPU tensors, its
        documented fallback, rather than stopping on remat's own bug."""
        if isinstance(error, TraceError):
            return error
        try:
            module = self.scope()[0] if op else self.ops[-1].module
        except Exception:  # the records are what failed: the module of the last op recorded
            module = self.ops[-1].module if self.ops else self.scopes[-1]
        module = module or "<root>"
        where = f"op {op}" if op else "the step's graph"
        first_line = (str(error).strip().splitlines() or [""])[0].rstrip(".")
        instead = (
            ""
            if self.real
            else " Trace on real tensors instead: remat.trace(..., device='cpu') or "
            "remat.auto(..., trace_device='cpu')."
        )
        return TraceError(
            f"remat's tracer failed recording {where} in module '{module}' during the "
            f"{self.phase} ({type(error).__name__}: {first_line}). This is a bug in remat: "
            f"please report it with the model.{instead}",
            op=op,
            module=module,
            fake_tensor_failure=not self.real,
        )

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
        self.finished_node = None  # the engine adds DTensor gradients out of place
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
            out = func(*args, **kwargs)
            return out if self.real else with_real_loss_storage(packet, args, kwargs, out)
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
            OpRecord(
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
            if torch.is_grad_enabled():
                self.pending_no_grad = []  # the Function (if any) has returned: none to come
            else:
                self.pending_no_grad += [(index, weakref.ref(h)) for h in holders]

    # -- saved tensor hooks ----------------------------------------------------------------------
    def pack(self, t: torch.Tensor) -> Any:
        try:
            return self._pack(t)
        except Exception as e:
            raise self.internal_error(e, self.last_op()) from e

    def unpack(self, packed: _Packed) -> torch.Tensor:
        try:
            return self._unpack(packed)
        except Exception as e:
            raise self.internal_error(e, self.last_op()) from e

    def last_op(self) -> str | None:
        return self.ops[-1].target if self.ops else None

    def _pack(self, t: torch.Tensor) -> Any:
        self.before_event()
        self.paused = True
        try:
            parts = wrapped_tensors(t)
            if parts:  # torchao's float8 tensor: its data and its scale saved, itself kept
                return _Packed(self, tuple(self._save(p, payload=False)[0] for p in parts), t, None)
            # A DTensor (tensor parallelism) is described by its local shard, this rank's bytes,
            # and rebuilt around the shard's stand-in in unpack, autograd wanting a DTensor back.
            handle, persistent = self._save(local_tensor(t), payload=True)
            if persistent:
                return _Packed(self, (handle,), t, None)
            return _Packed(self, (handle,), None, rewrapper(t))
        finally:
            self.paused = False

    def _save(self, inner: torch.Tensor, payload: bool) -> tuple[int, bool]:
        """A record of the save of `inner`: its handle, and whether its storage outlives the
        step (a parameter's, a buffer's). `payload`: on a real run, keep a copy of an
        activation's bytes for its stand-in."""
        tid = self.tensor_id(inner)
        sid = self.tensors[tid].storage
        handle = next(self.ids)
        persistent = self.storages[sid].kind not in ("activation", "grad")
        forward = self.phase == "forward"
        self.saved[handle] = SavedRecord(
            storage=sid,
            tensor=tid,
            shape=tuple(inner.shape),
            stride=tuple(inner.stride()),
            offset=int(inner.storage_offset()),
            dtype=inner.dtype,
            device=inner.device,
            storage_numel=storage_nbytes(inner) // inner.element_size(),
            payload=inner.untyped_storage().clone()
            if payload and self.real and not persistent
            else None,
            phase=self.phase,
            forward_op=self.saving_op() if forward else None,
            packed_after=len(self.ops) - 1 if forward else None,
        )
        return handle, persistent

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

    def _unpack(self, packed: _Packed) -> torch.Tensor:
        direct, rewrap = packed.direct, packed.rewrap
        self.before_event()
        self.paused = True
        try:
            for handle in packed.handles:
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
            # The node keeps the unpacked tensor in a local of its backward function, which dies
            # when it returns, before the engine reduces its gradients to their inputs' shapes
            # (`sum_to`) and before it releases the node: what a checkpoint replay re-made lives
            # until then (`Saved.unpacked_until`).
            self.handed[handle] = cdata
            self.stand_in_refs.append(StorageWeakRef(stand_in.untyped_storage()))
            self.tensor_ids[stand_in] = rec.tensor
            return stand_in if rewrap is None else rewrap(stand_in)
        finally:
            self.paused = False

    # -- modules ---------------------------------------------------------------------------------
    def install_module_hooks(self, model: nn.Module) -> list[Any]:
        handles = []
        for path, module in model.named_modules():
            enter, exit_ = self._guarded(self._enter(path)), self._guarded(self._exit(path))
            handles.append(module.register_forward_pre_hook(enter, with_kwargs=True))
            handles.append(module.register_forward_hook(exit_, with_kwargs=True, always_call=True))
        return handles

    def _guarded(self, hook: Callable) -> Callable:
        def guarded(*args: Any) -> Any:
            try:
                return hook(*args)
            except Exception as e:
                raise self.internal_error(e, self.last_op()) from e

        return guarded

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
            self.handling.append(sys.exc_info()[1])
            self.before_event()
            if self.phase == "backward":
                # a custom Function's backward runs the module again (reversible layers): not a
                # call of the forward, and no region can hold it (`Graph.rerun_in_backward`)
                self.rerun_in_backward.add(path)
                return
            self.scopes.append(path)
            shape = call_shape((args, kwargs))
            at, returned = self.returned
            self.modules.append(
                CallRecord(
                    path=path,
                    type=type(module).__name__,
                    first_op=len(self.ops),
                    last_op=len(self.ops) - 1,
                    inputs=self._tensor_ids((args, kwargs)),
                    arguments=argument_names(args, kwargs),
                    shape_in=shape,
                    previous=[c for c in returned if c.shape_in == shape]
                    if at == len(self.ops)
                    else [],
                )
            )

        return hook

    def _exit(self, path: str) -> Callable:
        def hook(module, args, kwargs, output):
            handled_at_entry = self.handling.pop() if self.handling else None
            leaving = sys.exc_info()[1]
            if self.failed_in is None and leaving is not None and leaving is not handled_at_entry:
                self.failed_in = path
            self.before_event()
            if self.phase == "backward":
                return
            call = next(m for m in reversed(self.modules) if m.path == path and m.open)
            call.outputs = self._tensor_ids(output_tensors(output))
            call.last_op = len(self.ops) - 1
            call.open = False
            call.output_path = output_path(output)
            call.shape_out = call_shape(output)
            call.repeats = tuple(c.path for c in call.previous if c.shape_out == call.shape_out)
            call.previous = []
            at, returned = self.returned
            self.returned = (len(self.ops), [*returned, call] if at == len(self.ops) else [call])
            call.escaped = self.escaped(call.first_op, call.last_op, call.outputs)
            if self.scopes[-1] == path:
                self.scopes.pop()

        return hook

    def record_rng_state(self, state: torch.Tensor) -> None:
        """The step copied the CPU generator's state (`torch.utils.checkpoint` keeps one per
        call to replay it, reentrant or not): memory no op makes, counted from the op before
        (the first op, before any). A holder of it is not state a recomputation writes again."""
        if self.paused:
            return
        self.before_event()
        at = max(len(self.ops) - 1, 0)
        self.rng_states.add(self.storage_id(state, "activation", allocated_at=at))

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
                    and sid not in self.rng_states
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
