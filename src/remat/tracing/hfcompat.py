"""Decisions Hugging Face transformers takes by reading tensor data, taken for a fake trace as the
real run takes them.

transformers looks for packed sequences (several sequences in one row) by reading the position
ids (`masking_utils.find_packed_sequence_indices`). On fake tensors it cannot, so it assumes
packing and materialises a causal mask that SDPA then keeps for backward, where a real run with
ordinary positions skips the mask: the trace would hold bytes the step does not. During a fake
trace remat gives transformers the real run's answer: computed on the caller's real
`position_ids` when it passed some, and "not packed" when it did not (transformers then makes
positions 0..seq-1 itself).

Likewise its SDPA mask code skips the mask when the padding mask it built is all ones
(`_ignore_causal_mask_sdpa`, `_ignore_bidirectional_mask_sdpa`), which it cannot read on fake
tensors. When every attention mask the caller passed is all ones (or it passed none, and the model
then builds `torch.ones` itself), remat answers "no padding" as the real run would. Nothing is
imported or changed when transformers is not in use.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake


def _real(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type != "meta" and not is_fake(t)


def _without_fake_padding(decide: Callable[..., bool]) -> Callable[..., bool]:
    def without_padding(padding_mask, *args, **kwargs):
        return decide(None if is_fake(padding_mask) else padding_mask, *args, **kwargs)

    return without_padding


@contextlib.contextmanager
def as_real_run(kwargs: dict[str, Any]) -> Iterator[None]:
    """Within: transformers' data-dependent mask decisions on fake tensors are the real run's."""
    masking = sys.modules.get("transformers.masking_utils")
    if masking is None:
        yield
        return
    patches: dict[str, Any] = {}
    positions = kwargs.get("position_ids")
    packed = _real(positions) and masking.find_packed_sequence_indices(positions) is not None
    if hasattr(masking, "find_packed_sequence_indices") and not packed:
        patches["find_packed_sequence_indices"] = lambda position_ids: None
    masks = [v for k, v in kwargs.items() if "attention_mask" in k and v is not None]
    if all(_real(m) and bool(m.all()) for m in masks):
        for name in ("_ignore_causal_mask_sdpa", "_ignore_bidirectional_mask_sdpa"):
            if hasattr(masking, name):
                patches[name] = _without_fake_padding(getattr(masking, name))
    originals = {name: getattr(masking, name) for name in patches}
    for name, patch in patches.items():
        setattr(masking, name, patch)
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(masking, name, original)
