"""The optimal segmentation of the chain of blocks by dynamic programming (Chen et al.'s and
Griewank's recursion): which consecutive blocks to checkpoint together so that the peak fits the
budget at the least recompute time. The chain model is a relaxation; `Planner.fit` judges every
answer by the exact simulation and tightens the target until the simulated peak fits."""

from __future__ import annotations

from typing import TYPE_CHECKING

from remat.planning.solvers import chain
from remat.planning.strategies import Strategy, register

if TYPE_CHECKING:
    from remat.planning.planner import Attempt, Planner
    from remat.planning.plans import Plan


def solve(planner: Planner, budget_bytes: int) -> Plan:
    from remat.planning.planner import Attempt

    model = planner.chain()

    def attempt(target: int) -> Attempt:
        best = chain.chain_dp(model, target)
        regions = tuple(
            region
            for start, stop, checkpointed in best.schedule.segments
            if checkpointed
            for region in planner.block_regions([list(range(start, stop))])
        )
        return Attempt(regions, best.reason)

    return planner.fit(budget_bytes, attempt, "chain_dp")


STRATEGY = register(
    Strategy(
        name="chain_dp",
        summary="the optimal segmentation of the blocks by dynamic programming",
        solve=solve,
        budgeted=True,
        needs_blocks=True,
        rank=65,
    )
)
