"""The frameworks' own model code as the model: `torchtune:<builder>` and `torchtitan:<model>:<flavor>`.

A published memory figure comes from a framework's code, not from remat's presets: these sources
build that code (when the package is installed) and wrap it so that `model(tokens, labels)`
returns the loss as the framework's training loop computes it:

- `torchtune:llama3_2_3b` (any builder of `torchtune.models`): `full_finetune_single_device`'s
  step: labels shifted by one (the last ignored), `CEWithChunkedOutputLoss` over 8 output chunks
  (the recipes' default; `--set loss=CrossEntropyLoss` for the plain loss on the upcast logits
  torchtune's decoder returns). Built under the training dtype as the recipe builds it
  (`training.set_default_dtype`), so its RoPE cache is in that dtype too.
- `torchtitan:llama3:8B` (any flavor of `<model>_args`, fields replaced by `--set`, e.g. the
  Llama 2 7B shape of torchtitan's first FSDP2 runs): `components.loss.cross_entropy_loss` (sum
  over tokens on the fp32 upcast prediction), divided by the number of tokens as the trainer
  does. Parameters are cast to the training dtype; the complex `freqs_cis` table stays
  complex64, as `init_weights` makes it. Called with the tokens alone, the model returns its
  prediction (`pred`), for a loop that computes the loss outside and keeps `pred` alive.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from dataclasses import fields, replace
from typing import Any

import torch
from torch import nn

from remat.errors import UnknownModelError
from remat.models.preset import token_ids

IGNORE_INDEX = -100


def _import(package: str, name: str) -> Any:
    try:
        return importlib.import_module(package)
    except ImportError as err:
        raise UnknownModelError(
            f"{name} needs the {package} package: pip install {package} (remat imports its model "
            f"code; {err})"
        ) from err


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Build under `dtype`, as torchtune's `training.set_default_dtype` does."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


class TorchtuneStep(nn.Module):
    """A torchtune decoder and its loss, as `full_finetune_single_device` takes one step."""

    def __init__(self, model: nn.Module, loss: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.loss = loss

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.model(tokens)
        ignored = torch.full_like(labels[:, :1], IGNORE_INDEX)
        labels = torch.hstack((labels[:, 1:], ignored))
        if not isinstance(logits, list):
            labels = labels.reshape(-1)
            logits = logits.reshape(-1, logits.size(-1))
        return self.loss(logits, labels)


def _torchtune_builder(builder: str) -> Any:
    """`llama3_2_3b` -> `torchtune.models.llama3_2.llama3_2_3b`: the longest module prefix."""
    models = _import("torchtune.models", f"torchtune:{builder}")
    parts = builder.split("_")
    for cut in range(len(parts) - 1, 0, -1):
        family = "_".join(parts[:cut])
        with contextlib.suppress(ImportError):
            module = importlib.import_module(f"{models.__name__}.{family}")
            if hasattr(module, builder):
                return getattr(module, builder)
    raise UnknownModelError(
        f"torchtune:{builder}: no builder of that name in torchtune.models (e.g. "
        "torchtune:llama3_2_3b, torchtune:llama3_1_8b, torchtune:qwen2_5_7b_base)"
    )


def build_torchtune(
    builder: str,
    *,
    batch: int,
    seq: int,
    dtype: torch.dtype,
    device: torch.device,
    tiny: bool,
    overrides: dict[str, Any],
) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    if tiny:
        raise UnknownModelError(
            f"torchtune:{builder} has no tiny size: its builders take no shapes; use a small "
            "builder (e.g. torchtune:llama3_2_1b) or a preset with --tiny"
        )
    overrides = dict(overrides)
    loss_name = overrides.pop("loss", "CEWithChunkedOutputLoss")
    chunks = int(overrides.pop("num_output_chunks", 8))
    if overrides:
        raise UnknownModelError(
            f"torchtune:{builder} takes --set loss=CEWithChunkedOutputLoss|CrossEntropyLoss and "
            f"num_output_chunks=N, not {', '.join(overrides)}"
        )
    make = _torchtune_builder(builder)
    with torch.device(device), _default_dtype(dtype):
        model = make()
    for module in model.modules():  # RoPE caches a meta build defers: made on the CPU, then moved
        if hasattr(module, "rope_init") and not getattr(module, "is_cache_built", True):
            with torch.device("cpu"), _default_dtype(dtype):
                module.rope_init()
            module.to(device)
    if loss_name == "CEWithChunkedOutputLoss":
        loss_module = _import("torchtune.modules.loss", f"torchtune:{builder}")
        loss = loss_module.CEWithChunkedOutputLoss(num_output_chunks=chunks)
        model.set_num_output_chunks(chunks)
    elif loss_name == "CrossEntropyLoss":
        loss = nn.CrossEntropyLoss(ignore_index=IGNORE_INDEX)
    else:
        raise UnknownModelError(
            f"loss={loss_name!r}: torchtune's recipes use CEWithChunkedOutputLoss or CrossEntropyLoss"
        )
    vocab = model.output.out_features if hasattr(model.output, "out_features") else None
    vocab = vocab or model.tok_embeddings.num_embeddings
    ids = token_ids(batch, seq, vocab, device)
    return TorchtuneStep(model.train(), loss), (ids, token_ids(batch, seq, vocab, device))


class TorchtitanStep(nn.Module):
    """A torchtitan model and its loss, as its trainer takes one step."""

    def __init__(self, model: nn.Module, loss: Any) -> None:
        super().__init__()
        self.model = model
        self.loss = loss

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        pred = self.model(tokens)
        if labels is None:
            return pred
        return self.loss(pred, labels) / labels.numel()


def build_torchtitan(
    spec: str,
    *,
    batch: int,
    seq: int,
    dtype: torch.dtype,
    device: torch.device,
    tiny: bool,
    overrides: dict[str, Any],
) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    name, _, flavor = spec.partition(":")
    flavor = flavor or ("debugmodel" if tiny else "")
    package = _import(f"torchtitan.models.{name}", f"torchtitan:{spec}")
    configs = getattr(package, f"{name}_args", None) or getattr(package, f"{name}_configs", None)
    if not configs or flavor not in configs:
        raise UnknownModelError(
            f"torchtitan:{spec}: give a flavor of torchtitan.models.{name}: "
            + ", ".join(sorted(configs or ()))
        )
    args = configs[flavor]
    valid = {f.name for f in fields(args)}
    unknown = [k for k in overrides if k not in valid]
    if unknown:
        raise UnknownModelError(
            f"torchtitan:{spec}: its model args have no {', '.join(map(repr, unknown))}; valid: "
            f"{', '.join(sorted(valid))}"
        )
    args = replace(args, **overrides, max_seq_len=max(seq, args.max_seq_len))
    with torch.device(device):
        model = package.Transformer(args)
    table = model.freqs_cis
    model = model.to(dtype)
    model.freqs_cis = table  # complex64, as init_weights makes it; .to(dtype) would drop its phase
    loss = _import("torchtitan.components.loss", f"torchtitan:{spec}").cross_entropy_loss
    ids = token_ids(batch, seq, args.vocab_size, device)
    return TorchtitanStep(model.train(), loss), (
        ids,
        token_ids(batch, seq, args.vocab_size, device),
    )
