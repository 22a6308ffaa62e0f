"""Selective checkpointing: every block is a region that keeps the outputs a named policy picks
(Megatron's attention-core recompute, save-matmuls, torchtitan's op list) and recomputes the rest.
One strategy per policy in `remat.planning.solvers.selective.POLICIES`."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from remat.planning.solvers.selective import POLICIES
from remat.planning.strategies import Strategy, register

if TYPE_CHECKING:
    from remat.planning.planner import Planner
    from remat.planning.plans import Plan


def _solver(option: str, reason: str) -> Callable[[Planner, int], Plan]:
    def solve(planner: Planner, budget_bytes: int) -> Plan:
        return planner.make_plan(planner.every_block(option), option, budget_bytes, reason)

    return solve


def _register(policy: str) -> Strategy:
    summary = POLICIES[policy].__doc__.strip().splitlines()[0].rstrip(".")
    name = f"selective:{policy}"
    return register(
        Strategy(name=name, summary=summary, solve=_solver(name, summary), needs_blocks=True)
    )


STRATEGIES = tuple(_register(policy) for policy in POLICIES)
