"""`hf:<model_type>`: a Hugging Face transformers model built offline from its config class.

`AutoConfig.for_model` gives the architecture's default config (hf:gpt2 is GPT-2 small, hf:llama
is Llama-2-7B's shape) and `from_config` builds it with no download. Dropout is off unless asked
for, so gradients are deterministic; the KV cache is off, as in training; attention goes through
SDPA where the architecture supports it, else the eager implementation.

The model sits behind `HFLogits` so that `model(input_ids)` returns a tensor, which remat sums for
a loss, instead of a ModelOutput. On meta tensors transformers' mask code reads a value
(`.item()`) and fails; trace these models under FakeTensorMode instead (`remat.tracing.hfcompat` gives its
data-dependent decisions the real run's answers). `build_for_training` builds a model as users
train it: default config and call, dropout and caching as they are, labels for the loss.
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from difflib import get_close_matches
from math import prod
from pathlib import Path
from typing import Any

import torch
from torch import nn

from remat.errors import SequenceLimitError, UnknownModelError
from remat.models.preset import class_ids, float_input, token_ids

#: Hugging Face configs shipped with remat as data (`hf:<org>/<name>`): the hub's config.json of
#: each model, so that it builds at its real size offline (configs/SOURCES.md).
CONFIGS = Path(__file__).parent / "configs"

# Small sizes for tiny=True under the names configs use for them; each applies where it exists.
TINY = {
    "num_hidden_layers": 2,
    "n_layer": 2,
    "num_layers": 2,
    "hidden_size": 64,
    "n_embd": 64,
    "d_model": 64,
    "intermediate_size": 128,
    "ffn_dim": 128,
    "d_ff": 128,
    "num_attention_heads": 4,
    "n_head": 4,
    "num_heads": 4,
    # encoder-decoders name their stacks apart (BART, Marian, PLBart: 12 heads do not divide 64)
    "encoder_layers": 2,
    "decoder_layers": 2,
    "encoder_ffn_dim": 128,
    "decoder_ffn_dim": 128,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    # partial rotary (GPT-J, CodeGen) and multi-head latent attention (DeepSeek): no wider than
    # the smaller heads
    "rotary_dim": 8,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "kv_lora_rank": 32,
    "q_lora_rank": 48,
    "vocab_size": 512,
}
_POSITIONS = ("n_positions", "max_position_embeddings")


class HFLogits(nn.Module):
    """Calls a transformers model on token ids and returns one tensor: its logits, or for a model
    without a language-model head its last hidden state. An encoder-decoder (T5Model) takes the
    same ids on the decoder's side too (as teacher forcing over an equal-length target does)."""

    def __init__(self, model: nn.Module, output: str):
        super().__init__()
        self.model = model
        self.output = output
        self.to_decoder = "decoder_input_ids" in inspect.signature(model.forward).parameters

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        decoder = {"decoder_input_ids": input_ids} if self.to_decoder else {}
        return getattr(self.model(input_ids=input_ids, **decoder), self.output)


class HFLoss(nn.Module):
    """Calls a transformers model with `labels` and returns its own training loss (causal LMs
    upcast the logits to fp32 and shift the labels in `ForCausalLMLoss`; classification heads
    take cross-entropy), as the Trainer does."""

    def __init__(self, model: nn.Module, input_name: str):
        super().__init__()
        self.model = model
        self.input_name = input_name

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(**{self.input_name: inputs, "labels": labels}).loss


def shipped_names() -> list[str]:
    """The shipped configs' hub ids, `hf:` left out."""
    return sorted(str(p.relative_to(CONFIGS).with_suffix("")) for p in CONFIGS.glob("*/*.json"))


#: The task heads a shipped config can be trained with (`--set task=...`).
TASKS = {
    "causal-lm": "AutoModelForCausalLM",
    "masked-lm": "AutoModelForMaskedLM",
    "sequence-classification": "AutoModelForSequenceClassification",
    "image-classification": "AutoModelForImageClassification",
}


def _default_task(architecture: str) -> str:
    """The task of a config's first architecture: its pretraining head, or classification for a
    bare image encoder (ViTModel)."""
    for suffix, task in (
        ("ForCausalLM", "causal-lm"),
        ("ForMaskedLM", "masked-lm"),
        ("ForSequenceClassification", "sequence-classification"),
    ):
        if architecture.endswith(suffix):
            return task
    return "image-classification"


