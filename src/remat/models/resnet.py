"""ResNet-50 and ResNet-18 (He et al. 2016) written out as torchvision builds them, without
torchvision.

ResNet-50: bottleneck blocks 1x1 -> 3x3 -> 1x1 with expansion 4 and the stride on the 3x3 conv
("v1.5"); ResNet-18: basic blocks, two 3x3 convs. BatchNorm after every conv, in-place ReLU, a
projection shortcut where the shape changes. Module names are torchvision's (`conv1`, `bn1`,
`layer1`..`layer4`, `fc`); 25.6e6 and 11.7e6 parameters.

Images are square with side `image_size` (default 224); `build`'s `seq` does not apply and is
ignored.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from remat.models.preset import Preset, class_ids, float_input


@dataclass(frozen=True)
class ResNetConfig:
    layers: tuple[int, int, int, int] = (3, 4, 6, 3)
    width: int = 64
    n_classes: int = 1000
    image_size: int = 224
    block: str = "bottleneck"  # or "basic" (ResNet-18, -34)


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, in_planes: int, planes: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or in_planes != planes:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False),
                nn.BatchNorm2d(planes),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += x if self.downsample is None else self.downsample(x)
        return self.relu(out)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, in_planes: int, planes: int, stride: int):
        super().__init__()
        out_planes = planes * self.expansion
        self.conv1 = nn.Conv2d(in_planes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, out_planes, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_planes)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or in_planes != out_planes:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_planes, out_planes, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_planes),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        out += x if self.downsample is None else self.downsample(x)
        return self.relu(out)


class ResNet(nn.Module):
    def __init__(self, config: ResNetConfig):
        super().__init__()
        w = config.width
        self.block = BasicBlock if config.block == "basic" else Bottleneck
        self.conv1 = nn.Conv2d(3, w, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(w)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        self.in_planes = w
        self.layer1 = self._stage(w, config.layers[0], stride=1)
        self.layer2 = self._stage(w * 2, config.layers[1], stride=2)
        self.layer3 = self._stage(w * 4, config.layers[2], stride=2)
        self.layer4 = self._stage(w * 8, config.layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(self.in_planes, config.n_classes)

    def _stage(self, planes: int, n_blocks: int, stride: int) -> nn.Sequential:
        blocks = []
        for i in range(n_blocks):
            blocks.append(self.block(self.in_planes, planes, stride if i == 0 else 1))
            self.in_planes = planes * self.block.expansion
        return nn.Sequential(*blocks)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """The class logits; given `labels`, the cross-entropy torchvision's reference training
        script takes."""
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        logits = self.fc(self.avgpool(x).flatten(1))
        return logits if labels is None else F.cross_entropy(logits, labels)


def _inputs(
    config: ResNetConfig, batch: int, seq: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Images and their class labels."""
    images = float_input((batch, 3, config.image_size, config.image_size), dtype, device)
    return images, class_ids((batch,), config.n_classes, device)


TINY = {"layers": (1, 1, 1, 1), "width": 8, "n_classes": 10, "image_size": 32}

PRESETS = {
    "resnet50": Preset(ResNetConfig(), TINY, ResNet, _inputs),
    "resnet18": Preset(ResNetConfig(layers=(2, 2, 2, 2), block="basic"), TINY, ResNet, _inputs),
}
