"""The caching allocator model (`remat.device.allocator`): each rule of c10/cuda/CUDACachingAllocator.cpp
pinned by a small case whose bytes follow from the rule, derived in the comments."""

from __future__ import annotations

import pytest

from remat.device.allocator import (
    Alloc,
    AllocatorSettings,
    Free,
    allocation_size,
    round_size,
    simulate,
)

KiB, MiB = 1 << 10, 1 << 20


def _run(*events, **settings):
    return simulate(list(events), AllocatorSettings(**settings))


def test_requests_round_up_to_512_bytes():
    assert [round_size(n) for n in (1, 512, 513, 1000)] == [512, 512, 1024, 1024]
    peaks = _run(Alloc("a", 1))
    assert (peaks.requested_bytes, peaks.allocated_bytes) == (1, 512)


def test_segment_sizes_by_request():
    # small pool: one 2 MiB segment; large under 10 MiB: 20 MiB; else rounded up to 2 MiB
    assert allocation_size(512) == allocation_size(1 * MiB) == 2 * MiB
    assert allocation_size(1 * MiB + 512) == allocation_size(9 * MiB) == 20 * MiB
    assert allocation_size(10 * MiB) == 10 * MiB
    assert allocation_size(15 * MiB + 1) == 16 * MiB


def test_small_requests_share_one_2_mib_segment():
    # 1000 requests of 1 KiB: 1000 KiB in 512-byte multiples, all in the first 2 MiB segment
    peaks = _run(*(Alloc(i, 1 * KiB) for i in range(1000)))
    assert peaks.allocated_bytes == 1000 * KiB
    assert peaks.reserved_bytes == 2 * MiB and peaks.segments == 1


def test_a_5_mib_request_takes_a_20_mib_segment_the_next_fits_in_its_rest():
    peaks = _run(Alloc("a", 5 * MiB), Alloc("b", 5 * MiB))
    # the 15 MiB rest is more than 1 MiB: split off, and the second request takes 5 MiB of it
    assert peaks.allocated_bytes == 10 * MiB and peaks.reserved_bytes == 20 * MiB


def test_a_large_block_whose_rest_is_at_most_1_mib_is_allocated_whole():
    # 15 MiB + 1 B: a 16 MiB segment (2 MiB rounding); the rest, 1 MiB - 512, stays in the block
    peaks = _run(Alloc("a", 15 * MiB + 1))
    assert peaks.allocated_bytes == 16 * MiB == peaks.reserved_bytes


def test_a_freed_block_is_reused_and_split_best_fit():
    # a 20 MiB segment freed, then 15 MiB: it fits in the cached block, split (5 MiB > 1 MiB)
    peaks = _run(Alloc("a", 5 * MiB), Free("a"), Alloc("b", 15 * MiB))
    assert peaks.reserved_bytes == 20 * MiB and peaks.segments == 1
    assert peaks.current_allocated_bytes == 15 * MiB


def test_freed_neighbours_coalesce():
    # three 6 MiB blocks of one 20 MiB segment freed in the middle-out order merge back into one
    # 20 MiB block, which then holds a 19 MiB request without a new segment
    peaks = _run(
        Alloc("a", 6 * MiB),
        Alloc("b", 6 * MiB),
        Alloc("c", 6 * MiB),
        Free("b"),
        Free("a"),
        Free("c"),
        Alloc("d", 19 * MiB),
    )
    assert peaks.reserved_bytes == 20 * MiB and peaks.segments == 1


def test_blocks_of_one_stream_are_not_given_to_another():
    peaks = _run(Alloc("a", 5 * MiB), Free("a"), Alloc("b", 5 * MiB, stream=1))
    assert peaks.reserved_bytes == 40 * MiB and peaks.segments == 2


def test_max_split_size_keeps_small_requests_out_of_oversize_blocks():
    # with max_split_size 16 MiB, a cached 32 MiB block is oversize: a 5 MiB request does not
    # take it and gets a 20 MiB segment of its own
    peaks = _run(Alloc("a", 32 * MiB), Free("a"), Alloc("b", 5 * MiB), max_split_size=16 * MiB)
    assert peaks.reserved_bytes == 52 * MiB
    default = _run(Alloc("a", 32 * MiB), Free("a"), Alloc("b", 5 * MiB))
    assert default.reserved_bytes == 32 * MiB


