"""Every strategy at 25/50/75% budgets, with the Pareto plot, for the docs (docs/strategies.md).

Run: python benchmarks/strategies_table.py > /tmp/tables.md   (plots go to docs/img/)
"""

from __future__ import annotations

from pathlib import Path

import remat
from remat import models
from remat.planner import STRATEGIES, Context, compare, pareto, plan_in
from remat.plans import resolve_budget
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


def table(name: str, kw: dict, device: str) -> str:
    graph = remat.trace(*_build(name, kw))
    ctx = Context.from_graph(graph, device)
    step_flops = sum(op.flops for op in graph.ops)
    est = ctx.estimate
    lines = [
        f"### {name} ({', '.join(f'{k} {v}' for k, v in kw.items())}), costs on {device}",
        "",
        f"store-all peak {format_bytes(est.peak_bytes)}, of which fixed (params, grads) "
        f"{format_bytes(est.fixed_bytes)} and activations {format_bytes(est.activation_bytes)}.",
        "",
        "| budget | strategy | predicted peak | kept activations | extra FLOPs (% of step) | recompute time (% of step) | |",
        "| --- | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    step_seconds = sum(ctx.op_seconds)
    for share in ("75%", "50%", "25%"):
        budget = resolve_budget(share, est.fixed_bytes, est.peak_bytes)
        chosen = None
        try:
            chosen = plan_in(ctx, budget, "auto")
        except remat.InfeasibleBudget as e:
            auto_note = f"infeasible: smallest feasible {format_bytes(e.min_feasible_bytes)}"
        for strategy, p, note in compare(ctx, budget):
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
    pareto(ctx).plot(str(png), title=f"{name} {kw} on {device}")
    lines += ["", f"![Pareto frontier of {name}](img/{png.name})", ""]
    return "\n".join(lines)


def _build(name, kw):
    model, inputs = models.build(name, **kw)
    return (model, *inputs)


if __name__ == "__main__":
    assert set(STRATEGIES)
    for case in CASES:
        print(table(*case))
