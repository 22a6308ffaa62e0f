"""Slow, obviously correct references the solvers are tested against. Test code, not remat's.

- `textbook_chain_dp`: the classic recursion over segments for the chain model of
  `remat.planning.solvers.chain`, the reference for `chain_dp` on chains too long to enumerate;
- `chain_brute_force`: every schedule of a short chain (the reference for ties and infeasibility);
- `blocks_brute_force`: every choice of a small `BlockProblem` (the reference for `milp`);
- `every_save_set`: every save set a joint problem allows, with what it recomputes (the
  reference for the compiled path's save-set programs);
- `store_all_timeline`: the live bytes of a step without checkpointing, the reference for
  `remat.estimate` (which is `remat.prediction.schedule.simulate` with no regions).
"""

from __future__ import annotations

import functools
import itertools
import math

import numpy as np

from remat.device.targets import scratch_bytes
from remat.errors import InfeasibleBudget
from remat.graph import Graph
from remat.planning.solvers.chain import (
    Chain,
    ChainPlan,
    ChainSchedule,
    chain_peak_bytes,
    chain_recompute_seconds,
)
from remat.planning.solvers.milp import (
    BlockProblem,
    MilpResult,
    block_peak_bytes,
    block_recompute_seconds,
)
from remat.planning.solvers.mincut import JointProblem, recomputed_values

Segment = tuple[int, int, bool]


def textbook_chain_dp(chain: Chain, budget_bytes: int) -> ChainSchedule | None:
    """A least-recompute schedule whose `chain_peak_bytes` fits the budget, None if none does.

    The textbook recursion (Chen et al. 2016, sec. 4): the blocks from i on, with `kept` bytes
    held by the segments before block i, are best run as some first segment [i, j), stored or
    checkpointed, then the best schedule of the blocks from j on. In the chain model a segment
    keeps all its blocks' saved bytes if stored, else its first block's input; its backward holds
    `kept` + that + (if checkpointed) the saved bytes its re-run makes. Memoised on (i, kept).
    """
    blocks, n = chain.blocks, len(chain.blocks)
    forward_room = budget_bytes - chain.fixed_bytes - chain.forward_transient_bytes
    backward_room = budget_bytes - chain.fixed_bytes - chain.backward_transient_bytes

    @functools.cache
    def best(i: int, kept: int) -> tuple[float, tuple[Segment, ...]] | None:
        """(recompute, segments) of the cheapest schedule of blocks i.. that fits, or None."""
        if i == n:
            return (0.0, ()) if kept <= forward_room else None
        options = []
        for j in range(i + 1, n + 1):
            saved = sum(block.kept_bytes for block in blocks[i:j])
            rerun = sum(block.forward_seconds for block in blocks[i:j])
            first_input = blocks[i].input_bytes
            # (checkpointed, bytes kept through the forward, bytes live in its backward, seconds)
            for checkpointed, keeps, live, seconds in (
                (False, saved, saved, 0.0),
                (True, first_input, first_input + saved, rerun),
            ):
                rest = best(j, kept + keeps) if kept + live <= backward_room else None
                if rest is not None:
                    options.append((seconds + rest[0], ((i, j, checkpointed), *rest[1])))
        return min(options, default=None)

    found = best(0, 0)
    return None if found is None else ChainSchedule(found[1])


def chain_brute_force(chain: Chain, budget_bytes: int) -> ChainPlan:
    """`chain_dp` by exhaustion (n <= 12 or so): least recompute, then lower peak, and the same
    `InfeasibleBudget` (with the smallest peak of any schedule) when nothing fits.

    Two shortcuts change no answer: adjacent stored segments are considered merged (splitting a
    stored run changes neither its kept bytes nor any peak, as test_chain checks), and the sets of
    checkpointed blocks are visited in order of recompute, stopping past the first that fits.
    """
    n = len(chain.blocks)
    by_recompute = sorted(
        (
            math.fsum(
                b.forward_seconds for b, ckpt in zip(chain.blocks, mask, strict=True) if ckpt
            ),
            mask,
        )
        for mask in itertools.product((False, True), repeat=n)
    )
    best: tuple[float, int, ChainSchedule] | None = None
    min_bytes = None
    for seconds, mask in by_recompute:
        if best is not None and seconds > best[0]:
            break
        # Per gap between blocks: a cut where the choice changes, none inside a stored run,
        # either inside a checkpointed run.
        options = [
            (mask[gap - 1] != mask[gap],) if not (mask[gap - 1] and mask[gap]) else (False, True)
            for gap in range(1, n)
        ]
        for cuts in itertools.product(*options):
            bounds = [0, *(gap for gap, cut in enumerate(cuts, start=1) if cut), n]
            schedule = ChainSchedule(
                tuple((start, stop, mask[start]) for start, stop in itertools.pairwise(bounds))
            )
            peak = chain_peak_bytes(chain, schedule)
            min_bytes = peak if min_bytes is None else min(min_bytes, peak)
            if peak <= budget_bytes and (best is None or (seconds, peak) < best[:2]):
                best = (seconds, peak, schedule)
    if best is None:
        raise InfeasibleBudget(
            f"no schedule fits {budget_bytes} bytes: the smallest peak is {min_bytes} bytes",
            budget_bytes=budget_bytes,
            min_feasible_bytes=min_bytes,
        )
    return ChainPlan(
        schedule=best[2],
        strategy="brute_force",
        peak_bytes=best[1],
        recompute_seconds=chain_recompute_seconds(chain, best[2]),
        reason=f"least recompute of all {2 * 3 ** (n - 1)} schedules, searched exhaustively",
    )


