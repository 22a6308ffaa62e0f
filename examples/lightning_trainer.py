"""remat with Lightning's Trainer: one callback, `RematCallback(budget=...)`, under its strategies.

    python examples/lightning_trainer.py                     # one process, tiny GPT-2, 3 steps
    torchrun --nproc_per_node=2 examples/lightning_trainer.py --strategy ddp
    torchrun --nproc_per_node=2 examples/lightning_trainer.py --strategy fsdp
    torchrun --nproc_per_node=2 examples/lightning_trainer.py --strategy model-parallel
    torchrun --nproc_per_node=2 examples/lightning_trainer.py --strategy model-parallel --tp 2

A LightningModule around remat's tiny GPT-2 preset (dropout 0.1) is trained by `lightning.Trainer`
twice from the same seed and the same initial weights: once as is, once with

    Trainer(..., callbacks=[RematCallback(budget="60%")])

which traces `training_step` on the Trainer's first batch, plans under the budget and installs the
checkpointing (`remat.integrations.lightning`): in `on_train_start` under the default strategy and
DDP, in `setup` (before anything shards the parameters) under FSDPStrategy (FSDP1, each block its
own unit) and ModelParallelStrategy (FSDP2: `configure_model` calls `fully_shard` on each block).
With `--tp 2` the model is remat's tiny Llama, laid out tensor-parallel in `configure_model`,
which plans it there (`plan(self, budget)`) before `fully_shard`; the callback takes that plan.
Recomputation replays the same dropout masks, so both runs log the same loss at every step on
every rank; rank 0 prints them side by side, each rank checks the plan with `remat.verify` (in one
process and under DDP with a measured step too), and the script fails if anything differs.

Lightning runs FSDPStrategy on GPUs only, and torch's FSDP1 wants an accelerator unless given a
`device_id`: on CPU (CI) `FSDPOnCPU` is Lightning's FSDPStrategy with FSDP1 handed the CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from typing import Any
from unittest import mock

import lightning.pytorch as L
import torch
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy
from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard

import remat
from remat import models
from remat.integrations.lightning import RematCallback, plan
from remat.layouts.parallel import tensor_parallel
from remat.models.gpt import Block

STRATEGIES = ("auto", "ddp", "fsdp", "model-parallel")


class LitLM(L.LightningModule):
    def __init__(self, seq: int, tp: int = 1):
        super().__init__()
        preset, overrides = ("llama-3.2-1b", {}) if tp > 1 else ("gpt2", {"dropout": 0.1})
        self.model, _ = models.build(preset, tiny=True, device="cpu", batch=1, seq=seq, **overrides)

    @property
    def blocks(self) -> torch.nn.ModuleList:
        return getattr(self.model, "h", None) or self.model.layers

    def training_step(self, batch, batch_idx):
        ids = batch[0]
        loss = self.model(ids[:, :-1], labels=ids[:, 1:].contiguous())  # the preset's own loss
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-2)


class ModelParallelLM(LitLM):
    """For ModelParallelStrategy: `configure_model` lays the model out as its user would, tensor
    parallel over the mesh's "tensor_parallel" ranks (remat's plan for its Llama), then FSDP2
    over the "data_parallel" ones, block by block. With tensor parallelism and a `budget`, the
    plan is made between the two, on the layout the rank runs."""

    def __init__(self, seq: int, tp: int = 1, budget: str | None = None):
        super().__init__(seq, tp)
        self.budget = budget

    def configure_model(self):
        tp, dp = self.device_mesh["tensor_parallel"], self.device_mesh["data_parallel"]
        if tp.size() > 1:
            tensor_parallel(self.model, tp.size(), mesh=tp)
            if self.budget is not None:
                plan(self, self.budget)
        for block in self.blocks:
            fully_shard(block, mesh=dp)
        fully_shard(self.model, mesh=dp)


class _FSDP1OnCPU(FullyShardedDataParallel):
    def __init__(self, module, *args, device_id=None, **kwargs):
        super().__init__(module, *args, device_id=torch.device("cpu"), **kwargs)


@contextlib.contextmanager
def fsdp1_on_cpu():
    """Lightning's FSDP strategies wrap with `torch.distributed.fsdp.FullyShardedDataParallel`
    and pass `device_id=None` on CPU, where FSDP1 then refuses to run ("FSDP needs a non-CPU
    accelerator device"); inside, that name is FSDP1 given the CPU as its device."""
    with mock.patch("torch.distributed.fsdp.FullyShardedDataParallel", _FSDP1OnCPU):
        yield


class FSDPOnCPU(FSDPStrategy):
    """Lightning's FSDPStrategy on CPU processes (Lightning checks `type(strategy) is
    FSDPStrategy` to refuse a CPU accelerator); everything but FSDP1's device is Lightning's."""

    def _setup_model(self, model):
        with fsdp1_on_cpu():
            return super()._setup_model(model)


class Losses(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


def make_strategy(name: str, world: int, tp: int) -> Any:
    if name == "ddp":
        return DDPStrategy(process_group_backend="gloo")
    if name == "fsdp":
        return FSDPOnCPU(auto_wrap_policy={Block})  # each block a unit
    if name == "model-parallel":
        return ModelParallelStrategy(data_parallel_size=world // tp, tensor_parallel_size=tp)
    return "auto"


def train(args, world: int, data, budget: str | None) -> tuple[list[float], RematCallback | None]:
    """`args.steps` steps from seed `args.seed`, with the callback when `budget` is given."""
    torch.manual_seed(args.seed)
    module = (
        ModelParallelLM(args.seq, args.tp, budget if args.tp > 1 else None)
        if args.strategy == "model-parallel"
        else LitLM(args.seq)
    )
    L.seed_everything(args.seed, verbose=False)
    losses = Losses()
    callback = None if budget is None else RematCallback(budget=budget)
    trainer = L.Trainer(
        max_steps=args.steps,
        accelerator="cpu",
        devices=world,
        strategy=make_strategy(args.strategy, world, args.tp),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[losses] + ([callback] if callback else []),
    )
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4, shuffle=True))
    return losses.losses, callback


def arguments(doc: str, argv: list[str] | None) -> argparse.Namespace:
    """The examples' options (on one torch thread: fastest for tiny models)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--strategy", choices=STRATEGIES, default="auto")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (model-parallel)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seq", type=int, default=33)
    parser.add_argument("--budget", default="60%")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.tp > 1 and args.strategy != "model-parallel":
        parser.error("--tp needs --strategy model-parallel")
    torch.set_num_threads(1)
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = arguments(__doc__, argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    g = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, 256, (4 * args.steps * world, args.seq), generator=g)
    data = torch.utils.data.TensorDataset(ids)

    baseline, _ = train(args, world, data, None)
    with_remat, callback = train(args, world, data, args.budget)
    measured = args.strategy in ("auto", "ddp")  # the others' parameters are shards: no own step
    check = remat.verify(callback.step, *([(ids[:4],)] if measured else []))
    remat.remove(callback.step)

    result = report(f"{args.strategy} on {world} process(es)", baseline, with_remat, args.steps,
                    callback.plan, check)  # fmt: skip
    result["first_step"] = callback.check.report  # the first step's check against the plan
    return result


def report(
    what: str, baseline: list[float], with_remat: list[float], steps: int, plan: Any, check: Any
) -> dict[str, Any]:
    """Print the plan, the check and the losses side by side (rank 0), and whether this rank's
    losses are equal and the check ok; the examples' result."""
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        print(f"\n{what}: {plan!r}\nverify: {check!r}")
        print(f"{'step':>4}  {'loss, no remat':>16}  {'loss, remat':>16}")
        for step, (a, b) in enumerate(zip(baseline, with_remat, strict=False), start=1):
            print(f"{step:>4}  {a:>16.10f}  {b:>16.10f}")
    equal = len(baseline) == len(with_remat) == steps and torch.allclose(
        torch.tensor(baseline), torch.tensor(with_remat), rtol=1e-6, atol=0
    )
    print(f"rank {rank}: losses equal: {equal} | verify ok: {check.ok}", flush=True)
    return {"baseline": baseline, "remat": with_remat, "equal": equal, "plan": plan,
            "verified": check.ok}  # fmt: skip


def exit_with(result: dict[str, Any]) -> None:
    """Exit 0 when the losses were equal, the check ok and something checkpointed (`OK` on rank
    0); under torchrun skip the interpreter's teardown once done (`distributed.py`)."""
    ok = result["equal"] and result["verified"] and bool(result["plan"].regions)
    if ok and int(os.environ.get("RANK", "0")) == 0:
        print("OK")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from distributed import exit_before_interpreter_teardown

        if ok:
            exit_before_interpreter_teardown()
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    exit_with(main())
