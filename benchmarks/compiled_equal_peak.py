"""torch.compile's partitioner against remat's at equal MEASURED peak (issue 11, item 5).

    python benchmarks/compiled_equal_peak.py [--rounds 9] [--budgets 0.8 0.5 0.2] [--tiny]

For each of torch's `activation_memory_budget` values: compile the model with torch's own
partitioner at that value and measure its peak (`remat.measure`); then `remat.compile` with that
measured peak as the byte budget (strategy auto), and measure its peak too. Every variant stays
compiled and is timed in interleaved rounds (each round times one step of every variant, starting
one variant later each round), so a slow moment of the machine hits all alike; the table shows the
median step time, its min-max range and the ratio to torch's default (budget 1.0). The model is the
GPT-2-style one of the issue: 12 layers, d 768, vocab 8192, seq 256, batch 4 (`--tiny`: the gpt2
preset's tiny size, for a quick check). Writes benchmarks/results/compiled-equal-peak-<tag>.json and
prints a markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from pathlib import Path

import torch
from torch._functorch import config as functorch_config

import remat
from remat import models
from remat.bench import _interleaved_rounds
from remat.compiled import RematBackend, remat_error_cause
from remat.units import format_bytes

GPT2_STYLE = {"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 8192}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.8, 0.5, 0.2])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    shape = {"batch": 2, "seq": 64} if args.tiny else {"batch": 4, "seq": 256}
    model, inputs = models.build(
        "gpt2", device="cpu", tiny=args.tiny, **shape, **({} if args.tiny else GPT2_STYLE)
    )
    variants: list[dict] = []
    torch._dynamo.reset()
    # seven compiled variants of one forward: past dynamo's recompile limit it would run eagerly
    torch._dynamo.config.recompile_limit = 64
    for budget in [1.0, *args.budgets]:
        print(f"torch.compile@{budget:g} ...", file=sys.stderr)
        backend = RematBackend(strategy="torch", compiler="inductor")
        compiled = torch.compile(model, backend=backend, dynamic=False)
        compiled.remat_backend = backend
        with functorch_config.patch(activation_memory_budget=budget):
            measured = remat.measure(compiled, *inputs)
        variants.append(
            {"name": f"torch.compile@{budget:g}", "module": compiled, "peak": measured.peak_bytes}
        )
        if budget == 1.0:
            continue
        print(f"remat.compile at {format_bytes(measured.peak_bytes)} ...", file=sys.stderr)
        ours = remat.compile(model, budget=measured.peak_bytes, strategy="auto")
        try:
            mine = remat.measure(ours, *inputs)
        except remat.RematError as err:
            variants.append({"name": f"remat@{budget:g}", "module": None, "note": str(err)})
            continue
        except Exception as err:  # dynamo's wrapper
            cause = remat_error_cause(err)
            if cause is None:
                raise
            variants.append({"name": f"remat@{budget:g}", "module": None, "note": str(cause)})
            continue
        (plan,) = remat.compiled.plans_of(ours)
        variants.append(
            {
                "name": f"remat@{budget:g}",
                "module": ours,
                "peak": mine.peak_bytes,
                "budget": measured.peak_bytes,
                "predicted": plan.predicted_peak_bytes,
            }
        )
    timed = [v for v in variants if v["module"] is not None]
    graphs = [len(_backend(v["module"]).plans) for v in timed]
    times = _interleaved_rounds(
        [(v["module"], _nothing) for v in timed],
        inputs,
        args.rounds,
        lambda text: print(text, file=sys.stderr),
    )
    base = statistics.median(times[0])
    lines = [
        "| variant | measured peak | budget | median step | min-max | ratio to torch@1 |",
        "|---|---|---|---|---|---|",
    ]
    results = []
    for v, t, n in zip(timed, times, graphs, strict=True):
        if len(_backend(v["module"]).plans) != n:
            v["name"] += " (recompiled while timing)"
        med = statistics.median(t)
        row = {k: v.get(k) for k in ("name", "peak", "budget", "predicted")}
        row.update(step_seconds=med, step_min=min(t), step_max=max(t), ratio=med / base)
        results.append(row)
        lines.append(
            f"| {v['name']} | {format_bytes(v['peak'])} | "
            f"{format_bytes(v['budget']) if v.get('budget') else '-'} | {med * 1e3:.0f} ms | "
            f"{min(t) * 1e3:.0f}-{max(t) * 1e3:.0f} ms | {med / base:.3f}x |"
        )
    for v in variants:
        if v["module"] is None:
            lines.append(f"| {v['name']} | could not run: {v['note'][:120]} | | | | |")
            results.append({"name": v["name"], "note": v["note"]})
    print("\n".join(lines))
    out = Path(args.out) / f"compiled-equal-peak-{'tiny' if args.tiny else 'gpt2-12l'}.json"
    out.write_text(json.dumps({"rounds": args.rounds, "rows": results}, indent=2))
    torch._dynamo.reset()
    return 0


def _backend(module: torch.nn.Module) -> RematBackend:
    return module.remat_backend


def _nothing() -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


if __name__ == "__main__":
    raise SystemExit(main())
