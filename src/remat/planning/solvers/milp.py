"""Which checkpointing option each block takes, as a mixed-integer linear program solved by HiGHS.

Why a MILP: once a block may be stored, fully checkpointed or selectively checkpointed under one of
several policies, the choice per block is a multiple-choice knapsack with one capacity constraint
per block's backward (the kept bytes of the blocks before it plus its own backward bytes). That is
a small integer program that HiGHS (through `scipy.optimize.milp`) solves to proven optimality in
under a second for a hundred-odd blocks, and it stays the same program whatever options a block
offers, where a dynamic program over byte counts would grow with the bytes.

Who answers. First the exact front (`remat.planning.solvers.block_front`): a search over the
blocks in forward order that keeps every prefix no other beats on kept bytes, peak and recompute,
and so answers every budget of one problem at once, exactly, in integer bytes, with no tolerance
and no clock (8B at seq 8192: ~20 ms a problem, where HiGHS took 9-26 runs of ~0.1 s a budget).
Repeated blocks keep that front small. Blocks identical up to noise make it a subset-sum: the
front gives up after a fixed number of labels, and HiGHS answers as below.

The model (`block_peak_bytes` is its single definition; everything here is checked against it):
blocks run forward 0..n-1 and backward n-1..0; block b's option keeps `kept_bytes` from the end of
its forward until its backward, and `backward_bytes` are live during its own backward on top of
the kept bytes of the blocks before it (the blocks after it have been freed). So

    forward peak     = fixed + sum_b kept(b) + forward_extra
    backward peak(b) = fixed + sum_{b' < b} kept(b') + backward(b) + prefetch(b - 1)
    peak             = max(forward peak, max_b backward peak(b))

Offload (docs/offload.md) is one more option of a block: its saves go to host memory
(`host_bytes`, summed over the blocks under `host_budget_bytes`), its `kept_bytes` drop by them,
they are back on the device during its own backward (in `backward_bytes`) and, where a link
prefetches them, already during the backward of the block after it (`prefetch_bytes`, the bytes
in flight). Its `recompute_seconds` are the copy time no compute hides: the objective is the
seconds an option adds to the step, recompute or exposed copies alike.

This is a model of the step, not its judge (each block reduced to two byte counts per option, the
rest of the step to `fixed` and `forward_extra`). The planner (`remat.planning.planner`, its fit loop) turns
every answer into checkpoint regions and re-simulates the step with `remat.prediction.schedule.simulate`;
that simulated peak decides whether the plan fits, and when it does not, the planner shrinks the
budget it gives this module by the overshoot and solves again.

Formulation. Binary y[b, k] = block b takes option k, with sum_k y[b, k] = 1 per block. The
cheapest plan minimises sum recompute_seconds * y subject to one row per peak expression: the
forward row sum_{b, k} kept * y <= budget - fixed - forward_extra, and for every block b the row
sum_{b' < b, k} kept * y + sum_k backward(b, k) * y[b, k] <= budget - fixed. The lowest peak
(`min_peak`, and the tie-break below) adds a continuous Q >= 0 with "row - Q <= -constant" for
every row and minimises Q, so Q is the largest peak expression, i.e. the peak minus `fixed`.

Scaling and exactness (HiGHS). Byte rows are divided by S, the largest value any row can take, so every
coefficient lies in [0, 1] whatever the model size; seconds are divided by the largest option's
seconds and multiplied by 1e6, as is Q's cost. That factor matters: HiGHS calls a plan optimal
when its objective is within 1e-6 (absolute) of the proven bound, and scipy exposes no option for
that gap (it passes `mip_abs_gap` on only with a warning), so with costs near 1 plans whose recompute differs by less than a microsecond's worth
per second of the costliest option would count as ties; at 1e6 the tolerance is 1e-12 of it.
HiGHS also accepts rows violated by about 1e-6 of S and binaries within 1e-6 of 0 or 1, so on
gigabyte models a returned plan can exceed the budget by kilobytes. Every plan is therefore
re-checked with the exact integer `block_peak_bytes`; one that does not fit is excluded with a
no-good cut (sum over its chosen y <= n - 1, which removes exactly that plan and nothing else, so
optimality is kept) and the program is solved again. `min_peak` shares the limitation the other
way: it is exact whenever the peaks of different plans differ by more than ~1e-7 of S, which
always holds below ~10 MB of activations; beyond, it may be off by up to ~1e-7 of S (about a
kilobyte for 10 GB). The peak reported for a plan is always exact.

Ties. Among plans with equal recompute (as `math.fsum` adds it), the lower peak is better. A tiny
secondary cost term cannot express that without either being lost in HiGHS's gap or outweighing
real recompute differences, so a second program minimises Q among plans whose recompute is at
most the first plan's; its answer replaces the first only if it is exactly verified to fit and to
be strictly better by (recompute, peak). That pass runs under what is left of the limits and is
best-effort: `status` and `mip_gap` describe the recompute, the primary objective.

Limits: a count first, the clock only as a safety net. Each HiGHS run stops after `node_limit`
branch-and-bound nodes (`NODE_LIMIT`), so its answer is a function of the problem, not of the
machine's load (before, a 10 s wall-clock limit was the only one, and under load the same `fit`
got other plans). `time_limit_s` (60 s) bounds all HiGHS runs of one call together as a safety
net; an answer it cut short is returned but not kept in `_solved`. When a limit stops HiGHS with a
plan, `status` is "node_limit" or "time_limit" and `mip_gap` is HiGHS's relative gap. When it
stops before HiGHS has any plan (or HiGHS reports none), the lowest-peak plan is computed without
a limit (one continuous objective: HiGHS solves it at the root in every instance we tried): if it
does not fit the budget, no plan does and `InfeasibleBudget` is raised with its peak as
`min_feasible_bytes`; if it fits, it is returned with an infinite gap.

Measured on 2 cores, HiGHS's passes together: 128 blocks x 4 options (random, or 128 identical
transformer-like blocks) solve to proven optimality in 0.1-0.8 s. The prefix rows hold O(n^2)
nonzeros, so 256 blocks take 2-4 s and 512 take 8-12 s. Not every instance is easy: blocks that
are identical up to measurement noise in bytes and seconds make a subset-sum in disguise, on
which HiGHS finds a plan within a second but leaves a gap of under 1% (less than one option's
step of one block) open for 20 s and more.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
from scipy import optimize
from scipy.sparse import csr_matrix, hstack

from remat.errors import InfeasibleBudget, RematError
from remat.planning.solvers import block_front
from remat.units import format_bytes

__all__ = [
    "BlockOption",
    "BlockProblem",
    "MilpResult",
    "block_host_bytes",
    "block_peak_bytes",
    "block_recompute_seconds",
    "milp",
    "min_peak",
]

#: What the largest cost becomes (see the module docstring: HiGHS's absolute gap of 1e-6).
_COST_SCALE = 1e6


@dataclass(frozen=True)
class BlockOption:
    """One thing `torch.utils.checkpoint` (+ a selective policy) can do to a block.

    `kept_bytes` are held from the end of the block's forward until its backward.
    `backward_bytes` are live for the block during its own backward beyond the kept bytes of
    earlier blocks: its kept bytes, what recomputation re-materialises and the gradients of its
    activations, so never less than `kept_bytes`. `recompute_seconds` is the extra forward time.
    """

    name: str
    kept_bytes: int
    backward_bytes: int
    recompute_seconds: float
    #: offload: host memory the option takes, and its bytes back on the device (prefetched) during
    #: the backward of the block after it
    host_bytes: int = 0
    prefetch_bytes: int = 0

    def __post_init__(self) -> None:
        if min(self.host_bytes, self.prefetch_bytes) < 0:
            raise RematError(f"option {self.name!r}: host_bytes and prefetch_bytes must be >= 0")
        if not 0 <= self.kept_bytes <= self.backward_bytes:
            raise RematError(
                f"option {self.name!r}: need 0 <= kept_bytes <= backward_bytes (the backward holds "
                f"the kept bytes too), got {self.kept_bytes} and {self.backward_bytes}"
            )
        if not (math.isfinite(self.recompute_seconds) and self.recompute_seconds >= 0):
            raise RematError(
                f"option {self.name!r}: recompute_seconds must be finite and >= 0, "
                f"got {self.recompute_seconds!r}"
            )


@dataclass(frozen=True)
class BlockProblem:
    """The blocks in forward order, each with its options, plus the bytes no option changes.

    `fixed_bytes` (parameters, gradients, optimizer state, inputs) are live all the time;
    `forward_extra_bytes` is the worst transient above the kept bytes during the forward.
    """

    options: tuple[tuple[BlockOption, ...], ...]
    fixed_bytes: int = 0
    forward_extra_bytes: int = 0
    host_budget_bytes: int | None = None  # pinned host memory the offloading options may take

    def __post_init__(self) -> None:
        if not self.options:
            raise RematError("a problem needs at least one block")
        empty = [b for b, block in enumerate(self.options) if not block]
        if empty:
            raise RematError(f"every block needs at least one option; blocks {empty} have none")
        if min(self.fixed_bytes, self.forward_extra_bytes) < 0:
            raise RematError("fixed_bytes and forward_extra_bytes must be >= 0")


@dataclass(frozen=True)
class MilpResult:
    """A plan: the option index and name per block, its exact peak and recompute, how sure the
    solver is (`status` "optimal", "node_limit" or "time_limit"; `mip_gap` the relative gap on
    recompute HiGHS reported, 0.0 when optimal), and a sentence saying why."""

    choice: tuple[int, ...]
    option_names: tuple[str, ...]
    peak_bytes: int
    recompute_seconds: float
    status: str
    mip_gap: float
    reason: str


def block_peak_bytes(problem: BlockProblem, choice: Sequence[int]) -> int:
    """The peak live bytes of a training step where block b takes option `choice[b]`.

    The one definition every solver here is checked against: the larger of the forward peak
    (fixed + all kept bytes + forward extra) and, for every block, its backward peak (fixed + the
    kept bytes of the blocks before it + its backward bytes). Exact integer arithmetic over the
    model; a model of the step nonetheless, which the planner's judge,
    `remat.prediction.schedule.simulate`, checks on the real step's graph before a plan is accepted.
    """
    chosen = _chosen(problem, choice)
    kept_before = 0
    peak = 0
    prefetched = 0
    for option in chosen:
        peak = max(peak, kept_before + option.backward_bytes + prefetched)
        kept_before += option.kept_bytes
        prefetched = option.prefetch_bytes
    return problem.fixed_bytes + max(peak, kept_before + problem.forward_extra_bytes)


def block_host_bytes(problem: BlockProblem, choice: Sequence[int]) -> int:
    """The host memory a choice's offloading options take."""
    return sum(option.host_bytes for option in _chosen(problem, choice))


