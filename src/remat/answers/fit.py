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

Here: `fit` itself, its `FitReport`, and what to do when nothing fits (`advice`,
`setup_that_fits`). The steps it judges (traced or size-modelled) are `remat.answers.fit_steps`',
each strategy's row and the search for the largest batch and sequence `remat.answers.fit_rows`'.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from remat.answers.fit_rows import FitRow, compiled_row, fits_on, judge_step
from remat.answers.fit_steps import PRECISIONS, Build, FitSteps
from remat.answers.fit_workers import default_workers, fit_rows
from remat.collector import collector_paused
from remat.device.gpus import Gpu, allocator_limit_bytes, fixed_memory, usable_bytes
from remat.errors import BudgetError, RematError
from remat.graph import Graph
from remat.layouts.parallel import ONE_RANK, Layout
from remat.planning.planner import Planner
from remat.prediction.estimate import Optimizer
from remat.prediction.gpu_memory import FsdpUnit
from remat.prediction.loop import Loop
from remat.units import format_bytes

#: The strategies a fit compares: no recomputation, the usual two, and remat's choice.
FIT_STRATEGIES = ("store_all", "full", "selective:megatron", "selective:torchtitan", "auto")


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
    #: how the loop treats gradients (`remat.prediction.loop.Loop.describe`), "" for torch's default
    loop: str = ""
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
        best = advised(self)
        # the advice as data: the row it applies and its line (None: nothing to apply)
        out["advised"] = None if best is None else {"strategy": best.strategy, "plan": best.plan}
        out["apply"] = None if best is None else best.apply
        out["bytes_legend"] = BYTES_LEGEND
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


#: Which torch statistic each byte figure of a row compares with, per rank (`--json`'s
#: `bytes_legend`). The allocator's figures are those of `gpu_memory[0]` (torch's default
#: settings), None where a --reserve replaced the allocator's judgement.
BYTES_LEGEND: dict[str, str] = {
    "peak_bytes": "remat.estimate's peak of live tensors, no allocator rounding and no BLAS "
    "workspaces: what the max batch / max seq searches compare. Under --shard a closed-form bound "
    "that holds the root unit's and two blocks' gathered parameters (and one block's unsharded "
    "gradients in backward) at every point, so it can exceed requested_bytes, which the allocator "
    "walk gathers and frees in order; compare requested_bytes with torch",
    "requested_bytes": "torch.cuda.memory_stats()['requested_bytes.all.peak']: the tensors as "
    "requested, BLAS workspaces included",
    "active_bytes": "memory_stats()['active_bytes.all.peak'] (torchtune's peak_memory_active): "
    "equal to allocated_bytes, as no block is freed while another stream uses it",
    "allocated_bytes": "torch.cuda.max_memory_allocated(): blocks as handed out (512 B rounding)",
    "reserved_bytes": "torch.cuda.max_memory_reserved(): segments taken from cudaMalloc; a row "
    "fits when these are within gpu_memory[0].limit_bytes",
    "expandable_reserved_bytes": "max_memory_reserved() under PYTORCH_CUDA_ALLOC_CONF="
    "expandable_segments:True",
    "nvidia_smi_bytes": "nvidia-smi's memory of the process: reserved + CUDA context + NCCL buffers",
}


def _row_dict(row: FitRow) -> dict[str, Any]:
    out = asdict(replace(row, solved=None))
    del out["solved"]
    judged = row.gpu_memory[0] if row.gpu_memory else {}
    keys = ("requested_bytes", "active_bytes", "allocated_bytes", "reserved_bytes")
    for key in (*keys, "nvidia_smi_bytes"):
        out[key] = judged.get(key)
    expandable = [m for m in row.gpu_memory if "expandable_segments:True" in m["settings"]]
    out["expandable_reserved_bytes"] = expandable[0]["reserved_bytes"] if expandable else None
    return out


