"""Keep every activation autograd saves: no recomputation, the peak everything else is measured
against."""

from __future__ import annotations

from typing import TYPE_CHECKING

from remat.planning.strategies import Strategy, register

if TYPE_CHECKING:
    from remat.planning.planner import Planner
    from remat.planning.plans import Plan


def solve(planner: Planner, budget_bytes: int) -> Plan:
    return planner.make_plan((), "store_all", budget_bytes, "keep every activation autograd saves")


STRATEGY = register(
    Strategy(
        name="store_all",
        summary="keep everything autograd saves (no recomputation)",
        solve=solve,
        rank=0,
    )
)
