"""The memory-traffic min-cut of the joint graph (Horace He's article, AOTAutograd's partitioner):
save the values on the cheapest cut between what the forward computes and what the backward needs,
recompute the rest. Matmul-class ops are never recomputed, as in AOTAutograd: the article's
fused-kernel model makes all recomputation free, which in eager mode would re-run every matmul.

Eagerly, each block is a region that keeps the values on the cut (the whole model is one region
when it has no blocks). Compiled, the cut is the save set; it has no byte budget of its own."""

from __future__ import annotations

from typing import TYPE_CHECKING

from remat.device.cost import is_matmul
from remat.errors import InfeasibleBudget
from remat.planning.solvers import mincut
from remat.planning.solvers.selective import keepable
from remat.planning.strategies import Strategy, register
from remat.prediction.schedule import make_region
from remat.units import format_bytes

if TYPE_CHECKING:
    from remat.planning.joint import JointContext
    from remat.planning.planner import Planner
    from remat.planning.plans import Plan
    from remat.planning.solvers.saveset import SaveSet


def solve(planner: Planner, budget_bytes: int) -> Plan:
    graph = planner.graph
    cut = mincut.mincut(graph, never_recompute=is_matmul)
    saved = {name.split(":")[0] for name in cut.saved}
    spans = [((c.path,), c.first_op, c.last_op) for c in planner.blocks]
    if not spans and not planner.reversible_blocks:  # no blocks: the whole model, unless it
        spans = [(("",), 0, len(graph.forward_ops) - 1)]  # holds reversible ones (Planner)
    regions = []
    for modules, first, last in spans:
        ops = graph.ops[first : last + 1]
        keep = keepable(graph, ops, {op.name for op in ops if op.name in saved})
        regions.append(make_region(graph, modules, first, last, keep))
    return planner.make_plan(
        tuple(regions),
        "mincut",
        budget_bytes,
        cut.reason,
        status="optimal",
        cut_cost_bytes=cut.cut_cost_bytes,
    )


def solve_compiled(joint: JointContext, budget_bytes: int | None) -> SaveSet:
    chosen = joint.min_cut
    if budget_bytes is not None and chosen.peak_bytes > budget_bytes:
        raise InfeasibleBudget(
            f"the min-cut save set peaks at {format_bytes(chosen.peak_bytes)}, above the budget "
            f"{format_bytes(budget_bytes)}: the min-cut has no byte budget; use strategy='milp' "
            "or 'auto', which bound the predicted peak",
            budget_bytes=budget_bytes,
            min_feasible_bytes=chosen.peak_bytes,
        )
    return chosen


STRATEGY = register(
    Strategy(
        name="mincut",
        summary="the memory-traffic min-cut (AOTAutograd's partitioner, matmuls never recomputed)",
        solve=solve,
        solve_compiled=solve_compiled,
        rank=60,
    )
)
