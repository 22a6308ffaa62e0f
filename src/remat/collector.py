"""Python's cyclic garbage collector paused while remat makes many long-lived objects: a fit or
an estimate builds millions of small records (ops, tensors, lives, allocator events) that live to
its end, and every collection in between walks them all, for nothing reference counting has not
freed already. Nothing here imports torch."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The collector off while the block runs, on again after (where it was on). What the block
    made and kept goes straight to the oldest generation (frozen, then unfrozen): turned on as
    it was, the collector's next young collection would walk it all (1.5 s at the end of the
    70B `--shard 32` fit of issue 35) and free nothing. Cycles it made wait for the next full
    collection, as long-lived objects' do (the 8B fit's peak resident memory: 1.03 GB with the
    collector on, 1.10 GB paused)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.unfreeze()
        gc.enable()