#: `blocks_brute_force` refuses more choices than this.
MAX_ENUMERATED = 2**20


def blocks_brute_force(problem: BlockProblem, budget_bytes: int) -> MilpResult:
    """Every choice enumerated: least recompute within the budget, then lowest peak. Refuses more
    than 2**20 choices. Raises `InfeasibleBudget` like `milp`.

    Vectorised over all choices; recompute is summed in float64 to find the candidates within
    1e-12 of the least, then re-added with `math.fsum` among them so ties are judged as `milp`
    judges them.
    """
    counts = [len(block) for block in problem.options]
    total = math.prod(counts)
    if total > MAX_ENUMERATED:
        raise ValueError(f"{total} choices: the enumeration takes at most {MAX_ENUMERATED}")
    choices = np.indices(counts).reshape(len(counts), -1).T
    blocks = np.arange(len(counts))

    def table(field: str, dtype: type) -> np.ndarray:
        """`field` of the option each choice gives each block: one row per choice."""
        values = np.zeros((len(counts), max(counts)), dtype=dtype)
        for b, block in enumerate(problem.options):
            values[b, : len(block)] = [getattr(option, field) for option in block]
        return values[blocks, choices]

    kept = table("kept_bytes", np.int64)
    backward = table("backward_bytes", np.int64)
    kept_before = np.cumsum(kept, axis=1) - kept
    peaks = problem.fixed_bytes + np.maximum(
        kept.sum(axis=1) + problem.forward_extra_bytes, (kept_before + backward).max(axis=1)
    )
    fits = np.flatnonzero(peaks <= budget_bytes)
    if not fits.size:
        lowest = int(peaks.min())
        raise InfeasibleBudget(
            f"no choice of options fits {budget_bytes} bytes: the smallest peak is {lowest} bytes",
            budget_bytes=budget_bytes,
            min_feasible_bytes=lowest,
        )
    seconds = table("recompute_seconds", np.float64).sum(axis=1)[fits]
    near = fits[seconds <= seconds.min() * (1 + 1e-12)]
    best = min(
        (tuple(int(k) for k in choices[i]) for i in near),
        key=lambda c: (block_recompute_seconds(problem, c), block_peak_bytes(problem, c)),
    )
    return MilpResult(
        choice=best,
        option_names=tuple(block[k].name for block, k in zip(problem.options, best, strict=True)),
        peak_bytes=block_peak_bytes(problem, best),
        recompute_seconds=block_recompute_seconds(problem, best),
        status="optimal",
        mip_gap=0.0,
        reason=f"enumerated all {total} choices",
    )


def store_all_timeline(graph: Graph, base_bytes: int) -> list[int]:
    """The live bytes at each op of a step without checkpointing, written directly: each storage
    allocated by the step is live from its op until both the program and every autograd node that
    saved it have let go, plus the op's kernel scratch. What `remat.prediction.schedule.simulate` must give
    with no regions (the estimate's timeline), by a second route."""
    end = len(graph.ops)
    death = {
        s.id: end if s.released_after is None else s.released_after
        for s in graph.storages.values()
        if s.allocated_at is not None
    }
    for sv in graph.saved:
        node = graph.nodes.get(sv.node) if sv.node is not None else None
        if sv.storage in death:
            if node is None:  # no node unpacked it: held until autograd was seen to let go
                held = end if sv.released_after is None else sv.released_after
            else:
                held = end if node.released_after is None else node.released_after
            death[sv.storage] = max(death[sv.storage], held)
    return [
        base_bytes
        + sum(
            graph.storages[sid].nbytes
            for sid, d in death.items()
            if graph.storages[sid].allocated_at <= i <= d
        )
        + scratch_bytes(graph, op)
        for i, op in enumerate(graph.ops)
    ]


def every_save_set(problem: JointProblem):
    """Each (save set, values it recomputes) of `problem`: every subset of its values that saves
    nothing unsaveable and leaves the backward computable."""
    values = range(len(problem.values))
    for r in range(len(problem.values) + 1):
        for subset in itertools.combinations(values, r):
            chosen = set(subset)
            if chosen & problem.unsaveable:
                continue
            recomputed = recomputed_values(problem, chosen)
            if recomputed is not None:
                yield chosen, recomputed
