"""Where a prediction and the device part ways, op by op: the planner's simulated live bytes at
each op of a plan's schedule against the caching allocator's counters around each op of the real
step, run under a dispatch mode on the device.

    python benchmarks/gpu_op_memory.py [--device cuda|cpu] [--tiny]
        [--runs MODEL:SHAPE:STRATEGY ...] [--out DIR]

SHAPE is BATCHxSEQ (`4x1024`) or BATCH (`8192`, models without a sequence). The model is built
and traced as `benchmarks/gpu_validate.py`'s memory part does (bf16-mixed on CUDA, a meta copy
traced with the GPU's kernel rules); the plan of STRATEGY (not budgeted: store_all, full, sqrt,
selective:...) is applied to the real model and one step (after one warm-up step) is recorded:
per op, the allocated bytes before and after it and the peak while it ran, above the step's
start. The two sequences are aligned by op (difflib on the aten op names); the report gives the
predicted and measured peaks, the ops only one side ran, and the aligned ops where the two
differ most. Writes DIR/op-memory-<model>-<strategy>.json (both sequences whole) and prints the
report. On the CPU the counters are the profiler's, and this is a check of the script only.
The recording mode itself changes one thing: autograd adds two gradients that meet out of place
under any dispatch mode (`remat.tracing.tensors.accumulates_in_place`), so where the engine would
add in place the recorded step allocates one gradient more than training does; the peaks of
`gpu_validate.py`'s memory part, measured without a mode, are the ones to compare.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from pathlib import Path
from typing import Any

import torch
from gpu_validate import PRECISIONS, Settings, Step, _build, _gpu_target, _planner, loss_of
from torch.utils._python_dispatch import TorchDispatchMode

from remat.answers.bench import plan_applied
from remat.device.cost import get_profile
from remat.planning import strategies
from remat.units import format_bytes

RUNS = (
    "hf:gpt2:4x1024:store_all",
    "megatron-gpt:2x2048:store_all",
    "megatron-gpt:2x2048:full",
    "llama-3.2-1b:1x2048:store_all",
    "llama-3.2-1b:1x2048:full",
    "mlp-chain-16:8192:store_all",
    "gpt2:4x1024:selective:megatron",
)


def allocated(device: torch.device) -> int:
    """The caching allocator's allocated bytes; 0 off CUDA (the script's own check)."""
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


class AllocatedAroundOps(TorchDispatchMode):
    """Per op: (aten name, allocated before, after, the peak while it ran)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device, self.rows = device, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        before = allocated(self.device)
        out = func(*args, **(kwargs or {}))
        peak = torch.cuda.max_memory_allocated(self.device) if cuda else 0
        self.rows.append((str(func), before, allocated(self.device), peak))
        return out


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def parse_run(text: str) -> tuple[str, dict[str, int], str]:
    """`MODEL:SHAPE:STRATEGY` (a model name may hold a colon: `hf:gpt2:4x1024:store_all`)."""
    parts = text.split(":")
    at = next((i for i, p in enumerate(parts) if p.replace("x", "").isdigit()), None)
    if at is None or at == 0 or at == len(parts) - 1:
        raise SystemExit(f"--runs {text!r}: give MODEL:BATCHxSEQ:STRATEGY (e.g. gpt2:4x1024:full)")
    sizes = [int(n) for n in parts[at].split("x")]
    shape = {"batch": sizes[0], **({"seq": sizes[1]} if len(sizes) > 1 else {})}
    return ":".join(parts[:at]), shape, ":".join(parts[at + 1 :])


