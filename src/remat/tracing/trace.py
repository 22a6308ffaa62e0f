"""Run one training step under a recorder and turn it into a `Graph`: `trace`, the entry point, runs
the step on fake (or real) tensors under the recorder (`remat.tracing.recorder.Tracer`), at both
extremes of random draws that decide its ops (`remat.tracing.draws`), an FSDP2 model as the bare
model it shards (`remat.tracing.fsdp`). A step that fails on fake tensors is a `TraceError` naming
module, op and the model's line, so that the caller can trace on the real CPU tensors instead, which
`fits_in_memory_for_real_trace` says is safe or not. The step's loss is `default_loss` unless the
caller gives one: the model's own where it returns one (`is_own_loss`), else the outputs' sum.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils import _pytree as pytree

from remat.device import emulate
from remat.device.targets import Target, get_target
from remat.errors import TraceError, warn
from remat.graph import Graph
from remat.tracing import hfcompat
from remat.tracing.caches import CachesOff
from remat.tracing.depth import trace_by_depth
from remat.tracing.draws import Draws, ForcedDraws
from remat.tracing.recorder import LOSS_SCOPE, Tracer
from remat.tracing.tensors import dtype_name, local_tensor, storage_key


@contextlib.contextmanager
def _no_op_module_casts() -> Iterator[None]:
    """Within a fake trace, `module.to(...)` to the dtype and device its tensors already have
    returns the module, as on real tensors. Some routers cast themselves in every forward
    (`self.classifier = self.classifier.to(self.dtype)`); on fake tensors torch swaps each
    parameter for its "converted" self, which fails while the trace holds it."""
    original = nn.Module.to

    def to(module: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        tensors = [*module.parameters(), *module.buffers()]
        same_device = device is None or all(
            t.device.type == torch.device(device).type for t in tensors
        )
        same_dtype = dtype is None or all(
            t.dtype == dtype for t in tensors if t.is_floating_point() or t.is_complex()
        )
        if same_device and same_dtype and memory_format is None:
            return module
        return original(module, *args, **kwargs)

    nn.Module.to = to  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.to = original  # type: ignore[method-assign]


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


@contextlib.contextmanager
def _rng_states_recorded(tracer: Tracer, on_cpu: bool) -> Iterator[None]:
    """`torch.get_rng_state()` during the step, as the tracer's record (`record_rng_state`); on a
    CUDA step the CPU generator's state lives on the host, not on the device: not recorded."""
    if not on_cpu:
        yield
        return
    original = torch.get_rng_state

    def get_rng_state() -> torch.Tensor:
        state = original()
        tracer.record_rng_state(state)
        return state

    torch.get_rng_state = get_rng_state
    try:
        yield
    finally:
        torch.get_rng_state = original


def _step_failure(tracer: Tracer, error: Exception) -> TraceError:
    """What a failure of the traced step means. On fake tensors, unless autograd itself refused
    (`_AUTOGRAD_REFUSALS`, which real tensors raise too): a limit of fake tensors, so that `auto`
    can trace on the real CPU tensors (`_fake_step_failure`). On real tensors, or where autograd
    refused: the step is not trainable as written, and no other trace would help."""
    if not tracer.real and not any(r in str(error) for r in _AUTOGRAD_REFUSALS):
        return _fake_step_failure(tracer, error)
    module, where, after, first_line = _failure_site(tracer, error)
    op = tracer.failed_op
    advice = next((a for r, a in _AUTOGRAD_REFUSALS.items() if r in str(error) and a), "")
    return TraceError(
        f"the step fails in module '{module}'{where}"
        + (f", in op {op}" if op else f", {after}")
        + f" ({type(error).__name__}: {first_line}), and real tensors raise this too: the "
        "model's forward (or its backward) is not trainable as written; fix the model there"
        + (f" ({advice})" if advice else ""),
        op=op,
        module=module,
    )


#: autograd's own refusals (raised before any kernel, so fake and real tensors alike) and the fix
_AUTOGRAD_REFUSALS = {
    "a leaf Variable that requires grad is being used in an in-place operation": "change a "
    "parameter under `with torch.no_grad():`, or compute a new tensor instead (`w = self.w + 1`)",
    "a view of a leaf Variable that requires grad is being used in an in-place operation": "change "
    "a parameter under `with torch.no_grad():`, or compute a new tensor instead",
    "has been modified by an inplace operation": "an in-place op overwrote a tensor the backward "
    "needs: use its out-of-place form (`x = x.relu()`, not `x.relu_()`)",
    "is a view and is being modified inplace": "clone the view before changing it in place",
    "does not require grad and does not have a grad_fn": "the loss does not depend on a "
    "parameter that requires grad",
    "Trying to backward through the graph a second time": "",
}


