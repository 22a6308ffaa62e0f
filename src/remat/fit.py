"""`remat.fit`: does a training step fit a GPU, with which strategy, at what batch and sequence?

Every answer comes from traced steps, not from a formula. Peaks of one strategy grow with the batch
as an affine function (every activation has the batch as a factor; parameters, gradients and
optimizer state do not) and with the sequence as a quadratic at most (attention scores), so a few
traces place the answer, and traces at the answer and one past it confirm it: the step at the
answer fits, one more does not.

Precision as users train: `fp32`; `bf16` (parameters, gradients and optimizer state in bf16);
`bf16-mixed` (fp32 master parameters and gradients, the forward under `torch.autocast(bf16)`, whose
bf16 copies of the weights autograd saves). Sharding over `shard` ranks (FSDP2 / ZeRO-3) is the
per-rank figure of `remat.estimate` (parameters, gradients and optimizer state divided, plus the
gathered parameters of the blocks in flight); activations are per rank as traced.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Literal

import numpy as np
import torch

from remat import strategies
from remat.errors import InfeasibleBudget, NoBlocksError, RematError
from remat.estimate import Optimizer, estimate, shard_step
from remat.gpus import Gpu, usable_bytes
from remat.planner import Planner
from remat.units import format_bytes

Precision = Literal["fp32", "bf16", "bf16-mixed"]
PRECISIONS: dict[str, tuple[str, torch.dtype | None]] = {
    # name: (the dtype parameters are built in, the autocast dtype of the forward)
    "fp32": ("fp32", None),
    "bf16": ("bf16", None),
    "bf16-mixed": ("fp32", torch.bfloat16),
}
#: The strategies a fit compares: no recomputation, the usual two, and remat's choice.
FIT_STRATEGIES = ("store_all", "full", "selective:megatron", "selective:torchtitan", "auto")
#: The sequence-length answer is a multiple of this (tokens), as sequence lengths are chosen.
SEQ_STEP = 64

Build = Callable[[int, int], tuple[torch.nn.Module, tuple[Any, ...]]]


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


@dataclass(frozen=True)
class FitReport:
    """The answer of `fit`, with everything it assumed."""

    model: str
    batch: int
    seq: int
    gpu: str
    capacity_bytes: int
    reserve_bytes: int
    usable_bytes: int
    precision: str
    optimizer: str | None
    shard: int
    rows: tuple[FitRow, ...]
    advice: tuple[str, ...]
    traces: int = 0
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    planner: Planner | None = field(default=None, repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        """Plain data for JSON (the planner of the asked size left out)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "planner"}
        out["rows"] = [asdict(r) for r in self.rows]
        return out

    def table_rows(self) -> list[dict[str, Any]]:
        """The rows for a report's fit table."""
        return [
            {
                "strategy": r.strategy,
                "plan": r.plan,
                "peak_bytes": r.peak_bytes,
                "fits": "yes" if r.fits else "no",
                "step time": "-" if r.overhead is None else f"+{r.overhead:.1%}",
                "max batch": r.max_batch,
                "max seq": r.max_seq,
            }
            for r in self.rows
        ]


class _Steps:
    """Traced steps by (batch, seq), each traced once and asked for every strategy's peak."""

    def __init__(
        self,
        build: Build,
        gpu: Gpu,
        precision: str,
        optimizer: Optimizer,
        shard: int,
        progress: Callable[[str], None] | None,
    ) -> None:
        self.build, self.gpu, self.precision = build, gpu, precision
        self.optimizer, self.shard, self.progress = optimizer, shard, progress
        self.planners: dict[tuple[int, int], Planner] = {}

    def planner(self, batch: int, seq: int) -> Planner:
        key = (batch, seq)
        if key not in self.planners:
            if self.progress:
                self.progress(f"tracing batch {batch}, seq {seq}")
            from remat.trace import trace

            model, inputs = self.build(batch, seq)
            graph = trace(model, *inputs, autocast=PRECISIONS[self.precision][1])
            self.planners[key] = Planner(graph, self.gpu.profile, self.optimizer)
        return self.planners[key]

    def rank_peak(self, planner: Planner, plan: Any, shard: int | None = None) -> int:
        """`plan`'s peak per rank: its simulation with parameters, gradients and optimizer state
        sharded over `shard` ranks (`remat.estimate.shard_step`), the optimizer step included."""
        shard = self.shard if shard is None else shard
        if shard == 1:
            return plan.predicted_peak_bytes
        sharded = shard_step(planner.graph, planner.simulate(plan.regions), shard, self.optimizer)
        return max(max(sharded.timeline), sharded.optimizer_step_bytes)

    def candidates(self, planner: Planner) -> list[Any]:
        """The plans judged per rank when sharded (the planner's budgets are whole-model bytes,
        where the optimizer step of the unsharded model hides every activation): every appliable
        strategy's plan at store-all's peak, and the lowest-peak plan."""
        found = [r.plan for r in planner.compare(planner.estimate.peak_bytes) if r.plan]
        return [p for p in found if p.appliable] + [planner.lowest_peak()]

    def peak(self, strategy: str, batch: int, seq: int, usable: int) -> tuple[int | None, Any]:
        """The strategy's per-rank peak at (batch, seq), with its plan; for `auto`, the plan that
        fits `usable` at the least recompute, else the one of lowest peak."""
        planner = self.planner(batch, seq)
        chosen = strategies.get(strategy, "eager")
        try:
            if strategy != "auto":
                p = planner.solve(chosen, planner.estimate.peak_bytes)
                return self.rank_peak(planner, p), p
            if self.shard == 1:
                try:
                    p = planner.plan(usable, "auto")
                except InfeasibleBudget:
                    p = planner.lowest_peak()
                return p.predicted_peak_bytes, p
        except NoBlocksError:
            return None, None
        peaks = [(self.rank_peak(planner, p), p) for p in self.candidates(planner)]
        fitting = [(peak, p) for peak, p in peaks if peak <= usable]
        if fitting:
            return min(fitting, key=lambda x: (x[1].recompute_seconds, x[0]))
        return min(peaks, key=lambda x: (x[0], x[1].recompute_seconds))


