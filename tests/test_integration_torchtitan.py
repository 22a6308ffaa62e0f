"""remat as torchtitan's activation checkpointing (`remat.integrations.torchtitan.RematAC`): the
plan made on the meta model survives torchtitan's parallelize (FSDP2), `to_empty` and
`init_weights` and trains as without checkpointing; layers torchtitan already wrapped are
refused by name; a Trainer.Config selects it, from a config function and the command line."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import pytest
import torch

import remat

pytest.importorskip("torchtitan")


def _example():
    spec = importlib.util.spec_from_file_location(
        "torchtitan_ac", Path(__file__).parent.parent / "examples" / "torchtitan_ac.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _meta_model(seq: int = 64) -> torch.nn.Module:
    from remat.models import build

    step, _ = build("torchtitan:llama3:debugmodel", seq=seq, device="meta", n_layers=2)
    return step.model


def test_integration_torchtitan_rematac_trains_as_without_checkpointing():
    """torchtitan's parallelize_llama (FSDP2, one gloo rank), to_empty, init_weights: the losses
    and gradient norms of every step equal the run without activation checkpointing, and the
    last step kept every op the plan keeps."""
    result = _example().main(["--steps", "2"])
    assert result["equal"] and result["verified"]
    assert result["remat"] == result["baseline"]
    assert result["plan"].regions  # it checkpointed something: the run tested something
    # what the blocks held for backward, measured under fully_shard, against the plan
    assert abs(result["held_ratio"] - 1) <= 0.05


def test_integration_torchtitan_rematac_refuses_layers_torchtitan_already_checkpoints(monkeypatch):
    from torchtitan.distributed.activation_checkpoint import SelectiveAC

    from remat.integrations.torchtitan import RematAC

    # torchtitan's apply turns dynamo's LRU cache off for the whole process; not in a test run
    monkeypatch.setattr(torch._C._dynamo.eval_frame, "_set_lru_cache", lambda use: None)
    model = _meta_model()
    SelectiveAC.Config().build(dump_folder="").apply(model)
    policy = RematAC.Config(local_batch_size=2, seq_len=64).build(dump_folder="")
    with pytest.raises(remat.RematError, match="already checkpointed") as err:
        policy.apply(model)
    assert "'layers.0'" in str(err.value) and "SelectiveAC" in str(err.value)
    assert RematAC.plan_of(model) is None


def test_integration_torchtitan_rematac_needs_the_steps_shape():
    from remat.integrations.torchtitan import RematAC

    with pytest.raises(remat.RematError, match="local_batch_size and seq_len"):
        RematAC.Config(budget="70%").build(dump_folder="").apply(_meta_model())


def test_integration_torchtitan_trainer_config_selects_rematac(monkeypatch):
    """A config function returns `trainer_config(...)`; torchtitan's own ConfigManager (tyro)
    parses it, switches to it by subcommand, sets its fields and hands it training's shape."""
    pytest.importorskip("torchtitan.trainer")  # the Trainer needs tensorboard and torchdata
    from torchtitan.config.manager import ConfigManager
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    from remat.integrations.torchtitan import RematAC, trainer_config

    configs = types.ModuleType("remat_torchtitan_configs")
    configs.llama3_remat = lambda: trainer_config(llama3_debugmodel(), budget="70%")
    monkeypatch.setitem(sys.modules, configs.__name__, configs)

    def parse(*args: str):
        argv = ["--module", configs.__name__, "--config", "llama3_remat", *args]
        return ConfigManager().parse_args(argv).activation_checkpoint

    ac = parse()
    assert isinstance(ac, RematAC.Config) and ac.budget == "70%"
    assert ac.step_shape() == (8, 2048, torch.bfloat16)  # llama3_debugmodel's training
    ac = parse("--training.local-batch-size", "2", "--training.seq-len", "64")
    assert ac.step_shape() == (2, 64, torch.bfloat16)
    ac = parse("activation-checkpoint:remat", "--activation-checkpoint.budget", "50%")
    assert ac.budget == "50%"
    assert type(parse("activation-checkpoint:selective")).__name__ == "Config"
    assert not isinstance(parse("activation-checkpoint:selective"), RematAC.Config)

    # what the trainer does with it: build the policy and apply it to the (meta) model
    ac = parse("--training.local-batch-size", "2", "--training.seq-len", "64")
    policy = ac.build(dump_folder="")
    assert isinstance(policy, RematAC)
    model = _meta_model(seq=64)
    policy.apply(model)
    assert RematAC.plan_of(model) is policy.plan and policy.plan.regions


def test_integration_torchtitan_rematac_plans_each_tensor_parallel_ranks_own_step(monkeypatch):
    """After torchtitan's tensor parallelism (DTensor weights, two fake ranks), RematAC plans the
    rank's local step: checkpointing every block, a rank holds less than the whole model's step,
    and less again with sequence parallelism (the blocks' inputs sharded by sequence)."""
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.models.llama3 as llama3
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.utils import get_spmd_backend, set_spmd_backend
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    from remat.integrations.torchtitan import RematAC
    from remat.layouts.parallel import fake_ranks

    monkeypatch.setattr(parallel_dims, "device_type", "cpu")  # torchtitan says "cuda" on a CPU

    def held_bytes(tp: int, sp: bool = False) -> int:
        config = llama3.model_registry("debugmodel").model
        config.layers = config.layers[:2]
        for _, _, parent, attr in list(config.traverse(FlexAttention.Config)):
            setattr(parent, attr, ScaledDotProductAttention.Config())
        set_llama3_sharding_config(config, enable_sp=sp)
        with torch.device("meta"):
            model = config.build()
        if tp > 1:
            parallelism = ParallelismConfig(
                tensor_parallel_degree=tp,
                spmd_backend="partial_dtensor",
                enable_sequence_parallel=sp,
            )
            dims = ParallelDims.from_config(parallelism, tp)
            dims.build_mesh()
            model.parallelize(dims)
            assert type(model.layers["0"].attention.wo.weight).__name__ == "DTensor"
        policy = RematAC.Config(
            strategy="full", local_batch_size=2, seq_len=256, mixed_precision_param="float32"
        ).build(dump_folder="")
        policy.apply(model)
        return policy.plan.held_bytes

    backend = get_spmd_backend()
    whole = held_bytes(1)
    set_spmd_backend("partial_dtensor")  # as the Trainer sets it from parallelism.spmd_backend
    try:
        with fake_ranks(2):
            tensor_parallel = held_bytes(2)
            sequence_parallel = held_bytes(2, sp=True)
    finally:
        set_spmd_backend(backend)
    assert sequence_parallel < tensor_parallel < whole
