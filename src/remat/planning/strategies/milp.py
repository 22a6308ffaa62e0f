"""An option per block by integer programming (scipy's HiGHS): store, full, or a selective policy
for each block, at the least recompute time whose peak fits the budget. On the compiled path: the
cheapest save set of the joint graph (recompute + memory traffic) whose predicted peak fits."""

from __future__ import annotations

from typing import TYPE_CHECKING

from remat.planning.strategies import Strategy, register
from remat.quiet import quiet_fd

if TYPE_CHECKING:
    from remat.planning.joint import JointContext
    from remat.planning.planner import Attempt, Planner
    from remat.planning.plans import Plan
    from remat.planning.solvers.milp import MilpResult
    from remat.planning.solvers.saveset import SaveSet


def attempt_of(planner: Planner, result: MilpResult) -> Attempt:
    """The regions and offloaded blocks of a MILP answer on `planner`'s blocks."""
    from remat.planning.offload import OPTIONS, PARTIAL
    from remat.planning.planner import Attempt

    names = result.option_names[1:]
    regions = tuple(
        region
        for b, option in enumerate(names)
        if OPTIONS.get(option, option) != "store" and not option.startswith(PARTIAL)
        for region in planner.block_regions([[b]], OPTIONS.get(option, option))
    )
    offload = tuple(b for b, o in enumerate(names) if o in OPTIONS or o.startswith(PARTIAL))
    some = {  # a stored block offloading the first k of its storages in save order
        planner.blocks[b].path: tuple(range(int(o.removeprefix(PARTIAL))))
        for b, o in enumerate(names)
        if o.startswith(PARTIAL)
    }
    status = "optimal" if result.status == "optimal" else "feasible"
    details = {"mip_gap": result.mip_gap, "options": list(names)}
    return Attempt(regions, result.reason, status, details, offload, some)


def solve(planner: Planner, budget_bytes: int) -> Plan:
    from remat.planning.solvers import milp

    problem = planner.block_problem()

    def attempt(target: int) -> Attempt:
        with quiet_fd(1):
            return attempt_of(planner, milp.milp(problem, target))

    return planner.fit(budget_bytes, attempt, "milp")


def lowest_peak(planner: Planner) -> Plan:
    """The block options whose peak is the lowest of all (the MILP at its least feasible budget)."""
    from remat.planning.solvers import milp

    problem = planner.block_problem()
    with quiet_fd(1):
        found = attempt_of(planner, milp.milp(problem, milp.min_peak(problem)))
    return planner.plan_of(found, "milp", None)


def solve_compiled(joint: JointContext, budget_bytes: int | None) -> SaveSet:
    return joint.cheapest_within(budget_bytes)


STRATEGY = register(
    Strategy(
        name="milp",
        summary="an option per block by integer programming (HiGHS); compiled: the cheapest "
        "save set within the budget",
        solve=solve,
        solve_compiled=solve_compiled,
        budgeted=True,
        needs_blocks=True,
        lowest_peak=lowest_peak,
        rank=70,
    )
)
