"""Llama 2 and Llama 3 (Touvron et al. 2023; Llama Team 2024), computed as torchtitan's reference
Llama trains (pytorch/torchtitan `models/llama3/model/model.py`), with Hugging Face's module names.

RMSNorm before attention and MLP (in fp32, cast back), rotary position embeddings applied as
torchtitan does (q and k upcast to fp32 and multiplied by a complex64 `freqs_cis` table),
grouped-query attention with the K/V heads materialised for each group (`repeat_kv`, as torchtitan
and Meta's reference code do; `expand_kv=False` lets SDPA read them in place instead), a SwiGLU
MLP, no biases. Given labels, the model returns the training loss as the trainer takes it:
cross-entropy on the logits upcast to fp32 (torchtitan's `cross_entropy_loss`), or torchtune's
`CEWithChunkedOutputLoss` over `loss_chunks` sequence chunks. The presets carry the published
shapes, so their parameter counts are the models' own: 6.74e9, 1.24e9, 3.21e9, 8.03e9, 70.6e9,
405.9e9.

Llama 3.1's long-context RoPE frequency scaling is left out: it changes the values of the table,
not any shape, memory or time. The table is a buffer (not a parameter, not in the state dict)
sized to the run's `seq` (to `max(seq, max_seq_len)` where `max_seq_len` is given), as torchtitan sizes
it to `training.seq_len`, and kept complex64 whatever the model's dtype, as torchtitan keeps it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from remat.errors import RematError
from remat.models.preset import Preset, token_ids


@dataclass(frozen=True)
class LlamaConfig:
    n_layers: int = 32
    d_model: int = 4096
    n_heads: int = 32
    n_kv_heads: int = 32
    ffn_dim: int = 11008
    vocab_size: int = 32000
    rope_theta: float = 10000.0
    max_seq_len: int = 4096
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    expand_kv: bool = True  # repeat_kv materialises K/V per Q group; False: SDPA's enable_gqa
    loss_chunks: int = 0  # > 0: torchtune's chunked cross-entropy over that many sequence chunks

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads or self.n_heads % self.n_kv_heads:
            raise RematError(
                f"d_model={self.d_model} must be divisible by n_heads={self.n_heads}, "
                f"and n_heads by n_kv_heads={self.n_kv_heads}"
            )


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 and cast back, as Hugging Face does."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def precompute_freqs_cis(head_dim: int, end: int, theta: float) -> torch.Tensor:
    """torchtitan's RoPE table: (end, head_dim / 2) complex64 rotations, computed in fp32."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(end, dtype=torch.float32), freqs)
    return torch.polar(torch.ones_like(angles), angles)