def build_shipped(
    hub_id: str,
    *,
    batch: int,
    seq: int,
    dtype: torch.dtype,
    device: torch.device,
    tiny: bool,
    overrides: dict[str, Any],
) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """`hf:<hub id>`: the model of a shipped config at its real size (or shrunk with `tiny`), with
    its dropout as published, and the inputs of a training step with labels; the model returns
    its loss. `overrides` replace config fields; `task` picks the head (`TASKS`; default: the
    config's pretraining head), `attn_implementation` the attention (default: SDPA where the
    architecture has it)."""
    path = CONFIGS / f"{hub_id}.json"
    if not path.is_file():
        close = get_close_matches(hub_id, shipped_names(), n=1)
        raise UnknownModelError(
            f"hf:{hub_id} is not a config shipped with remat"
            + (f" (did you mean hf:{close[0]}?)" if close else "")
            + f"; shipped: {', '.join(shipped_names())}. For any other architecture use "
            "hf:<model_type> (its default config) with --set to give its sizes."
        )
    try:
        import transformers
        from transformers import CONFIG_MAPPING
    except ImportError as err:
        raise UnknownModelError(
            f"hf:{hub_id} needs Hugging Face transformers: pip install 'remat[hf]'"
        ) from err
    data = json.loads(path.read_text())
    overrides = dict(overrides)
    task = overrides.pop("task", None) or _default_task(data["architectures"][0])
    attn = overrides.pop("attn_implementation", None)
    if task not in TASKS:
        raise UnknownModelError(f"task={task!r}: choose one of {', '.join(TASKS)}")
    config_class = CONFIG_MAPPING[data["model_type"]]
    unknown = [k for k in overrides if not hasattr(config_class(), k)]
    if unknown:
        raise UnknownModelError(
            f"hf:{hub_id}: its config has no field {', '.join(map(repr, unknown))}; fields: "
            f"{', '.join(sorted(data))} (and task, attn_implementation)"
        )
    sizes = _shrunk(data, TINY, positions=seq) if tiny else {}
    with config_errors(f"hf:{hub_id}"):
        config = config_class.from_dict({**data, **sizes, **overrides, "use_cache": False})
    positions = getattr(config, "max_position_embeddings", None)
    if task != "image-classification" and positions is not None and seq > positions:
        raise _too_long(f"hf:{hub_id}", seq, "max_position_embeddings", positions)
    auto = getattr(transformers, TASKS[task])
    with torch.device(device):
        try:
            model = auto.from_config(config, attn_implementation=attn or "sdpa")
        except ValueError:  # this architecture has no SDPA attention
            if attn:
                raise
            model = auto.from_config(config, attn_implementation="eager")
    model = model.to(dtype).train()
    if task == "image-classification":
        size = config.image_size
        images = float_input((batch, config.num_channels, size, size), dtype, device)
        return HFLoss(model, "pixel_values"), (
            images,
            class_ids((batch,), config.num_labels, device),
        )
    ids = token_ids(batch, seq, config.vocab_size, device)
    if task == "sequence-classification":
        return HFLoss(model, "input_ids"), (ids, class_ids((batch,), config.num_labels, device))
    return HFLoss(model, "input_ids"), (ids, token_ids(batch, seq, config.vocab_size, device))


def _validation_errors() -> tuple[type[Exception], ...]:
    try:
        from huggingface_hub.errors import StrictDataclassFieldValidationError
    except ImportError:  # huggingface_hub before strict dataclasses: no validation to translate
        return ()
    return (StrictDataclassFieldValidationError,)


@contextmanager
def config_errors(source: str) -> Iterator[None]:
    """transformers' config validation (huggingface_hub's strict dataclasses: 'Field
    tie_word_embeddings expected bool, got str') as one line naming the `--set` field."""
    try:
        yield
    except Exception as err:
        if not isinstance(err, _validation_errors()):
            raise
        text = " ".join(str(err).split())
        field = re.search(r"field '([^']+)'", text)
        name = field.group(1) if field else "a field"
        raise UnknownModelError(
            f"{source}: its config refuses {name}: {text.partition(':')[2].strip()} "
            f"(check --set {name}=...)"
        ) from None


def _shrunk(fields: dict[str, Any], table: dict[str, int], positions: int) -> dict[str, Any]:
    """Config overrides that shrink a model: the sizes of `table` where the default config has
    that field as a number (Swin's `num_heads` is a list per stage), `positions` for its position
    fields, and special token ids moved inside the smaller vocabulary."""
    sizes: dict[str, Any] = {k: v for k, v in table.items() if type(fields.get(k)) is int}
    sizes |= {k: positions for k in _POSITIONS if k in fields}
    last = table["vocab_size"] - 1
    sizes |= {
        k: last
        for k, v in fields.items()
        if k.endswith("_token_id") and isinstance(v, int) and v > last
    }
    return sizes


