"""torch.compile's partitioner, and the eager peers, against remat.compile at equal MEASURED peak
(issue 11, item 5; issue 24).

    python benchmarks/compiled_equal_peak.py [--rounds 9] [--budgets 0.8 0.5 0.2]
        [--eager-peers full selective:torchtitan] [--tiny]

For each of torch's `activation_memory_budget` values: compile the model with torch's own
partitioner at that value and measure its peak (`remat.measure`); then `remat.compile` with that
measured peak as the byte budget (strategy auto), and measure its peak too. The same for each eager
peer (a hand-written strategy applied to the uncompiled model: full checkpointing, torchtitan's
selective policy): its measured peak is remat.compile's budget, and the peer itself is timed with
the rest, as is eager store_all. Every variant is timed in interleaved rounds (each round times one
step of every variant, starting one variant later each round), so a slow moment of the machine
hits all alike; the table shows the median step time, its min-max range and the ratio to torch's
default (budget 1.0) and to eager store_all. The model is the
GPT-2-style one of the issue: 12 layers, d 768, vocab 8192, seq 256, batch 4 (`--tiny`: the gpt2
preset's tiny size, for a quick check). Writes benchmarks/results/compiled-equal-peak-<tag>.json and
prints a markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import sys
from pathlib import Path

import torch
from torch._functorch import config as functorch_config

import remat
from remat import models
from remat.answers.bench import interleaved_rounds, plan_applied, quartile_range
from remat.applying.compiled import RematBackend, remat_error_cause
from remat.planning import strategies
from remat.units import format_bytes

GPT2_STYLE = {"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 8192}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.8, 0.5, 0.2])
    parser.add_argument(
        "--eager-peers",
        nargs="*",
        default=["full", "selective:torchtitan"],
        help="hand-written eager strategies whose measured peaks remat.compile is also given",
    )
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    shape = {"batch": 2, "seq": 64} if args.tiny else {"batch": 4, "seq": 256}
    model, inputs = models.build(
        "gpt2", device="cpu", tiny=args.tiny, **shape, **({} if args.tiny else GPT2_STYLE)
    )
    variants: list[dict] = [_eager(model, inputs, "store_all", None)]
    if args.eager_peers:
        meta_model, meta_inputs = models.build(
            "gpt2", device="meta", tiny=args.tiny, **shape, **({} if args.tiny else GPT2_STYLE)
        )
        planner = remat.Planner(remat.trace(meta_model, *meta_inputs), "cpu")
        for name in args.eager_peers:
            print(f"eager {name} ...", file=sys.stderr)
            plan = planner.solve(strategies.get(name, "eager"), planner.estimate.peak_bytes)
            variants.append(_eager(model, inputs, name, plan))
    torch._dynamo.reset()
    # seven compiled variants of one forward: past dynamo's recompile limit it would run eagerly
    torch._dynamo.config.recompile_limit = 64
    peers = [(v["name"], v["peak"]) for v in variants[1:]]
    for budget in [1.0, *args.budgets]:
        print(f"torch.compile@{budget:g} ...", file=sys.stderr)
        backend = RematBackend(strategy="torch", compiler="inductor")
        compiled = torch.compile(model, backend=backend, dynamic=False)
        compiled.remat_backend = backend
        with functorch_config.patch(activation_memory_budget=budget):
            measured = remat.measure(compiled, *inputs)
        variants.append(_variant(f"torch.compile@{budget:g}", compiled, measured.peak_bytes))
        if budget != 1.0:
            peers.append((f"torch.compile@{budget:g}", measured.peak_bytes))
    for peer, peak in peers:
        print(f"remat.compile at {peer}'s {format_bytes(peak)} ...", file=sys.stderr)
        variants.append(_remat_compiled(model, inputs, f"remat@{peer}", peak))
    timed = [v for v in variants if v["module"] is not None]
    graphs = [_graphs(v["module"]) for v in timed]
    times = interleaved_rounds(
        [(v["module"], v["setup"]) for v in timed],
        inputs,
        args.rounds,
        lambda text: print(text, file=sys.stderr),
    )
    eager_times = times[0]
    base_times = times[[v["name"] for v in timed].index("torch.compile@1")]
    eager, base = statistics.median(eager_times), statistics.median(base_times)
    lines = [
        "| variant | measured peak | budget | median step | min-max | vs torch.compile@1 | "
        "vs eager store_all | paired vs torch.compile@1: median (IQR) | "
        "paired vs eager store_all: median (IQR) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    results = []
    for v, t, n in zip(timed, times, graphs, strict=True):
        if _graphs(v["module"]) != n:
            v["name"] += " (recompiled while timing)"
        med = statistics.median(t)
        row = {k: v.get(k) for k in ("name", "peak", "budget", "predicted")}
        row.update(
            step_seconds=med,
            step_min=min(t),
            step_max=max(t),
            times=t,
            ratio=med / base,
            ratio_to_eager=med / eager,
            paired_ratio=_paired(t, base_times),
            paired_ratio_to_eager=_paired(t, eager_times),
        )
        results.append(row)
        lines.append(
            f"| {v['name']} | {format_bytes(v['peak'])} | "
            f"{format_bytes(v['budget']) if v.get('budget') else '-'} | {med * 1e3:.0f} ms | "
            f"{min(t) * 1e3:.0f}-{max(t) * 1e3:.0f} ms | {med / base:.3f}x | {med / eager:.3f}x | "
            f"{_paired_text(row['paired_ratio'])} | {_paired_text(row['paired_ratio_to_eager'])} |"
        )
    for v in variants:
        if v["module"] is None:
            lines.append(f"| {v['name']} | could not run: {v['note'][:120]} | | | | | | |")
            results.append({"name": v["name"], "note": v["note"]})
    print("\n".join(lines))
    folder = Path(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / f"compiled-equal-peak-{'tiny' if args.tiny else 'gpt2-12l'}.json"
    out.write_text(json.dumps({"rounds": args.rounds, "rows": results}, indent=2))
    torch._dynamo.reset()
    return 0


def _paired(times: list[float], base: list[float]) -> dict[str, float]:
    """Each round's step over the baseline's in the same round: the machine's drift between rounds
    (+-20% on this VM) cancels, which the ratio of medians keeps."""
    ratios = [t / b for t, b in zip(times, base, strict=True)]
    q1, q3 = quartile_range(ratios)
    return {"median": statistics.median(ratios), "q1": q1, "q3": q3}


def _paired_text(ratio: dict[str, float]) -> str:
    return f"{ratio['median']:.3f} ({ratio['q1']:.3f}-{ratio['q3']:.3f})"


def _variant(name: str, module: torch.nn.Module, peak: int, **extra) -> dict:
    return {"name": name, "module": module, "setup": contextlib.nullcontext, "peak": peak, **extra}


def _eager(model: torch.nn.Module, inputs: tuple, name: str, plan: remat.Plan | None) -> dict:
    """The uncompiled model under a hand-written plan (None: store_all), its peak measured."""
    setup = contextlib.nullcontext if plan is None else functools.partial(plan_applied, model, plan)
    with setup():
        peak = remat.measure(model, *inputs, steps=1).peak_bytes
    return {"name": f"eager {name}", "module": model, "setup": setup, "peak": peak}


def _remat_compiled(model: torch.nn.Module, inputs: tuple, name: str, budget: int) -> dict:
    """remat.compile(strategy auto) at a byte budget, its peak measured, or why it cannot run."""
    ours = remat.compile(model, budget=budget, strategy="auto")
    try:
        mine = remat.measure(ours, *inputs)
    except remat.RematError as err:
        return {"name": name, "module": None, "note": str(err)}
    except Exception as err:  # dynamo's wrapper
        cause = remat_error_cause(err)
        if cause is None:
            raise
        return {"name": name, "module": None, "note": str(cause)}
    (plan,) = remat.applying.compiled.plans_of(ours)
    return _variant(name, ours, mine.peak_bytes, budget=budget, predicted=plan.predicted_peak_bytes)


def _graphs(module: torch.nn.Module) -> int:
    """How many graphs a compiled variant has planned (0 for an eager one)."""
    backend: RematBackend | None = getattr(module, "remat_backend", None)
    return len(backend.plans) if backend else 0


if __name__ == "__main__":
    raise SystemExit(main())
