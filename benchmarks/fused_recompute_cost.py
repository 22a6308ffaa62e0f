"""What recomputing a pointwise op costs under a fusing compiler (issue 11, item 3).

    python benchmarks/fused_recompute_cost.py [--elements 4194304] [--reps 15]

The compiled path prices a recomputed pointwise op at its arithmetic (one vector operation per
element, `profile.transcendental_ops` of them for exp, sin, tanh and the like:
`remat.device.cost.fused_op_seconds_all`), not at a round trip to memory, and a matmul at its roofline.
This measures both premises on the machine at hand under inductor:

- chains of k pointwise ops (k = 1, 2, 4, 8, 16) on one fp32 tensor, compiled by inductor into one
  kernel, eager (one kernel per op) beside them: the slope of time over k is what one more op
  costs fused (per element) and unfused; the fused intercept is the one read and one write;
- the same for transcendental ops (sin, exp, tanh), which cost several vector operations each;
- a square matmul compiled by inductor against the profile's roofline (`peak_flops`).

Each point is the median of `--reps` timed calls after a warm-up, the chains interleaved in every
round. Prints a markdown table and compares with `remat.measuring.calibrate.calibrate_profile()` and the
shipped cpu profile; writes benchmarks/results/fused-recompute-cost.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from remat.device.cost import get_profile
from remat.measuring.calibrate import calibrate_profile

CHEAP = (lambda y: y * 1.0001, lambda y: y + 0.5)
TRANSCENDENTAL = (torch.sin, torch.exp, torch.tanh)
LENGTHS = (1, 2, 4, 8, 16)


def _chain(ops: tuple[Callable, ...], k: int) -> Callable[[torch.Tensor], torch.Tensor]:
    def chain(x: torch.Tensor) -> torch.Tensor:
        y = x
        for i in range(k):
            y = ops[i % len(ops)](y)
        return y

    return chain


def _slope(times: dict[int, float]) -> tuple[float, float]:
    """Least-squares line through (k, seconds): (intercept, slope)."""
    ks = list(times)
    mean_k = statistics.fmean(ks)
    mean_t = statistics.fmean(times.values())
    slope = sum((k - mean_k) * (times[k] - mean_t) for k in ks) / sum((k - mean_k) ** 2 for k in ks)
    return mean_t - slope * mean_k, slope


def _timed_rounds(calls: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
    for call in calls.values():
        call()
    samples: dict[str, list[float]] = {name: [] for name in calls}
    names = list(calls)
    for r in range(reps):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            start = time.perf_counter()
            calls[name]()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(s) for name, s in samples.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--elements", type=int, default=1 << 22)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--out", default="benchmarks/results/fused-recompute-cost.json")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    x = torch.rand(args.elements)
    results: dict[str, dict] = {}
    for family, ops in (("add/mul", CHEAP), ("sin/exp/tanh", TRANSCENDENTAL)):
        calls: dict[str, Callable[[], object]] = {}
        for k in LENGTHS:
            eager = _chain(ops, k)
            fused = torch.compile(eager, dynamic=False)
            calls[f"fused {k}"] = lambda f=fused: f(x)
            calls[f"eager {k}"] = lambda f=eager: f(x)
        medians = _timed_rounds(calls, args.reps)
        fused_line = _slope({k: medians[f"fused {k}"] for k in LENGTHS})
        eager_line = _slope({k: medians[f"eager {k}"] for k in LENGTHS})
        results[family] = {
            "medians_s": medians,
            "fused_ns_per_element_op": fused_line[1] / args.elements * 1e9,
            "fused_intercept_ns_per_element": fused_line[0] / args.elements * 1e9,
            "eager_ns_per_element_op": eager_line[1] / args.elements * 1e9,
        }
        torch._dynamo.reset()

    n = 1024
    a, b = torch.randn(n, n), torch.randn(n, n)
    mm = torch.compile(torch.mm, dynamic=False)
    mm_seconds = _timed_rounds({"mm": lambda: mm(a, b)}, args.reps)["mm"]
    calibrated = calibrate_profile("cpu")
    shipped = get_profile("cpu")
    round_trip = 8 / calibrated.bandwidth * 1e9  # one fp32 read + one write per element
    results["matmul"] = {
        "n": n,
        "seconds": mm_seconds,
        "achieved_flops": 2 * n**3 / mm_seconds,
        "calibrated_peak_flops": calibrated.peak_flops,
    }
    results["profiles"] = {
        "calibrated": {
            "vector_ns_per_element_op": 1e9 / calibrated.vector_flops,
            "transcendental_ops": calibrated.transcendental_ops,
            "round_trip_ns_per_element": round_trip,
            "peak_flops": calibrated.peak_flops,
            "bandwidth": calibrated.bandwidth,
        },
        "shipped cpu": {
            "vector_ns_per_element_op": 1e9 / shipped.vector_flops,
            "round_trip_ns_per_element": 8 / shipped.bandwidth * 1e9,
        },
    }

    print(f"{args.elements} fp32 elements, medians of {args.reps} interleaved rounds\n")
    print("| ops | one more op fused | one more op eager | fused chain's read + write |")
    print("|---|---|---|---|")
    for family in ("add/mul", "sin/exp/tanh"):
        r = results[family]
        print(
            f"| {family} | {r['fused_ns_per_element_op']:.3f} ns/element "
            f"| {r['eager_ns_per_element_op']:.3f} ns/element "
            f"| {r['fused_intercept_ns_per_element']:.3f} ns/element |"
        )
    cal = results["profiles"]["calibrated"]
    print(
        f"\nmodel (calibrated profile): {cal['vector_ns_per_element_op']:.3f} ns per element-op, "
        f"{cal['transcendental_ops']:.1f} of them per transcendental element, "
        f"round trip {cal['round_trip_ns_per_element']:.3f} ns per element; shipped cpu profile: "
        f"{results['profiles']['shipped cpu']['vector_ns_per_element_op']:.3f} ns and "
        f"{results['profiles']['shipped cpu']['round_trip_ns_per_element']:.3f} ns"
    )
    m = results["matmul"]
    print(
        f"matmul {n}^3 under inductor: {m['achieved_flops'] / 1e9:.1f} GFLOP/s, roofline "
        f"(calibrated peak) {m['calibrated_peak_flops'] / 1e9:.1f} GFLOP/s"
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"torch": torch.__version__, **results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