def _config_kwargs(
    model_type: str, seq: int, tiny: bool, overrides: dict[str, Any]
) -> tuple[dict[str, Any], Any]:
    """The `AutoConfig.for_model` keyword arguments for this build, and the default config."""
    from transformers import CONFIG_MAPPING, AutoConfig

    if model_type not in CONFIG_MAPPING:
        close = get_close_matches(model_type, CONFIG_MAPPING.keys(), n=3)
        raise UnknownModelError(
            f"hf:{model_type}: transformers has no model type {model_type!r}"
            + (f" (close: {', '.join(close)})" if close else "")
            + "; list them with: python -c "
            '"from transformers import CONFIG_MAPPING; print(sorted(CONFIG_MAPPING.keys()))"'
        )
    default = AutoConfig.for_model(model_type)
    fields = default.to_dict()
    kwargs: dict[str, Any] = {"use_cache": False}
    kwargs |= {k: 0.0 for k, v in fields.items() if "drop" in k and type(v) in (int, float)}
    if tiny:
        kwargs |= _shrunk(fields, TINY, positions=seq)
    unknown = [k for k in overrides if not hasattr(default, k)]
    if unknown:
        raise UnknownModelError(
            f"hf:{model_type}: its config has no field {', '.join(map(repr, unknown))}; "
            f"valid fields: {', '.join(sorted(fields))}"
        )
    return kwargs | overrides, default


def build(
    model_type: str,
    *,
    batch: int,
    seq: int,
    dtype: torch.dtype,
    device: torch.device,
    tiny: bool,
    overrides: dict[str, Any],
) -> tuple[nn.Module, tuple[torch.Tensor]]:
    try:
        from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError as err:
        raise UnknownModelError(
            f"hf:{model_type} needs Hugging Face transformers: pip install 'remat[hf]'"
        ) from err
    overrides = dict(overrides)
    attn = overrides.pop("attn_implementation", None)
    kwargs, default = _config_kwargs(model_type, seq, tiny, overrides)
    if not hasattr(default, "vocab_size"):
        raise UnknownModelError(
            f"hf:{model_type} does not read token ids (its config has no vocab_size); hf: builds "
            "text models, so write a 'pkg.module:factory' that returns this one and its inputs"
        )
    causal = model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    auto = AutoModelForCausalLM if causal else AutoModel

    def from_config(impl: str) -> nn.Module:
        return auto.from_config(
            AutoConfig.for_model(model_type, attn_implementation=impl, **kwargs)
        )

    def built() -> nn.Module:
        try:
            return from_config(attn or "sdpa")
        except ValueError:  # this architecture has no SDPA attention
            if attn:
                raise
            try:
                return from_config("eager")
            except ValueError as err:  # the model's own check of its config
                raise UnknownModelError(
                    f"hf:{model_type}: transformers does not build it"
                    + (" at --tiny's sizes" if tiny else "")
                    + f": {' '.join(str(err).split())} (give its config fields with --set "
                    "FIELD=VALUE)"
                ) from None

    with torch.device(device), config_errors(f"hf:{model_type}"):
        try:
            model = built()
        except AssertionError as err:  # a causal LM head that asserts is_decoder (Reformer's)
            if "is_decoder" not in str(err) or "is_decoder" in overrides:
                raise
            kwargs["is_decoder"] = True
            model = built()
    learned = _learned_positions(model)
    if learned is not None and seq > learned[1]:
        raise _too_long(f"hf:{model_type}", seq, *learned)
    wrapped = HFLogits(model.to(dtype), "logits" if causal else "last_hidden_state")
    return wrapped, (token_ids(batch, seq, model.config.vocab_size, device),)


def _learned_positions(model: nn.Module) -> tuple[str, int] | None:
    """The config field and length of the model's learned position table (GPT-2's `wpe`, BERT's
    and BART's position embeddings), or None: rotary and relative positions have no table. Past
    its length a GPU's embedding asserts, where a trace on fake tensors reads on unchecked."""
    has_table = any(
        isinstance(m, nn.Embedding) and ("pos" in name.rsplit(".", 1)[-1] or name.endswith("wpe"))
        for name, m in model.named_modules()
    )
    for field in _POSITIONS if has_table else ():
        limit = getattr(model.config, field, None)
        if isinstance(limit, int):
            return field, limit
    return None


