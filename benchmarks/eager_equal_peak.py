"""remat.auto against each hand-written eager strategy at that strategy's MEASURED peak (issue 11,
item 7).

    python benchmarks/eager_equal_peak.py [--rounds 9] [--profile cpu|calibrated] [--tiny] [--tuned]

For each hand-written strategy (full, sqrt, checkpointing every other block, torchtitan's and
Megatron's selective policies): apply its plan and measure its peak (`remat.measure`); then plan
`auto` with that measured peak as the byte budget (as `remat.auto` installs it: ranked with
checkpointing's host cost measured here, then tuned on its first training steps), apply it and
measure its peak too. Both figures
are whole-step peaks, parameters, gradients and inputs included, as the planner's budget is, so
the budget is the hand-written plan's peak as measured, not as predicted. store_all, every
strategy and every auto plan are then timed in interleaved rounds (`remat.answers.bench`'s: each round
times one step of every row in turn, set up just before and torn down just after, starting one row
later each round); an auto plan that is the same plan as a row already timed is not timed twice.

The model is the GPT-2-style one of the issue: 12 layers, d 768, 12 heads, vocab 8192, seq 256,
batch 4, fp32, on the CPU (`--tiny`: the gpt2 preset's tiny size, batch 2, seq 64, for a quick
check). Costs are priced on the `cpu` profile, or with `--profile calibrated` on
`remat.measuring.measure.calibrate_profile()` of this machine. Prints a markdown table and writes
benchmarks/results/eager-equal-peak[-tiny].json.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

import remat
from remat import models
from remat.answers.bench import auto_as_installed, interleaved_rounds, plan_applied
from remat.applying.tune import tune
from remat.errors import InfeasibleBudget
from remat.planning import strategies
from remat.planning.plans import Plan
from remat.units import format_bytes

GPT2_STYLE = {"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 8192}
HAND_WRITTEN = ("full", "sqrt", "every_other", "selective:torchtitan", "selective:megatron")


def _every_other(planner: remat.Planner) -> Plan:
    """Checkpoint blocks 0, 2, 4, ...: the hand-written plan the issue calls every-other-block."""
    n = len(planner.blocks)
    return planner.make_plan(
        planner.block_regions([[b] for b in range(0, n, 2)]),
        "every_other",
        None,
        "checkpoint every other block",
    )


def _hand_written(planner: remat.Planner, name: str) -> Plan:
    if name == "every_other":
        return _every_other(planner)
    return planner.solve(strategies.get(name, "eager"), planner.estimate.peak_bytes)


def _what(plan: Plan) -> str:
    """What a plan does, in a few words: its strategy and its regions' options."""
    options = plan.details.get("options")
    if options:
        counts: dict[str, int] = {}
        for o in options:
            counts[o] = counts.get(o, 0) + 1
        return f"{plan.strategy}: " + ", ".join(f"{n}x {o}" for o, n in counts.items())
    sac = sum(1 for r in plan.regions if r.keep)
    return f"{plan.strategy}: {len(plan.regions)} regions ({sac} selective)"


