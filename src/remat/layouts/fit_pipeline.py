"""`remat fit --pp`: the fit of a pipeline-parallel step, per stage and per rank.

Each distinct stage is traced once for one micro-batch (middle stages of as many blocks once for
all) (`remat.layouts.pipeline_traced.TracedPipeline`, with the layout's tensor parallelism and
context-parallel sequence), and every strategy's rank peaks come from walks of torch's schedule
order over those traces: no strategy traces again. The largest micro-batch comes from a second
trace at twice the micro-batch (a rank's peak is affine in the micro-batch: activations grow with
it, parameters and state do not); the largest number of micro-batches from walks alone (the traces
do not change with it).

Judged as the rest of `fit` is: each rank's walk as allocation events through the caching
allocator (`remat.layouts.pipeline_traced.rank_events`, `remat.prediction.gpu_memory`), a row
fitting when every rank's reserved bytes do, and the searches run on live bytes within the
allocator's limit less the overhead it showed (or in live bytes within capacity less a user's
--reserve). FSDP2 as torchtitan runs it under pipelining (`remat.layouts.pipeline_walk.Sharding`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from remat.device.gpus import Gpu
from remat.errors import InfeasibleBudget, NoBlocksError, RematError
from remat.layouts.parallel import Layout, fake_ranks, laid_out
from remat.layouts.pipeline_traced import TracedPipeline
from remat.layouts.pipeline_walk import PipelineReport, Sharding
from remat.planning import strategies
from remat.planning.planner import Planner
from remat.prediction.estimate import Optimizer
from remat.units import format_bytes

#: The most micro-batches the search for the largest number tries.
MAX_MICROBATCHES = 1024


@dataclass(frozen=True)
class PipelineFit:
    """`pipeline_rows`' answer: a row per strategy (as `remat.answers.fit_rows.FitRow`'s fields,
    with `max_microbatches`), each strategy's per-stage report, the number of stage traces it
    took, and, when no row fits, `layout_that_fits`' answer (None: none found, or not searched)."""

    rows: list[dict[str, Any]]
    stages: dict[str, PipelineReport]
    traces: int
    layout_that_fits: dict[str, Any] | None
    #: the planner of the tightest rank's first stage (under auto, else the first row): the
    #: step a report draws
    planner: Planner | None = None
    #: per strategy, each rank's peak reserved bytes (empty: the allocator not simulated)
    reserved: dict[str, list[int]] = field(default_factory=dict)
    #: how the tensor-parallel plan laid the model out (`remat.layouts.parallel.laid_out`)
    tp_plan: tuple[str, bool] | None = None


