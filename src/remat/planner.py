"""`remat.plan()`: what to keep and what to recompute under a budget, by a named strategy.

The solvers in `remat.solvers` are pure functions on small models (a chain of blocks, per-block
options, the joint graph); this module turns a traced `Graph` into those models, turns their
answers back into checkpoint regions, and judges every answer by the same exact simulation
(`remat.schedule.simulate`), so that a plan's predicted peak is what `remat.apply` will run.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import cached_property

from remat.cost import DeviceProfile, get_profile, is_matmul, op_seconds_all
from remat.errors import InfeasibleBudget
from remat.estimate import MemoryEstimate, Optimizer, estimate
from remat.graph import Graph, ModuleCall
from remat.plans import Plan, build_plan, resolve_budget
from remat.quiet import quiet_fd
from remat.schedule import Region, Simulation, make_region, simulate
from remat.solvers import chain as chain_solver
from remat.solvers.mincut import mincut as traffic_mincut
from remat.solvers.selective import POLICIES, without_mutated
from remat.units import format_bytes

BLOCK_OPTIONS = ("store", "full", *(f"selective:{p}" for p in POLICIES))


@dataclass
class Context:
    """A traced step prepared for planning: costs, fixed memory, blocks."""

    graph: Graph
    profile: DeviceProfile
    optimizer: Optimizer
    estimate: MemoryEstimate
    op_seconds: list[float]
    base_bytes: int  # live before the step: parameters, buffers, inputs, optimizer state
    blocks: list[ModuleCall] = field(default_factory=list)

    @classmethod
    def from_graph(
        cls, graph: Graph, device: str | DeviceProfile = "cpu", optimizer: Optimizer = None
    ) -> Context:
        profile = get_profile(device)
        est = estimate(graph, optimizer=optimizer)
        persistent = sum(s.nbytes for s in graph.storages.values() if s.allocated_at is None)
        return cls(
            graph=graph,
            profile=profile,
            optimizer=optimizer,
            estimate=est,
            op_seconds=op_seconds_all(graph, profile),
            base_bytes=persistent + est.optimizer_state_bytes,
            blocks=graph.blocks,
        )

    @cached_property
    def optimizer_step_peak(self) -> int:
        """The optimizer step runs after every activation is gone: the same for every plan."""
        return self.estimate.peak_bytes if self.estimate.peak_phase == "optimizer" else 0

    def simulate(self, regions: tuple[Region, ...]) -> Simulation:
        return simulate(self.graph, regions, base_bytes=self.base_bytes)

    def plan(
        self, regions: tuple[Region, ...], strategy: str, budget: int | None, reason: str, **details
    ) -> Plan:
        p = build_plan(
            self.graph,
            regions,
            strategy=strategy,
            budget_bytes=budget,
            op_seconds=self.op_seconds,
            base_bytes=self.base_bytes,
            device=self.profile.name,
            reason=reason,
            details=details,
        )
        if self.optimizer_step_peak > p.predicted_peak_bytes:
            p = replace(p, predicted_peak_bytes=self.optimizer_step_peak)
        return p

    # -- regions ---------------------------------------------------------------------------------
    @cached_property
    def chained(self) -> list[bool]:
        """Whether block b+1 continues block b so that one region can run both: no op between
        them, b's only output is b+1's first input, and their other tensor inputs are the same
        (an encoder's last layer and a decoder's first are not chained)."""
        return [
            a.last_op + 1 == b.first_op
            and len(a.outputs) == 1
            and b.inputs[:1] == a.outputs
            and b.inputs[1:] == a.inputs[1:]
            for a, b in zip(self.blocks, self.blocks[1:], strict=False)
        ]

    def block_regions(self, groups: list[list[int]], option: str = "full") -> tuple[Region, ...]:
        """One region per group of consecutive block indices, checkpointed with `option`; a group
        that spans blocks that are not chained is split where the chain breaks."""
        split = []
        for group in groups:
            split.append([group[0]])
            for b in group[1:]:
                if self.chained[b - 1]:
                    split[-1].append(b)
                else:
                    split.append([b])
        out = []
        for group in split:
            first, last = self.blocks[group[0]], self.blocks[group[-1]]
            keep: set[str] = set()
            if option.startswith("selective:"):
                ops = self.graph.ops[first.first_op : last.last_op + 1]
                policy = POLICIES[option.split(":", 1)[1]]
                keep = without_mutated(self.graph, ops, policy(self.graph, ops))
            modules = tuple(self.blocks[i].path for i in group)
            out.append(make_region(self.graph, modules, first.first_op, last.last_op, keep))
        return tuple(out)

    def require_blocks(self, strategy: str) -> None:
        if not self.blocks:
            raise InfeasibleBudget(
                f"strategy {strategy!r} checkpoints repeated blocks, and this model has none "
                "(no numbered submodules such as layers.0, layers.1): use --strategy mincut or "
                "store_all",
                budget_bytes=0,
                min_feasible_bytes=None,
            )

    # -- per-block models for the chain and MILP solvers -----------------------------------------
    @cached_property
    def block_metrics(self) -> dict[str, dict[str, list]]:
        """For each block option applied to every block, from one exact simulation: the bytes each
        block keeps through the forward (`kept`), the bytes live during its backward above what
        earlier blocks keep (`backward`), its recompute seconds, and two plan-wide terms: `pre`,
        the most live above all kept bytes before the first block's backward (the forward, the
        head's backward), and `post`, the most live after the blocks' backward (gradient
        accumulation of embeddings), when no activation is left."""
        n = len(self.blocks)
        block_of_op = {}
        for b, call in enumerate(self.blocks):
            for i in range(call.first_op, call.last_op + 1):
                block_of_op[i] = b
        last_forward = len(self.graph.forward_ops) - 1
        out: dict[str, dict[str, list]] = {}
        for option in BLOCK_OPTIONS:
            regions = (
                () if option == "store" else self.block_regions([[b] for b in range(n)], option)
            )
            sim = self.simulate(regions)
            end_of_forward = sim.schedule.index(("op", last_forward))
            kept = [0] * n
            for sid, death in sim.deaths.items():
                at = self.graph.storages[sid].allocated_at
                if at in block_of_op and death > end_of_forward:
                    kept[block_of_op[at]] += self.graph.storages[sid].nbytes
            first_pos, last_pos = [None] * n, [None] * n
            for pos, (kind, i) in enumerate(sim.schedule):
                if kind == "replay":
                    b = block_of_op[i]
                elif pos > end_of_forward and self.graph.ops[i].node is not None:
                    b = block_of_op.get(self.graph.nodes[self.graph.ops[i].node].forward_op)
                else:
                    continue
                if b is not None:
                    first_pos[b] = pos if first_pos[b] is None else first_pos[b]
                    last_pos[b] = pos
            # Backward visits blocks n-1 .. 0: block b owns the positions from its first one to
            # just before block b-1's first one; block 0 owns up to its last one.
            starts = [
                first_pos[b] if first_pos[b] is not None else len(sim.schedule) for b in range(n)
            ]
            stops = [
                starts[b - 1] if b else (last_pos[0] if last_pos[0] is not None else starts[0]) + 1
                for b in range(n)
            ]
            live = [t - self.base_bytes for t in sim.timeline]
            prefix = [0] * (n + 1)
            for b in range(n):
                prefix[b + 1] = prefix[b] + kept[b]
            backward = [max(live[starts[b] : stops[b]], default=0) - prefix[b] for b in range(n)]
            pre = max(live[: min(starts)], default=0) - prefix[n]
            post = max(live[stops[0] :], default=0)
            seconds = [0.0] * n
            for i in sim.recompute_ops:
                seconds[block_of_op[i]] += self.op_seconds[i]
            out[option] = {
                "kept": kept,
                "backward": backward,
                "seconds": seconds,
                "pre": [pre],
                "post": [post],
            }
        return out

    @cached_property
    def floor_bytes(self) -> int:
        """The least any block plan can reach: the step's end, once every activation is gone."""
        return self.base_bytes + max(m["post"][0] for m in self.block_metrics.values())

    def block_problem(self):
        """The per-block options model of `remat.solvers.milp` (scipy.optimize is imported only
        when a MILP is solved)."""
        from remat.solvers import milp as milp_solver

        m = self.block_metrics
        options = tuple(
            tuple(
                milp_solver.BlockOption(
                    name=o,
                    kept_bytes=m[o]["kept"][b],
                    backward_bytes=max(m[o]["backward"][b], m[o]["kept"][b]),
                    recompute_seconds=m[o]["seconds"][b],
                )
                for o in BLOCK_OPTIONS
            )
            for b in range(len(self.blocks))
        )
        tail = milp_solver.BlockOption(
            name="store",
            kept_bytes=0,
            backward_bytes=self.floor_bytes - self.base_bytes,
            recompute_seconds=0.0,
        )
        pre = max(m[o]["pre"][0] for o in BLOCK_OPTIONS)
        return milp_solver.BlockProblem(
            options=((tail,), *options),
            fixed_bytes=self.base_bytes,
            forward_extra_bytes=max(pre, 0),
        )

    def chain(self) -> chain_solver.Chain:
        m = self.block_metrics
        n = len(self.blocks)
        blocks = tuple(
            chain_solver.ChainBlock(
                name=self.blocks[b].path,
                forward_seconds=m["full"]["seconds"][b],
                input_bytes=m["full"]["kept"][b - 1] if b else 0,
                saved_bytes=m["store"]["kept"][b],
            )
            for b in range(n)
        )
        transient = max(m["store"]["backward"][b] - m["store"]["kept"][b] for b in range(n))
        return chain_solver.Chain(
            blocks=blocks,
            fixed_bytes=self.base_bytes,
            forward_transient_bytes=max(max(m[o]["pre"][0] for o in BLOCK_OPTIONS), 0),
            backward_transient_bytes=max(transient, 0),
        )


