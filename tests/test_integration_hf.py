"""remat inside Hugging Face's Trainer, TRL's SFTTrainer and accelerate
(`remat.integrations.hf`): the losses are those of the run without remat, the plan is carried out,
and nothing is checkpointed twice: a model whose layers Hugging Face or torch's CheckpointWrapper
already checkpoint is refused by name, the callback switches Hugging Face's own off, saying so,
and accelerate's FSDP activation checkpointing is refused naming the setting. Under accelerate's
FSDP2 (two gloo processes): plan, then prepare; and the Trainer's callback on the sharded model."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torchrun import torchrun

import remat

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _example():
    spec = importlib.util.spec_from_file_location("hf_trainer", EXAMPLES / "hf_trainer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_integration_trainer_callback_plans_from_the_batch_and_keeps_the_losses(recwarn):
    result = _example().main(["--steps", "3", "--seq", "32"])
    assert result["equal"] and result["verified"]
    assert result["plan"].regions  # it checkpointed something: the run tested something
    first = result["first_step"]  # the Trainer's first step checked itself, and did not warn
    assert first is not None and not first.warned
    assert abs(first.held_bytes_counted / first.held_bytes_predicted - 1) < 0.01
    assert not [w for w in recwarn if "first training step" in str(w.message)]


def test_integration_trainer_with_hf_gradient_checkpointing_switches_it_off(remat_log):
    """The example asserts that nothing but remat checkpoints the trained model."""
    result = _example().main(["--steps", "2", "--seq", "32", "--gradient-checkpointing"])
    assert result["equal"] and result["verified"] and result["plan"].regions
    assert any("gradient checkpointing switched off" in r.getMessage() for r in remat_log.records)


def test_integration_trainer_callback_on_a_lora_model_keeps_the_losses():
    """PEFT's LoRA (dropout 0.1 on the adapters, base frozen) under the Trainer's callback."""
    pytest.importorskip("peft")
    result = _example().main(["--steps", "2", "--seq", "32", "--lora"])
    assert result["equal"] and result["verified"]
    assert all(m.startswith("base_model.model.") for r in result["plan"].regions for m in r.modules)


def test_integration_trl_sft_trainer_keeps_the_losses_and_switches_its_checkpointing_off(
    remat_log,
):
    """TRL's SFTTrainer on pre-tokenized ids with a tokenizer built in memory: its defaults turn
    Hugging Face's gradient checkpointing and bf16 autocast on; the callback plans the autocast
    step (accelerate wraps the model's forward in it) and switches the checkpointing off."""
    pytest.importorskip("trl")
    result = _example().main(["--steps", "2", "--seq", "32", "--trl"])
    assert result["equal"] and result["verified"] and result["plan"].regions
    assert any("gradient checkpointing switched off" in r.getMessage() for r in remat_log.records)


@pytest.mark.distributed
def test_integration_trainer_fsdp2_plans_the_sharded_model_as_the_bare_one():
    """Trainer(fsdp=True, fsdp_config={"fsdp_version": 2}) on two ranks, with
    gradient_checkpointing=True: the callback switches that off, plans the sharded model exactly
    as the bare one (same plan; verified there), the sharded steps keep the planned ops, and the
    losses equal those without remat."""
    torchrun(
        EXAMPLES / "hf_trainer.py", "--fsdp", "--gradient-checkpointing",
        "--steps", "3", "--seq", "32", "--batch", "2", timeout=240,
    )  # fmt: skip


@pytest.mark.distributed
def test_integration_accelerate_fsdp2_plan_then_prepare_keeps_the_losses():
    torchrun(EXAMPLES / "accelerate_fsdp.py", timeout=240)


@pytest.mark.distributed
def test_integration_accelerate_activation_checkpointing_is_refused_before_and_after_prepare():
    """accelerate wraps the planned layers in its CheckpointWrapper at prepare, after remat's
    plan: `enable(accelerator=)` refuses before, `check_accelerator` after, naming the setting."""
    torchrun(EXAMPLES / "accelerate_fsdp.py", "--activation-checkpointing", timeout=240)


def _accelerator(**plugin_kwargs):
    """What `enable` and `check_accelerator` read of an Accelerator: its FSDP plugin (a real one;
    sharding itself needs the ranks of the torchrun tests)."""
    from accelerate import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(
        auto_wrap_policy="transformer_based_wrap", **plugin_kwargs
    )
    return SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin))


def _four_layer_gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=4, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    model = transformers.GPT2LMHeadModel(config).train()
    ids = torch.randint(0, 64, (2, 16))
    return model, {"input_ids": ids, "labels": ids}