def apply_rotary_emb(
    xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k (batch, seq, heads, head_dim) as complex numbers in fp32, then cast back.
    A longer table is cut to the sequence: a pipeline stage under sequence parallelism sees only
    its shard of the sequence when it takes the table, the attention the whole of it."""
    if freqs_cis.shape[0] != xq.shape[1]:
        freqs_cis = freqs_cis[: xq.shape[1]]
    shape = (1, xq.shape[1], 1, xq.shape[-1] // 2)
    freqs = freqs_cis.view(shape)
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    xq_out = torch.view_as_real(xq_ * freqs).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(batch, seq, kv_heads, head_dim) -> (batch, seq, kv_heads * n_rep, head_dim), a copy."""
    if n_rep == 1:
        return x
    b, t, n_kv, d = x.shape
    return x[:, :, :, None, :].expand(b, t, n_kv, n_rep, d).reshape(b, t, n_kv * n_rep, d)


class CrossEntropy(nn.Module):
    """torchtitan's `cross_entropy_loss` (components/loss.py): cross-entropy of the logits upcast
    to fp32. A module, the model's `loss`, as the trainers hold their loss: what they compile on
    its own (torchtitan's `build_cross_entropy_loss` under `--training.compile`, torchtune's
    `compile_loss`), remat's `--compile blocks+loss`."""

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


class ChunkedCrossEntropy(nn.Module):
    """torchtune's `CEWithChunkedOutputLoss` (the model's `loss` where `loss_chunks` > 0): given
    the logits of each sequence chunk (the output projection applied chunk by chunk, as
    torchtune's decoder does with `num_output_chunks`), each chunk upcast to fp32 and summed by
    cross-entropy, over the number of labels not ignored (-100)."""

    def __init__(self, chunks: int) -> None:
        super().__init__()
        self.chunks = chunks

    def forward(self, logits: list[torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
        total = sum(
            F.cross_entropy(
                chunk.reshape(-1, chunk.size(-1)).float(),
                target.reshape(-1),
                ignore_index=-100,
                reduction="sum",
            )
            for chunk, target in zip(logits, labels.chunk(self.chunks, dim=1), strict=True)
        )
        return total / (labels != -100).sum()


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.expand_kv = config.expand_kv
        self.head_dim = config.d_model // config.n_heads
        kv_dim = config.n_kv_heads * self.head_dim
        self.q_proj = nn.Linear(config.d_model, config.d_model, bias=False)
        self.k_proj = nn.Linear(config.d_model, kv_dim, bias=False)
        self.v_proj = nn.Linear(config.d_model, kv_dim, bias=False)
        self.o_proj = nn.Linear(config.d_model, config.d_model, bias=False)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # heads counted from the projections (-1), as torchtitan does: under tensor parallelism a
        # rank's projections hold its share of the heads
        q = self.q_proj(x).view(B, T, -1, self.head_dim)
        k = self.k_proj(x).view(B, T, -1, self.head_dim)
        v = self.v_proj(x).view(B, T, -1, self.head_dim)
        q, k = apply_rotary_emb(q, k, freqs_cis)
        n_rep = self.n_heads // self.n_kv_heads
        if self.expand_kv:
            k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
        # without the expansion, enable_gqa lets SDPA read each K/V head for its group of Q heads
        gqa = not self.expand_kv and n_rep > 1
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=gqa
        )
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    """SwiGLU (Shazeer 2020): down(silu(gate(x)) * up(x))."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.d_model, config.ffn_dim, bias=False)
        self.up_proj = nn.Linear(config.d_model, config.ffn_dim, bias=False)
        self.down_proj = nn.Linear(config.ffn_dim, config.d_model, bias=False)
        self.act = F.silu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.d_model, config.norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.d_model, config.norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), freqs_cis)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(LlamaBlock(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.loss_chunks = config.loss_chunks
        self.loss = (
            ChunkedCrossEntropy(config.loss_chunks) if config.loss_chunks else CrossEntropy()
        )
        freqs_cis = precompute_freqs_cis(
            config.d_model // config.n_heads, config.max_seq_len, config.rope_theta
        )
        self.register_buffer("freqs_cis", freqs_cis, persistent=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """The logits; given `labels` (next-token ids, -100 ignored), the training loss."""
        x = self.embed_tokens(input_ids)
        freqs_cis = self.freqs_cis[: input_ids.shape[1]]
        for layer in self.layers:
            x = layer(x, freqs_cis)
        h = self.norm(x)
        if labels is None:
            return self.lm_head(h)
        if self.loss_chunks:
            chunks = h.chunk(self.loss_chunks, dim=1)
            return self.loss([self.lm_head(chunk) for chunk in chunks], labels)
        return self.loss(self.lm_head(h), labels)

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        """`.to(dtype)` casts parameters and float buffers; the complex RoPE table keeps complex64
        (torchtitan never casts it) and only follows the parameters' device."""
        table = self._buffers.pop("freqs_cis")
        try:
            out = super()._apply(fn, recurse)
        finally:
            device = fn(torch.empty(0, device=table.device)).device
            self._buffers["freqs_cis"] = table.to(device)
        return out


def _fit_seq(config: LlamaConfig, seq: int) -> LlamaConfig:
    return replace(config, max_seq_len=max(seq, config.max_seq_len))


def _inputs(
    config: LlamaConfig, batch: int, seq: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and their next-token labels."""
    return token_ids(batch, seq, config.vocab_size, device), token_ids(
        batch, seq, config.vocab_size, device
    )


TINY = {
    "n_layers": 2,
    "d_model": 64,
    "n_heads": 4,
    "n_kv_heads": 2,
    "ffn_dim": 128,
    "vocab_size": 512,
    "max_seq_len": 128,
}


def _preset(config: LlamaConfig) -> Preset:
    return Preset(config, TINY, Llama, _inputs, _fit_seq)


# Llama 3 was pretrained at 8192 tokens; 3.1 extends that to 128K by RoPE scaling (see above).
_LLAMA3 = {"vocab_size": 128256, "rope_theta": 500000.0, "max_seq_len": 8192}

PRESETS = {
    "llama-2-7b": _preset(LlamaConfig()),
    "llama-3.2-1b": _preset(
        LlamaConfig(
            n_layers=16, d_model=2048, n_kv_heads=8, ffn_dim=8192, tie_embeddings=True, **_LLAMA3
        )
    ),
    "llama-3.2-3b": _preset(
        LlamaConfig(
            n_layers=28,
            d_model=3072,
            n_heads=24,
            n_kv_heads=8,
            ffn_dim=8192,
            tie_embeddings=True,
            **_LLAMA3,
        )
    ),
    "llama-3.1-8b": _preset(LlamaConfig(n_kv_heads=8, ffn_dim=14336, **_LLAMA3)),
    "llama-3.1-70b": _preset(
        LlamaConfig(n_layers=80, d_model=8192, n_heads=64, n_kv_heads=8, ffn_dim=28672, **_LLAMA3)
    ),
    "llama-3.1-405b": _preset(
        LlamaConfig(
            n_layers=126, d_model=16384, n_heads=128, n_kv_heads=8, ffn_dim=53248, **_LLAMA3
        )
    ),
}
