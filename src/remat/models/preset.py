"""What every family file provides: a `Preset` per name, and example inputs made the same way.

A preset is data, not a function, so `build` can apply `tiny=True` and `**overrides` uniformly with
`dataclasses.replace` before any parameter exists, and a 70B config costs nothing until built.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


def _same_config(config: Any, seq: int) -> Any:
    return config


@dataclass(frozen=True)
class Preset:
    """A named model: its published config, the small one, and how to make model and inputs.

    `inputs(config, batch, seq, dtype, device)` returns the positional inputs of `model(*inputs)`.
    `fit_seq(config, seq)` lets a family size something to the sequence before the model is built
    (Llama's RoPE tables); most families ignore it.
    """

    config: Any
    tiny: Mapping[str, Any]
    model: Callable[[Any], nn.Module]
    inputs: Callable[[Any, int, int, torch.dtype, torch.device], tuple[torch.Tensor, ...]]
    fit_seq: Callable[[Any, int], Any] = _same_config


def token_ids(batch: int, seq: int, vocab_size: int, device: torch.device) -> torch.Tensor:
    """Token ids (batch, seq): real ids below `vocab_size`, or an unfilled tensor on meta."""
    return class_ids((batch, seq), vocab_size, device)


def class_ids(shape: tuple[int, ...], n_classes: int, device: torch.device) -> torch.Tensor:
    """Integer labels of `shape` below `n_classes` (token ids, next-token targets, image classes),
    or an unfilled tensor on meta."""
    if device.type == "meta":
        return torch.empty(shape, dtype=torch.long, device=device)
    return torch.randint(n_classes, shape, device=device)


def float_input(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A float input that needs no gradient, as data from a loader would be."""
    if device.type == "meta":
        return torch.empty(shape, dtype=dtype, device=device)
    return torch.randn(shape, dtype=dtype, device=device)
