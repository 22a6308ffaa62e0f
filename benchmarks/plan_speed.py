"""Planning speed: `auto` at a 50% budget on Llama at seq 8192, tracing excluded.

Targets (issue 3): llama-3.1-8b under 10 s, llama-3.1-70b under 30 s on a 2-core machine.
Run: python benchmarks/plan_speed.py [model ...]   (writes benchmarks/results/plan_speed.json)
"""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path

import remat
from remat import Planner, models
from remat.errors import InfeasibleBudget
from remat.units import format_bytes

TARGET_SECONDS = {"llama-3.1-8b": 10.0, "llama-3.1-70b": 30.0}


def bench(name: str, budget: str = "50%") -> dict:
    model, inputs = models.build(name, batch=1, seq=8192, dtype="bf16")
    start = time.perf_counter()
    graph = remat.trace(model, *inputs)
    traced = time.perf_counter()
    planner = Planner(graph, "h100")
    try:
        p = planner.plan(budget, "auto")
        result = {
            "strategy": p.strategy,
            "predicted_peak_bytes": p.predicted_peak_bytes,
            "budget_bytes": p.budget_bytes,
        }
    except InfeasibleBudget as e:
        result = {"infeasible": str(e)}
    planned = time.perf_counter()
    row = {
        "model": name,
        "seq": 8192,
        "ops": len(graph.ops),
        "trace_seconds": round(traced - start, 2),
        "plan_seconds": round(planned - traced, 2),
        "target_seconds": TARGET_SECONDS.get(name),
        **result,
    }
    print(
        f"{name}: {row['ops']} ops, trace {row['trace_seconds']} s, plan {row['plan_seconds']} s "
        f"(target {row['target_seconds']} s): {result.get('strategy', result.get('infeasible'))}"
        + (
            f", peak {format_bytes(result['predicted_peak_bytes'])} <= {format_bytes(result['budget_bytes'])}"
            if "strategy" in result
            else ""
        )
    )
    return row


if __name__ == "__main__":
    names = sys.argv[1:] or list(TARGET_SECONDS)
    rows = [bench(n) for n in names]
    out = Path(__file__).parent / "results" / "plan_speed.json"
    out.write_text(
        json.dumps(
            {"machine": f"{platform.machine()} {platform.processor()}, cpu", "rows": rows}, indent=2
        )
    )