def _same(a: Plan, b: Plan) -> bool:
    return a.regions == b.regions


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--profile", default="cpu", help="cpu, another profile name, calibrated")
    parser.add_argument("--strategies", nargs="+", default=list(HAND_WRITTEN))
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--tag", default="", help="suffix of the JSON file name")
    parser.add_argument(
        "--before",
        action="store_true",
        help="also plan auto with checkpointing's own cost left out of the profile (the cost "
        "model before issue 11 item 7), and time those plans in the same rounds",
    )
    parser.add_argument(
        "--tuned",
        action="store_true",
        help="also auto:tuned at each peak (remat.applying.tune: the best few plans that fit timed on the "
        "model, the fastest kept), timed in the same rounds",
    )
    args = parser.parse_args(argv)

    log = functools.partial(print, file=sys.stderr, flush=True)
    torch.manual_seed(0)
    shape = {"batch": 2, "seq": 64} if args.tiny else {"batch": 4, "seq": 256}
    overrides = {} if args.tiny else GPT2_STYLE
    model, inputs = models.build("gpt2", device="cpu", tiny=args.tiny, **shape, **overrides)
    meta_model, meta_inputs = models.build(
        "gpt2", device="meta", tiny=args.tiny, **shape, **overrides
    )
    graph = remat.trace(meta_model, *meta_inputs)
    if args.profile == "calibrated":
        from remat.measuring.calibrate import calibrate_profile

        profile = calibrate_profile()
    else:
        profile = args.profile
    start = time.perf_counter()
    planner = remat.Planner(graph, profile)
    log(f"profile {planner.profile}")
    planners = {"auto": planner}
    if args.before:
        free = replace(planner.profile, region_seconds=0.0, policy_op_seconds=0.0)
        planners["auto-before"] = remat.Planner(graph, free)

    def measured_peak(plan: Plan) -> int:
        with plan_applied(model, plan):
            return remat.measure(model, *inputs, steps=1).peak_bytes

    store_all = planner.solve(strategies.get("store_all"), planner.estimate.peak_bytes)
    rows: list[dict] = [
        {
            "name": "store_all",
            "plan": store_all,
            "what": "no regions",
            "peak": measured_peak(store_all),
        }
    ]
    pairs: list[tuple[dict, dict]] = []
    for name in args.strategies:
        log(f"{name} ...")
        mine = _hand_written(planner, name)
        peak = measured_peak(mine)
        row = {"name": name, "plan": mine, "what": _what(mine), "peak": peak}
        log(f"  measured peak {format_bytes(peak)} ({peak} B); auto at that budget ...")
        rows.append(row)
        choosers = {label: functools.partial(p.plan, peak, "auto") for label, p in planners.items()}
        # auto as users get it: ranked with checkpointing's measured host cost, then tuned on
        # its first training steps (remat.answers.bench.auto_as_installed)
        choosers["auto"] = lambda peak=peak: auto_as_installed(model, inputs, planner, peak)[0]
        if args.tuned:  # the best few plans that fit, timed on the model: the fastest
            choosers["auto:tuned"] = lambda peak=peak: (
                tune(model, *inputs, planner=planner, budget_bytes=peak).chosen
            )
        for label, choose in choosers.items():
            try:
                chosen = choose()
            except InfeasibleBudget as err:
                auto = {"name": f"{label}@{name}", "plan": None, "note": str(err), "budget": peak}
            else:
                twin = next((r for r in rows if r["plan"] and _same(r["plan"], chosen)), None)
                auto = {
                    "name": f"{label}@{name}",
                    "plan": chosen,
                    "what": _what(chosen),
                    "budget": peak,
                    "peak": twin["peak"] if twin else measured_peak(chosen),
                }
                if auto["peak"] > peak:
                    log(f"  {label}'s measured peak {auto['peak']} B is over the budget {peak} B")
            rows.append(auto)
            pairs.append((row, auto))
    plan_seconds = time.perf_counter() - start

    # One timing per distinct plan: an auto plan equal to a row already timed shares its times.
    timed: list[dict] = []
    for row in rows:
        if row["plan"] is None:
            continue
        twin = next((t for t in timed if _same(t["plan"], row["plan"])), None)
        if twin is None:
            timed.append(row)
        else:
            row["same_as"] = twin["name"]
    times = interleaved_rounds(
        [(model, functools.partial(plan_applied, model, r["plan"])) for r in timed],
        inputs,
        args.rounds,
        log,
    )
    for r, t in zip(timed, times, strict=True):
        r["times"] = t
    for row in rows:
        if "same_as" in row:
            row["times"] = next(r for r in rows if r["name"] == row["same_as"])["times"]
    base = statistics.median(rows[0]["times"])

    def cell(row: dict) -> str:
        t = row["times"]
        med = statistics.median(t)
        same = f" (= {row['same_as']})" if "same_as" in row else ""
        return (
            f"{med * 1e3:.0f} ms ({min(t) * 1e3:.0f}-{max(t) * 1e3:.0f}){same} | {med / base:.3f}x"
        )

    lines = [
        f"store_all: measured peak {format_bytes(rows[0]['peak'])} ({rows[0]['peak']} B), "
        f"step {cell(rows[0]).replace(' | ', ', ')}",
        "",
        "| strategy | measured peak | step median (min-max) | vs store_all | planner | auto's "
        "plan at that peak | auto's peak | auto's step median (min-max) | auto vs store_all | "
        "predicted extra: auto (strategy) |",
        "|---|---:|---:|---:|---|---|---:|---:|---:|---:|",
    ]
    for row, auto in pairs:
        mine = f"| {row['name']} | {format_bytes(row['peak'])} | {cell(row)} |"
        label = auto["name"].split("@")[0]
        if auto["plan"] is None:
            lines.append(f"{mine} {label} | infeasible: {auto['note'][:100]} | | | | |")
            continue
        extra = planners.get(label, planner).make_plan(row["plan"].regions, "", None, "")
        extra = extra.recompute_seconds
        lines.append(
            f"{mine} {label} | {auto['what']} | {format_bytes(auto['peak'])} | {cell(auto)} | "
            f"{auto['plan'].recompute_seconds * 1e3:.0f} ms ({extra * 1e3:.0f} ms) |"
        )
    print("\n".join(lines))

    results = []
    for row in rows:
        t = row.get("times")
        plan = row["plan"]
        results.append(
            {
                "name": row["name"],
                "what": row.get("what"),
                "budget": row.get("budget"),
                "peak": row.get("peak"),
                "predicted_peak": plan.predicted_peak_bytes if plan else None,
                "predicted_extra_seconds": plan.recompute_seconds if plan else None,
                "peak_within_budget": row["peak"] <= row["budget"]
                if plan and row.get("budget")
                else None,
                "same_as": row.get("same_as"),
                "step_seconds": statistics.median(t) if t else None,
                "step_min": min(t) if t else None,
                "step_max": max(t) if t else None,
                "times": t,
                "ratio": statistics.median(t) / base if t else None,
                "note": row.get("note"),
            }
        )
    out = Path(args.out) / f"eager-equal-peak{'-tiny' if args.tiny else ''}{args.tag}.json"
    out.write_text(
        json.dumps(
            {
                "model": "gpt2 tiny" if args.tiny else {"gpt2": GPT2_STYLE, **shape},
                "rounds": args.rounds,
                "profile": str(planner.profile),
                "plan_seconds": plan_seconds,
                "rows": results,
            },
            indent=2,
        )
    )
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