def pipeline_rows(
    build: Callable[[int, int], tuple[Any, tuple[Any, ...]]],
    *,
    layout: Layout,
    gpu: Gpu,
    autocast: Any,
    master_scale: int,
    optimizer: Optimizer,
    shard: int,
    microbatch: int,
    seq: int,
    usable: int,
    strategies_to_fit: Iterable[str],
    progress: Callable[[str], None] | None,
    simulate_allocator: bool = True,
    replicate_depth: bool = True,
) -> PipelineFit:
    """Per strategy: the tightest rank's peak, whether every rank fits `usable` (by its reserved
    bytes where `simulate_allocator`, `RankMemory`), the predicted overhead of the slowest stage,
    the largest micro-batch and number of micro-batches, and each stage's prediction
    (`PipelineReport`), for micro-batches of `microbatch` samples."""
    sharding = Sharding(shard, master_scale)
    words: list[tuple[str, bool] | None] = []
    asked = _traced(build, layout, gpu, autocast, microbatch, seq, progress, words, replicate_depth)
    doubled = _traced(
        build, layout, gpu, autocast, 2 * microbatch, seq, progress, replicate_depth=replicate_depth
    )
    memory = RankMemory(gpu, optimizer, sharding, shard * layout.ranks, simulate_allocator)
    rows, stage_reports = [], {}
    reserved: dict[str, list[int]] = {}  # per strategy, each rank's (torch's default settings)
    for name in strategies_to_fit:
        plans = _plans(asked, name, gpu, optimizer, sharding, usable)
        if plans is None:
            continue
        if progress and simulate_allocator:
            progress(f"{name}: each rank's step through the caching allocator")
        memories = memory.of(asked, plans)
        budgets: list[int] | int = usable
        if name == "auto":
            plans, memories, budgets = _auto_by_allocator(asked, plans, memories, memory, usable)
        report = asked.report(plans, optimizer, sharding)
        twice = doubled.report(
            _same_plans(doubled, name, gpu, optimizer, plans), optimizer, sharding
        )
        overhead = _overhead(asked, plans, gpu, optimizer)
        # the searches run on each rank's live bytes, within what its allocator leaves them
        limits = memory.limits(memories, usable, len(asked.order))
        tightest = memory.tightest_rank(memories, report)
        rows.append(
            {
                "strategy": name,
                "peak_bytes": report.rank_peak_bytes[tightest],  # a row is one rank's
                "fits": memory.fits(memories, report, usable),
                "overhead": overhead,
                "gpu_memory": tuple(m.to_dict() for m in memories[tightest]) if memories else (),
                "max_batch": _largest_microbatch(microbatch, report, twice, limits),
                "max_microbatches": _largest_count(asked, report, limits, optimizer, sharding),
                "plan": "per stage: "
                + ", ".join(
                    f"{s.stage} {s.plan.strategy if s.plan else 'store_all'}" for s in report.stages
                ),
                "apply": _apply_line(name, layout, microbatch, seq, budgets, optimizer, gpu),
                "note": f"tightest: rank {tightest} (stage "
                + ", ".join(str(s.stage) for s in report.stages if s.rank == tightest)
                + (", by its reserved bytes)" if memories else ", by its live peak)"),
            }
        )
        stage_reports[name] = report
        reserved[name] = [rank[0].reserved_bytes for rank in memories]
    traces = sum(len({id(t.graph) for t in p.traced}) for p in (asked, doubled))
    found = None
    if not any(r["fits"] for r in rows):
        found = layout_that_fits(
            build, layout=layout, gpu=gpu, autocast=autocast, master_scale=master_scale,
            optimizer=optimizer, shard=shard, microbatch=microbatch, seq=seq, usable=usable,
            progress=progress, asked=asked, replicate_depth=replicate_depth,
        )  # fmt: skip
    shown = stage_reports.get("auto") or next(iter(stage_reports.values()), None)
    planner = None
    if shown is not None:
        planner = asked.planner(shown.tightest_stages[0], gpu.profile, optimizer)
    return PipelineFit(
        rows, stage_reports, traces, found, planner, reserved, next(iter(words), None)
    )


@dataclass(frozen=True)
class RankMemory:
    """Each rank's step as the GPU reports it (`TracedPipeline.gpu_memory`), under every
    allocator setting of `remat.prediction.gpu_memory.ALLOCATOR_SETTINGS` (torch's default first, the one
    a row is judged by); nothing where `simulate` is off (a --reserve given)."""

    gpu: Gpu
    optimizer: Optimizer
    sharding: Sharding
    ranks: int
    simulate: bool = True
    #: walks by (pipeline, rank, its stages' regions): a rank's events read only its own
    #: stages' regions, and auto's plans are often another row's on a rank (store-all's or
    #: full's), or its own before a retarget that changed other ranks' plans
    walked: dict[Any, tuple[TracedPipeline, list[Any]]] = field(
        default_factory=dict, compare=False, repr=False
    )

    def of(self, traced: TracedPipeline, plans: dict[int, Any]) -> list[list[Any]]:
        """Per rank, its memories under each setting."""
        if not self.simulate:
            return []
        out = []
        for rank in sorted(traced.order):
            mine = (t.stage.index for t in traced.traced if t.rank == rank)
            regions = tuple(() if plans.get(i) is None else plans[i].regions for i in mine)
            key = (id(traced), rank, regions)  # what `rank_events` reads of the plans
            if key not in self.walked or self.walked[key][0] is not traced:
                self.walked[key] = (traced, traced.gpu_memories(
                    rank, self.gpu, plans, self.optimizer, self.sharding, ranks=self.ranks
                ))  # fmt: skip
            out.append(list(self.walked[key][1]))
        return out

    def fits(self, memories: list[list[Any]], report: PipelineReport, usable: int) -> bool:
        if not memories:
            return report.peak_bytes <= usable
        return all(rank[0].fits for rank in memories)

    def tightest_rank(self, memories: list[list[Any]], report: PipelineReport) -> int:
        """The tightest rank, by what decides whether a row fits: under torch's default
        settings one that does not fit, else the one of most reserved bytes, ties going to the
        higher live peak (the column a row shows); by live bytes where the allocator is not
        simulated (`PipelineReport.tightest_rank`, as `remat.layouts.pipeline.predict` names it)."""
        if not memories:
            return report.tightest_rank
        return max(
            range(len(memories)),
            key=lambda r: (
                not memories[r][0].fits,
                memories[r][0].reserved_bytes,
                report.rank_peak_bytes[r],
            ),
        )

    def limits(self, memories: list[list[Any]], usable: int, ranks: int) -> list[int]:
        """Per rank, the live bytes it may reach and still fit: the allocator's limit less the
        BLAS workspaces and the overhead (reserved less requested) it showed on that rank."""
        if not memories:
            return [usable] * ranks
        return [rank[0].live_bytes_that_fit for rank in memories]


