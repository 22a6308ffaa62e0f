"""What the first step's check costs: the wall time of a planned model's first training step with
the check (`remat.auto(..., check=True)`, the default) and without it (`check=False`).

Each round deep-copies one planned model twice (a copy checks its own first step) and times the
first step of each, the two in alternating order so that drift on a loaded machine falls on both;
the median and the spread (min-max) over rounds are printed, with the median of the per-round
differences. The check is a one-time cost: steps after the first run without it.

Run: python benchmarks/first_step_cost.py [--model gpt2] [--layers 4] [--rounds 31]   (from the repository root)
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings

import torch

import remat
from remat import models


def first_step_seconds(planned: torch.nn.Module, inputs: tuple) -> float:
    model = copy.deepcopy(planned)
    start = time.perf_counter()
    model(*inputs).sum().backward()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--strategy", default="auto")
    parser.add_argument("--budget", default="50%")
    parser.add_argument("--rounds", type=int, default=31)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)  # a small model: threads add only contention
    torch.manual_seed(0)
    built = {}
    for check in (True, False):
        model, inputs = models.build(
            args.model, batch=args.batch, seq=args.seq, device="cpu", tiny=True, n_layer=args.layers
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = remat.auto(
                model, *inputs, strategy=args.strategy, budget=args.budget, check=check
            )
        built[check] = model
    first_step_seconds(built[False], inputs)  # warm the kernels and allocator once
    times: dict[bool, list[float]] = {True: [], False: []}
    for r in range(args.rounds):
        for check in (True, False) if r % 2 == 0 else (False, True):
            times[check].append(first_step_seconds(built[check], inputs))
    print(
        f"{args.model}, tiny ({args.layers} layers, batch {args.batch}, seq {args.seq}), "
        f"{plan.strategy} ({len(plan.regions)} regions), torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, {args.rounds} rounds"
    )
    for check, label in ((False, "unchecked first step"), (True, "checked first step")):
        t = times[check]
        print(
            f"  {label:22s} median {statistics.median(t) * 1e3:8.2f} ms  "
            f"(min {min(t) * 1e3:.2f}, max {max(t) * 1e3:.2f})"
        )
    diffs = [a - b for a, b in zip(times[True], times[False], strict=True)]
    print(
        f"  the check's cost      median {statistics.median(diffs) * 1e3:8.2f} ms per model "
        f"(min {min(diffs) * 1e3:.2f}, max {max(diffs) * 1e3:.2f}), "
        f"{statistics.median(diffs) / statistics.median(times[False]):.0%} of the unchecked step"
    )


if __name__ == "__main__":
    main()
