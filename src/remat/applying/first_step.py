"""The first training step after a plan is installed checks itself, once, so that no wrong plan is
silent past step one.

What it counts is what the plan predicts: the bytes the forward allocated that are still live when
the backward starts (`Plan.held_bytes`), by the module whose op allocated them
(`Plan.held_by_module`). A dispatch mode notes every storage an op makes during the model's
forward (outputs that alias no input) with the module running, and sums those alive at the
forward's end; a region's blocks count as the region (its later blocks run inside the first's
forward). On CUDA it also reads the caching allocator's peak over forward and backward
(`torch.cuda.max_memory_allocated`, reset when the step begins). Where held bytes are more than
2% over the prediction, or the peak is over the budget, a `RematWarning` names the modules or
regions that differ, predicted against counted. Under `remat.compile` the step's saved tensors
are counted by the saved-tensor hooks `remat.measure` uses, against the compiled plans' held bytes.

The check runs on the first forward with gradients on after the plan is installed, then removes
itself; it observes and never changes a value, so gradients are those of an unchecked step. Off
with `check=False` (`remat.auto`, `remat.compile`, the integrations). Skipped where the
parameters are DTensors (FSDP2, tensor parallelism: the step gathers parameters the plan does not
hold) and while torch.compile traces the model."""

from __future__ import annotations

import functools
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _get_current_dispatch_mode_stack,
    is_traceable_wrapper_subclass,
)

from remat.applying.eager import installed_plan, scope_hooks
from remat.errors import log, warn
from remat.measuring.measure import SavedStorages, storage_keys
from remat.planning.plans import CHECKPOINT_FRAMES, Plan
from remat.units import format_bytes

#: held bytes may exceed the prediction by this share before the check warns
HELD_TOLERANCE = 0.02
#: `Plan.held_by_module`'s key for the loss's ops, which run outside the model's forward
LOSS = "<loss>"
_SHOWN = 4  # modules named in a warning


@dataclass(frozen=True)
class FirstStepReport:
    """What the first step's check found: held bytes predicted and counted, in all and by module
    or region (`by_module`: name, predicted, counted), the CUDA allocator's peak (None on CPU or
    before the backward ran) against the budget, and whether it warned."""

    held_bytes_predicted: int
    held_bytes_counted: int
    by_module: tuple[tuple[str, int, int], ...]
    peak_bytes: int | None
    budget_bytes: int | None
    warned: bool