def _judged_by(steps: FitSteps) -> str:
    if steps.simulate_allocator:
        from remat.prediction.gpu_memory import ALLOCATOR_SETTINGS

        return (
            f"reserved bytes of the caching allocator ({ALLOCATOR_SETTINGS[0].describe()}) "
            "within its limit"
        )
    return "live bytes within capacity - --reserve"


@collector_paused()
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
    loop: Loop | None = None,
    full_trace: bool = False,
    compiled_maxima: bool = True,
    fsdp_units: Sequence[FsdpUnit] = (),
    workers: int | None = None,
) -> FitReport:
    """Does one training step of `build(batch, seq)` fit `gpu`, and what is the most it fits?

    `build(batch, seq)` returns (model, inputs) on the meta device in the precision's parameter
    dtype (`PRECISIONS`). For each strategy: the per-rank peak at (batch, seq), whether it fits
    the GPU's usable memory (`remat.device.gpus.usable_bytes` on `shard` ranks: capacity less the
    context, BLAS workspaces, NCCL buffers and fragmentation, or less `reserve` if given), the
    predicted recompute on the GPU's cost profile, and the largest batch at `seq` and sequence at `batch` that fit (searched on size
    models, confirmed by a trace at the answer).

    `compile` (`whole` or `blocks`): one more row, `compile:<mode>`, the step under torch.compile
    with no recomputation of remat's (`remat.prediction.compiled_estimate`), judged as the eager
    rows are, its largest batch and sequence searched on compiled sizes (`compiled_row`; not
    with `compiled_maxima=False`: the asked size only, one compilation). On one rank.
    `ac` (`full` or a selective op policy, `remat.prediction.compiled_ac`): each block
    checkpointed before it is compiled, as torchtitan's apply_ac wraps it.

    `build_for(precision)`: the `build` of another precision. Given, and nothing fits as asked,
    `extra["setup_that_fits"]` is `setup_that_fits`'s answer (precision, optimizer and ranks
    that do fit at the least cost), or absent when none does.

    `layout`: tensor and context parallelism (`remat.layouts.parallel.Layout`): every figure is then one
    rank's, its step traced as that rank runs it (its shards, its collectives); `shard` is the
    data-parallel degree; FSDP2 shards parameters, gradients and optimizer state over `shard` x
    `layout.cp` ranks (torchtitan's `dp_shard_cp` mesh), and the GPU's NCCL buffers count all
    ranks. With pipeline stages, `batch` is still the step's (a data-parallel rank's), cut into
    `layout.microbatches` micro-batches, as `remat.layouts.pipeline.predict` takes it; the
    largest batch searched is the largest micro-batch (`extra["microbatch"]`: the asked one).

    `loop`: how the training loop treats gradients (`remat.prediction.loop.Loop`: the optimizer
    stepped in backward, or gradients kept between steps as under gradient accumulation: on one
    rank; the logits kept through backward: on any ranks, eager and without pipeline stages).

    `fsdp_units`: modules outside the blocks that FSDP2 wraps in units of their own
    (`remat.prediction.gpu_memory.FsdpUnit`: torchtitan wraps the embedding, and the final norm
    with the output head, not resharded after forward); without them those parameters are the
    root unit's, gathered from the step's start to the end of its backward.

    Each step is traced on a few of the model's repeated blocks and laid out at its full depth
    (`remat.tracing.depth`: the same graph, byte for byte); `full_trace=True` traces every block.

    `workers`: the processes the rows' searches run in (`remat.answers.fit_workers`: the same
    answers as one process gives); None: `REMAT_WORKERS`, else one per core (Linux)."""
    import time

    if precision not in PRECISIONS:
        raise RematError(f"precision {precision!r}: choose one of {', '.join(PRECISIONS)}")
    if shard < 1:
        raise RematError(f"shard={shard}: the number of ranks must be at least 1")
    if shard * layout.cp == 1 and PRECISIONS[precision].master_scale != 1:
        raise RematError(
            f"precision {precision!r} is FSDP2's MixedPrecisionPolicy over sharded fp32 "
            "parameters: give the number of ranks (--shard 2 or more), or use bf16-mixed on one GPU"
        )
    if PRECISIONS[precision].float8 == "rowwise" and layout.tp > 1:
        raise RematError(
            "precision float8-rowwise with --tp: its per-row scales are not sharded over the "
            "tensor-parallel ranks here; leave out --tp, or use float8 / float8-tensorwise"
        )
    if compile is not None and layout.ranks > 1:
        raise RematError(
            f"compile={compile!r} is predicted on one rank: leave out --compile with --tp / --cp"
        )
    if compile == "whole" and shard > 1:
        raise RematError(
            "compile='whole' is predicted on one rank: drop --shard, or use --compile blocks "
            "(torchtitan's per-block compile under per-block FSDP)"
        )
    if fsdp_units and (shard * layout.cp == 1 or layout.pp > 1):
        raise RematError(
            "FSDP units outside the blocks (--fsdp-unit) are one rank's of FSDP2 without pipeline "
            "stages: give --shard 2 or more, and leave out --pp"
        )
    loop = loop or Loop()
    gradients = replace(loop, keep_logits=False)  # the loop's treatment of gradients
    if gradients.describe() and (shard * layout.ranks > 1 or compile == "whole"):
        raise RematError(
            f"{gradients.describe()} is predicted on one rank, eager or compiled by blocks: "
            "leave out --shard, --tp, --cp and --pp with it, and use --compile blocks or "
            "blocks+loss (a whole compiled graph returns every gradient at its end)"
        )
    if loop.keep_logits and (compile is not None or layout.pp > 1):
        raise RematError(
            "logits kept through backward (--keep-logits) is predicted on the eager step of a "
            "whole model: leave out --compile and --pp with it"
        )
    start = time.perf_counter()
    usable = _usable(gpu, shard * layout.ranks, reserve)
    if layout.pp > 1:
        if compile is not None:
            raise RematError(
                f"compile={compile!r} is predicted on one rank: leave it out with --pp"
            )
        if batch % layout.microbatches:
            raise RematError(
                f"batch {batch} does not split into {layout.microbatches} equal micro-batches: "
                f"give a batch that is a multiple of {layout.microbatches} (the batch is the "
                "step's, each micro-batch batch / microbatches, as remat.layouts.pipeline takes it)"
            )
        return _pipeline_fit(
            build, model, batch, seq, gpu, precision, optimizer, shard, usable,
            strategies_to_fit, layout, progress, start, simulate_allocator=reserve is None,
            replicate_depth=not full_trace,
        )  # fmt: skip
    steps = FitSteps(build, gpu, precision, optimizer, shard, progress, layout)
    steps.simulate_allocator = steps.simulate_allocator and reserve is None
    steps.loop = loop
    steps.replicate_depth = not full_trace
    steps.fsdp_units = tuple(fsdp_units)
    rows, traced = fit_rows(
        steps, list(strategies_to_fit), batch, seq, usable, max_batch, max_seq,
        default_workers() if workers is None else workers,
    )  # fmt: skip
    if compile is not None:
        rows.append(
            compiled_row(
                steps, compile, ac, batch, seq, usable, max_batch, max_seq, compiled_maxima
            )
        )
    extra: dict[str, Any] = {}
    depth = next((g.info["depth"] for g in steps.traced.values() if "depth" in g.info), None)
    if depth is not None:  # how the steps were traced (`remat.tracing.depth`)
        extra["depth"] = depth
    peaks = [r.peak_bytes for r in rows if r.peak_bytes is not None]
    if peaks and min(peaks) > usable:
        extra["ranks_to_fit"] = _ranks_to_fit(steps, batch, seq, usable)
    if build_for is not None and not any(r.fits for r in rows):
        asked = Setup(precision, optimizer, shard)
        found = setup_that_fits(
            build_for, batch=batch, seq=seq, gpu=gpu, asked=asked, reserve=reserve,
            progress=progress, traced={precision: steps.traced}, layout=layout,
            full_trace=full_trace, known={(precision, optimizer): steps}, fsdp_units=fsdp_units,
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
        traces=len(traced | set(steps.traced)),
        seconds=time.perf_counter() - start,
        extra=extra,
        allocator=_judged_by(steps),
        layout=layout.describe(steps.planner(batch, seq).graph),
        loop=loop.describe(),
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
    replicate_depth: bool = True,
) -> FitReport:
    """`fit` of a pipeline-parallel step (`remat.layouts.fit_pipeline`) of `batch` samples in
    `layout.microbatches` micro-batches: every figure the tightest rank's, each stage's in
    `extra["stages"]` (by strategy), `max_batch` the largest micro-batch and
    `extra["max_microbatches"]` the most micro-batches, by strategy."""
    import time

    from remat.layouts.fit_pipeline import pipeline_rows, stage_table
    from remat.prediction.gpu_memory import ALLOCATOR_SETTINGS

    setup = PRECISIONS[precision]
    microbatch = batch // layout.microbatches
    answer = pipeline_rows(
        build, layout=layout, gpu=gpu, autocast=setup.autocast, master_scale=setup.master_scale,
        optimizer=optimizer, shard=shard, microbatch=microbatch, seq=seq, usable=usable,
        strategies_to_fit=strategies_to_fit, progress=progress,
        simulate_allocator=simulate_allocator, replicate_depth=replicate_depth,
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
            "microbatch": microbatch,
            "max_microbatches": {r["strategy"]: r["max_microbatches"] for r in found},
            **({"layout_that_fits": found_layout} if found_layout else {}),
        },
        allocator=(
            "each rank's reserved bytes of the caching allocator "
            f"({ALLOCATOR_SETTINGS[0].describe()}) within its limit"
            if simulate_allocator
            else "live bytes within capacity - --reserve"
        ),
        layout=layout.describe(tp_plan=answer.tp_plan),
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
    full_trace: bool = False,
    known: dict[tuple[str, Optimizer], FitSteps] | None = None,
    fsdp_units: Sequence[FsdpUnit] = (),
) -> Setup | None:
    """The setup under which remat's plan of the step at (batch, seq) fits `gpu`, at the least
    cost: the fewest ranks first (GPUs cost more than time), then the least predicted step time,
    then the fewest changes from `asked`. Tried: the asked precision, bf16-mixed, bf16-fsdp
    (sharded only) and bf16; the asked optimizer and, for AdamW, 8-bit AdamW; the asked ranks and
    powers of two up to `max_ranks`. None when nothing up to `max_ranks` fits. `traced`:
    graphs already traced, by precision (the optimizer does not change the trace); `known`: steps
    already judged, by (precision, optimizer), whose planners and allocator walks serve again.
    `layout` (tensor and context parallelism) and `fsdp_units` stay as asked: only the
    data-parallel ranks vary."""
    traced = {} if traced is None else traced
    levels = [asked.shard, *(2**k for k in range(1, 11) if asked.shard < 2**k <= max_ranks)]
    precisions = list(dict.fromkeys([asked.precision, "bf16-mixed", "bf16-fsdp", "bf16"]))
    optimizers = list(dict.fromkeys([asked.optimizer, _LEANER_OPTIMIZER.get(asked.optimizer)]))
    combos: dict[tuple[str, Optimizer], FitSteps] = {}  # one per setup: planners are per rank count
    for precision in precisions:
        for optimizer in (o for o in optimizers if o is not None or asked.optimizer is None):
            steps = FitSteps(
                build_for(precision), gpu, precision, optimizer, asked.shard, progress, layout
            )
            steps.traced = traced.setdefault(precision, {})
            seen = (known or {}).get((precision, optimizer))
            if seen is not None and seen.traced is steps.traced:
                steps.planners, steps.memories = seen.planners, seen.memories
                steps.rank_peaks = seen.rank_peaks
            steps.simulate_allocator = reserve is None
            steps.replicate_depth = not full_trace
            steps.fsdp_units = tuple(fsdp_units)
            combos[(precision, optimizer)] = steps
    for ranks in levels:
        usable = _usable(gpu, ranks * layout.ranks, reserve)
        # the most a rank may hold: the allocator's limit where it judges, else `usable`
        limit = usable if reserve is not None else allocator_limit_bytes(gpu, ranks * layout.ranks)
        found = []
        for (precision, optimizer), steps in combos.items():
            if ranks == 1 and steps.setup.master_scale != 1:
                continue  # FSDP2's mixed precision needs sharded parameters
            steps.shard = ranks
            planner = steps.planner(batch, seq)
            if steps.held_at_every_size(batch, seq) > limit:
                continue  # parameters, gradients and optimizer state alone do not fit
            # Cheap first: where no fixed plan comes within 5% of the memory, auto's solvers
            # (which only mix those plans' choices per block) need not run.
            lowest = min(steps.rank_peak(planner, p) for p in steps.fixed_plans(planner))
            if lowest > 1.05 * usable:
                continue
            judged = judge_step(steps, "auto", batch, seq, usable, judged_only=True)
            if judged is None:
                return None  # no blocks to plan: no setup changes that
            peak, p, memories, row_usable, overhead = judged
            if fits_on(peak, memories, row_usable):
                found.append(Setup(precision, optimizer, ranks, p.strategy, overhead))
        if found:
            return min(found, key=lambda s: (round(s.overhead, 4), len(s.changes(asked))))
    return None


