"""Chen et al. (2016): sqrt(n) segments of sqrt(n) blocks, each checkpointed as one region, so
O(sqrt n) inputs are kept and one segment at a time is recomputed."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from remat.planning.strategies import Strategy, register

if TYPE_CHECKING:
    from remat.planning.planner import Planner
    from remat.planning.plans import Plan


def solve(planner: Planner, budget_bytes: int) -> Plan:
    n = len(planner.blocks)
    size = max(1, round(math.sqrt(n)))
    groups = [list(range(i, min(i + size, n))) for i in range(0, n, size)]
    regions = planner.block_regions(groups)
    reason = f"{len(groups)} segments of {size} blocks (Chen et al. 2016)"
    if len(regions) > len(groups):
        pairs = [
            f"{planner.blocks[b - 1].path} .. {planner.blocks[b].path}"
            for g in groups
            for b in g[1:]
        ]
        why = next(
            (f" ({p}: {planner.chain_breaks[p]})" for p in pairs if p in planner.chain_breaks), ""
        )
        reason += f", cut into {len(regions)} regions where blocks cannot share one{why}"
    return planner.make_plan(regions, "sqrt", budget_bytes, reason)


STRATEGY = register(
    Strategy(
        name="sqrt",
        summary="checkpoint sqrt(n) segments of sqrt(n) blocks (Chen et al. 2016)",
        solve=solve,
        needs_blocks=True,
        rank=30,
    )
)
