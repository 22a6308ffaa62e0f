"""The frameworks' own model code as the model (`torchtune:`, `torchtitan:`), when installed: the
step's loss is the framework's, and the traced step saves what autograd saves."""

from __future__ import annotations

import pytest
import torch

import remat
from remat.errors import UnknownModelError
from remat.models import build


def test_torchtitan_llama_returns_its_trainers_loss_and_traces_exactly():
    pytest.importorskip("torchtitan")
    from torchtitan.components.loss import cross_entropy_loss

    torch.manual_seed(0)
    model, (tokens, labels) = build("torchtitan:llama3:debugmodel", batch=2, seq=32, device="cpu")
    with torch.no_grad():  # torchtitan 0.2 leaves the weights uninitialised: give them values
        for p in model.parameters():
            p.normal_(0, 0.02)
    loss = model(tokens, labels)
    pred = model(tokens)
    expected = cross_entropy_loss(pred, labels) / labels.numel()
    torch.testing.assert_close(loss, expected)
    tables = [b for n, b in model.named_buffers() if n.endswith(("freqs_cis", "rope.cache"))]
    assert tables and all(t.dtype == torch.complex64 for t in tables)  # complex, as torchtitan's
    real = remat.trace(model, tokens, labels, device="cpu")
    fake = remat.trace(model, tokens, labels)
    assert real.info["loss"] == "model"
    assert real.activation_bytes == fake.activation_bytes > 0


def test_torchtitan_flavors_take_overrides_by_field_name():
    pytest.importorskip("torchtitan")
    model, _ = build(
        "torchtitan:llama3:8B",
        batch=1,
        seq=128,
        dtype="bf16",
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=32,
        vocab_size=32000,
        multiple_of=256,
        ffn_dim_multiplier=None,
        rope_theta=10000,
    )
    assert sum(p.numel() for p in model.parameters()) == 6_738_415_616  # Llama 2 7B
    # q, k, v by three matmuls, as in torchtitan before 0.3 (0.3's flavors fuse them)
    separate, _ = build("torchtitan:llama3:8B", batch=1, seq=128, n_layers=1, fuse_qkv=False)
    names = [n.rsplit(".", 2)[-2] for n, _ in separate.named_parameters()]
    assert {"wq", "wk", "wv"} <= set(names) and "wqkv" not in names
    with pytest.raises(UnknownModelError, match="no 'hidden'"):
        build("torchtitan:llama3:8B", hidden=3)
    with pytest.raises(UnknownModelError, match="8B"):
        build("torchtitan:llama3:9B")


def test_torchtune_step_is_the_recipes_shifted_chunked_cross_entropy():
    pytest.importorskip("torchtune")
    from torchtune.modules.loss import CEWithChunkedOutputLoss

    model, (tokens, labels) = build("torchtune:llama3_2_1b", batch=1, seq=64, dtype="bf16")
    assert sum(p.numel() for p in model.parameters()) == 1_235_814_400
    assert isinstance(model.loss, CEWithChunkedOutputLoss) and model.model.num_output_chunks == 8
    graph = remat.trace(model, tokens, labels, target="cuda:sm80")
    # the recipe's 8 chunks: one fp32 log-softmax saved per chunk, 8 x 8 tokens x 128256 x 4 B
    by_op = {o.op: o for o in remat.estimate(graph).by_op}
    assert by_op["_log_softmax"].count == 8
    assert by_op["_log_softmax"].activation_bytes == 64 * 128256 * 4
    plain, _ = build(
        "torchtune:llama3_2_1b", batch=1, seq=64, dtype="bf16", loss="CrossEntropyLoss"
    )
    assert isinstance(plain.loss, torch.nn.CrossEntropyLoss)
    with pytest.raises(UnknownModelError, match="no builder"):
        build("torchtune:llama9_100b")
