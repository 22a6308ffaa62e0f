"""remat: decide which activations a training step keeps and which it recomputes, under a budget.

Data flows one way: `trace` (model -> Graph) -> `estimate` (Graph -> MemoryEstimate) -> plan ->
apply -> `measure` (the independent ground truth) -> report.
"""

from remat.compiled_estimate import CompiledEstimate, estimate_compiled
from remat.eager import (
    Verification,
    apply,
    auto,
    checkpointed_elsewhere,
    installed_plan,
    remove,
    verify,
)
from remat.errors import (
    BudgetError,
    InfeasibleBudget,
    NoBlocksError,
    PlanFormatError,
    RematError,
    RematWarning,
    StatefulModuleError,
    TraceError,
    UnknownModelError,
    UnknownProfileError,
    UnknownStrategyError,
)
from remat.estimate import MemoryEstimate, estimate
from remat.graph import Graph
from remat.measure import Measurement, measure
from remat.planner import Frontier, Planner, pareto, plan
from remat.plans import Plan
from remat.strategies import Strategy
from remat.trace import trace

__all__ = [
    "Frontier",
    "Graph",
    "BudgetError",
    "CompiledEstimate",
    "InfeasibleBudget",
    "NoBlocksError",
    "PlanFormatError",
    "Measurement",
    "MemoryEstimate",
    "Plan",
    "Planner",
    "RematError",
    "RematWarning",
    "StatefulModuleError",
    "Strategy",
    "TraceError",
    "UnknownModelError",
    "UnknownProfileError",
    "UnknownStrategyError",
    "Verification",
    "apply",
    "auto",
    "backend",
    "checkpointed_elsewhere",
    "installed_plan",
    "compile",
    "estimate",
    "estimate_compiled",
    "measure",
    "pareto",
    "plan",
    "remove",
    "trace",
    "verify",
]
__version__ = "0.4.0"


def __getattr__(name: str):
    """`remat.compile` and `remat.backend` import torch's inductor (seconds): only when used."""
    if name in ("compile", "backend"):
        from remat import compiled

        return getattr(compiled, name)
    raise AttributeError(f"module 'remat' has no attribute {name!r}")
