"""Pipeline parallelism: cut a zoo model into stages, count what torch's schedules keep in flight,
and predict (and plan) each rank's peak from one traced micro-batch per stage.

The one-call answers are here (`predict`, `plan`, `largest_microbatch`), and every public name of
the modules that do the work, so that users import from `remat.layouts.pipeline` alone:
`pipeline_stages` cuts the model (`split`, `Stage`); `pipeline_schedules` reads torch's per-rank
orders (`pipeline_order`, `in_flight`); `pipeline_steps` traces one micro-batch per stage
(`StageStep`); `pipeline_walk` walks each rank's order to its peak (`Sharding`, `PipelineReport`);
`pipeline_events` makes a stage's actions allocation events; `pipeline_traced` holds the traced
pipeline that evaluates and plans them all (`TracedPipeline`, `rank_events`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from remat.layouts.pipeline_schedules import SCHEDULES, Action, in_flight, pipeline_order
from remat.layouts.pipeline_stages import Stage, split
from remat.layouts.pipeline_steps import StageStep
from remat.layouts.pipeline_traced import TracedPipeline, rank_events
from remat.layouts.pipeline_walk import UNSHARDED, PipelineReport, Sharding, StagePrediction
from remat.prediction.estimate import Optimizer
from remat.units import parse_bytes

__all__ = [
    "SCHEDULES",
    "Action",
    "PipelineReport",
    "Stage",
    "StagePrediction",
    "Sharding",
    "StageStep",
    "TracedPipeline",
    "UNSHARDED",
    "in_flight",
    "largest_microbatch",
    "pipeline_order",
    "plan",
    "predict",
    "rank_events",
    "split",
]


def predict(
    build: Callable[[int, int], tuple[nn.Module, tuple[Any, ...]]],
    batch: int,
    seq: int,
    *,
    stages: int,
    microbatches: int,
    schedule: str = "1f1b",
    ranks: int | None = None,
    optimizer: Optimizer = None,
) -> PipelineReport:
    """Each rank's and stage's peak for one pipeline step of a `batch` x `seq` batch, cut into
    `microbatches`, of the model `build(microbatch_size, seq)` returns with its `(input_ids,
    labels)` (on the meta device: nothing of the model's size is allocated), cut into `stages`
    by `split` and run by torch's `schedule` (`SCHEDULES`) on `ranks` ranks (default: one stage
    per rank). Store-all: `plan` predicts with recomputation."""
    traced = TracedPipeline.of(
        build, batch, seq, stages=stages, microbatches=microbatches, schedule=schedule, ranks=ranks
    )
    return traced.report(optimizer=optimizer)


def plan(
    build: Callable[[int, int], tuple[nn.Module, tuple[Any, ...]]],
    batch: int,
    seq: int,
    budget: int | str,
    *,
    stages: int,
    microbatches: int,
    schedule: str = "1f1b",
    ranks: int | None = None,
    optimizer: Optimizer = None,
    profile: str = "cpu",
) -> PipelineReport:
    """`predict`, with each stage planned so that its rank's peak fits `budget` bytes ("40GiB"):
    of the plans on the stage's frontier and the fixed strategies (`Planner.pareto`: store-all,
    full, selective; the frontier alone is judged by one micro-batch's peak, where what a plan
    holds per micro-batch in flight counts as much), the one of least recompute time whose rank
    peak, with the schedule's micro-batches in flight, fits. A stage that holds more
    micro-batches (the first, under 1F1B) gets less room per micro-batch, and so may recompute
    more. A rank of several stages (interleaved schedules) gets the combination of its stages'
    plans of least summed recompute that fits. Raises `InfeasibleBudget` naming the rank, its
    stages and the smallest budget its plans reach."""
    traced = TracedPipeline.of(
        build, batch, seq, stages=stages, microbatches=microbatches, schedule=schedule, ranks=ranks
    )
    return traced.plan(budget, optimizer, profile)


def largest_microbatch(
    build: Callable[[int, int], tuple[nn.Module, tuple[Any, ...]]],
    seq: int,
    budget: int | str,
    *,
    stages: int,
    microbatches: int,
    schedule: str = "1f1b",
    ranks: int | None = None,
    optimizer: Optimizer = None,
    limit: int = 1 << 16,
) -> PipelineReport | None:
    """The prediction (`predict`, store-all) of the largest micro-batch size, at most `limit`,
    whose every rank fits `budget` with `microbatches` of them (None: not even 1 fits): doubled,
    then bisected, as a rank's peak grows with the micro-batch."""
    budget_bytes = parse_bytes(budget)

    def at(size: int) -> PipelineReport:
        return predict(
            build,
            size * microbatches,
            seq,
            stages=stages,
            microbatches=microbatches,
            schedule=schedule,
            ranks=ranks,
            optimizer=optimizer,
        )

    best, low, high = None, 0, 1  # low fits (0: none known), high is the next size to try
    while high <= limit and (report := at(high)).peak_bytes <= budget_bytes:
        best, low, high = report, high, 2 * high
    high = min(high, limit + 1)  # the smallest size known not to fit (or past the limit)
    while high - low > 1:
        mid = (low + high) // 2
        report = at(mid)
        if report.peak_bytes <= budget_bytes:
            best, low = report, mid
        else:
            high = mid
    return best
