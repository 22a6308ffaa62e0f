"""The CUDA caching allocator, as a model: what `torch.cuda.memory_stats()` would report for a
sequence of allocations and frees, with no GPU.

A GPU user reads allocated and reserved bytes, not live tensor bytes. The difference is the
caching allocator's (c10/cuda/CUDACachingAllocator.cpp, torch 2.13), whose rules this follows:

- `round_size`: a request is rounded up to a multiple of 512 bytes (kMinBlockSize);
- pools: requests up to 1 MiB (kSmallSize) come from the small pool, larger from the large one;
  blocks belong to the stream that allocated them and are never handed to another stream;
- `get_free_block`: the smallest cached block of the pool and stream that holds the request
  (best fit, then lowest address); with `max_split_size`, a small request does not take an
  oversize block, and an oversize request not one more than 20 MiB larger than itself; under
  expandable segments a segment's free tail counts as the size it can expand to, so the next
  larger free block of the stream, if there is one, is taken before it;
- `get_allocation_size`: without a fitting block, a new segment is cudaMalloc'd: 2 MiB
  (kSmallBuffer) for a small request, 20 MiB (kLargeBuffer) for one under 10 MiB (kMinLargeAlloc),
  else the request rounded up to 2 MiB (kRoundLarge);
- `should_split`: the rest of a block is split off as a free block when it is at least 512 bytes
  (small pool) or more than 1 MiB (large pool, and only for requests under `max_split_size`);
  otherwise the whole block is allocated, and counts in allocated bytes;
- `free_block`: a freed block merges with free neighbours of its segment;
- out of memory (a segment would take reserved bytes past `capacity`): free the oversize cached
  blocks (`release_available_cached_blocks`, with `max_split_size`), then every cached segment
  that is whole (`release_cached_blocks`), retrying after each; then give up (an OOM);
- `expandable_segments:True`: one segment per stream and pool whose pages (2 MiB small, 20 MiB
  large) are mapped at its end as it grows; every remainder of at least 512 bytes is split off.

Not modelled: CUDA graph pools, `garbage_collection_threshold`, `roundup_power2_divisions`,
events of blocks used on other streams (`record_stream`: FSDP2 does not use it), the unmapping of
pages inside an expandable segment (only its free tail is unmapped when memory runs out).
Pure Python: no torch.
"""

from __future__ import annotations

import bisect
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

MIN_BLOCK = 512  # kMinBlockSize
SMALL_SIZE = 1 << 20  # kSmallSize: largest request of the small pool
SMALL_BUFFER = 2 << 20  # kSmallBuffer: a small pool segment, and its expandable page
MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc
LARGE_BUFFER = 20 << 20  # kLargeBuffer: a large segment for requests under 10 MiB; expandable page
ROUND_LARGE = 2 << 20  # kRoundLarge


@dataclass(frozen=True)
class Alloc:
    """A tensor's storage of `nbytes` allocated on `stream`; `key` names it for its `Free`."""

    key: Hashable
    nbytes: int
    stream: int = 0


@dataclass(frozen=True)
class Free:
    key: Hashable


@dataclass(frozen=True)
class AllocatorSettings:
    """The `PYTORCH_CUDA_ALLOC_CONF` options that move the peak, and the bytes the allocator may
    reserve (`capacity`: the GPU's memory less what sits outside the allocator; None: no limit)."""

    expandable_segments: bool = False
    max_split_size: int | None = None
    capacity: int | None = None

    def describe(self) -> str:
        """As PYTORCH_CUDA_ALLOC_CONF would say it."""
        parts = [f"expandable_segments:{self.expandable_segments}"]
        if self.max_split_size is not None:
            parts.append(f"max_split_size_mb:{self.max_split_size >> 20}")
        return ",".join(parts)


@dataclass(frozen=True)
class AllocatorPeaks:
    """What `torch.cuda.memory_stats()` would say after the events (`.all.peak` and `.current`).

    `requested_bytes`: "requested_bytes.all.peak", the sum of live request sizes;
    `allocated_bytes`: "allocated_bytes.all.peak" (= `max_memory_allocated()`), the blocks handed
    out; `reserved_bytes`: "reserved_bytes.all.peak" (= `max_memory_reserved()`), the segments;
    `alloc_retries`: "num_alloc_retries", the times the cache was freed to retry a cudaMalloc;
    `out_of_memory_at`: the index of the event no retry could serve ("num_ooms" > 0), else None.
    The simulation stops at an out-of-memory error, as the program would."""

    requested_bytes: int
    allocated_bytes: int
    reserved_bytes: int
    current_requested_bytes: int
    current_allocated_bytes: int
    current_reserved_bytes: int
    alloc_retries: int
    out_of_memory_at: int | None
    segments: int

    @property
    def out_of_memory(self) -> bool:
        return self.out_of_memory_at is not None


