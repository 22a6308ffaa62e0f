"""The fastest plan that fits: every other appliable strategy in the registry is solved at the
budget and the one with the least predicted recompute time among those that fit wins. Compiled:
the min-cut when it fits the budget (least traffic), else the cheapest save set within it."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from remat.errors import InfeasibleBudget
from remat.planning.strategies import Strategy, available, get, register
from remat.units import format_bytes

if TYPE_CHECKING:
    from remat.planning.joint import JointContext
    from remat.planning.planner import Planner
    from remat.planning.plans import Plan
    from remat.planning.solvers.saveset import SaveSet


def solve(planner: Planner, budget_bytes: int) -> Plan:
    candidates: list[Plan] = []
    for strategy in available("eager"):
        if strategy.name == "auto" or not strategy.appliable:
            continue
        if strategy.needs_blocks and not planner.blocks:
            continue
        try:
            p = planner.solve(strategy, budget_bytes)
        except InfeasibleBudget:
            continue
        if p.predicted_peak_bytes <= budget_bytes:
            candidates.append(p)
    if not candidates:
        smallest = planner.lowest_peak().predicted_peak_bytes
        raise InfeasibleBudget(
            f"no strategy fits {format_bytes(budget_bytes)}; the smallest feasible budget is "
            f"{format_bytes(smallest)} ({smallest} bytes)",
            budget_bytes=budget_bytes,
            min_feasible_bytes=smallest,
        )
    best = min(candidates, key=lambda p: (p.recompute_seconds, p.predicted_peak_bytes))
    others = ", ".join(
        f"{p.strategy} +{p.recompute_seconds * 1e3:.2f} ms" for p in candidates if p is not best
    )
    return replace(
        best,
        strategy=f"auto ({best.strategy})",
        # a choice among candidates: "optimal" only where the chosen one was proved so
        status="feasible" if best.status == "fixed" else best.status,
        reason=f"fastest that fits: {best.reason}" + (f"; other fits: {others}" if others else ""),
    )


def solve_compiled(joint: JointContext, budget_bytes: int | None) -> SaveSet:
    try:
        return get("mincut").solve_compiled(joint, budget_bytes)
    except InfeasibleBudget:
        return get("milp").solve_compiled(joint, budget_bytes)


STRATEGY = register(
    Strategy(
        name="auto",
        summary="the fastest of the strategies that fits the budget",
        solve=solve,
        solve_compiled=solve_compiled,
        budgeted=True,
        rank=90,
    )
)
