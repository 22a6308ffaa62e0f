"""Checkpoint the first k blocks, each as its own region, and keep the rest: the fewest k that
fits. Megatron-LM's `--recompute-method block --recompute-num-layers k`: recomputing k whole
blocks costs the same wherever they are, but the first blocks' activations are held longest (the
backward reaches them last), so checkpointing those lowers the peak most per block recomputed.
A plan the block solvers' relaxed memory models can miss where it fits by the exact simulation."""

from __future__ import annotations

from typing import TYPE_CHECKING

from remat.errors import InfeasibleBudget
from remat.planning.strategies import Strategy, register
from remat.units import format_bytes

if TYPE_CHECKING:
    from remat.planning.planner import Planner
    from remat.planning.plans import Plan


def _plan(planner: Planner, k: int, budget_bytes: int | None) -> Plan:
    n = len(planner.blocks)
    return planner.make_plan(
        planner.block_regions([[b] for b in range(k)]),
        "first_k",
        budget_bytes,
        f"checkpoint the first {k} of {n} blocks, keep the rest (Megatron-LM's block method)",
        k=k,
    )


def solve(planner: Planner, budget_bytes: int) -> Plan:
    plans = []
    for k in range(len(planner.blocks) + 1):
        p = _plan(planner, k, budget_bytes)
        if p.predicted_peak_bytes <= budget_bytes:
            return p
        plans.append(p)
    lowest = min(p.predicted_peak_bytes for p in plans)
    raise InfeasibleBudget(
        f"strategy first_k: no number of checkpointed blocks fits {format_bytes(budget_bytes)}; "
        f"its lowest peak is {format_bytes(lowest)}",
        budget_bytes=budget_bytes,
        min_feasible_bytes=lowest,
    )


def lowest_peak(planner: Planner) -> Plan:
    plans = [_plan(planner, k, None) for k in range(len(planner.blocks) + 1)]
    return min(plans, key=lambda p: (p.predicted_peak_bytes, p.recompute_seconds))


STRATEGY = register(
    Strategy(
        name="first_k",
        summary="checkpoint the first k blocks, the fewest that fit (Megatron-LM's block method)",
        solve=solve,
        budgeted=True,
        needs_blocks=True,
        lowest_peak=lowest_peak,
        rank=62,
    )
)