def _failure_site(tracer: Tracer, error: Exception) -> tuple[str, str, str, str]:
    """(module, ` at file:line `code``, what ran before, the error's first line) of a failure."""
    module = tracer.failed_in if tracer.failed_in is not None else tracer.scopes[-1]
    module = module or "<root>"
    last_op = tracer.ops[-1].target if tracer.ops else None
    frames = traceback.extract_tb(error.__traceback__)
    own = [f for f in frames if not _is_library_file(f.filename)]
    where = ""
    if own:
        frame = own[-1]
        where = f" at {frame.filename}:{frame.lineno} `{(frame.line or '').strip()}`"
    first_line = (str(error).strip().splitlines() or [""])[0].rstrip(".")
    after = f"after op {last_op}" if last_op else "before its first op"
    return module, where, after, first_line


def _fake_step_failure(tracer: Tracer, error: Exception) -> TraceError:
    """A failure of the step on fake tensors outside any op (a module cast or moved in forward, a
    Python check on a tensor): a TraceError naming the module, the last op traced before it and
    the line of the model's code that raised, so that `auto` can trace on real tensors."""
    module, where, after, first_line = _failure_site(tracer, error)
    last_op = tracer.ops[-1].target if tracer.ops else None
    return TraceError(
        f"the step fails on fake tensors in module '{module}'{where}, {after} "
        f"({type(error).__name__}: {first_line}). Trace on real tensors at a size that fits in "
        "memory instead: remat.trace(..., device='cpu') or remat.auto(..., trace_device='cpu') "
        "(CLI: --trace-device cpu, with a smaller --batch/--seq).",
        op=last_op,
        module=module,
        fake_tensor_failure=True,
    )


def _raised_by_remat(error: Exception) -> bool:
    """Whether remat's own code raised `error` (the innermost frame of its traceback is in
    remat's package), not the model, an op or torch: a bug of the tracer, not of the step."""
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and frames[-1].filename.startswith(_REMAT_DIR)


_REMAT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _is_library_file(filename: str) -> bool:
    """torch's and remat's own files: not where a model's failing line is."""
    return filename.startswith(_LIBRARY_DIRS)


_LIBRARY_DIRS = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(__file__) + os.sep)


def default_loss(output: Any) -> torch.Tensor:
    """The model's own loss when it returns one (a 0-dim float tensor that requires grad, as the
    presets given labels and Hugging Face models given `labels` do: the step then is the trainer's
    step, cross-entropy and all); otherwise the sum of every floating-point output that requires
    grad: a loss whose gradient reaches every output, so the backward is the model's whole backward."""
    if is_own_loss(output):
        return output
    leaves = [
        t
        for t in pytree.tree_leaves(output)
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad
    ]
    if not leaves:
        raise TraceError(
            "no output of the model requires grad, so there is no backward to trace: the model has "
            "no trainable parameter reaching its outputs (check requires_grad, or that forward does "
            "not run under torch.no_grad()), and no input requires grad."
        )
    total = leaves[0].sum()
    for t in leaves[1:]:
        total = total + t.sum()
    return total


def is_own_loss(output: Any) -> bool:
    """Whether the model returned its loss: one 0-dim floating-point tensor that requires grad."""
    return (
        isinstance(output, torch.Tensor)
        and output.dim() == 0
        and output.is_floating_point()
        and output.requires_grad
    )


