"""remat in Hugging Face's `Trainer` and in accelerate: a callback that plans from the Trainer's
first batch and installs the plan before the first step, and `enable` for a model outside a
Trainer (with accelerate: before `accelerator.prepare`).

    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[RematCallback(budget="70%")])

    enable(model, batch, budget="70%", accelerator=accelerator)    # accelerate: plan, then
    model, optimizer = accelerator.prepare(model, optimizer)        # prepare

Hugging Face's own gradient checkpointing is switched off first, saying so (remat would
checkpoint its layers twice); the model trains on its own loss (`out.loss`), with its cache off
in training as Hugging Face's checkpointing does (`remat.tracing.caches`).

Under FSDP2 (`fully_shard`, which accelerate applies at prepare) a plan is made for the bare
model, one rank's batch: FSDP changes where the parameters live, not the activations. A region
of several blocks runs its later blocks inside the first one's forward, where FSDP has not
gathered their parameters when they are FSDP units of their own (accelerate shards every
decoder layer), so such a plan is refused, naming the region. The Trainer's model is already
sharded when the callback sees it: it is traced as the bare model (each sharded parameter a meta
tensor of its full shape, FSDP's forward hooks held off for the trace). accelerate's own
activation checkpointing (`activation_checkpointing=True` in its FSDP plugin or the Trainer's
`fsdp_config`) is refused by name: it wraps the layers in a `CheckpointWrapper` at prepare,
after remat's plan, and each planned layer would be checkpointed twice.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from remat.applying.eager import checkpointed_elsewhere, installed_plan
from remat.errors import RematError, log
from remat.planning.plans import DEFAULT_BUDGET, Plan
from remat.units import format_bytes

#: accelerate's setting that checkpoints the layers itself, as a user writes it in each API
_ACCELERATE_AC = (
    "FullyShardedDataParallelPlugin(activation_checkpointing=True) (the Trainer's "
    'fsdp_config={"activation_checkpointing": True}, or FSDP_ACTIVATION_CHECKPOINTING=true)'
)


def enable(
    model: nn.Module,
    example: dict[str, Any],
    budget: int | str = DEFAULT_BUDGET,
    *,
    accelerator: Any = None,
    **kwargs: Any,
) -> Plan:
    """Plan `model`'s training step on the batch `example` (the keyword inputs of its call, labels
    included) under `budget` and install the plan (`remat.auto` with the model's own loss); Hugging
    Face's gradient checkpointing is switched off first. Returns the plan.

    `accelerator`: the `accelerate.Accelerator` that will prepare the model, before
    `accelerator.prepare`: its FSDP2 plugin's activation checkpointing is refused, and so is a
    plan with a region FSDP cannot run (one that continues into a layer accelerate will shard on
    its own). A model already sharded with FSDP2 is planned as its bare model. With FSDP,
    `kwargs` may be `strategy`, `profile`, `optimizer` (the planner's) and `check`; otherwise any
    of `remat.auto`'s. `check=True` (the default): the first training step checks itself against
    the plan and warns naming the modules that differ (`remat.applying.first_step`)."""
    _switch_off_hf_checkpointing(model)
    if accelerator is not None:
        check_accelerator(accelerator)
    from remat.tracing.fsdp import is_fsdp_sharded

    units = _units_accelerate_will_shard(accelerator, model)
    if not units and not is_fsdp_sharded(model):
        from remat.applying.auto import auto

        return auto(model, **example, budget=budget, loss_fn=_own_loss, **kwargs)
    return _plan_for_fsdp(model, example, budget, units, **kwargs)


def check_accelerator(accelerator: Any, *models: nn.Module) -> None:
    """Refuse what accelerate does on top of a remat plan: its FSDP plugin's activation
    checkpointing (it wraps the layers in `CheckpointWrapper` at prepare, after the plan, so each
    planned layer would be checkpointed twice), and, for each prepared `models` that has a plan,
    a region that FSDP cannot run (one that continues into a layer FSDP shards on its own).
    Call it after `accelerator.prepare` for a plan made with `remat.auto` before it; `enable(...,
    accelerator=)` calls it before."""
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if plugin is not None and plugin.activation_checkpointing:
        wrapped = [p for m in models for p in checkpointed_elsewhere(m)]
        where = f" (it wrapped {', '.join(repr(p) for p in wrapped[:3])})" if wrapped else ""
        raise RematError(
            f"accelerate checkpoints the layers itself{where}: {_ACCELERATE_AC}. Each planned "
            "layer would be checkpointed twice: accelerate's wrapper keeps none of the layer's "
            "activations, whatever remat's plan keeps, and its recomputation does not restore "
            "the random state (dropout masks differ from the forward's). Set "
            "activation_checkpointing=False and let remat plan the layers"
        )
    for model in models:
        plan = installed_plan(model)
        if plan is not None:
            _refuse_regions_fsdp_cannot_run(plan, model, set())


def _switch_off_hf_checkpointing(model: nn.Module) -> None:
    """Hugging Face's own checkpointing off (its 5.x name first, then the deprecated one), saying
    so: remat's plan replaces it."""
    on = getattr(model, "is_activation_checkpointing", None)
    if on is None:
        on = getattr(model, "is_gradient_checkpointing", False)
    if not on:
        return
    off = getattr(model, "activation_checkpointing_disable", None)
    (off or model.gradient_checkpointing_disable)()
    log.info(
        "remat: Hugging Face's gradient checkpointing switched off on %s "
        "(TrainingArguments(gradient_checkpointing=True) or activation_checkpointing=True): "
        "remat's plan replaces it (it would checkpoint the layers twice)",
        type(model).__name__,
    )


def _units_accelerate_will_shard(accelerator: Any, model: nn.Module) -> set[str]:
    """The paths of the submodules `accelerator.prepare` will shard as units of their own, by
    accelerate's own wrap policy (every layer of `_no_split_modules` by default)."""
    plugin = getattr(getattr(accelerator, "state", None), "fsdp_plugin", None)
    if plugin is None:
        return set()
    if plugin.fsdp_version != 2:
        raise RematError(
            "accelerate's FSDP plugin is FSDP1: remat plans FSDP2 models (fully_shard). Use "
            "FullyShardedDataParallelPlugin(fsdp_version=2)"
        )
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy

    plugin.set_auto_wrap_policy(model)  # as prepare does first; it does it once
    policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
    if policy is None:
        return set()
    return {p for p, m in model.named_modules() if p and policy(m)}


def _refuse_regions_fsdp_cannot_run(plan: Plan, model: nn.Module, units: set[str]) -> None:
    from remat.layouts.parallel import regions_across_fsdp_units

    crossing = regions_across_fsdp_units(plan, model, units)
    if crossing:
        raise RematError(
            f"the plan's region {', '.join(crossing[0])} runs "
            f"{', '.join(repr(m) for m in crossing[0][1:])} inside "
            f"the forward of {crossing[0][0]!r}, but FSDP shards them as units of their own and "
            "gathers a unit's parameters only in its own call. Plan knowing the FSDP units: "
            "remat.integrations.hf.enable(model, batch, budget, accelerator=accelerator) before "
            "prepare, or a strategy of one block per region (strategy='milp', 'first_k', 'full' "
            "or 'selective')"
        )


def _plan_for_fsdp(
    model: nn.Module,
    example: dict[str, Any],
    budget: int | str,
    units: set[str],
    strategy: str = "auto",
    profile: str = "cpu",
    optimizer: str | None = None,
    check: bool = True,
) -> Plan:
    """Trace the bare model on fake tensors, plan, refuse a plan with a region FSDP cannot run
    and install it (with the first step's check, which skips a step whose parameters are FSDP's
    DTensors: `remat.applying.first_step`)."""
    from remat.applying import first_step
    from remat.applying.auto import plan_for_training
    from remat.applying.eager import apply, remove
    from remat.tracing.trace import trace

    remove(model)
    graph = trace(
        model, **example, loss_fn=_own_loss
    )  # as the bare model (`remat.layouts.parallel`)
    # ranked as `remat.auto` ranks the bare model's plans (checkpointing's measured host cost
    # included), untuned: a sharded step's first steps are not timed
    chosen, _, _ = plan_for_training(
        model, graph, (), example, budget, strategy, profile, optimizer, False
    )
    _refuse_regions_fsdp_cannot_run(chosen, model, units)
    apply(model, chosen)
    if check:
        first_step.install(model, chosen)
    log.info(
        "remat: installed %s on %s under FSDP2 (planned as the bare model, one rank's batch): "
        "predicted peak %s unsharded%s (remat.verify(model) checks the kept ops after a step)",
        chosen.strategy,
        type(model).__name__,
        format_bytes(chosen.predicted_peak_bytes),
        f" within {format_bytes(chosen.budget_bytes)}" if chosen.budget_bytes else "",
    )
    return chosen


def _own_loss(out: Any) -> torch.Tensor:
    return out.loss


def _unwrapped(model: nn.Module) -> nn.Module:
    """The model inside DDP's or accelerate's wrappers (their `.module`)."""
    while isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
    return model


def _callback_base() -> type:
    try:
        from transformers import TrainerCallback
    except ImportError as err:  # pragma: no cover - the hf extra is missing
        raise ImportError(
            "remat.integrations.hf needs Hugging Face transformers: pip install 'remat[hf]'"
        ) from err
    return TrainerCallback


class RematCallback(_callback_base()):  # type: ignore[misc]
    """Plans the model's training step from the Trainer's first batch (its shape, on the model's
    device) and installs the plan before the first step (`on_train_begin`); `plan` is then the
    plan. The batch is drawn without moving the random stream the Trainer shuffles with. Under
    FSDP2 the Trainer has sharded the model already: it is planned as the bare model (`enable`);
    FSDP's own activation checkpointing is refused by name. The Trainer's first step checks
    itself against the plan, once (`check=False` among `auto_kwargs` turns that off), and its
    first steps try the best few plans that fit, keeping the fastest (`remat.applying.tune_steps`;
    `tune=False` turns that off)."""

    def __init__(self, budget: int | str = DEFAULT_BUDGET, **auto_kwargs: Any):
        self.budget = budget
        self.auto_kwargs = auto_kwargs
        self.plan: Plan | None = None

    def on_train_begin(self, args, state, control, model=None, train_dataloader=None, **kwargs):
        if model is None or train_dataloader is None:
            raise ValueError("RematCallback needs the Trainer's model and train dataloader")
        fsdp = getattr(args, "fsdp_plugin_args", None) or {}
        if fsdp.get("fsdp_version", 2) != 2:
            raise RematError(
                "the Trainer shards with FSDP1: RematCallback plans FSDP2 models (fully_shard). "
                'Use fsdp_config={"fsdp_version": 2} (the default)'
            )
        if fsdp.get("activation_checkpointing"):
            raise RematError(
                f"the Trainer's FSDP checkpoints the layers itself: {_ACCELERATE_AC}; remat would "
                "checkpoint them twice. Leave it False and let RematCallback plan the layers"
            )
        target = _unwrapped(model)
        device = next(target.parameters()).device
        with torch.random.fork_rng(devices=[] if device.type != "cuda" else [device]):
            batch = next(iter(train_dataloader))
        example = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        self.plan = enable(target, example, self.budget, **self.auto_kwargs)
        return control
