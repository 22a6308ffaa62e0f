"""remat.compile at the measured peak of torch's full checkpointing, with the save set chosen
under per-window caps (solvers/peak_windows.py) and, as before, under one cap on all the bytes
held (`--before`), against eager store_all (issue 38, item 4).

    OMP_NUM_THREADS=1 python benchmarks/compiled_full_peak.py [--model harness|zoo] [--rounds 7]
        [--before] [--torch-compile] [--tiny]

`harness` is benchmarks/harness_gpt2.py's GPT-2 (untied head, checkpointed by hand with
`torch.utils.checkpoint`); `zoo` is the project's tied-embedding GPT-2 of
benchmarks/compiled_equal_peak.py (its full checkpointing applied by remat). Both: 12 layers,
d 768, vocabulary 8192, seq 256, batch 4, fp32, CPU. Every row is timed in interleaved rounds,
each step's wall time and this thread's CPU time (with one thread, `OMP_NUM_THREADS=1`, the
thread does all of the step's work, so its CPU time is what the step costs whatever else the
machine runs); ratios are per round against eager store_all in the same round. Writes
benchmarks/results/compiled-full-peak-<model>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

import remat
from remat import models
from remat.answers.bench import plan_applied
from remat.applying.compiled import RematBackend, plans_of
from remat.planning import strategies
from remat.planning.solvers import saveset

sys.path.insert(0, str(Path(__file__).parent))
import harness_gpt2  # noqa: E402

GPT2_STYLE = {"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 8192}


def _build(
    name: str, tiny: bool
) -> tuple[torch.nn.Module, tuple, contextlib.AbstractContextManager]:
    """The model, its inputs and a context under which it runs torch's full checkpointing."""
    if name == "harness":
        model, inputs = harness_gpt2.build("cpu", tiny)
        return model, inputs, functools.partial(harness_gpt2.wrapped, model, harness_gpt2._full)
    shape = {"batch": 2, "seq": 64} if tiny else {"batch": 4, "seq": 256}
    size = {} if tiny else GPT2_STYLE
    torch.manual_seed(0)
    model, inputs = models.build("gpt2", device="cpu", tiny=tiny, **shape, **size)
    meta_model, meta_inputs = models.build("gpt2", device="meta", tiny=tiny, **shape, **size)
    planner = remat.Planner(remat.trace(meta_model, *meta_inputs), "cpu")
    full = planner.solve(strategies.get("full", "eager"), planner.estimate.peak_bytes)
    return model, inputs, functools.partial(plan_applied, model, full)


@contextlib.contextmanager
def _ladder_only():
    """The budgeted save set as before this change: the ladder of single caps alone."""
    shaped = saveset._shaped_within
    saveset._shaped_within = lambda *args, **kwargs: None
    try:
        yield
    finally:
        saveset._shaped_within = shaped


