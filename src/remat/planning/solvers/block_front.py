"""Every block choice that no other beats on recompute and peak: the exact answer to the block
MILP (`remat.planning.solvers.milp`) at every budget at once, without HiGHS.

Why: HiGHS accepts rows violated by ~1e-6 of their scale, so on gigabyte steps it returns plans a
few kilobytes over the budget, and each exact re-check then cuts off one of them: 9-26 HiGHS runs
per budget on a Llama (32 interchangeable blocks make that many arrangements of one over-budget
mix), 0.1 s each. A transformer's blocks repeat, so the distinct (kept bytes, recompute) pairs a
prefix of blocks can reach are few, and a label-setting search over the blocks in forward order
keeps only those no other prefix beats (Nemhauser and Ullmann's knapsack front):

    label after blocks 0..b-1 = (kept bytes so far, what block b-1 prefetches, host bytes,
                                 the largest peak expression so far, exact recompute)

Block b with option k turns a label into (kept + kept_k, prefetch_k, host + host_k,
max(peak, kept + backward_k + prefetch), recompute + seconds_k); after the last block the forward
row (all kept bytes + the forward extra) joins the peak. Every future peak expression grows with
the kept bytes, the prefetch and the host bytes, so a label at least as large on all five as another
with the same prefetch can never lead to a better plan and is dropped: the front after the last
block holds, for every budget, the least recompute that fits and the lowest peak among its ties, so
one search answers every budget the planner asks (32 per 8B `fit`).

Exactness: bytes are int64; recompute is summed exactly, every float a multiple of the smallest
power of two any option's seconds needs, in two int64 limbs. A plan's recompute is reported as
`math.fsum` rounds it, so "equal recompute" is equal after that rounding, as before.

Limits: blocks that are identical up to noise in their bytes and seconds make a subset-sum whose
front grows exponentially; the search gives up (None) once `MAX_LABELS` labels have been made in
total, a count, not a clock, so whether it answers depends only on the problem. So does a problem
whose seconds span more than ~90 binary orders of magnitude. `milp` then asks HiGHS. Under a
host-memory cap (offload) a label only beats labels of equal prefetch and equal host bytes, so
those fronts grow faster: 32 Llama blocks with three offload options under a cap give up after
~1.3 s (16 blocks: 0.3 s, answered), and HiGHS answers as it did before the front.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np


class Option(Protocol):
    """What the search reads of a block's option (`remat.planning.solvers.milp.BlockOption`)."""

    @property
    def kept_bytes(self) -> int: ...
    @property
    def backward_bytes(self) -> int: ...
    @property
    def prefetch_bytes(self) -> int: ...
    @property
    def host_bytes(self) -> int: ...
    @property
    def recompute_seconds(self) -> float: ...


class Problem(Protocol):
    """What the search reads of a problem (`remat.planning.solvers.milp.BlockProblem`, which
    imports this module, so it is named here by its fields)."""

    @property
    def options(self) -> Sequence[Sequence[Option]]: ...
    @property
    def forward_extra_bytes(self) -> int: ...
    @property
    def host_budget_bytes(self) -> int | None: ...


#: How many labels the search may make in all (about a second of work on this 2-core machine);
#: 8B at seq 8192 makes 10,000-100,000, 126 identical blocks of 5 options up to 1,300,000.
MAX_LABELS = 2_000_000

_LIMB = 32  # the low limb of the exact recompute holds 32 bits
_MASK = (1 << _LIMB) - 1
_MAX_UNITS_BITS = 93  # the high limb (int64) must hold a sum of up to 2**(93 - 32) units


@dataclass(frozen=True)
class Front:
    """The labels after the last block: `peak` (bytes above the fixed bytes), the exact recompute
    (`high` * 2**32 + `low` units of 1 / `unit` seconds), and the way back to each choice."""

    peak: np.ndarray
    high: np.ndarray
    low: np.ndarray
    unit: int
    steps: tuple[tuple[np.ndarray, np.ndarray], ...]  # per block: (parent label, option)

    def choice(self, label: int) -> tuple[int, ...]:
        """The option per block of one label."""
        out = []
        for parent, option in reversed(self.steps):
            out.append(int(option[label]))
            label = int(parent[label])
        return tuple(reversed(out))

    def seconds(self, label: int) -> float:
        """A label's recompute as `math.fsum` rounds it (Python's int division rounds exactly)."""
        return ((int(self.high[label]) << _LIMB) + int(self.low[label])) / self.unit

    def cheapest(self, room_bytes: int) -> int | None:
        """The label of least recompute whose peak is at most `room_bytes`, the lowest peak among
        equal recompute; None when no label fits."""
        fits = np.flatnonzero(self.peak <= room_bytes)
        if not fits.size:
            return None
        order = fits[np.lexsort((self.peak[fits], self.low[fits], self.high[fits]))]
        least = self.seconds(int(order[0]))
        tied = itertools.takewhile(lambda i: self.seconds(int(i)) == least, order)
        return int(min(tied, key=lambda i: (int(self.peak[i]), int(i))))

    def lowest(self) -> int:
        """The label of lowest peak, least recompute among equal peaks."""
        return int(np.lexsort((self.low, self.high, self.peak))[0])


