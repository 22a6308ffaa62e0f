"""torch.compile's own partitioner at its activation_memory_budget values against remat's budgeted
save set holding no more activation bytes, both priced by remat's cost model on the same joint graph.

    python benchmarks/compiled_vs_torch.py [--model gpt2] [--batch 4] [--seq 256] [--compiler aot_eager]

For each torch budget: the activation bytes torch's save set holds for backward, its predicted
recompute time and peak; then remat's least-recompute save set under the same held bytes
(`cheapest_save_set(..., traffic_weight=0)`), with its recompute time and peak. Writes
benchmarks/results/compiled-vs-torch-<model>.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch._functorch import config as functorch_config

import remat
from remat import models
from remat.answers.bench import gradients
from remat.device.cost import fused_op_seconds_all, get_profile
from remat.planning.solvers.mincut import joint_problem
from remat.planning.solvers.saveset import cheapest_save_set, describe_save_set
from remat.units import format_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--compiler", default="aot_eager", choices=["aot_eager", "inductor"])
    parser.add_argument("--profile", default="h100", help="cost profile (default: %(default)s)")
    args = parser.parse_args()
    torch.manual_seed(0)
    model, inputs = models.build(
        args.model, batch=args.batch, seq=args.seq, device="cpu", tiny=args.tiny
    )
    profile = get_profile(args.profile)
    rows = []
    for budget in (1.0, 0.5, 0.0):
        torch._dynamo.reset()
        watcher = remat.backend(strategy="torch", compiler=args.compiler, profile=profile)
        with functorch_config.patch(activation_memory_budget=budget):
            gradients(torch.compile(model, backend=watcher, dynamic=False), inputs)
        (theirs,) = watcher.plans
        graph = watcher.graphs[0]
        problem = joint_problem(graph, None)
        op_seconds = fused_op_seconds_all(graph, profile)
        held = theirs.details["held_activation_bytes"]
        chosen = cheapest_save_set(
            graph, problem, op_seconds, profile.bandwidth, held, traffic_weight=0.0
        )
        ours = describe_save_set(graph, problem, chosen, op_seconds)
        rows.append(
            {
                "torch_budget": budget,
                "held_bytes": held,
                "torch_recompute_seconds": theirs.recompute_seconds,
                "torch_peak_bytes": theirs.predicted_peak_bytes,
                "remat_held_bytes": ours.held_activation_bytes,
                "remat_recompute_seconds": ours.recompute_seconds,
                "remat_peak_bytes": ours.peak_bytes,
            }
        )
        print(
            f"torch@{budget:g}: holds {format_bytes(held)}, recompute "
            f"{theirs.recompute_seconds * 1e6:.1f} us, peak {format_bytes(theirs.predicted_peak_bytes)}"
            f" | remat at <= that: holds {format_bytes(ours.held_activation_bytes)}, recompute "
            f"{ours.recompute_seconds * 1e6:.1f} us, peak {format_bytes(ours.peak_bytes)}"
        )
    out = Path(__file__).parent / "results" / f"compiled-vs-torch-{args.model}.json"
    out.write_text(json.dumps({**vars(args), "rows": rows}, indent=2))
    print(f"written to {out}")


if __name__ == "__main__":
    main()
