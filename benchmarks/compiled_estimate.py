"""`remat estimate --compile` against the compiled step run for real (issue 19, item 4).

    python benchmarks/compiled_estimate.py [--models gpt2 llama-3.2-1b] [--batch 4] [--seq 256]

For each tiny preset: the eager step and the step under torch.compile, `whole`
(`torch.compile(model)`), `blocks` (each block `torch.compile`d, the rest eager, as torchtitan
does) and `blocks` + full AC (each block checkpointed, then compiled: torchtitan's compile + AC),
predicted on fake tensors (`remat.estimate_compiled`) and measured on real CPU tensors
(`remat.measure`, the profiler's allocation events), AdamW included. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import copy

import torch

import remat
from remat import models


class _FullAC(torch.nn.Module):
    """torchtitan's full activation checkpointing of a block (non-reentrant checkpoint)."""

    def __init__(self, block: torch.nn.Module):
        super().__init__()
        self.block = block

    def forward(self, *args, **kwargs):
        return torch.utils.checkpoint.checkpoint(self.block, *args, use_reentrant=False, **kwargs)


def _per_block(model: torch.nn.Module, paths: list[str], ac: bool) -> torch.nn.Module:
    """torchtitan's apply_compile: each block replaced by torch.compile(block, fullgraph=True),
    after apply_ac (full) when `ac`."""
    model = copy.deepcopy(model)
    for path in paths:
        parent, _, name = path.rpartition(".")
        holder = model.get_submodule(parent)
        block = holder.get_submodule(name)
        holder.register_module(name, torch.compile(_FullAC(block) if ac else block, fullgraph=True))
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
        for mode, ac in (("whole", None), ("blocks", None), ("blocks", "full")):
            est = remat.estimate_compiled(
                graph, model, *inputs, compile=mode, optimizer="adamw", ac=ac
            )
            torch._dynamo.reset()
            run = (
                torch.compile(model, fullgraph=True)
                if mode == "whole"
                else _per_block(model, paths, ac=ac is not None)
            )
            steps[f"compile {mode}" + (f" + {ac} AC" if ac else "")] = (est.peak_bytes, run)
        for step, (predicted, run) in steps.items():
            measured = remat.measure(run, *inputs, optimizer="adamw").peak_bytes
            print(
                f"| {name} | {step} | {predicted:,} B | {measured:,} B | {measured - predicted} B |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