# -- strategies --------------------------------------------------------------------------------
Strategy = Callable[[Context, int], Plan]


def store_all(ctx: Context, budget: int) -> Plan:
    return ctx.plan(
        (), "store_all", budget, "keep every activation autograd saves: no recomputation"
    )


def full(ctx: Context, budget: int) -> Plan:
    ctx.require_blocks("full")
    regions = ctx.block_regions([[b] for b in range(len(ctx.blocks))])
    return ctx.plan(regions, "full", budget, f"checkpoint each of the {len(regions)} blocks")


def sqrt(ctx: Context, budget: int) -> Plan:
    ctx.require_blocks("sqrt")
    n = len(ctx.blocks)
    size = max(1, round(math.sqrt(n)))
    groups = [list(range(i, min(i + size, n))) for i in range(0, n, size)]
    return ctx.plan(
        ctx.block_regions(groups),
        "sqrt",
        budget,
        f"{len(groups)} segments of {size} blocks (Chen et al. 2016)",
    )


def store_none(ctx: Context, budget: int) -> Plan:
    """The memory-poor reference of the sqrt-n article: keep only the input and re-run the forward
    from it for every block's backward (O(n^2) compute). It has no flat-region form, so its numbers
    come from the chain model and it cannot be applied."""
    ctx.require_blocks("store_none")
    chain = ctx.chain()
    poor = chain_solver.store_none(chain)
    forward = ctx.plan((), "store_none", budget, "")
    return replace(
        forward,
        predicted_peak_bytes=max(poor.peak_bytes, ctx.floor_bytes, ctx.optimizer_step_peak),
        held_bytes=0,
        recompute_seconds=poor.recompute_seconds,
        recompute_flops=sum(
            (len(ctx.blocks) - j)
            * sum(op.flops for op in ctx.graph.ops[c.first_op : c.last_op + 1])
            for j, c in enumerate(ctx.blocks)
        ),
        reason=poor.reason,
        details={"appliable": False},
    )


