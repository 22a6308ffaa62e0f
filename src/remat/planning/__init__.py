"""Planning: what to keep under a budget. `plans` (the `Plan` value), `planner` (the `Planner` and
the strategy registry), `joint` (one compiled joint graph as strategies see it), `strategies/` (one
file each), `solvers/` (pure solvers). Torch-free; imports the base, `device` and `prediction`."""
