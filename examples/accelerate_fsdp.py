"""remat with accelerate's FSDP2: plan, then prepare. Two CPU processes, gloo.

    torchrun --nproc_per_node=2 examples/accelerate_fsdp.py
    torchrun --nproc_per_node=2 examples/accelerate_fsdp.py --activation-checkpointing

The two-line change to an accelerate training script, before `prepare`:

    from remat.integrations.hf import enable
    enable(model, batch, budget="70%", accelerator=accelerator)
    model, optimizer = accelerator.prepare(model, optimizer)

`enable` traces one training step of the bare model on this rank's batch (fake tensors), plans
under the budget, refuses a region FSDP could not run (one running a layer accelerate shards on
its own inside another's forward) and installs the plan; `prepare` then shards the planned model
(`fully_shard` keeps the plan, which lives on the layers' `forward`). Each rank trains a tiny GPT-2 (dropout on) on its own batches,
once as is and once with the plan, from the same seed: the losses must be equal at every step on
every rank, the plan must hold as predicted on the model before prepare (`remat.verify` with the
batch) and the sharded steps must keep the planned ops (`remat.verify(model)`).

`--activation-checkpointing` turns accelerate's own on as well
(`FullyShardedDataParallelPlugin(activation_checkpointing=True)`): `enable` refuses it, and a
plan made by `remat.auto` without the accelerator, which accelerate then wraps again at prepare,
is refused by `check_accelerator(accelerator, model)` after prepare, naming the layers accelerate
wrapped; both refusals name the setting.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import hf_trainer  # noqa: E402  (the example beside this one: model, data, accelerate on CPU)

import remat  # noqa: E402
from remat.integrations.hf import check_accelerator, enable  # noqa: E402


def accelerator_with_fsdp2(activation_checkpointing: bool) -> Any:
    """An `Accelerator` with accelerate's FSDP2 plugin as a user sets it (every decoder layer its
    own unit), on CPU (`hf_trainer.fsdp_on_cpu`)."""
    from accelerate import Accelerator, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        activation_checkpointing=activation_checkpointing,
    )
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
    hf_trainer.fsdp_on_cpu(accelerator, plugin)
    return accelerator


def batches(rank: int, steps: int, batch: int, seq: int, vocab: int) -> list[dict[str, Any]]:
    """Rank `rank`'s batches: random token ids, their own labels."""
    data = hf_trainer.RandomTokens(steps * batch, seq, vocab, seed=100 + rank)
    return [
        {"input_ids": data.ids[i : i + batch], "labels": data.ids[i : i + batch]}
        for i in range(0, steps * batch, batch)
    ]


def train(model: torch.nn.Module, accelerator: Any, data: list, seed: int) -> list[float]:
    """AdamW over `data` on the prepared `model`: this rank's loss at each step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    torch.manual_seed(seed + accelerator.process_index)
    losses = []
    for batch in data:
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def plan_then_prepare(args: argparse.Namespace, rank: int) -> bool:
    build = lambda: hf_trainer.build_model("gpt2", args.seq, args.seed)  # noqa: E731
    model = build()
    data = batches(rank, args.steps, args.batch, args.seq, model.config.vocab_size)
    baseline = train(model, accelerator_with_fsdp2(False), data, args.seed)

    model = build()
    accelerator = accelerator_with_fsdp2(False)
    plan = enable(model, data[0], args.budget, accelerator=accelerator)
    # before prepare: the plan's predictions against one measured step of this rank's batch
    predicted = remat.verify(model, **data[0], loss_fn=lambda out: out.loss)
    with_remat = train(model, accelerator, data, args.seed)  # prepare shards `model` in place
    check_accelerator(accelerator, model)
    carried_out = remat.verify(model)  # the kept ops matched in the sharded run's last step

    equal = baseline == with_remat and all(map(math.isfinite, baseline))
    ok = equal and predicted.ok and carried_out.ok and bool(plan.regions)
    regions = "; ".join(", ".join(r.modules) for r in plan.regions) or "nothing"
    lines = [
        f"rank {rank}: {plan.strategy}, checkpointed {regions}",
        f"  before prepare {predicted!r}",
        f"  sharded steps: kept ops matched {carried_out.kept_ops_matched}/"
        f"{carried_out.kept_ops_expected}",
        f"  {'step':>4}  {'loss, no remat':>16}  {'loss, remat':>16}",
        *(
            f"  {i:>4}  {a:>16.10f}  {b:>16.10f}"
            for i, (a, b) in enumerate(zip(baseline, with_remat, strict=True), 1)
        ),
        f"  losses equal: {equal}",
    ]
    print("\n".join(lines), flush=True)
    return ok


def refuse_accelerate_checkpointing(args: argparse.Namespace, rank: int) -> bool:
    """accelerate's own activation checkpointing on top of remat's plan: refused before prepare
    by `enable`, and after prepare by `check_accelerator` for a plan made without the
    accelerator (accelerate wraps the planned layers in `CheckpointWrapper` at prepare)."""
    model = hf_trainer.build_model("gpt2", args.seq, args.seed)
    data = batches(rank, 1, args.batch, args.seq, model.config.vocab_size)
    accelerator = accelerator_with_fsdp2(True)
    try:
        enable(model, data[0], args.budget, accelerator=accelerator)
        refused_before = ""
    except remat.RematError as err:
        refused_before = str(err)

    plan = remat.auto(model, **data[0], budget=args.budget, loss_fn=lambda out: out.loss)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    wrapped = remat.checkpointed_elsewhere(model)
    try:
        check_accelerator(accelerator, model)
        refused_after = ""
    except remat.RematError as err:
        refused_after = str(err)
    if rank == 0:
        print(f"enable(..., accelerator=) refused:\n  {refused_before}")
        print(f"remat.auto, then prepare: accelerate wrapped {wrapped} around remat's plan")
        print(f"check_accelerator(accelerator, model) refused:\n  {refused_after}")
    setting = "activation_checkpointing=True"
    return setting in refused_before and setting in refused_after and bool(plan.regions)


def main(argv: list[str] | None = None) -> bool:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--budget", default="70%")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--activation-checkpointing", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", 0))
    if args.activation_checkpointing:
        return refuse_accelerate_checkpointing(args, rank)
    return plan_then_prepare(args, rank)


if __name__ == "__main__":
    hf_trainer.exit_under_torchrun(main())
