"""What torch lacks for the ops a trace meets: FLOP formulas `torch.utils.flop_counter` has none
for, and fake kernels where torch's meta kernel is narrower than the real kernels. The recorder
(`remat.tracing.recorder`) counts an op's FLOPs with `EXTRA_FLOPS` where torch has no formula, and
runs `FAKE_KERNELS`' kernel on fake tensors outside the dtype torch's meta kernel accepts."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count


def _heads_as_query(q: torch.Tensor, kv: torch.Tensor) -> tuple[int, ...]:
    """K/V shape with the query's head count: grouped-query attention costs as many FLOPs."""
    return (kv.shape[0], q.shape[1], kv.shape[2], kv.shape[3])


def _grouped_mm_flops(a: torch.Tensor, b: torch.Tensor, *args: Any, **kwargs: Any) -> int:
    """A grouped matmul (the experts of a mixture of experts) costs the matmuls of its groups,
    2 x (rows of `a`, all groups) x K x N. Only 3d x 2d pairs each row with one group's N columns,
    not all groups' (torch.utils.flop_counter has no formula)."""
    groups_of_a = a.shape[0] if a.dim() == 3 and b.dim() == 2 else 1
    return 2 * a.numel() * b.shape[-1] // groups_of_a


#: torch.utils.flop_counter has no formula for the CPU flash-attention kernels (counted with its own
#: SDPA formulas, as it counts the CUDA flash kernels) nor for grouped matmuls.
EXTRA_FLOPS: dict[str, Callable[..., int]] = {
    "_scaled_dot_product_flash_attention_for_cpu": lambda q, k, v, *a, **kw: sdpa_flop_count(
        q.shape, _heads_as_query(q, k), _heads_as_query(q, v)
    ),
    "_scaled_dot_product_flash_attention_for_cpu_backward": lambda g, q, k, v, *a, **kw: (
        sdpa_backward_flop_count(g.shape, q.shape, _heads_as_query(q, k), _heads_as_query(q, v))
    ),
    "_grouped_mm": _grouped_mm_flops,
}


def _fake_grouped_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    offs: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The output of `_grouped_mm` in each of its four layouts (2d x 2d splits K into groups)."""
    if a.dim() == 2 and b.dim() == 2:
        shape = (offs.shape[0], a.shape[0], b.shape[1])
    elif a.dim() == 2:
        shape = (a.shape[0], b.shape[-1])
    elif b.dim() == 2:
        shape = (a.shape[1], b.shape[-1])
    else:
        shape = (a.shape[0], a.shape[1], b.shape[-1])
    return a.new_empty(shape, dtype=out_dtype or a.dtype)


#: Fake kernels for ops whose meta kernel keeps one CUDA kernel's restrictions that the CPU kernel
#: (and CUDA's fallback) does not have, used outside the dtype torch's meta kernel accepts: meta
#: `_grouped_mm` takes bf16 only (with 16-byte aligned rows); the CPU kernel fp32 too, and Hugging
#: Face's experts call it in the parameters' dtype.
FAKE_KERNELS: dict[str, tuple[torch.dtype, Callable[..., torch.Tensor]]] = {
    "_grouped_mm": (torch.bfloat16, _fake_grouped_mm),
}


#: Loss kernels whose real output is allocated at the inputs' (broadcast) shape and then resized to
#: the reduced 0-d loss (mse_loss and smooth_l1_loss: their structured meta function, shared by CPU
#: and CUDA; binary_cross_entropy, soft_margin_loss: their `_out` kernels), so the loss keeps the
#: whole buffer's storage until it is dropped. Their meta kernels return a fresh 0-d tensor. The
#: value is the position of the `reduction` argument (default mean; 0 is none: no resize).
RESIZED_LOSSES: dict[str, int] = {
    "mse_loss": 2,
    "smooth_l1_loss": 2,
    "binary_cross_entropy": 3,
    "soft_margin_loss": 2,
}


def with_real_loss_storage(packet: str, args: tuple, kwargs: dict, out: Any) -> Any:
    """`out` of a fake `RESIZED_LOSSES` kernel on the storage the real kernel leaves it on."""
    at = RESIZED_LOSSES.get(packet)
    if at is None:
        return out
    reduction = args[at] if len(args) > at else kwargs.get("reduction", 1)
    if reduction == 0:
        return out
    shape = torch.broadcast_shapes(args[0].shape, args[1].shape)
    return out.new_empty(shape).resize_(())