def _auto_by_allocator(
    traced: TracedPipeline,
    plans: dict[int, Any],
    memories: list[list[Any]],
    memory: RankMemory,
    usable: int,
) -> tuple[dict[int, Any], list[list[Any]], list[int] | int]:
    """auto's plans chosen again where a rank's reserved bytes do not fit though its live bytes
    do: each such rank planned within the live bytes its allocator leaves
    (`RankMemory.limits`), lowered a few times while it still does not fit. Returns the plans,
    their memories and the budgets (per rank) they were made at."""
    budgets = [usable] * len(traced.order)
    for _ in range(3):
        if not memories or all(rank[0].fits for rank in memories):
            break
        for r, rank in enumerate(memories):
            if not rank[0].fits:
                lower = rank[0].live_bytes_that_fit
                budgets[r] = lower if lower < budgets[r] else budgets[r] - rank[0].limit_bytes // 50
        try:
            report = traced.plan(budgets, memory.optimizer, memory.gpu.profile, memory.sharding)
        except RematError:
            break
        plans = {s.stage: s.plan for s in report.stages}
        memories = memory.of(traced, plans)
    return plans, memories, budgets if len(set(budgets)) > 1 else usable


def _traced(
    build: Callable[[int, int], tuple[Any, tuple[Any, ...]]],
    layout: Layout,
    gpu: Gpu,
    autocast: Any,
    size: int,
    seq: int,
    progress: Callable[[str], None] | None,
    words: list[tuple[str, bool] | None] | None = None,
    replicate_depth: bool = True,
) -> TracedPipeline:
    """The pipeline of `layout` traced at micro-batch `size`: the model laid out over its
    tensor-parallel ranks (on a fake process group) and context-parallel sequence, then cut;
    `words` gets how the tensor-parallel plan laid it out (`laid_out`); each stage's blocks
    replicated from a few (`remat.tracing.depth`) unless not `replicate_depth`."""

    def rank_build(b: int, s: int) -> tuple[Any, tuple[Any, ...]]:
        model, inputs = build(b, layout.local_seq(s))
        if layout.tp > 1:
            layout.lay_out(model)
            if words is not None:
                words.append(laid_out(model))
        return model, inputs

    if progress:
        progress(f"tracing {layout.pp} stages ({layout.describe()}) at micro-batch {size}")
    with fake_ranks(layout.tp) if layout.tp > 1 else contextlib.nullcontext():
        return TracedPipeline.of(
            rank_build,
            size * layout.microbatches,
            seq,
            stages=layout.stages,
            ranks=layout.pp,
            microbatches=layout.microbatches,
            schedule=layout.schedule,
            reuse_alike=True,
            target=gpu.target,
            autocast=autocast,
            replicate_depth=replicate_depth,
        )


