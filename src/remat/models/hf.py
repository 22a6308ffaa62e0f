"""`hf:<model_type>`: a Hugging Face transformers model built offline from its config class.

`AutoConfig.for_model` gives the architecture's default config (hf:gpt2 is GPT-2 small, hf:llama
is Llama-2-7B's shape) and `from_config` builds it with no download. Dropout is off unless asked
for, so gradients are deterministic; the KV cache is off, as in training; attention goes through
SDPA where the architecture supports it, else the eager implementation.

The model sits behind `HFLogits` so that `model(input_ids)` returns a tensor, which remat sums for
a loss, instead of a ModelOutput. On meta tensors transformers' mask code reads a value
(`.item()`) and fails; trace these models under FakeTensorMode instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from difflib import get_close_matches
from typing import Any

import torch
from torch import nn

from remat.errors import UnknownModelError
from remat.models.preset import token_ids

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
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 512,
}
_POSITIONS = ("n_positions", "max_position_embeddings")


class HFLogits(nn.Module):
    """Calls a transformers model on token ids and returns one tensor: its logits, or for a model
    without a language-model head its last hidden state."""

    def __init__(self, model: nn.Module, output: str):
        super().__init__()
        self.model = model
        self.output = output

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        with _unpacked_sequences():
            return getattr(self.model(input_ids=input_ids), self.output)


@contextlib.contextmanager
def _unpacked_sequences() -> Iterator[None]:
    """Tell transformers that the batch holds no packed sequences.

    transformers looks for packed sequences by reading the position ids; on fake tensors it cannot,
    so it assumes packing and materialises a causal mask that SDPA then keeps for backward, where a
    real run skips the mask. This wrapper only ever feeds whole unpacked sequences (positions
    0..seq-1), for which transformers' own answer is `None`: we give that answer on every device.
    """
    try:
        from transformers import masking_utils
    except ImportError:  # pragma: no cover - hf extra missing is reported at build time
        yield
        return
    original = getattr(masking_utils, "find_packed_sequence_indices", None)
    if original is None:
        yield
        return
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


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
        kwargs |= {k: v for k, v in TINY.items() if k in fields}
        kwargs |= {k: seq for k in _POSITIONS if k in fields}
        # Special token ids must stay inside the smaller vocabulary.
        last = TINY["vocab_size"] - 1
        kwargs |= {
            k: last
            for k, v in fields.items()
            if k.endswith("_token_id") and isinstance(v, int) and v > last
        }
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

    with torch.device(device):
        try:
            model = from_config(attn or "sdpa")
        except ValueError:  # this architecture has no SDPA attention
            if attn:
                raise
            model = from_config("eager")
    wrapped = HFLogits(model.to(dtype), "logits" if causal else "last_hidden_state")
    return wrapped, (token_ids(batch, seq, model.config.vocab_size, device),)
