"""`megatron-gpt`: a GPT layer stack built to the memory model of Korthikanti et al. 2022.

"Reducing Activation Recomputation in Large Transformer Models", section 4.1, counts the bytes one
layer keeps for backward with 16-bit activations, sequence s, batch b, hidden h, heads a:

    attention  11sbh + 5as^2b   QKV input 2sbh; Q and K for QK^T 4sbh; softmax output 2as^2b;
                                its dropout mask as^2b; dropout output 2as^2b and V 2sbh for the
                                product with V; output projection input 2sbh; dropout mask sbh
    MLP        19sbh            fc1 input 2sbh; GELU input 8sbh; fc2 input 8sbh; dropout mask sbh
    LayerNorms  4sbh            each keeps its input, 2sbh
    total      sbh(34 + 5as/h)

The code does exactly these ops, so the saved tensors are those (build with dtype="bf16" for the
paper's 16-bit arithmetic; the default fp32 doubles every term but the masks). Q, K and V are views
of the one fused QKV output, so they cost its 6sbh once; the additive causal mask needs nothing
saved; LayerNorm also keeps a mean and rstd per token (4 to 8 bytes, not in the paper).
Dropout keeps a 1-byte mask on every device, see `Dropout`.

`attention="sdpa"` replaces the core (QK^T, softmax, dropout, product with V) by
`F.scaled_dot_product_attention`, which keeps no s x s matrix: the paper's selective recomputation,
34sbh, plus the fused kernel's float32 log-sum-exp (4abs bytes; on CPU its output, laid out like
its (s, b) inputs, is also the projection's input and costs nothing more). This variant
drops no attention probabilities (and has no `attn_dropout`): only CUDA's fused kernels do dropout
without an s x s mask, and on CPU a dropout_p > 0 falls back to the math kernel, which keeps s x s
matrices in float32. (On meta tensors SDPA always takes that math kernel, whatever dropout_p.)

Inputs are (s, b, h) floats, Megatron's sequence-first layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from remat.errors import RematError
from remat.models.preset import Preset, float_input


@dataclass(frozen=True)
class MegatronConfig:
    n_layers: int = 4
    d_model: int = 1024
    n_heads: int = 16
    dropout: float = 0.1
    attention: Literal["softmax", "sdpa"] = "softmax"

    def __post_init__(self) -> None:
        if self.attention not in ("softmax", "sdpa"):
            raise RematError(f"attention={self.attention!r}: choose 'softmax' or 'sdpa'")
        if self.d_model % self.n_heads:
            raise RematError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")


class Dropout(nn.Module):
    """Dropout that keeps a 1-byte (bool) mask for backward, as the paper counts.

    `nn.Dropout` lowers to `native_dropout`, whose mask is bool, only on CUDA; on CPU and meta it
    multiplies by a mask of the input's dtype, twice the bytes in 16 bits. Calling `native_dropout`
    directly saves what a GPU saves on every device.
    """

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        return torch.native_dropout(x, self.p, True)[0]


class MegatronLayer(nn.Module):
    def __init__(self, config: MegatronConfig):
        super().__init__()
        h = config.d_model
        self.n_heads = config.n_heads
        self.sdpa = config.attention == "sdpa"
        self.ln_1 = nn.LayerNorm(h)
        self.qkv = nn.Linear(h, 3 * h)
        if not self.sdpa:
            self.attn_dropout = Dropout(config.dropout)
        self.proj = nn.Linear(h, h)
        self.out_dropout = Dropout(config.dropout)
        self.ln_2 = nn.LayerNorm(h)
        self.fc1 = nn.Linear(h, 4 * h)
        self.gelu = nn.GELU()
        self.fc2 = nn.Linear(4 * h, h)
        self.mlp_dropout = Dropout(config.dropout)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Q, K, V (s, b, a, d) -> context (s, b, a·d), by explicit softmax or by SDPA."""
        s, b, a, d = q.shape
        if self.sdpa:
            q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # (b, a, s, d), views
            ctx = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return ctx.permute(2, 0, 1, 3).reshape(s, b, a * d)
        q, k, v = (t.reshape(s, b * a, d).transpose(0, 1) for t in (q, k, v))  # (b·a, s, d), views
        causal = torch.full((s, s), float("-inf"), dtype=q.dtype, device=q.device).triu(1)
        scores = torch.bmm(q, k.transpose(1, 2)) * d**-0.5 + causal
        probs = self.attn_dropout(torch.softmax(scores, dim=-1))
        return torch.bmm(probs, v).transpose(0, 1).reshape(s, b, a * d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.shape[-1]
        # Megatron's per-head [q | k | v] layout: splitting the fused output makes views, not copies.
        # Heads from the width (-1), sequence from the output: a tensor-parallel rank's projection
        # holds its share of the heads, over the whole sequence even when x is a sequence shard.
        qkv = self.qkv(self.ln_1(x))
        qkv = qkv.view(*qkv.shape[:2], -1, 3 * (h // self.n_heads))
        ctx = self.attention(*qkv.chunk(3, dim=-1))
        x = x + self.out_dropout(self.proj(ctx))
        return x + self.mlp_dropout(self.fc2(self.gelu(self.fc1(self.ln_2(x)))))


class MegatronGPT(nn.Module):
    """The layer stack alone (no embedding, no head), so saved bytes divide evenly by layer."""

    def __init__(self, config: MegatronConfig):
        super().__init__()
        self.layers = nn.ModuleList(MegatronLayer(config) for _ in range(config.n_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _inputs(
    config: MegatronConfig, batch: int, seq: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor]:
    return (float_input((seq, batch, config.d_model), dtype, device),)


TINY = {"n_layers": 2, "d_model": 64, "n_heads": 4}

PRESETS = {"megatron-gpt": Preset(MegatronConfig(), TINY, MegatronGPT, _inputs)}