def layout_that_fits(
    build: Callable[[int, int], tuple[Any, tuple[Any, ...]]],
    *,
    layout: Layout,
    gpu: Gpu,
    autocast: Any,
    master_scale: int,
    optimizer: Optimizer,
    shard: int,
    microbatch: int,
    seq: int,
    usable: int,
    progress: Callable[[str], None] | None,
    asked: TracedPipeline | None = None,
    replicate_depth: bool = True,
) -> dict[str, Any] | None:
    """When no plan fits the asked pipeline: a layout under which remat's plan (`auto`, per
    stage) fits every rank, at the fewest ranks, then the least predicted recompute. Tried: 1F1B
    instead of GPipe (the same ranks, and the `asked` traces if given: fewer micro-batches in
    flight), twice the stages, twice the tensor-parallel ranks. None when none of them fits."""
    sharding = Sharding(shard, master_scale)
    tries = []
    if layout.schedule == "gpipe":
        tries.append(
            replace(layout, schedule="1f1b", microbatches=max(layout.microbatches, layout.pp))
        )
    tries.append(
        replace(layout, pp=2 * layout.pp, microbatches=max(layout.microbatches, 2 * layout.pp))
    )
    tries.append(replace(layout, tp=2 * layout.tp))
    found = []
    for candidate in tries:
        try:
            if asked is not None and (candidate.tp, candidate.pp) == (layout.tp, layout.pp):
                traced = asked.with_microbatches(candidate.microbatches, candidate.schedule)
            else:
                traced = _traced(
                    build, candidate, gpu, autocast, microbatch, seq, progress,
                    replicate_depth=replicate_depth,
                )  # fmt: skip
            report = traced.plan(usable, optimizer, gpu.profile, sharding)
        except RematError:
            continue  # does not fit, or the model does not split so (heads, blocks)
        plans = {s.stage: s.plan for s in report.stages}
        found.append(
            {
                "layout": candidate.describe(),
                "tp": candidate.tp,
                "pp": candidate.pp,
                "microbatches": candidate.microbatches,
                "schedule": candidate.schedule,
                "peak_bytes": report.peak_bytes,
                "overhead": _overhead(traced, plans, gpu, optimizer),
            }
        )
    if not found:
        return None
    return min(found, key=lambda f: (f["tp"] * f["pp"], round(f["overhead"], 4)))


def _apply_line(
    name: str,
    layout: Layout,
    batch: int,
    seq: int,
    budget: int | Sequence[int],
    optimizer: Optimizer,
    gpu: Gpu,
) -> str:
    """What makes the row's plans: each rank applies its stage's plan (`remat.apply(stage,
    plan)`), made by `TracedPipeline.plan` at the rank budget (or each rank's) for `auto`, by
    the strategy's name otherwise."""
    if name == "auto":
        return (
            f"pipeline = remat.layouts.pipeline.TracedPipeline.of(build, {batch * layout.microbatches}, "
            f"{seq}, stages={layout.pp}, microbatches={layout.microbatches}, "
            f"schedule={layout.schedule!r}); plans = pipeline.plan({budget}, "
            f"optimizer={optimizer!r}, profile={gpu.profile!r}); on rank r, "
            "remat.apply(stage, plans.stages[r].plan)"
        )
    return f'on each rank, remat.auto(stage, *inputs, strategy="{name}", budget="100%")'


def _plans(
    traced: TracedPipeline,
    name: str,
    gpu: Gpu,
    optimizer: Optimizer,
    sharding: Sharding,
    usable: int,
) -> dict[int, Any] | None:
    """Each stage's plan under strategy `name`: none for store-all; `auto` fits every rank in
    `usable` at the least recompute (`TracedPipeline.plan`), else the plans of least peak; None
    when the model has no blocks for a per-block strategy."""
    if name == "store_all":
        return {}
    if name == "auto":
        try:
            report = traced.plan(usable, optimizer, gpu.profile, sharding)
        except InfeasibleBudget:
            return {
                t.stage.index: traced.planner(t.stage.index, gpu.profile, optimizer).lowest_peak()
                for t in traced.traced
            }
        return {s.stage: s.plan for s in report.stages}
    strategy = strategies.get(name, "eager")
    try:
        return {
            t.stage.index: (planner := traced.planner(t.stage.index, gpu.profile, optimizer)).solve(
                strategy, planner.estimate.peak_bytes
            )
            for t in traced.traced
        }
    except NoBlocksError:
        return None