def test_out_of_memory_frees_the_cache_and_retries():
    # 50 MiB cached, 60 MiB asked under a 100 MiB capacity: 110 MiB would not fit, so the cached
    # segment is released (one retry) and the 60 MiB segment is made
    peaks = _run(Alloc("a", 50 * MiB), Free("a"), Alloc("b", 60 * MiB), capacity=100 * MiB)
    assert peaks.alloc_retries == 1 and not peaks.out_of_memory
    assert peaks.current_reserved_bytes == 60 * MiB


def test_out_of_memory_is_reported_at_its_event():
    peaks = _run(Alloc("a", 50 * MiB), Alloc("b", 60 * MiB), capacity=100 * MiB)
    assert peaks.out_of_memory and peaks.out_of_memory_at == 1


def test_expandable_segments_map_20_mib_pages_and_fill_them():
    # two 5 MiB requests in one expandable segment: one 20 MiB page holds both
    peaks = _run(Alloc("a", 5 * MiB), Alloc("b", 5 * MiB), expandable_segments=True)
    assert peaks.reserved_bytes == 20 * MiB
    # 15 MiB + 1 B: one 20 MiB page, the rest split off (no whole-block allocation)
    peaks = _run(Alloc("a", 15 * MiB + 1), expandable_segments=True)
    assert peaks.allocated_bytes == 15 * MiB + 512 and peaks.reserved_bytes == 20 * MiB


def test_expandable_segments_grow_where_fixed_segments_fragment():
    # a 30 MiB block held between two freed 30 MiB ones, then 60 MiB asked: fixed segments need
    # a fourth cudaMalloc (90 + 60 = 150 MiB); the expandable segment grows its free tail
    events = [
        Alloc("a", 30 * MiB),
        Alloc("b", 30 * MiB),
        Alloc("c", 30 * MiB),
        Free("a"),
        Free("c"),
        Alloc("d", 60 * MiB),
    ]
    assert _run(*events).reserved_bytes == 150 * MiB
    expandable = _run(*events, expandable_segments=True)
    # a, b, c: 90 MiB in 5 pages (100 MiB, 10 MiB of slack at the end); freed, c and the slack
    # are a 40 MiB free tail, which one more 20 MiB page makes 60 MiB: 120 MiB
    assert expandable.reserved_bytes == 120 * MiB
    assert expandable.allocated_bytes == 90 * MiB


def test_an_expandable_segments_free_tail_is_taken_after_a_larger_free_block():
    # get_free_block under expandable segments: a free tail counts as its size plus the
    # unmapped address space after it (expandable_size), so a larger free block before it wins.
    # a, b, c: 200 MiB in 10 pages; a and c freed: a 100 MiB hole and a 60 MiB free tail.
    # 50 MiB goes in the hole (by size alone it went in the tail), leaving 50 MiB there, so the
    # 100 MiB after it finds no block: the 60 MiB tail grows by two pages, 240 MiB reserved
    # (by size alone the 100 MiB took the whole hole: 200 MiB)
    events = [
        Alloc("a", 100 * MiB),
        Alloc("b", 40 * MiB),
        Alloc("c", 60 * MiB),
        Free("a"),
        Free("c"),
        Alloc("d", 50 * MiB),
        Alloc("e", 100 * MiB),
    ]
    peaks = _run(*events, expandable_segments=True)
    assert peaks.reserved_bytes == 240 * MiB
    assert peaks.current_allocated_bytes == 190 * MiB
    # 110 MiB: no free block holds it, the tail grows by the 50 MiB it lacks, in three pages
    assert _run(*events[:5], Alloc("d", 110 * MiB), expandable_segments=True).reserved_bytes == (
        260 * MiB
    )


def test_a_free_of_an_unknown_key_is_an_error():
    with pytest.raises(ValueError, match="not allocated"):
        _run(Free("nobody"))


def test_settings_are_named_as_pytorch_cuda_alloc_conf_names_them():
    assert AllocatorSettings().describe() == "expandable_segments:False"
    assert (
        AllocatorSettings(True, max_split_size=128 * MiB).describe()
        == "expandable_segments:True,max_split_size_mb:128"
    )