def selective(policy: str) -> Strategy:
    def solve(ctx: Context, budget: int) -> Plan:
        ctx.require_blocks(f"selective:{policy}")
        regions = ctx.block_regions([[b] for b in range(len(ctx.blocks))], f"selective:{policy}")
        return ctx.plan(
            regions, f"selective:{policy}", budget, POLICIES[policy].__doc__.strip().splitlines()[0]
        )

    return solve


def mincut(ctx: Context, budget: int) -> Plan:
    """The memory-traffic min-cut (Horace He), realised eagerly: each block is a region that keeps
    the values on the cut and recomputes the rest. Matmul-class ops are never recomputed, as in
    AOTAutograd's partitioner: the article's fused-kernel model makes all recomputation free,
    which in eager mode would re-run every matmul."""
    cut = traffic_mincut(ctx.graph, never_recompute=is_matmul)
    saved = {name.split(":")[0] for name in cut.saved}
    spans = [((c.path,), c.first_op, c.last_op) for c in ctx.blocks] or [
        (("",), 0, len(ctx.graph.forward_ops) - 1)
    ]
    regions = []
    for modules, first, last in spans:
        ops = ctx.graph.ops[first : last + 1]
        keep = without_mutated(ctx.graph, ops, {op.name for op in ops if op.name in saved})
        regions.append(make_region(ctx.graph, modules, first, last, keep))
    regions = tuple(regions)
    return ctx.plan(regions, "mincut", budget, cut.reason, cut_cost_bytes=cut.cut_cost_bytes)