def _ranks_to_fit(steps: FitSteps, batch: int, seq: int, usable: int) -> int | None:
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
                f"The largest {'micro-batch' if 'microbatch' in report.extra else 'batch'} that "
                f"fits without recomputation is {store_all.max_batch}."
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
    best = advised(report)
    if best is not None:
        return (
            f"{row_name(best)} fits ({_held(best, usable)}) at "
            f"+{best.overhead:.1%} predicted step time: the cheapest plan that fits. Apply it "
            f"with `{best.apply}`"
            + (", then wrap with fully_shard as usual." if report.shard > 1 else "."),
        )
    lowest = min((r for r in report.rows if r.peak_bytes is not None), key=lambda r: r.peak_bytes)
    lines = [f"nothing fits: the lowest is {row_name(lowest)}, {_held(lowest, usable)}."]
    expandable = [r for r in report.rows if "expandable_segments:True" in r.note]
    if expandable:
        lines.append(
            f"{expandable[0].strategy} fits with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: "
            "the default allocator's fragmentation is what does not fit."
        )
    if auto is not None and auto.max_batch and "microbatch" not in report.extra:
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


def advised(report: FitReport) -> FitRow | None:
    """The row whose plan the advice applies: the cheapest that fits with recomputation, where
    neither store-all nor a compiled step fits without it; None otherwise."""
    rows = {r.strategy: r for r in report.rows}
    if rows.get("store_all") is not None and rows["store_all"].fits:
        return None
    if any(r.strategy.startswith("compile:") and r.fits for r in report.rows):
        return None
    fitting = [r for r in report.rows if r.fits and r.overhead is not None]
    return min(fitting, key=lambda r: r.overhead) if fitting else None


def row_name(row: FitRow) -> str:
    """A row as the table names it, with its plan where that is another strategy's: `auto
    (milp)`, `auto (selective:save-matmuls)`, `full`."""
    if row.plan == row.strategy or row.plan.startswith(row.strategy):
        return row.plan or row.strategy
    return f"{row.strategy} ({row.plan})"


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
