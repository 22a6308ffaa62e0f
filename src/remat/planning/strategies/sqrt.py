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
    return planner.make_plan(
        planner.block_regions(groups),
        "sqrt",
        budget_bytes,
        f"{len(groups)} segments of {size} blocks (Chen et al. 2016)",
    )


STRATEGY = register(
    Strategy(
        name="sqrt",
        summary="checkpoint sqrt(n) segments of sqrt(n) blocks (Chen et al. 2016)",
        solve=solve,
        needs_blocks=True,
        rank=30,
    )
)
