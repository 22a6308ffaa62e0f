"""remat inside Lightning (`remat.integrations.lightning`): under the Trainer's strategies and
Fabric, on one process and on two under torchrun, the losses are those of the run without remat
and the plan is carried out; Lightning's own activation checkpointing, checkpointing added after
the plan, and a region that FSDP would gather block by block are refused by name."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torchrun import torchrun

import remat
from remat import models

pytest.importorskip("lightning")

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _example(name: str = "lightning_trainer"):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _planned_module(n_layer: int = 2, strategy: str = "full"):
    """The example's LightningModule with remat's tiny GPT-2 of `n_layer` blocks, planned by
    `strategy`."""
    from remat.integrations.lightning import plan

    module = _example().LitLM(17)
    module.model, (ids, _) = models.build("gpt2", batch=2, seq=17, device="cpu", tiny=True,
                                        n_layer=n_layer)  # fmt: skip
    chosen = plan(module, "1TiB", batch=(ids,), strategy=strategy)
    return module, chosen


def test_integration_lightning_callback_keeps_the_losses_and_verifies(recwarn):
    result = _example().main(["--steps", "3"])
    assert result["equal"] and result["verified"]
    assert any(region.keep for region in result["plan"].regions)  # selective: ops matched
    first = result["first_step"]  # the callback's check of the first step, which did not warn
    assert first is not None and not first.warned  # (checkpoint's RNG states are not ops: 10 KB)
    assert abs(first.held_bytes_counted / first.held_bytes_predicted - 1) < 0.01
    assert not [w for w in recwarn if "first training step" in str(w.message)]


def test_integration_lightning_fabric_setup_keeps_the_losses_and_verifies(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))  # it takes lightning_trainer's FSDP1-on-CPU shim
    result = _example("lightning_fabric").main(["--steps", "3"])
    assert result["equal"] and result["verified"]
    # the plan installed after 3 steps is the one the first-steps tuning's schedule has reached:
    # which candidate (selective or whole blocks) depends on the cost model's order of them
    assert result["plan"].regions


@pytest.mark.distributed
@pytest.mark.parametrize(
    "args",
    [["--strategy", "fsdp"], ["--strategy", "model-parallel"],
     ["--strategy", "model-parallel", "--tp", "2"]],
    ids=["fsdp1", "fsdp2", "tp-fsdp2"],
)  # fmt: skip
def test_integration_lightning_trainer_strategies_keep_the_losses_on_two_ranks(args):
    """Two gloo ranks: every rank's losses equal the run without remat, every kept op matched.
    (DDP, and Fabric with tensor parallelism, run the same way: `examples/lightning_*.py
    --strategy ddp`, `--tp 2`; left out of the suite for its time.)"""
    torchrun(EXAMPLES / "lightning_trainer.py", *args, timeout=120)


@pytest.mark.distributed
@pytest.mark.parametrize(
    "args",
    [["--strategy", "fsdp"], ["--strategy", "model-parallel"]],
    ids=["fsdp1", "fsdp2"],
)  # fmt: skip
def test_integration_lightning_fabric_strategies_keep_the_losses_on_two_ranks(args):
    torchrun(EXAMPLES / "lightning_fabric.py", *args, timeout=120)


def test_integration_lightning_refuses_its_own_activation_checkpointing():
    from lightning.fabric.strategies import FSDPStrategy as FabricFSDP
    from lightning.pytorch.strategies import FSDPStrategy

    from remat.integrations.lightning import RematCallback, fabric_setup
    from remat.models.gpt import Block

    module = _example().LitLM(17)
    trainer = SimpleNamespace(strategy=FSDPStrategy(activation_checkpointing_policy={Block}))
    with pytest.raises(remat.RematError, match="FSDPStrategy checkpoints activations itself"):
        RematCallback().setup(trainer, module, "fit")
    fabric = SimpleNamespace(strategy=FabricFSDP(activation_checkpointing_policy={Block}))
    with pytest.raises(remat.RematError, match="FSDPStrategy checkpoints activations itself"):
        fabric_setup(fabric, module.model, example=(torch.zeros(1, 8, dtype=torch.long),))
    assert remat.installed_plan(module.model) is None  # nothing planned


def test_integration_lightning_refuses_checkpointing_added_after_the_plan():
    """What configure_model wraps after the callback planned in setup (ModelParallelStrategy's
    order) would be checkpointed twice: refused before the first step, naming the module."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
    )

    from remat.integrations.lightning import RematCallback
    from remat.models.gpt import Block

    module, chosen = _planned_module()
    assert chosen.regions
    apply_activation_checkpointing(module, check_fn=lambda m: isinstance(m, Block))
    trainer = SimpleNamespace(strategy=None)
    with pytest.raises(remat.RematError, match="checkpointed after remat planned them.*h.0"):
        RematCallback().on_train_start(trainer, module)


def test_integration_lightning_refuses_a_region_that_fsdp_gathers_block_by_block():
    """sqrt's regions run two blocks each; fully_shard on each block gathers its parameters only
    when that block is called, which the region's first block bypasses for the second."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from remat.integrations.lightning import RematCallback

    module, chosen = _planned_module(n_layer=4, strategy="sqrt")
    assert max(len(region.modules) for region in chosen.regions) == 2
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        for block in module.model.h:
            fully_shard(block, mesh=mesh)
        with pytest.raises(remat.RematError, match="runs 2 blocks as one checkpoint"):
            RematCallback().on_train_start(SimpleNamespace(strategy=None), module)
    finally:
        dist.destroy_process_group()


def test_integration_lightning_says_where_to_plan_when_setup_cannot():
    """Under a sharding strategy the callback plans in setup: a module whose layers do not exist
    yet, or one laid out tensor-parallel in configure_model, is told where to call plan()."""
    import lightning.pytorch as L
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    from remat.integrations.lightning import RematCallback

    trainer = SimpleNamespace(strategy=FSDPStrategy())
    with pytest.raises(remat.RematError, match="no parameters before configure_model"):
        RematCallback().setup(trainer, L.LightningModule(), "fit")
    trainer = SimpleNamespace(strategy=ModelParallelStrategy())
    with pytest.raises(remat.RematError, match="plan\\(self, budget\\) in configure_model"):
        RematCallback().on_train_start(trainer, _example().LitLM(17))