def _step(module: torch.nn.Module, inputs: tuple) -> tuple[float, float]:
    """One training step's (wall, thread CPU) seconds; gradients set to None after."""
    start, cpu = time.perf_counter(), time.thread_time()
    module(*inputs).backward()
    out = (time.perf_counter() - start, time.thread_time() - cpu)
    for p in module.parameters():
        p.grad = None
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("harness", "zoo"), default="harness")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--before", action="store_true", help="also the ladder of single caps")
    parser.add_argument("--torch-compile", action="store_true", help="also torch.compile@1")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    log = functools.partial(print, file=sys.stderr, flush=True)
    model, inputs, full = _build(args.model, args.tiny)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    rows = [{"name": "eager store_all", "module": model, "setup": contextlib.nullcontext}]
    rows.append({"name": "eager full checkpointing", "module": model, "setup": full})
    for row in rows:
        with row["setup"]():
            row["peak"] = remat.measure(model, *inputs, steps=1).peak_bytes
    budget = rows[1]["peak"]
    log(f"full checkpointing's peak {budget} B ({(budget - params) / 2**20:.1f} MiB above params)")
    torch._dynamo.config.recompile_limit = 64
    variants = [("remat.compile (windows)", contextlib.nullcontext)]
    if args.before:
        variants.append(("remat.compile (ladder, before)", _ladder_only))
    for name, context in variants:
        log(f"{name} ...")
        started = time.perf_counter()
        compiled = remat.compile(model, budget=budget, strategy="auto")
        with context():
            peak = remat.measure(compiled, *inputs, steps=1).peak_bytes
        (plan,) = plans_of(compiled)
        graph = compiled.remat_backend.graphs[0]
        kinds: dict[str, int] = {}
        for op_name in plan.recomputed:  # what backward re-runs, by op kind
            short = graph.op_by_name[op_name].short
            kinds[short] = kinds.get(short, 0) + 1
        rows.append(
            {
                "name": name,
                "module": compiled,
                "setup": contextlib.nullcontext,
                "peak": peak,
                "predicted": plan.predicted_peak_bytes,
                "recompute_seconds": plan.recompute_seconds,
                "reason": plan.reason,
                "recomputed_ops": kinds,
                "compile_seconds": time.perf_counter() - started,
            }
        )
        log(f"  {plan.reason}; peak {peak} B, predicted {plan.predicted_peak_bytes} B; {kinds}")
    if args.torch_compile:
        backend = RematBackend(strategy="torch", compiler="inductor")
        compiled = torch.compile(model, backend=backend, dynamic=False)
        peak = remat.measure(compiled, *inputs, steps=1).peak_bytes
        rows.append(
            {
                "name": "torch.compile@1",
                "module": compiled,
                "setup": contextlib.nullcontext,
                "peak": peak,
            }
        )
    wall: list[list[float]] = [[] for _ in rows]
    cpu: list[list[float]] = [[] for _ in rows]
    loads = []
    for r in range(args.rounds):
        log(f"round {r + 1}/{args.rounds}")
        loads.append(os.getloadavg()[0])
        for k in range(len(rows)):
            i = (r + k) % len(rows)
            with rows[i]["setup"]():
                if r == 0:
                    _step(rows[i]["module"], inputs)
                w, c = _step(rows[i]["module"], inputs)
            wall[i].append(w)
            cpu[i].append(c)
    lines = [
        f"{args.model}: parameters {params} B; torch threads {torch.get_num_threads()}; "
        f"1-min load {min(loads):.1f}-{max(loads):.1f} over the rounds",
        "",
        "| row | measured peak above parameters | predicted recompute | thread CPU median | "
        "per round vs store_all, CPU: median (min-max) | wall median | per round, wall: median |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row, w, c in zip(rows, wall, cpu, strict=True):
        per_cpu = sorted(a / b for a, b in zip(c, cpu[0], strict=True))
        per_wall = sorted(a / b for a, b in zip(w, wall[0], strict=True))
        row.update(
            wall=w,
            cpu=c,
            cpu_ratio=statistics.median(per_cpu),
            wall_ratio=statistics.median(per_wall),
        )
        rec = f"{row['recompute_seconds'] * 1e3:.0f} ms" if "recompute_seconds" in row else "-"
        lines.append(
            f"| {row['name']} | {(row['peak'] - params) / 2**20:.1f} MiB | {rec} | "
            f"{statistics.median(c) * 1e3:.0f} ms | {row['cpu_ratio']:.3f} "
            f"({per_cpu[0]:.3f}-{per_cpu[-1]:.3f}) | {statistics.median(w) * 1e3:.0f} ms | "
            f"{row['wall_ratio']:.3f} |"
        )
    print("\n".join(lines))
    out = Path(args.out) / f"compiled-full-peak-{args.model}{'-tiny' if args.tiny else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    keep = (
        "name",
        "peak",
        "predicted",
        "recompute_seconds",
        "reason",
        "recomputed_ops",
        "compile_seconds",
        "wall",
        "cpu",
        "cpu_ratio",
        "wall_ratio",
    )
    out.write_text(
        json.dumps(
            {
                "model": args.model,
                "parameter_bytes": params,
                "budget": budget,
                "loads": loads,
                "threads": torch.get_num_threads(),
                "rows": [{k: r[k] for k in keep if k in r} for r in rows],
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
