"""`remat.answers.fit`: does a training step fit a GPU, with which strategy, at what batch and sequence?

Every answer comes from traced steps, not from a formula. A step's graph is affine in the batch and
at most quadratic in the sequence (attention scores), so a few traces give the graph at any size
(`remat.prediction.sizes.SizeModel`), the search runs on those, and a trace at the answer confirms it: the
traced graph there must equal the interpolated one, whose step fits while one more does not.

Precision as users train: `fp32`; `bf16` (parameters, gradients and optimizer state in bf16);
`bf16-mixed` (fp32 master parameters and gradients, the forward under `torch.autocast(bf16)`, whose
bf16 copies of the weights autograd saves). Sharding over `shard` ranks (FSDP2 / ZeRO-3) is the
per-rank figure of `remat.estimate` (parameters, gradients and optimizer state divided, plus the
gathered parameters of the blocks in flight); activations are per rank as traced.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

import numpy as np

from remat.answers.fit_steps import PRECISIONS, Build, _Steps
from remat.device.gpus import Gpu, allocator_limit_bytes, fixed_memory, usable_bytes
from remat.errors import BudgetError, RematError
from remat.graph import Graph
from remat.layouts.parallel import ONE_RANK, Layout
from remat.planning import strategies
from remat.planning.planner import Planner
from remat.prediction.estimate import Optimizer, estimate
from remat.units import format_bytes

#: The strategies a fit compares: no recomputation, the usual two, and remat's choice.
FIT_STRATEGIES = ("store_all", "full", "selective:megatron", "selective:torchtitan", "auto")
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

    @property
    def reserved_bytes(self) -> int | None:
        """The peak reserved bytes under the allocator setting the row is judged with."""
        return self.gpu_memory[0]["reserved_bytes"] if self.gpu_memory else None


@dataclass(frozen=True)
class FitReport:
    """The answer of `fit`, with everything it assumed."""

    model: str
    batch: int
    seq: int
    gpu: str
    profile: str  # the cost profile step times are predicted on
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
    #: how rows were judged: the allocator setting whose reserved bytes must fit its limit, or
    #: why live bytes were judged against `usable_bytes` instead
    allocator: str = ""
    #: tensor / context parallelism of every per-rank figure ("tp 8 + sp, cp 2"), "" for none
    layout: str = ""
    planner: Planner | None = field(default=None, repr=False, compare=False)

    def __repr__(self) -> str:
        """One line: does it fit, with what, and the advice's first sentence (all: `to_dict()`)."""
        fitting = [r.strategy for r in self.rows if r.fits]
        verdict = (
            f"{len(fitting)} of {len(self.rows)} strategies fit ({', '.join(fitting)})"
            if fitting
            else f"none of {len(self.rows)} strategies fits"
        )
        shard = f" x {self.shard} ranks" if self.shard > 1 else ""
        shard += f" ({self.layout})" if self.layout else ""
        advice = f"; advice: {self.advice[0]}" if self.advice else ""
        return (
            f"FitReport({self.model} on {self.gpu}{shard}, batch {self.batch} x seq {self.seq}, "
            f"{self.precision}, optimizer {self.optimizer}: {verdict} in "
            f"{format_bytes(self.usable_bytes)} usable{advice})"
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain data for JSON (the planner of the asked size left out); each row carries the
        figures of its judging allocator setting at the top level (`allocated_bytes`,
        `reserved_bytes`, `nvidia_smi_bytes`) and every setting's in `gpu_memory`."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "planner"}
        out["rows"] = [_row_dict(r) for r in self.rows]
        return out

    def table_rows(self) -> list[dict[str, Any]]:
        """The rows for a report's fit table."""
        return [
            {
                "strategy": r.strategy,
                "plan": r.plan,
                "peak_bytes": r.peak_bytes,
                "reserved_bytes": "OOM"
                if r.gpu_memory and r.gpu_memory[0]["out_of_memory"]
                else r.reserved_bytes,
                "fits": "yes" if r.fits else "no",
                "step time": "-" if r.overhead is None else f"+{r.overhead:.1%}",
                "max batch": r.max_batch,
                "max seq": r.max_seq,
            }
            for r in self.rows
        ]


def _row_dict(row: FitRow) -> dict[str, Any]:
    out = asdict(row)
    judged = row.gpu_memory[0] if row.gpu_memory else {}
    for key in ("requested_bytes", "allocated_bytes", "reserved_bytes", "nvidia_smi_bytes"):
        out[key] = judged.get(key)
    expandable = [m for m in row.gpu_memory if "expandable_segments:True" in m["settings"]]
    out["expandable_reserved_bytes"] = expandable[0]["reserved_bytes"] if expandable else None
    return out


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
    """One strategy: its peak at (batch, seq) and the largest batch and sequence that fit.

    Where the caching allocator is simulated (`steps.gpu_memories`), the row fits when its
    reserved bytes do (the allocator's limit, under torch's default settings), and the searches
    for the largest batch and sequence run on live bytes against the limit less the workspaces
    and the allocator's overhead (reserved - requested) measured at (batch, seq)."""
    judged = _judge(steps, name, batch, seq, usable)
    if judged is None:
        return FitRow(name, None, False, None, None, None, note="needs repeated blocks")
    peak, p, memories, usable, overhead = judged
    planner = steps.planner(batch, seq)
    floor = estimate(
        planner.graph,
        optimizer=steps.optimizer,
        shard=steps.shard,
        master_scale=steps.setup.master_scale,
    ).fixed_bytes
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
            gpu_memory=tuple(m.to_dict() for m in memories),
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
            limits.append(str(err).split(";")[0])
            return False

    # Batch: a line through two traced sizes past 1 (batch 1 can trace differently: reshapes that
    # are views only there); sequence: a parabola through three traced lengths from the asked one.
    b_anchors = [max(batch, 2), max(batch, 2) + 1]
    units = max(seq // SEQ_STEP, 1)
    s_anchors = [units, units + 1, units + 2]
    steps.model_through("batch", seq, b_anchors)
    try:
        steps.model_through("seq", batch, [u * SEQ_STEP for u in s_anchors])
        s_peaks = [steps.peak(name, batch, u * SEQ_STEP, usable)[0] for u in s_anchors]
        s_guess = _guess(s_anchors, s_peaks, usable)
    except RematError as err:  # the model cannot be built that long
        limits.append(str(err).split(";")[0])
        s_guess = units
    b_guess = _guess(b_anchors, [steps.peak(name, b, seq, usable)[0] for b in b_anchors], usable)

    def largest(
        axis: str, fixed: int, fits: Callable[[int], bool], guess: int, high: int, degree: int
    ) -> int | None:
        """The largest size that fits, searched on the size model and confirmed by a trace at
        the answer. A size can be piecewise polynomial (a table of max(seq, n) rows): where the
        answer is not confirmed, the model is drawn again through traces at the answer, and
        where that is not confirmed either, the search runs on traces."""
        scale = 1 if axis == "batch" else SEQ_STEP
        best = _largest(fits, guess, 1, high)
        for attempt in range(2):
            if best is None or steps.confirm(axis, fixed, best * scale):
                return best
            if attempt == 0:
                start = max(best, 2) if axis == "batch" else best
                with contextlib.suppress(RematError):
                    steps.model_through(
                        axis, fixed, [(start + k) * scale for k in range(degree + 1)]
                    )
            best = _largest(fits, best, 1, high)
        return best

    best_batch = largest("batch", seq, fits_batch, b_guess, max_batch, degree=1)
    best_seq = largest("seq", batch, fits_seq, s_guess, max_seq // SEQ_STEP, degree=2)
    return FitRow(
        strategy=name,
        apply=_apply_line(p, steps),
        plan=p.strategy,
        peak_bytes=peak,
        fits=_fits(peak, memories, usable),
        overhead=overhead,
        max_batch=best_batch,
        max_seq=None if best_seq is None else best_seq * SEQ_STEP,
        note=_allocator_note(memories) + (f"max seq: {limits[-1]}" if limits else ""),
        gpu_memory=tuple(m.to_dict() for m in memories),
    )


def _judge(
    steps: _Steps, name: str, batch: int, seq: int, usable: int
) -> tuple[int, Any, list[Any], int, float] | None:
    """A strategy's step at (batch, seq): its per-rank peak, plan, GPU memories, the live bytes it
    may reach (the allocator's judge where simulated) and its predicted step-time overhead; None
    for a per-block strategy on a model without blocks."""
    peak, p = steps.peak(name, batch, seq, usable)
    if peak is None:
        return None
    memories = steps.gpu_memories(batch, seq, p)
    planner = steps.planner(batch, seq)
    if memories and name == "auto":
        # Choose again against the allocator's judge: live bytes within its limit less the
        # overhead it showed, lowered while the reserved bytes still do not fit; then the plan of
        # least recompute among the fixed ones whose reserved bytes fit, if auto's never did.
        target = usable
        for _ in range(4):
            if memories[0].fits:
                break
            lower = memories[0].live_bytes_that_fit
            target = lower if lower < target else target - memories[0].limit_bytes // 50
            peak, p = steps.peak(name, batch, seq, target)
            memories = steps.gpu_memories(batch, seq, p)
        if not memories[0].fits:
            for fixed in sorted(steps.candidates(planner), key=lambda c: c.recompute_seconds):
                fixed_memories = steps.gpu_memories(batch, seq, fixed)
                if fixed_memories[0].fits:
                    peak, p, memories = steps.rank_peak(planner, fixed), fixed, fixed_memories
                    break
    if memories:
        usable = memories[0].live_bytes_that_fit
    overhead = p.recompute_seconds / planner.step_seconds if planner.step_seconds else 0.0
    return peak, p, memories, usable, overhead


def _fits(peak: int, memories: list[Any], usable: int) -> bool:
    return peak <= usable if not memories else memories[0].fits


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


def _judged_by(steps: _Steps) -> str:
    if steps.simulate_allocator:
        from remat.prediction.gpu_memory import ALLOCATOR_SETTINGS

        return (
            f"reserved bytes of the caching allocator ({ALLOCATOR_SETTINGS[0].describe()}) "
            "within its limit"
        )
    return "live bytes within capacity - --reserve"


def _compiled_row(
    steps: _Steps, mode: str, ac: str | None, batch: int, seq: int, usable: int
) -> FitRow:
    """The step under torch.compile (`mode`, `ac`) at (batch, seq), from its traced eager step."""
    from remat.prediction.compiled_estimate import estimate_compiled

    graph = steps.trace(batch, seq)
    if steps.progress:
        steps.progress(f"compiling ({mode}) batch {batch}, seq {seq} on fake tensors")
    model, inputs = steps.build(batch, seq)
    compiled = estimate_compiled(
        graph,
        model,
        *inputs,
        compile=mode,
        optimizer=steps.optimizer,
        autocast=steps.setup.autocast,
        ac=ac,
    )
    name = f"{mode}+{ac} AC" if ac else mode
    return FitRow(
        strategy=f"compile:{name}",
        plan=f"torch.compile ({name}), torch's partitioner",
        peak_bytes=compiled.peak_bytes,
        fits=compiled.peak_bytes <= usable,
        overhead=None,
        max_batch=None,
        max_seq=None,
        note=f"{compiled.backend}; peak at batch {batch}, seq {seq} only (one compilation a size)",
    )


def _apply_line(p: Any, steps: _Steps) -> str:
    """The `remat.auto` call that makes plan `p` on the user's model: a fixed strategy by name; a
    budgeted plan by the whole-model budget it was solved at (under sharding, not the per-rank
    capacity), with the optimizer and cost profile it was judged with."""
    name = p.strategy.split(" ")[0]
    if not strategies.get(name, "eager").budgeted:
        return f'remat.auto(model, *inputs, strategy="{name}", budget="100%")'
    return (
        f"remat.auto(model, *inputs, budget={p.budget_bytes}, optimizer={steps.optimizer!r}, "
        f'profile="{steps.gpu.profile}")'
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
    compile: str | None = None,
    ac: str | None = None,
    progress: Callable[[str], None] | None = None,
    build_for: Callable[[str], Build] | None = None,
    layout: Layout = ONE_RANK,
) -> FitReport:
    """Does one training step of `build(batch, seq)` fit `gpu`, and what is the most it fits?

    `build(batch, seq)` returns (model, inputs) on the meta device in the precision's parameter
    dtype (`PRECISIONS`). For each strategy: the per-rank peak at (batch, seq), whether it fits
    the GPU's usable memory (`remat.device.gpus.usable_bytes` on `shard` ranks: capacity less the
    context, BLAS workspaces, NCCL buffers and fragmentation, or less `reserve` if given), the
    predicted recompute on the GPU's cost profile, and the largest batch at `seq` and sequence at `batch` that fit (searched on size
    models, confirmed by a trace at the answer).

    `compile` (`whole` or `blocks`): one more row, `compile:<mode>`, the step under torch.compile
    with no recomputation of remat's (`remat.prediction.compiled_estimate`): its peak at (batch, seq) only
    (each size is one compilation, so no largest batch or sequence is searched). On one rank.
    `ac="full"` (with `blocks`): each block checkpointed before it is compiled.

    `build_for(precision)`: the `build` of another precision. Given, and nothing fits as asked,
    `extra["setup_that_fits"]` is `setup_that_fits`'s answer (precision, optimizer and ranks
    that do fit at the least cost), or absent when none does.

    `layout`: tensor and context parallelism (`remat.layouts.parallel.Layout`): every figure is then one
    rank's, its step traced as that rank runs it (its shards, its collectives); `shard` is the
    data-parallel degree that FSDP2 shards over, and the GPU's NCCL buffers count all ranks."""
    import time

    if precision not in PRECISIONS:
        raise RematError(f"precision {precision!r}: choose one of {', '.join(PRECISIONS)}")
    if shard < 1:
        raise RematError(f"shard={shard}: the number of ranks must be at least 1")
    if shard == 1 and PRECISIONS[precision].master_scale != 1:
        raise RematError(
            f"precision {precision!r} is FSDP2's MixedPrecisionPolicy over sharded fp32 "
            "parameters: give the number of ranks (--shard 2 or more), or use bf16-mixed on one GPU"
        )
    if compile is not None and layout.ranks > 1:
        raise RematError(
            f"compile={compile!r} is predicted on one rank: leave out --compile with --tp / --cp"
        )
    if compile is not None and shard > 1:
        raise RematError(
            f"compile={compile!r} is predicted on one rank: drop --shard, or leave out --compile "
            "(FSDP's per-rank arithmetic runs on the eager step)"
        )
    start = time.perf_counter()
    usable = _usable(gpu, shard * layout.ranks, reserve)
    if layout.pp > 1:
        if compile is not None:
            raise RematError(
                f"compile={compile!r} is predicted on one rank: leave it out with --pp"
            )
        return _pipeline_fit(
            build, model, batch, seq, gpu, precision, optimizer, shard, usable,
            strategies_to_fit, layout, progress, start, simulate_allocator=reserve is None,
        )  # fmt: skip
    steps = _Steps(build, gpu, precision, optimizer, shard, progress, layout)
    steps.simulate_allocator = steps.simulate_allocator and reserve is None
    rows = [
        _fit_row(steps, name, batch, seq, usable, max_batch, max_seq) for name in strategies_to_fit
    ]
    if compile is not None:
        rows.append(_compiled_row(steps, compile, ac, batch, seq, usable))
    extra: dict[str, Any] = {}
    peaks = [r.peak_bytes for r in rows if r.peak_bytes is not None]
    if peaks and min(peaks) > usable:
        extra["ranks_to_fit"] = _ranks_to_fit(steps, batch, seq, usable)
    if build_for is not None and not any(r.fits for r in rows):
        asked = Setup(precision, optimizer, shard)
        found = setup_that_fits(
            build_for, batch=batch, seq=seq, gpu=gpu, asked=asked, reserve=reserve,
            progress=progress, traced={precision: steps.traced}, layout=layout,
        )  # fmt: skip
        if found is not None:
            extra["setup_that_fits"] = asdict(found)
    report = _report(
        model,
        batch,
        seq,
        gpu,
        usable,
        precision,
        optimizer,
        shard,
        rows=tuple(rows),
        advice=(),
        traces=len(steps.traced),
        seconds=time.perf_counter() - start,
        extra=extra,
        allocator=_judged_by(steps),
        layout=layout.describe(steps.planner(batch, seq).graph),
        planner=steps.planner(batch, seq),
    )
    return replace(report, advice=advice(report))


def _pipeline_fit(
    build: Build,
    model: str,
    batch: int,
    seq: int,
    gpu: Gpu,
    precision: str,
    optimizer: Optimizer,
    shard: int,
    usable: int,
    strategies_to_fit: Iterable[str],
    layout: Layout,
    progress: Callable[[str], None] | None,
    start: float,
    simulate_allocator: bool = True,
) -> FitReport:
    """`fit` of a pipeline-parallel step (`remat.layouts.fit_pipeline`): every figure the tightest
    rank's, each stage's in `extra["stages"]` (by strategy), `max_batch` the largest micro-batch
    and `extra["max_microbatches"]` the most micro-batches, by strategy."""
    import time

    from remat.layouts.fit_pipeline import pipeline_rows, stage_table
    from remat.prediction.gpu_memory import ALLOCATOR_SETTINGS

    setup = PRECISIONS[precision]
    answer = pipeline_rows(
        build, layout=layout, gpu=gpu, autocast=setup.autocast, master_scale=setup.master_scale,
        optimizer=optimizer, shard=shard, batch=batch, seq=seq, usable=usable,
        strategies_to_fit=strategies_to_fit, progress=progress,
        simulate_allocator=simulate_allocator,
    )  # fmt: skip
    found, found_layout = answer.rows, answer.layout_that_fits
    rows = tuple(
        FitRow(
            strategy=r["strategy"],
            peak_bytes=r["peak_bytes"],
            fits=r["fits"],
            overhead=r["overhead"],
            max_batch=r["max_batch"],
            max_seq=None,
            plan=r["plan"],
            note=r["note"],
            apply=r["apply"],
            gpu_memory=r["gpu_memory"],
        )
        for r in found
    )
    report = _report(
        model,
        batch,
        seq,
        gpu,
        usable,
        precision,
        optimizer,
        shard,
        rows=rows,
        advice=(),
        traces=answer.traces,
        seconds=time.perf_counter() - start,
        extra={
            "stages": {
                name: stage_table(r, answer.reserved.get(name, ()))
                for name, r in answer.stages.items()
            },
            "max_microbatches": {r["strategy"]: r["max_microbatches"] for r in found},
            **({"layout_that_fits": found_layout} if found_layout else {}),
        },
        allocator=(
            "each rank's reserved bytes of the caching allocator "
            f"({ALLOCATOR_SETTINGS[0].describe()}) within its limit"
            if simulate_allocator
            else "live bytes within capacity - --reserve"
        ),
        layout=layout.describe(),
        planner=answer.planner,
    )
    said = advice(report)
    if found_layout:
        said += (
            f"Laid out as {found_layout['layout']}, remat's plan fits every rank "
            f"({format_bytes(found_layout['peak_bytes'])} at the tightest) at "
            f"+{found_layout['overhead']:.1%} predicted step time.",
        )
    return replace(report, advice=said)


def _report(
    model: str,
    batch: int,
    seq: int,
    gpu: Gpu,
    usable: int,
    precision: str,
    optimizer: Optimizer,
    shard: int,
    **answer: Any,
) -> FitReport:
    """A `FitReport` of what was asked (model, size, GPU and its usable bytes, precision,
    optimizer, ranks) and the `answer` (rows, advice, traces, ...)."""
    return FitReport(
        model=model,
        batch=batch,
        seq=seq,
        gpu=gpu.name,
        profile=gpu.profile,
        capacity_bytes=gpu.capacity_bytes,
        reserve_bytes=gpu.capacity_bytes - usable,
        usable_bytes=usable,
        precision=precision,
        optimizer=optimizer,
        shard=shard,
        **answer,
    )


def _usable(gpu: Gpu, shard: int, reserve: int | str | None) -> int:
    """What a rank's step may take: the allocator's limit less the workspaces it holds, or the
    capacity less a user's `reserve`."""
    if reserve is not None:
        return usable_bytes(gpu, reserve, ranks=shard)
    usable = allocator_limit_bytes(gpu, shard) - fixed_memory(gpu, shard).cublas_workspace_bytes
    if usable <= 0:
        raise BudgetError(
            f"{gpu.name}'s {format_bytes(gpu.capacity_bytes)} leave nothing to a training step "
            "once the CUDA context, NCCL's buffers and the BLAS workspaces are taken"
        )
    return usable


@dataclass(frozen=True)
class Setup:
    """How a step is trained: precision, optimizer and FSDP2 ranks; with the plan `auto` makes
    under it and that plan's predicted step-time overhead, where it was judged."""

    precision: str
    optimizer: Optimizer
    shard: int
    plan: str = ""
    overhead: float = 0.0

    def changes(self, asked: Setup) -> list[str]:
        """What differs from `asked`, in words."""
        out = []
        if self.precision != asked.precision:
            out.append(f"precision {asked.precision} -> {self.precision}")
        if self.optimizer != asked.optimizer:
            out.append(f"optimizer {asked.optimizer} -> {self.optimizer}")
        if self.shard != asked.shard:
            out.append(f"ranks {asked.shard} -> {self.shard}")
        return out


#: Optimizers `setup_that_fits` may trade for: 8-bit AdamW keeps 2 bytes of state per parameter
#: element instead of 8 (the step's math is AdamW's).
_LEANER_OPTIMIZER = {
    o: "adamw-8bit" for o in ("adamw", "adamw-foreach", "adamw-for-loop", "adamw-fused")
}


def setup_that_fits(
    build_for: Callable[[str], Build],
    *,
    batch: int,
    seq: int,
    gpu: Gpu,
    asked: Setup,
    reserve: int | str | None = None,
    max_ranks: int = 1024,
    progress: Callable[[str], None] | None = None,
    traced: dict[str, dict[tuple[int, int], Graph]] | None = None,
    layout: Layout = ONE_RANK,
) -> Setup | None:
    """The setup under which remat's plan of the step at (batch, seq) fits `gpu`, at the least
    cost: the fewest ranks first (GPUs cost more than time), then the least predicted step time,
    then the fewest changes from `asked`. Tried: the asked precision, bf16-mixed, bf16-fsdp
    (sharded only) and bf16; the asked optimizer and, for AdamW, 8-bit AdamW; the asked ranks and
    powers of two up to `max_ranks`. None when nothing up to `max_ranks` fits. `traced`:
    graphs already traced, by precision (the optimizer does not change the trace). `layout`
    (tensor and context parallelism) stays as asked: only the data-parallel ranks vary."""
    traced = {} if traced is None else traced
    levels = [asked.shard, *(2**k for k in range(1, 11) if asked.shard < 2**k <= max_ranks)]
    precisions = list(dict.fromkeys([asked.precision, "bf16-mixed", "bf16-fsdp", "bf16"]))
    optimizers = list(dict.fromkeys([asked.optimizer, _LEANER_OPTIMIZER.get(asked.optimizer)]))
    combos: dict[tuple[str, Optimizer], _Steps] = {}  # one per setup: planners are per rank count
    for precision in precisions:
        for optimizer in (o for o in optimizers if o is not None or asked.optimizer is None):
            steps = _Steps(
                build_for(precision), gpu, precision, optimizer, asked.shard, progress, layout
            )
            steps.traced = traced.setdefault(precision, {})
            steps.simulate_allocator = reserve is None
            combos[(precision, optimizer)] = steps
    for ranks in levels:
        usable = _usable(gpu, ranks * layout.ranks, reserve)
        found = []
        for (precision, optimizer), steps in combos.items():
            if ranks == 1 and steps.setup.master_scale != 1:
                continue  # FSDP2's mixed precision needs sharded parameters
            steps.shard = ranks
            planner = steps.planner(batch, seq)
            # Cheap first: where no fixed plan comes within 5% of the memory, auto's solvers
            # (which only mix those plans' choices per block) need not run.
            lowest = min(steps.rank_peak(planner, p) for p in steps.fixed_plans(planner))
            if lowest > 1.05 * usable:
                continue
            judged = _judge(steps, "auto", batch, seq, usable)
            if judged is None:
                return None  # no blocks to plan: no setup changes that
            peak, p, memories, row_usable, overhead = judged
            if _fits(peak, memories, row_usable):
                found.append(Setup(precision, optimizer, ranks, p.strategy, overhead))
        if found:
            return min(found, key=lambda s: (round(s.overhead, 4), len(s.changes(asked))))
    return None


def _ranks_to_fit(steps: _Steps, batch: int, seq: int, usable: int) -> int | None:
    """The fewest ranks (a power of two, up to 1024) over which sharding parameters, gradients and
    optimizer state brings a plan within `usable` per rank (per rank, since the unsharded
    optimizer step can hide every activation from the whole-model judge): arithmetic on the
    traced step, as `estimate(shard=N)` is."""
    planner = steps.planner(batch, seq)
    plans = steps.candidates(planner)
    for ranks in (2**k for k in range(1, 11)):
        if ranks > steps.shard and any(steps.rank_peak(planner, p, ranks) <= usable for p in plans):
            return ranks
    return None


def advice(report: FitReport) -> tuple[str, ...]:
    """What to do, in words (seed 004's "when the trade is right")."""
    rows = {r.strategy: r for r in report.rows}
    store_all, auto = rows.get("store_all"), rows.get("auto")
    usable = format_bytes(report.usable_bytes)
    if store_all is not None and store_all.fits:
        return (
            f"store-all fits ({_held(store_all, usable)}): do not "
            "checkpoint; recomputation would only cost time. "
            + (
                f"The largest batch that fits without recomputation is {store_all.max_batch}."
                if store_all.max_batch
                else ""
            ),
        )
    compiled = [r for r in report.rows if r.strategy.startswith("compile:") and r.fits]
    if compiled:
        best = min(compiled, key=lambda r: r.peak_bytes)
        return (
            f"{best.plan} fits ({format_bytes(best.peak_bytes)} of {usable}) without "
            "recomputation: compile it and do not checkpoint.",
        )
    fitting = [r for r in report.rows if r.fits and r.overhead is not None]
    if fitting:
        best = min(fitting, key=lambda r: r.overhead)
        return (
            f"{best.plan} fits ({_held(best, usable)}) at "
            f"+{best.overhead:.1%} predicted step time: the cheapest plan that fits. Apply it "
            f"with `{best.apply}`"
            + (", then wrap with fully_shard as usual." if report.shard > 1 else "."),
        )
    lowest = min((r for r in report.rows if r.peak_bytes is not None), key=lambda r: r.peak_bytes)
    name = (
        lowest.plan
        if lowest.plan.startswith(lowest.strategy)
        else (f"{lowest.strategy} ({lowest.plan})")
    )
    lines = [f"nothing fits: the lowest is {name}, {_held(lowest, usable)}."]  # a row's name
    expandable = [r for r in report.rows if "expandable_segments:True" in r.note]
    if expandable:
        lines.append(
            f"{expandable[0].strategy} fits with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: "
            "the default allocator's fragmentation is what does not fit."
        )
    if auto is not None and auto.max_batch:
        lines.append(
            f"a micro-batch of {auto.max_batch} fits with remat's plan: keep the global batch "
            f"with {math.ceil(report.batch / auto.max_batch)} gradient-accumulation steps."
        )
    ranks = report.extra.get("ranks_to_fit")
    found = report.extra.get("setup_that_fits")
    if found:
        asked = Setup(report.precision, report.optimizer, report.shard)
        setup = Setup(**found)
        lines.append(
            f"fits with {', '.join(setup.changes(asked))}: {setup.plan} at +{setup.overhead:.1%} "
            "predicted step time, the fewest GPUs and then the least time of the setups tried "
            "(precisions bf16-mixed, bf16-fsdp, bf16; 8-bit AdamW; up to 1024 ranks)."
        )
        if ranks and ranks != setup.shard:
            lines.append(
                f"keeping {report.precision} and {report.optimizer}: --shard {ranks} "
                "(FSDP2 / ZeRO-3: parameters, gradients and optimizer state split)."
            )
    elif ranks:
        lines.append(
            f"sharded over {ranks} ranks (FSDP2 / ZeRO-3: parameters, gradients and optimizer "
            f"state split, activations per rank as traced) the lowest plan fits: --shard {ranks}."
        )
    elif report.precision == "bf16-mixed" and report.shard > 1:
        lines.append(
            "no number of ranks fits under torch.autocast: it keeps a bf16 copy of every layer's "
            "weights through the forward, which sharding does not divide. FSDP2's mixed precision "
            "(MixedPrecisionPolicy(param_dtype=bf16)) has no such copies: --precision bf16-fsdp."
        )
    else:
        lines.append(
            f"shard parameters, gradients and optimizer state over more ranks (now "
            f"{report.shard}; --shard N), or offload them to the host (not modelled yet)."
        )
    return tuple(lines)


def _held(row: FitRow, usable: str) -> str:
    """What a row takes of what it may: reserved bytes against the allocator's limit when the
    allocator was simulated, else live bytes against the usable memory."""
    if row.gpu_memory:
        judged = row.gpu_memory[0]
        if judged["out_of_memory"]:
            return (
                f"{format_bytes(row.peak_bytes)} of live tensors, out of memory in the "
                f"allocator's {format_bytes(judged['limit_bytes'])}"
            )
        return (
            f"{format_bytes(judged['reserved_bytes'])} reserved of the allocator's "
            f"{format_bytes(judged['limit_bytes'])}"
        )
    return f"{format_bytes(row.peak_bytes)} of {usable}"