def _fits(problem: BlockProblem, choice: Sequence[int], budget_bytes: int) -> bool:
    host = problem.host_budget_bytes
    return block_peak_bytes(problem, choice) <= budget_bytes and (
        host is None or block_host_bytes(problem, choice) <= host
    )


def block_recompute_seconds(problem: BlockProblem, choice: Sequence[int]) -> float:
    """The extra forward seconds of a choice. `math.fsum` rounds the exact sum once, so choices
    that recompute the same amount report the same float whatever the block order."""
    return math.fsum(option.recompute_seconds for option in _chosen(problem, choice))


def _chosen(problem: BlockProblem, choice: Sequence[int]) -> list[BlockOption]:
    if len(choice) != len(problem.options):
        raise RematError(
            f"a choice needs one option index per block: got {len(choice)} for "
            f"{len(problem.options)} blocks"
        )
    bad = [b for b, k in enumerate(choice) if not 0 <= k < len(problem.options[b])]
    if bad:
        raise RematError(f"option index out of range for blocks {bad} in choice {tuple(choice)}")
    return [block[k] for block, k in zip(problem.options, choice, strict=True)]


# -- the program --------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Model:
    """The scaled program of one problem. Columns: y[b, k] at `offsets[b] + k`, then Q (last).

    `rows` holds the peak expressions (row 0 the forward, row 1 + b block b's backward) over the y
    columns divided by `scale`; `constant` is what each row adds beyond `fixed` (the forward extra
    for row 0), in bytes. `cost` is the scaled recompute per column (0 for Q).
    """

    offsets: np.ndarray
    rows: csr_matrix
    constant: np.ndarray
    scale: float
    cost: np.ndarray
    one_hot: optimize.LinearConstraint
    host: list[optimize.LinearConstraint]  # the host-memory row, when the problem caps it

    @property
    def columns(self) -> int:
        return int(self.offsets[-1]) + 1


