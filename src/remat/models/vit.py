"""ViT-B/16 (Dosovitskiy et al. 2021): an image cut into 16x16 patches, read by a Transformer.

A stride-16 conv embeds the patches, a learned class token is prepended and learned position
embeddings added, then 12 pre-LayerNorm encoder blocks (width 768, 12 heads, GELU MLP 3072) with
non-causal `F.scaled_dot_product_attention`; the head reads the class token. 86.6e6 parameters.

Images are square with side `image_size` (default 224); `build`'s `seq` does not apply and is
ignored (the sequence is the (image_size / patch_size)^2 + 1 tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from remat.errors import RematError
from remat.models.preset import Preset, class_ids, float_input


@dataclass(frozen=True)
class ViTConfig:
    image_size: int = 224
    patch_size: int = 16
    n_layers: int = 12
    d_model: int = 768
    n_heads: int = 12
    mlp_dim: int = 3072
    n_classes: int = 1000

    def __post_init__(self) -> None:
        if self.image_size % self.patch_size or self.d_model % self.n_heads:
            raise RematError(
                f"image_size={self.image_size} must be divisible by patch_size={self.patch_size}, "
                f"and d_model={self.d_model} by n_heads={self.n_heads}"
            )


class Attention(nn.Module):
    def __init__(self, config: ViTConfig):
        super().__init__()
        self.n_heads = config.n_heads
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        qkv = self.qkv(x).view(B, N, 3, self.n_heads, C // self.n_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])
        return self.proj(y.transpose(1, 2).reshape(B, N, C))


class MLP(nn.Module):
    def __init__(self, config: ViTConfig):
        super().__init__()
        self.fc1 = nn.Linear(config.d_model, config.mlp_dim)
        self.gelu = nn.GELU()
        self.fc2 = nn.Linear(config.mlp_dim, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, config: ViTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.d_model, eps=1e-6)
        self.attn = Attention(config)
        self.ln_2 = nn.LayerNorm(config.d_model, eps=1e-6)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class ViT(nn.Module):
    def __init__(self, config: ViTConfig):
        super().__init__()
        d, p = config.d_model, config.patch_size
        n_patches = (config.image_size // p) ** 2
        self.patch_embed = nn.Conv2d(3, d, kernel_size=p, stride=p)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, d))
        self.pos_embed = nn.Parameter(0.02 * torch.randn(1, n_patches + 1, d))
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = nn.LayerNorm(d, eps=1e-6)
        self.head = nn.Linear(d, config.n_classes)

    def forward(self, images: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """The class logits; given `labels`, the cross-entropy torchvision's reference training
        script takes."""
        x = self.patch_embed(images).flatten(2).transpose(1, 2)  # (B, n_patches, d)
        x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x)[:, 0])
        return logits if labels is None else F.cross_entropy(logits, labels)


def _inputs(
    config: ViTConfig, batch: int, seq: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Images and their class labels."""
    images = float_input((batch, 3, config.image_size, config.image_size), dtype, device)
    return images, class_ids((batch,), config.n_classes, device)


TINY = {
    "image_size": 32,
    "patch_size": 8,
    "n_layers": 2,
    "d_model": 64,
    "n_heads": 4,
    "mlp_dim": 128,
    "n_classes": 10,
}

PRESETS = {"vit-b-16": Preset(ViTConfig(), TINY, ViT, _inputs)}
