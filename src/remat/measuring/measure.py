"""Ground truth: run a real training step and measure what it saves, retains and peaks at.

This module is the independent check of remat's predictions, so it shares no accounting code with
the rest of remat: it never imports the tracer, the estimator or the graph. It counts bytes of real
storages on a real device, with three instruments that do not depend on each other:

* saved tensors: `torch.autograd.graph.saved_tensors_hooks` sees every tensor autograd saves for
  backward during forward and loss;
* live bytes on CPU: the PyTorch profiler's memory events (every allocation and free made through
  c10's CPU allocator while profiling), summed in time order;
* live bytes on CUDA: the caching allocator's own counters (`memory_allocated`,
  `max_memory_allocated`).

`calibrate_profile` (`remat.measuring.calibrate`, re-exported here) times real kernels the same
way, to give the roofline cost model (`remat.device.cost`, which imports no torch) a
`DeviceProfile` of the machine at hand.

One training step is `out = model(*inputs, **kwargs)`, `loss = loss_fn(out)` (default: the model's
own 0-dim loss if it returns one, else the sum of every floating tensor in `out`, each summed in its
own dtype), `loss.backward()`, then
`optimizer.step()` if there is an optimizer, then every gradient is set to None. The outputs and
the loss stay referenced until the step ends, as in a loop that writes `out = model(x)`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from itertools import chain
from typing import Any

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from remat.errors import RematError
from remat.measuring.calibrate import calibrate_profile, checkpoint_overheads  # their old home
from remat.quiet import quiet_fd
from remat.tracing.draws import Draws, ForcedDraws
from remat.tracing.trace import is_own_loss

__all__ = [
    "Measurement",
    "SavedStorages",
    "calibrate_profile",
    "checkpoint_overheads",
    "cpu_peak_bytes",
    "measure",
    "saved_tensor_bytes",
    "storage_keys",
    "time_steps",
]

_OPTIMIZERS: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
    "sgd": lambda params: torch.optim.SGD(params, lr=1e-3),
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=1e-3, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3),
    "adamw-foreach": lambda params: torch.optim.AdamW(params, lr=1e-3, foreach=True),
    "adamw-for-loop": lambda params: torch.optim.AdamW(params, lr=1e-3, foreach=False),
    "adamw-fused": lambda params: torch.optim.AdamW(params, lr=1e-3, fused=True),
}
_FORWARD_RANGE = "remat.measuring.measure.forward"

# A storage's device and base address: views, in-place results and aliases of one storage share
# both. Unique only among storages alive at the same time (a freed address can be reused).
_StorageKey = tuple[torch.device, int]


@dataclass(frozen=True)
class Measurement:
    """What one real training step cost, in bytes of storage, and how long steps took.

    Attributes:
        activation_bytes: bytes of the distinct storages that autograd saved for backward during the
            forward and the loss, parameters and buffers excluded (inputs included). A storage
            counts once however many tensors, views or ops saved it; each storage is counted at
            its full `nbytes()`, even if only a view of it was saved. Saves made inside a
            non-reentrant `torch.utils.checkpoint` region go through checkpoint's own hooks and
            are not seen here.
        held_bytes: bytes allocated during forward and loss and still live when backward
            starts: saved activations, the outputs and the loss, and everything else kept alive
            (such as the region input and the RNG state snapshot that a non-reentrant checkpoint
            keeps for its recomputation).
            Storages that existed before the step (parameters, inputs) are not in it.
        peak_bytes: `baseline_bytes` plus the highest level, during the step, of bytes allocated
            since the step began minus bytes of those allocations freed again (on CUDA, minus
            every byte freed: the allocator also knows the sizes of older storages).
        baseline_bytes: bytes of the distinct storages, on the measured device, of parameters,
            buffers, inputs and optimizer state at the start of the measured step (tied weights
            count once). Gradients are None at that point.
        step_seconds: wall time of each timed step, without the profiler running.
        device: "cpu" or "cuda:<index> (<device name>)".
        random_reads: with `draws`, the reads of random draws it answered (over the warmup and
            the measured step): 0 means the step's ops do not depend on random draws.
    """

    activation_bytes: int
    held_bytes: int
    peak_bytes: int
    baseline_bytes: int
    step_seconds: tuple[float, ...]
    device: str
    random_reads: int = 0


def measure(
    model: nn.Module,
    *inputs: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    optimizer: None | str | torch.optim.Optimizer = None,
    steps: int = 1,
    warmup: int = 1,
    device: str | torch.device | None = None,
    draws: Draws | None = None,
    **kwargs: Any,
) -> Measurement:
    """Run real training steps of `model` on `inputs` and measure their memory and time.

    Runs `warmup` untimed steps (so optimizer state and lazily built buffers exist), then one
    step whose memory is measured (not timed), then `steps` timed steps without any
    instrumentation. Every step updates the parameters when there is an optimizer; with
    `warmup=0` the measured step is the model's first, and builds the optimizer state.

    On CPU, live bytes come from the profiler's allocation events: only allocations made through
    c10's CPU allocator during the measured step are seen. Memory that BLAS, oneDNN or other
    libraries allocate inside a kernel with their own `malloc`, the profiler's own memory and
    Python objects are not counted. A storage allocated before the step and freed during it
    is not subtracted (the profiler may not know its size, or know a stale one; only frees of
    storages the step allocated count): gradients are set to None before the step so that
    this does not happen to them. On CUDA, live bytes are the caching
    allocator's counters, relative to what was allocated when the step began, so they count
    each allocation rounded up to the allocator's block size (512 bytes), including workspaces
    that libraries allocate through it.

    Args:
        model: the module to train; its parameters must be real tensors on one device. It is
            not modified beyond optimizer updates to its parameters; its gradients are None
            afterwards, and train/eval mode is left as the caller set it.
        inputs, kwargs: passed to `model`; tensors among them (also inside tuples, lists and
            dicts) are moved to the measured device.
        loss_fn: maps the model output to a scalar loss; default is the sum of every floating
            tensor in the output (walking tuples, lists, mappings and dataclasses).
        optimizer: None, "sgd" (`SGD(lr=1e-3)`), "sgd-momentum", "adamw" (`AdamW(lr=1e-3)`,
            torch's default implementation), "adamw-foreach", "adamw-for-loop", "adamw-fused",
            or an optimizer instance; its state counts in `baseline_bytes` once warmup has created it.
        steps: number of timed steps, at least 1.
        warmup: number of untimed steps before measuring, at least 0.
        device: the device to measure on; None means where the model's parameters are. The
            model must already be there: measure() does not move it.
        draws: None (the step draws as in training), or "low"/"high": a step whose ops depend
            on random draws (LayerDrop) runs with them at that extreme (`remat.tracing.draws`).

    Raises:
        RematError: for parameters on the meta device or on several devices, a `device` the
            model is not on, an unknown optimizer, a loss that cannot be backpropagated, or
            `steps` / `warmup` out of range.
    """
    if steps < 1 or warmup < 0:
        raise RematError(f"measure() needs steps >= 1 and warmup >= 0, got {steps=}, {warmup=}")
    step, target = _training_step(model, inputs, kwargs, loss_fn, optimizer, device)
    step.draws = draws
    params = list(model.parameters())
    with torch.enable_grad():
        step.clear_grads()
        for _ in range(warmup):
            step.run()
        if step.draws is not None and warmup and not step.random_reads:
            # the step draws nothing: measured without the draws' dispatch mode, under which
            # autograd never adds two gradients in place (`tracing.tensors.accumulates_in_place`)
            step.draws = None
        baseline = _distinct_bytes(
            chain(
                params,
                model.buffers(),
                _tensors((step.inputs, step.kwargs)),
                _tensors(step.optimizer.state if step.optimizer else {}),
            ),
            target,
        )
        saved = SavedStorages(excluded=storage_keys(chain(params, model.buffers())))
        if target.type == "cuda":
            retained, peak = _cuda_memory_step(step, saved, target)
        else:
            retained, peak = _cpu_memory_step(step, saved)
        reads = step.random_reads
        seconds = tuple(_timed_step(step, target) for _ in range(steps))
    return Measurement(
        activation_bytes=saved.nbytes,
        held_bytes=retained,
        peak_bytes=baseline + peak,
        baseline_bytes=baseline,
        step_seconds=seconds,
        device=_device_label(target),
        random_reads=reads,
    )


def time_steps(
    model: nn.Module,
    *inputs: Any,
    steps: int = 1,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    warmup: int = 0,
    **kwargs: Any,
) -> tuple[float, ...]:
    """Wall time, in seconds, of each of `steps` training steps of `model` on `inputs`, after
    `warmup` untimed ones: the timed steps of `measure` without its memory step (no profiler, no
    hooks, no optimizer). The step is the same (forward, loss, backward, gradients to None); the
    model must already be on one device, tensors among the inputs are moved there, and CUDA is
    synchronized around each timed step.

    Raises:
        RematError: as `measure` does for the model's device, or for `steps` < 1 or `warmup` < 0.
    """
    if steps < 1 or warmup < 0:
        raise RematError(f"time_steps() needs steps >= 1 and warmup >= 0, got {steps=}, {warmup=}")
    step, target = _training_step(model, inputs, kwargs, loss_fn, None, None)
    with torch.enable_grad():
        step.clear_grads()
        for _ in range(warmup):
            step.run()
        return tuple(_timed_step(step, target) for _ in range(steps))


def _training_step(
    model: nn.Module,
    inputs: tuple[Any, ...],
    kwargs: dict[str, Any],
    loss_fn: Callable[[Any], torch.Tensor] | None,
    optimizer: None | str | torch.optim.Optimizer,
    device: str | torch.device | None,
) -> tuple[_TrainingStep, torch.device]:
    """The step `measure` and `time_steps` run, with its inputs moved to the model's device."""
    target = _measured_device(model, device, chain(_tensors(inputs), _tensors(kwargs)))
    inputs = _to_device(inputs, target)
    kwargs = _to_device(kwargs, target)
    params = list(model.parameters())
    leaf_inputs = [t for t in _tensors((inputs, kwargs)) if t.is_leaf and t.requires_grad]
    step = _TrainingStep(
        model=model,
        inputs=inputs,
        kwargs=kwargs,
        loss_fn=loss_fn,
        optimizer=_make_optimizer(optimizer, params),
        grad_holders=params + leaf_inputs,
    )
    return step, target


def saved_tensor_bytes(
    model: nn.Module,
    *inputs: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    **kwargs: Any,
) -> int:
    """Bytes of the distinct storages autograd saves during one forward and loss.

    The same count as `Measurement.activation_bytes` (parameters and buffers excluded, each storage
    once), from a single forward and loss on the tensors as given: no backward, no warmup, no
    optimizer, and the model's gradients are untouched. The graph is dropped before returning.

    Raises:
        RematError: for parameters on the meta device or on several devices, or a loss that is
            not a scalar requiring grad.
    """
    _measured_device(model, None, chain(_tensors(inputs), _tensors(kwargs)))
    saved = SavedStorages(excluded=storage_keys(chain(model.parameters(), model.buffers())))
    with torch.enable_grad(), saved.hooks():
        _forward(model, inputs, kwargs, loss_fn)
    return saved.nbytes


@dataclass
class _TrainingStep:
    """One training step, split where measurement needs to look: after forward and loss."""

    model: nn.Module
    inputs: tuple[Any, ...]
    kwargs: dict[str, Any]
    loss_fn: Callable[[Any], torch.Tensor] | None
    optimizer: torch.optim.Optimizer | None
    grad_holders: list[torch.Tensor]  # parameters and inputs whose .grad backward may fill
    draws: Draws | None = None  # reads of random draws answered with this extreme (LayerDrop)
    random_reads: int = 0  # how many there were, over the steps run

    @contextlib.contextmanager
    def _draws(self) -> Iterator[None]:
        if self.draws is None:
            yield
            return
        forced = ForcedDraws(self.draws)
        try:
            with forced:
                yield
        finally:
            self.random_reads += len(forced.reads)

    def forward(self) -> tuple[Any, torch.Tensor]:
        with self._draws():
            return _forward(self.model, self.inputs, self.kwargs, self.loss_fn)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward, optimizer step, then gradients to None (also those the optimizer skips)."""
        with self._draws():  # a region's replay draws again
            loss.backward()
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.clear_grads()

    def clear_grads(self) -> None:
        for t in self.grad_holders:
            t.grad = None

    def run(self) -> None:
        # `out` stays referenced until backward and the update are done, as in a training loop.
        out, loss = self.forward()
        self.backward(loss)


def _forward(
    model: nn.Module,
    inputs: tuple[Any, ...],
    kwargs: dict[str, Any],
    loss_fn: Callable[[Any], torch.Tensor] | None,
) -> tuple[Any, torch.Tensor]:
    out = model(*inputs, **kwargs)
    if loss_fn is not None:
        loss = loss_fn(out)
    elif is_own_loss(out):
        loss = out
    else:
        floats = [t for t in _tensors(out) if t.is_floating_point()]
        if not floats:
            raise RematError(
                "the model output holds no floating tensor to sum into a loss; pass loss_fn="
            )
        loss = floats[0].sum()
        for t in floats[1:]:
            loss = loss + t.sum()
    if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.requires_grad):
        raise RematError(
            "the loss must be a one-element tensor that requires grad (a model with trainable "
            "parameters, or inputs with requires_grad=True); check loss_fn and the model output"
        )
    return out, loss


class SavedStorages:
    """Pack hook that sums the bytes of each distinct storage autograd saves.

    A storage is recognised by identity (storages keep one Python object while they live), so a
    storage that is saved, freed with its branch of the graph and whose address is then reused
    by a new saved storage counts twice: both were saved during the forward. The hook returns a
    detached alias, not the tensor itself: a saved output returned as-is would hold its own
    grad_fn, a reference cycle through C++ that the garbage collector cannot free. Autograd
    rebuilds the unpacked tensor's autograd metadata itself, so gradients are unchanged.
    """

    def __init__(self, excluded: set[_StorageKey]) -> None:
        self._excluded = excluded
        self._seen: dict[_StorageKey, weakref.ref[torch.UntypedStorage]] = {}
        self.nbytes = 0

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """The hooks; under a compiled model (dynamo imported) the pack hook runs eagerly: dynamo
        would compile it once per saved tensor's dtype and shape where the model breaks its
        graph (an LSTM), and warn of its recompile limit on the first step."""
        pack = self._pack
        if "torch._dynamo" in sys.modules:
            pack = torch._dynamo.disable(pack)
        return torch.autograd.graph.saved_tensors_hooks(pack, _unpack)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = _local(t).untyped_storage()
        key = (storage.device, storage.data_ptr())
        seen = self._seen.get(key)
        if key not in self._excluded and (seen is None or seen() is not storage):
            self._seen[key] = weakref.ref(storage)
            self.nbytes += storage.nbytes()
        return t.detach()


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


def _cpu_memory_step(step: _TrainingStep, saved: SavedStorages) -> tuple[int, int]:
    """Run `step` under the profiler; return (retained, peak) bytes allocated within it."""

    def run() -> None:
        with record_function(_FORWARD_RANGE), saved.hooks():
            out, loss = step.forward()  # both stay live until the step is over
        step.backward(loss)

    events = _profiled_cpu(run)
    forward_end = next(e.end_time_ns for e in events if e.name == _FORWARD_RANGE)
    live = retained = peak = 0
    for when, size in _cpu_allocations(events):
        live += size
        peak = max(peak, live)
        if when <= forward_end:
            retained = live
    return retained, peak


def cpu_peak_bytes(run: Callable[[], object]) -> int:
    """The highest level, while `run()` runs, of bytes allocated through c10's CPU allocator since
    it began minus those of them freed again: `measure`'s CPU instrument, for a step that is not
    one model call (a pipeline schedule's `step`). Storages older than `run` are not seen."""
    live = peak = 0
    for _, size in _cpu_allocations(_profiled_cpu(run)):
        live += size
        peak = max(peak, live)
    return peak


def _profiled_cpu(run: Callable[[], object]) -> list[Any]:
    """The profiler's events, with memory, of one call of `run`."""
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with quiet_fd(2):
        prof.__enter__()
    try:
        run()
    finally:
        with quiet_fd(2):
            prof.__exit__(None, None, None)
    return list(_walk(prof.profiler.kineto_results.experimental_event_tree()))


def _cpu_allocations(events: list[Any]) -> list[tuple[int, int]]:
    """(time, bytes) of every CPU allocation among `events` (negative: a free of one of them), in
    time order. The free of a storage allocated before the events began is left out, even where
    the profiler reports one: c10's CPU reporter keeps the size of each block allocated while any
    profiler ran and forgets it only when the block is freed under a profiler, so such a block
    (or one allocated later at its address) freed in this step was reported, its bytes taken off
    a step that never counted them (tests/test_measure.py; the likely cause of a tiny Mistral's
    held bytes once measured 6% low after other tests' profiled steps in the same process)."""
    allocation = torch._C._profiler._EventType.Allocation
    ordered = sorted(
        (
            (e.start_time_ns, e.extra_fields.alloc_size, e.extra_fields.ptr)  # < 0 for frees
            for e in events
            if e.tag == allocation and e.extra_fields.device.type == "cpu"
        ),
        key=lambda event: event[0],  # stable: equal timestamps keep the tree's order
    )
    seen: set[int] = set()  # addresses allocated within the events and not freed since
    found = []
    for when, size, ptr in ordered:
        if size > 0:
            seen.add(ptr)
        elif ptr in seen:
            seen.discard(ptr)
        else:
            continue
        found.append((when, size))
    return found


def _cuda_memory_step(
    step: _TrainingStep, saved: SavedStorages, device: torch.device
) -> tuple[int, int]:
    """Run `step` between the allocator's counters; return (retained, peak) above the start."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    start = torch.cuda.memory_allocated(device)
    with saved.hooks():
        out, loss = step.forward()  # both stay live until the step is over
    retained = torch.cuda.memory_allocated(device) - start
    step.backward(loss)
    torch.cuda.synchronize(device)
    return retained, torch.cuda.max_memory_allocated(device) - start


def _timed_step(step: _TrainingStep, device: torch.device) -> float:
    _synchronize(device)
    start = time.perf_counter()
    step.run()
    _synchronize(device)
    return time.perf_counter() - start


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _walk(events: Iterable[Any]) -> Iterator[Any]:
    for event in events:
        yield event
        yield from _walk(event.children)


def _measured_device(
    model: nn.Module, device: str | torch.device | None, inputs: Iterable[torch.Tensor]
) -> torch.device:
    """The one device the model lives on (or its inputs, for a model without tensors)."""
    own = {t.device for t in chain(model.parameters(), model.buffers())}
    if any(d.type == "meta" for d in own):
        raise RematError(
            "measurement needs real tensors, but the model has parameters or buffers on the meta "
            "device; build the model with device='cpu' (or 'cuda') to measure it"
        )
    if len(own) > 1:
        raise RematError(
            f"the model's parameters and buffers are on several devices "
            f"({', '.join(sorted(map(str, own)))}); measure() needs them on one"
        )
    if device is None:
        found = own or {t.device for t in inputs} or {torch.device("cpu")}
        if len(found) > 1:
            raise RematError("the inputs are on several devices; pass device= to measure()")
        target = found.pop()
    else:
        target = torch.device(device)
        if target.type == "cuda" and target.index is None and torch.cuda.is_available():
            target = torch.device("cuda", torch.cuda.current_device())
    if target.type not in ("cpu", "cuda"):
        raise RematError(f"measure() supports 'cpu' and 'cuda' devices, not {str(target)!r}")
    if own and own != {target}:
        raise RematError(
            f"device={str(device)!r} but the model is on {own.pop()}; measure() does not move "
            f"the model: call model.to({str(target)!r}) first"
        )
    return target


def _device_label(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)


def _make_optimizer(
    optimizer: None | str | torch.optim.Optimizer, params: list[nn.Parameter]
) -> torch.optim.Optimizer | None:
    if optimizer is None or isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    if not isinstance(optimizer, str) or optimizer not in _OPTIMIZERS:
        raise RematError(
            f"optimizer={optimizer!r} is not supported: use None, "
            f"{', '.join(repr(name) for name in _OPTIMIZERS)} or a torch.optim.Optimizer instance"
        )
    trainable = [p for p in params if p.requires_grad]
    if not trainable:
        raise RematError(f"optimizer={optimizer!r} but the model has no trainable parameters")
    return _OPTIMIZERS[optimizer](trainable)


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in `obj`, walking tuples, lists, mappings and dataclass instances."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, Mapping):
        for value in obj.values():
            yield from _tensors(value)
    elif isinstance(obj, (tuple, list)):
        for value in obj:
            yield from _tensors(value)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            yield from _tensors(getattr(obj, field.name))


def _to_device(obj: Any, device: torch.device) -> Any:
    """`obj` with its tensors moved to `device` (a no-op, same objects, where they are there)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, Mapping):
        return {key: _to_device(value, device) for key, value in obj.items()}
    if isinstance(obj, (tuple, list)):
        moved = [_to_device(value, device) for value in obj]
        if hasattr(obj, "_fields"):  # a namedtuple takes its fields as arguments
            return type(obj)(*moved)
        return type(obj)(moved)
    return obj


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage holds `t`'s bytes on this rank: the one tensor inside a wrapper
    subclass that holds one (a DTensor's local shard, a pending collective's result), else `t`."""
    if is_traceable_wrapper_subclass(t):
        attrs, _ = t.__tensor_flatten__()
        inner = [getattr(t, a) for a in attrs if isinstance(getattr(t, a), torch.Tensor)]
        if len(inner) == 1:
            return _local(inner[0])
    return t


def storage_keys(tensors: Iterable[torch.Tensor]) -> set[_StorageKey]:
    storages = [_local(t).untyped_storage() for t in tensors]
    return {(s.device, s.data_ptr()) for s in storages}


def _distinct_bytes(tensors: Iterable[torch.Tensor], device: torch.device) -> int:
    """Bytes of the distinct storages on `device` among `tensors` (all alive at once)."""
    storages = [_local(t).untyped_storage() for t in tensors if t.device == device]
    sizes = {s.data_ptr(): s.nbytes() for s in storages}
    return sum(sizes.values())