def _model(problem: BlockProblem) -> _Model:
    counts = [len(block) for block in problem.options]
    offsets = np.concatenate(([0], np.cumsum(counts)))
    n, columns = len(counts), int(offsets[-1]) + 1
    options = [option for block in problem.options for option in block]
    kept = np.array([option.kept_bytes for option in options], dtype=np.float64)
    backward = np.array([option.backward_bytes for option in options], dtype=np.float64)
    seconds = np.array([option.recompute_seconds for option in options])
    prefetch = np.array([option.prefetch_bytes for option in options], dtype=np.float64)

    max_kept = np.array([max(o.kept_bytes for o in block) for block in problem.options])
    max_backward = np.array([max(o.backward_bytes for o in block) for block in problem.options])
    max_prefetch = np.array([max(o.prefetch_bytes for o in block) for block in problem.options])
    kept_before = np.concatenate(([0], np.cumsum(max_kept)[:-1]))
    prefetched = np.concatenate(([0], max_prefetch[:-1]))
    scale = float(max(1, int(max_kept.sum()), int((kept_before + max_backward + prefetched).max())))

    # the forward row (row 0) holds every kept byte
    row_of, col_of, value_of = (
        [np.zeros(columns - 1, dtype=np.int64)],
        [np.arange(columns - 1)],
        [kept],
    )
    for b in range(n):  # block b's backward: kept bytes before it, its own backward bytes
        start, stop = int(offsets[b]), int(offsets[b + 1])
        row_of.append(np.full(stop, b + 1))
        col_of.append(np.arange(stop))
        value_of.append(np.concatenate((kept[:start], backward[start:stop])))
        if b:  # and what the block before it prefetches (its kept bytes, back early)
            before = int(offsets[b - 1])
            row_of.append(np.full(start - before, b + 1))
            col_of.append(np.arange(before, start))
            value_of.append(prefetch[before:start])
    rows = csr_matrix(
        (np.concatenate(value_of) / scale, (np.concatenate(row_of), np.concatenate(col_of))),
        shape=(n + 1, columns),
    )
    block_of = np.repeat(np.arange(n), counts)
    one_hot = optimize.LinearConstraint(
        csr_matrix((np.ones(columns - 1), (block_of, np.arange(columns - 1))), shape=(n, columns)),
        1,
        1,
    )
    largest = seconds.max()
    cost = np.zeros(columns)
    if largest > 0:
        cost[:-1] = seconds / largest * _COST_SCALE
    constant = np.zeros(n + 1)
    constant[0] = problem.forward_extra_bytes
    host: list[optimize.LinearConstraint] = []
    host_bytes = np.array([option.host_bytes for option in options], dtype=np.float64)
    if problem.host_budget_bytes is not None and host_bytes.any():
        host_scale = float(host_bytes.max())
        row = np.zeros((1, columns))
        row[0, :-1] = host_bytes / host_scale
        host.append(optimize.LinearConstraint(row, -np.inf, problem.host_budget_bytes / host_scale))
    return _Model(offsets, rows, constant, scale, cost, one_hot, host)