def _fake_like(t: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    """A fake tensor of `t`'s layout; meta tensors become fake CPU tensors so that factory calls in
    forward (which default to CPU) and traced tensors live on one device. A DTensor (tensor or
    sequence parallelism, `parallelize_module`) stays a DTensor on its mesh, over a fake local
    shard: the trace then records this rank's local ops and its collectives."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        local = _fake_like(t.to_local(), False)
        shard = DTensor.from_local(
            local, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride()
        )
        return shard.requires_grad_(requires_grad)
    device = "cpu" if t.device.type == "meta" else t.device
    out = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device=device)
    return out.requires_grad_(requires_grad)


def trace(
    fn: nn.Module | Callable[..., Any],
    *args: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    device: str = "meta",
    autocast: torch.dtype | None = None,
    target: Target | str | None = None,
    replicate_depth: bool = False,
    **kwargs: Any,
) -> Graph:
    """Trace one training step of `fn(*args, **kwargs)`: forward, `loss_fn(output)` (default: the sum
    of the outputs), backward. `device="meta"` (default) runs on fake tensors and allocates nothing
    of the model's size; `device="cpu"` (or "cuda") runs on the real tensors, which must be there.

    `autocast=torch.bfloat16` runs the forward and the loss under `torch.autocast` (mixed
    precision: fp32 parameters, bf16 compute, as `bf16-mixed` training does).

    `target`: the device the step is predicted for (`remat.device.targets`): "cpu" (default: the CPU's
    kernels and autocast lists, exact on this machine), "cuda" (an sm90 GPU), "cuda:sm80" or a
    `Target`: a fake trace then runs the CUDA kernels' choices (fused dropout and RMSNorm, fp32
    normalisation statistics, the SDPA backend of that GPU, CUDA autocast's op lists) and its
    graph's scratch is priced with CUDA's kernels (`graph.info["target"]`).

    `replicate_depth=True` (fake traces of a module): trace a few of the model's repeated blocks
    and lay out the graph of its full depth from them, equal to the full trace's
    (`remat.tracing.depth`); `graph.info["depth"]` says how it was traced, and why in full."""
    real = device != "meta"
    target = get_target(target)
    if target.is_cuda and real:
        raise TraceError(
            f"target {target.describe()!r} is traced on fake tensors (device='meta'): the CUDA "
            f"kernels' choices are emulated on fake CPU tensors, not run on real {device} ones"
        )
    _refuse_ambient_autocast(autocast)
    module = fn if isinstance(fn, nn.Module) else None
    if module is not None:
        _check_call(module, args, kwargs)
    inputs_need_grad = any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in pytree.tree_leaves((args, kwargs))
    )
    if (
        module is not None
        and not inputs_need_grad
        and not any(p.requires_grad for p in module.parameters())
    ):
        raise TraceError(
            f"model {type(module).__name__} has no trainable parameter and no input requires "
            "grad: there is nothing to train. Set requires_grad=True on the parameters to train."
        )
    params = dict(module.named_parameters()) if module is not None else {}
    buffers = dict(module.named_buffers()) if module is not None else {}
    if real:
        metas = [n for n, t in {**params, **buffers}.items() if t.device.type == "meta"] + [
            "input"
            for t in pytree.tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor) and t.device.type == "meta"
        ]
        if metas:
            raise TraceError(
                f"trace(device='{device}') needs real tensors, but {metas[0]!r} is on the meta "
                "device. Build the model with device='cpu' (remat.models.build(..., device='cpu')), "
                "or trace with device='meta'."
            )

    bare = contextlib.nullcontext()
    if module is not None and not real:
        from remat.tracing.fsdp import fsdp_sharded_as_bare, is_fsdp_sharded

        if is_fsdp_sharded(module):  # FSDP's hooks on fake tensors would corrupt its buffers
            bare = fsdp_sharded_as_bare(module)
    with bare:

        def run() -> Graph:
            return _trace_draws(fn, module, args, kwargs, loss_fn, device, autocast, target)

        if replicate_depth and module is not None and not real:
            return trace_by_depth(module, run)
        return run()


def _check_call(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
    """A call the model's forward cannot take (no example inputs, a misspelt keyword) is refused
    here, naming the signature, not reported as a failure inside the step."""
    try:
        signature = inspect.signature(module.forward)
    except (TypeError, ValueError):  # a builtin or C++ forward: the call itself will say
        return
    try:
        signature.bind(*args, **kwargs)
    except TypeError as err:
        given = f"{len(args)} positional input(s)" + (
            f" and keyword(s) {', '.join(kwargs)}" if kwargs else ""
        )
        raise TraceError(
            f"{type(module).__name__}.forward{signature} cannot take the example inputs given "
            f"({given}): {err}. Pass one batch as the model takes it: remat.trace(model, *inputs, "
            "**kwargs), remat.auto(model, *inputs, budget=..., **kwargs)"
        ) from None


def _trace_draws(
    fn: nn.Module | Callable[..., Any],
    module: nn.Module | None,
    args: tuple,
    kwargs: dict[str, Any],
    loss_fn: Callable[[Any], torch.Tensor] | None,
    device: str,
    autocast: torch.dtype | None,
    target: Target,
) -> Graph:
    """The step traced with random draws at their low extreme; where a draw reached Python
    (LayerDrop) at the high one too, and planned for the longer step (`remat.tracing.draws`)."""
    traced: dict[str, Graph | TraceError] = {}
    for draws in ("low", "high"):
        try:
            traced[draws] = _trace_once(
                fn, module, args, kwargs, loss_fn, device, autocast, target, draws
            )
        except TraceError as err:
            if not err.random_reads:
                raise  # not about random draws
            traced[draws] = err  # e.g. every layer skipped: nothing left to train
        first = traced["low"]
        reads = first.random_reads if isinstance(first, TraceError) else first.info["random_reads"]
        if not reads:
            return first  # type: ignore[return-value]
    low, high = (g if isinstance(g, Graph) else None for g in traced.values())
    if low is None and high is None:
        raise traced["low"]  # type: ignore[misc]
    if (
        low is not None
        and high is not None
        and [o.name for o in low.ops] == [o.name for o in high.ops]
    ):
        return low  # draws that decide nothing (LayerDrop at 0)
    graph = max(
        (g for g in (low, high) if g is not None),
        key=lambda g: (len(g.forward_ops), g.activation_bytes),
    )
    counts = {k: len(g.forward_ops) if isinstance(g, Graph) else 0 for k, g in traced.items()}
    where, what = reads[0]
    warn(
        f"remat: the step's ops depend on random draws ({what} in module '{where or '<root>'}', "
        f"{len(reads)} draw(s): LayerDrop or random depth); traced at both extremes of the draws "
        f"({counts['low']} and {counts['high']} forward ops) and planned for the longer step, so "
        "the plan holds for every draw; regions hold one block each (a run of blocks cannot "
        "skip one)"
    )
    graph.info["random_control"] = {
        "draws": "low" if graph is low else "high",
        "forward_ops": counts,
    }
    return graph


def _refuse_ambient_autocast(autocast: torch.dtype | None) -> None:
    """A trace inside `torch.autocast(...)` would run its own mixed precision (`autocast`) and the
    caller's on top: on a CPU step called so, `remat.auto` refused every budget below store-all's
    by 8%. The step's precision is an argument instead."""
    for device in ("cpu", "cuda"):
        if torch.is_autocast_enabled(device):
            dtype = torch.get_autocast_dtype(device)
            raise TraceError(
                f"remat traces the step inside torch.autocast({device!r}, dtype={dtype}): call it "
                f"outside the autocast context and pass autocast={dtype} (remat.auto(model, ..., "
                f"autocast={dtype}); CLI: --precision bf16-mixed), which runs the traced step's "
                "forward and loss under autocast as training does"
                + (f" (the one given now: {autocast})" if autocast is not None else "")
            )


def _every_slot(
    module: nn.Module, originals: dict[str, torch.Tensor], state: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """`state` (stand-ins of `originals`, the parameters and buffers by name) for every place the
    module holds one of those tensors, each once: a tied weight in each module that holds it, a
    shared block under its first name alone. torch's own `tie_weights=True` also swaps a shared
    block's tensors under each of its names, and restores the first swap's stand-in under the
    second: the caller's model was left with fake parameters."""
    new = {id(originals[n]): t for n, t in state.items()}
    out = {}
    for prefix, m in module.named_modules():
        for attr, t in [*m._parameters.items(), *m._buffers.items()]:
            if t is not None and id(t) in new:
                out[f"{prefix}.{attr}" if prefix else attr] = new[id(t)]
    return out


def _trace_once(
    fn: nn.Module | Callable[..., Any],
    module: nn.Module | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    loss_fn: Callable[[Any], torch.Tensor] | None,
    device: str,
    autocast: torch.dtype | None,
    target: Target,
    draws: Draws,
) -> Graph:
    """One trace of the step, reads of random draws answered with their `draws` extreme."""
    real = device != "meta"
    params = dict(module.named_parameters()) if module is not None else {}
    buffers = dict(module.named_buffers()) if module is not None else {}
    tracer = Tracer(real=real, target=target)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True) if not real else None
    # A real trace runs dropout & co. for real: restore the caller's CPU (and CUDA) random streams.
    rng = contextlib.nullcontext()
    if real:
        on_cuda = [
            t.device
            for t in [*params.values(), *buffers.values(), *pytree.tree_leaves((args, kwargs))]
            if isinstance(t, torch.Tensor) and t.device.type == "cuda"
        ]
        cuda_devices = sorted(
            {d.index if d.index is not None else torch.cuda.current_device() for d in on_cuda}
        )
        rng = torch.random.fork_rng(devices=cuda_devices)
    as_real = hfcompat.as_real_run(kwargs) if not real else contextlib.nullcontext()
    casts = _no_op_module_casts() if not real else contextlib.nullcontext()
    dispatch = emulate.installed(target, autocast, "cuda" if device.startswith("cuda") else "cpu")
    with (
        rng,
        as_real,
        casts,
        dispatch as target_dispatch,
        fake_mode if fake_mode is not None else contextlib.nullcontext(),
    ):
        if real:
            leaves = {n: p.detach().requires_grad_(p.requires_grad) for n, p in params.items()}
            state = {**leaves, **{n: b.clone() for n, b in buffers.items()}}
            call_args, call_kwargs = args, kwargs
        else:
            leaves = {n: _fake_like(p, p.requires_grad) for n, p in params.items()}
            state = {**leaves, **{n: _fake_like(b, False) for n, b in buffers.items()}}
            call_args, call_kwargs = pytree.tree_map_only(
                torch.Tensor, lambda t: _fake_like(t, t.requires_grad), (args, kwargs)
            )
        for n, t in state.items():
            tracer.tensor_id(t, "param" if n in params else "buffer")
        tracer.param_names = {id(t): n for n, t in leaves.items()}
        for t, traced in zip(
            pytree.tree_leaves((args, kwargs)),
            pytree.tree_leaves((call_args, call_kwargs)),
            strict=True,
        ):
            if isinstance(t, torch.Tensor):
                tracer.tensor_id(traced, "input")
                # the caller's tensor read from elsewhere (a loss function's target that is the
                # input itself, as an autoencoder's) is the input's storage, not a constant
                tracer.storage_by_cdata.setdefault(
                    storage_key(local_tensor(t)), tracer.storage_id(traced, "input")
                )
        hook_handles = tracer.install_module_hooks(module) if module is not None else []
        caches_off = CachesOff(module) if module is not None else None
        restored = _outside_grads_restored(tracer, (args, kwargs, call_args, call_kwargs))
        try:
            forced = ForcedDraws(draws, scope=lambda: tracer.scopes[-1])
            # The traced state stays the module's through the backward too: a custom Function's
            # backward that runs the module again (reversible layers) must use the traced
            # parameters and accumulate their gradients, not the caller's.
            with (
                restored,
                _reparametrize_module(module, _every_slot(module, {**params, **buffers}, state))
                if module is not None
                else contextlib.nullcontext(),
                tracer,
                _rng_states_recorded(tracer, not target.is_cuda and not device.startswith("cuda")),
                unrecorded_sharding_propagation(tracer),
                forced,
                torch.autograd.graph.saved_tensors_hooks(tracer.pack, tracer.unpack),
            ):
                with target_dispatch.autocast():
                    if module is not None:
                        output = module(*call_args, **call_kwargs)
                    else:
                        output = fn(*call_args, **call_kwargs)
                    tracer.before_event()
                    tracer.scopes.append(LOSS_SCOPE)
                    loss = loss_fn(output) if loss_fn is not None else default_loss(output)
                    own_loss = "model" if is_own_loss(output) else "sum"
                    tracer.scopes.pop()
                # the last forward op's outputs are attributed now; holding them longer would keep
                # alive what the program dropped (cross-entropy's total_weight, say)
                tracer.resolve_grad_fns()
                tracer.pending_grad_fn = []
                tracer.before_event()
                tracer.phase = "backward"
                loss.backward()
                tracer.before_event()
                tracer.finish_backward()
                tracer.recording = False
                tracer.before_event()  # raises what failed while the last saves were freed
        except TraceError as err:
            err.random_reads = forced.reads
            raise
        except Exception as e:
            if _raised_by_remat(e):
                error = tracer.internal_error(e, tracer.last_op())
            else:
                error = _step_failure(tracer, e)
            error.random_reads = forced.reads
            raise error from e
        finally:
            tracer.remove_node_hooks()
            for h in hook_handles:
                h.remove()
            if caches_off is not None:
                caches_off.remove()
        try:
            grad_leaves = list(leaves.values()) + [
                t
                for t in pytree.tree_leaves((call_args, call_kwargs))
                if isinstance(t, torch.Tensor) and t.requires_grad
            ]
            for leaf in grad_leaves:
                if leaf.grad is not None:
                    tracer.storages[tracer.storage_id(leaf.grad, "grad")].kind = "grad"
            # what a pipeline stage sends on (its output) and back (its inputs' gradients)
            output_storages = sorted(
                {
                    tracer.storage_by_cdata[key]
                    for t in pytree.tree_leaves(output)
                    if isinstance(t, torch.Tensor)
                    and (key := storage_key(local_tensor(t))) in tracer.storage_by_cdata
                }
            )
            input_grad_storages = sorted(
                {
                    tracer.storage_id(t.grad, "grad")
                    for t in pytree.tree_leaves((call_args, call_kwargs))
                    if isinstance(t, torch.Tensor) and t.grad is not None
                }
            )
            info = {
                "trace_device": device,
                "param_count": sum(local_tensor(p).numel() for p in params.values()),
                "trainable_param_bytes": sum(
                    tracer.storages[tracer.tensors[tracer.tensor_id(t)].storage].nbytes
                    for t in {id(t): t for t in leaves.values() if t.requires_grad}.values()
                ),
                "loss": "custom" if loss_fn is not None else own_loss,
                "autocast": None if autocast is None else dtype_name(autocast),
                "target": target.name,
                "target_detail": target.describe(),
                **(
                    {
                        "cuda_multiprocessors": target.multiprocessors,
                        "cuda_threads_per_multiprocessor": target.threads_per_multiprocessor,
                    }
                    if target.is_cuda
                    else {}
                ),
                "random_reads": forced.reads,
                "kernel_scratch": {str(i): n for i, n in tracer.kernel_scratch.items()},
                "output_storages": output_storages,
                "rerun_in_backward": sorted(tracer.rerun_in_backward),
                "input_grad_storages": input_grad_storages,
            }
            graph = tracer.graph(info)
        except Exception as e:
            raise tracer.internal_error(e, None) from e
        del output, loss
    return graph


@contextlib.contextmanager
def _outside_grads_restored(tracer: Tracer, inputs: Any) -> Iterator[None]:
    """The trace leaves the caller's tensors as they were: a leaf of the model that is not a
    parameter (a tensor attribute with requires_grad) gets back the `.grad` it had before the
    traced backward wrote into it. The step's own inputs keep theirs, as a training step would."""
    try:
        yield
    finally:
        own = {id(t) for t in pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor)}
        for key, (ref, grad) in tracer.outside_leaves.items():
            leaf = ref()
            if leaf is not None and key not in own:
                leaf.grad = grad


