"""Checkpoint the first k blocks, each as its own region, and keep the rest: the fewest k that
fits. Megatron-LM's `--recompute-method block --recompute-num-layers k`: recomputing k whole
blocks costs the same wherever they are, but the first blocks' activations are held longest (the
backward reaches them last), so checkpointing those lowers the peak most per block recomputed.
A plan the block solvers' relaxed memory models can miss where it fits by the exact simulation."""

from __future__ import annotations

from typing import TYPE_CHECKING

from remat.errors import InfeasibleBudget
from remat.planning.plans import recompute_seconds
from remat.planning.strategies import Strategy, register
from remat.prediction.prefix_peaks import prefixes
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


def predicted_peaks(planner: Planner) -> list[int]:
    """The predicted peak of `_plan(planner, k, ...)` for k = 0..n, as `make_plan` predicts it (the
    simulation's peak over the bytes before the step, or the optimizer step's where higher), from
    one stepping of the simulation through k (`prefixes`), not n + 1 simulations; where stepping
    does not apply, the plans' own."""
    found = prefixes(planner.graph, planner.every_block())
    if found is None:
        return [
            _plan(planner, k, None).predicted_peak_bytes for k in range(len(planner.blocks) + 1)
        ]
    return [max(peak + planner.base_bytes, planner.optimizer_step_peak) for peak in found.peaks]


def solve(planner: Planner, budget_bytes: int) -> Plan:
    peaks = predicted_peaks(planner)
    for k, peak in enumerate(peaks):
        if peak <= budget_bytes:
            return _plan(planner, k, budget_bytes)
    raise InfeasibleBudget(
        f"strategy first_k: no number of checkpointed blocks fits {format_bytes(budget_bytes)}; "
        f"its lowest peak is {format_bytes(min(peaks))}",
        budget_bytes=budget_bytes,
        min_feasible_bytes=min(peaks),
    )


def lowest_peak(planner: Planner) -> Plan:
    """The plan of lowest (peak, recompute seconds), the fewest blocks among equals. Block counts
    often tie at the lowest peak (the optimizer step's, or a peak the later blocks do not reach):
    their recompute seconds are summed as `build_plan` sums them, from the replays' ops."""
    peaks = predicted_peaks(planner)
    lowest = min(peaks)
    ties = [k for k, peak in enumerate(peaks) if peak == lowest]
    found = prefixes(planner.graph, planner.every_block()) if len(ties) > 1 else None
    if found is not None:
        every = planner.every_block()

        def seconds(k: int) -> float:
            overheads = sum(planner.region_overheads(every[:k]))
            return recompute_seconds(planner.op_seconds, found.recompute_ops(k), overheads)

        ties = [min(ties, key=seconds)]
    plans = [_plan(planner, k, None) for k in ties]
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
