"""The model zoo: `build(name)` returns `(model, example_inputs)` ready for `model(*inputs)`.

`name` is one of three forms:

- a preset with published shapes (`preset_names()`), e.g. "gpt2", "llama-3.1-8b", "resnet50",
  "resnet18", "convnext-t", "vit-b-16", "megatron-gpt", or "mlp-chain-N" for any N >= 1;
- "pkg.module:factory", a function of yours returning (model, inputs), see `factory`;
- "hf:<model_type>", a Hugging Face transformers architecture built offline, see `hf`;
- "hf:<org>/<name>", a Hugging Face model of a config shipped with remat (`hf.shipped_names()`),
  at its real size, returning its own loss;
- "torchtune:<builder>" and "torchtitan:<model>:<flavor>", the frameworks' own model code with
  their training loss, when the package is installed, see `frameworks`.

Parameters are created directly on `device`, "meta" by default, so a 70B model allocates nothing
and builds in well under a second: remat plans from shapes, and only needs real memory to measure.
`tiny=True` swaps in a small config of the same family that trains on a CPU in milliseconds, and
`**overrides` then replace config fields by name.
"""

from __future__ import annotations

from dataclasses import fields, replace
from difflib import get_close_matches
from typing import Any

import torch
from torch import nn

from remat.errors import RematError, UnknownModelError
from remat.models import (
    convnext,
    factory,
    frameworks,
    gpt,
    hf,
    llama,
    megatron,
    mlp,
    resnet,
    vit,
)
from remat.models.overrides import check_override_types, parse_overrides, parse_value
from remat.models.preset import Preset

__all__ = [
    "PRESETS",
    "Preset",
    "build",
    "check_override_types",
    "loss_chunks_overrides",
    "parse_overrides",
    "parse_value",
    "preset_names",
]

PRESETS: dict[str, Preset] = {
    **gpt.PRESETS,
    **llama.PRESETS,
    **resnet.PRESETS,
    **convnext.PRESETS,
    **vit.PRESETS,
    **mlp.PRESETS,
    **megatron.PRESETS,
}

_DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


def preset_names() -> list[str]:
    """The registered preset names, sorted. Any "mlp-chain-N" builds too, listed or not."""
    return sorted(PRESETS)


def build(
    name: str,
    batch: int = 2,
    seq: int = 128,
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device = "meta",
    tiny: bool = False,
    **overrides: Any,
) -> tuple[nn.Module, tuple[Any, ...]]:
    """Build model `name` in training mode with its parameters on `device`, and example inputs.

    Token models take `input_ids` (batch, seq); image models (batch, 3, image_size, image_size)
    and `mlp-chain-N` (batch, d_model) ignore `seq`; `megatron-gpt` takes (seq, batch, d_model).
    Float inputs have the model's `dtype` ("fp32", "bf16", "fp16" or a torch.dtype).
    """
    dtype = _dtype(dtype)
    device = _device(device)
    if batch < 1 or seq < 1:
        raise RematError(f"batch={batch} and seq={seq} must both be >= 1")
    kw = {"batch": batch, "seq": seq, "dtype": dtype, "device": device}
    if name.startswith("hf:") and "/" in name:
        model, inputs = hf.build_shipped(name[3:], **kw, tiny=tiny, overrides=overrides)
    elif name.startswith("hf:"):
        model, inputs = hf.build(name[3:], **kw, tiny=tiny, overrides=overrides)
    elif name.startswith("torchtune:"):
        model, inputs = frameworks.build_torchtune(
            name.partition(":")[2], **kw, tiny=tiny, overrides=overrides
        )
    elif name.startswith("torchtitan:"):
        model, inputs = frameworks.build_torchtitan(
            name.partition(":")[2], **kw, tiny=tiny, overrides=overrides
        )
    elif ":" in name:
        model, inputs = factory.load(name, **kw, tiny=tiny, overrides=overrides)
    else:
        preset = _lookup(name)
        config = _configure(name, preset, tiny, overrides)
        if "max_seq_len" not in overrides and hasattr(config, "max_seq_len"):
            # a RoPE table of the run's positions, as torchtitan sizes it (training.seq_len), not
            # the preset's pretraining length: a buffer every rank and stage would hold unseen
            config = replace(config, max_seq_len=seq)
        config = preset.fit_seq(config, seq)
        with torch.device(device):
            model = preset.model(config).to(dtype)
        inputs = preset.inputs(config, batch, seq, dtype, device)
    return model.train(), inputs