def _largest(fits: Callable[[int], bool], guess: int, low: int, high: int) -> int | None:
    """The largest n in [low, high] with fits(n), for a monotone `fits`: gallop up from `guess` (a
    good guess costs two calls: the answer fits, the next does not), or check `low` when the guess
    does not fit, then bisect. None when not even `low` fits."""
    n = min(max(guess, low), high)
    step = 1
    if fits(n):
        lo = n
        while lo < high and fits(min(lo + step, high)):
            lo, step = min(lo + step, high), step * 2
        hi = min(lo + step, high + 1)  # does not fit, or past `high`
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


def _fit_row(
    steps: _Steps, name: str, batch: int, seq: int, usable: int, max_batch: int, max_seq: int
) -> FitRow:
    """One strategy: its peak at (batch, seq) and the largest batch and sequence that fit."""
    peak, p = steps.peak(name, batch, seq, usable)
    if peak is None:
        return FitRow(name, None, False, None, None, None, note="needs repeated blocks")
    planner = steps.planner(batch, seq)
    overhead = p.recompute_seconds / planner.step_seconds if planner.step_seconds else 0.0

    def fits_batch(b: int) -> bool:
        return steps.peak(name, b, seq, usable)[0] <= usable

    limits: list[str] = []

    def seq_peak(units: int) -> int | None:
        """The peak at `units` * SEQ_STEP tokens; None past what the model can build (learned
        positions end), which counts as not fitting."""
        try:
            return steps.peak(name, batch, units * SEQ_STEP, usable)[0]
        except RematError as err:
            limits.append(str(err).split(";")[0])
            return None

    def fits_seq(units: int) -> bool:
        peak = seq_peak(units)
        return peak is not None and peak <= usable

    floor = estimate(planner.graph, optimizer=steps.optimizer, shard=steps.shard).fixed_bytes
    if floor > usable:  # parameters, gradients and optimizer state alone: no size fits
        return FitRow(
            name,
            plan=p.strategy,
            peak_bytes=peak,
            fits=False,
            overhead=overhead,
            max_batch=None,
            max_seq=None,
            note=f"parameters, gradients and optimizer state alone take {format_bytes(floor)}",
        )
    b_points = [batch, 2 * batch]
    b_guess = _guess(b_points, [steps.peak(name, b, seq, usable)[0] for b in b_points], usable)
    units = max(seq // SEQ_STEP, 1)
    s_points = sorted({max(units // 2, 1), units, units + 1})
    s_peaks = [seq_peak(u) for u in s_points]
    known = [(u, pk) for u, pk in zip(s_points, s_peaks, strict=True) if pk is not None]
    s_guess = _guess(*map(list, zip(*known, strict=True)), usable) if len(known) == 3 else units
    best_batch = _largest(fits_batch, b_guess, 1, max_batch)
    best_seq = _largest(fits_seq, s_guess, 1, max_seq // SEQ_STEP)
    return FitRow(
        strategy=name,
        plan=p.strategy,
        peak_bytes=peak,
        fits=peak <= usable,
        overhead=overhead,
        max_batch=best_batch,
        max_seq=None if best_seq is None else best_seq * SEQ_STEP,
        note=f"max seq: {limits[-1]}" if limits else "",
    )


def fit(
    build: Build,
    *,
    model: str,
    batch: int,
    seq: int,
    gpu: Gpu,
    precision: str = "bf16-mixed",
    optimizer: Optimizer = "adamw",
    shard: int = 1,
    reserve: int | str | None = None,
    strategies_to_fit: Iterable[str] = FIT_STRATEGIES,
    max_batch: int = 4096,
    max_seq: int = 1 << 20,
    progress: Callable[[str], None] | None = None,
) -> FitReport:
    """Does one training step of `build(batch, seq)` fit `gpu`, and what is the most it fits?

    `build(batch, seq)` returns (model, inputs) on the meta device in the precision's parameter
    dtype (`PRECISIONS`). For each strategy: the per-rank peak at (batch, seq), whether it fits
    the GPU's usable memory (capacity less `reserve`), the predicted recompute on the GPU's cost
    profile, and the largest batch at `seq` and sequence at `batch` that fit (confirmed by traces
    at the answer and one step past it)."""
    import time

    if precision not in PRECISIONS:
        raise RematError(f"precision {precision!r}: choose one of {', '.join(PRECISIONS)}")
    if shard < 1:
        raise RematError(f"shard={shard}: the number of ranks must be at least 1")
    start = time.perf_counter()
    usable = usable_bytes(gpu, reserve)
    steps = _Steps(build, gpu, precision, optimizer, shard, progress)
    rows = [
        _fit_row(steps, name, batch, seq, usable, max_batch, max_seq) for name in strategies_to_fit
    ]
    extra: dict[str, Any] = {}
    peaks = [r.peak_bytes for r in rows if r.peak_bytes is not None]
    if peaks and min(peaks) > usable:
        extra["ranks_to_fit"] = _ranks_to_fit(steps, batch, seq, usable)
    report = FitReport(
        model=model,
        batch=batch,
        seq=seq,
        gpu=gpu.name,
        capacity_bytes=gpu.capacity_bytes,
        reserve_bytes=gpu.capacity_bytes - usable,
        usable_bytes=usable,
        precision=precision,
        optimizer=optimizer,
        shard=shard,
        rows=tuple(rows),
        advice=(),
        traces=len(steps.planners),
        seconds=time.perf_counter() - start,
        extra=extra,
        planner=steps.planner(batch, seq),
    )
    return replace(report, advice=advice(report))


def _ranks_to_fit(steps: _Steps, batch: int, seq: int, usable: int) -> int | None:
    """The fewest ranks (a power of two, up to 1024) over which sharding parameters, gradients and
    optimizer state brings the lowest-peak plan within `usable` per rank: arithmetic on the
    traced step, as `estimate(shard=N)` is."""
    planner = steps.planner(batch, seq)
    candidates = steps.candidates(planner)
    for ranks in (2**k for k in range(1, 11)):
        if ranks > steps.shard and any(
            steps.rank_peak(planner, p, ranks) <= usable for p in candidates
        ):
            return ranks
    return None


def advice(report: FitReport) -> tuple[str, ...]:
    """What to do, in words (seed 004's "when the trade is right")."""
    rows = {r.strategy: r for r in report.rows}
    store_all, auto = rows.get("store_all"), rows.get("auto")
    usable = format_bytes(report.usable_bytes)
    if store_all is not None and store_all.fits:
        return (
            f"store-all fits ({format_bytes(store_all.peak_bytes)} of {usable}): do not "
            "checkpoint; recomputation would only cost time. "
            + (
                f"The largest batch that fits without recomputation is {store_all.max_batch}."
                if store_all.max_batch
                else ""
            ),
        )
    fitting = [r for r in report.rows if r.fits and r.overhead is not None]
    if fitting:
        best = min(fitting, key=lambda r: r.overhead)
        return (
            f"{best.plan} fits ({format_bytes(best.peak_bytes)} of {usable}) at "
            f"+{best.overhead:.1%} predicted step time: the cheapest plan that fits. Apply it "
            f"with `remat.auto(model, *inputs, budget={report.usable_bytes})`.",
        )
    lowest = min((r for r in report.rows if r.peak_bytes is not None), key=lambda r: r.peak_bytes)
    lines = [
        f"nothing fits: the lowest peak is {format_bytes(lowest.peak_bytes)} ({lowest.plan}) "
        f"against {usable} usable."
    ]
    if auto is not None and auto.max_batch:
        lines.append(
            f"a micro-batch of {auto.max_batch} fits with remat's plan: keep the global batch "
            f"with {math.ceil(report.batch / auto.max_batch)} gradient-accumulation steps."
        )
    ranks = report.extra.get("ranks_to_fit")
    if ranks:
        lines.append(
            f"sharded over {ranks} ranks (FSDP2 / ZeRO-3: parameters, gradients and optimizer "
            f"state split, activations per rank as traced) the lowest plan fits: --shard {ranks}."
        )
    else:
        lines.append(
            f"shard parameters, gradients and optimizer state over more ranks (now "
            f"{report.shard}; --shard N), or offload them to the host (not modelled yet)."
        )
    return tuple(lines)
