"""`remat estimate --compile` against the compiled step run for real (issue 19, item 4).

    python benchmarks/compiled_estimate.py [--models gpt2 llama-3.2-1b] [--batch 4] [--seq 256]

For each tiny preset: the eager step and the step under torch.compile, `whole`
(`torch.compile(model)`) and `blocks` (each block `torch.compile`d, the rest eager, as torchtitan
does), predicted on fake tensors (`remat.estimate_compiled`) and measured on real CPU tensors
(`remat.measure`, the profiler's allocation events), AdamW included. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import copy

import torch

import remat
from remat import models


def _per_block(model: torch.nn.Module, paths: list[str]) -> torch.nn.Module:
    """torchtitan's apply_compile: each block replaced by torch.compile(block, fullgraph=True)."""
    model = copy.deepcopy(model)
    for path in paths:
        parent, _, name = path.rpartition(".")
        holder = model.get_submodule(parent)
        holder.register_module(name, torch.compile(holder.get_submodule(name), fullgraph=True))
    return model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["gpt2", "llama-3.2-1b"])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    args = parser.parse_args(argv)
    print("| model (tiny) | step | predicted | measured | measured - predicted |")
    print("|---|---|---|---|---|")
    for name in args.models:
        torch.manual_seed(0)
        model, inputs = models.build(name, batch=args.batch, seq=args.seq, device="cpu", tiny=True)
        graph = remat.trace(model, *inputs)
        paths = [b.path for b in graph.blocks]
        steps = {
            "eager": (remat.estimate(graph, optimizer="adamw").peak_bytes, model),
        }
        for mode in ("whole", "blocks"):
            est = remat.estimate_compiled(graph, model, *inputs, compile=mode, optimizer="adamw")
            torch._dynamo.reset()
            run = (
                torch.compile(model, fullgraph=True)
                if mode == "whole"
                else _per_block(model, paths)
            )
            steps[f"compile {mode}"] = (est.peak_bytes, run)
        for step, (predicted, run) in steps.items():
            measured = remat.measure(run, *inputs, optimizer="adamw").peak_bytes
            print(
                f"| {name} | {step} | {predicted:,} B | {measured:,} B | {measured - predicted} B |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
