"""The fastest plan that fits: every other appliable strategy in the registry is solved at the
budget and the one with the least predicted recompute time among those that fit wins. Compiled:
the min-cut when it fits the budget (least traffic), else the cheapest save set within it."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from remat.errors import InfeasibleBudget, RematError, StrategyRefused
from remat.planning.strategies import Strategy, available, get, register
from remat.units import format_bytes

if TYPE_CHECKING:
    from remat.planning.joint import JointContext
    from remat.planning.planner import Planner
    from remat.planning.plans import Plan
    from remat.planning.solvers.saveset import SaveSet


def solve(planner: Planner, budget_bytes: int) -> Plan:
    candidates: list[Plan] = []
    #: strategy -> what became of it: fits, over the budget, or refused and why
    outcomes: dict[str, str] = {}
    refused: dict[str, str] = {}
    for strategy in available("eager"):
        if strategy.name == "auto" or not strategy.appliable:
            continue
        if strategy.needs_blocks and not planner.blocks:
            continue
        try:
            p = planner.solve(strategy, budget_bytes)
        except StrategyRefused as e:  # this step, at any budget: the others still answer
            refused[strategy.name] = _first_sentence(e)
        except InfeasibleBudget as e:
            outcomes[strategy.name] = f"no plan within the budget: {_first_sentence(e)}"
            continue
        except RematError as e:  # any other refusal of one candidate ends only that candidate
            refused[strategy.name] = _first_sentence(e)
        else:
            peak = format_bytes(p.predicted_peak_bytes)
            if p.predicted_peak_bytes <= budget_bytes:
                candidates.append(p)
                recompute = f"+{p.recompute_seconds * 1e3:.3g} ms recompute"
                if p.offload:
                    recompute += f", +{p.transfer_seconds * 1e3:.3g} ms copies not hidden"
                outcomes[strategy.name] = f"fits: peak {peak}, {recompute}"
            else:
                outcomes[strategy.name] = f"over the budget: peak {peak}"
            continue
        outcomes[strategy.name] = f"refused: {refused[strategy.name]}"
    left_out = "; ".join(f"{name} refused ({why})" for name, why in refused.items())
    if not candidates:
        smallest = planner.lowest_peak()
        raise InfeasibleBudget(
            f"no strategy fits {format_bytes(budget_bytes)}; the smallest feasible budget is "
            f"{format_bytes(smallest.predicted_peak_bytes)} ({smallest.predicted_peak_bytes} bytes)"
            f". {planner.what_the_peak_holds(smallest.predicted_peak_bytes)}"
            + (f" ({left_out})" if left_out else "")
            + _short_by_the_inputs(smallest.predicted_peak_bytes - budget_bytes, planner)
            + _no_blocks(planner),
            budget_bytes=budget_bytes,
            min_feasible_bytes=smallest.predicted_peak_bytes,
        )
    best = min(candidates, key=lambda p: (p.added_seconds, p.predicted_peak_bytes))
    others = ", ".join(
        f"{p.strategy} +{p.added_seconds * 1e3:.2f} ms" for p in candidates if p is not best
    )
    return replace(
        best,
        strategy=f"auto ({best.strategy})",
        # a choice among candidates: "optimal" only where the chosen one was proved so
        status="feasible" if best.status == "fixed" else best.status,
        reason=f"fastest that fits: {best.reason}"
        + (f"; other fits: {others}" if others else "")
        + (f"; {left_out}" if left_out else ""),
        details={**best.details, "candidates": outcomes},
    )


def _short_by_the_inputs(short: int, planner: Planner) -> str:
    """Where the budget misses by no more than the step's inputs, why it may have (issue 38: a
    harness took the peak from the profiler's events plus the parameters, 11,328 B short)."""
    inputs = planner.estimate.input_bytes
    if not 0 < short <= inputs:
        return ""
    return (
        f". The budget is {short} bytes short, no more than the inputs' {inputs} bytes: the budget "
        "is the whole step's peak, inputs included; a peak read from a profiler or an allocator "
        "counter started after the inputs existed leaves them out (remat.measure's peak_bytes "
        "counts them)"
    )


def _no_blocks(planner: Planner) -> str:
    """Why nothing but store-all was tried, where the model has no blocks for regions."""
    if planner.blocks or planner.reversible_blocks:
        return ""
    return (
        ". No strategy but store_all could run: checkpoint regions wrap repeated blocks, and this "
        "model has none (no numbered submodules such as layers.0, layers.1, and no module its "
        "forward calls more than once). Hold the repeated layers in an nn.ModuleList, or use "
        "remat.compile, which plans inside the compiled graph"
    )


def _first_sentence(error: Exception) -> str:
    """The part of a strategy's error that says why (its advice follows the first '. ')."""
    return str(error).split(". ")[0].rstrip(".")


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