def _fit(
    ctx: Context,
    budget: int,
    solve: Callable[[int], tuple[tuple[Region, ...], dict]],
    strategy: str,
) -> Plan:
    """Run a model-based solver and check its answer by exact simulation; while the simulated peak
    exceeds the budget, shrink the budget the solver sees by the overshoot."""
    if ctx.floor_bytes > budget:
        raise InfeasibleBudget(
            f"{strategy}: {format_bytes(budget)} is below what the end of the step needs once every "
            f"activation is gone ({format_bytes(ctx.floor_bytes)}: parameters, their gradients, the "
            "embedding-gradient accumulation); no recomputation can go lower",
            budget_bytes=budget,
            min_feasible_bytes=ctx.floor_bytes,
        )
    target, closest = budget, None
    for _ in range(8):
        try:
            regions, details = solve(target)
        except InfeasibleBudget:
            break
        p = ctx.plan(regions, strategy, budget, details.pop("reason"), **details)
        if p.predicted_peak_bytes <= budget:
            return p
        closest = (
            p.predicted_peak_bytes if closest is None else min(closest, p.predicted_peak_bytes)
        )
        target -= p.predicted_peak_bytes - budget
    raise InfeasibleBudget(
        f"{strategy}: no plan found whose simulated peak fits {format_bytes(budget)}"
        + (f"; the closest predicts {format_bytes(closest)}" if closest else ""),
        budget_bytes=budget,
        min_feasible_bytes=closest,
    )


def chain_dp(ctx: Context, budget: int) -> Plan:
    ctx.require_blocks("chain_dp")
    chain = ctx.chain()

    def solve(target: int):
        best = chain_solver.chain_dp(chain, target)
        groups = [(list(range(a, b)), ck) for a, b, ck in best.schedule.segments]
        regions = tuple(r for (g, ck) in groups if ck for r in ctx.block_regions([g]))
        return regions, {"reason": best.reason}

    return _fit(ctx, budget, solve, "chain_dp")


