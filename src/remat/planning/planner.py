"""`remat.Planner`: what to keep and what to recompute under a budget, by a named strategy.

The strategies (`remat.planning.strategies`, one file each) are pure functions of a `Planner`;
the solvers they call (`remat.planning.solvers`) work on small models of the step (a chain of
blocks, per-block options, the joint graph). The planner turns a traced `Graph` into those models
and their answers back into checkpoint regions, and judges every answer by one exact simulation
(`remat.prediction.schedule.simulate`): a plan's predicted peak is what `remat.apply` will run.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import TYPE_CHECKING, Any, Literal

from remat.device.cost import (
    DeviceProfile,
    checkpoint_overhead_seconds,
    get_profile,
    op_seconds_all,
)
from remat.errors import (
    InfeasibleBudget,
    NoBlocksError,
    RematError,
    StrategyRefused,
    UnknownStrategyError,
)
from remat.graph import Graph, Op
from remat.planning import offload as offloading
from remat.planning.blocks import (
    BlockMetrics,
    Carry,
    block_seconds,
    carry,
    deciding_blocks,
    ladder_sizes,
    maker_blocks,
    measure,
    replay_reach,
)
from remat.planning.plans import (
    DEFAULT_BUDGET,
    Plan,
    PlanStatus,
    build_plan,
    overhead_share,
    resolve_budget,
)
from remat.planning.solvers import chain as chain_model
from remat.planning.solvers.selective import POLICIES, dearest_first, keep_of, keepable
from remat.prediction.estimate import MemoryEstimate, Optimizer, estimate, optimizer_step_bytes
from remat.prediction.schedule import Region, Simulation, analyse_regions, make_region, simulate
from remat.units import format_bytes

if TYPE_CHECKING:
    from remat.planning.joint import JointContext
    from remat.planning.solvers.saveset import SaveSet

#: What a block can be in the per-block models: stored, checkpointed, or selectively checkpointed.
BLOCK_OPTIONS = ("store", "full", *(f"selective:{p}" for p in POLICIES))
#: The keep ladder's options (`Planner.block_options`): their prefix, and how many at most.
DEAREST, LADDER = "dearest-", 6


PlanPath = Literal["eager", "compile"]


@dataclass(frozen=True)
class Strategy:
    """A named way to choose what to keep.

    `budgeted`: it searches for the cheapest plan under the budget (a fixed strategy gives the same
    plan at every budget, and is judged against it afterwards). `needs_blocks`: it checkpoints the
    model's repeated blocks, so it needs some. `appliable`: `remat.apply` can run its eager plans
    (`store_none` is a reference point with no flat-region form). `lowest_peak`: the plan with the
    lowest peak it can make, for a budgeted strategy that has one (fixed strategies have one plan).
    `rank` orders tables and help."""

    name: str
    summary: str
    solve: Callable[[Planner, int], Plan] | None = None
    solve_compiled: Callable[[JointContext, int | None], SaveSet] | None = None
    budgeted: bool = False
    needs_blocks: bool = False
    appliable: bool = True
    lowest_peak: Callable[[Planner], Plan] | None = None
    rank: int = 50

    @property
    def paths(self) -> tuple[PlanPath, ...]:
        """Where it plans: the eager step, inside torch.compile, or both."""
        eager: tuple[PlanPath, ...] = ("eager",) if self.solve else ()
        return eager + (("compile",) if self.solve_compiled else ())


_REGISTRY: dict[str, Strategy] = {}
_discovered = False


def register(strategy: Strategy) -> Strategy:
    """Make `strategy` available by its name everywhere (replacing one of the same name)."""
    if not strategy.solve and not strategy.solve_compiled:
        raise RematError(f"strategy {strategy.name!r} has neither solve nor solve_compiled")
    _REGISTRY[strategy.name] = strategy
    return strategy


def unregister(name: str) -> None:
    """Remove the strategy called `name` (a no-op when there is none)."""
    _REGISTRY.pop(name, None)


def _discover() -> None:
    """Import every module of `remat.planning.strategies` once: each registers its strategy."""
    global _discovered
    if not _discovered:
        _discovered = True
        package = importlib.import_module("remat.planning.strategies")
        for info in pkgutil.iter_modules(package.__path__):
            importlib.import_module(f"{package.__name__}.{info.name}")


def available(path: PlanPath | None = None) -> list[Strategy]:
    """Every registered strategy (those supporting `path`, if given), in table order."""
    _discover()
    found = [s for s in _REGISTRY.values() if path is None or path in s.paths]
    return sorted(found, key=lambda s: (s.rank, s.name))


def get(name: str, path: PlanPath | None = None) -> Strategy:
    """The strategy called `name`; `UnknownStrategyError` naming the choices when there is none
    (for that path)."""
    _discover()
    strategy = _REGISTRY.get(name)
    if strategy is None or (path is not None and path not in strategy.paths):
        choices = tuple(s.name for s in available(path))
        what = f"has no {path} path" if strategy else "is unknown"
        raise UnknownStrategyError(
            f"strategy {name!r} {what}: choose one of {', '.join(choices)}",
            name=name,
            choices=choices,
        )
    return strategy


@dataclass(frozen=True)
class Attempt:
    """One answer of a model-based solver, for `Planner.fit` to judge: the regions, why, how sure
    the solver is, and solver-specific figures for the plan's `details`."""

    regions: tuple[Region, ...]
    reason: str
    status: PlanStatus = "optimal"
    details: dict[str, Any] = field(default_factory=dict)
    offload: tuple[int, ...] = ()  # indices of the blocks whose saves go to host memory
    #: a stored block that offloads only some: its path -> their places in its save order
    offload_saves: dict[str, tuple[int, ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class Comparison:
    """One row of `Planner.compare`: the strategy's plan at the budget, or None and why not."""

    strategy: str
    plan: Plan | None
    note: str

    def __repr__(self) -> str:
        if self.plan is None:
            return f"Comparison({self.strategy}: {self.note})"
        p = self.plan
        return (
            f"Comparison({self.strategy}: peak {format_bytes(p.predicted_peak_bytes)}, "
            f"+{p.recompute_seconds * 1e3:.3g} ms recompute, {self.note})"
        )


@dataclass(frozen=True)
class Frontier:
    """Plans along the budget axis: `points` are the non-dominated (peak, recompute seconds) of
    `auto` over budgets; `named` is where each fixed strategy falls."""

    points: tuple[Plan, ...]
    named: tuple[Plan, ...]

    def __repr__(self) -> str:
        if not self.points:
            return "Frontier(no points)"
        low, high = self.points[0], self.points[-1]
        return (
            f"Frontier({len(self.points)} points from {format_bytes(low.predicted_peak_bytes)} "
            f"at +{low.recompute_seconds * 1e3:.3g} ms to {format_bytes(high.predicted_peak_bytes)} "
            f"at +{high.recompute_seconds * 1e3:.3g} ms; named: "
            f"{', '.join(p.strategy for p in self.named)})"
        )


class Planner:
    """A traced step prepared for planning: costs on `profile`, fixed memory, blocks, and the
    per-block models, computed once and shared by every plan asked of it.

    Users call `plan`, `compare`, `pareto` and `lowest_peak`. Strategy authors also use
    `make_plan`, `every_block`, `block_regions`, `fit`, `chain` and `block_problem`."""

    def __init__(
        self,
        graph: Graph,
        profile: str | DeviceProfile = "cpu",
        optimizer: Optimizer = None,
        offload: offloading.OffloadSettings | None = None,
    ) -> None:
        #: offload as a block option of the MILP (None: keep and recompute only)
        self.offload = offload
        #: the timeline the block models read from a simulation (`remat fit --offload`: per rank)
        self.timeline_of: Callable[[Simulation], Sequence[int]] = lambda sim: sim.timeline
        self.graph = graph
        self.profile = get_profile(profile)
        self.optimizer = optimizer
        self.estimate: MemoryEstimate = estimate(graph, optimizer=optimizer)
        self.op_seconds = op_seconds_all(graph, self.profile)
        persistent = sum(s.nbytes for s in graph.storages.values() if s.allocated_at is None)
        #: Live before the step: parameters, buffers, inputs, optimizer state.
        self.base_bytes = persistent + self.estimate.optimizer_state_bytes
        rerun = graph.info.get("rerun_in_backward", ())
        #: Reversible blocks: a custom Function's backward runs their modules again (RevNets,
        #: Reformer), so they recompute their own forward already; a region over one would
        #: recompute it twice and free nothing their Function keeps. They are not offered.
        self.reversible_blocks: list[str] = [
            b.path
            for b in graph.blocks
            if any(m == b.path or m.startswith(b.path + ".") for m in rerun)
        ]
        self.blocks = [b for b in graph.blocks if b.path not in self.reversible_blocks]
        self._frontiers: dict[int, Frontier] = {}
        self._lowest: Plan | None = None
        self._solved: dict[tuple[Strategy, int], Plan | InfeasibleBudget] = {}
        #: `make_plan`'s plans by (regions, offloaded blocks): the rest of a call only labels it
        self._judged: dict[tuple[tuple[Region, ...], tuple[int, ...]], Plan] = {}

    # -- the user's API ------------------------------------------------------------------------
    @property
    def step_seconds(self) -> float:
        """The predicted time of the step's ops without recomputation, on the profile."""
        return sum(self.op_seconds)

    def budget_bytes(self, budget: int | str) -> int:
        """Bytes from `40GiB`, `123`, `50%` (the fixed memory plus that share of the rest of
        store-all's peak) or `+10%` (the lowest peak on the frontier whose predicted recompute is
        at most 10% of the step's time: `within_overhead`)."""
        share = overhead_share(budget)
        if share is not None:
            return self.within_overhead(share).predicted_peak_bytes
        return resolve_budget(budget, self.estimate.fixed_bytes, self.estimate.peak_bytes)

    def within_overhead(self, share: float) -> Plan:
        """The plan of lowest peak on the frontier whose predicted recompute time is at most
        `share` of the step's (store-all qualifies at any share)."""
        limit = share * self.step_seconds * (1 + 1e-9)
        fits = [p for p in self.pareto().points if p.added_seconds <= limit]
        return min(fits, key=lambda p: (p.predicted_peak_bytes, p.added_seconds))

    def plan(self, budget: int | str = DEFAULT_BUDGET, strategy: str = "auto") -> Plan:
        """The plan of `strategy` under `budget`. Raises `InfeasibleBudget` naming the smallest
        budget that fits when the plan's predicted peak exceeds the budget."""
        chosen = get(strategy, "eager")
        budget_bytes = self.budget_bytes(budget)
        share = overhead_share(budget)
        try:
            p = self.solve(chosen, budget_bytes)
        except InfeasibleBudget:
            if strategy != "auto" or share is None:
                raise
            # A time budget is the peak of a plan on the frontier, which fits it; a budgeted
            # solver need not answer at that tighter budget as it did where the frontier asked.
            p = replace(self.within_overhead(share), budget_bytes=budget_bytes)
        if p.predicted_peak_bytes > budget_bytes:
            raise InfeasibleBudget(
                f"strategy {strategy} predicts a peak of {format_bytes(p.predicted_peak_bytes)}, "
                f"over the budget of {format_bytes(budget_bytes)}: the smallest budget it fits is "
                f"{format_bytes(p.predicted_peak_bytes)} (strategy auto picks among all)",
                budget_bytes=budget_bytes,
                min_feasible_bytes=p.predicted_peak_bytes,
            )
        return p

    def compare(self, budget: int | str = DEFAULT_BUDGET) -> list[Comparison]:
        """Every eager strategy but auto at this budget, fitting or not, for a side-by-side table."""
        budget_bytes = self.budget_bytes(budget)
        rows = []
        for s in available("eager"):
            if s.name == "auto":
                continue
            try:
                p = self.solve(s, budget_bytes)
            except InfeasibleBudget as e:
                rows.append(Comparison(s.name, None, str(e).split(";")[0]))
                continue
            except NoBlocksError:
                rows.append(Comparison(s.name, None, "needs repeated blocks; the model has none"))
                continue
            note = "fits" if p.predicted_peak_bytes <= budget_bytes else "over budget"
            if not p.appliable:
                note += " (reference only: not appliable)"
            rows.append(Comparison(s.name, p, note))
        return rows

    def lowest_peak(self) -> Plan:
        """The plan with the lowest simulated peak that remat can apply: the best of the fixed
        strategies and of the budgeted ones' lowest-peak plans. Its peak is the smallest budget
        `auto` accepts. Found once (each budgeted strategy simulates a plan per block count)."""
        if self._lowest is not None:
            return self._lowest
        plans = []
        for s in available("eager"):
            if not s.appliable or (s.needs_blocks and not self.blocks):
                continue
            try:
                if s.lowest_peak is not None:
                    plans.append(self._runs_with_skipped_blocks(s.lowest_peak(self)))
                elif not s.budgeted:
                    plans.append(self.solve(s, 0))
            except RematError:  # a strategy that refuses this step: the others still answer
                continue
        self._lowest = min(plans, key=lambda p: (p.predicted_peak_bytes, p.added_seconds))
        return self._lowest

    def pareto(self, steps: int = 16) -> Frontier:
        """The frontier of (predicted peak, recompute seconds) over `steps` budgets from the lowest
        feasible peak to store-all's, planned by `auto`, and the fixed strategies for comparison.
        Computed once per `steps` for this planner."""
        if steps in self._frontiers:
            return self._frontiers[steps]
        low = self.lowest_peak().predicted_peak_bytes
        high = self.estimate.peak_bytes
        auto = get("auto")
        plans = []
        for k in range(steps):
            try:
                plans.append(self.solve(auto, int(low + (high - low) * k / max(steps - 1, 1))))
            except InfeasibleBudget:
                continue
        named = []
        for s in available("eager"):
            if s.budgeted or not s.appliable or (s.needs_blocks and not self.blocks):
                continue
            try:
                named.append(self.solve(s, high))
            except RematError:  # a fixed strategy that refuses this step (LayerDrop and sqrt)
                continue
        frontier, best = [], None
        for p in sorted([*plans, *named], key=lambda p: (p.predicted_peak_bytes, p.added_seconds)):
            if best is None or p.added_seconds < best - 1e-15:
                frontier.append(p)
                best = p.added_seconds
        self._frontiers[steps] = Frontier(points=tuple(frontier), named=tuple(named))
        return self._frontiers[steps]

    def solve(self, strategy: Strategy, budget_bytes: int) -> Plan:
        """`strategy`'s eager plan at `budget_bytes`, which may not fit (`plan` checks). Solved
        once per strategy and budget: `compare` then `plan`, or `auto` inside `pareto`, reuse it."""
        key = (strategy, budget_bytes)
        if key not in self._solved:
            try:
                self._solved[key] = self._solve(strategy, budget_bytes)
            except InfeasibleBudget as e:
                self._solved[key] = e
        found = self._solved[key]
        if isinstance(found, InfeasibleBudget):
            raise found
        return found

    def _solve(self, strategy: Strategy, budget_bytes: int) -> Plan:
        if strategy.solve is None:
            raise RematError(
                f"strategy {strategy.name!r} decides only inside torch.compile: use remat.compile"
            )
        if strategy.needs_blocks and not self.blocks and self.reversible_blocks:
            raise NoBlocksError(
                f"strategy {strategy.name!r} checkpoints repeated blocks, and this model's "
                f"blocks ({', '.join(self.reversible_blocks[:3])}, ...) are reversible: their "
                "custom autograd Function recomputes them in backward already, so a checkpoint "
                "region would recompute them twice and free nothing. Use strategy store_all "
                "(or auto)",
                strategy=strategy.name,
            )
        if strategy.needs_blocks and not self.blocks:
            raise NoBlocksError(
                f"strategy {strategy.name!r} checkpoints repeated blocks, and this model has none "
                "(no numbered submodules such as layers.0, layers.1): use strategy mincut or "
                "store_all",
                strategy=strategy.name,
            )
        return self._runs_with_skipped_blocks(strategy.solve(self, budget_bytes))

    def _runs_with_skipped_blocks(self, plan: Plan) -> Plan:
        """`plan`, or InfeasibleBudget where the step skips blocks at random (LayerDrop: the
        trace's `random_control`) and a region spans several blocks: the region's first block
        runs them all, so a skipped first block would skip them all, a skipped later one run."""
        if "random_control" not in self.graph.info:
            return plan
        runs = [r.modules for r in plan.regions if len(r.modules) > 1]
        if not runs:
            return plan
        raise StrategyRefused(
            f"strategy {plan.strategy!r} checkpoints runs of several blocks ({', '.join(runs[0])}), "
            "and this step skips blocks at random (LayerDrop): a run cannot skip one of its "
            "blocks. Use a strategy whose regions hold one block (full, selective, milp, auto)",
            strategy=plan.strategy,
            budget_bytes=plan.budget_bytes or 0,
        )

    # -- the strategy author's API -------------------------------------------------------------
    @cached_property
    def optimizer_step_peak(self) -> int:
        """The optimizer step runs after every activation is gone: the same for every plan, and
        the peak of a plan whose activations peak lower (before 0.5 it was counted only where it
        was store-all's peak, so a checkpointed plan could be predicted under its step's bytes)."""
        if self.optimizer is None:
            return 0
        return optimizer_step_bytes(self.graph, self.simulate(()), self.optimizer)

    def simulate(self, regions: tuple[Region, ...], offload=None) -> Simulation:
        return simulate(self.graph, regions, base_bytes=self.base_bytes, offload=offload)

    @cached_property
    def offload_costs(self) -> dict[str, list[offloading.OffloadCost]]:
        """Per offload option and block, what its copies cost (`offload.costs_of`)."""
        return offloading.costs_of(self)

    def region_overheads(self, regions: tuple[Region, ...]) -> list[float]:
        """What checkpointing itself costs per region on the profile (beyond the ops it
        recomputes): `region_seconds` each, plus `policy_op_seconds` for every op a selective
        region runs under its policy, in the forward and in the replay up to its early stop."""
        if not regions or not (self.profile.region_seconds or self.profile.policy_op_seconds):
            return [0.0] * len(regions)
        if not any(r.keep_keys for r in regions):  # no op runs under a policy: no analysis
            return [checkpoint_overhead_seconds(self.profile, 1, 0)] * len(regions)
        out = []
        for replay in analyse_regions(self.graph, regions).replays:
            r = replay.region
            policy_ops = 0
            if r.keep_keys:
                policy_ops = r.last_op - r.first_op + 1
                if replay.trigger is not None and replay.stop_at is not None:
                    policy_ops += replay.stop_at - r.first_op + 1
            out.append(checkpoint_overhead_seconds(self.profile, 1, policy_ops))
        return out

    def plan_of(
        self,
        found: Attempt,
        strategy: str,
        budget_bytes: int | None,
        status: PlanStatus | None = None,
    ) -> Plan:
        """A solver's answer judged by the exact simulation (`make_plan`), as `strategy`'s plan;
        `status` overrides the solver's own (a retry's answer is only "feasible")."""
        return self.make_plan(
            found.regions,
            strategy,
            budget_bytes,
            found.reason,
            status=status or found.status,
            offload_blocks=found.offload,
            offload_saves=found.offload_saves,
            **found.details,
        )

    def make_plan(
        self,
        regions: tuple[Region, ...],
        strategy: str,
        budget_bytes: int | None,
        reason: str,
        *,
        status: PlanStatus = "fixed",
        appliable: bool = True,
        offload_blocks: tuple[int, ...] = (),
        offload_saves: dict[str, tuple[int, ...]] | None = None,
        **details: Any,
    ) -> Plan:
        """The plan of `regions` (and of `offload_blocks`' saves on the host), judged by the exact
        simulation; its recompute time includes what checkpointing itself costs on the profile
        (`region_overheads`), its `transfer_seconds` the copies no compute hides."""
        if offload_blocks:
            details = {**details, "host_link": offloading.settings_of(self).link_name}
        saves = tuple(sorted((offload_saves or {}).items()))
        key = (tuple(regions), tuple(offload_blocks), saves)
        if key not in self._judged:  # the same regions again (first_k per budget, retries)
            offload = (
                offloading.choose(self, regions, offload_blocks, chosen=offload_saves)
                if offload_blocks
                else None
            )
            self._judged[key] = build_plan(
                self.graph, regions, strategy=strategy, budget_bytes=budget_bytes,
                op_seconds=self.op_seconds, base_bytes=self.base_bytes,
                profile=self.profile.name, reason=reason,
                overhead_seconds=sum(self.region_overheads(regions)), offload=offload,
            )  # fmt: skip
        judged = self._judged[key]
        p = replace(
            judged, regions=regions, strategy=strategy, budget_bytes=budget_bytes, reason=reason,
            status=status, appliable=appliable, details=details or {},
            held_by_module=dict(judged.held_by_module),
        )  # fmt: skip
        if self.optimizer is not None:
            without = judged.predicted_peak_bytes - self.estimate.optimizer_state_bytes
            peak = max(judged.predicted_peak_bytes, self.optimizer_step_peak)
            p = replace(p, predicted_peak_bytes=peak, optimizer_bytes=peak - without)
        return p

    @cached_property
    def links(self) -> list[Carry | None]:
        """How block b+1 takes block b's output where one region can run both (`carry`), else
        None (an encoder's last layer and a decoder's first are not chained)."""
        return [c if isinstance(c, tuple) else None for c in self._carries]

    @cached_property
    def chain_breaks(self) -> dict[str, str]:
        """Why no region runs block b and b+1 together, by "b .. b+1" (module paths): what a
        segment a strategy asked for is split at, so that it never fails at step time."""
        return {
            f"{a.path} .. {b.path}": c
            for a, b, c in zip(self.blocks, self.blocks[1:], self._carries, strict=False)
            if isinstance(c, str)
        }

    @cached_property
    def _carries(self) -> list[Carry | str]:
        return [carry(a, b) for a, b in zip(self.blocks, self.blocks[1:], strict=False)]

    @property
    def chained(self) -> list[bool]:
        """Whether block b+1 continues block b so that one region can run both."""
        return [link is not None for link in self.links]

    def every_block(self, option: str = "full") -> tuple[Region, ...]:
        """One region per block, checkpointed with `option` (`full` or `selective:<policy>`)."""
        return self.block_regions([[b] for b in range(len(self.blocks))], option)

    def block_regions(self, groups: list[list[int]], option: str = "full") -> tuple[Region, ...]:
        """One region per group of consecutive block indices, checkpointed with `option`; a group
        is split where the chain breaks, or where its blocks pass the chained tensor differently
        (a region hands it on one way)."""
        split = []
        for group in groups:
            split.append([group[0]])
            for b in group[1:]:
                link = self.links[b - 1]
                if link is not None and link == self.links[split[-1][0]]:
                    split[-1].append(b)
                else:
                    split.append([b])
        out = []
        for group in split:
            first, last = self.blocks[group[0]], self.blocks[group[-1]]
            name = option.removeprefix("selective:")
            keep = self.policy_keep(name, first.first_op, last.last_op) if name != option else set()
            modules = tuple(self.blocks[i].path for i in group)
            link = self.links[group[0]] if len(group) > 1 else None
            region = make_region(self.graph, modules, first.first_op, last.last_op, keep)
            if link is not None:
                region = replace(region, carry_output=link[0], carry_argument=link[1])
            out.append(region)
        return tuple(out)

    def policy_keep(self, name: str, first_op: int, last_op: int) -> set[str]:
        """What a region over `first_op..last_op` keeps under `selective:<name>`: a policy's ops
        or the keep ladder's first n (benchmarks/keep_floor.py offers every subset of it)."""
        ops = self.graph.ops[first_op : last_op + 1]
        reached = self.replayed(first_op, last_op)
        if name.startswith(DEAREST):
            ladder = dearest_first(self.graph, reached, self.op_seconds)
            keep = {op.name for op in ladder[: int(name.removeprefix(DEAREST))]}
        else:
            keep = keep_of(name, self.graph, ops, reached)
        return keepable(self.graph, ops, keep)

    def replayed(self, first_op: int, last_op: int) -> list[Op]:
        """The ops the replay of a region over `first_op..last_op` reaches (`replay_reach`)."""
        return replay_reach(self.graph, first_op, last_op)

    def fit(self, budget_bytes: int, attempt: Callable[[int], Attempt], strategy: str) -> Plan:
        """Run a model-based solver and judge its answer by the exact simulation: while the
        simulated peak exceeds the budget, shrink the target the solver sees by the overshoot. The
        solver's own peak model is a relaxation; only the simulation's peak is reported."""
        if self.floor_bytes > budget_bytes:
            raise InfeasibleBudget(
                f"{strategy}: {format_bytes(budget_bytes)} is below what the end of the step needs "
                f"once every activation is gone ({format_bytes(self.floor_bytes)}: parameters, "
                "their gradients, the embedding-gradient accumulation); no recomputation can go "
                f"lower. {self.what_the_peak_holds(self.floor_bytes)}",
                budget_bytes=budget_bytes,
                min_feasible_bytes=self.floor_bytes,
            )
        if (
            self.estimate.peak_bytes <= budget_bytes
            and self.simulate(()).peak_bytes <= budget_bytes
        ):
            return self.make_plan(
                (),
                strategy,
                budget_bytes,
                "store-all fits the budget: nothing to recompute",
                status="optimal",
            )
        target, closest = budget_bytes, None
        for tries in range(8):
            try:
                found = attempt(target)
            except InfeasibleBudget:
                break
            status = found.status if tries == 0 else "feasible"
            p = self.plan_of(found, strategy, budget_bytes, status)
            if p.predicted_peak_bytes <= budget_bytes:
                return p
            closest = min(closest or p.predicted_peak_bytes, p.predicted_peak_bytes)
            target -= p.predicted_peak_bytes - budget_bytes
        raise InfeasibleBudget(
            f"{strategy}: no plan found whose simulated peak fits {format_bytes(budget_bytes)}"
            + (f"; the closest predicts {format_bytes(closest)}" if closest else ""),
            budget_bytes=budget_bytes,
            min_feasible_bytes=closest,
        )

    # -- per-block models for the chain and MILP solvers ---------------------------------------
    @cached_property
    def block_options(self) -> tuple[str, ...]:
        """What a block can be in the per-block models: `BLOCK_OPTIONS`, the keep ladder, and
        with offload its options. The ladder, `selective:dearest-<n>`, keeps the n ops of the
        block's replay dearest to recompute per byte (`dearest_first`): the named policies leave
        gaps of 20 MiB and more a GPT-2 block (d 768, 1024 tokens), where a budget in one
        recomputed a whole block. Offered for n up to one less than every op, `LADDER` of them at
        most, spread evenly; those that keep what a named policy keeps are left out."""
        options = (*BLOCK_OPTIONS, *(offloading.OPTIONS if self.offload else ()))
        if not self.blocks:
            return options
        first = self.blocks[0]
        named = [self.block_regions([[0]], o)[0].keep for o in BLOCK_OPTIONS if ":" in o]
        reached = self.replayed(first.first_op, first.last_op)
        ladder = dearest_first(self.graph, reached, self.op_seconds)
        sizes = ladder_sizes([op.name for op in ladder], named, LADDER)
        return (*options, *(f"selective:{DEAREST}{n}" for n in sizes))

    @cached_property
    def option_simulations(self) -> dict[str, tuple[tuple[Region, ...], Simulation]]:
        """Each of `block_options` applied to every block: its regions and exact simulation."""
        out = {}
        for option in self.block_options:
            base = offloading.OPTIONS.get(option, option)
            regions = () if base == "store" else self.every_block(base)
            every = None
            if base != option:
                every = offloading.choose(self, regions, range(len(self.blocks)), False)
            out[option] = (regions, self.simulate(regions, every and every.offload))
        return out

    def _metrics(self, charge: dict[int, int]) -> dict[str, BlockMetrics]:
        out = {}
        for option, (regions, sim) in self.option_simulations.items():
            timeline = [t - self.base_bytes for t in self.timeline_of(sim)]
            overheads = self.region_overheads(regions)
            seconds = block_seconds(self.blocks, sim, regions, self.op_seconds, overheads)
            out[option] = measure(self.graph, self.blocks, sim, timeline, charge, seconds)
        return out

    @cached_property
    def block_metrics(self) -> dict[str, BlockMetrics]:
        """`BlockMetrics` of each of `block_options`, kept bytes charged to the block that made
        them (the chain model's view: a block's output is its kept bytes under full)."""
        return self._metrics(maker_blocks(self.graph, self.blocks))

    @cached_property
    def milp_metrics(self) -> dict[str, BlockMetrics]:
        """`BlockMetrics` with kept bytes charged to the block whose option decides whether they
        are kept (`remat.planning.blocks.deciding_blocks`), so that the MILP's mixes add up."""
        return self._metrics(deciding_blocks(self.graph, self.blocks))

    def what_the_peak_holds(self, peak_bytes: int) -> str:
        """What a peak of `peak_bytes` (the lowest a plan reaches) is made of, for an error that
        refuses a budget below it; where parameters, gradients and optimizer state are most of it,
        that recomputation cannot reach lower and what can (precision, an 8-bit optimizer,
        sharding)."""
        e = self.estimate
        fixed = e.param_bytes + e.grad_bytes + e.optimizer_state_bytes
        rest = max(peak_bytes - fixed - e.input_bytes - e.buffer_bytes, 0)
        held = (
            f"parameters {format_bytes(e.param_bytes)}, their gradients "
            f"{format_bytes(e.grad_bytes)}, optimizer state {format_bytes(e.optimizer_state_bytes)}"
            + (f" ({self.optimizer})" if self.optimizer else " (no optimizer given)")
            + f", inputs and buffers {format_bytes(e.input_bytes + e.buffer_bytes)}, activations "
            f"and temporaries {format_bytes(rest)} (store-all saves "
            f"{format_bytes(e.activation_bytes)} of activations)"
        )
        if 2 * fixed < peak_bytes:
            return f"That peak holds {held}"
        levers = ["lower precision (bf16 parameters and gradients take half)"]
        if e.optimizer_state_bytes:
            levers.append("an 8-bit optimizer (AdamW's state in a quarter)")
        levers.append("sharding over GPUs with FSDP (`remat fit --shard N` finds the ranks)")
        return (
            f"That peak holds {held}: parameters, gradients and optimizer state are "
            f"{fixed / peak_bytes:.0%} of it, and recomputation only removes activations, so no "
            f"plan goes lower. What can: {', '.join(levers[:-1])} or {levers[-1]}"
        )

    @cached_property
    def floor_bytes(self) -> int:
        """The least any block plan can reach: the step's end, once every activation is gone."""
        return self.base_bytes + max(m.post for m in self.block_metrics.values())

    def block_problem(self):
        """The per-block options model of `remat.planning.solvers.milp` (scipy.optimize is imported only
        when a MILP is solved)."""
        from remat.planning.solvers import milp

        m = self.milp_metrics
        charge = deciding_blocks(self.graph, self.blocks) if self.offload else {}
        options = tuple(
            tuple(
                milp.BlockOption(
                    name=o,
                    kept_bytes=m[o].kept[b],
                    backward_bytes=max(m[o].backward[b], m[o].kept[b]),
                    recompute_seconds=m[o].seconds[b],
                )
                if o not in offloading.OPTIONS
                else offloading.block_option(self, o, b, m[o])
                for o in self.block_options
                if o not in offloading.OPTIONS or self.offload_costs[o][b].host_bytes
            )
            + (tuple(offloading.partial_options(self, b, m["store"], charge)) if charge else ())
            for b in range(len(self.blocks))
        )
        tail = milp.BlockOption(
            name="store",
            kept_bytes=0,
            backward_bytes=self.floor_bytes - self.base_bytes,
            recompute_seconds=0.0,
        )
        return milp.BlockProblem(
            options=((tail,), *options),
            fixed_bytes=self.base_bytes,
            forward_extra_bytes=max(max(m[o].pre for o in m if o not in offloading.OPTIONS), 0),
            host_budget_bytes=self.offload.host_budget_bytes if self.offload else None,
        )

    def chain(self) -> chain_model.Chain:
        """The chain-of-blocks model of `remat.planning.solvers.chain`."""
        m = self.block_metrics
        n = len(self.blocks)
        blocks = tuple(
            chain_model.ChainBlock(
                name=self.blocks[b].path,
                forward_seconds=m["full"].seconds[b],
                input_bytes=m["full"].kept[b - 1] if b else 0,
                kept_bytes=m["store"].kept[b],
            )
            for b in range(n)
        )
        transient = max(m["store"].backward[b] - m["store"].kept[b] for b in range(n))
        return chain_model.Chain(
            blocks=blocks,
            fixed_bytes=self.base_bytes,
            forward_transient_bytes=max(max(m[o].pre for o in BLOCK_OPTIONS), 0),
            backward_transient_bytes=max(transient, 0),
        )


def plan(
    graph: Graph,
    budget: int | str = DEFAULT_BUDGET,
    strategy: str = "auto",
    profile: str | DeviceProfile = "cpu",
    optimizer: Optimizer = None,
    offload: offloading.OffloadSettings | bool | None = None,
) -> Plan:
    """The plan of `strategy` for `graph` under `budget` (bytes, "40GiB", "50%": the fixed memory
    plus that share of the rest of store-all's peak, or "+10%": the lowest peak within 10% more
    predicted step time, the default), with recompute costs on `profile`. `offload` (True, or
    `OffloadSettings`) lets the MILP (and auto, through it) move blocks' saves to host memory.
    Raises `InfeasibleBudget` naming the smallest budget that fits. For several plans of one
    graph, make a `Planner` once and ask it."""
    settings = offloading.settings_for(profile, offload)
    return Planner(graph, profile, optimizer, settings).plan(budget, strategy)


def pareto(
    graph: Graph,
    profile: str | DeviceProfile = "cpu",
    optimizer: Optimizer = None,
    steps: int = 16,
) -> Frontier:
    """`Planner(graph, profile, optimizer).pareto(steps)`."""
    return Planner(graph, profile, optimizer).pareto(steps)