def fits_in_memory_for_real_trace(
    module: nn.Module | Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[bool, str]:
    """Whether tracing this step on the real CPU tensors (`trace(..., device="cpu")`) is safe: every
    parameter, buffer and input tensor is real and on the CPU, and a rough bound of the step
    (4 x parameter and buffer bytes for weights, gradients and saved activations of their size,
    plus 8 x input bytes) is under half of the memory available now. Returns (verdict, reason);
    the reason reads after "tracing on real CPU tensors instead: ..." or says why not."""
    import os

    from torch._subclasses.fake_tensor import is_fake

    named: list[tuple[str, torch.Tensor]] = []
    if isinstance(module, nn.Module):
        named += list(module.named_parameters()) + list(module.named_buffers())
    state_names = len(named)
    named += [
        ("input", t) for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
    ]
    for i, (name, t) in enumerate(named):
        what = f"parameter/buffer '{name}'" if i < state_names else "an input tensor"
        if t.device.type == "meta" or is_fake(t):
            return False, f"{what} is on the meta device (or fake), not real"
        if t.device.type != "cpu":
            return False, f"{what} is on {t.device}, not on the CPU"

    def nbytes(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    state_bytes = sum(nbytes(t) for _, t in named[:state_names])
    input_bytes = sum(nbytes(t) for _, t in named[state_names:])
    need = 4 * state_bytes + 8 * input_bytes

    available, source = None, "MemAvailable"
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError):
        pass
    if available is None:
        source = "physical memory"
        try:
            available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (AttributeError, OSError, ValueError):
            return False, "cannot tell how much memory is available"

    mib = 2**20
    sizes = (
        f"the step needs about {need / mib:.1f} MiB (4 x {state_bytes / mib:.1f} MiB of parameters "
        f"and buffers + 8 x {input_bytes / mib:.1f} MiB of inputs), "
    )
    if need < available // 2:
        return True, sizes + f"under half of the {available / mib:.0f} MiB {source}"
    return False, sizes + f"not under half of the {available / mib:.0f} MiB {source}"
