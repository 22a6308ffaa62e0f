"""The strategies, one file each, found by name through the registry (kept in
`remat.planning.planner`, which runs them) that `remat.plan`, `auto`, `pareto`,
the compiled backend, the CLI's help and the docs read.

A strategy is one `Strategy` value registered at import. The package imports each of its modules
the first time the registry is read, so adding a built-in strategy is adding one file here; a
strategy of your own is `register(Strategy(...))` in any module you import before planning.

A strategy supports the eager path when it has `solve(planner, budget_bytes) -> Plan` (on the
traced step, with the planner's helpers: `Planner.every_block`, `block_regions`, `fit`, `chain`,
`block_problem`, `make_plan`), and the compiled path when it has
`solve_compiled(joint, budget_bytes) -> SaveSet` (on one joint graph inside torch.compile, with
`remat.planning.joint.JointContext`'s helpers). Eager and compiled share one namespace: `mincut` is the
memory-traffic min-cut on whichever graph it is given. Solve functions are pure: no torch.
"""

from remat.planning.planner import PlanPath, Strategy, available, get, register, unregister

__all__ = ["PlanPath", "Strategy", "available", "get", "register", "unregister"]
