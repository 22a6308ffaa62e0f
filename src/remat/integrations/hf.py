"""remat in Hugging Face's `Trainer`: a callback that plans from the Trainer's first batch and
installs the plan before the first step, and `enable` for a model outside a Trainer.

    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[RematCallback(budget="70%")])

Hugging Face's own gradient checkpointing is switched off first, saying so (remat would
checkpoint its layers twice); the model trains on its own loss (`out.loss`), with its cache off
in training as Hugging Face's checkpointing does (`remat.caches`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from remat.errors import log
from remat.plans import DEFAULT_BUDGET, Plan


def enable(
    model: nn.Module, example: dict[str, Any], budget: int | str = DEFAULT_BUDGET, **kwargs: Any
) -> Plan:
    """Plan `model`'s training step on the batch `example` (the keyword inputs of its call, labels
    included) under `budget` and install the plan (`remat.auto` with the model's own loss); Hugging
    Face's gradient checkpointing is switched off first. Returns the plan."""
    from remat.eager import auto

    if getattr(model, "is_gradient_checkpointing", False):
        model.gradient_checkpointing_disable()
        log.info(
            "remat: Hugging Face's gradient checkpointing switched off on %s: remat's plan "
            "replaces it (it would checkpoint the layers twice)",
            type(model).__name__,
        )
    return auto(model, **example, budget=budget, loss_fn=_own_loss, **kwargs)


def _own_loss(out: Any) -> torch.Tensor:
    return out.loss


def _unwrapped(model: nn.Module) -> nn.Module:
    """The model inside DDP's or accelerate's wrappers (their `.module`)."""
    while isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
    return model


def _callback_base() -> type:
    try:
        from transformers import TrainerCallback
    except ImportError as err:  # pragma: no cover - the hf extra is missing
        raise ImportError(
            "remat.integrations.hf needs Hugging Face transformers: pip install 'remat[hf]'"
        ) from err
    return TrainerCallback


class RematCallback(_callback_base()):  # type: ignore[misc]
    """Plans the model's training step from the Trainer's first batch (its shape, on the model's
    device) and installs the plan before the first step (`on_train_begin`); `plan` is then the
    plan. The batch is drawn without moving the random stream the Trainer shuffles with."""

    def __init__(self, budget: int | str = DEFAULT_BUDGET, **auto_kwargs: Any):
        self.budget = budget
        self.auto_kwargs = auto_kwargs
        self.plan: Plan | None = None

    def on_train_begin(self, args, state, control, model=None, train_dataloader=None, **kwargs):
        if model is None or train_dataloader is None:
            raise ValueError("RematCallback needs the Trainer's model and train dataloader")
        target = _unwrapped(model)
        device = next(target.parameters()).device
        with torch.random.fork_rng(devices=[] if device.type != "cuda" else [device]):
            batch = next(iter(train_dataloader))
        example = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        self.plan = enable(target, example, self.budget, **self.auto_kwargs)
        return control
