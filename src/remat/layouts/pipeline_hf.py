"""Pipeline stages of a Hugging Face model: its decoder stack cut as transformers' own pipeline
plan (`base_model_pp_plan`) lays it out, the embedding with the first layers, the final norm and
the head with the last.

A stage runs the base model's own `forward` on a shallow copy of it that holds only the stage's
layers (the embedding absent after the first stage, the final norm an identity before the last),
so each stage computes what the whole model's forward computes around its layers: the first
takes the token ids, the others the hidden states (`inputs_embeds`) the stage before sends, and
every stage makes its own position embeddings (the rotary table) and causal mask from them, as a
transformers decoder layer takes them (`hidden_states` plus `position_embeddings` and the mask).
The last stage returns the logits; `loss_fn` is the model's own `loss_function` (fp32 logits,
labels shifted), the one its `forward(labels=...)` computes.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from remat.errors import RematError
from remat.layouts.stage_place import StagePlace


def hf_parts(model: nn.Module) -> tuple[nn.Module, str, list[str], list[str], list[str]] | None:
    """For a transformers model with a pipeline plan: its base model, the name of its layer
    stack, the base's modules before the stack (embedding) and after it (final norm), and the
    head's modules outside the base. None: not such a model."""
    prefix = getattr(model, "base_model_prefix", None)
    base = getattr(model, prefix, None) if prefix else None
    base = model if base is None and prefix is not None else base
    plan = getattr(getattr(base, "config", None), "base_model_pp_plan", None)
    if not plan:
        return None
    names = list(plan)
    stack = next((n for n in names if isinstance(getattr(base, n, None), nn.ModuleList)), None)
    if stack is None:
        return None
    at = names.index(stack)
    head = [] if base is model else [n for n in (getattr(model, "_pp_plan", None) or {})
                                     if not n.startswith(f"{prefix}.")]  # fmt: skip
    return base, stack, names[:at], names[at + 1 :], head


class HFStage(StagePlace):
    """One pipeline stage of a transformers model (see the module): `model`, its base model's
    copy with this stage's layers; on the last stage its head (`lm_head`). Parameter names read
    as in the whole model but for the layers' indices, which count from the stage's first."""

    def __init__(self, model: nn.Module, index: int, num_stages: int, layers: range) -> None:
        super().__init__(index, num_stages, layers)
        parts = hf_parts(model)
        if parts is None:
            raise RematError(f"{type(model).__name__} has no transformers pipeline plan")
        base, stack, before, after, head = parts
        clone = base.__new__(type(base))
        clone.__dict__ = dict(base.__dict__)
        for field in ("_modules", "_parameters", "_buffers"):
            setattr(clone, field, dict(getattr(base, field)))
        clone._modules[stack] = nn.ModuleList([getattr(base, stack)[i] for i in layers])
        kinds = getattr(base.config, "layer_types", None)
        if kinds is not None:  # read by the loop's own index (Gemma 2: sliding, full, ...)
            config = copy.copy(base.config)
            config.layer_types = [kinds[i] for i in layers]
            clone.config = config
        if not self.is_first:
            for name in before:
                clone._modules[name] = None
        if not self.is_last:
            for name in after:
                clone._modules[name] = nn.Identity()
        self.model = clone
        self.head_names = tuple(head) if self.is_last else ()
        for name in self.head_names:
            setattr(self, name, getattr(model, name))
        self._loss = getattr(model, "loss_function", None)
        self.vocab_size = getattr(model.config, "vocab_size", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        given = {"input_ids": x} if self.is_first else {"inputs_embeds": x}
        hidden = self.model(**given, use_cache=False).last_hidden_state
        for name in self.head_names:
            hidden = getattr(self, name)(hidden)
        return hidden

    def loss_fn(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self._loss is None:
            raise RematError(
                f"a {type(self.model).__name__} without a head has no training loss: cut the "
                "model with its task head (AutoModelForCausalLM)"
            )
        return self._loss(logits=logits, labels=labels, vocab_size=self.vocab_size)
