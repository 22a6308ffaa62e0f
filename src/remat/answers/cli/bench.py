"""`remat bench`: each strategy applied to the real model, its peak, step time and gradients
measured."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape

from remat.answers.cli.common import DTYPES, planner_for, title_of, writable

if TYPE_CHECKING:
    from remat.planning.planner import Planner


#: What `remat bench` compares by default: remat's plans and the baselines users write.
BENCH_STRATEGIES = (
    "store_all,full,sqrt,selective:megatron,chain_dp,auto,"
    "torch:checkpoint-per-block,torch:checkpoint_sequential"
)


def cmd_bench(args: argparse.Namespace, console: Console) -> int:
    writable(args.json, "--json")
    writable(args.plot, "--plot")
    writable(args.html, "--html")
    return show_bench(planner_for(args, console), args, console)


def show_bench(planner: Planner, args: argparse.Namespace, console: Console) -> int:
    from remat import models
    from remat.answers.bench import (
        BenchInterrupted,
        BenchRow,
        bench,
        bench_compiled,
        progress_total,
        quartile_range,
    )
    from remat.answers.plots import plot_bench
    from remat.answers.report import bench_table
    from remat.applying import tune_steps
    from remat.planning.plans import describe_budget
    from remat.units import format_bytes

    model, inputs = models.build(
        args.model,
        batch=args.batch,
        seq=args.seq,
        dtype=DTYPES[args.dtype],
        device=args.device,
        tiny=args.tiny,
        **models.parse_overrides(args.set),
    )
    names = _bench_names(args)
    with console.status(f"resolving the budget {args.budget} ..."):
        budget_bytes = planner.budget_bytes(args.budget)
    console.print(
        f"budget {args.budget}: {format_bytes(budget_bytes)} ({describe_budget(args.budget)}), "
        "for every row"
    )
    title = (
        f"{title_of(args, planner)}, measured on {args.device}, budget {format_bytes(budget_bytes)}"
    )
    rows: list[BenchRow] = []
    try:
        with _progress(console, progress_total(names, args.steps, args.compile)) as advance:
            rows = bench(
                model, inputs, planner, names, budget=budget_bytes, steps=args.steps,
                progress=advance, tune_rounds=1 if getattr(args, "quick", False) else tune_steps.ROUNDS,
            )  # fmt: skip
            if args.compile:
                base = next(r for r in rows if r.strategy == "store_all")
                rows += bench_compiled(
                    model,
                    inputs,
                    budget=budget_bytes,
                    steps=args.steps,
                    compiler=args.compiler,
                    profile=args.profile,
                    base_seconds=base.step_seconds,
                    base_range=quartile_range(list(base.rounds)),
                    progress=advance,
                )
    except KeyboardInterrupt as stopped:  # what was measured is still worth a table
        done = stopped.rows if isinstance(stopped, BenchInterrupted) else rows
        rounds = stopped.rounds if isinstance(stopped, BenchInterrupted) else args.steps
        if done:
            console.print(
                bench_table(
                    done,
                    title=f"{title} (interrupted: {len(done)} rows measured, "
                    f"{rounds} of {args.steps} timing rounds)",
                    budget_bytes=budget_bytes,
                )
            )
        raise

    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "model": args.model,
                    "batch": args.batch,
                    "seq": args.seq,
                    "dtype": args.dtype,
                    "device": args.device,
                    "budget": args.budget,
                    "budget_bytes": budget_bytes,
                    "rows": [r.to_dict() for r in rows],
                },
                f,
                indent=2,
            )
    console.print(bench_table(rows, title=title, budget_bytes=budget_bytes))
    failed = [r for r in rows if not r.ran]
    if failed:
        console.print(
            f"[yellow]{len(failed)} of {len(rows)} rows could not run:[/yellow] "
            + escape("; ".join(f"{r.strategy} ({r.note.split(';')[0]})" for r in failed))
        )
    if args.plot:
        plot_bench(
            rows,
            planner.pareto(),
            planner.step_seconds,
            args.plot,
            title=title,
            budget_bytes=budget_bytes,
        )
        console.print(f"plot written to {escape(args.plot)}")
    if args.html:
        from remat.answers.html import write_report

        write_report(args.html, planner, title=title, budget_bytes=budget_bytes, bench_rows=rows)
        console.print(f"report written to {escape(args.html)}")
    return 0


def _bench_names(args: argparse.Namespace) -> list[str]:
    """The rows to measure: --strategies, or the defaults plus Hugging Face's own gradient
    checkpointing for hf: models (the only ones it applies to)."""
    text = args.strategies or BENCH_STRATEGIES + (
        ",hf:gradient_checkpointing" if args.model.startswith("hf:") else ""
    )
    return [s.strip() for s in text.split(",") if s.strip()]


@contextlib.contextmanager
def _progress(console: Console, total: int) -> Iterator[Callable[[str], None]]:
    """A progress bar on a terminal; on a pipe (where rich draws nothing) one line per step on
    stderr, so a long bench shows that it moves."""
    from rich.progress import Progress

    if not console.is_terminal:
        done = 0

        def line(name: str) -> None:
            nonlocal done
            done += 1
            print(f"[{done}/{total}] measuring {name}", file=sys.stderr, flush=True)

        yield line
        return
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task("measuring", total=total)
        yield lambda name: bar.update(task, advance=1, description=f"measuring {name}")