def test_integration_accelerate_a_region_spanning_two_fsdp_units_is_refused_by_name():
    """A region of two blocks runs the second inside the first's forward, where FSDP has not
    gathered the second's parameters (accelerate shards every GPT2Block on its own): refused,
    naming the region; a plan of one block per region installs."""
    from remat.integrations.hf import enable

    model, example = _four_layer_gpt2()
    accelerator = _accelerator(fsdp_version=2)
    with pytest.raises(remat.RematError, match="runs 'transformer.h.1' inside the forward of"):
        enable(model, example, "1TiB", accelerator=accelerator, strategy="sqrt")
    assert not remat.checkpointed_elsewhere(model)
    plan = enable(model, example, "1TiB", accelerator=accelerator, strategy="full")
    assert [r.modules for r in plan.regions] == [(f"transformer.h.{i}",) for i in range(4)]
    assert remat.verify(model, **example, loss_fn=lambda out: out.loss).ok


def test_integration_accelerate_refuses_its_own_activation_checkpointing_and_fsdp1():
    from remat.integrations.hf import check_accelerator, enable

    model, example = _four_layer_gpt2()
    with pytest.raises(remat.RematError, match=r"activation_checkpointing=True\)"):
        check_accelerator(_accelerator(fsdp_version=2, activation_checkpointing=True))
    with pytest.raises(remat.RematError, match="fsdp_version=2"):
        enable(model, example, accelerator=_accelerator(fsdp_version=1))


def test_integration_trainer_callback_refuses_fsdp_activation_checkpointing_and_fsdp1():
    from remat.integrations.hf import RematCallback

    for settings, refusal in [
        ({"fsdp_version": 2, "activation_checkpointing": True}, "activation_checkpointing"),
        ({"fsdp_version": 1}, "FSDP1"),
    ]:
        args = SimpleNamespace(fsdp_plugin_args=settings)
        with pytest.raises(remat.RematError, match=refusal):
            RematCallback().on_train_begin(
                args, None, None, model=nn.Linear(2, 2), train_dataloader=[]
            )


def test_integration_remat_refuses_a_model_hugging_face_already_checkpoints():
    from remat.models.hf import build_for_training

    model, inputs = build_for_training("gpt2", seq=32)
    model.gradient_checkpointing_enable()
    with pytest.raises(remat.RematError, match="already checkpointed") as err:
        remat.auto(model, **inputs, loss_fn=lambda out: out.loss)
    assert "transformer.h.0" in str(err.value) and "gradient_checkpointing_disable" in str(
        err.value
    )


def test_integration_remat_refuses_checkpoint_wrapped_layers_by_name():
    """accelerate's and Lightning's FSDP activation checkpointing wrap layers in torch's
    CheckpointWrapper; remat names them instead of checkpointing them twice."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    model[0] = checkpoint_wrapper(model[0])
    assert remat.checkpointed_elsewhere(model) == ["0"]
    with pytest.raises(remat.RematError, match="already checkpointed.*'0'"):
        remat.auto(model, torch.randn(4, 8))


def test_integration_verify_is_not_ok_when_another_tool_wraps_a_planned_layer_afterwards():
    """accelerate's FSDP `activation_checkpointing` wraps layers at `prepare`, after remat's plan
    was installed: the kept ops still match inside, but the wrapper keeps nothing of the layer,
    so `verify` names it and is not ok."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from remat.models.hf import build_for_training

    model, inputs = build_for_training("gpt2", seq=32)
    remat.auto(model, **inputs, loss_fn=lambda out: out.loss, strategy="full", budget="100%")
    model.transformer.h[1] = checkpoint_wrapper(model.transformer.h[1])
    model(**inputs).loss.backward()
    check = remat.verify(model)
    assert check.kept_ops_matched == check.kept_ops_expected
    assert check.checkpointed_elsewhere == ("transformer.h.1",) and not check.ok
    assert "checkpointed elsewhere too: transformer.h.1" in repr(check)


def test_a_lora_model_traces_measures_and_plans_exactly():
    """PEFT's LoRA on a Hugging Face model (frozen base weights, trainable adapters): the trace
    saves what autograd saves, the peak is the measured one, and remat's plan verifies with the
    adapters' gradients unchanged."""
    peft = pytest.importorskip("peft")
    from remat import models
    from remat.tracing.trace import default_loss

    torch.manual_seed(0)
    model, inputs = models.build("hf:llama", tiny=True, device="cpu", batch=2, seq=32)
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    lora = peft.get_peft_model(model, config)
    graph = remat.trace(lora, *inputs)
    measured = remat.measure(lora, *inputs)
    assert graph.activation_bytes == measured.activation_bytes
    assert measured.peak_bytes == pytest.approx(remat.estimate(graph).peak_bytes, rel=1e-4)

    def adapter_grads() -> dict[str, torch.Tensor]:
        lora.zero_grad(set_to_none=True)
        default_loss(lora(*inputs)).backward()
        return {n: p.grad.clone() for n, p in lora.named_parameters() if p.requires_grad}

    before = adapter_grads()
    remat.auto(lora, *inputs, budget="90%")
    assert remat.verify(lora, *inputs).ok
    after = adapter_grads()
    assert before.keys() == after.keys() and all(torch.equal(before[n], after[n]) for n in before)
