"""remat inside Hugging Face's Trainer (`remat.integrations.hf.RematCallback`), and refusing to
checkpoint twice: a model whose layers Hugging Face or torch's CheckpointWrapper already
checkpoint is refused by name; the callback switches Hugging Face's own off, saying so."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import pytest
import torch
from torch import nn

import remat

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")


def _example():
    spec = importlib.util.spec_from_file_location(
        "hf_trainer", Path(__file__).parent.parent / "examples" / "hf_trainer.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_integration_trainer_callback_plans_from_the_batch_and_keeps_the_losses():
    result = _example().main(["--steps", "3", "--seq", "32"])
    assert result["equal"] and result["verified"]
    assert result["plan"].regions  # it checkpointed something: the run tested something


def test_integration_trainer_with_hf_gradient_checkpointing_switches_it_off(caplog):
    from remat.integrations.hf import RematCallback

    example = _example()
    torch.set_num_threads(1)
    model = example.build_model("gpt2", 32, seed=0)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    data = example.RandomTokens(8, 32, model.config.vocab_size, seed=1)
    baseline = example.train(model, data, steps=2, batch=4, seed=0)
    model.load_state_dict(initial)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    callback = RematCallback(budget="70%")
    logger = logging.getLogger("remat")
    logger.addHandler(caplog.handler)
    try:
        got = example.train(model, data, steps=2, batch=4, seed=0, callbacks=[callback])
    finally:
        logger.removeHandler(caplog.handler)
        remat.remove(model)
    assert not model.is_gradient_checkpointing
    assert any("gradient checkpointing switched off" in r.getMessage() for r in caplog.records)
    assert got["loss"] == pytest.approx(baseline["loss"], rel=1e-6)


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


def test_a_lora_model_traces_measures_and_plans_exactly():
    """PEFT's LoRA on a Hugging Face model (frozen base weights, trainable adapters): the trace
    saves what autograd saves, the peak is the measured one, and remat's plan verifies with the
    adapters' gradients unchanged."""
    peft = pytest.importorskip("peft")
    from remat import models
    from remat.trace import default_loss

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