def _too_long(name: str, seq: int, field: str, limit: int) -> SequenceLimitError:
    return SequenceLimitError(
        f"seq={seq} exceeds {name}'s {field}={limit} positions: ask for a shorter sequence "
        f"(CLI: --seq {limit}) or build more positions (CLI: --set {field}={seq})",
        limit=limit,
        lever=f"--set {field}=N",
    )


#: Small sizes for the models users bring, on top of `TINY`: image, audio and mixture-of-experts
#: fields, under the names their configs use.
SMALL = {
    **TINY,
    "d_kv": 16,
    "image_size": 64,
    "patch_size": 8,
    "num_mel_bins": 16,
    "max_source_positions": 32,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
}


def build_for_training(
    model_type: str, *, batch: int = 2, seq: int = 64, small: bool = True, seed: int = 0
) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A Hugging Face model as a user trains it: its task head (causal LM, seq2seq LM, masked LM,
    image classification, speech seq2seq, CTC) built from the architecture's default config, default
    dropout and caching, in train mode on the CPU, and the keyword inputs of its default call with
    labels, so that `model(**inputs).loss` is the training loss. `small` shrinks only the sizes
    (layers, widths, vocabulary, image and audio lengths). Nothing is downloaded."""
    try:
        import transformers
        from transformers import AutoConfig
        from transformers.models.auto import modeling_auto as auto
    except ImportError as err:
        raise UnknownModelError(
            f"hf:{model_type} needs Hugging Face transformers: pip install 'remat[hf]'"
        ) from err
    default = AutoConfig.for_model(model_type)
    fields = default.to_dict()
    # Room for position offsets (RoBERTa starts after the padding index).
    positions = 2 * max(seq, SMALL["max_source_positions"])
    sizes = _shrunk(fields, SMALL, positions) if small else {}
    config = AutoConfig.for_model(model_type, **sizes)
    if config.is_encoder_decoder and getattr(config, "decoder_start_token_id", None) is None:
        config.decoder_start_token_id = config.pad_token_id or 0  # as T5's released configs
    heads = (
        (auto.MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES, "AutoModelForSpeechSeq2Seq"),
        (auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES, "AutoModelForSeq2SeqLM"),
        (auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES, "AutoModelForMaskedLM"),  # BERT: its pretraining
        (auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, "AutoModelForCausalLM"),
        (auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES, "AutoModelForImageClassification"),
        (auto.MODEL_FOR_CTC_MAPPING_NAMES, "AutoModelForCTC"),  # wav2vec2 & co.: speech to text
    )
    head = next((cls for names, cls in heads if model_type in names), None)
    if head is None:
        raise UnknownModelError(
            f"hf:{model_type}: no task head remat knows how to feed (causal or seq2seq LM, masked "
            "LM, image classification, speech seq2seq, CTC); build it in a 'pkg.module:factory'"
        )
    torch.manual_seed(seed)
    names = next(names for names, cls in heads if cls == head)[model_type]
    # Some architectures map to several classes (DeiT: with and without a teacher): the first.
    name = names[0] if isinstance(names, (list, tuple)) else names
    model = getattr(transformers, name)._from_config(config).train()
    vocab = getattr(config, "vocab_size", None)
    if head == "AutoModelForImageClassification":
        size = getattr(config, "image_size", SMALL["image_size"])  # conv nets take any size
        size = size[0] if isinstance(size, (list, tuple)) else size
        inputs = {
            "pixel_values": torch.randn(batch, config.num_channels, size, size),
            "labels": torch.randint(config.num_labels, (batch,)),
        }
    elif head == "AutoModelForSpeechSeq2Seq":
        frames = 2 * config.max_source_positions
        inputs = {
            "input_features": torch.randn(batch, config.num_mel_bins, frames),
            "labels": torch.randint(vocab, (batch, seq)),
        }
    elif head == "AutoModelForCTC":
        # raw audio: `seq` frames of the feature encoder's total stride; labels a quarter as long
        stride = prod(getattr(config, "conv_stride", (320,)))
        inputs = {
            "input_values": torch.randn(batch, seq * stride),
            "labels": torch.randint(1, vocab, (batch, seq // 4)),
        }
    else:
        ids = torch.randint(vocab, (batch, seq))
        inputs = {"input_ids": ids, "labels": ids.clone()}
    return model, inputs