def milp(ctx: Context, budget: int) -> Plan:
    from remat.solvers import milp as milp_solver

    ctx.require_blocks("milp")
    problem = ctx.block_problem()

    def solve(target: int):
        with quiet_fd(1):
            res = milp_solver.milp(problem, target)
        regions = tuple(
            r
            for b, name in enumerate(res.option_names[1:])
            if name != "store"
            for r in ctx.block_regions([[b]], name)
        )
        return regions, {
            "reason": res.reason,
            "status": res.status,
            "mip_gap": res.mip_gap,
            "options": list(res.option_names[1:]),
        }

    return _fit(ctx, budget, solve, "milp")


FIXED = ("store_all", "full", "sqrt", *(f"selective:{p}" for p in POLICIES), "mincut")


def lowest_peak(ctx: Context) -> Plan:
    """The plan with the lowest simulated peak that remat can apply: the best of the fixed
    strategies and of the MILP's lowest-peak choice of block options. Its peak is the smallest
    budget `auto` accepts."""
    plans = [
        STRATEGIES[name](ctx, 0) for name in FIXED if ctx.blocks or name in ("store_all", "mincut")
    ]
    if ctx.blocks:
        from remat.solvers import milp as milp_solver

        problem = ctx.block_problem()
        with quiet_fd(1):
            res = milp_solver.milp(problem, milp_solver.min_peak(problem))
        regions = tuple(
            r
            for b, name in enumerate(res.option_names[1:])
            if name != "store"
            for r in ctx.block_regions([[b]], name)
        )
        plans.append(ctx.plan(regions, "milp", None, res.reason))
    return min(plans, key=lambda p: (p.predicted_peak_bytes, p.recompute_seconds))


def auto(ctx: Context, budget: int) -> Plan:
    """The fastest plan that fits, among every strategy (store_none aside: it cannot be applied)."""
    candidates: list[Plan] = []
    for name in (*FIXED, "chain_dp", "milp"):
        try:
            p = STRATEGIES[name](ctx, budget)
        except InfeasibleBudget:
            continue
        if p.predicted_peak_bytes <= budget:
            candidates.append(p)
    if not candidates:
        smallest = lowest_peak(ctx).predicted_peak_bytes
        raise InfeasibleBudget(
            f"no strategy fits {format_bytes(budget)}; the smallest feasible budget is "
            f"{format_bytes(smallest)} ({smallest} bytes)",
            budget_bytes=budget,
            min_feasible_bytes=smallest,
        )
    best = min(candidates, key=lambda p: (p.recompute_seconds, p.predicted_peak_bytes))
    others = ", ".join(
        f"{p.strategy} +{p.recompute_seconds * 1e3:.2f} ms" for p in candidates if p is not best
    )
    return replace(
        best,
        strategy=f"auto ({best.strategy})",
        reason=f"fastest that fits: {best.reason}" + (f"; other fits: {others}" if others else ""),
    )


STRATEGIES: dict[str, Strategy] = {
    "store_all": store_all,
    "store_none": store_none,
    "full": full,
    "sqrt": sqrt,
    "chain_dp": chain_dp,
    **{f"selective:{p}": selective(p) for p in POLICIES},
    "mincut": mincut,
    "milp": milp,
    "auto": auto,
}


