"""`remat.auto`: trace one step, plan under a budget and apply the plan, the one line a training
script adds; with `tune=True` the fastest of the plans that fit, timed on the model."""

from __future__ import annotations

from typing import Any

from torch import nn

from remat.applying import first_step
from remat.applying.eager import apply, installed_plan, refuse_double_checkpointing, remove
from remat.applying.tune import tune as fastest
from remat.applying.tune import with_measured_overheads
from remat.device.cost import get_profile
from remat.errors import RematError, TraceError, log, warn
from remat.planning.offload import OffloadSettings
from remat.planning.planner import Planner, plan
from remat.planning.plans import DEFAULT_BUDGET, Plan
from remat.tracing.trace import fits_in_memory_for_real_trace, trace
from remat.units import format_bytes


def auto(
    model: nn.Module,
    *example_inputs: Any,
    budget: int | str = DEFAULT_BUDGET,
    strategy: str = "auto",
    profile: str = "cpu",
    optimizer: str | None = None,
    trace_device: str | None = None,
    tune: bool = False,
    check: bool = True,
    offload: bool | OffloadSettings | None = None,
    **kwargs: Any,
) -> Plan:
    """Trace one step of `model(*example_inputs, **kwargs)`, plan under `budget` and apply the
    plan in place: the one line to add to a training script. Returns the plan.

    `tune=True`: where the cost model and the machine disagree, the machine wins: the best few
    plans that fit are timed on the model for a few steps and the fastest is applied
    (`remat.applying.tune`; cached per model, shapes, budget and device, for the process and on disk under
    `$REMAT_CACHE_DIR`, `~/.cache/remat` by default). The inputs must then be real tensors on the
    model's device.

    The step is traced on fake tensors (`trace_device=None` or "meta"); when an op cannot run on
    them (a meta kernel that rejects its inputs, a shape that depends on data, as in mixture-of-
    experts routing) and the step fits comfortably in memory, it is traced again on the real CPU
    tensors, with a warning. `trace_device="cpu"` traces on real tensors from the start.
    `profile` names the cost profile recompute time is predicted on (cpu, a100, h100, h200).
    On a model that already has a plan, the new plan replaces it, made as for the bare model.

    `check=True`: the first training step after this checks itself, once
    (`remat.applying.first_step`): where the bytes it holds for the backward are more than 2% over
    the plan's, or (CUDA) its peak is over the budget, a `RematWarning` names the modules that
    differ."""
    # Plan the bare model: a plan already installed would be traced as part of the step. Should
    # tracing or planning fail, the model keeps the plan it had.
    previous = installed_plan(model)
    remove(model)
    refuse_double_checkpointing(model)  # before a trace that would run their checkpointing
    try:
        if trace_device in (None, "meta"):
            try:
                graph = trace(model, *example_inputs, device="meta", **kwargs)
            except TraceError as err:
                if trace_device is not None or not err.fake_tensor_failure:
                    raise
                fits, why = fits_in_memory_for_real_trace(model, example_inputs, kwargs)
                if not fits:
                    raise
                warn(
                    f"remat: {str(err).split('. ')[0]}; tracing on real CPU tensors instead ({why})"
                )
                graph = trace(model, *example_inputs, device="cpu", **kwargs)
        else:
            graph = trace(model, *example_inputs, device=trace_device, **kwargs)
        if tune and strategy != "auto":
            raise RematError(
                f"tune=True times the plans of every strategy that fit and keeps the fastest: "
                f"it replaces strategy={strategy!r}; leave strategy at 'auto'"
            )
        if tune and offload:
            raise RematError(
                "tune=True times eager plans without offload; remat.auto(offload=...) plans it "
                "by the cost model only: leave tune off, or offload off"
            )
        if tune:
            device = next(iter(model.parameters())).device
            measured = with_measured_overheads(get_profile(profile), device)
            planner = Planner(graph, measured, optimizer)
            tuning = fastest(
                model,
                *example_inputs,
                planner=planner,
                budget_bytes=planner.budget_bytes(budget),
                **kwargs,
            )
            if tuning.cached and tuning.cache_file is not None:
                log.info(
                    "remat: the tuned plan kept in %s (delete it to time the plans again)",
                    tuning.cache_file,
                )
            chosen = tuning.chosen
        else:
            chosen = plan(
                graph,
                budget=budget,
                strategy=strategy,
                profile=profile,
                optimizer=optimizer,
                offload=offload,
            )
    except BaseException:
        if previous is not None:
            apply(model, previous)
        raise
    apply(model, chosen)
    if check:
        first_step.install(model, chosen)
    refused = {
        name: why.removeprefix("refused: ")
        for name, why in chosen.details.get("candidates", {}).items()
        if why.startswith("refused: ")
    }
    if refused:
        log.info(
            "remat: auto left out %s",
            "; ".join(f"{name}, which refused ({why})" for name, why in refused.items()),
        )
    log.info(
        "remat: installed %s on %s: predicted peak %s%s, %s (remat.verify(model, *inputs) checks "
        "it)",
        chosen.strategy,
        type(model).__name__,
        format_bytes(chosen.predicted_peak_bytes),
        f" within {format_bytes(chosen.budget_bytes)}" if chosen.budget_bytes else "",
        f"recompute +{chosen.recompute_seconds * 1e3:.3g} ms a step on the {chosen.profile} profile"
        if chosen.recompute_seconds
        else "no recompute",
    )
    if chosen.offload:
        log.info(
            "remat: %d blocks offload their saves to host memory: %s on the host, +%.3g ms of copies "
            "not hidden by compute",
            len(chosen.offload),
            format_bytes(chosen.host_bytes),
            chosen.transfer_seconds * 1e3,
        )
    return chosen
