"""A stored GPU run's memory rows predicted again by this tree, on the CPU: no GPU needed.

`benchmarks/gpu_validate.py` writes, per model and strategy, the peak it measured on the GPU and
the peak remat predicted then. A fix made after the device time was spent (a kernel's scratch, an
op's order) can be checked against those measurements here: each model is traced again as
gpu_validate traces it (a meta copy, bf16-mixed, the GPU's kernel rules: SM90 with the attention
backend and SM count of the stored run), each row's strategy planned with the stored run's cost
profile and budget, and the measured peak set against the prediction then and now.

    python benchmarks/gpu_repredict.py [--json benchmarks/results/gpu-validate-nvidia-h100-80gb-hbm3.json]
        [--attention cudnn-first] [--multiprocessors 132] [--models gpt2 ...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

import remat
from remat import models
from remat.device.cost import DeviceProfile
from remat.device.targets import cuda
from remat.planning import strategies

STORED = Path("benchmarks/results/gpu-validate-nvidia-h100-80gb-hbm3.json")


def repredict(stored: dict[str, Any], target: Any, only: list[str] | None) -> list[dict[str, Any]]:
    """Per measured memory row: the strategy's plan now, and measured / predicted then and now."""
    settings = stored["settings"]
    fields = dict(settings["profile"])
    fields["element_ops"] = tuple(tuple(e) for e in fields["element_ops"])
    profile = DeviceProfile(**fields)
    autocast = {"bf16-mixed": torch.bfloat16}.get(settings["precision"])
    dtype = "fp32" if settings["precision"] == "bf16-mixed" else settings["precision"]
    rows = [r for r in stored["rows"] if r["part"] == "memory" and r["measured_peak_bytes"]]
    out = []
    for name in dict.fromkeys(r["model"] for r in rows):
        if only and name not in only:
            continue
        meta, inputs = models.build(
            name, device="meta", dtype=dtype, **settings["memory_shapes"][name]
        )
        planner = remat.Planner(
            remat.trace(meta, *inputs, autocast=autocast, target=target), profile
        )
        for r in (r for r in rows if r["model"] == name):
            strategy = r["variant"].split("@")[0]
            row = {"model": name, "variant": r["variant"], "plan_then": r["plan"]}
            row["ratio_then"] = r["measured_peak_bytes"] / r["predicted_peak_bytes"]
            try:
                p = planner.solve(
                    strategies.get(strategy, "eager"), planner.budget_bytes(settings["budget"])
                )
            except remat.RematError as err:
                row["now"] = f"refused: {str(err).split(';')[0]}"
            else:
                now = p.predicted_peak_bytes - planner.base_bytes
                row.update(plan_now=p.strategy, ratio_now=r["measured_peak_bytes"] / now)
            out.append(row)
            print(
                f"| {name} | {r['variant']} | {row['ratio_then']:.3f} | "
                + (
                    f"{row['ratio_now']:.3f} ({row['plan_now']})"
                    if "ratio_now" in row
                    else row["now"]
                )
                + " |",
                flush=True,
            )
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, default=STORED, help="a gpu_validate.py result")
    parser.add_argument("--attention", default="cudnn-first", help="the run's SDPA order")
    parser.add_argument("--multiprocessors", type=int, default=132, help="the run's SM count")
    parser.add_argument("--models", nargs="*", help="only these models")
    args = parser.parse_args(argv)
    stored = json.loads(args.json.read_text())
    print(f"{stored['device']}, torch {stored['torch']}: measured / predicted peak")
    print("| model | row | then | now (plan) |\n|---|---|---:|---|")
    target = cuda((9, 0), args.attention, multiprocessors=args.multiprocessors)
    repredict(stored, target, args.models)


if __name__ == "__main__":
    main()
