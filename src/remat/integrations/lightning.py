"""remat in Lightning: a callback that plans the LightningModule's `training_step` on the
Trainer's first batch and installs the plan before the first step.

    trainer = L.Trainer(..., callbacks=[RematCallback(budget="70%")])

The plan is made for what `training_step` returns (its loss, or the dict's "loss"), on the module
after `configure_model` (Lightning calls `on_train_start` after it); Lightning's own activation
checkpointing (`FSDPStrategy(activation_checkpointing_policy=...)`) is refused by name, and
modules it or anything else already wrapped are refused by `remat.apply`.
"""

from __future__ import annotations

from typing import Any
from unittest import mock

import torch
from torch import nn

from remat.plans import DEFAULT_BUDGET, Plan


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


class RematCallback(_base()):  # type: ignore[misc]
    """Plans `training_step` on the Trainer's first train batch (moved to the module's device)
    under `budget` and installs the plan (`on_train_start`); `plan` is then the plan and
    `step` the traced `TrainingStep` (`remat.verify(callback.step, batch)` checks it). The
    batch is drawn without moving the random stream Lightning shuffles with."""

    def __init__(self, budget: int | str = DEFAULT_BUDGET, **auto_kwargs: Any):
        self.budget = budget
        self.auto_kwargs = auto_kwargs
        self.plan: Plan | None = None
        self.step: TrainingStep | None = None

    def on_train_start(self, trainer: Any, pl_module: nn.Module) -> None:
        from lightning.fabric.utilities.apply_func import move_data_to_device

        from remat.eager import auto
        from remat.errors import RematError

        policy = getattr(trainer.strategy, "_activation_checkpointing_kwargs", None)
        if policy:
            raise RematError(
                f"{type(trainer.strategy).__name__} checkpoints activations itself "
                f"({policy}): remat would checkpoint the same layers twice. Leave "
                "activation_checkpointing_policy unset and let RematCallback plan them"
            )
        with torch.random.fork_rng():
            batch = next(iter(trainer.train_dataloader))
        batch = move_data_to_device(batch, pl_module.device)
        self.step = TrainingStep(pl_module)
        self.plan = auto(self.step, batch, budget=self.budget, **self.auto_kwargs)
