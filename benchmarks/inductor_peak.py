"""remat.compile's predicted peak against the measured one under inductor (issue 11, item 1).

    python benchmarks/inductor_peak.py [--models gpt2 llama-3.2-1b gpt2-style]
                                       [--budgets 100% 85% 70% 60% 50%]

For each model and budget: `remat.compile(model, budget, strategy="auto")` under inductor, one
measured training step (`remat.measure`), and the plan's predicted peak, which comes from
inductor's own buffer plan (src/remat/prediction/inductor_plan.py). gpt2 and llama-3.2-1b are the tiny
presets at batch 4, seq 64; gpt2-style is the issue's GPT-2-style model (12 layers, d 768, vocab
8192, seq 256, batch 4). Prints a markdown table (predicted, measured, their difference, the
budget, whether the measured peak is within it, compile time and how many of inductor's plans
were read) and writes benchmarks/results/inductor-peak.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

import remat
from remat import models
from remat.applying.compiled import plans_of, remat_error_cause
from remat.units import format_bytes

GPT2_STYLE = {"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 8192}


def _build(name: str) -> tuple[torch.nn.Module, tuple]:
    torch.manual_seed(0)
    if name == "gpt2-style":
        return models.build("gpt2", batch=4, seq=256, device="cpu", **GPT2_STYLE)
    return models.build(name, batch=4, seq=64, device="cpu", tiny=True)


def run(name: str, budget: str) -> dict:
    model, inputs = _build(name)
    torch._dynamo.reset()
    start = time.perf_counter()
    compiled = remat.compile(model, budget=budget, strategy="auto")
    try:
        measured = remat.measure(compiled, *inputs)
    except Exception as err:
        cause = remat_error_cause(err) or err
        return {"model": name, "budget": budget, "error": str(cause)}
    (plan,) = plans_of(compiled)
    return {
        "model": name,
        "budget": budget,
        "budget_bytes": plan.budget_bytes,
        "strategy": plan.strategy,
        "peak_model": plan.details.get("peak_model"),
        "inductor_plans_read": plan.details.get("inductor_plans_read"),
        "predicted_peak_bytes": plan.predicted_peak_bytes,
        "measured_peak_bytes": measured.peak_bytes,
        "held_bytes": plan.held_bytes,
        "seconds": time.perf_counter() - start,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["gpt2", "llama-3.2-1b", "gpt2-style"])
    parser.add_argument("--budgets", nargs="+", default=["100%", "85%", "70%", "60%", "50%"])
    parser.add_argument("--out", default="benchmarks/results/inductor-peak.json")
    args = parser.parse_args(argv)
    rows = []
    print(
        "| model | budget | predicted | measured | measured - predicted | within budget "
        "| saved | compile + step | plans read |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.models:
        for budget in args.budgets:
            print(f"{name} at {budget} ...", file=sys.stderr)
            row = run(name, budget)
            rows.append(row)
            if "error" in row:
                print(f"| {name} | {budget} | - | - | - | - | - | - | {row['error'][:80]} |")
                continue
            diff = row["measured_peak_bytes"] - row["predicted_peak_bytes"]
            within = row["measured_peak_bytes"] <= row["budget_bytes"]
            print(
                f"| {name} | {budget} ({format_bytes(row['budget_bytes'])}) "
                f"| {format_bytes(row['predicted_peak_bytes'])} "
                f"| {format_bytes(row['measured_peak_bytes'])} | {diff:+,d} B "
                f"| {'yes' if within else 'NO'} | {format_bytes(row['held_bytes'])} "
                f"| {row['seconds']:.0f} s | {row['inductor_plans_read']} |",
                flush=True,
            )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"torch": torch.__version__, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
