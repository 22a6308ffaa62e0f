"""Every strategy at 25/50/75% budgets, with the Pareto plot, for the docs (docs/strategies.md).

Run: python benchmarks/strategies_table.py > /tmp/tables.md   (plots go to docs/img/)
"""

from __future__ import annotations

from pathlib import Path

import remat
from remat import models
from remat.answers.plots import plot_frontier
from remat.units import format_bytes

CASES = [
    ("gpt2", {"batch": 8, "seq": 1024, "dtype": "fp32"}, "cpu"),
    ("llama-3.1-8b", {"batch": 1, "seq": 8192, "dtype": "bf16"}, "h100"),
    (
        "megatron-gpt",
        {"batch": 1, "seq": 2048, "dtype": "bf16", "n_layers": 24, "d_model": 2048, "n_heads": 16},
        "h100",
    ),
]
IMG = Path(__file__).resolve().parents[1] / "docs" / "img"


def table(name: str, kw: dict, profile: str) -> str:
    graph = remat.trace(*_build(name, kw))
    planner = remat.Planner(graph, profile)
    step_flops = sum(op.flops for op in graph.ops)
    est = planner.estimate
    lines = [
        f"### {name} ({', '.join(f'{k} {v}' for k, v in kw.items())}), costs on {profile}",
        "",
        f"store-all peak {format_bytes(est.peak_bytes)}, of which fixed (params, grads) "
        f"{format_bytes(est.fixed_bytes)} and activations {format_bytes(est.activation_bytes)}.",
        "",
        "| budget | strategy | predicted peak | kept activations | extra FLOPs (% of step) | recompute time (% of step) | |",
        "| --- | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    step_seconds = planner.step_seconds
    for share in ("75%", "50%", "25%"):
        budget = planner.budget_bytes(share)
        chosen = None
        try:
            chosen = planner.plan(budget, "auto")
        except remat.InfeasibleBudget as e:
            auto_note = f"infeasible: smallest feasible {format_bytes(e.min_feasible_bytes)}"
        for row in planner.compare(budget):
            strategy, p, note = row.strategy, row.plan, row.note
            if p is None:
                lines.append(
                    f"| {share} ({format_bytes(budget)}) | {strategy} | - | - | - | - | {note} |"
                )
                continue
            mark = (
                " **(auto)**"
                if chosen is not None and chosen.strategy == f"auto ({strategy})"
                else ""
            )
            lines.append(
                f"| {share} ({format_bytes(budget)}) | {strategy}{mark} | {format_bytes(p.predicted_peak_bytes)} | "
                f"{format_bytes(p.held_bytes)} | {p.recompute_flops / step_flops:.1%} | "
                f"{p.recompute_seconds / step_seconds:.1%} | {note} |"
            )
        if chosen is None:
            lines.append(
                f"| {share} ({format_bytes(budget)}) | auto | - | - | - | - | {auto_note} |"
            )
    png = IMG / f"pareto-{name}.png"
    budget = planner.budget_bytes("50%")
    try:
        chosen = planner.plan(budget, "auto")
    except remat.InfeasibleBudget:
        chosen = None
    plot_frontier(
        planner.pareto(),
        str(png),
        title=f"{name} ({', '.join(f'{k} {v}' for k, v in kw.items())}), costs on {profile}: "
        "predicted memory / recompute frontier, auto at 50%",
        budget_bytes=budget,
        chosen=chosen,
        step_seconds=planner.step_seconds,
    )
    lines += ["", f"![Pareto frontier of {name}](img/{png.name})", ""]
    return "\n".join(lines)


def _build(name, kw):
    model, inputs = models.build(name, **kw)
    return (model, *inputs)


if __name__ == "__main__":
    for case in CASES:
        print(table(*case))