def _no_good(model: _Model, choices: list[tuple[int, ...]]) -> list[optimize.LinearConstraint]:
    """Rows that exclude exactly these choices: at most n - 1 of a choice's y may be 1."""
    if not choices:
        return []
    n = len(model.offsets) - 1
    columns = np.array([model.offsets[:-1] + np.array(choice) for choice in choices])
    matrix = csr_matrix(
        (np.ones(columns.size), (np.repeat(np.arange(len(choices)), n), columns.ravel())),
        shape=(len(choices), model.columns),
    )
    return [optimize.LinearConstraint(matrix, -np.inf, n - 1)]


@dataclass(frozen=True)
class _Run:
    """A plan HiGHS returned: the choice, whether proven optimal, and the relative gap HiGHS
    reported (0.0 when optimal)."""

    choice: tuple[int, ...]
    optimal: bool
    gap: float


def _highs(
    model: _Model,
    cost: np.ndarray,
    constraints: list[optimize.LinearConstraint],
    q_upper: float,
    time_limit_s: float,
    node_limit: int | None,
) -> _Run | None:
    """Solve over the y columns and Q; None when HiGHS has no plan (infeasible or out of time)."""
    integrality = np.ones(model.columns)
    integrality[-1] = 0
    upper = np.ones(model.columns)
    upper[-1] = q_upper
    res = optimize.milp(
        cost,
        integrality=integrality,
        bounds=optimize.Bounds(0, upper),
        constraints=[model.one_hot, *model.host, *constraints],
        options={"time_limit": time_limit_s, "node_limit": node_limit, "mip_rel_gap": 0.0},
    )
    if res.x is None:
        return None
    choice = tuple(
        int(np.argmax(res.x[start:stop])) for start, stop in itertools.pairwise(model.offsets)
    )
    optimal = res.status == 0
    return _Run(choice, optimal, 0.0 if optimal else float(res.mip_gap))


