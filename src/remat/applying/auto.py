"""`remat.auto`: trace one step, plan under a budget and apply the plan, the one line a training
script adds; by default the best few plans that fit then take turns on the first training steps
and the fastest is kept (`remat.applying.tune_steps`); with `tune=True` they are timed before
`auto` returns."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import nn

from remat.applying import first_step, tune_steps
from remat.applying.eager import apply, installed_plan, refuse_double_checkpointing, remove
from remat.applying.tune import (
    cached,
    candidate_plans,
    describes,
    measured_profile,
    tuning_key,
)
from remat.applying.tune import tune as fastest
from remat.device.cost import DeviceProfile, get_profile
from remat.errors import RematError, TraceError, log, warn
from remat.graph import Graph
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
    tune: bool | Literal["steps"] = "steps",
    check: bool = True,
    offload: bool | OffloadSettings | None = None,
    clock: Callable[[], float] | None = None,
    **kwargs: Any,
) -> Plan:
    """Trace one step of `model(*example_inputs, **kwargs)`, plan under `budget` and apply the
    plan in place: the one line to add to a training script. Returns the plan.

    Where the cost model and the machine disagree, the machine wins. `tune="steps"` (the
    default, with `strategy="auto"`): the cost model's pick is installed, and it and the next
    best plans that fit (up to 4) take turns on the first training steps, which run anyway and
    give bit-identical gradients under any plan; after a warm-up step each and 5 timed rounds
    (`tune_steps.ROUNDS`; 24 steps for 4 plans) the fastest is kept, and one log line says what
    was tried and kept (`remat.applying.tune_steps`; `clock`, seconds now, replaces the device's
    clock). `tune=True`: the same plans are timed before `auto` returns, on the example inputs,
    which must then be real tensors on the model's device (`remat.applying.tune`).
    `tune=False`: the cost model's pick, untimed. `offload` (True: the profile GPU's host link and
    memory; or `OffloadSettings`): blocks may keep their saves in host memory (docs/offload.md),
    planned by the cost model only (no plans timed). Either tuning keeps its result per model,
    shapes, budget and device, for the process and on disk under `$REMAT_CACHE_DIR`
    (`~/.cache/remat` by default), so the next run starts on the winner and times nothing.

    The step is traced on fake tensors (`trace_device=None` or "meta"); when an op cannot run on
    them (a meta kernel that rejects its inputs, a shape that depends on data, as in mixture-of-
    experts routing) and the step fits comfortably in memory, it is traced again on the real CPU
    tensors, with a warning. `trace_device="cpu"` traces on real tensors from the start.
    `profile` names the cost profile recompute time is predicted on (cpu, a100, h100, h200);
    where it is the profile of the device the model is on, `strategy="auto"` ranks the plans
    with checkpointing's own host cost measured there too (per region, per op a selective
    policy sees; once per process, well under a second), within the budget the profile sets.
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
    # the trace's own options, not the model's (tune=True calls the model with the rest)
    traced = {k: kwargs.pop(k) for k in ("autocast", "target") if k in kwargs}
    try:
        if trace_device in (None, "meta"):
            try:
                graph = trace(model, *example_inputs, device="meta", **traced, **kwargs)
            except TraceError as err:
                if trace_device is not None or not err.fake_tensor_failure:
                    raise
                fits, why = fits_in_memory_for_real_trace(model, example_inputs, kwargs)
                if not fits:
                    raise
                warn(
                    f"remat: {str(err).split('. ')[0]}; tracing on real CPU tensors instead ({why})"
                )
                graph = trace(model, *example_inputs, device="cpu", **traced, **kwargs)
        else:
            graph = trace(model, *example_inputs, device=trace_device, **traced, **kwargs)
        if offload:
            if tune is True:
                raise RematError(
                    "tune=True times eager plans without offload; remat.auto(offload=...) plans "
                    "it by the cost model only: leave tune off, or offload off"
                )
            # offload's copies are priced by the cost model only: no plans timed on steps
            chosen = plan(
                graph,
                budget=budget,
                strategy=strategy,
                profile=profile,
                optimizer=optimizer,
                offload=offload,
            )
            trials, key = [], None
        else:
            if tune is True and traced.get("autocast") is not None:
                raise RematError(
                    "tune=True times steps on the example inputs without the training loop's "
                    "autocast; with autocast= leave tune at 'steps' (the default), which times "
                    "your own first training steps, as they run"
                )
            chosen, trials, key = plan_for_training(
                model, graph, example_inputs, kwargs, budget, strategy, profile, optimizer, tune
            )
    except BaseException:
        if previous is not None:
            apply(model, previous)
        raise
    apply(model, chosen)
    if check:
        first_step.install(model, chosen)
    tune_steps.install(model, trials, key, clock=clock)
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


