"""The frameworks' own model code as the model: `torchtune:<builder>` and `torchtitan:<model>:<flavor>`.

A published memory figure comes from a framework's code, not from remat's presets: these sources
build that code (when the package is installed) and wrap it so that `model(tokens, labels)`
returns the loss as the framework's training loop computes it:

- `torchtune:llama3_2_3b` (any builder of `torchtune.models`): `full_finetune_single_device`'s
  step: labels shifted by one (the last ignored), `CEWithChunkedOutputLoss` over 8 output chunks
  (the recipes' default; `--set loss=CrossEntropyLoss` for the plain loss on the upcast logits
  torchtune's decoder returns). Built under the training dtype as the recipe builds it
  (`training.set_default_dtype`), so its RoPE cache is in that dtype too.
- `torchtitan:llama3:8B` (any flavor of the model's registry): `components.loss.
  cross_entropy_loss` (sum over tokens on the fp32 upcast prediction), divided by the number of
  tokens as the trainer does. torchtitan 0.3 (nested configs, `model_registry`): built under the
  training dtype with RoPE tables of `seq` positions, as the trainer builds it, and FlexAttention
  (compiled) or varlen attention replaced by SDPA, which saves the same output and logsumexp;
  `--set n_layers=N vocab_size=V` for any decoder, and for llama3 also `dim`, `n_heads`,
  `n_kv_heads`, `multiple_of`, `ffn_dim_multiplier`, `rope_theta` (e.g. the Llama 2 7B shape of
  torchtitan's first FSDP2 runs). torchtitan 0.2 (`<model>_args` flavors): fields replaced by
  `--set`; parameters cast to the training dtype, the complex `freqs_cis` table kept complex64,
  as `init_weights` makes it. Called with the tokens alone, the model returns its prediction
  (`pred`), for a loop that computes the loss outside and keeps `pred` alive.
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
from remat.models.overrides import check_override_types
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


class LossFunction(nn.Module):
    """A loss function as a module, the step's `loss`: the unit torchtitan's trainer compiles on
    its own under `--training.compile` (`build_cross_entropy_loss`), remat's
    `--compile blocks+loss`."""

    def __init__(self, function: Any) -> None:
        super().__init__()
        self.function = function

    def forward(self, pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.function(pred, labels)


class TorchtitanStep(nn.Module):
    """A torchtitan model and its loss, as its trainer takes one step."""

    def __init__(self, model: nn.Module, loss: Any) -> None:
        super().__init__()
        self.model = model
        self.loss = LossFunction(loss)

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
    if hasattr(package, "model_registry"):  # torchtitan >= 0.3: nested configs, one per module
        model, vocab = _build_torchtitan_model(package, spec, flavor, seq, dtype, device, overrides)
    else:  # torchtitan 0.2: one flat `<model>_args` dataclass per flavor
        model, vocab = _build_torchtitan_0_2(package, spec, flavor, seq, dtype, device, overrides)
    loss = _import("torchtitan.components.loss", f"torchtitan:{spec}").cross_entropy_loss
    ids = token_ids(batch, seq, vocab, device)
    return TorchtitanStep(model.train(), loss), (ids, token_ids(batch, seq, vocab, device))


def _flavors(package: Any) -> dict[str, Any]:
    """The package's flavor table (`llama3_configs`, `deepseekv3_configs`, ...)."""
    return next(
        (
            v
            for k, v in vars(package).items()
            if k.endswith("_configs") and isinstance(v, dict) and v
        ),
        {},
    )


#: torchtitan >= 0.3 overrides by name: any decoder's depth and vocabulary, and for llama3 the
#: shape of its `_build_llama3_layers` (Llama 2 and 3 are both that shape); `fuse_qkv=False`: the
#: separate wq, wk, wv of torchtitan before 0.3 (0.3's flavors fuse them into one wqkv matmul,
#: which changes what a policy counting matmuls saves).
_DECODER_FIELDS = ("n_layers", "vocab_size")
_LLAMA3_FIELDS = (
    "dim",
    "n_heads",
    "n_kv_heads",
    "multiple_of",
    "ffn_dim_multiplier",
    "rope_theta",
    "fuse_qkv",
)


def _build_torchtitan_model(
    package: Any,
    spec: str,
    flavor: str,
    seq: int,
    dtype: torch.dtype,
    device: torch.device,
    overrides: dict[str, Any],
) -> tuple[nn.Module, int]:
    """torchtitan >= 0.3: the flavor's `model_registry(flavor).model` config, built as the trainer
    builds it: under the training dtype, RoPE tables sized to `seq` (`update_from_config`), and
    on a real device initialised by the model's own `init_weights`. FlexAttention and varlen
    attention (torch.compile'd and CUDA kernels that a fake trace cannot run) become
    `ScaledDotProductAttention`, which saves what they save: the output and its logsumexp."""
    flavors = _flavors(package)
    if flavor not in flavors:
        raise UnknownModelError(
            f"torchtitan:{spec}: give a flavor of {package.__name__}: {', '.join(sorted(flavors))}"
        )
    config = package.model_registry(flavor).model
    valid = _DECODER_FIELDS + (_LLAMA3_FIELDS if hasattr(package, "_build_llama3_layers") else ())
    unknown = [k for k in overrides if k not in valid]
    if unknown:
        raise UnknownModelError(
            f"torchtitan:{spec}: its model config has no {', '.join(map(repr, unknown))}; valid: "
            f"{', '.join(sorted(valid))}"
        )
    check_override_types(
        f"torchtitan:{spec}",
        overrides,
        {"n_layers": 1, "vocab_size": 1, "dim": 1, "n_heads": 1, "n_kv_heads": 1}
        | {"multiple_of": 1, "ffn_dim_multiplier": 1.0, "rope_theta": 1.0, "fuse_qkv": True},
    )
    config = _with_overrides(package, config, overrides)
    _eager_attention(config, seq)
    with torch.device(device), _default_dtype(dtype):
        model = config.build()
    if device.type != "meta":
        with torch.no_grad():
            model.init_weights(buffer_device=None)
    return model, config.vocab_size