def _cheapest(
    problem: BlockProblem, model: _Model, budget_bytes: int, node_limit: int, deadline: float
) -> tuple[_Run | None, list[tuple[int, ...]]]:
    """Least recompute within the budget, exactly verified; None if HiGHS found no plan that fits
    in time. Also returns the no-good cuts added on the way (plans HiGHS's tolerances let over)."""
    room = (budget_bytes - problem.fixed_bytes - model.constant) / model.scale
    fits = optimize.LinearConstraint(model.rows, -np.inf, room)
    cuts: list[tuple[int, ...]] = []
    while True:
        run = _highs(
            model,
            model.cost,
            [fits, *_no_good(model, cuts)],
            q_upper=0.0,
            time_limit_s=max(deadline - time.monotonic(), 0.0),
            node_limit=node_limit,
        )
        if run is None:
            return None, cuts
        if _fits(problem, run.choice, budget_bytes):
            return run, cuts
        cuts.append(run.choice)


def _lowest_peak(
    model: _Model,
    *,
    time_limit_s: float = math.inf,
    node_limit: int | None = None,
    q_upper: float = math.inf,
    extra: list[optimize.LinearConstraint] | None = None,
) -> _Run | None:
    """Minimise Q, the largest peak expression, optionally capped and with extra rows."""
    q_column = csr_matrix(np.full((model.rows.shape[0], 1), -1.0))
    below_q = optimize.LinearConstraint(
        hstack([model.rows[:, :-1], q_column], format="csr"), -np.inf, -model.constant / model.scale
    )
    cost = np.zeros(model.columns)
    cost[-1] = _COST_SCALE
    return _highs(model, cost, [below_q, *(extra or [])], q_upper, time_limit_s, node_limit)


def _tie_break(
    problem: BlockProblem,
    model: _Model,
    budget_bytes: int,
    best: tuple[int, ...],
    cuts: list[tuple[int, ...]],
    node_limit: int,
    deadline: float,
) -> tuple[int, ...]:
    """The lowest-peak plan among those recomputing no more than `best`, if one verifiably beats
    `best` on (recompute, peak) within the budget; else `best`."""
    no_costlier = optimize.LinearConstraint(
        model.cost[None, :], -np.inf, float(model.cost[model.offsets[:-1] + np.array(best)].sum())
    )
    run = _lowest_peak(
        model,
        time_limit_s=max(deadline - time.monotonic(), 0.0),
        node_limit=node_limit,
        q_upper=(budget_bytes - problem.fixed_bytes) / model.scale,
        extra=[no_costlier, *_no_good(model, cuts)],
    )
    if run is None:
        return best
    peak = block_peak_bytes(problem, run.choice)
    key = (block_recompute_seconds(problem, run.choice), peak)
    if _fits(problem, run.choice, budget_bytes) and key < (
        block_recompute_seconds(problem, best),
        block_peak_bytes(problem, best),
    ):
        return run.choice
    return best


