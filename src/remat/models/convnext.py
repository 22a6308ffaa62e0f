"""ConvNeXt-T (Liu et al. 2022, "A ConvNet for the 2020s"), as the paper's code builds it.

A 4x4 stride-4 stem conv and LayerNorm, then four stages (depths 3, 3, 9, 3; widths 96, 192, 384,
768) of blocks: a 7x7 depthwise conv, LayerNorm over channels (channels last), a 4x MLP with GELU
(as `Linear`s), a learned layer scale, and the residual; between stages a LayerNorm and a 2x2
stride-2 conv. The head pools globally, normalises and classifies. Stochastic depth is left out
(0 here), so a step is deterministic. Module names are the paper's (`downsample_layers`,
`stages`, `norm`, `head`), 28.6e6 parameters.

Images are square with side `image_size` (default 224); `build`'s `seq` does not apply.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from remat.models.preset import Preset, class_ids, float_input


@dataclass(frozen=True)
class ConvNeXtConfig:
    depths: tuple[int, int, int, int] = (3, 3, 9, 3)
    dims: tuple[int, int, int, int] = (96, 192, 384, 768)
    n_classes: int = 1000
    image_size: int = 224
    layer_scale: float = 1e-6


class LayerNorm2d(nn.LayerNorm):
    """LayerNorm over the channels of an NCHW tensor (torchvision's `LayerNorm2d`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.layer_norm(x.permute(0, 2, 3, 1), self.normalized_shape, self.weight, self.bias)
        return x.permute(0, 3, 1, 2)


class Block(nn.Module):
    def __init__(self, dim: int, layer_scale: float):
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(layer_scale * torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(self.dwconv(x).permute(0, 2, 3, 1))  # (N, H, W, C)
        y = self.gamma * self.pwconv2(self.act(self.pwconv1(y)))
        return x + y.permute(0, 3, 1, 2)


class ConvNeXt(nn.Module):
    def __init__(self, config: ConvNeXtConfig):
        super().__init__()
        dims = config.dims
        stem = nn.Sequential(nn.Conv2d(3, dims[0], 4, stride=4), LayerNorm2d(dims[0], eps=1e-6))
        self.downsample_layers = nn.ModuleList([stem])
        for i in range(3):
            self.downsample_layers.append(
                nn.Sequential(
                    LayerNorm2d(dims[i], eps=1e-6), nn.Conv2d(dims[i], dims[i + 1], 2, stride=2)
                )
            )
        self.stages = nn.ModuleList(
            nn.Sequential(*(Block(dim, config.layer_scale) for _ in range(depth)))
            for dim, depth in zip(dims, config.depths, strict=True)
        )
        self.norm = nn.LayerNorm(dims[-1], eps=1e-6)
        self.head = nn.Linear(dims[-1], config.n_classes)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """The class logits; given `labels`, their cross-entropy."""
        for downsample, stage in zip(self.downsample_layers, self.stages, strict=True):
            x = stage(downsample(x))
        logits = self.head(self.norm(x.mean((-2, -1))))
        return logits if labels is None else F.cross_entropy(logits, labels)


def _inputs(
    config: ConvNeXtConfig, batch: int, seq: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Images and their class labels."""
    images = float_input((batch, 3, config.image_size, config.image_size), dtype, device)
    return images, class_ids((batch,), config.n_classes, device)


TINY = {"depths": (1, 1, 2, 1), "dims": (8, 16, 24, 32), "n_classes": 10, "image_size": 32}

PRESETS = {"convnext-t": Preset(ConvNeXtConfig(), TINY, ConvNeXt, _inputs)}
