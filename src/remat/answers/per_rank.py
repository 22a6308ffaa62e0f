"""One rank's view of a traced step, for a page whose every figure must be of the step the fit
table judges: under FSDP2 / ZeRO-3 over `shard` ranks, parameters, gradients and optimizer state
divided and the gathered ones added (`remat.prediction.estimate.shard_step`), activations as
traced. A planner plans the whole-model step; `RankView` turns its simulations, plans, frontier
and estimate into the rank's, and a rank's budget into the whole-model budget that plans it.

With one rank and nothing to scale, every figure is the planner's own, unchanged.
"""

from __future__ import annotations

from dataclasses import replace
from functools import cached_property

from remat.planning.planner import Comparison, Frontier, Planner
from remat.planning.plans import Plan
from remat.prediction.estimate import MemoryEstimate, estimate, shard_step
from remat.prediction.schedule import Region, Simulation


class RankView:
    """The figures of one rank of `shard` (FSDP2 data-parallel ranks) running `planner`'s step;
    `layout`: how else the step is laid out ("tp 8 + sp"), already in the traced graph."""

    def __init__(
        self, planner: Planner, shard: int = 1, master_scale: int = 1, layout: str = ""
    ) -> None:
        self.planner, self.shard, self.master_scale, self.layout = (
            planner,
            shard,
            master_scale,
            layout,
        )

    @property
    def sharded(self) -> bool:
        """Whether the rank's figures differ from the whole-model step's."""
        return self.shard > 1 or self.master_scale != 1

    def describe(self) -> str:
        """What every figure is, for a page's header; "" for one device."""
        parts = [f"FSDP2 over {self.shard} ranks"] if self.shard > 1 else []
        parts += [self.layout] if self.layout else []
        return f"per rank: {', '.join(parts)}" if parts else ""

    @cached_property
    def estimate(self) -> MemoryEstimate:
        """The store-all step of one rank (`estimate(..., shard=)`)."""
        if not self.sharded:
            return self.planner.estimate
        return estimate(self.planner.graph, self.planner.optimizer, self.shard, self.master_scale)

    @cached_property
    def base_bytes(self) -> int:
        """What is live on the rank before the step: its shards of parameters and optimizer
        state, buffers and inputs."""
        if not self.sharded:
            return self.planner.base_bytes
        sharded = self._shard(self.planner.simulate(()))
        whole = self.planner.estimate
        return (
            self.planner.base_bytes
            - (self.planner.graph.param_bytes - sharded.param_bytes)
            - (whole.optimizer_state_bytes - sharded.optimizer_state_bytes)
        )

    def _shard(self, sim: Simulation):
        return shard_step(
            self.planner.graph, sim, self.shard, self.planner.optimizer, self.master_scale
        )

    def simulate(self, regions: tuple[Region, ...]) -> Simulation:
        """The rank's live bytes over the step under `regions` (the optimizer step not in the
        timeline, as in the planner's)."""
        sim = self.planner.simulate(regions)
        if not self.sharded:
            return sim
        timeline = self._shard(sim).timeline
        peak = max(timeline, default=0)
        return replace(sim, timeline=timeline, peak_bytes=peak, peak_position=timeline.index(peak))

    def plan(self, p: Plan) -> Plan:
        """`p` with the rank's peak (its step or its optimizer step, the higher)."""
        if not self.sharded:
            return p
        sharded = self._shard(self.planner.simulate(p.regions))
        peak = max(max(sharded.timeline, default=0), sharded.optimizer_step_bytes)
        return replace(p, predicted_peak_bytes=peak)

    def frontier(self, frontier: Frontier) -> Frontier:
        return Frontier(
            points=tuple(self.plan(p) for p in frontier.points),
            named=tuple(self.plan(p) for p in frontier.named),
        )

    def compare(self, rows: list[Comparison]) -> list[Comparison]:
        return [replace(c, plan=None if c.plan is None else self.plan(c.plan)) for c in rows]

    def whole_budget(self, rank_budget: int) -> int:
        """The whole-model budget the planner plans a rank's `rank_budget` at: moved by what
        sharding saves on store-all's step (as `remat.answers.fit_steps.FitSteps.auto` moves it)."""
        if not self.sharded:
            return rank_budget
        store_all = self.planner.estimate.peak_bytes
        return rank_budget + store_all - self.estimate.peak_bytes