# -- the public solvers -------------------------------------------------------------------------
#: The front of each problem less its fixed bytes (`block_front.front`; None where it gave up):
#: the planners of one step under two optimizers, or one step asked at 32 budgets, share it.
_fronts: OrderedDict[BlockProblem, block_front.Front | None] = OrderedDict()
FRONTS_KEPT = 64

#: HiGHS's answers by (the problem less its fixed bytes, the room above them, the node limit),
#: for those the wall clock did not cut short (the rest is deterministic: the same program gives
#: the same answer): the program sees only the room (`_cheapest`, `_tie_break` and `_fits` all
#: subtract the fixed bytes first). Oldest dropped past `SOLVED_KEPT`.
_solved: OrderedDict[tuple[BlockProblem, int, int], tuple[tuple[int, ...], str, float] | int]
_solved = OrderedDict()
SOLVED_KEPT = 512

#: Branch-and-bound nodes per HiGHS run: the deterministic bound on its work (about a second on
#: the near-identical 128-block instance of the tests, where it stops with a gap under 1%).
NODE_LIMIT = 200


def milp(
    problem: BlockProblem,
    budget_bytes: int,
    time_limit_s: float = 60.0,
    node_limit: int = NODE_LIMIT,
) -> MilpResult:
    """The plan with the least recompute whose peak fits `budget_bytes`, lowest peak among ties.

    Exact from the problem's front (`block_front`) where that search answers; else HiGHS with
    `node_limit` nodes per run, and `time_limit_s` of wall clock for all its runs together as a
    safety net only (an answer it cuts short depends on the machine's load and is not kept). See
    the module docstring for what is returned at a limit. The returned `peak_bytes` is always
    exact and within the budget. Raises `InfeasibleBudget`, with the smallest achievable peak as
    `min_feasible_bytes`, when no choice fits.
    """
    exact = _front(problem)
    if exact is not None:
        label = exact.cheapest(budget_bytes - problem.fixed_bytes)
        found = (exact.choice(label), "optimal", 0.0) if label is not None else None
        if found is None:
            found = int(exact.peak[exact.lowest()])
        solver = "an exact search of the blocks' front of recompute and peak"
    else:
        found = _highs_answer(problem, budget_bytes, time_limit_s, node_limit)
        solver = "HiGHS"
    if isinstance(found, int):  # no choice fits: the smallest peak above the fixed bytes
        peak = problem.fixed_bytes + found
        raise InfeasibleBudget(
            f"no choice of options fits the budget of {format_bytes(budget_bytes)} "
            f"({budget_bytes} bytes): the smallest achievable peak is {format_bytes(peak)} "
            f"({peak} bytes)",
            budget_bytes=budget_bytes,
            min_feasible_bytes=peak,
        )
    choice, status, gap = found
    seconds = block_recompute_seconds(problem, choice)
    limit = (
        f"{time_limit_s:g} s time limit"
        if status == "time_limit"
        else f"limit of {node_limit} branch-and-bound nodes"
    )
    if gap == math.inf:
        return _result(
            problem,
            choice,
            status,
            math.inf,
            f"HiGHS found no plan within its {limit}; this lowest-peak plan fits but does not "
            "minimise recompute",
        )
    least, what = "recompute", "recompute"
    if block_host_bytes(problem, choice):
        least, what = "added time", "recompute and copies to host memory not hidden by compute"
    if status == "optimal":
        why = (
            f"the least {least} that fits, proved optimal by the MILP solver ({solver}): "
            f"{_time(seconds)} of {what} a step (not the step's time) within"
        )
    else:
        why = (
            f"the MILP solver (HiGHS) stopped at its {limit} with {_time(seconds)} of {what} a "
            f"step, at most {gap:.2%} above the least that fits"
        )
    return _result(problem, choice, status, gap, f"{why} {format_bytes(budget_bytes)}")


