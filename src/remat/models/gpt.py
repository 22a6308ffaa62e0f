"""GPT-2 as nanoGPT writes it (Radford et al. 2019; github.com/karpathy/nanoGPT).

Pre-LayerNorm blocks, one fused `c_attn` Linear(d, 3d) for Q, K and V, causal attention through
`F.scaled_dot_product_attention`, a 4d GELU MLP, learned position embeddings and `lm_head` tied
to `wte`. Names match nanoGPT and Hugging Face's GPT-2 so plans read like the checkpoints.
Weights keep PyTorch's default init: remat measures memory and time, not loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from remat.errors import RematError, SequenceLimitError
from remat.models.preset import Preset, token_ids


@dataclass(frozen=True)
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50257
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise RematError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.h = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying, as GPT-2 was trained

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """The logits; given `labels` (next-token ids), nanoGPT's training loss instead:
        cross-entropy on the logits in the model's dtype (nanoGPT does not upcast them)."""
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.drop(self.wte(input_ids) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if labels is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1), ignore_index=-1)


def _check_seq(config: GPTConfig, seq: int) -> GPTConfig:
    if seq > config.block_size:
        raise SequenceLimitError(
            f"seq={seq} exceeds GPT-2's {config.block_size} learned positions (block_size): ask "
            f"for a shorter sequence (CLI: --seq {config.block_size}; `remat fit` defaults to "
            f"4096) or build more positions (CLI: --set block_size={seq}; Python: "
            f"models.build(..., block_size={seq}))",
            limit=config.block_size,
            lever="--set block_size=N",
        )
    return config


def _inputs(
    config: GPTConfig, batch: int, seq: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and their next-token labels."""
    return token_ids(batch, seq, config.vocab_size, device), token_ids(
        batch, seq, config.vocab_size, device
    )


TINY = {"n_layer": 2, "n_head": 4, "n_embd": 64, "vocab_size": 512}


def _preset(n_layer: int, n_head: int, n_embd: int) -> Preset:
    config = GPTConfig(n_layer=n_layer, n_head=n_head, n_embd=n_embd)
    return Preset(config, TINY, GPT, _inputs, _check_seq)


PRESETS = {
    "gpt2": _preset(12, 12, 768),
    "gpt2-medium": _preset(24, 16, 1024),
    "gpt2-large": _preset(36, 20, 1280),
    "gpt2-xl": _preset(48, 25, 1600),
}
