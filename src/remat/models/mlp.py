"""`mlp-chain-N`: N identical Linear(d, d) + ReLU layers, the textbook case for checkpointing.

Every layer keeps the same activations, so good plans are known in closed form (Chen et al. 2016:
sqrt(N) checkpoints for O(sqrt(N)) memory; Griewank and Walther's binomial "revolve" schedules are
optimal), which makes this chain the reference to test a planner against. Inputs are (batch, d_model)
floats; `build`'s `seq` does not apply and is ignored. N is any integer >= 1, read from the name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from remat.errors import UnknownModelError
from remat.models.preset import Preset, float_input

PREFIX = "mlp-chain-"


@dataclass(frozen=True)
class MLPChainConfig:
    n_layers: int = 16
    d_model: int = 512


class Layer(nn.Module):
    def __init__(self, d_model: int):
        super().__init__()
        self.linear = nn.Linear(d_model, d_model)
        self.relu = nn.ReLU()
        # He init keeps the gradient's scale through ReLU layers; PyTorch's default shrinks it
        # ~2.4x per layer, to exact zeros (via slow CPU denormals) a few hundred layers down.
        nn.init.kaiming_normal_(self.linear.weight, nonlinearity="relu")
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.linear(x))


class MLPChain(nn.Module):
    def __init__(self, config: MLPChainConfig):
        super().__init__()
        self.layers = nn.ModuleList(Layer(config.d_model) for _ in range(config.n_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _inputs(
    config: MLPChainConfig, batch: int, seq: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor]:
    return (float_input((batch, config.d_model), dtype, device),)


TINY = {"d_model": 64}  # keeps N: the layer count is what the name asks for


def chain(name: str) -> Preset:
    """The preset for `mlp-chain-N`; raises `UnknownModelError` unless N is an integer >= 1."""
    match = re.fullmatch(re.escape(PREFIX) + r"([1-9][0-9]*)", name)
    if match is None:
        raise UnknownModelError(
            f"{name!r}: an MLP chain is named 'mlp-chain-N' with N an integer >= 1, "
            "e.g. 'mlp-chain-16'"
        )
    return Preset(MLPChainConfig(n_layers=int(match[1])), TINY, MLPChain, _inputs)


PRESETS = {name: chain(name) for name in ("mlp-chain-16", "mlp-chain-256")}