def plan_for_training(
    model: nn.Module,
    graph: Graph,
    inputs: tuple,
    kwargs: dict[str, Any],
    budget: int | str,
    strategy: str,
    profile: str | DeviceProfile,
    optimizer: str | None,
    tune: bool | str,
) -> tuple[Plan, list[Plan], tuple | None]:
    """What `auto` installs on `model` for the traced step `graph`: the plan, the plans its first
    training steps try (the first is that plan; none: no tuning) and the key their result is kept
    under. Shared with `remat bench`, whose `auto` row is what users get."""
    if tune is True and strategy != "auto":
        raise RematError(
            f"tune=True times the plans of every strategy that fit and keeps the fastest: "
            f"it replaces strategy={strategy!r}; leave strategy at 'auto'"
        )
    if tune not in (True, False, "steps"):
        raise RematError(
            f"tune={tune!r}: use 'steps' (the default: tuned on the first training steps), "
            "True (timed now, on the example inputs) or False (untuned)"
        )
    device = _device(model)
    if tune is True:
        planner = Planner(graph, measured_profile(get_profile(profile), device), optimizer)
        tuning = fastest(
            model, *inputs, planner=planner, budget_bytes=planner.budget_bytes(budget), **kwargs
        )
        if tuning.cached and tuning.cache_file is not None:
            log.info(
                "remat: the tuned plan kept in %s (delete it to time the plans again)",
                tuning.cache_file,
            )
        return tuning.chosen, [], None
    planner = Planner(graph, profile, optimizer)
    if strategy == "auto" and describes(planner.profile, device):
        # the plans are ranked with what checkpointing itself costs on this device and, on the
        # CPU, the op rates, measured (`measured_profile`), within the budget the plain profile sets
        budget = planner.budget_bytes(budget)
        planner = Planner(graph, measured_profile(planner.profile, device), optimizer)
    chosen = planner.plan(budget, strategy)
    if tune == "steps" and strategy == "auto":
        return _first_steps_candidates(model, inputs, kwargs, planner, budget, chosen)
    return chosen, [], None


def _first_steps_candidates(
    model: nn.Module,
    inputs: tuple,
    kwargs: dict[str, Any],
    planner: Planner,
    budget: int | str,
    pick: Plan,
) -> tuple[Plan, list[Plan], tuple]:
    """The plan to install and the plans the first training steps try (none when a tuning of
    this model, shapes and budget is kept from before: its winner is installed)."""
    budget_bytes = planner.budget_bytes(budget)
    key = tuning_key(model, inputs, kwargs, budget_bytes, planner.profile.name, CANDIDATES)
    kept = cached(key)
    if kept is not None:
        log.info(
            "remat: starting on %s, the plan the first steps of an earlier run kept%s",
            kept.chosen.strategy,
            f" ({kept.cache_file}; delete it to time the plans again)" if kept.cache_file else "",
        )
        return kept.chosen, [], key
    regions = tuple((r.modules, r.keep) for r in pick.regions)
    others = [
        p
        for p in candidate_plans(planner, budget_bytes, CANDIDATES)
        if tuple((r.modules, r.keep) for r in p.regions) != regions
    ]
    return pick, [pick, *others][:CANDIDATES], key


#: Plans the first-steps tuning tries: the cost model's pick and the next best that fit.
CANDIDATES = 4


def _device(model: nn.Module) -> torch.device:
    return next((p.device for p in model.parameters()), torch.device("cpu"))