def front(problem: Problem, max_labels: int = MAX_LABELS) -> Front | None:
    """The front of `problem` (its fixed bytes left out), or None past `max_labels` labels made or
    where its seconds cannot be summed exactly in two limbs (see the module docstring)."""
    seconds = [o.recompute_seconds for block in problem.options for o in block]
    unit = max(s.as_integer_ratio()[1] for s in seconds)
    units = [[_units(o.recompute_seconds, unit) for o in block] for block in problem.options]
    if sum(max(block) for block in units).bit_length() > _MAX_UNITS_BITS:
        return None
    capped = problem.host_budget_bytes is not None
    host_cap = problem.host_budget_bytes if capped else 0
    last = len(problem.options) - 1
    kept = peak = prefetch = host = high = low = np.zeros(1, dtype=np.int64)
    steps = []
    made = 0
    for b, block in enumerate(problem.options):
        option_kept, option_backward, option_prefetch, option_host = (
            np.array([getattr(o, field) for o in block], dtype=np.int64)
            for field in ("kept_bytes", "backward_bytes", "prefetch_bytes", "host_bytes")
        )
        if not capped:
            option_host = np.zeros_like(option_host)
        option_high = np.array([u >> _LIMB for u in units[b]], dtype=np.int64)
        option_low = np.array([u & _MASK for u in units[b]], dtype=np.int64)
        made += kept.size * len(block)
        if made > max_labels:
            return None
        grid = (kept.size, len(block))
        new_peak = np.maximum(
            peak[:, None], kept[:, None] + option_backward[None, :] + prefetch[:, None]
        ).ravel()
        new_kept = (kept[:, None] + option_kept[None, :]).ravel()
        new_host = (host[:, None] + option_host[None, :]).ravel()
        new_prefetch = np.broadcast_to(option_prefetch[None, :], grid).ravel()
        new_low = (low[:, None] + option_low[None, :]).ravel()
        new_high = (high[:, None] + option_high[None, :]).ravel() + (new_low >> _LIMB)
        new_low &= _MASK
        parent = np.repeat(np.arange(kept.size), len(block))
        option = np.tile(np.arange(len(block)), kept.size)
        if b == last:  # the forward row: every kept byte and the forward's extra
            new_peak = np.maximum(new_peak, new_kept + problem.forward_extra_bytes)
            new_kept = new_prefetch = np.zeros_like(new_kept)
        alive = _undominated(new_kept, new_prefetch, new_host, new_peak, new_high, new_low)
        if capped:
            alive = alive[new_host[alive] <= host_cap]
        kept, prefetch, host = new_kept[alive], new_prefetch[alive], new_host[alive]
        peak, high, low = new_peak[alive], new_high[alive], new_low[alive]
        steps.append((parent[alive], option[alive]))
    return Front(peak, high, low, unit, tuple(steps))


def _units(seconds: float, unit: int) -> int:
    numerator, denominator = seconds.as_integer_ratio()
    return numerator * (unit // denominator)


def _undominated(kept, prefetch, host, peak, high, low) -> np.ndarray:
    """The labels no other label with the same prefetch and host bytes beats on kept bytes, peak
    and recompute together (ties: the first in (recompute, kept, peak) order), in that order.
    A sweep in recompute order keeps, per (prefetch, host), the staircase of (kept, peak) seen;
    where all labels share those bytes, the labels an earlier one is known to beat are dropped
    first, in arrays (most of them: 538,486 of 539,070 in a front of the 8B fit)."""
    order = np.lexsort((peak, kept, low, high))
    if order.size > 1 and (prefetch == prefetch[0]).all() and (host == host[0]).all():
        order = order[~_beaten_by_earlier(kept[order], peak[order])]
    return _sweep(order, kept, prefetch, host, peak)


def _beaten_by_earlier(kept: np.ndarray, peak: np.ndarray) -> np.ndarray:
    """Of labels in sweep order, those that an earlier label beats (no more kept bytes, no higher
    peak): checked against the label just before and against the earlier labels of least kept
    bytes and of lowest peak. Not every beaten label, only labels the sweep drops too: a label
    one of these beats, the sweep finds beaten by the staircase, which beats what it has seen."""
    beaten = np.zeros(kept.size, dtype=bool)
    beaten[1:] = (kept[:-1] <= kept[1:]) & (peak[:-1] <= peak[1:])
    index = np.arange(kept.size)
    for key, other in ((kept, peak), (peak, kept)):
        lowest_before = np.minimum.accumulate(key)[:-1]
        new_low = np.concatenate(([True], key[1:] < lowest_before))
        first_lowest = np.maximum.accumulate(np.where(new_low, index, 0))[:-1]  # before each
        beaten[1:] |= (key[first_lowest] <= key[1:]) & (other[first_lowest] <= other[1:])
    return beaten


def _sweep(order, kept, prefetch, host, peak) -> np.ndarray:
    """The labels of `order` (sweep order) no earlier one beats, per (prefetch, host)."""
    stairs: dict[tuple[int, int], tuple[list[int], list[int]]] = {}
    alive = []
    for i, k, p, f, h in zip(
        order.tolist(),
        kept[order].tolist(),
        peak[order].tolist(),
        prefetch[order].tolist(),
        host[order].tolist(),
        strict=True,
    ):
        ks, ps = stairs.setdefault((f, h), ([], []))  # kept ascending, peak descending
        j = bisect.bisect_right(ks, k)
        if j and ps[j - 1] <= p:
            continue
        alive.append(i)
        start = stop = bisect.bisect_left(ks, k)
        while stop < len(ks) and ps[stop] >= p:
            stop += 1
        ks[start:stop], ps[start:stop] = [k], [p]
    return np.array(alive, dtype=np.int64)
