"""`remat fit --offload`: the plan with offload at full checkpointing's per-rank peak, against full
checkpointing itself, and the pinned host memory per rank it needs (docs/offload.md).

Full checkpointing is what a user who runs out of memory turns on first; the question offload
answers is whether the same peak can be had for less step time by moving some activations to host
memory instead of recomputing them. The plan is the MILP's with keep, recompute and offload per
block (`remat.planning.offload`), judged per rank as `remat fit` judges its rows (FSDP2's sharded
parameters, gradients and optimizer state: `remat.prediction.estimate.shard_step`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from remat.device.gpus import Gpu
from remat.device.host_link import MIN_OFFLOAD_BYTES
from remat.errors import InfeasibleBudget
from remat.planning.offload import OffloadSettings, plan_offload
from remat.planning.planner import Planner
from remat.planning.plans import Plan
from remat.prediction.estimate import shard_step
from remat.units import format_bytes


@dataclass(frozen=True)
class OffloadAnswer:
    """Full checkpointing's per-rank peak and added step time, and the offloading plan's at (or
    under) that peak: its added time (recompute + copies not hidden), host bytes per rank, the
    link its copies were priced on and the blocks it offloads."""

    full_peak_bytes: int
    full_added_seconds: float
    peak_bytes: int
    added_seconds: float
    transfer_seconds: float
    host_bytes: int
    host_budget_bytes: int | None
    link: str
    step_seconds: float
    plan: Plan

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in vars(self).items() if k != "plan"}
        return {**out, "offloaded_blocks": list(self.plan.offload), "strategy": self.plan.strategy}

    def _options(self) -> str:
        names = self.plan.details.get("options")
        return f" (blocks: {_count(names)})" if names else ""

    def lines(self) -> list[str]:
        """What `remat fit` prints under its table."""
        share = (lambda s: f"+{s / self.step_seconds:.1%}") if self.step_seconds else str
        cheaper = "below" if self.added_seconds < self.full_added_seconds else "not below"
        cap = format_bytes(self.host_budget_bytes) if self.host_budget_bytes else "no cap"
        return [
            f"offload at full checkpointing's peak ({format_bytes(self.full_peak_bytes)} per "
            f"rank): {self.plan.strategy} peaks at {format_bytes(self.peak_bytes)} for "
            f"{share(self.added_seconds)} step time, {cheaper} full's "
            f"{share(self.full_added_seconds)}; {len(self.plan.offload)} blocks offloaded"
            f"{self._options()}, "
            f"{format_bytes(self.host_bytes)} of pinned host memory per rank (cap {cap}), "
            f"{self.transfer_seconds * 1e3:.3g} ms of copies not hidden, on {self.link}",
        ]


def _count(names: list[str]) -> str:
    return ", ".join(f"{names.count(n)} {n}" for n in dict.fromkeys(names))


def rank_peak(
    judge: Planner, chooser: Planner, plan: Plan, shard: int, optimizer: Any, master_scale: int
) -> int:
    """`plan`'s per-rank peak with its offload and the optimizer's state and step (`judge`
    simulates with them; `chooser` made the plan), as `remat fit` judges its rows."""
    sim = judge.simulate(plan.regions, plan_offload(chooser, plan))
    sharded = shard_step(judge.graph, sim, shard, optimizer, master_scale)
    return max(max(sharded.timeline), sharded.optimizer_step_bytes)


def offload_at_full(
    planner: Planner,
    gpu: Gpu,
    *,
    shard: int,
    optimizer: Any,
    master_scale: int,
    host_memory_bytes: int | None = None,
    min_bytes: int = MIN_OFFLOAD_BYTES,
) -> OffloadAnswer:
    """The least-time plan with offload whose per-rank peak is at most full checkpointing's, on
    `gpu`'s host link with `host_memory_bytes` per rank (default: the GPU's memory)."""
    from remat.planning.solvers import milp
    from remat.planning.strategies.milp import attempt_of

    settings = OffloadSettings.for_profile(
        gpu.name, host_memory_bytes or gpu.capacity_bytes, min_bytes
    )
    graph = planner.graph
    offloading = Planner(graph, planner.profile, planner.optimizer, settings)
    store_all = offloading.simulate(())
    sharded = shard_step(graph, store_all, shard, optimizer, master_scale)
    # The block models read the per-rank timeline, shifted to the whole model's at the first op
    # (FSDP's saving on parameters and state is the same at every position), so that the MILP's
    # peak is the per-rank peak plus that shift.
    offset = store_all.timeline[0] - sharded.timeline[0]
    offloading.timeline_of = lambda sim: [
        t + offset for t in shard_step(graph, sim, shard, optimizer, master_scale).timeline
    ]

    def per_rank(p: Plan) -> int:
        return rank_peak(offloading, offloading, p, shard, optimizer, master_scale)

    full = offloading.plan("1TiB", "full")
    full_rank = per_rank(full)
    problem = offloading.block_problem()
    target, found = full_rank + offset, full
    for _ in range(6):  # the MILP's target, lowered by any per-rank excess of the exact judge
        try:
            answer = attempt_of(offloading, milp.milp(problem, target))
        except InfeasibleBudget:
            break
        candidate = offloading.plan_of(answer, "milp", None)
        excess = per_rank(candidate) - full_rank
        if excess <= 0:
            if candidate.added_seconds < found.added_seconds:
                found = candidate
            break
        target -= excess
    return OffloadAnswer(
        full_peak_bytes=full_rank,
        full_added_seconds=full.added_seconds,
        peak_bytes=per_rank(found),
        added_seconds=found.added_seconds,
        transfer_seconds=found.transfer_seconds,
        host_bytes=found.host_bytes,
        host_budget_bytes=settings.host_budget_bytes,
        link=settings.link_name,
        step_seconds=offloading.step_seconds,
        plan=found,
    )
