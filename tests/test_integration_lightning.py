"""remat inside Lightning (`remat.integrations.lightning.RematCallback`): the Trainer's losses are
those of the run without remat, the plan is carried out, and Lightning's own activation
checkpointing is refused by name."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest
from torch import nn

import remat

pytest.importorskip("lightning")


def _example():
    spec = importlib.util.spec_from_file_location(
        "lightning_trainer", Path(__file__).parent.parent / "examples" / "lightning_trainer.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_integration_lightning_callback_keeps_the_losses_and_verifies():
    result = _example().main(["--steps", "3"])
    assert result["equal"] and result["verified"]
    assert result["plan"].regions  # something was checkpointed: the run tested something


def test_integration_lightning_refuses_its_own_activation_checkpointing():
    from lightning.pytorch.strategies import FSDPStrategy

    from remat.integrations.lightning import RematCallback

    strategy = FSDPStrategy(activation_checkpointing_policy={nn.Linear})
    trainer = SimpleNamespace(strategy=strategy, train_dataloader=None)
    with pytest.raises(remat.RematError, match="FSDPStrategy checkpoints activations itself"):
        RematCallback().on_train_start(trainer, nn.Linear(2, 2))
