"""The strategies, one file each, found by name: the registry that `remat.plan`, `auto`, `pareto`,
the compiled backend, the CLI's help and the docs read.

A strategy is one `Strategy` value registered at import. The package imports each of its modules
the first time the registry is read, so adding a built-in strategy is adding one file here; a
strategy of your own is `register(Strategy(...))` in any module you import before planning.

A strategy supports the eager path when it has `solve(planner, budget_bytes) -> Plan` (on the
traced step, with the planner's helpers: `Planner.every_block`, `block_regions`, `fit`, `chain`,
`block_problem`, `make_plan`), and the compiled path when it has
`solve_compiled(joint, budget_bytes) -> SaveSet` (on one joint graph inside torch.compile, with
`remat.applying.compiled.JointContext`'s helpers). Eager and compiled share one namespace: `mincut` is the
memory-traffic min-cut on whichever graph it is given. Solve functions are pure: no torch.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from remat.errors import RematError, UnknownStrategyError

if TYPE_CHECKING:
    from remat.applying.compiled import JointContext
    from remat.planning.planner import Planner
    from remat.planning.plans import Plan
    from remat.planning.solvers.saveset import SaveSet

PlanPath = Literal["eager", "compile"]


@dataclass(frozen=True)
class Strategy:
    """A named way to choose what to keep.

    `budgeted`: it searches for the cheapest plan under the budget (a fixed strategy gives the same
    plan at every budget, and is judged against it afterwards). `needs_blocks`: it checkpoints the
    model's repeated blocks, so it needs some. `appliable`: `remat.apply` can run its eager plans
    (`store_none` is a reference point with no flat-region form). `lowest_peak`: the plan with the
    lowest peak it can make, for a budgeted strategy that has one (fixed strategies have one plan).
    `rank` orders tables and help."""

    name: str
    summary: str
    solve: Callable[[Planner, int], Plan] | None = None
    solve_compiled: Callable[[JointContext, int | None], SaveSet] | None = None
    budgeted: bool = False
    needs_blocks: bool = False
    appliable: bool = True
    lowest_peak: Callable[[Planner], Plan] | None = None
    rank: int = 50

    @property
    def paths(self) -> tuple[PlanPath, ...]:
        """Where it plans: the eager step, inside torch.compile, or both."""
        eager: tuple[PlanPath, ...] = ("eager",) if self.solve else ()
        return eager + (("compile",) if self.solve_compiled else ())


_REGISTRY: dict[str, Strategy] = {}
_discovered = False


def register(strategy: Strategy) -> Strategy:
    """Make `strategy` available by its name everywhere (replacing one of the same name)."""
    if not strategy.solve and not strategy.solve_compiled:
        raise RematError(f"strategy {strategy.name!r} has neither solve nor solve_compiled")
    _REGISTRY[strategy.name] = strategy
    return strategy


def unregister(name: str) -> None:
    """Remove the strategy called `name` (a no-op when there is none)."""
    _REGISTRY.pop(name, None)


def _discover() -> None:
    global _discovered
    if not _discovered:
        _discovered = True
        for info in pkgutil.iter_modules(__path__):
            importlib.import_module(f"{__name__}.{info.name}")


def available(path: PlanPath | None = None) -> list[Strategy]:
    """Every registered strategy (those supporting `path`, if given), in table order."""
    _discover()
    found = [s for s in _REGISTRY.values() if path is None or path in s.paths]
    return sorted(found, key=lambda s: (s.rank, s.name))


def get(name: str, path: PlanPath | None = None) -> Strategy:
    """The strategy called `name`; `UnknownStrategyError` naming the choices when there is none
    (for that path)."""
    _discover()
    strategy = _REGISTRY.get(name)
    if strategy is None or (path is not None and path not in strategy.paths):
        choices = tuple(s.name for s in available(path))
        what = f"has no {path} path" if strategy else "is unknown"
        raise UnknownStrategyError(
            f"strategy {name!r} {what}: choose one of {', '.join(choices)}",
            name=name,
            choices=choices,
        )
    return strategy
