"""remat: decide which activations a training step keeps and which it recomputes, under a budget.

Data flows one way: `trace` (model -> Graph) -> `estimate` (Graph -> MemoryEstimate) -> plan ->
apply -> `measure` (the independent ground truth) -> report. Each stage is a folder (docs/architecture.md).
"""

import sys

from remat import _moved
from remat._version import __version__ as __version__
from remat.collector import collector_paused

# torch and the stages: what they make lives as long as the process, so the collector need not
# walk it on the way (`remat.collector`)
with collector_paused():
    from remat.applying.auto import auto
    from remat.applying.eager import (
        Verification,
        apply,
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
        SequenceLimitError,
        StatefulModuleError,
        StrategyRefused,
        TraceError,
        UnknownModelError,
        UnknownProfileError,
        UnknownStrategyError,
    )
    from remat.graph import Graph
    from remat.measuring.measure import Measurement, measure
    from remat.planning import strategies as strategies  # remat.strategies.available(), register()
    from remat.planning.offload import OffloadSettings
    from remat.planning.planner import Frontier, Planner, pareto, plan
    from remat.planning.plans import Plan
    from remat.planning.strategies import Strategy
    from remat.prediction.compiled_estimate import CompiledEstimate, estimate_compiled
    from remat.prediction.estimate import MemoryEstimate, estimate
    from remat.tracing.trace import trace

_moved.install()
# Old paths named like a function of remat's: an import of them must not rebind the function.
for _name in ("estimate", "measure", "trace"):
    sys.modules.setdefault(f"remat.{_name}", sys.modules[_moved.new_path(f"remat.{_name}")])

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
    "OffloadSettings",
    "Plan",
    "Planner",
    "RematError",
    "RematWarning",
    "SequenceLimitError",
    "StatefulModuleError",
    "Strategy",
    "StrategyRefused",
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


def __getattr__(name: str):
    """`remat.compile` and `remat.backend` import torch's inductor (seconds): only when used."""
    if name in ("compile", "backend"):
        from remat.applying import compiled

        return getattr(compiled, name)
    raise AttributeError(f"module 'remat' has no attribute {name!r}")
