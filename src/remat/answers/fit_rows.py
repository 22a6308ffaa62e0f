"""One strategy's row of a fit (`FitRow`): its per-rank peak at the asked batch and sequence and
whether it fits, judged by the caching allocator where it is simulated (`judge_step`); the largest batch
and sequence that fit, searched on size models and confirmed by a trace at the answer (`fit_row`,
`_largest`, `_guess`); the row of the step under torch.compile (`compiled_row`); and the line that
applies a row's plan (`_apply_line`).

Apart from `remat.answers.fit`, which gathers the rows into a `FitReport` with its advice; both
judge the steps of `remat.answers.fit_steps`.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from remat.answers.fit_steps import FitSteps
from remat.errors import RematError, SequenceLimitError
from remat.planning import strategies
from remat.prediction.estimate import estimate
from remat.units import format_bytes

#: The sequence-length answer is a multiple of this (tokens), as sequence lengths are chosen.
SEQ_STEP = 64


@dataclass(frozen=True)
class FitRow:
    """One strategy on the GPU: its per-rank peak at the asked batch and sequence, whether that
    fits, its predicted recompute as a share of the step on the GPU's cost profile, and the largest
    batch (at the asked sequence) and sequence (at the asked batch) that fit; None: not even the
    smallest."""

    strategy: str
    peak_bytes: int | None
    fits: bool
    overhead: float | None
    max_batch: int | None
    max_seq: int | None
    plan: str = ""  # the plan behind the peak: what auto chose, or the lowest-peak one
    note: str = ""
    apply: str = ""  # the one line that makes this plan for the model (before any FSDP wrapping)
    # as the GPU reports the step (`remat.prediction.gpu_memory`), by allocator setting; empty when the
    # allocator is not simulated (a --reserve given)
    gpu_memory: tuple[dict[str, Any], ...] = ()
    #: the `Plan` behind `plan`, of the whole-model step (a page shows it per rank); not data
    solved: Any = field(default=None, repr=False, compare=False)

    @property
    def reserved_bytes(self) -> int | None:
        """The peak reserved bytes under the allocator setting the row is judged with."""
        return self.gpu_memory[0]["reserved_bytes"] if self.gpu_memory else None


def _largest(
    fits: Callable[[int], bool], guess: int, low: int, high: int, above: int | None = None
) -> int | None:
    """The largest n in [low, high] with fits(n), for a monotone `fits`: gallop up from `guess` (a
    good guess costs two calls: the answer fits, the next does not), or check `low` when the guess
    does not fit, then bisect. None when not even `low` fits. `above`: a size expected not to
    fit, checked after a guess that fits before galloping: a guess and an `above` on either side
    of the answer leave a bisection between them."""
    n = min(max(guess, low), high)
    step = 1
    if fits(n):
        lo, hi = n, high + 1  # hi: does not fit, or past `high`
        if above is not None and lo < above <= high:
            lo, hi = (above, hi) if fits(above) else (lo, above)
        if hi > high:
            while lo < high and fits(min(lo + step, high)):
                lo, step = min(lo + step, high), step * 2
            hi = min(lo + step, high + 1)
    else:
        if n == low or not fits(low):
            return None
        lo, hi = low, n
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def _guess(xs: list[int], ys: list[int], limit: int) -> int:
    """The largest x at which the polynomial through the points (a line through two, a parabola
    through three) reaches `limit`; the last point when it never does. A guess: `_largest`
    confirms it."""
    poly = np.polynomial.Polynomial.fit(xs, ys, len(xs) - 1).convert()
    crossings = [r.real for r in (poly - limit).roots() if abs(r.imag) < 1e-9]
    return int(max(crossings)) if crossings else xs[-1]


def fit_row(
    steps: FitSteps,
    name: str,
    batch: int,
    seq: int,
    usable: int,
    max_batch: int,
    max_seq: int,
    earlier: Sequence[FitRow] = (),
) -> FitRow:
    """One strategy: its peak at (batch, seq) and the largest batch and sequence that fit.

    Where the caching allocator is simulated (`steps.gpu_memories`), the row fits when its
    reserved bytes do (the allocator's limit, under torch's default settings), and so do the
    largest batch and sequence: searched by the allocator's judgement itself (so that a row that
    does not fit never names a maximum at or above what was asked), from where the size models'
    live bytes reach the asked size's live limit (`live_limit`: the limit less the overhead,
    reserved - live, measured there). Without the allocator, on live bytes within `usable`.

    `earlier`: rows of the same fit already found. Where the allocator judges, one whose peak at
    (batch, seq) is within 1% of this row's (auto's plan is often a fixed strategy's) starts the
    searches at its largest sizes: two steps when they are this row's too (the searches find the
    largest size that fits from any start)."""
    judged = judge_step(steps, name, batch, seq, usable)
    return searched_row(steps, name, judged, batch, seq, usable, max_batch, max_seq, earlier)


def searched_row(
    steps: FitSteps,
    name: str,
    judged: tuple[int, Any, list[Any], int, float] | None,
    batch: int,
    seq: int,
    usable: int,
    max_batch: int,
    max_seq: int,
    earlier: Sequence[FitRow] = (),
) -> FitRow:
    """`fit_row` of the strategy's `judge_step` at (batch, seq), `judged`: the searches. A
    judgement of the judging allocator setting alone (`judged_only`) gets every setting's
    memory here, for the row to show."""
    asked_usable = usable
    if judged is None:
        return FitRow(name, None, False, None, None, None, note="needs repeated blocks")
    peak, p, memories, usable, overhead = judged
    if memories:
        memories = steps.gpu_memories(batch, seq, p)
    row_fits = fits_on(peak, memories, usable)
    planner = steps.planner(batch, seq)
    held = steps.held_at_every_size(batch, seq)
    if not some_size_fits(steps, judged, batch, seq):
        return FitRow(
            name,
            plan=p.strategy,
            peak_bytes=peak,
            fits=False,
            overhead=overhead,
            max_batch=None,
            max_seq=None,
            note=f"parameters, gradients and optimizer state alone take {format_bytes(held)}",
            gpu_memory=tuple(m.to_dict() for m in memories),
            solved=p,
        )
    limits: list[str] = []

    def fits_batch(b: int) -> bool:
        return steps.fits(name, b, seq, usable)

    def fits_seq(units: int) -> bool:
        """Whether `units` * SEQ_STEP tokens fit; a length the model cannot build (learned
        positions end) does not."""
        try:
            return steps.fits(name, batch, units * SEQ_STEP, usable)
        except RematError as err:
            limits.append(limit_note(err))
            return False

    # by size, with the graph judged: a size model the confirming trace drops takes its with it
    judgements: dict[tuple[int, int], tuple[Any, bool]] = {(batch, seq): (planner.graph, row_fits)}

    def allocator_fits(b: int, s: int) -> bool:
        """The row's own rule at (b, s): the step's reserved bytes within the allocator's limit."""
        try:
            graph = steps.planner(b, s).graph
        except RematError as err:  # a length the model cannot build
            limits.append(limit_note(err))
            return False
        if (b, s) not in judgements or judgements[(b, s)][0] is not graph:
            if name == "auto" and candidate_fits(steps, b, s):
                fits = True  # judge_step's answer whatever auto's solvers find: spare them
            else:
                found = judge_step(steps, name, b, s, asked_usable, judged_only=True)
                fits = found is not None and fits_on(found[0], found[2], found[3])
            judgements[(b, s)] = (graph, fits)
        return judgements[(b, s)][1]

    # Batch: a line through two traced sizes past 1 (batch 1 can trace differently: reshapes that
    # are views only there); sequence: a parabola through three traced lengths from the asked one.
    b_anchors = [max(batch, 2), max(batch, 2) + 1]
    s_anchors = seq_anchors(seq)
    units = s_anchors[0]
    # a row of (nearly) the same step found these: start there
    like = nearest_row([r.peak_bytes for r in earlier], peak)
    near = earlier[like] if memories and like is not None else None
    # else where the size models' live bytes reach `usable`, from the row's peaks at the anchors
    # (auto's: a solve at each)
    s_guess = (near.max_seq or 0) // SEQ_STEP if near is not None else 0
    s_peaks: list[int] = []
    try:
        steps.model_through("seq", batch, [u * SEQ_STEP for u in s_anchors])
        if not s_guess:
            s_peaks = [steps.peak(name, batch, u * SEQ_STEP, usable)[0] for u in s_anchors]
            s_guess = _guess(s_anchors, s_peaks, usable)
    except RematError as err:  # the model cannot be built that long
        limits.append(limit_note(err))
        s_guess = s_guess or units
    b_guess = near.max_batch if near is not None and near.max_batch else 1
    b_peaks: list[int] = []

    def batch_line() -> None:
        """The batch size model drawn through its anchors, and the row's guess from its peaks
        there where no earlier row's answer gives one."""
        nonlocal b_guess, b_peaks
        steps.model_through("batch", seq, b_anchors)
        if near is None or not near.max_batch:
            b_peaks = [steps.peak(name, b, seq, usable)[0] for b in b_anchors]
            b_guess = _guess(b_anchors, b_peaks, usable)

    def largest(
        axis: str,
        fixed: int,
        fits: Callable[[int], bool],
        guess: int,
        high: int,
        degree: int,
        low: int = 1,
        above: int | None = None,
    ) -> int | None:
        """The largest size in [low, high] that fits, searched on the size model and confirmed
        by a trace at the answer. A size can be piecewise polynomial (a table of max(seq, n)
        rows): where the answer is not confirmed, the model is drawn again through traces at the
        answer, and where that is not confirmed either, the search runs on traces."""
        if high < low:
            return None
        scale = 1 if axis == "batch" else SEQ_STEP
        best = _largest(fits, guess, low, high, above)
        for attempt in range(2):
            if best is None or steps.confirm(axis, fixed, best * scale):
                return best
            if attempt == 0:
                start = max(best, 2) if axis == "batch" else best
                with contextlib.suppress(RematError):
                    steps.model_through(
                        axis, fixed, [(start + k) * scale for k in range(degree + 1)]
                    )
            best = _largest(fits, best, low, high)
        return best

    if not memories:  # live bytes within `usable`
        batch_line()
        best_batch = largest("batch", seq, fits_batch, b_guess, max_batch, degree=1)
        best_seq = largest("seq", batch, fits_seq, s_guess, max_seq // SEQ_STEP, degree=2)
    else:  # the allocator's judgement, the row's own rule, from the size models' guesses
        # (searched on live bytes first, the guesses told the allocator's search no more and
        # cost a trace at each answer: a row that does not fit has `usable` = its peak - 1)
        # Expected to fit: where the live bytes reach the asked size's live limit (its overhead,
        # reserved - live, is more than at the answer, where the allocator frees its cache to
        # make room); not to: where they reach the allocator's limit less the BLAS workspaces
        # (no overhead at all). A step that ran out of memory shows no overhead: halfway there.
        room = memories[0].limit_bytes - memories[0].blas_workspace_bytes
        s_above = _guess(s_anchors, s_peaks, room) if s_peaks else None
        if memories[0].out_of_memory and near is None:
            s_guess = (1 + s_above) // 2 if s_above else 1
        # a row that fits at (batch, seq) fits at least that much; one that does not, less
        b_low, b_high = (batch, max_batch) if row_fits else (1, batch - 1)
        # The batch line only where the search goes past the first of its anchors, batch + 1
        # (a trace of its own), which a row that fits is judged at first: at a length that
        # fills the memory, one more sample seldom fits.
        if not row_fits or batch == max_batch or allocator_fits(batch + 1, seq):
            if b_low <= b_high:
                batch_line()
        else:
            b_guess = batch + 1
        b_above = _guess(b_anchors, b_peaks, room) if b_peaks else None
        if memories[0].out_of_memory and near is None:
            b_guess = (1 + b_above) // 2 if b_above else 1
        best_batch = largest(
            "batch",
            seq,
            lambda b: allocator_fits(b, seq),
            b_guess,
            b_high,
            degree=1,
            low=b_low,
            above=b_above,
        )
        best_seq = largest(
            "seq",
            batch,
            lambda u: allocator_fits(batch, u * SEQ_STEP),
            s_guess,
            max_seq // SEQ_STEP if row_fits else (seq - 1) // SEQ_STEP,
            degree=2,
            low=seq // SEQ_STEP if row_fits and seq % SEQ_STEP == 0 else 1,
            above=s_above,
        )
    return FitRow(
        strategy=name,
        apply=_apply_line(p, steps, planner, usable),
        plan=p.strategy,
        peak_bytes=peak,
        fits=row_fits,
        overhead=overhead,
        max_batch=best_batch,
        max_seq=None if best_seq is None else best_seq * SEQ_STEP,
        note=_allocator_note(memories) + (f"max seq: {limits[-1]}" if limits else ""),
        gpu_memory=tuple(m.to_dict() for m in memories),
        solved=p,
    )


def nearest_row(peaks: Sequence[int | None], peak: int) -> int | None:
    """The index of the row, of those with `peaks` at the asked size, that a row of `peak` there
    starts its searches from: the nearest within 1% (the first of equals); None if none is."""
    like = [i for i, p in enumerate(peaks) if p and abs(p - peak) <= peak // 100]
    return min(like, key=lambda i: abs(peaks[i] - peak)) if like else None  # type: ignore[operator]


def seq_anchors(seq: int) -> list[int]:
    """The lengths (in `SEQ_STEP` units) a row's sequence size model is drawn through: a parabola
    through three from the asked one."""
    units = max(seq // SEQ_STEP, 1)
    return [units, units + 1, units + 2]


def some_size_fits(
    steps: FitSteps, judged: tuple[int, Any, list[Any], int, float], batch: int, seq: int
) -> bool:
    """Whether what a rank holds at every size (parameters, gradients, optimizer state) leaves
    room under the limit the row is judged by (`judged`: its `judge_step`): else no size fits,
    and the row searches none."""
    memories, usable = judged[2], judged[3]
    return steps.held_at_every_size(batch, seq) <= (memories[0].limit_bytes if memories else usable)


def judge_step(
    steps: FitSteps, name: str, batch: int, seq: int, usable: int, judged_only: bool = False
) -> tuple[int, Any, list[Any], int, float] | None:
    """A strategy's step at (batch, seq): its per-rank peak, plan, GPU memories, the live bytes it
    may reach (the allocator's judge where simulated) and its predicted step-time overhead; None
    for a per-block strategy on a model without blocks. `judged_only`: the memory of the judging
    allocator setting alone (`FitSteps.gpu_memories`), for a search."""
    peak, p = steps.peak(name, batch, seq, usable)
    if peak is None:
        return None
    memories = steps.gpu_memories(batch, seq, p, judged_only)
    planner = steps.planner(batch, seq)
    if (
        memories
        and name == "auto"
        and not memories[0].fits
        and steps.held_at_every_size(batch, seq) <= memories[0].limit_bytes
    ):
        # Choose again against the allocator's judge: live bytes within its limit less the
        # overhead it showed, lowered while the reserved bytes still do not fit; then the plan of
        # least recompute among the fixed ones whose reserved bytes fit, if auto's never did.
        # (Not where what every plan holds alone exceeds the limit: none can fit.)
        target = usable
        for _ in range(4):
            if memories[0].fits:
                break
            lower = live_limit(peak, memories[0])
            target = lower if lower < target else target - memories[0].limit_bytes // 50
            if target <= 0:  # the allocator's overhead alone fills its limit
                break
            peak, p = steps.peak(name, batch, seq, target)
            memories = steps.gpu_memories(batch, seq, p, judged_only=True)
        if not memories[0].fits:
            for fixed in sorted(steps.candidates(planner), key=lambda c: c.recompute_seconds):
                fixed_memories = steps.gpu_memories(batch, seq, fixed, judged_only=True)
                if fixed_memories[0].fits:
                    peak, p, memories = steps.rank_peak(planner, fixed), fixed, fixed_memories
                    break
    if memories:
        usable = live_limit(peak, memories[0])
        if not judged_only:  # every setting's, of the plan judged
            memories = steps.gpu_memories(batch, seq, p)
    return peak, p, memories, usable, _overhead(p, planner)


def _overhead(plan: Any, planner: Any) -> float:
    """`plan`'s predicted recompute as a share of the step."""
    return plan.recompute_seconds / planner.step_seconds if planner.step_seconds else 0.0


def candidate_fits(steps: FitSteps, batch: int, seq: int) -> bool:
    """Whether a fixed or the lowest-peak plan's reserved bytes fit at (batch, seq): then `auto`
    fits there by `judge_step` (its own plans fit, or it falls back to the first of these that
    does), so a search that asks only whether it fits need not run auto's solvers."""
    planner = steps.planner(batch, seq)
    # one at a time, the lowest-peak plan (a plan per block count, a MILP) only where no fixed
    # plan fits: the same answer as judging `steps.candidates(planner)` whole
    plans = itertools.chain(steps.fixed_plans(planner), (planner.lowest_peak() for _ in (0,)))
    return any(steps.gpu_memories(batch, seq, p, judged_only=True)[0].fits for p in plans)


def live_limit(peak: int, memory: Any) -> int:
    """The `peak` (the per-rank live bytes the searches compare) a step may reach by `memory`'s
    judgement at one size: `peak` plus the room the reserved bytes leave under the limit. So the
    asked size fits in a search exactly when its reserved bytes fit. (`live_bytes_that_fit`
    counts from `requested_bytes`, which under --shard is the event walk's, below `peak`'s
    closed-form bound: a row could fit with no batch that fits.)"""
    room = memory.limit_bytes - memory.reserved_bytes
    return peak + room if memory.fits else min(peak + room, peak - 1)


def fits_on(peak: int, memories: list[Any], usable: int) -> bool:
    """Whether a step fits: by the simulated allocator where there is one, else live bytes."""
    return peak <= usable if not memories else memories[0].fits


def limit_note(err: RematError) -> str:
    """Why a size search stopped where the model cannot be built: at its sequence limit, the
    limit and how to build it longer (not the error's advice to ask for less, which the user
    did not); else the error's first clause."""
    if isinstance(err, SequenceLimitError):
        return f"{err.limit}, the longest the model is built for (more: {err.lever})"
    return str(err).split(";")[0]


def _allocator_note(memories: list[Any]) -> str:
    """When torch's default allocator runs out and expandable segments would not: say so."""
    if len(memories) > 1 and not memories[0].fits and memories[1].fits:
        return (
            f"out of memory with the default allocator (reserved "
            f"{format_bytes(memories[0].reserved_bytes)}), fits with "
            f"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
            f"({format_bytes(memories[1].reserved_bytes)}); "
        )
    return ""


def compiled_row(
    steps: FitSteps,
    mode: str,
    ac: str | None,
    batch: int,
    seq: int,
    usable: int,
    max_batch: int = 4096,
    max_seq: int = 1 << 20,
    search: bool = True,
) -> FitRow:
    """The step under torch.compile (`mode`, `ac`) at (batch, seq), from its traced eager step,
    and (`search`) the largest batch and sequence that fit. Judged by the caching allocator as eager rows
    are (reserved bytes within the limit, `remat.prediction.compiled_events`) where it is
    simulated, else by live bytes; the largest sizes by the same rule as eager rows': a line
    (batch) or parabola (sequence) through compiled sizes guesses where the live bytes reach
    the asked size's live limit, and the allocator's judgement of compiled steps confirms it.
    Each size is one compilation; a step that does not grow with the sequence (an image model)
    is not searched along it. Without `search`, the asked size is the one compilation and the
    largest sizes are None."""
    from remat.prediction.compiled_estimate import estimate_compiled

    compiled_at: dict[tuple[int, int], Any] = {}
    limits: list[str] = []
    # one rank's step under --shard: the allocator judges it; the search below runs on the
    # unsharded live bytes, whose growth with the size is the rank's (activations are not sharded)
    fsdp = steps.fsdp()
    judged = steps.simulate_allocator or fsdp is not None

    def at(b: int, s: int) -> Any:
        if (b, s) not in compiled_at:
            graph = steps.trace(b, s)
            if steps.progress:
                steps.progress(f"compiling ({mode}) batch {b}, seq {s} on fake tensors")
            model, inputs = steps.build(b, s)
            compiled_at[(b, s)] = estimate_compiled(
                graph,
                model,
                *inputs,
                compile=mode,
                optimizer=steps.optimizer,
                autocast=steps.setup.autocast,
                ac=ac,
                gpu=steps.gpu if judged else None,
                fsdp=fsdp,
            )
        return compiled_at[(b, s)]

    def fits(b: int, s: int) -> bool:
        try:
            c = at(b, s)
        except RematError as err:  # a length the model cannot build
            limits.append(limit_note(err))
            return False
        return c.gpu_memory[0]["fits"] if c.gpu_memory else c.peak_bytes <= usable

    compiled = at(batch, seq)
    memories = compiled.gpu_memory
    row_fits = fits(batch, seq)
    live = compiled.peak_bytes
    if memories:  # the live bytes the step may reach by the allocator's judgement (`live_limit`)
        room = memories[0]["limit_bytes"] - memories[0]["reserved_bytes"]
        live = live + room if row_fits else min(live + room, live - 1)
    else:
        live = usable

    def row(best_batch: int | None, best_seq: int | None) -> FitRow:
        name = f"{mode}+{compiled.ac} AC" if compiled.ac else mode
        return FitRow(
            strategy=f"compile:{name}",
            plan=f"torch.compile ({name}), torch's partitioner",
            # under --shard the rank's live peak, by the event walk (requested less workspaces)
            peak_bytes=compiled.peak_bytes
            if fsdp is None
            else memories[0]["requested_bytes"] - memories[0]["blas_workspace_bytes"],
            fits=row_fits,
            overhead=None,
            max_batch=best_batch,
            max_seq=None if best_seq is None else best_seq * SEQ_STEP,
            note=f"{compiled.backend}; {len(compiled_at)} sizes compiled"
            + ("" if search else "; largest sizes not searched")
            + (f"; max seq: {limits[-1]}" if limits else ""),
            gpu_memory=memories,
        )

    if not search:
        return row(None, None)

    def guess(xs: list[int], ys: list[int], size: Callable[[int], tuple[int, int]]) -> int:
        """Where the line or parabola through the compiled sizes reaches the live limit,
        corrected twice by the allocator's overhead (reserved - live) compiled at the guess: it
        grows with the step, so the asked size's alone guesses far sizes high."""
        x = _guess(xs, ys, live)
        for _ in range(2):
            try:
                c = at(*size(max(x, 1)))
            except RematError:
                break
            if not c.gpu_memory or c.gpu_memory[0]["out_of_memory"]:
                break  # an allocator that ran out stopped at its limit: no overhead to read
            m = c.gpu_memory[0]
            corrected = _guess(xs, ys, c.peak_bytes + m["limit_bytes"] - m["reserved_bytes"])
            if corrected == x:
                break
            x = corrected
        return x

    b_anchors = [max(batch, 2), max(batch, 2) + 1]
    b_peaks = [at(b, seq).peak_bytes for b in b_anchors]
    best_batch = _largest(
        lambda b: fits(b, seq),
        guess(b_anchors, b_peaks, lambda b: (b, seq)),
        batch if row_fits else 1,
        max_batch if row_fits else batch - 1,
    )
    units = max(seq // SEQ_STEP, 1)
    high = max_seq // SEQ_STEP if row_fits else (seq - 1) // SEQ_STEP
    low = units if row_fits and seq % SEQ_STEP == 0 else 1
    s_anchors = [units, units + 1, units + 2]
    try:  # the eager steps first: where they do not grow with the sequence, nothing to compile
        eager = {estimate(steps.trace(batch, u * SEQ_STEP)).peak_bytes for u in s_anchors}
        s_peaks = [] if len(eager) == 1 else [at(batch, u * SEQ_STEP).peak_bytes for u in s_anchors]
    except RematError as err:
        limits.append(limit_note(err))
        s_anchors, s_peaks = [units], [compiled.peak_bytes]
    if not s_peaks:  # the sequence does not move the step
        best_seq = high if row_fits and high >= low else None
    else:
        u_guess = (
            guess(s_anchors, s_peaks, lambda u: (batch, u * SEQ_STEP))
            if len(s_peaks) > 1
            else units
        )
        best_seq = _largest(lambda u: fits(batch, u * SEQ_STEP), u_guess, low, high)
    return row(best_batch, best_seq)


def _apply_line(p: Any, steps: FitSteps, planner: Any, usable: int) -> str:
    """The `remat.auto` call that makes plan `p` on the user's model, its budget in units and, in
    a comment, what that budget is made of. `remat.auto` plans the whole model's step, so under
    sharding the budget is the live bytes a rank may reach (`usable`, or what auto was solved
    at) plus what sharding takes off a rank's store-all step; a fixed strategy is named with the
    budget it is checked against (never below its own peak)."""
    name = p.strategy.split(" ")[0]
    fixed = not strategies.get(name, "eager").budgeted
    # what sharding takes off a rank: of this plan's step, or of store-all's (as auto is solved)
    judged = p if fixed else planner.solve(strategies.get("store_all"), planner.estimate.peak_bytes)
    moved = judged.predicted_peak_bytes - steps.rank_peak(planner, judged)
    if fixed:
        budget = max(usable + moved, p.predicted_peak_bytes)
    else:  # a lowest-peak plan (judge_step's fallback) was solved at no budget: its own peak
        budget = p.predicted_peak_bytes if p.budget_bytes is None else p.budget_bytes
    rank = budget - moved
    code = (
        "remat.auto(model, *inputs, "
        + (f'strategy="{name}", ' if fixed else "")
        + f'budget="{budget_text(budget)}", optimizer={steps.optimizer!r}, '
        f'profile="{steps.gpu.profile}")'
    )
    if moved:
        made = (
            f"the whole model's step: {format_bytes(rank)} a rank + {format_bytes(moved)} of "
            f"parameters, gradients and optimizer state that sharding over {steps.shard} ranks "
            "takes off each"
        )
    else:
        made = f"the live bytes the step may reach on {steps.gpu.name}"
    return f"{code}  # {made}"


def budget_text(nbytes: int) -> str:
    """A budget as `remat.auto` reads it, in GiB (MiB below 1 GiB), rounded down to 0.01."""
    unit, scale = ("GiB", 2**30) if nbytes >= 2**30 else ("MiB", 2**20)
    return f"{math.floor(nbytes / scale * 100) / 100:g}{unit}"