def _front(problem: BlockProblem) -> block_front.Front | None:
    """The problem's front, searched once per problem less its fixed bytes (`_fronts`)."""
    key = replace(problem, fixed_bytes=0)
    if key in _fronts:
        _fronts.move_to_end(key)
        return _fronts[key]
    found = _fronts[key] = block_front.front(key, block_front.MAX_LABELS)
    if len(_fronts) > FRONTS_KEPT:
        _fronts.popitem(last=False)
    return found


def _highs_answer(
    problem: BlockProblem, budget_bytes: int, time_limit_s: float, node_limit: int
) -> tuple[tuple[int, ...], str, float] | int:
    """`_solve`, once per program, room and node limit (`_solved`)."""
    key = (replace(problem, fixed_bytes=0), budget_bytes - problem.fixed_bytes, node_limit)
    found = _solved.get(key)
    if found is not None:
        _solved.move_to_end(key)
        return found
    deadline = time.monotonic() + time_limit_s
    found = _solve(problem, budget_bytes, node_limit, deadline)
    if time.monotonic() < deadline:  # no run cut short by the clock
        _solved[key] = found
        if len(_solved) > SOLVED_KEPT:
            _solved.popitem(last=False)
    return found


def _solve(
    problem: BlockProblem, budget_bytes: int, node_limit: int, deadline: float
) -> tuple[tuple[int, ...], str, float] | int:
    """HiGHS's search: the choice, its status ("optimal", "node_limit" or "time_limit") and
    HiGHS's gap (infinite: the lowest-peak plan, as HiGHS found none within its limits); or, where
    no choice fits, the smallest peak less the fixed bytes."""
    model = _model(problem)
    run, cuts = _cheapest(problem, model, budget_bytes, node_limit, deadline)
    if run is None:
        lowest = _lowest_peak_choice(model)
        peak = block_peak_bytes(problem, lowest)
        if peak > budget_bytes:
            return peak - problem.fixed_bytes
        return lowest, _limit_hit(deadline), math.inf
    choice = run.choice
    if time.monotonic() < deadline:
        choice = _tie_break(problem, model, budget_bytes, choice, cuts, node_limit, deadline)
    return choice, "optimal" if run.optimal else _limit_hit(deadline), run.gap


def _limit_hit(deadline: float) -> str:
    """Which limit stopped HiGHS: the wall clock where it has run out, else the node limit."""
    return "time_limit" if time.monotonic() >= deadline else "node_limit"


def _time(seconds: float) -> str:
    """Seconds as a reader's figure: 0.000395 -> "0.395 ms"."""
    if seconds >= 1:
        return f"{seconds:.3g} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} us"


def min_peak(problem: BlockProblem) -> int:
    """The smallest peak any choice achieves, in bytes: exact from the problem's front, else from
    HiGHS (exact up to the tolerance in the module docstring; solved without a limit: it is the
    easy program, one continuous objective)."""
    exact = _front(problem)
    if exact is not None:
        return problem.fixed_bytes + int(exact.peak[exact.lowest()])
    return block_peak_bytes(problem, _lowest_peak_choice(_model(problem)))


def _lowest_peak_choice(model: _Model) -> tuple[int, ...]:
    run = _lowest_peak(model)
    assert run is not None, "without a time limit and with Q unbounded, HiGHS always has a plan"
    return run.choice


def _result(
    problem: BlockProblem, choice: tuple[int, ...], status: str, gap: float, why: str
) -> MilpResult:
    names = tuple(block[k].name for block, k in zip(problem.options, choice, strict=True))
    peak = block_peak_bytes(problem, choice)
    counts = ", ".join(f"{count} {name}" for name, count in Counter(names).items())
    return MilpResult(
        choice=choice,
        option_names=names,
        peak_bytes=peak,
        recompute_seconds=block_recompute_seconds(problem, choice),
        status=status,
        mip_gap=gap,
        reason=f"{why}: {counts}",
    )
