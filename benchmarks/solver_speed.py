"""Speed targets of the solvers and the model zoo, on the instances the tests check for correctness.

Wall-clock limits are targets, not tests: on a loaded 2-core machine a test that asserts one fails
for reasons of its neighbours (the chain DP's 2 s limit did, while a compile ran beside the suite).
Each case is timed `--repeats` times; the median is compared with its target.

| case | target | test of its answer |
|---|---|---|
| chain DP, 128 distinct blocks, 4 budgets | 2 s a solve | tests/test_chain.py |
| block MILP, 128 blocks x 4 options | 5 s | tests/test_milp.py |
| min-cut, 20k-op forward | 5 s | tests/test_mincut.py |
| llama-3.1-70b built on meta | 2 s | tests/test_models.py |

Run: python benchmarks/solver_speed.py [--repeats 3]   (from the repository root)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tests' instances

import numpy as np  # noqa: E402
from test_chain import distinct_chain  # noqa: E402
from test_milp import highest_peak, min_peak, random_problem  # noqa: E402
from test_mincut import large_graph  # noqa: E402

from remat import models  # noqa: E402
from remat.planning.solvers.chain import chain_dp, min_feasible_bytes, store_all  # noqa: E402
from remat.planning.solvers.milp import milp  # noqa: E402
from remat.planning.solvers.mincut import mincut  # noqa: E402


def chain_cases() -> list[tuple[str, Callable[[], object], float]]:
    chain = distinct_chain(128, seed=0)
    bottom, top = min_feasible_bytes(chain), store_all(chain).peak_bytes
    return [
        (
            f"chain_dp 128 blocks at {fraction:.0%}",
            lambda b=int(bottom + fraction * (top - bottom)): chain_dp(chain, b),
            2.0,
        )
        for fraction in (0.1, 0.25, 0.5, 0.9)
    ]


def milp_case() -> tuple[str, Callable[[], object], float]:
    problem = random_problem(np.random.default_rng(128), blocks=128, options=4)
    budget = (min_peak(problem) + highest_peak(problem)) // 2
    return "milp 128 blocks x 4 options", lambda: milp(problem, budget), 5.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    graph = large_graph()
    cases = [
        *chain_cases(),
        milp_case(),
        ("mincut 20k-op forward", lambda: mincut(graph), 5.0),
        ("llama-3.1-70b on meta", lambda: models.build("llama-3.1-70b"), 2.0),
    ]
    missed = 0
    for name, run, target in cases:
        seconds = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            run()
            seconds.append(time.perf_counter() - start)
        median = statistics.median(seconds)
        missed += median > target
        print(
            f"{name:34s} median {median:6.3f} s (min {min(seconds):.3f}, max {max(seconds):.3f})"
            f"  target {target:.1f} s  {'ok' if median <= target else 'MISSED'}"
        )
    return 1 if missed else 0


if __name__ == "__main__":
    raise SystemExit(main())
