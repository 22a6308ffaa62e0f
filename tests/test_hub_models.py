"""Hugging Face models from the configs shipped with remat (`hf:<org>/<name>`): real sizes offline,
each model's own training loss."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import remat
from remat.errors import RematError, UnknownModelError
from remat.models import build
from remat.models.hf import shipped_names

pytest.importorskip("transformers")


def _bert_large_base() -> int:
    """BertModel of bert-large-uncased, layer by layer: embeddings (30522 + 512 + 2 positions and
    types, x 1024, + LayerNorm), 24 layers of attention (4 x (1024^2 + 1024)) + 2 LayerNorms +
    FFN (2 x 1024 x 4096 + 4096 + 1024), pooler (1024^2 + 1024)."""
    h, f = 1024, 4096
    embeddings = (30522 + 512 + 2) * h + 2 * h
    layer = 4 * (h * h + h) + 2 * 2 * h + (h * f + f) + (f * h + h)
    return embeddings + 24 * layer + (h * h + h)


#: Published parameter counts (SOURCES.md next to the configs), and the head each build has.
COUNTS = {
    "meta-llama/Llama-3.2-1B": 1_235_814_400,
    "meta-llama/Llama-3.2-3B": 3_212_749_824,
    "meta-llama/Llama-3.1-8B": 8_030_261_248,
    "meta-llama/Llama-3.1-70B": 70_553_706_496,
    "mistralai/Mistral-7B-v0.3": 7_248_023_552,
    "Qwen/Qwen2.5-7B": 7_615_616_512,
    "google/gemma-2-9b": 9_241_705_984,
    # + the masked-LM head: transform (1024^2 + 1024 + LayerNorm) and the decoder bias (30522);
    # BertForMaskedLM has no pooler
    "google-bert/bert-large-uncased": _bert_large_base()
    - (1024 * 1024 + 1024)
    + (1024 * 1024 + 1024 + 2 * 1024 + 30522),
    # ViTModel-H/14 without pooler: patch embedding (3 x 14^2 x 1280 + 1280), cls + 257
    # positions, 32 layers of 4 x (1280^2 + 1280) + 2 LayerNorms + 2 x 1280 x 5120 + 5120 + 1280,
    # final LayerNorm; + a 2-label classifier
    "google/vit-huge-patch14-224-in21k": (3 * 14 * 14 * 1280 + 1280)
    + 258 * 1280
    + 32 * (4 * (1280 * 1280 + 1280) + 4 * 1280 + 2 * 1280 * 5120 + 5120 + 1280)
    + 2 * 1280
    + (1280 * 2 + 2),
}


def test_every_shipped_config_is_counted():
    assert set(shipped_names()) == set(COUNTS)
    assert _bert_large_base() == 335_141_888  # the model card's "336M"


@pytest.mark.parametrize("hub_id", sorted(COUNTS))
def test_shipped_configs_build_at_their_published_size_on_meta(hub_id):
    model, inputs = build(f"hf:{hub_id}", batch=1, seq=128, dtype="bf16")
    assert sum(p.numel() for p in model.parameters()) == COUNTS[hub_id]
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert model.training and len(inputs) == 2


@pytest.mark.parametrize(
    "hub_id, task",
    [
        ("meta-llama/Llama-3.2-1B", None),
        ("google-bert/bert-large-uncased", None),
        ("google-bert/bert-large-uncased", "sequence-classification"),
        ("google/vit-huge-patch14-224-in21k", None),
    ],
)
def test_a_tiny_shipped_model_returns_its_own_loss_and_traces_as_autograd_saves(hub_id, task):
    torch.manual_seed(0)
    extra = {"task": task} if task else {}
    overrides = {"image_size": 32, "patch_size": 8} if "vit" in hub_id else {}
    model, (x, labels) = build(
        f"hf:{hub_id}", batch=2, seq=16, tiny=True, device="cpu", **extra, **overrides
    )
    model.eval()  # dropout off: the same loss twice
    loss = model(x, labels)
    logits = model.model(**{model.input_name: x}).logits
    if "Llama" in hub_id:  # causal LM: shifted labels, logits upcast to fp32
        expected = nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten()
        )
    else:
        expected = nn.functional.cross_entropy(logits.flatten(0, -2), labels.flatten())
    torch.testing.assert_close(loss, expected)
    model.train()
    real = remat.trace(model, x, labels, device="cpu")
    fake = remat.trace(model, x, labels)
    assert real.info["loss"] == fake.info["loss"] == "model"
    assert real.activation_bytes == fake.activation_bytes > 0


def test_unknown_shipped_names_and_tasks_say_what_exists():
    with pytest.raises(UnknownModelError, match="did you mean hf:meta-llama/Llama-3.2-1B"):
        build("hf:meta-llama/Llama-3.2-1b")
    with pytest.raises(UnknownModelError, match="choose one of causal-lm"):
        build("hf:google-bert/bert-large-uncased", task="translation")
    with pytest.raises(RematError, match="max_position_embeddings=512"):
        build("hf:google-bert/bert-large-uncased", seq=1024)