def record(name: str, shape: dict[str, int], strategy: str, settings: Settings) -> dict[str, Any]:
    """The plan's simulated schedule and the real step's ops, both above the step's start."""
    model, inputs = _build(name, shape, str(settings.device), settings)
    planner = _planner(name, shape, model, inputs, settings)
    plan = planner.solve(strategies.get(strategy, "eager"), planner.budget_bytes("1TiB"))
    sim = planner.simulate(plan.regions)
    ops = planner.graph.ops
    predicted = [
        (ops[i].target, ops[i].name if kind == "op" else f"{ops[i].name} (replay)", live)
        for (kind, i), live in zip(sim.schedule, sim.timeline, strict=True)
    ]
    step = Step(model, settings.autocast, settings.device.type)
    with plan_applied(model, plan), torch.enable_grad():
        loss_of(step(*inputs)).backward()  # warm-up: workspaces, lazily built state
        for p in model.parameters():
            p.grad = None
        synchronize(settings.device)
        start = allocated(settings.device)
        recorder = AllocatedAroundOps(settings.device)
        with recorder:
            out = step(*inputs)
            loss_of(out).backward()
        del out
        synchronize(settings.device)
    real = [(op, b - start, a - start, p - start) for op, b, a, p in recorder.rows]
    return {
        "model": name,
        "shape": shape,
        "strategy": strategy,
        "plan": plan.strategy,
        "predicted_peak_bytes": sim.peak_bytes - planner.base_bytes,
        "measured_peak_bytes": max((r[3] for r in real), default=0),
        "predicted": [(t, n, live - planner.base_bytes) for t, n, live in predicted],
        "real": real,
    }


def report(result: dict[str, Any], shown: int = 12) -> str:
    """The peaks, the ops one side alone ran, and the aligned ops that differ most."""
    pred, real = result["predicted"], result["real"]
    matcher = difflib.SequenceMatcher(
        a=[p[0] for p in pred], b=[r[0] for r in real], autojunk=False
    )
    lines = [
        f"## {result['model']} {result['shape']} {result['strategy']} ({result['plan']})",
        f"peak predicted {format_bytes(result['predicted_peak_bytes'])}, measured "
        f"{format_bytes(result['measured_peak_bytes'])} "
        f"({result['measured_peak_bytes'] / max(result['predicted_peak_bytes'], 1):.3f}); "
        f"{len(pred)} predicted positions, {len(real)} real ops",
    ]
    pairs, alone = [], []
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            pairs += [(i1 + k, j1 + k) for k in range(i2 - i1)]
            continue
        alone.append(
            f"  {tag}: predicted {[p[1] for p in pred[i1:i2]][:4]}{'...' if i2 - i1 > 4 else ''}"
            f" | real {[r[0] for r in real[j1:j2]][:4]}{'...' if j2 - j1 > 4 else ''}"
        )
    lines.append(f"{len(alone)} stretches not aligned:")
    lines += alone[:shown]
    diffs = sorted(pairs, key=lambda ij: -abs(real[ij[1]][3] - pred[ij[0]][2]))
    lines.append("aligned ops differing most (predicted live while it runs, real peak in it):")
    for i, j in sorted(diffs[:shown]):
        lines.append(
            f"  {i:5d} {pred[i][1]:60s} {format_bytes(pred[i][2]):>10s} "
            f"{format_bytes(real[j][3]):>10s}  {format_bytes(real[j][3] - pred[i][2]):>10s}"
        )
    peak_at = max(range(len(pred)), key=lambda i: pred[i][2], default=None)
    if peak_at is not None:
        lines.append(f"predicted peak at {peak_at}: {pred[peak_at][1]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tiny", action="store_true", help="the models' tiny presets")
    parser.add_argument("--runs", nargs="+", default=list(RUNS), help="MODEL:SHAPE:STRATEGY")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    runs = [parse_run(r) for r in args.runs]
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_op_memory: no CUDA device; the counters it reads are CUDA's", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    precision = "bf16-mixed" if device.type == "cuda" else "fp32"
    settings = Settings(
        device=device,
        precision=precision,
        profile=get_profile("h100" if device.type == "cuda" else "cpu"),
        tiny=args.tiny,
        budget="1TiB",
        trace_real=False,
        target=_gpu_target(device),
    )
    assert precision in PRECISIONS
    args.out.mkdir(parents=True, exist_ok=True)
    failed = 0
    for name, shape, strategy in runs:
        try:
            result = record(name, shape, strategy, settings)
        except Exception as e:  # one run's failure is reported, the others go on
            print(f"## {name} {shape} {strategy}: {type(e).__name__}: {e}", flush=True)
            failed += 1
            continue
        slug = f"{name}-{strategy}".replace(":", "-").replace("/", "-")
        (args.out / f"op-memory-{slug}.json").write_text(json.dumps(result))
        print(report(result), flush=True)
        torch.cuda.empty_cache()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
