"""Checkpoint every repeated block: keep each block's input, recompute the block in its backward
(one extra forward, the usual "about 33% slower")."""

from __future__ import annotations

from typing import TYPE_CHECKING

from remat.planning.strategies import Strategy, register

if TYPE_CHECKING:
    from remat.planning.planner import Planner
    from remat.planning.plans import Plan


def solve(planner: Planner, budget_bytes: int) -> Plan:
    regions = planner.every_block("full")
    return planner.make_plan(
        regions, "full", budget_bytes, f"checkpoint each of the {len(regions)} blocks"
    )


STRATEGY = register(
    Strategy(
        name="full",
        summary="checkpoint every block",
        solve=solve,
        needs_blocks=True,
        rank=20,
    )
)
