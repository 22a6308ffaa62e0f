"""Llama 2 and Llama 3 (Touvron et al. 2023; Llama Team 2024), with Hugging Face's module names.

RMSNorm before attention and MLP, rotary position embeddings, grouped-query attention (fewer K/V
heads than Q heads) and a SwiGLU MLP, no biases. The presets carry the published shapes, so their
parameter counts are the models' own: 6.74e9, 1.24e9, 8.03e9 and 70.6e9.

Llama 3.1's long-context RoPE frequency scaling is left out: it changes the values of the cos/sin
tables, not any shape, memory or time. RoPE tables are buffers (not parameters, not in the state
dict) sized to `max(seq, max_seq_len)`, computed once at build time as Hugging Face computes them.
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


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = config.d_model // config.n_heads
        kv_dim = config.n_kv_heads * self.head_dim
        self.q_proj = nn.Linear(config.d_model, config.d_model, bias=False)
        self.k_proj = nn.Linear(config.d_model, kv_dim, bias=False)
        self.v_proj = nn.Linear(config.d_model, kv_dim, bias=False)
        self.o_proj = nn.Linear(config.d_model, config.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        # enable_gqa lets SDPA read each K/V head for its group of Q heads without copying them.
        gqa = self.n_kv_heads != self.n_heads
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, C))


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

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
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
        head_dim = config.d_model // config.n_heads
        inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
        angles = torch.outer(torch.arange(config.max_seq_len).float(), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("rope_cos", angles.cos(), persistent=False)
        self.register_buffer("rope_sin", angles.sin(), persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        T = input_ids.shape[1]
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))


def _fit_seq(config: LlamaConfig, seq: int) -> LlamaConfig:
    return replace(config, max_seq_len=max(seq, config.max_seq_len))


def _inputs(
    config: LlamaConfig, batch: int, seq: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor]:
    return (token_ids(batch, seq, config.vocab_size, device),)


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
    "llama-3.1-8b": _preset(LlamaConfig(n_kv_heads=8, ffn_dim=14336, **_LLAMA3)),
    "llama-3.1-70b": _preset(
        LlamaConfig(n_layers=80, d_model=8192, n_heads=64, n_kv_heads=8, ffn_dim=28672, **_LLAMA3)
    ),
}
