"""Optimizer moments stored block-wise quantized (8-bit and 4-bit AdamW), sized tensor by tensor as
their libraries allocate them, and the share of them in CUDA unified memory (paged optimizers),
which the caching allocator never sees.

- bitsandbytes `AdamW8bit` (`Optimizer2State`, blockwise): each moment of a parameter with at
  least `min_8bit_size` = 4096 elements is uint8, with an fp32 absmax per 256-element block (the
  last block padded: `n // 256 + bool(n % 256)`); a smaller parameter's moments are fp32 (4 bytes
  an element, whatever the parameter's dtype). The two 256-entry fp32 quantization maps are
  shared by all parameters (2 KiB). `PagedAdamW8bit` puts a moment of 100,000 elements or more
  (`get_state_buffer`: `p.numel() < 1e5` stays on the device) in `cudaMallocManaged` memory.
- torchao `AdamW8bit` / `AdamW4bit` (`torchao.optim`): a moment of a parameter whose local
  (per-rank) tensor has at least 4096 elements and a whole number of blocks is an
  `OptimState8bit` (uint8 codes, fp32 scale per 256-element block, its own 256-entry fp32 map) or
  `OptimState4bit` (two codes a byte, fp32 scale per 128-element block, a 16-entry fp32 map);
  any other moment is `zeros_like(p)`: the parameter's dtype.

Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class BlockQuantized:
    """How a library stores one moment of one parameter: `bits` per element in blocks of `block`
    elements, each block with a `scale_bytes` scale, once the tensor has `min_elements`
    (and, where `whole_blocks`, a whole number of blocks); `map_bytes` of quantization map per
    quantized tensor, `shared_bytes` once for the optimizer. A tensor left unquantized keeps
    `small_element_bytes` an element (None: the parameter's own). `paged_min_elements`: moments
    of at least this many elements live in unified memory (paged optimizers), None: none do."""

    bits: int
    block: int
    scale_bytes: int = 4
    min_elements: int = 4096
    whole_blocks: bool = False
    small_element_bytes: int | None = None
    map_bytes: int = 0
    shared_bytes: int = 0
    paged_min_elements: int | None = None

    def moment_bytes(self, elements: int, element_bytes: int) -> int:
        """Bytes of one moment of a tensor of `elements` whose parameter has `element_bytes`."""
        quantized = elements >= self.min_elements and (
            not self.whole_blocks or elements % self.block == 0
        )
        if not quantized:
            return elements * (self.small_element_bytes or element_bytes)
        blocks = -(-elements // self.block)
        return -(-elements * self.bits // 8) + blocks * self.scale_bytes + self.map_bytes

    def paged(self, elements: int) -> bool:
        return self.paged_min_elements is not None and elements >= self.paged_min_elements

    def state_bytes(self, tensors: Iterable[tuple[int, int]], moments: int = 2) -> tuple[int, int]:
        """(device bytes, paged bytes) of `moments` moments of each (elements, element bytes)."""
        device = paged = 0
        for elements, element_bytes in tensors:
            n = moments * self.moment_bytes(elements, element_bytes)
            if self.paged(elements):
                paged += n
            else:
                device += n
        return device + (self.shared_bytes if device or paged else 0), paged


#: bitsandbytes 0.45 `AdamW8bit` (blockwise), and `PagedAdamW8bit`.
BNB_8BIT = BlockQuantized(bits=8, block=256, small_element_bytes=4, shared_bytes=2 * 256 * 4)
BNB_8BIT_PAGED = BlockQuantized(
    bits=8, block=256, small_element_bytes=4, shared_bytes=2 * 256 * 4, paged_min_elements=100_000
)
#: torchao `torchao.optim.AdamW8bit` and `AdamW4bit`.
TORCHAO_8BIT = BlockQuantized(bits=8, block=256, whole_blocks=True, map_bytes=256 * 4)
TORCHAO_4BIT = BlockQuantized(bits=4, block=128, whole_blocks=True, map_bytes=16 * 4)
