"""The traced activation bytes agree with the analytic formulas of the literature (docs/memory-model.md
explains every byte of difference). Traced on fake tensors at realistic sizes: nothing is allocated."""

from __future__ import annotations

import pytest

import remat
from remat import models
from remat.answers.report import block_activation_bytes


def per_layer_bytes(name: str, **kw) -> int:
    graph = remat.trace(*_build(name, **kw))
    blocks = block_activation_bytes(graph, remat.estimate(graph))
    return blocks[1][1]  # a middle layer: saved bytes are charged to the op that made them, so the
    # first layer also holds the model input and the last one lacks its output (nothing saves it)


def _build(name, **kw):
    model, inputs = models.build(name, **kw)
    return (model, *inputs)


@pytest.mark.parametrize(("s", "b", "h", "a"), [(2048, 1, 1024, 16), (512, 4, 2048, 32)])
def test_megatron_layer_matches_sbh_34_plus_5as_over_h(s, b, h, a):
    got = per_layer_bytes(
        "megatron-gpt", batch=b, seq=s, dtype="bf16", d_model=h, n_heads=a, n_layers=3
    )
    assert got == pytest.approx(s * b * h * (34 + 5 * a * s / h), rel=0.03)


@pytest.mark.parametrize(("s", "b", "h", "a"), [(2048, 1, 1024, 16), (512, 4, 2048, 32)])
def test_megatron_sdpa_layer_matches_34_sbh(s, b, h, a):
    got = per_layer_bytes(
        "megatron-gpt",
        batch=b,
        seq=s,
        dtype="bf16",
        d_model=h,
        n_heads=a,
        n_layers=3,
        attention="sdpa",
    )
    assert got == pytest.approx(34 * s * b * h, rel=0.03)


def llama_layer_bytes(s: int, b: int, h: int, heads: int, ffn: int) -> int:
    """Bytes one bf16 Llama layer keeps, derived in docs/memory-model.md: two RMSNorms computed in
    fp32 (8 sbh each), attention as torchtitan runs it (q after RoPE, K and V repeated to every
    head, the output: 4 x 2 sbh, whatever the K/V heads) + fp32 log-sum-exp, SwiGLU 4 x 2 s b ffn."""
    sbh = s * b * h
    norms = 2 * ((4 + 2 + 2) * sbh + 4 * s * b)  # + the fp32 rsqrt per token
    attention = 4 * 2 * sbh + 4 * b * heads * s
    mlp = 4 * 2 * s * b * ffn
    return norms + attention + mlp


def test_llama_3_1_70b_layer_at_8k_matches_its_derivation():
    got = per_layer_bytes("llama-3.1-70b", batch=1, seq=8192, dtype="bf16", n_layers=3)
    assert got == llama_layer_bytes(8192, 1, 8192, 64, 28672)