def _same_plans(
    traced: TracedPipeline, name: str, gpu: Gpu, optimizer: Optimizer, plans: dict[int, Any]
) -> dict[int, Any]:
    """The plans of `plans`' strategies on `traced` (another micro-batch size): the same fixed
    strategy per stage (auto's choice of strategy kept, its budget re-solved by the strategy)."""
    out = {}
    for t in traced.traced:
        p = plans.get(t.stage.index)
        if p is None:
            continue
        planner = traced.planner(t.stage.index, gpu.profile, optimizer)
        chosen = p.strategy.removeprefix("auto (").rstrip(")") if name == "auto" else name
        try:
            out[t.stage.index] = planner.solve(
                strategies.get(chosen, "eager"), planner.estimate.peak_bytes
            )
        except (NoBlocksError, InfeasibleBudget, KeyError, ValueError):
            out[t.stage.index] = planner.lowest_peak()
    return out


def _overhead(
    traced: TracedPipeline, plans: dict[int, Any], gpu: Gpu, optimizer: Optimizer
) -> float:
    """The slowest stage's recompute as a share of its step: a pipeline runs at its slowest
    stage's pace."""
    worst = 0.0
    for t in traced.traced:
        p = plans.get(t.stage.index)
        step = traced.planner(t.stage.index, gpu.profile, optimizer).step_seconds
        if p is not None and step:
            worst = max(worst, p.recompute_seconds / step)
    return worst


def _largest_microbatch(
    batch: int, report: PipelineReport, twice: PipelineReport, limits: Sequence[int]
) -> int | None:
    """The largest micro-batch at which every rank fits its limit, on each rank's line through
    its peaks at `batch` and `2 * batch` (None: not even 1)."""
    largest = []
    for rank, limit in enumerate(limits):
        at_batch, at_twice = report.rank_peak_bytes[rank], twice.rank_peak_bytes[rank]
        per_sample = max(at_twice - at_batch, 1) / batch
        largest.append(int((limit - (at_batch - per_sample * batch)) // per_sample))
    return min(largest) if min(largest) >= 1 else None


def _largest_count(
    traced: TracedPipeline,
    report: PipelineReport,
    limits: Sequence[int],
    optimizer: Optimizer,
    sharding: Sharding,
) -> int | None:
    """The most micro-batches (up to `MAX_MICROBATCHES`) for which every rank still fits its
    limit: torch's order walked again for each count, over the same simulated stage steps."""
    steps = {s.stage: s.step for s in report.stages}

    def fits(count: int) -> bool:
        try:
            other = traced.with_microbatches(count)
        except RematError:  # torch refuses some counts (1F1B below its stage count)
            return False
        return all(
            other.rank_peak(rank, steps, optimizer, sharding) <= limits[rank]
            for rank in other.order
        )

    if not fits(traced.microbatches):
        return None
    low, high = traced.microbatches, traced.microbatches * 2
    while high <= MAX_MICROBATCHES and fits(high):
        low, high = high, high * 2
    high = min(high, MAX_MICROBATCHES + 1)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def stage_table(report: PipelineReport, reserved: Sequence[int] = ()) -> list[dict[str, str]]:
    """One row per stage, for the CLI and JSON; `reserved`: each rank's reserved bytes."""
    return [
        {
            "stage": str(s.stage),
            "rank": str(s.rank),
            "blocks": f"{s.layers.start}..{s.layers.stop - 1}" if len(s.layers) else "-",
            "in flight": str(s.in_flight),
            "held / micro-batch": format_bytes(s.held_bytes_per_microbatch),
            "fixed": format_bytes(s.fixed_bytes),
            "rank peak": format_bytes(s.peak_bytes),
            **({"rank reserved": format_bytes(reserved[s.rank])} if reserved else {}),
            "plan": s.plan.strategy if s.plan is not None else "store_all",
        }
        for s in report.stages
    ]
