"""`remat plan` and `remat report`: what to keep and recompute under a budget, every strategy
compared, with the frontier plot, the HTML report and the plan file."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape

from remat.answers.cli.common import planner_for, title_of, writable
from remat.answers.cli.fit import fit_report
from remat.errors import RematError

if TYPE_CHECKING:
    from remat.planning.planner import Planner


def cmd_plan(args: argparse.Namespace, console: Console) -> int:
    from remat.planning import strategies

    strategies.get(args.strategy, "eager")  # bad input fails before the trace
    if getattr(args, "gpu", None) or getattr(args, "capacity", None):
        _report_precision(args)
    writable(args.out, "--out")
    writable(args.plot, "--plot")
    writable(args.html, "--html")
    return show_plan(planner_for(args, console), args, console)


def show_plan(planner: Planner, args: argparse.Namespace, console: Console) -> int:
    from remat.answers.plots import plot_frontier
    from remat.answers.report import explain_table, plan_dict, plan_table
    from remat.planning.plans import describe_budget
    from remat.units import format_bytes

    with console.status(f"resolving the budget {args.budget} ..."):
        budget_bytes = planner.budget_bytes(args.budget)
    layout = planner.graph.info.get("layout")
    if not args.json:
        if layout:  # --tp / --cp: whose plan sharded which modules
            console.print(f"one rank of {layout}", markup=False)
        console.print(
            f"budget {args.budget}: {format_bytes(budget_bytes)} ({describe_budget(args.budget)})"
        )
    with console.status(f"planning {args.strategy} under {format_bytes(budget_bytes)} ..."):
        rows = planner.compare(budget_bytes)
        chosen = planner.plan(budget_bytes, args.strategy)
    step_seconds = planner.step_seconds
    context = {
        "model": args.model,
        "batch": args.batch,
        "seq": args.seq,
        "dtype": args.dtype,
        "budget": args.budget,
        **({"layout": layout} if layout else {}),
    }
    if args.out:
        with open(args.out, "w") as f:
            f.write(chosen.to_json())
    if args.plot:
        with console.status("sweeping budgets for the Pareto frontier ..."):
            plot_frontier(
                planner.pareto(),
                args.plot,
                title=f"{title_of(args, planner)}: predicted memory / recompute frontier",
                budget_bytes=budget_bytes,
                chosen=chosen,
                step_seconds=step_seconds,
            )
    if args.html:
        from remat.answers.html import write_report

        fitted = None
        if getattr(args, "gpu", None) or getattr(args, "capacity", None):
            fitted = fit_report(args, console, _report_precision(args), shard=1).table_rows()
        with console.status("writing the HTML report ..."):
            write_report(
                args.html,
                planner,
                title=title_of(args, planner),
                budget_bytes=budget_bytes,
                chosen=chosen,
                fit_rows=fitted,
            )
    if args.json:
        d = plan_dict(chosen, **context)
        d["comparison"] = [
            {
                "strategy": row.strategy,
                "note": row.note,
                **(
                    {}
                    if row.plan is None
                    else {
                        "predicted_peak_bytes": row.plan.predicted_peak_bytes,
                        "held_bytes": row.plan.held_bytes,
                        "recompute_flops": row.plan.recompute_flops,
                        "recompute_seconds": row.plan.recompute_seconds,
                        "host_bytes": row.plan.host_bytes,
                        "transfer_seconds": row.plan.transfer_seconds,
                    }
                ),
            }
            for row in rows
        ]
        print(json.dumps(d, indent=2))
        return 0
    console.print(plan_table(rows, chosen, step_seconds, budget_bytes))
    if args.explain:
        console.print(explain_table(chosen.explain(planner.graph)))
    console.print(
        f"[bold]chosen: {chosen.strategy}[/bold]: predicted peak {format_bytes(chosen.predicted_peak_bytes)}, "
        f"{_step_time_words(chosen, step_seconds, planner.profile.name)}\n{escape(chosen.reason)}"
    )
    regions = ", ".join(
        r.modules[0]
        + (f"..{r.modules[-1]}" if len(r.modules) > 1 else "")
        + (f" (keeps {len(r.keep)} ops)" if r.keep else "")
        for r in chosen.regions
    )
    console.print(f"checkpoint regions: {escape(regions) or 'none'}")
    if chosen.offload:
        console.print(
            f"offloaded to host memory: the saves of {escape(', '.join(chosen.offload))} "
            f"({format_bytes(chosen.host_bytes)} on the host, "
            f"{chosen.transfer_seconds * 1e3:.3g} ms of copies not hidden by compute)"
        )
    saved = args.out or "plan.json"
    apply_line = f'remat.apply(model, remat.Plan.from_json(open("{saved}").read()))'
    if args.out:
        console.print(
            f"plan written to {escape(args.out)}; to use it in the training script:", soft_wrap=True
        )
    elif chosen.regions or chosen.offload:
        console.print(f"to use it: --out {escape(saved)}, then in the training script:")
    if args.out or chosen.regions or chosen.offload:
        console.print(f"  {escape(apply_line)}", soft_wrap=True, highlight=False)
    if args.plot:
        console.print(f"frontier plotted to {escape(args.plot)}")
    if args.html:
        console.print(f"report written to {escape(args.html)}")
    return 0


def _report_precision(args: argparse.Namespace) -> str:
    """The fit precision of `remat report --gpu`: the model's --dtype, where fit has it."""
    from remat.answers.fit_steps import PRECISIONS

    if args.dtype not in PRECISIONS:
        raise RematError(
            f"the report's fit table runs at --dtype fp32 or bf16, not {args.dtype}; "
            "`remat fit --precision ...` covers mixed precision"
        )
    return args.dtype


def _step_time_words(plan: Any, step_seconds: float, profile: str) -> str:
    """What a plan costs, time first: FLOPs alone mislead where the recomputed ops move memory
    (norms, activations) rather than multiply."""
    if not plan.added_seconds:
        return "no recompute"
    time = f"{plan.added_seconds / step_seconds:+.1%} predicted step time on the {profile} profile"
    if plan.offload:
        return f"{time} (recompute and the copies to host memory no compute hides)"
    share = plan.recompute_flops_share
    if share < 0.005:
        return f"{time} (the recomputed ops move memory; they add almost no FLOPs)"
    return f"{time} (recomputing {share:.1%} of the forward's FLOPs)"