def _with_overrides(package: Any, config: Any, overrides: dict[str, Any]) -> Any:
    """`config` with `n_layers` (the flavor's layers cut, or its last repeated), `vocab_size`,
    and llama3's shape fields (its layers rebuilt by its own `_build_llama3_layers`)."""
    shape = {k: v for k, v in overrides.items() if k in _LLAMA3_FIELDS}
    n_layers = int(overrides.get("n_layers", len(config.layers)))
    vocab = int(overrides.get("vocab_size", config.vocab_size))
    if shape:  # rebuild llama3's layers as its flavors do, with the flavor's values as defaults
        from torchtitan.models.common import compute_ffn_hidden_dim

        first = config.layers[0]
        dim = int(shape.get("dim", config.dim))
        n_heads = int(shape.get("n_heads", first.attention.n_heads))
        rope = replace(
            first.attention.rope,
            dim=dim // n_heads,
            theta=shape.get("rope_theta", first.attention.rope.theta),
        )
        hidden = first.feed_forward.w1.out_features
        if "multiple_of" in shape or "ffn_dim_multiplier" in shape or "dim" in shape:
            hidden = compute_ffn_hidden_dim(
                dim,
                multiple_of=int(shape.get("multiple_of", 1)),
                ffn_dim_multiplier=shape.get("ffn_dim_multiplier"),
            )
        layers = package._build_llama3_layers(
            n_layers=n_layers,
            dim=dim,
            n_heads=n_heads,
            n_kv_heads=shape.get("n_kv_heads", first.attention.n_kv_heads),
            hidden_dim=hidden,
            rope=rope,
            attn_backend="flex",
            fuse_qkv=bool(shape.get("fuse_qkv", True)),
        )
        return replace(
            config,
            dim=dim,
            vocab_size=vocab,
            tok_embeddings=replace(config.tok_embeddings, num_embeddings=vocab, embedding_dim=dim),
            norm=replace(config.norm, normalized_shape=dim),
            lm_head=replace(config.lm_head, in_features=dim, out_features=vocab),
            layers=layers,
        )
    layers = [config.layers[min(i, len(config.layers) - 1)] for i in range(n_layers)]
    return replace(
        config,
        vocab_size=vocab,
        tok_embeddings=replace(config.tok_embeddings, num_embeddings=vocab),
        lm_head=replace(config.lm_head, out_features=vocab),
        layers=layers,
    )


def _eager_attention(config: Any, seq: int) -> None:
    """In place: FlexAttention and varlen attention -> SDPA; RoPE tables of `seq` positions."""
    from torchtitan.models.common.attention import (
        FlexAttention,
        ScaledDotProductAttention,
        VarlenAttention,
    )
    from torchtitan.models.common.rope import RoPE

    for _, _, parent, attr in list(config.traverse((FlexAttention.Config, VarlenAttention.Config))):
        setattr(parent, attr, ScaledDotProductAttention.Config())
    for _, rope, parent, attr in list(config.traverse(RoPE.Config)):
        setattr(parent, attr, replace(rope, max_seq_len=seq))


def _build_torchtitan_0_2(
    package: Any,
    spec: str,
    flavor: str,
    seq: int,
    dtype: torch.dtype,
    device: torch.device,
    overrides: dict[str, Any],
) -> tuple[nn.Module, int]:
    name = spec.partition(":")[0]
    configs = getattr(package, f"{name}_args", None)
    if not configs or flavor not in configs:
        raise UnknownModelError(
            f"torchtitan:{spec}: give a flavor of torchtitan.models.{name}: "
            + ", ".join(sorted(configs or ()))
        )
    args = configs[flavor]
    overrides = dict(overrides)
    if overrides.pop("fuse_qkv", False):
        raise UnknownModelError(
            f"torchtitan:{spec}: torchtitan 0.2's attention has separate wq, wk, wv; fuse_qkv=True "
            "needs torchtitan >= 0.3"
        )
    valid = {f.name for f in fields(args)}
    unknown = [k for k in overrides if k not in valid]
    if unknown:
        raise UnknownModelError(
            f"torchtitan:{spec}: its model args have no {', '.join(map(repr, unknown))}; valid: "
            f"{', '.join(sorted(valid))}"
        )
    check_override_types(f"torchtitan:{spec}", overrides, {k: getattr(args, k) for k in valid})
    args = replace(args, **overrides, max_seq_len=max(seq, args.max_seq_len))
    with torch.device(device):
        model = package.Transformer(args)
    table = model.freqs_cis
    model = model.to(dtype)
    model.freqs_cis = table  # complex64, as init_weights makes it; .to(dtype) would drop its phase
    return model, args.vocab_size
