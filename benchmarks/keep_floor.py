"""The least recomputation any per-block keep set reaches under a budget (issue 38): the MILP over
every subset of the ops a block's replay can keep, against the shipped planner's options.

    python benchmarks/keep_floor.py [--budget BYTES ...] [--profile cpu]

The shipped planner offers each block a few options (store, full, the named selective policies
and the keep ladder's prefixes, `Planner.block_options`). This study offers every subset of the
ladder's ops (2^n - 2 keep sets a block besides store and full, each simulated exactly over the
whole step) and lets the same MILP mix them per block. Where it finds the same recompute as the
shipped options, no eager plan of keep sets does better at that budget on the profile's prices,
which is what bounds `remat.auto` at a peer's peak. The model is eager_equal_peak.py's GPT-2
(12 layers, d 768, vocab 8192, seq 256, batch 4, fp32); the budgets default to the predicted
peaks of full checkpointing and torchtitan's policy (equal to their measured ones on the CPU).
"""

from __future__ import annotations

import argparse
import sys
from functools import cached_property

from eager_equal_peak import GPT2_STYLE  # this folder is the script's sys.path[0]

import remat
from remat import models
from remat.planning import planner as planning
from remat.planning import strategies
from remat.planning.solvers.selective import dearest_first, keepable

SUBSET = "subset-"


class EveryKeepSet(planning.Planner):
    """A planner whose blocks may keep any subset of their replay's ladder (`dearest_first`)."""

    @cached_property
    def block_options(self) -> tuple[str, ...]:
        first = self.blocks[0]
        n = len(
            dearest_first(self.graph, self.replayed(first.first_op, first.last_op), self.op_seconds)
        )
        masks = range(1, 2**n - 1)
        return (*planning.BLOCK_OPTIONS, *(f"selective:{SUBSET}{m}" for m in masks))

    def policy_keep(self, name: str, first_op: int, last_op: int) -> set[str]:
        if not name.startswith(SUBSET):
            return super().policy_keep(name, first_op, last_op)
        mask = int(name.removeprefix(SUBSET))
        ladder = dearest_first(self.graph, self.replayed(first_op, last_op), self.op_seconds)
        keep = {op.name for i, op in enumerate(ladder) if mask >> i & 1}
        return keepable(self.graph, self.graph.ops[first_op : last_op + 1], keep)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--budget", type=int, nargs="+", help="bytes (default: full's and torchtitan's peaks)"
    )
    parser.add_argument(
        "--sweep", type=int, default=0, help="also N+1 budgets from full's peak to store-all's"
    )
    parser.add_argument("--profile", default="cpu")
    args = parser.parse_args(argv)

    meta, inputs = models.build("gpt2", device="meta", batch=4, seq=256, **GPT2_STYLE)
    graph = remat.trace(meta, *inputs)
    shipped = remat.Planner(graph, args.profile)
    every = EveryKeepSet(graph, args.profile)
    full, titan = (
        shipped.solve(strategies.get(name, "eager"), shipped.estimate.peak_bytes)
        for name in ("full", "selective:torchtitan")
    )
    budgets = args.budget or [full.predicted_peak_bytes, titan.predicted_peak_bytes]
    low, high = full.predicted_peak_bytes, shipped.estimate.peak_bytes
    budgets += [low + (high - low) * k // args.sweep for k in range(args.sweep + 1)] * bool(
        args.sweep
    )
    first = shipped.blocks[0]
    reached = shipped.replayed(first.first_op, first.last_op)
    ladder = dearest_first(graph, reached, shipped.op_seconds)
    print(f"a block's keep ladder ({len(ladder)} ops): " + ", ".join(op.name for op in ladder))
    step = shipped.step_seconds
    print(
        f"options a block: shipped {len(shipped.block_options)}, every keep subset "
        f"{len(every.block_options)}; predicted step without recompute on "
        f"{shipped.profile.name}: {step * 1e3:.0f} ms\n"
    )
    print(
        "| budget (B) | shipped options: plan | recompute | vs store-all | every keep subset: plan "
        "| recompute | vs store-all |"
    )
    print("|---:|---|---:|---:|---|---:|---:|")
    for budget in budgets:
        cells = []
        for planner in (shipped, every):
            plan = planner.plan(budget, "milp")
            extra = plan.recompute_seconds
            cells.append(f"{_what(plan)} | {extra * 1e3:.1f} ms | {1 + extra / step:.4f}x")
        print(f"| {budget:,} | " + " | ".join(cells) + " |")
    return 0


def _what(plan) -> str:
    counts: dict[str, int] = {}
    for option in plan.details.get("options", ()):
        counts[option] = counts.get(option, 0) + 1
    return ", ".join(f"{n}x {o.removeprefix('selective:')}" for o, n in counts.items())


if __name__ == "__main__":
    sys.exit(main())
