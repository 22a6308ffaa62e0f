"""remat in Lightning: `RematCallback` for the Trainer, `plan` for a LightningModule the user lays
out by hand in `configure_model`, `fabric_setup` for Fabric.

    trainer = L.Trainer(..., callbacks=[RematCallback(budget="70%")])

A plan is made for what `training_step` returns (its loss, or the dict's "loss") on the module as
it will compute, and before anything shards its parameters: FSDPStrategy's FSDP1 flattens them
into per-rank shards and `fully_shard` (ModelParallelStrategy) makes them DTensor shards that a
trace of the module cannot run. So under those two strategies the callback plans in `setup`,
before `configure_model` and the strategy's wrapping (on the layers `__init__` built); under the
others in `on_train_start`, after `configure_model`. With tensor parallelism the plan must see
the layout: `plan(self)` in `configure_model`, after `parallelize_module` and before
`fully_shard`.

Never twice: Lightning's own activation checkpointing (`activation_checkpointing_policy`) is
refused by name, and so is checkpointing that `configure_model` (or Fabric's `parallelize_fn`)
adds around a planned module; a region that runs several blocks as one checkpoint is refused
when FSDP gathers those blocks' parameters separately.
"""

from __future__ import annotations

from typing import Any
from unittest import mock

import torch
from torch import nn

from remat.applying import tune_steps
from remat.applying.eager import installed_plan
from remat.applying.first_step import FirstStepCheck
from remat.errors import RematError
from remat.planning.plans import DEFAULT_BUDGET, Plan

_STEP = "_remat_training_step"  # the LightningModule's planned TrainingStep, in its __dict__


def _base() -> type:
    try:
        from lightning.pytorch import Callback
    except ImportError as err:  # pragma: no cover - the integrations extra is missing
        raise ImportError(
            "remat.integrations.lightning needs Lightning: pip install 'remat[integrations]'"
        ) from err
    return Callback


class TrainingStep(nn.Module):
    """A LightningModule's `training_step` as a module to trace: its forward is the step's loss
    on a fixed batch. Its only child is the LightningModule, under the name `module`, so a plan's
    paths are the LightningModule's prefixed with "module."; it shares the LightningModule's
    submodules, so a plan installed on it runs in Lightning's own steps."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, batch: Any) -> torch.Tensor:
        # self.log inside the step would record traced values in the Trainer's results
        with mock.patch.object(self.module, "log"), mock.patch.object(self.module, "log_dict"):
            out = self.module.training_step(batch, 0)
        return out["loss"] if isinstance(out, dict) else out


def _first_batch(trainer: Any) -> Any:
    """The Trainer's first train batch, drawn without moving the random stream Lightning shuffles
    with; before the fit loop has set its loader up (`setup`, `configure_model`), from the loader
    it will set up (a DataLoader given to `fit`, or the module's or datamodule's
    `train_dataloader()`), whose batches have the same shapes."""
    loader = trainer.train_dataloader
    if loader is None:
        loader = trainer.fit_loop._data_source.dataloader()
    with torch.random.fork_rng(devices=[]):
        return next(iter(loader))


def plan(
    module: nn.Module, budget: int | str = DEFAULT_BUDGET, batch: Any = None, **auto_kwargs: Any
) -> Plan:
    """Plan the LightningModule's `training_step` on `batch` (default: its Trainer's first train
    batch) under `budget` and install the plan (`remat.auto`; `auto_kwargs` go to it); a later
    call replaces it. Call it where the module computes as it will train and is not sharded yet:
    in `configure_model` after tensor parallelism and before `fully_shard`."""
    from lightning.fabric.utilities.apply_func import move_data_to_device

    from remat.applying.auto import auto

    if batch is None:
        batch = _first_batch(module.trainer)
    batch = move_data_to_device(batch, module.device)
    step = vars(module).get(_STEP)
    if step is None:
        step = TrainingStep(module)
        vars(module)[_STEP] = step  # not a submodule: the step holds the module, not the reverse
    return auto(step, batch, budget=budget, **auto_kwargs)


def _installed(module: nn.Module) -> Plan | None:
    """The plan installed on the LightningModule's TrainingStep, or None."""
    step = vars(module).get(_STEP)
    return None if step is None else installed_plan(step)


