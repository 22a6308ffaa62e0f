"""Which blocks of a chain to checkpoint, on a small pure model of eager `torch.utils.checkpoint`.

Why a model of its own: deciding where to put checkpoint regions in a sequential stack (transformer
blocks, ResNet stages) is a one-dimensional problem that can be solved exactly and fast, provided
the memory of a schedule is a closed formula. This module is that formula (`chain_peak_bytes`, the
single definition every solver here checks feasibility against), the textbook schedules (store
all, store none, checkpoint every block, checkpoint every sqrt(n) blocks) and an exact dynamic
program (`chain_dp`) for the schedule with the least recompute that fits a byte budget.

A schedule (`ChainSchedule`) cuts the blocks into consecutive segments, each STORED (autograd
keeps every block's saved tensors until that block's backward) or CHECKPOINTED (one
`torch.utils.checkpoint` region: the forward keeps only the region's input; the backward re-runs
the region's forward once, after which all its blocks' saved tensors are live until the region's
backward ends). Regions are not nested. Backward runs the last segment first.

The formula is a model of the step, not its judge: it sees each block as an input and its saved
bytes, and the rest of the step as two transients. The planner (`remat.planning.planner`, its fit loop)
turns every schedule it takes from here into checkpoint regions and re-simulates the step with
`remat.prediction.schedule.simulate`; that simulated peak decides whether the plan fits the budget, and when
it does not, the planner shrinks the budget it gives this module by the overshoot and asks again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from remat.errors import InfeasibleBudget, RematError
from remat.units import format_bytes

__all__ = [
    "Chain",
    "ChainBlock",
    "ChainPlan",
    "ChainSchedule",
    "chain_dp",
    "chain_peak_bytes",
    "chain_recompute_seconds",
    "full",
    "min_feasible_bytes",
    "sqrt",
    "store_all",
    "store_none",
]


@dataclass(frozen=True)
class ChainBlock:
    """One block of the chain, as the peak model sees it.

    `forward_seconds` is what checkpointing the block costs (one more forward); `input_bytes` is
    what a checkpoint region starting at this block keeps through the forward; `kept_bytes` is
    what autograd keeps for the block's backward when it runs outside a region (its input
    included if the block saves it).
    """

    name: str
    forward_seconds: float
    input_bytes: int
    kept_bytes: int

    def __post_init__(self) -> None:
        if not (math.isfinite(self.forward_seconds) and self.forward_seconds >= 0):
            raise RematError(
                f"block {self.name!r}: forward_seconds must be finite and >= 0, "
                f"got {self.forward_seconds!r}"
            )
        if self.input_bytes < 0 or self.kept_bytes < 0:
            raise RematError(
                f"block {self.name!r}: input_bytes and kept_bytes must be >= 0, "
                f"got {self.input_bytes} and {self.kept_bytes}"
            )


@dataclass(frozen=True)
class Chain:
    """A non-empty sequence of blocks plus the bytes that do not depend on the schedule.

    `fixed_bytes` (parameters, gradients, optimizer state, the model input) is live throughout;
    `forward_transient_bytes` is added at the worst moment of a forward and
    `backward_transient_bytes` at the worst moment of a block's backward (gradients in flight).
    """

    blocks: tuple[ChainBlock, ...]
    fixed_bytes: int = 0
    forward_transient_bytes: int = 0
    backward_transient_bytes: int = 0

    def __post_init__(self) -> None:
        if not self.blocks:
            raise RematError("a chain needs at least one block")
        if min(self.fixed_bytes, self.forward_transient_bytes, self.backward_transient_bytes) < 0:
            raise RematError(
                "fixed_bytes, forward_transient_bytes and backward_transient_bytes must be >= 0"
            )


@dataclass(frozen=True)
class ChainSchedule:
    """Consecutive segments `(start, stop, checkpointed)`, stop exclusive, starting at block 0.

    Construction checks that the segments are non-empty and contiguous; that the last one ends at
    the chain's last block is checked where a chain is at hand (`chain_peak_bytes`).
    """

    segments: tuple[tuple[int, int, bool], ...]

    def __post_init__(self) -> None:
        position = 0
        for start, stop, _ in self.segments:
            if start != position or stop <= start:
                raise RematError(
                    f"segments must be non-empty and contiguous from block 0, got {self.segments}"
                )
            position = stop
        if not self.segments:
            raise RematError("a schedule needs at least one segment")


@dataclass(frozen=True)
class ChainPlan:
    """A solver's answer: the schedule (None for `store_none`, which is no flat schedule), the
    strategy that produced it, its predicted peak and recompute, and why it looks as it does."""

    schedule: ChainSchedule | None
    strategy: str
    peak_bytes: int
    recompute_seconds: float
    reason: str


def chain_peak_bytes(chain: Chain, schedule: ChainSchedule) -> int:
    """The peak live bytes of one training step under `schedule` in the chain model: the definition
    all solvers here use. A model of eager checkpointing, which the planner's judge,
    `remat.prediction.schedule.simulate`, checks on the real step's graph before a plan is accepted.

    With kept(seg) = the sum of its blocks' kept_bytes if stored, else its first block's
    input_bytes, and K(s) = the kept bytes of the segments before s, the peak is the largest of
    - the end of the forward: fixed + sum of kept(seg) over all segments + forward transient;
    - a checkpointed segment's backward: fixed + K(s) + its input_bytes + the sum of its blocks'
      kept_bytes (all re-materialised by the re-run) + backward transient;
    - a stored segment's backward: fixed + K(s) + kept(s) + backward transient.
    The segments after s have been freed by the time s's backward runs.
    """
    if schedule.segments[-1][1] != len(chain.blocks):
        raise RematError(
            f"schedule covers blocks 0..{schedule.segments[-1][1]} but the chain has "
            f"{len(chain.blocks)} blocks"
        )
    blocks = chain.blocks
    kept_before = 0
    backward_peak = 0
    for start, stop, checkpointed in schedule.segments:
        saved = sum([block.kept_bytes for block in blocks[start:stop]])
        if checkpointed:
            kept = blocks[start].input_bytes
            live = kept + saved
        else:
            kept = live = saved
        backward_peak = max(backward_peak, kept_before + live)
        kept_before += kept
    return chain.fixed_bytes + max(
        kept_before + chain.forward_transient_bytes,
        backward_peak + chain.backward_transient_bytes,
    )


def chain_recompute_seconds(chain: Chain, schedule: ChainSchedule) -> float:
    """Seconds of extra forward: each block in a checkpointed segment is re-run exactly once.

    `math.fsum` rounds the exact sum once, so schedules that recompute the same blocks report the
    same float whatever the segment order.
    """
    return math.fsum(
        block.forward_seconds
        for start, stop, checkpointed in schedule.segments
        if checkpointed
        for block in chain.blocks[start:stop]
    )


def _plan(chain: Chain, schedule: ChainSchedule, strategy: str, reason: str) -> ChainPlan:
    return ChainPlan(
        schedule=schedule,
        strategy=strategy,
        peak_bytes=chain_peak_bytes(chain, schedule),
        recompute_seconds=chain_recompute_seconds(chain, schedule),
        reason=reason,
    )


def store_all(chain: Chain) -> ChainPlan:
    """No checkpointing ("memory rich"): no recompute, a peak that grows with depth."""
    n = len(chain.blocks)
    return _plan(
        chain,
        ChainSchedule(((0, n, False),)),
        "store_all",
        f"keeps the saved tensors of all {n} blocks: no recompute, peak grows with depth",
    )


def store_none(chain: Chain) -> ChainPlan:
    """The "memory poor" extreme: keep only the model input, re-run the prefix for every backward.

    Not a flat segment schedule (block 0's input would be re-read by every block's backward), so
    it is modelled here directly and `schedule` is None. Before block k's backward, blocks 0..k
    are re-run from the input, so the recompute is sum_k sum_{i<=k} forward_seconds[i], O(n^2).
    The peak is fixed + blocks[0].input_bytes + max_k kept_bytes[k] + max(forward transient,
    backward transient): besides the input only one block's saved tensors are live at a time
    (during a re-run, the activation passed between blocks is assumed no larger than what the
    receiving block saves), and the worse of the two transients is charged once.
    """
    blocks = chain.blocks
    n = len(blocks)
    return ChainPlan(
        schedule=None,
        strategy="store_none",
        peak_bytes=chain.fixed_bytes
        + blocks[0].input_bytes
        + max(block.kept_bytes for block in blocks)
        + max(chain.forward_transient_bytes, chain.backward_transient_bytes),
        recompute_seconds=math.fsum(
            block.forward_seconds * (n - i) for i, block in enumerate(blocks)
        ),
        reason=f"keeps only the model input and re-runs blocks 0..k before block k's backward: "
        f"{n * (n + 1) // 2} block forwards of recompute, O(n^2)",
    )


def full(chain: Chain) -> ChainPlan:
    """Every block its own checkpoint region, as `torch.utils.checkpoint` around each block does:
    one extra forward, and the forward keeps one block input per block."""
    n = len(chain.blocks)
    return _plan(
        chain,
        ChainSchedule(tuple((i, i + 1, True) for i in range(n))),
        "full",
        f"checkpoints each of the {n} blocks on its own: one extra forward",
    )


def sqrt(chain: Chain) -> ChainPlan:
    """Chen et al. (2016): checkpoint regions of round(sqrt(n)) blocks, the last possibly shorter.

    All regions are checkpointed, the last included, as in the article, so the recompute is
    exactly one extra forward and the peak is about n/s region inputs plus one region of s blocks,
    O(sqrt(n)) for s = sqrt(n). (Storing the last region instead would save its re-run at almost no
    memory; `chain_dp` finds such refinements.)
    """
    n = len(chain.blocks)
    length = max(1, round(math.sqrt(n)))
    segments = tuple((i, min(i + length, n), True) for i in range(0, n, length))
    return _plan(
        chain,
        ChainSchedule(segments),
        "sqrt",
        f"checkpoints {len(segments)} regions of {length} blocks (~sqrt({n})), Chen et al. 2016: "
        "one extra forward",
    )


def _time_keys(chain: Chain) -> np.ndarray:
    """Per-block recompute costs the DP adds up: integers whenever that loses (almost) nothing.

    Why integers: float sums depend on the order of addition, so two schedules that recompute
    equally long (identical layers, different ones checkpointed) could differ by an ulp, and the
    tie-break by lower peak would then be arbitrary. The times are counted in the finest power of
    two unit that keeps the total below 2^61 (so every sum fits int64): exact when the times are
    multiples of it, else rounded by at most 2^-40 of each block's own time, in which case the DP
    is optimal to that relative precision and equal times tie exactly. If some block's time is
    under ~2^-21 of the total (its rounding would be coarser), it adds float64 seconds instead:
    optimal up to float rounding, but equal times may then differ by an ulp.
    """
    seconds = [block.forward_seconds for block in chain.blocks]
    total = math.fsum(seconds)
    if total == 0:
        return np.zeros(len(seconds), dtype=np.int64)
    unit_exponent = math.frexp(total)[1] - 61
    scaled = [math.ldexp(second, -unit_exponent) for second in seconds]
    if all(abs(value - round(value)) <= value * 2**-40 for value in scaled):
        return np.array([round(value) for value in scaled], dtype=np.int64)
    return np.array(seconds, dtype=np.float64)


@dataclass(frozen=True)
class _Front:
    """The undominated DP states that end a segment at one position, sorted by `kept` ascending.

    A state is a schedule prefix: `kept` = bytes its segments keep (K before the next segment),
    `time` = its recompute, `peak` = the largest (K(s) + live bytes of s's backward) over its
    segments. `prev`/`index` point at the state it extends and `checkpointed` says how the last
    segment was run, to rebuild the schedule.
    """

    kept: np.ndarray
    time: np.ndarray
    peak: np.ndarray
    prev: np.ndarray
    index: np.ndarray
    checkpointed: np.ndarray


def _undominated(parts: list[_Front]) -> _Front:
    """Drop every state that another beats on kept bytes and on (time, peak) in that order.

    Sound because every later constraint and the final objective only grow with K, and the
    objective is (time, then peak): a state with K no larger and (time, peak) no larger
    lexicographically completes every suffix the other completes, at least as well.
    """
    merged = _Front(
        *(np.concatenate(arrays) for arrays in zip(*(vars(p).values() for p in parts), strict=True))
    )
    # Rank states by (time, peak); a plain argsort suffices unless times tie (np.lexsort is slow).
    by_cost = np.argsort(merged.time)
    if (np.diff(merged.time[by_cost]) == 0).any():
        by_cost = np.lexsort((merged.peak, merged.time))
    time, peak = merged.time[by_cost], merged.peak[by_cost]
    new_cost = np.ones(len(by_cost), dtype=bool)
    new_cost[1:] = (time[1:] != time[:-1]) | (peak[1:] != peak[:-1])
    rank = np.empty(len(by_cost), dtype=np.int64)
    rank[by_cost] = np.cumsum(new_cost)
    # Then by kept bytes, cost rank breaking ties; a state survives if it costs less than all before.
    order = by_cost[np.argsort(merged.kept[by_cost], kind="stable")]
    ranks = rank[order]
    keep = np.empty(len(order), dtype=bool)
    keep[:1] = True
    keep[1:] = ranks[1:] < np.minimum.accumulate(ranks)[:-1]
    chosen = order[keep]
    return _Front(*(array[chosen] for array in vars(merged).values()))


def _cheapest_schedule(
    chain: Chain, keys: np.ndarray, budget_bytes: int, time_bound: float
) -> ChainSchedule | None:
    """The schedule minimising (sum of `keys` over checkpointed blocks, peak) within the budget,
    or None if none fits or every one that fits costs more than `time_bound`.

    Left-to-right DP over segment boundaries, state = (kept bytes so far, time, peak so far), one
    Pareto front per boundary. Only single-block stored segments are generated: a run of stored
    segments has the same kept bytes, recompute and peak as one stored segment over the run (the
    last one's constraint implies the others'), so nothing is lost. A checkpointed segment
    [start, stop) extends a state with K iff K + input[start] + saved(start..stop) fits; fronts are
    sorted by K so that is a prefix of each front. Along a front time never increases, so the
    states still within `time_bound` after the segment are a suffix: only states that could end
    within the bound are generated, which is what makes a small bound cheap.
    """
    n = len(chain.blocks)
    saved = np.array([block.kept_bytes for block in chain.blocks], dtype=np.int64)
    inputs = np.array([block.input_bytes for block in chain.blocks], dtype=np.int64)
    saved_prefix = np.concatenate(([0], np.cumsum(saved)))
    backward_room = budget_bytes - chain.fixed_bytes - chain.backward_transient_bytes
    forward_room = budget_bytes - chain.fixed_bytes - chain.forward_transient_bytes
    start_state = _Front(
        kept=np.zeros(1, dtype=np.int64),
        time=np.zeros(1, dtype=keys.dtype),
        peak=np.zeros(1, dtype=np.int64),
        prev=np.full(1, -1, dtype=np.int64),
        index=np.zeros(1, dtype=np.int64),
        checkpointed=np.zeros(1, dtype=bool),
    )
    no_state = _Front(*(array[:0] for array in vars(start_state).values()))
    # parts[stop]: the states of earlier fronts extended by a segment ending at `stop`.
    parts = [[start_state]] + [[no_state] for _ in range(n)]
    fronts: list[_Front] = []

    def extend(start: int, stops: np.ndarray, added: int, checkpointed: bool) -> None:
        """Extend fronts[start] by one segment to each of `stops`, keeping `added` bytes."""
        front = fronts[start]
        live = (inputs[start] if checkpointed else 0) + saved_prefix[stops] - saved_prefix[start]
        # Summed from `start`, not as a difference of prefix sums: float keys must not cancel.
        time = np.cumsum(keys[start : stops[-1]]) if checkpointed else np.zeros_like(stops)
        firsts = np.searchsorted(-front.time, time - time_bound)
        lasts = np.searchsorted(
            front.kept, np.minimum(backward_room - live, forward_room - added), "right"
        )
        for stop, first, last, stop_live, stop_time in zip(
            stops, firsts, lasts, live, time, strict=True
        ):
            if first < last:
                kept = front.kept[first:last]
                parts[stop].append(
                    _Front(
                        kept=kept + added,
                        time=front.time[first:last] + stop_time,
                        peak=np.maximum(front.peak[first:last], kept + stop_live),
                        prev=np.full(last - first, start, dtype=np.int64),
                        index=np.arange(first, last, dtype=np.int64),
                        checkpointed=np.full(last - first, checkpointed),
                    )
                )

    for position in range(n + 1):
        fronts.append(_undominated(parts[position]))
        parts[position] = []
        if position < n:
            extend(position, np.array([position + 1]), int(saved[position]), False)
            extend(position, np.arange(position + 1, n + 1), int(inputs[position]), True)

    last = fronts[n]
    if not len(last.kept):
        return None
    peak = np.maximum(
        last.kept + chain.forward_transient_bytes, last.peak + chain.backward_transient_bytes
    )
    state = int(np.lexsort((peak, last.time))[0])
    segments: list[tuple[int, int, bool]] = []
    stop = n
    while stop:
        front = fronts[stop]
        start, checkpointed = int(front.prev[state]), bool(front.checkpointed[state])
        if segments and not checkpointed and not segments[-1][2]:
            segments[-1] = (start, segments[-1][1], False)
        else:
            segments.append((start, stop, checkpointed))
        state, stop = int(front.index[state]), start
    return ChainSchedule(tuple(reversed(segments)))


def _recompute_guess(chain: Chain, keys: np.ndarray, budget_bytes: int) -> float:
    """Where `chain_dp` starts its bound on recompute: a relaxation that came to 75-90% of the
    optimum on the chains we measured. Any value is correct (too low costs a retry, too high a slower pass).

    The forward must end within the budget, so the checkpointed blocks must drop at least
    (store-all's forward peak - budget) bytes of saved tensors; the cheapest way to drop that many
    bytes when blocks may be taken fractionally (best recompute per saved byte first) is the guess.
    """
    saved = np.array([block.kept_bytes for block in chain.blocks], dtype=np.float64)
    excess = saved.sum() + chain.fixed_bytes + chain.forward_transient_bytes - budget_bytes
    if excess <= 0:
        return keys.dtype.type(0)
    cost = np.divide(keys, saved, out=np.full(len(saved), np.inf), where=saved > 0)
    order = np.argsort(cost)
    covered = np.cumsum(saved[order])
    whole = int(np.searchsorted(covered, excess))
    if whole == len(order):
        return keys.sum()
    part = (excess - (covered[whole - 1] if whole else 0)) * cost[order[whole]]
    return keys.dtype.type(keys[order[:whole]].sum() + part)


def min_feasible_bytes(chain: Chain) -> int:
    """The smallest peak any flat schedule reaches: the same DP with every block free to recompute.

    With all times zero the DP's tie-break (lower peak) is the whole objective. Its budget is the
    better of store-all and checkpoint-every-block, both flat schedules, so it prunes nothing the
    minimum could need.
    """
    budget = min(store_all(chain).peak_bytes, full(chain).peak_bytes)
    schedule = _cheapest_schedule(chain, np.zeros(len(chain.blocks), dtype=np.int64), budget, 0)
    assert schedule is not None, "the DP must find the store-all or full schedule"
    return chain_peak_bytes(chain, schedule)


def _infeasible(chain: Chain, budget_bytes: int, min_bytes: int) -> InfeasibleBudget:
    return InfeasibleBudget(
        f"no checkpoint schedule of the {len(chain.blocks)}-block chain fits the budget of "
        f"{budget_bytes} bytes ({format_bytes(budget_bytes)}); the smallest peak any schedule "
        f"reaches is {min_bytes} bytes ({format_bytes(min_bytes)}): raise the budget to at least "
        "that, or shrink the batch",
        budget_bytes=budget_bytes,
        min_feasible_bytes=min_bytes,
    )


def chain_dp(chain: Chain, budget_bytes: int) -> ChainPlan:
    """The schedule with the least recompute whose `chain_peak_bytes` is within `budget_bytes`.

    Exact, ties in recompute going to the lower peak. The DP (`_cheapest_schedule`) keeps, at
    each segment boundary, the Pareto front of states (kept bytes so far; recompute, then peak so
    far), at most one state per distinct kept total. Each pass runs under a bound on recompute
    that prunes states which could only finish above it: first a relaxation's guess
    (`_recompute_guess`), then 25% more after each pass that finds nothing, up to the recompute of
    checkpointing every block, past which it runs unbounded. Pruning drops only costlier states,
    so the first pass that finds a schedule has found the optimum; an unbounded pass that finds
    none proves the budget infeasible. A pass costs O(n^2 P log(nP)) for fronts of P states (each boundary merges a
    slice of every earlier front), in numpy: n = 128 distinct blocks takes well under a second.
    Raises `InfeasibleBudget` with the smallest peak any flat schedule reaches when none fits.
    """
    keys = _time_keys(chain)
    total = keys.sum()
    time_bound = _recompute_guess(chain, keys, budget_bytes)
    while (schedule := _cheapest_schedule(chain, keys, budget_bytes, time_bound)) is None:
        if time_bound == math.inf:
            raise _infeasible(chain, budget_bytes, min_feasible_bytes(chain))
        if keys.dtype.kind == "i":  # integer bounds keep the int64 comparisons exact
            grown = time_bound + max(time_bound // 4, total // 128, 1)
        else:
            grown = time_bound + max(time_bound / 4, total / 128)
        time_bound = grown if time_bound < grown < total else math.inf
    return _plan(
        chain,
        schedule,
        "chain_dp",
        f"least recompute of any schedule of the {len(chain.blocks)} blocks within "
        f"{format_bytes(budget_bytes)} (exact DP over segment boundaries)",
    )
