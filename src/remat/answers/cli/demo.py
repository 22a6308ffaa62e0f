"""`remat demo`: estimate, plan, apply and measure on a narrowed GPT-2 (138 s measured on this
project's 2 shared cores under load: no time is promised in --help)."""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.markup import escape

from remat.answers.cli.bench import show_bench
from remat.answers.cli.common import planner_for
from remat.answers.cli.estimate import show_estimate
from remat.answers.cli.plan import show_plan

#: The demo's model: GPT-2's architecture, narrowed so a real training step takes about a second
#: on a 2-core CPU and activations dominate (so a 50% budget has room to work).
DEMO = {
    "model": "gpt2",
    "batch": 4,
    "seq": 256,
    "dtype": "fp32",
    "set": ["n_layer=6", "n_embd=256", "n_head=8", "vocab_size=4096"],
}
#: REMAT_QUICK=1 (QUICK_ENV, as tests run it): every step on the same architecture, half as wide
#: and half as long, so its profiled steps take a fraction of the time and activations still
#: dominate.
QUICK_DEMO = {"seq": 128, "set": ["n_layer=6", "n_embd=128", "n_head=4", "vocab_size=2048"]}
DEMO_STRATEGIES = "store_all,full,sqrt,auto,torch:checkpoint-per-block"


def cmd_demo(args: argparse.Namespace, console: Console) -> int:
    from pathlib import Path

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    demo = argparse.Namespace(
        **{**DEMO, **QUICK_DEMO} if args.quick else DEMO,
        tiny=False,
        trace_device="meta",
        optimizer=None,
        profile="cpu",
        json=False,
        top=6,
        budget="50%",
        strategy="auto",
        explain=False,
        out=str(out / "plan.json"),
        plot=str(out / "pareto.png"),
        strategies=DEMO_STRATEGIES,
        device="cpu",
        steps=2 if args.quick else 5,  # REMAT_QUICK=1 (QUICK_ENV), as tests run it
        quick=args.quick,
        compile=False,
        compiler="inductor",
        html=None,
    )
    console.rule("1. estimate: activation memory and the peak of a training step (fake tensors)")
    planner = planner_for(demo, console)  # one trace and one frontier for the three steps
    show_estimate(
        planner.graph, planner.estimate, demo, console, planner.graph.info["trace_seconds"]
    )
    console.rule("2. plan: every strategy at a 50% budget, and the Pareto frontier")
    show_plan(planner, demo, console)
    console.rule("3. apply and measure: real CPU steps, side by side with the baselines")
    demo.json, demo.plot = str(out / "bench.json"), str(out / "bench.png")
    show_bench(planner, demo, console)
    console.print(
        f"[bold]results in {escape(str(out))}/[/bold]: plan.json, pareto.png, bench.json, bench.png"
    )
    return 0
