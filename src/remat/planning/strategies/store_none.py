"""The memory-poor reference of the sqrt-n article: keep only the input and re-run the forward from
it for every block's backward (O(n^2) compute). It has no flat-region form, so its numbers come
from the chain model and it cannot be applied."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from remat.planning.solvers import chain
from remat.planning.strategies import Strategy, register

if TYPE_CHECKING:
    from remat.planning.planner import Planner
    from remat.planning.plans import Plan


def solve(planner: Planner, budget_bytes: int) -> Plan:
    poor = chain.store_none(planner.chain())
    forward = planner.make_plan((), "store_none", budget_bytes, poor.reason, appliable=False)
    blocks = planner.blocks
    return replace(
        forward,
        predicted_peak_bytes=max(poor.peak_bytes, planner.floor_bytes, planner.optimizer_step_peak),
        held_bytes=0,
        recompute_seconds=poor.recompute_seconds,
        recompute_flops=sum(
            (len(blocks) - j)
            * sum(op.flops for op in planner.graph.ops[c.first_op : c.last_op + 1])
            for j, c in enumerate(blocks)
        ),
    )


STRATEGY = register(
    Strategy(
        name="store_none",
        summary="recompute from the input for every block (the O(n^2) reference; not appliable)",
        solve=solve,
        needs_blocks=True,
        appliable=False,
        rank=10,
    )
)