def _refuse_own_checkpointing(strategy: Any) -> None:
    """FSDPStrategy's (Trainer's or Fabric's) `activation_checkpointing_policy` wraps the blocks
    in torch's CheckpointWrapper after remat planned them."""
    policy = getattr(strategy, "_activation_checkpointing_kwargs", None)
    if policy:
        raise RematError(
            f"{type(strategy).__name__} checkpoints activations itself ({policy}): remat would "
            "checkpoint the same layers twice. Leave activation_checkpointing_policy unset and "
            "let remat plan them"
        )


def _tensor_parallel_size(strategy: Any) -> int:
    mesh = getattr(strategy, "_device_mesh", None)
    if mesh is None or "tensor_parallel" not in (mesh.mesh_dim_names or ()):
        return 1
    return mesh["tensor_parallel"].size()


def _shards(strategy: Any) -> bool:
    """Whether `strategy` shards the module's parameters (after `setup`'s hook)."""
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    return isinstance(strategy, (FSDPStrategy, ModelParallelStrategy))


def _check_installed(planned: nn.Module, plan: Plan, where: str) -> None:
    """Refuse what happened to `planned` (its plan installed) after planning that the plan does
    not survive: checkpointing added around its modules (by `where`), and a region that runs
    blocks FSDP gathers separately (the region's first block calls the others' forwards itself,
    outside the hooks that gather their parameters)."""
    from remat.applying.eager import checkpointed_elsewhere

    found = checkpointed_elsewhere(planned)
    if found:
        raise RematError(
            f"{len(found)} module(s) were checkpointed after remat planned them ({found[0]!r}"
            f"{' and more' if len(found) > 1 else ''}): remat would checkpoint them twice. "
            f"Leave activation checkpointing (checkpoint_wrapper, apply_activation_checkpointing,"
            f" torchtitan's apply_ac) out of {where}; remat's plan replaces it"
        )
    from remat.layouts.parallel import regions_across_fsdp_units

    crossing = regions_across_fsdp_units(plan, planned)
    if crossing:
        modules = crossing[0]
        raise RematError(
            f"plan region {modules} runs {len(modules)} blocks as one "
            "checkpoint, but FSDP shards them as separate units, whose parameters are "
            "gathered only when each is called: plan block by block (strategy='milp', "
            "'selective' or 'full') or shard these blocks as one unit"
        )


