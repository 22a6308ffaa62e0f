"""`remat.auto` on a model that is already on the GPU, as a user calls it, against the same
budget planned the way `remat plan --gpu` plans (a meta copy traced with the GPU's kernel rules,
`targets.runtime_cuda`), each applied to the CUDA model and checked by `remat.verify` after a
training step.

`remat.auto` traces a model on CUDA with the CPU's kernel rules (its default target): no CUDA
kernel scratch, CPU-measured scratch instead. Whether that costs the held bytes or the peak on a
GPU, and so whether auto should trace for `runtime_cuda()` by default, is what this measures; a
third row traces the CUDA model itself with the GPU's rules (fake CUDA tensors: the rules were
written for fake CPU ones, so whether that path holds is part of the answer)
(stop 49: not yet run on a GPU). On a machine without CUDA both rows are CPU plans (they may
differ: auto ranks with checkpointing's cost measured on the device): a check that the script runs.

    python benchmarks/gpu_auto.py --out DIR [--models gpt2 llama-3.2-1b] [--budget 60%]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

import remat
from remat import models
from remat.planning.planner import Planner
from remat.tracing.trace import default_loss

SHAPES = {"gpt2": (4, 1024), "llama-3.2-1b": (1, 2048)}
TINY_SHAPE = (2, 64)


def _train_step(model: torch.nn.Module, inputs: tuple[Any, ...]) -> None:
    model.zero_grad(set_to_none=True)
    default_loss(model(*inputs)).backward()
    model.zero_grad(set_to_none=True)


def _row(name: str, plan: remat.Plan, model: torch.nn.Module, inputs: tuple) -> dict[str, Any]:
    _train_step(model, inputs)
    check = remat.verify(model, *inputs)
    row = {
        "row": name,
        "strategy": plan.strategy,
        "target": plan.details.get("target", ""),
        "budget_bytes": plan.budget_bytes,
        "predicted_peak_bytes": check.peak_bytes_predicted,
        "measured_peak_bytes": check.peak_bytes_measured,
        "predicted_held_bytes": check.held_bytes_predicted,
        "measured_held_bytes": check.held_bytes_measured,
        "kept_ops": f"{check.kept_ops_matched}/{check.kept_ops_expected}",
        "ok": check.ok,
        "verification": repr(check),
    }
    print(f"  {name}: {check!r}", flush=True)
    remat.remove(model)
    return row


def run(name: str, device: torch.device, budget: str, tiny: bool) -> list[dict[str, Any]]:
    batch, seq = TINY_SHAPE if tiny else SHAPES.get(name, (2, 1024))
    torch.manual_seed(0)
    model, inputs = models.build(name, batch=batch, seq=seq, device=device, tiny=tiny)
    print(f"{name} {batch} x {seq} on {device}", flush=True)
    users = remat.auto(model, *inputs, budget=budget, tune=False, check=False)
    rows = [_row("remat.auto (as users call it)", users, model, inputs)]
    meta, meta_inputs = models.build(name, batch=batch, seq=seq, device="meta", tiny=tiny)
    if device.type == "cuda":
        from remat.device.targets import runtime_cuda

        target, profile = runtime_cuda(device), users.profile
    else:
        target, profile = None, users.profile
    graph = remat.trace(meta, *meta_inputs, target=target)
    planned = Planner(graph, profile).plan(users.budget_bytes or budget, "auto")
    remat.apply(model, planned)
    rows.append(_row("meta copy, the GPU's kernel rules", planned, model, inputs))
    if target is not None:  # what auto's default would become: the CUDA model, the GPU's rules
        try:
            graph = remat.trace(model, *inputs, target=target)
            own = Planner(graph, profile).plan(users.budget_bytes or budget, "auto")
            remat.apply(model, own)
            rows.append(_row("the CUDA model, the GPU's kernel rules", own, model, inputs))
        except Exception as err:  # the finding, not a crash: this path is what is being tried
            remat.remove(model)
            rows.append({"row": "the CUDA model, the GPU's kernel rules", "error": repr(err)})
            print(f"  the CUDA model, the GPU's kernel rules: {err!r}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["gpt2", "llama-3.2-1b"])
    parser.add_argument("--budget", default="60%")
    parser.add_argument("--tiny", action="store_true", help="the models' tiny configs")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    label = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    result: dict[str, Any] = {"device": label, "torch": torch.__version__, "rows": {}}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"gpu-auto-{label.lower().replace(' ', '-')}.json"
    for name in args.models:
        result["rows"][name] = run(name, device, args.budget, args.tiny)
        path.write_text(json.dumps(result, indent=2))  # after each model: a cut-off call keeps it
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
