"""How long remat's own answers take (issue 35): each command of the table below, run `--repeats`
times as a user runs it (a fresh `remat` process), the median wall time and CPU time, the number
of steps it traced, and where one more run, profiled in-process, spends its time.

| command | target |
|---|---|
| fit llama-3.1-8b, seq 8192, h100, adamw, bf16-mixed | 8 s |
| fit llama-3.1-70b, seq 8192, h100, --shard 32, bf16-fsdp, adamw | 15 s |
| fit llama-3.1-70b, seq 8192, h100, --tp 8 --pp 4 --shard 4, bf16-fsdp, adamw | 30 s |
| fit llama-3.1-405b, seq 8192, h100, --tp 8 --pp 16, bf16, adamw | 60 s |
| estimate llama-3.1-70b, batch 1, seq 8192, bf16 | 4 s |

Targets are for an idle 2-core machine; on a loaded one the times say little, the traces and the
shares of the time more. `--full-trace` times the same commands tracing every block (the answer
is the same, byte for byte: tests/test_depth.py).

Run: python benchmarks/tool_speed.py [--repeats 3] [--only fit-8b] [--full-trace]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import pstats
import resource
import statistics
import subprocess
import sys
import time

#: name -> (the command line after `remat`, its target in seconds)
COMMANDS: dict[str, tuple[str, float]] = {
    "fit-8b": (
        "fit --model llama-3.1-8b --seq 8192 --gpu h100 --optimizer adamw --precision bf16-mixed",
        8.0,
    ),
    "fit-70b-shard32": (
        "fit --model llama-3.1-70b --seq 8192 --gpu h100 --shard 32 --precision bf16-fsdp "
        "--optimizer adamw",
        15.0,
    ),
    "fit-70b-tp8-pp4": (
        "fit --model llama-3.1-70b --seq 8192 --gpu h100 --tp 8 --pp 4 --shard 4 "
        "--precision bf16-fsdp --optimizer adamw",
        30.0,
    ),
    "fit-405b-tp8-pp16": (
        "fit --model llama-3.1-405b --seq 8192 --gpu h100 --tp 8 --pp 16 --precision bf16 "
        "--optimizer adamw",
        60.0,
    ),
    "estimate-70b": ("estimate --model llama-3.1-70b --batch 1 --seq 8192 --dtype bf16", 4.0),
}

#: the stages a run's time is shared among: (label, the function whose cumulative time it is)
STAGES = (
    ("tracing", "tracing/trace.py", "trace"),
    ("plans", "planning/planner.py", "solve"),
    ("lowest peak", "planning/planner.py", "lowest_peak"),
    ("allocator", "prediction/gpu_memory.py", "gpu_memory"),
    ("pipeline walks", "layouts/fit_pipeline.py", "pipeline_rows"),
)


def timed(args: list[str]) -> tuple[float, int | None, float]:
    """Seconds of one `remat` run, the steps it traced (fit's `traces`; estimate traces one) and
    the CPU seconds it took (user + system: on a loaded machine, steadier than the wall's)."""
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", "remat.answers.cli", *args, "--json"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime - used.ru_utime + after.ru_stime - used.ru_stime
    try:
        traces = json.loads(out).get("traces", 1 if args[0] == "estimate" else None)
    except json.JSONDecodeError:
        traces = None
    return seconds, traces, cpu


def shares(args: list[str]) -> dict[str, float]:
    """Seconds per stage of one in-process run under cProfile (slower than a plain run; the
    shares are what to read)."""
    from remat.answers.cli import main

    profile = cProfile.Profile()
    profile.enable()
    with contextlib.suppress(SystemExit):
        main([*args, "--json"])
    profile.disable()
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    out = {"total": max(ct for (_, _, _, ct, _) in stats.values())}
    for label, path, name in STAGES:
        out[label] = max(
            (
                ct
                for (f, _, fn), (_, _, _, ct, _) in stats.items()
                if f.endswith(path) and fn == name
            ),
            default=0.0,
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", action="append", choices=sorted(COMMANDS))
    parser.add_argument("--full-trace", action="store_true", help="trace every block")
    parser.add_argument("--no-profile", action="store_true", help="skip the profiled run")
    opts = parser.parse_args()
    print(
        "| command | median s | runs (s) | CPU s (median) | traces | target s "
        "| where the time goes (profiled) |"
    )
    print("|---|---|---|---|---|---|---|")
    for name in opts.only or COMMANDS:
        line, target = COMMANDS[name]
        args = line.split() + (["--full-trace"] if opts.full_trace else [])
        runs = [timed(args) for _ in range(opts.repeats)]
        seconds = [s for s, _, _ in runs]
        cpu = statistics.median(c for _, _, c in runs)
        where = ""
        if not opts.no_profile:
            got = shares(args)
            where = ", ".join(
                f"{label} {got[label] / got['total']:.0%}" for label, *_ in STAGES if got[label]
            )
        print(
            f"| {' '.join(args)} | {statistics.median(seconds):.1f} | "
            f"{', '.join(f'{s:.1f}' for s in seconds)} | {cpu:.1f} | {runs[-1][1]} | {target:g} "
            f"| {where} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