def plan(
    graph: Graph,
    budget: int | str = "50%",
    strategy: str = "auto",
    device: str | DeviceProfile = "cpu",
    optimizer: Optimizer = None,
) -> Plan:
    """The plan of `strategy` for `graph` under `budget` (bytes, "40GiB", or "50%": the fixed memory
    plus that share of the rest of store-all's peak). Raises `InfeasibleBudget` naming the smallest
    budget that fits when the plan's predicted peak exceeds the budget."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose from {', '.join(STRATEGIES)}")
    ctx = Context.from_graph(graph, device, optimizer)
    return plan_in(ctx, budget, strategy)


def compare(ctx: Context, budget_bytes: int) -> list[tuple[str, Plan | None, str]]:
    """Every strategy at this budget: (name, plan or None, note) for the comparison table."""
    rows = []
    for name in STRATEGIES:
        if name == "auto":
            continue
        try:
            p = STRATEGIES[name](ctx, budget_bytes)
        except InfeasibleBudget as e:
            rows.append((name, None, str(e).split(";")[0]))
            continue
        note = "fits" if p.predicted_peak_bytes <= budget_bytes else "over budget"
        if p.details.get("appliable") is False:
            note += " (reference only: not appliable)"
        rows.append((name, p, note))
    return rows


def plan_in(ctx: Context, budget: int | str, strategy: str) -> Plan:
    budget_bytes = resolve_budget(budget, ctx.estimate.fixed_bytes, ctx.estimate.peak_bytes)
    p = STRATEGIES[strategy](ctx, budget_bytes)
    if p.predicted_peak_bytes > budget_bytes:
        raise InfeasibleBudget(
            f"strategy {strategy} predicts a peak of {format_bytes(p.predicted_peak_bytes)}, over the "
            f"budget of {format_bytes(budget_bytes)}: the smallest budget it fits is "
            f"{format_bytes(p.predicted_peak_bytes)} (--strategy auto picks among all strategies)",
            budget_bytes=budget_bytes,
            min_feasible_bytes=p.predicted_peak_bytes,
        )
    return p


@dataclass(frozen=True)
class Frontier:
    """Plans along the budget axis: `points` are the non-dominated (peak, recompute seconds) of
    `auto` over budgets; `named` is where each named strategy falls."""

    points: tuple[Plan, ...]
    named: tuple[Plan, ...]

    def plot(self, path: str, title: str = "") -> str:
        """A PNG of the frontier with the named strategies marked."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4.5))
        gib = 2**30
        xs = [p.predicted_peak_bytes / gib for p in self.points]
        ys = [p.recompute_seconds * 1e3 for p in self.points]
        ax.step(xs, ys, where="post", color="black", label="remat auto (frontier)")
        ax.scatter(xs, ys, color="black", s=12)
        for p in self.named:
            ax.scatter(p.predicted_peak_bytes / gib, p.recompute_seconds * 1e3, s=40, marker="D")
            ax.annotate(
                p.strategy,
                (p.predicted_peak_bytes / gib, p.recompute_seconds * 1e3),
                fontsize=8,
                xytext=(4, 4),
                textcoords="offset points",
            )
        ax.set_xlabel("predicted peak of the step (GiB)")
        ax.set_ylabel(
            f"predicted recompute time (ms, {self.points[0].device if self.points else ''})"
        )
        ax.set_title(title or "memory / recompute frontier")
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right", fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return path


def pareto(
    graph: Graph | Context,
    device: str | DeviceProfile = "cpu",
    optimizer: Optimizer = None,
    steps: int = 16,
) -> Frontier:
    """The frontier of (predicted peak, recompute seconds) over budgets from the lowest feasible
    peak to store-all's, planned by `auto`, and the named strategies for comparison."""
    ctx = graph if isinstance(graph, Context) else Context.from_graph(graph, device, optimizer)
    low = lowest_peak(ctx).predicted_peak_bytes
    high = ctx.estimate.peak_bytes
    plans = []
    for k in range(steps):
        budget = int(low + (high - low) * k / max(steps - 1, 1))
        try:
            plans.append(auto(ctx, budget))
        except InfeasibleBudget:
            continue
    named = [
        STRATEGIES[name](ctx, high)
        for name in FIXED
        if ctx.blocks or name in ("store_all", "mincut")
    ]
    frontier, best = [], None
    for p in sorted([*plans, *named], key=lambda p: (p.predicted_peak_bytes, p.recompute_seconds)):
        if best is None or p.recompute_seconds < best - 1e-15:
            frontier.append(p)
            best = p.recompute_seconds
    return Frontier(points=tuple(frontier), named=tuple(named))