def loss_chunks_overrides(model: str, chunks: int) -> dict[str, Any]:
    """The overrides that make `model`'s loss a cross-entropy over `chunks` sequence chunks, in
    its own code's words: torchtune's `CEWithChunkedOutputLoss(num_output_chunks)`, the presets'
    `loss_chunks` (llama); refused for code whose loss remat does not write."""
    if chunks < 1:
        raise RematError(f"--loss-chunks {chunks}: give 1 or more chunks")
    if model.startswith("torchtune:"):
        return {"loss": "CEWithChunkedOutputLoss", "num_output_chunks": chunks}
    if ":" not in model:
        preset = PRESETS.get(model)
        if preset is None or hasattr(preset.config, "loss_chunks"):
            return {"loss_chunks": chunks}  # an unknown name is refused by its build
        raise RematError(
            f"--loss-chunks: the preset {model} computes its loss whole (no loss_chunks field); "
            "the llama presets and torchtune:* models take a chunked loss"
        )
    raise RematError(
        f"--loss-chunks: {model} computes its own loss; the chunked loss is torchtune's "
        "CEWithChunkedOutputLoss (torchtune:* models) or the llama presets' loss_chunks"
    )


def _device(device: str | torch.device) -> torch.device:
    """`device` as a torch.device that this torch can allocate on (meta always can)."""
    try:
        device = torch.device(device)
    except RuntimeError:
        raise RematError(
            f"device {device!r} is not a torch device; use meta, cpu or cuda[:N]"
        ) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RematError(
            f"device {str(device)!r}: this torch ({torch.__version__}) sees no CUDA device; "
            "use cpu (or meta to analyse without allocating)"
        )
    return device


def _dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype
    if isinstance(dtype, str) and dtype in _DTYPES:
        return _DTYPES[dtype]
    raise RematError(f"dtype {dtype!r} is not a float type; use one of {', '.join(_DTYPES)}")


def _lookup(name: str) -> Preset:
    if name in PRESETS:
        return PRESETS[name]
    if name.startswith(mlp.PREFIX):
        return mlp.chain(name)
    close = get_close_matches(name, PRESETS, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    if "." in name and all(part.isidentifier() for part in name.split(".")):
        hint = f" If {name!r} is a module, name the factory in it: '{name}:<function>'."
    raise UnknownModelError(
        f"unknown model {name!r}.{hint} Presets: {', '.join(preset_names())}, and mlp-chain-N "
        "for any N >= 1. Or name your own function as 'pkg.module:factory' (it returns "
        "(model, inputs)), or a Hugging Face architecture as 'hf:<model_type>', e.g. 'hf:gpt2'."
    )


def _configure(name: str, preset: Preset, tiny: bool, overrides: dict[str, Any]) -> Any:
    """The preset's config with the tiny sizes, then the overrides, in one `replace`."""
    valid = [f.name for f in fields(preset.config)]
    unknown = [k for k in overrides if k not in valid]
    if unknown:
        raise UnknownModelError(
            f"{name} has no config field {', '.join(map(repr, unknown))}; "
            f"valid fields: {', '.join(valid)}"
        )
    check_override_types(name, overrides, {f: getattr(preset.config, f) for f in valid})
    return replace(preset.config, **{**(preset.tiny if tiny else {}), **overrides})
