"""Untuned auto's pick against the peers at their peaks, in the thread's CPU time (issue 38, item 2).

    OMP_NUM_THREADS=1 python benchmarks/auto_ranking.py [--model zoo|harness|resmlp|encoder]
        [--rounds 6]

For the zoo's GPT-2 of benchmarks/eager_equal_peak.py (12 layers, d 768, vocab 8192, seq 256,
batch 4, tied head), the independent harness GPT-2 of benchmarks/harness_gpt2.py (untied head) or
a residual MLP (8 blocks `x + Linear(GELU(Linear(LayerNorm(x))))`, d 512, 16 x 128 tokens) or the
issue's encoder (4 `nn.TransformerEncoderLayer(128, 4, 512, batch_first=True)`, dropout 0.1,
batch 16, seq 128), auto's
untuned pick is planned at each peer's peak twice: ranked as before issue 38's calibration (the
shipped `cpu` profile plus checkpointing's measured host cost: `with_measured_overheads`) and as
`remat.auto` ranks now (`measured_profile`: the op rates measured too). Peers: torch's full and
torchtitan-style selective checkpointing (the zoo's as remat's plans, whose predicted peaks equal
their measured ones there; the harness's written by hand, at their measured peaks); the MLP's and
the encoder's: full, chain_dp, first_k, sqrt and milp at 60% of store-all. Every row is then timed in interleaved rounds (each round one step of every
row, starting one row later each round, a warm-up step each in the first), each step's
`time.thread_time()`: on the 2 cores other sessions share, wall-clock rounds spread 0.5-2.3x, the
thread's CPU time +-5%. Prints each row's median and its per-round ratio to store_all; writes
benchmarks/results/auto-ranking-<model>.json with every step's times and the load.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

import remat
from remat import models
from remat.answers.bench import plan_applied
from remat.applying.tune import measured_profile, with_measured_overheads
from remat.planning.planner import Planner
from remat.planning.strategies import get
from remat.tracing.trace import default_loss

sys.path.insert(0, str(Path(__file__).parent))
GPT2_STYLE = {"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 8192}
#: the harness peers' measured whole-step peaks (docs/benchmarks.md, issue 38, item 4)
HARNESS_PEAKS = {"full": 803967944, "selective": 914208008}


class ResMLP(nn.Module):
    def __init__(self, d: int = 512, n: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
            for _ in range(n)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = x + b(x)
        return x


def _build(name: str, device: str) -> tuple[nn.Module, tuple]:
    torch.manual_seed(0)
    if name == "zoo":
        return models.build("gpt2", device=device, batch=4, seq=256, **GPT2_STYLE)
    if name == "harness":
        from harness_gpt2 import build

        return build(device)
    with torch.device(device):
        if name == "encoder":
            layer = nn.TransformerEncoderLayer(128, 4, 512, batch_first=True)
            model = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
            return model, (torch.randn(16, 128, 128),)
        return ResMLP(), (torch.randn(16, 128, 512),)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("zoo", "harness", "resmlp", "encoder"), default="zoo")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)

    meta, meta_inputs = _build(args.model, "meta")
    graph = remat.trace(meta, *meta_inputs)
    shipped = Planner(graph, "cpu")
    cpu = torch.device("cpu")
    rankings = {
        "before": Planner(graph, with_measured_overheads(shipped.profile, cpu)),
        "now": Planner(graph, measured_profile(shipped.profile, cpu)),
    }
    model, inputs = _build(args.model, "cpu")
    rows: dict[str, object] = {"store_all": contextlib.nullcontext}
    if args.model == "harness":
        from harness_gpt2 import _full, _selective, wrapped

        rows["torch full"] = functools.partial(wrapped, model, _full)
        rows["torch selective"] = functools.partial(wrapped, model, _selective)
        peaks = HARNESS_PEAKS
    elif args.model == "zoo":
        peaks = {}
        for peer in ("full", "selective:torchtitan"):
            plan = shipped.solve(get(peer), 0)
            peaks[peer] = plan.predicted_peak_bytes
            rows[peer] = functools.partial(plan_applied, model, plan)
    else:
        peaks = {"60%": shipped.budget_bytes("60%")}
        for peer in ("full", "chain_dp", "first_k", "sqrt", "milp"):
            rows[peer] = functools.partial(plan_applied, model, shipped.plan(peaks["60%"], peer))
    picks: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for peer, peak in peaks.items():
        for tag, planner in rankings.items():
            pick = planner.plan(peak, "auto")
            key = tuple((r.modules, r.keep) for r in pick.regions)
            name = f"auto at {peer}'s peak, {tag}"
            options = pick.details.get("options")
            picks[name] = f"{pick.strategy} {options or ''} {pick.recompute_seconds * 1e3:.1f} ms"
            print(f"{name}: {picks[name]}", flush=True)
            if key in seen:
                picks[name] += f" (= {seen[key]})"
                continue
            seen[key] = name
            rows[name] = functools.partial(plan_applied, model, pick)

    names = list(rows)

    def step() -> None:
        for p in model.parameters():
            p.grad = None
        default_loss(model(*inputs)).backward()

    cpu_s: dict[str, list[float]] = {n: [] for n in names}
    wall: dict[str, list[float]] = {n: [] for n in names}
    loads = []
    for r in range(args.rounds):
        loads.append(float(Path("/proc/loadavg").read_text().split()[0]))
        print(f"round {r + 1}, load {loads[-1]}", file=sys.stderr, flush=True)
        for k in range(len(names)):
            n = names[(r + k) % len(names)]
            with rows[n]():  # type: ignore[operator]
                if r == 0:
                    step()
                c, w = time.thread_time(), time.perf_counter()
                step()
                cpu_s[n].append(time.thread_time() - c)
                wall[n].append(time.perf_counter() - w)
    print(f"\nthreads {torch.get_num_threads()}, {args.rounds} rounds, load {loads}")
    print("| row | thread CPU median ms | per round vs store_all: median (min-max) |")
    print("|---|---:|---:|")
    for n in names:
        ratios = sorted(a / b for a, b in zip(cpu_s[n], cpu_s["store_all"], strict=True))
        print(
            f"| {n} | {statistics.median(cpu_s[n]) * 1e3:.0f} | {statistics.median(ratios):.3f} "
            f"({ratios[0]:.3f}-{ratios[-1]:.3f}) |"
        )
    out = Path(args.out) / f"auto-ranking-{args.model}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"picks": picks, "cpu": cpu_s, "wall": wall, "loads": loads, "rows": names}
    out.write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