class _Made(TorchDispatchMode):
    """Every storage an op makes (an output that aliases no input), with the module running."""

    def __init__(self, scope: list[str]):
        super().__init__()
        self.scope = scope
        self.made: list[tuple[weakref.ref, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        returns = func._schema.returns
        for ret, value in zip(returns, out if len(returns) > 1 else (out,), strict=False):
            if ret.alias_info is None:
                for t in pytree.tree_leaves(value):
                    if isinstance(t, torch.Tensor) and not is_traceable_wrapper_subclass(t):
                        self.made.append((weakref.ref(t.untyped_storage()), self.scope[-1]))
        return out

    def live_by_module(self) -> dict[str, int]:
        """Bytes of the noted storages still alive, by the module that made them."""
        seen: set[int] = set()
        live: dict[str, int] = defaultdict(int)
        for ref, module in self.made:
            storage = ref()
            if storage is not None and id(storage) not in seen:
                seen.add(id(storage))
                live[module] += storage.nbytes()
        return dict(live)


class FirstStepCheck:
    """Forward pre-hook and hook on a planned model (`install`): the first training forward runs
    counted, and the step's backward, on CUDA, ends with the allocator's peak read. The hooks are
    objects of this class, so a planned model still deep-copies and pickles; a copy checks its
    own first step."""

    def __init__(self, model: nn.Module, plan: Plan):
        self.plan = plan
        self.model_name = type(model).__name__
        self.report: FirstStepReport | None = None
        self._reset()

    def _reset(self) -> None:
        self.done = False
        self._handles: list[Any] = []
        self._scope_handles: list[Any] = []
        self._made: _Made | None = None
        self._device: torch.device | None = None
        self._start_bytes = 0

    def __getstate__(self) -> dict[str, Any]:
        return {"plan": self.plan, "model_name": self.model_name, "report": self.report}

    def __setstate__(self, state: dict[str, Any]) -> None:
        vars(self).update(state)
        self._reset()

    def before(self, model: nn.Module, args: tuple, kwargs: dict) -> None:
        if self.done or self._made is not None or not torch.is_grad_enabled():
            return
        if _get_current_dispatch_mode_stack():
            return  # a trace (remat.trace, fake tensors) runs the model: not a training step
        if installed_plan(model) is not self.plan or _skipped(model):
            self._finish(model)  # replaced, removed, sharded or compiled: nothing to check
            return
        scope = [""]
        self._scope_handles = scope_hooks(model, scope)
        self._device = _cuda_device(model)
        if self._device is not None:
            torch.cuda.synchronize(self._device)
            torch.cuda.reset_peak_memory_stats(self._device)
            self._start_bytes = torch.cuda.memory_allocated(self._device)
        self._made = _Made(scope)
        self._made.__enter__()

    def after(self, model: nn.Module, args: tuple, output: Any) -> None:
        made = self._stop()
        if made is None:
            return
        self._finish(model)
        counted = made.live_by_module()
        by_module = _compare(self.plan, counted, exclude=(LOSS,))
        predicted = self.plan.held_bytes - self.plan.held_by_module.get(LOSS, 0)
        self.report = FirstStepReport(
            held_bytes_predicted=predicted,
            held_bytes_counted=sum(counted.values()),
            by_module=by_module,
            peak_bytes=None,
            budget_bytes=self.plan.budget_bytes,
            warned=False,
        )
        if self.report.held_bytes_counted > predicted * (1 + HELD_TOLERANCE):
            self._warn(
                f"held {format_bytes(self.report.held_bytes_counted)} for the backward at the end "
                f"of its forward, {self.report.held_bytes_counted / max(predicted, 1) - 1:.1%} "
                f"over the {format_bytes(predicted)} predicted"
            )
        if self._device is not None:
            after_backward(output, self._read_peak)

    def abort(self) -> None:
        """Stop counting a step that ended without a backward (an exception, a skipped batch): the
        next training step is checked instead."""
        self._stop()

    def _stop(self) -> _Made | None:
        made, self._made = self._made, None
        if made is not None:
            made.__exit__(None, None, None)
        for handle in self._scope_handles:
            handle.remove()
        self._scope_handles = []
        return made

    def _read_peak(self) -> None:
        assert self._device is not None and self.report is not None
        torch.cuda.synchronize(self._device)
        peak = torch.cuda.max_memory_allocated(self._device)
        budget = self.plan.budget_bytes or self.plan.predicted_peak_bytes
        self.report = _with(self.report, peak_bytes=peak)
        if peak > budget:
            self._warn(
                f"peaked at {format_bytes(peak)} on {self._device} (torch.cuda."
                f"max_memory_allocated; {format_bytes(self._start_bytes)} allocated when the step "
                f"began), over the budget of {format_bytes(budget)} (predicted peak "
                f"{format_bytes(self.plan.predicted_peak_bytes)})"
            )

    def _warn(self, what: str) -> None:
        assert self.report is not None
        self.report = _with(self.report, warned=True)
        warn(
            f"remat: the first training step of {self.model_name} under plan "
            f"{self.plan.strategy} {what}; {_differences(self.report.by_module)}. The plan's "
            "memory is not what the model does: remat.verify(model, *inputs) measures a step "
            "(check=False turns this check off)"
        )

    def _finish(self, model: nn.Module) -> None:
        self.done = True
        self._stop()
        for handle in self._handles:
            handle.remove()
        self._handles = []


def install(model: nn.Module, plan: Plan) -> FirstStepCheck:
    """Check the first training step of `model` (where `plan` is installed) against `plan`."""
    check = FirstStepCheck(model, plan)
    check._handles = [
        model.register_forward_pre_hook(check.before, with_kwargs=True),
        model.register_forward_hook(check.after, always_call=True),
    ]
    vars(model)[_CHECK] = check
    return check


def report(model: nn.Module) -> FirstStepReport | None:
    """What the check of `model`'s first step found (`remat.auto`, the integrations), or None:
    no check installed, or its step not run yet (or skipped: sharded parameters)."""
    check = vars(model).get(_CHECK)
    return None if check is None else check.report


_CHECK = "_remat_first_step"


def after_backward(output: Any, callback: Callable[[], None]) -> None:
    """Run `callback` once the backward through `output` (its tensors that require grad) is done."""
    tensors = [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor)]
    anchor = next((t for t in tensors if t.requires_grad), None)
    if anchor is None:
        return

    def queue(grad: torch.Tensor) -> None:
        torch.autograd.Variable._execution_engine.queue_callback(callback)

    anchor.register_hook(queue)


def check_compiled(
    call: Callable[..., Any], plans: list[Plan], model: nn.Module | None
) -> Callable[..., Any]:
    """`call` (a `remat.compile`d forward) whose first call with gradients on counts the bytes
    autograd saves (the saved-tensor hooks of `remat.measure`) against the held bytes of the plans
    the call made (or, compiled before, all of them), and on CUDA the allocator's peak against
    the budget."""
    done = False

    @functools.wraps(call)
    def call_checking_first_step(*args: Any, **kwargs: Any) -> Any:
        nonlocal done
        if done or not torch.is_grad_enabled():
            return call(*args, **kwargs)
        done = True
        before = len(plans)
        owned: Iterable[torch.Tensor] = (
            () if model is None else (*model.parameters(), *model.buffers())
        )
        saved = SavedStorages(excluded=storage_keys(owned))
        device = _cuda_device(model) if model is not None else None
        if device is not None:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        with saved.hooks():
            out = call(*args, **kwargs)
        made = plans[before:] or list(plans)
        if not made:
            return out
        predicted = sum(p.held_bytes for p in made)
        name = type(model).__name__ if model is not None else getattr(call, "__name__", "?")
        largest = sorted((s for p in made for s in p.saved), key=lambda s: -s.bytes)[:_SHOWN]
        values = ", ".join(f"{s.name} {format_bytes(s.bytes)}" for s in largest)
        over = saved.nbytes / max(predicted, 1) - 1
        if over > HELD_TOLERANCE:
            warn(
                f"remat: the first training step of compiled {name} saved "
                f"{format_bytes(saved.nbytes)} for the backward, {over:.1%} over the "
                f"{format_bytes(predicted)} its {len(made)} compiled graph(s) predict (largest "
                f"planned values: {values}; tensors saved outside the compiled graphs, at graph "
                "breaks, are not in any plan). remat.measure(compiled, *inputs) measures a step "
                "(check=False turns this check off)"
            )
        if device is not None:
            budget = made[0].budget_bytes or made[0].predicted_peak_bytes

            def read_peak() -> None:
                torch.cuda.synchronize(device)
                peak = torch.cuda.max_memory_allocated(device)
                if peak > budget:
                    warn(
                        f"remat: the first training step of compiled {name} peaked at "
                        f"{format_bytes(peak)} on {device}, over the budget of "
                        f"{format_bytes(budget)} (largest planned values: {values}). "
                        "check=False turns this check off"
                    )

            after_backward(out, read_peak)
        return out

    return call_checking_first_step


def _compare(plan: Plan, counted: dict[str, int], exclude: tuple[str, ...]) -> tuple:
    """(module or region, predicted, counted) for every module either side names, with a region's
    blocks and their submodules counted as the region; predicted is 0 where the plan (written
    before `held_by_module`) has no breakdown."""
    unit = _units(plan)
    predicted: dict[str, int] = defaultdict(int)
    for module, nbytes in plan.held_by_module.items():
        if module not in exclude and module != CHECKPOINT_FRAMES:
            predicted[unit(module)] += nbytes
    got: dict[str, int] = defaultdict(int)
    for module, nbytes in counted.items():
        got[unit(module)] += nbytes
    names = sorted(set(predicted) | set(got), key=lambda n: predicted[n] - got[n])
    return tuple((n or "<root>", predicted[n], got[n]) for n in names)


def _units(plan: Plan) -> Callable[[str], str]:
    """A module path's unit: the region whose blocks it is in (`first .. last`), else itself."""
    blocks = {
        path: region.modules[0] + (f" .. {region.modules[-1]}" if len(region.modules) > 1 else "")
        for region in plan.regions
        for path in region.modules
    }

    @functools.cache
    def unit(path: str) -> str:
        parts = path.split(".")
        for k in range(len(parts), 0, -1):
            prefix = ".".join(parts[:k])
            if prefix in blocks:
                return blocks[prefix]
        return path

    return unit


def _differences(by_module: tuple[tuple[str, int, int], ...]) -> str:
    over = [(n, p, c) for n, p, c in by_module if c > p]
    if not over:
        return "no module holds more than predicted (the difference is outside the model's modules)"
    shown = "; ".join(
        f"'{n}' {format_bytes(c)} counted / {format_bytes(p)} predicted"
        for n, p, c in over[:_SHOWN]
    )
    more = f" and {len(over) - _SHOWN} more" if len(over) > _SHOWN else ""
    return f"modules over their prediction: {shown}{more}"


def _with(report: FirstStepReport, **changes: Any) -> FirstStepReport:
    return FirstStepReport(**{**vars(report), **changes})


def _cuda_device(model: nn.Module) -> torch.device | None:
    device = next((p.device for p in model.parameters()), None)
    return device if device is not None and device.type == "cuda" else None


def _skipped(model: nn.Module) -> bool:
    """Steps the check does not count: sharded parameters (DTensors of FSDP2 or tensor
    parallelism, FSDP1's flat parameters: the step gathers what the plan of the bare or local
    step does not hold) and torch.compile's tracing of the model."""
    if torch.compiler.is_compiling():
        return True
    if sharded(model):
        log.debug("remat: first-step check skipped: FSDP or tensor-parallel parameters")
        return True
    return False


def sharded(model: nn.Module) -> bool:
    """Whether `model`'s parameters are sharded: DTensors (FSDP2, tensor parallelism) or FSDP1's
    flat parameters."""
    return any(is_traceable_wrapper_subclass(p) for p in model.parameters()) or any(
        type(m).__name__ == "FullyShardedDataParallel" for m in model.modules()
    )