class RematCallback(_base()):  # type: ignore[misc]
    """Plans `training_step` on the Trainer's first train batch (moved to the module's device)
    under `budget` and installs the plan before the first step: in `setup` under FSDPStrategy and
    ModelParallelStrategy (before anything shards the parameters), else in `on_train_start`.
    A plan `plan(self)` made in `configure_model` during this fit is taken as it is (the way
    with tensor parallelism). `plan` is then the plan and `step` the planned `TrainingStep`
    (`remat.verify(callback.step)` checks it after a step). The batch is drawn without moving
    the random stream Lightning shuffles with.

    `check=True`: the first training step checks itself against the plan, from the batch's
    start to `on_before_backward` (its forward and loss: what the plan holds) and, on CUDA, to
    the end of its backward, warning where they differ (`remat.applying.first_step`; `check`
    is the first step's `FirstStepCheck`, with its `report` after the step)."""

    def __init__(self, budget: int | str = DEFAULT_BUDGET, check: bool = True, **auto_kwargs: Any):
        self.budget = budget
        # Lightning calls training_step, not the TrainingStep's forward: the callback's hooks
        # bound the step, not auto's forward hooks
        self.auto_kwargs = {**auto_kwargs, "check": False}
        self.plan: Plan | None = None
        self.step: TrainingStep | None = None
        self.check: FirstStepCheck | None = None
        self._checks = check
        self._earlier: Plan | None = None  # the module's plan from before this fit

    def setup(self, trainer: Any, pl_module: nn.Module, stage: str) -> None:
        if stage != "fit":
            return
        strategy = trainer.strategy
        _refuse_own_checkpointing(strategy)
        self._earlier = _installed(pl_module)
        if not _shards(strategy) or _tensor_parallel_size(strategy) > 1:
            return
        if not any(True for _ in pl_module.parameters()):
            raise RematError(
                f"{type(pl_module).__name__} has no parameters before configure_model: under "
                f"{type(strategy).__name__} RematCallback plans before configure_model, whose "
                "sharding a plan cannot follow. Build the layers in __init__ (`with "
                "trainer.init_module(empty_init=True)` keeps that cheap), or call "
                "remat.integrations.lightning.plan(self, budget) in configure_model before "
                "anything shards them"
            )
        plan(pl_module, self.budget, **self.auto_kwargs)

    def on_train_start(self, trainer: Any, pl_module: nn.Module) -> None:
        strategy = trainer.strategy
        if _installed(pl_module) is self._earlier:  # not planned in setup or configure_model
            if _shards(strategy):
                raise RematError(
                    f"{type(strategy).__name__} with tensor parallelism: remat plans the layout "
                    "the rank runs, so call remat.integrations.lightning.plan(self, budget) in "
                    "configure_model after parallelize_module and before fully_shard"
                )
            plan(pl_module, self.budget, **self.auto_kwargs)
        self.step = vars(pl_module)[_STEP]
        self.plan = installed_plan(self.step)
        _check_installed(self.step, self.plan, "configure_model")
        if self._checks:
            self.check = FirstStepCheck(self.step, self.plan)

    def on_train_batch_start(self, trainer: Any, pl_module: nn.Module, batch: Any, i: int) -> None:
        if self.check is not None and self.step is not None:
            self.check.before(self.step, (), {})
        if self.step is not None:  # auto's first-steps tuning, on Lightning's step boundaries
            tune_steps.step_began(self.step)

    def on_after_backward(self, trainer: Any, pl_module: nn.Module) -> None:
        if self.step is not None:
            tune_steps.step_ended(self.step)

    def on_before_backward(self, trainer: Any, pl_module: nn.Module, loss: torch.Tensor) -> None:
        if self.check is not None and self.step is not None:
            self.check.after(self.step, (), loss)

    def on_train_batch_end(self, trainer: Any, pl_module: nn.Module, *args: Any) -> None:
        if self.check is not None:
            self.check.abort()  # a step that returned no loss: the next one is checked

    def on_exception(self, trainer: Any, pl_module: nn.Module, exception: BaseException) -> None:
        if self.check is not None:
            self.check.abort()


def fabric_setup(
    fabric: Any,
    module: nn.Module,
    *optimizers: Any,
    example: tuple,
    budget: int | str = DEFAULT_BUDGET,
    **auto_kwargs: Any,
) -> Any:
    """`fabric.setup(module, *optimizers)` with a plan: `module(*example)` is planned under
    `budget` (`remat.auto`; `loss_fn` and the rest of `auto_kwargs` go to it) and the plan
    installed before Fabric wraps or shards the module, then checked after. Returns what
    `fabric.setup` returns; `remat.verify(model.module)` checks the plan after a step.

    Refused: Fabric's own activation checkpointing (FSDPStrategy's
    `activation_checkpointing_policy`), and tensor parallelism, whose layout the plan must see:
    call `remat.auto` inside ModelParallelStrategy's `parallelize_fn`, after the tensor-parallel
    layout and before `fully_shard`, and `fabric.setup` as usual."""
    from remat.applying.auto import auto

    _refuse_own_checkpointing(fabric.strategy)
    if _tensor_parallel_size(fabric.strategy) > 1:
        raise RematError(
            f"{type(fabric.strategy).__name__} with tensor parallelism: remat plans the layout "
            "the rank runs, so call remat.auto(module, *example, budget=...) in parallelize_fn "
            "after the tensor-parallel layout and before fully_shard, then fabric.setup as usual"
        )
    chosen = auto(module, *example, budget=budget, **auto_kwargs)
    out = fabric.setup(module, *optimizers)
    _check_installed(module, chosen, "parallelize_fn")
    return out
