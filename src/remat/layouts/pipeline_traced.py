"""The traced pipeline: a pipeline step traced once, one micro-batch per stage, with torch's
order for its schedule (`TracedPipeline`), evaluated under any plans, sharding and optimizer by
each rank's walk (`report`), planned per rank (`plan`: a rank's stages together), and read as the
GPU reports it (`gpu_memories`) from the walk's allocation events (`rank_events`). `rank_events`
sits beside the class it reads and whose `gpu_memories` calls it: apart, the two modules would
import each other.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from remat.device.allocator import Alloc, AllocatorSettings, Free
from remat.device.gpus import Gpu
from remat.errors import InfeasibleBudget, RematError
from remat.layouts.pipeline_events import StageLives, optimizer_step_events, shard_sizes
from remat.layouts.pipeline_schedules import Action, in_flight, pipeline_order
from remat.layouts.pipeline_stages import split
from remat.layouts.pipeline_steps import StageStep, TracedStage, trace_stages
from remat.layouts.pipeline_walk import (
    UNSHARDED,
    PipelineReport,
    Sharding,
    StagePrediction,
    peak_of_rank,
    sent_counts,
    stage_fixed_bytes,
)
from remat.planning import strategies
from remat.planning.planner import Planner
from remat.planning.plans import Plan
from remat.prediction.estimate import Optimizer
from remat.prediction.gpu_memory import (
    ALLOCATOR_SETTINGS,
    Event,
    GpuMemory,
    blas_workspaces,
    memory_of_events,
)
from remat.units import format_bytes, parse_bytes


def rank_events(
    pipeline: TracedPipeline,
    rank: int,
    plans: dict[int, Plan | None],
    optimizer: Optimizer = None,
    sharding: Sharding = UNSHARDED,
    blas_workspaces: Sequence[int] = (),
    steps: int = 2,
) -> list[Event]:
    """The allocation events of `steps` pipeline steps on `rank` (its stages under `plans`), for
    `remat.prediction.gpu_memory`'s caching allocator: what the walk counts (`peak_of_rank`), as the blocks a
    rank allocates and frees in torch's order.

    Before the first step: each stage's parameters and buffers, its micro-batches' inputs
    (`PipelineStage`'s receive buffers), its gradient receive buffers and, under FSDP, its
    parameters' shards. Each step: every action's lives (`StageLives.action`), the sends the
    schedule keeps freed as `sent_counts` lets them go; after the schedule, the optimizer (its
    state on the first step, then its temporaries, all stages' at once as one optimizer over the
    rank's stages), then the gradients are dropped."""
    mine = [t for t in pipeline.traced if t.rank == rank]
    lives = {
        t.stage.index: StageLives.of(t, () if plans.get(t.stage.index) is None
                                      else plans[t.stage.index].regions)
        for t in mine
    }  # fmt: skip
    traced = {t.stage.index: t for t in mine}
    events: list[Event] = []
    for i, t in traced.items():
        graph = t.graph
        before = sorted(
            (s for s in graph.storages.values() if s.allocated_at is None and s.nbytes),
            key=lambda s: s.id,
        )
        events += [Alloc(("persistent", i, s.id), s.nbytes) for s in before]
        inputs = [s for s in before if s.kind in ("input", "constant")]  # as `input_bytes`
        events += [
            Alloc(("input", i, m, s.id), s.nbytes)
            for m in range(1, pipeline.microbatches)
            for s in inputs
        ]
        if t.output_bytes:
            events += [
                Alloc(("grad_recv", i, m), t.output_bytes) for m in range(pipeline.microbatches)
            ]
        if sharding.ranks > 1:
            events += [
                Alloc(("shard", i, sid), n) for sid, n in shard_sizes(graph, sharding).items() if n
            ]
    workspaces_made = not blas_workspaces
    for step in range(steps):
        in_flight = dict.fromkeys(traced, 0)
        done = dict.fromkeys(traced, 0)
        previous = dict.fromkeys(traced, "F")
        sent: dict[int, dict[str, list[Any]]] = {
            i: {"output": [], "input_grad": []} for i in traced
        }
        grads: list[Any] = []
        for a in pipeline.order[rank]:
            if a.kind == "B":
                in_flight[a.stage] -= 1
            for i in traced:  # the sends the schedule no longer keeps, oldest first
                steady = previous[i] == "F" or (i == a.stage and a.kind == "F")
                keep = dict(zip(("output", "input_grad"),
                                sent_counts(pipeline.schedule, done[i], pipeline.counts[i], steady),
                                strict=True))  # fmt: skip
                for role, queue in sent[i].items():
                    while len(queue) > keep[role]:
                        events.append(Free(queue.pop(0)))
            made: list[Event] = []
            if not workspaces_made and a.kind == "F":
                made = [Alloc(("blas", k), n) for k, n in enumerate(blas_workspaces)]
                workspaces_made = True
            # the n-th backward of a stage is its n-th forward's (torch's 1F1B numbers the last
            # rank's forwards from 1, its backwards from 0)
            microbatch = in_flight[a.stage] + done[a.stage] if a.kind == "F" else done[a.stage]
            sl = lives[a.stage]
            chosen = (
                sl.forward
                if a.kind == "F"
                else sl.later_backward
                if done[a.stage]
                else sl.first_backward
            )
            action, kept = chosen.of(step, a.stage, microbatch, made)
            events += action
            if a.kind == "F":
                in_flight[a.stage] += 1
            else:
                done[a.stage] += 1
                grads += kept.get("param_grad", [])
                for role in ("output", "input_grad"):
                    sent[a.stage][role] += kept.get(role, [])
            previous[a.stage] = a.kind
        events += [Free(key) for queues in sent.values() for q in queues.values() for key in q]
        events += optimizer_step_events(
            [(i, t.graph) for i, t in traced.items()], optimizer, step, sharding
        )
        events += [Free(key) for key in grads]  # zero_grad(set_to_none=True)
    return events


#: The most combinations of its stages' candidate plans `TracedPipeline.plan` walks for a rank.
_MAX_COMBINATIONS = 20_000


@dataclass
class TracedPipeline:
    """A pipeline step traced once (one micro-batch per stage) and torch's order for its schedule:
    `report` evaluates it under any plans, sharding and optimizer without tracing again, and
    `with_microbatches` under another number of micro-batches (the order is recomputed, the
    traces kept)."""

    traced: list[TracedStage]
    schedule: str
    microbatches: int
    microbatch_size: int
    ranks: int
    order: dict[int, list[Action]]
    counts: tuple[int, ...]
    #: planners by (graph, profile, optimizer), shared with `with_microbatches`' copies
    planners: dict[tuple[int, Any, Any], Planner] = field(default_factory=dict, repr=False)

    @classmethod
    def of(
        cls,
        build: Callable[[int, int], tuple[nn.Module, tuple[Any, ...]]],
        batch: int,
        seq: int,
        *,
        stages: int,
        microbatches: int,
        schedule: str = "1f1b",
        ranks: int | None = None,
        reuse_alike: bool = False,
        **trace_options: Any,
    ) -> TracedPipeline:
        """The model `build(batch / microbatches, seq)` returns, cut and traced stage by stage
        (`remat.trace` with `trace_options`: a target, an autocast dtype); `reuse_alike`: middle
        stages of as many blocks traced once (for figures, not for plans to apply)."""
        if batch % microbatches:
            raise RematError(
                f"batch {batch} does not split into {microbatches} equal micro-batches"
            )
        ranks = stages if ranks is None else ranks
        size = batch // microbatches
        order = pipeline_order(schedule, stages, microbatches, ranks)
        counts = in_flight(schedule, stages, microbatches, ranks)
        model, inputs = build(size, seq)
        ids, labels = _ids_and_labels(model, inputs)
        model.train()
        traced = trace_stages(
            split(model, stages, ids), ids, labels, ranks, trace_options, reuse_alike
        )
        return cls(traced, schedule, microbatches, size, ranks, order, counts)

    def with_microbatches(self, microbatches: int, schedule: str | None = None) -> TracedPipeline:
        """The same traces under `microbatches` micro-batches (and another one-stage-per-rank
        `schedule`, if given): torch's order again, nothing traced."""
        stages, schedule = len(self.traced), schedule or self.schedule
        return TracedPipeline(
            self.traced,
            schedule,
            microbatches,
            self.microbatch_size,
            self.ranks,
            pipeline_order(schedule, stages, microbatches, self.ranks),
            in_flight(schedule, stages, microbatches, self.ranks),
            self.planners,
        )

    def planner(self, stage: int, profile: Any = "cpu", optimizer: Optimizer = None) -> Planner:
        """The stage's planner, one per graph (stages traced alike share it)."""
        graph = self.traced[stage].graph
        key = (id(graph), profile, optimizer)
        if key not in self.planners:
            self.planners[key] = Planner(graph, profile, optimizer)
        return self.planners[key]

    def step(self, stage: int, plan: Plan | None, optimizer: Optimizer = None) -> StageStep:
        """The stage's one-micro-batch step simulated with `plan`'s regions (None: store-all)."""
        t = self.traced[stage]
        planner = self.planner(stage, optimizer=optimizer)
        regions = () if plan is None else plan.regions
        return StageStep.of(t.graph, planner.simulate(regions), planner.base_bytes, t.output_bytes)

    def rank_peak(
        self,
        rank: int,
        steps: dict[int, StageStep],
        optimizer: Optimizer = None,
        sharding: Sharding = UNSHARDED,
    ) -> int:
        """`rank`'s peak with its stages' `steps` (by stage index)."""
        mine = [t for t in self.traced if t.rank == rank]
        return peak_of_rank(
            mine,
            {t.stage.index: steps[t.stage.index] for t in mine},
            self.order[rank],
            self.schedule,
            self.counts,
            self.microbatches,
            optimizer,
            sharding,
        )

    def gpu_memories(
        self,
        rank: int,
        gpu: Gpu | str,
        plans: dict[int, Plan | None] | None = None,
        optimizer: Optimizer = None,
        sharding: Sharding = UNSHARDED,
        settings: Sequence[AllocatorSettings] = ALLOCATOR_SETTINGS,
        ranks: int | None = None,
    ) -> list[GpuMemory]:
        """`rank`'s step with `plans` (by stage; missing or None: store-all) as `gpu` reports it,
        under each of the allocator `settings` (`rank_events` through `remat.prediction.gpu_memory`);
        `ranks`: of the whole job, for NCCL's buffers (default: the pipeline's times the
        sharding's)."""
        ranks = self.ranks * sharding.ranks if ranks is None else ranks
        events = rank_events(self, rank, plans or {}, optimizer, sharding, blas_workspaces(gpu))
        return [memory_of_events(events, gpu, ranks, s) for s in settings]

    def report(
        self,
        plans: dict[int, Plan | None] | None = None,
        optimizer: Optimizer = None,
        sharding: Sharding = UNSHARDED,
    ) -> PipelineReport:
        """Every stage's and rank's prediction with `plans` (by stage index; missing or None:
        store-all)."""
        plans = {t.stage.index: (plans or {}).get(t.stage.index) for t in self.traced}
        steps = {i: self.step(i, p, optimizer) for i, p in plans.items()}
        rank_peaks = tuple(
            self.rank_peak(rank, steps, optimizer, sharding) for rank in sorted(self.order)
        )
        predictions = tuple(
            StagePrediction(
                stage=t.stage.index,
                rank=t.rank,
                layers=t.stage.layer_indices,
                in_flight=self.counts[t.stage.index],
                held_bytes_per_microbatch=steps[t.stage.index].held_bytes,
                fixed_bytes=stage_fixed_bytes(t, self.microbatches, optimizer, sharding),
                peak_bytes=rank_peaks[t.rank],
                step=steps[t.stage.index],
                plan=plans[t.stage.index],
            )
            for t in self.traced
        )
        return PipelineReport(
            self.schedule, self.microbatches, self.microbatch_size, predictions, rank_peaks
        )

    def plan(
        self,
        budget: int | str | Sequence[int],
        optimizer: Optimizer = None,
        profile: str | Any = "cpu",
        sharding: Sharding = UNSHARDED,
    ) -> PipelineReport:
        """Each stage planned so that its rank's peak fits `budget` (or `budget[rank]`, one per
        rank): see `plan`."""
        if isinstance(budget, (int, str)):
            budgets = [parse_bytes(budget)] * len(self.order)
        elif len(budget) == len(self.order):
            budgets = [parse_bytes(b) for b in budget]
        else:
            raise RematError(
                f"{len(budget)} budgets for {len(self.order)} ranks: give one per rank"
            )
        plans: dict[int, Plan | None] = {}
        frontiers: dict[int, list[Any]] = {}  # by graph: stages traced alike share theirs
        for rank in sorted(self.order):
            mine = [t for t in self.traced if t.rank == rank]
            plans.update(
                self._plan_rank(rank, mine, budgets[rank], optimizer, profile, sharding, frontiers)
            )
        return self.report(plans, optimizer, sharding)

    def _plan_rank(
        self,
        rank: int,
        mine: list[TracedStage],
        budget_bytes: int,
        optimizer: Optimizer,
        profile: str | Any,
        sharding: Sharding,
        frontiers: dict[int, list[Any]],
    ) -> dict[int, Plan]:
        """The plans of `rank`'s stages of least summed recompute (the rank runs them one after
        another) whose rank peak fits: store-all if it does; else the combinations of each
        stage's candidates (its frontier and the fixed strategies, `Planner.pareto`) in order of
        their summed recompute, the first that fits (one stage per rank: its candidates in
        order)."""
        planners = {t.stage.index: self.planner(t.stage.index, profile, optimizer) for t in mine}
        store_all = {
            i: p.solve(strategies.get("store_all"), p.estimate.peak_bytes)
            for i, p in planners.items()
        }
        steps = {i: self.step(i, None, optimizer) for i in planners}
        if self.rank_peak(rank, steps, optimizer, sharding) <= budget_bytes:
            return store_all  # no plan recomputes less (and no frontier is needed)
        candidates = []
        for t in mine:
            if id(t.graph) not in frontiers:
                frontier = planners[t.stage.index].pareto()
                frontiers[id(t.graph)] = sorted(
                    (*frontier.points, *frontier.named), key=lambda p: p.recompute_seconds
                )
            candidates.append(frontiers[id(t.graph)])
        # several stages a rank: the cheapest of each stage's candidates, at most ~20,000 pairs
        per_stage = max(2, int(_MAX_COMBINATIONS ** (1 / len(candidates))))
        candidates = [c[:per_stage] for c in candidates]
        stage_steps: dict[tuple[int, int], StageStep] = {}

        def step_of(t: TracedStage, k: int, p: Plan) -> StageStep:
            if (t.stage.index, k) not in stage_steps:
                planner = planners[t.stage.index]
                stage_steps[t.stage.index, k] = StageStep.of(
                    t.graph, planner.simulate(p.regions), planner.base_bytes, t.output_bytes
                )
            return stage_steps[t.stage.index, k]

        combos = sorted(
            itertools.product(*(range(len(c)) for c in candidates)),
            key=lambda ks: sum(c[k].recompute_seconds for c, k in zip(candidates, ks, strict=True)),
        )
        best = None
        for ks in combos:
            steps = {
                t.stage.index: step_of(t, k, c[k])
                for t, c, k in zip(mine, candidates, ks, strict=True)
            }
            peak = self.rank_peak(rank, steps, optimizer, sharding)
            if peak <= budget_bytes:
                return {t.stage.index: c[k] for t, c, k in zip(mine, candidates, ks, strict=True)}
            best = peak if best is None else min(best, peak)
        stages = ", ".join(
            f"{t.stage.index} ({self.counts[t.stage.index]} in flight)" for t in mine
        )
        raise InfeasibleBudget(
            f"rank {rank} (stage {stages}) peaks at {format_bytes(best)} at least, over the "
            f"budget of {format_bytes(budget_bytes)}",
            budget_bytes=budget_bytes,
            min_feasible_bytes=best,
        )


def _ids_and_labels(model: nn.Module, inputs: tuple[Any, ...]) -> tuple[Any, Any]:
    """The first stage's input and the last stage's labels: the two inputs the model was built
    with, or, for a language model built with its token ids alone (`hf:<model_type>`, whose
    one-process step sums the logits), those ids as labels, which a causal LM's loss shifts."""
    if len(inputs) == 2:
        return inputs
    if len(inputs) == 1 and not inputs[0].is_floating_point():
        return inputs[0], inputs[0]
    raise RematError(
        f"{type(model).__name__} was built with {len(inputs)} input(s) and no labels: a "
        "pipeline's last stage needs labels for its loss. Build it as (model, (inputs, labels)) "
        "in a 'pkg.module:factory', or use a shipped config (hf:<org>/<name>)"
    )