def round_size(nbytes: int) -> int:
    """A request's block size: a multiple of 512 bytes, at least 512."""
    return max(MIN_BLOCK, -(-nbytes // MIN_BLOCK) * MIN_BLOCK)


def allocation_size(size: int) -> int:
    """The segment cudaMalloc'd for a (rounded) request no cached block holds."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


@dataclass(eq=False, slots=True)
class _Block:
    stream: int
    small: bool
    address: int
    size: int
    segment: _Segment
    allocated: bool = False
    requested: int = 0
    prev: _Block | None = None
    next: _Block | None = None


@dataclass(eq=False, slots=True)
class _Segment:
    address: int
    mapped: int  # bytes reserved: the whole segment, or an expandable one's mapped pages
    page: int = 0  # expandable: the page its mapping grows by; 0 for a cudaMalloc'd segment
    tail: _Block | None = None  # expandable: the block at its highest address

    @property
    def expandable(self) -> bool:
        return self.page > 0


class _Allocator:
    def __init__(self, settings: AllocatorSettings) -> None:
        self.settings = settings
        # per pool (small or not): the free blocks' keys, sorted, and the blocks by key
        self.free_blocks: dict[bool, list[tuple[int, int, int]]] = {True: [], False: []}
        self.by_key: dict[bool, dict[tuple[int, int, int], _Block]] = {True: {}, False: {}}
        self.live: dict[Hashable, _Block] = {}
        self.segments: list[_Segment] = []
        self.expandable: dict[tuple[int, bool], _Segment] = {}
        self.next_address = 0
        self.requested = self.allocated = self.reserved = 0
        self.peak_requested = self.peak_allocated = self.peak_reserved = 0
        self.retries = 0

    # -- the free pools --------------------------------------------------------------------------
    def _insert(self, block: _Block) -> None:
        k = (block.stream, block.size, block.address)
        bisect.insort(self.free_blocks[block.small], k)
        self.by_key[block.small][k] = block

    def _remove(self, block: _Block) -> None:
        k = (block.stream, block.size, block.address)
        pool = self.free_blocks[block.small]
        pool.pop(bisect.bisect_left(pool, k))
        del self.by_key[block.small][k]

    def _take_best_fit(self, stream: int, small: bool, size: int) -> _Block | None:
        """The cached block `get_free_block` hands out for a request of `size`, taken out of its
        pool; None when no cached block serves it."""
        pool = self.free_blocks[small]
        i = bisect.bisect_left(pool, (stream, size, -1))
        if i == len(pool) or pool[i][0] != stream:
            return None
        by_key = self.by_key[small]
        block = by_key[pool[i]]
        # `get_free_block`'s expandable_size: a free tail counts as its size plus the unmapped
        # address space after it, so the next larger free block of the stream wins over it
        tail = block.segment.expandable and block.segment.tail is block
        if tail and i + 1 < len(pool) and pool[i + 1][0] == stream:
            i += 1
            block = by_key[pool[i]]
        limit = self.settings.max_split_size
        if limit is not None and not small:
            if size < limit <= block.size:
                return None
            if size >= limit and block.size >= size + LARGE_BUFFER:
                return None
        del by_key[pool.pop(i)]
        return block

    # -- segments ---------------------------------------------------------------------------------
    def _fits_capacity(self, extra: int) -> bool:
        capacity = self.settings.capacity
        return capacity is None or self.reserved + extra <= capacity

    def _new_segment(self, stream: int, small: bool, size: int) -> _Block | None:
        """cudaMalloc a segment for a request of `size`: its one free block, or None if it would
        pass the capacity."""
        nbytes = allocation_size(size)
        if not self._fits_capacity(nbytes):
            return None
        segment = _Segment(self.next_address, nbytes)
        self.next_address += nbytes
        self.segments.append(segment)
        self._reserve(nbytes)
        return _Block(stream, small, segment.address, nbytes, segment)

    def _grow_expandable(self, stream: int, small: bool, size: int) -> _Block | None:
        """Map pages at the end of the stream's expandable segment of this pool so that its free
        tail holds `size`: the tail block (taken out of the pool), or None past the capacity."""
        key = (stream, small)
        segment = self.expandable.get(key)
        if segment is None:
            segment = _Segment(self.next_address, 0, SMALL_BUFFER if small else LARGE_BUFFER)
            self.next_address += 1 << 50  # address space of its own
            self.expandable[key] = segment
            self.segments.append(segment)
        tail = segment.tail
        start = segment.address if tail is None else tail.address + tail.size
        free_tail = tail if tail is not None and not tail.allocated else None
        have = free_tail.size if free_tail is not None else 0
        pages = -(-(size - have) // segment.page) * segment.page
        if not self._fits_capacity(pages):
            return None
        segment.mapped += pages
        self._reserve(pages)
        if free_tail is not None:
            self._remove(free_tail)
            free_tail.size += pages
            return free_tail
        block = _Block(stream, small, start, pages, segment, prev=tail)
        if tail is not None:
            tail.next = block
        segment.tail = block
        return block

    def _reserve(self, nbytes: int) -> None:
        self.reserved += nbytes
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def _release_cached(self, oversize_only: bool) -> bool:
        """Free cached segments that are whole (every segment's, or only oversize blocks when
        `oversize_only`), and unmap the free tails of expandable segments. True if any went."""
        released = 0
        limit = self.settings.max_split_size
        for small in (True, False):
            for k in list(self.free_blocks[small]):
                block = self.by_key[small][k]
                if block.segment.expandable or block.prev is not None or block.next is not None:
                    continue
                if oversize_only and (limit is None or block.size < limit):
                    continue
                self._remove(block)
                self.segments.remove(block.segment)
                self.reserved -= block.size
                released += block.size
        if not oversize_only:
            for segment in self.expandable.values():
                tail = segment.tail
                if tail is not None and not tail.allocated:
                    self._remove(tail)
                    segment.mapped -= tail.size
                    self.reserved -= tail.size
                    released += tail.size
                    segment.tail = tail.prev
                    if tail.prev is not None:
                        tail.prev.next = None
        return released > 0

    # -- malloc / free ----------------------------------------------------------------------------
    def malloc(self, event: Alloc) -> bool:
        size = round_size(event.nbytes)
        small = size <= SMALL_SIZE
        expandable = self.settings.expandable_segments
        block = self._take_best_fit(event.stream, small, size)
        if block is None:
            grow = self._grow_expandable if expandable else self._new_segment
            block = grow(event.stream, small, size)
            if block is None and self._release_cached(oversize_only=True):
                block = grow(event.stream, small, size)
            if block is None and self._release_cached(oversize_only=False):
                self.retries += 1
                block = grow(event.stream, small, size)
            if block is None:
                return False
        self._split(block, size, expandable)
        block.allocated, block.requested = True, event.nbytes
        self.live[event.key] = block
        self.requested += event.nbytes
        self.allocated += block.size
        if self.requested > self.peak_requested:
            self.peak_requested = self.requested
        if self.allocated > self.peak_allocated:
            self.peak_allocated = self.allocated
        return True

    def _split(self, block: _Block, size: int, expandable: bool) -> None:
        remaining = block.size - size
        limit = self.settings.max_split_size
        if block.small or expandable:
            split = remaining >= MIN_BLOCK
        else:
            split = (limit is None or size < limit) and remaining > SMALL_SIZE
        if not split:
            return
        rest = _Block(
            block.stream,
            block.small,
            block.address + size,
            remaining,
            block.segment,
            prev=block,
            next=block.next,
        )
        if block.next is not None:
            block.next.prev = rest
        block.next, block.size = rest, size
        if block.segment.tail is block:
            block.segment.tail = rest
        self._insert(rest)

    def free(self, event: Free) -> None:
        block = self.live.pop(event.key, None)
        if block is None:
            raise ValueError(f"free of {event.key!r}, which is not allocated")
        self.requested -= block.requested
        self.allocated -= block.size
        block.allocated, block.requested = False, 0
        # merge with the free neighbours of its segment (only the higher one can be its tail)
        before, after = block.prev, block.next
        if before is not None and not before.allocated:
            self._remove(before)
            block.address, block.prev = before.address, before.prev
            if before.prev is not None:
                before.prev.next = block
            block.size += before.size
        if after is not None and not after.allocated:
            self._remove(after)
            block.next = after.next
            if after.next is not None:
                after.next.prev = block
            block.size += after.size
            if block.segment.tail is after:
                block.segment.tail = block
        self._insert(block)


def simulate(
    events: Iterable[Alloc | Free], settings: AllocatorSettings | None = None
) -> AllocatorPeaks:
    """Run the events through the caching allocator under `settings` (torch's defaults if None).
    Stops at the first request it cannot serve within the capacity (`out_of_memory_at`)."""
    allocator = _Allocator(settings or AllocatorSettings())
    oom_at = None
    for index, event in enumerate(events):
        if isinstance(event, Alloc):
            if event.nbytes <= 0:
                raise ValueError(f"allocation {event.key!r} of {event.nbytes} bytes")
            if not allocator.malloc(event):
                oom_at = index
                break
        else:
            allocator.free(event)
    return AllocatorPeaks(
        requested_bytes=allocator.peak_requested,
        allocated_bytes=allocator.peak_allocated,
        reserved_bytes=allocator.peak_reserved,
        current_requested_bytes=allocator.requested,
        current_allocated_bytes=allocator.allocated,
        current_reserved_bytes=allocator.reserved,
        alloc_retries=allocator.retries,
        out_of_memory_at=oom_at,
        segments=len(allocator.segments),
    )
