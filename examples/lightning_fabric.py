"""remat with Lightning Fabric: `fabric_setup(fabric, model, example=..., budget=...)` in place of
`fabric.setup(model)`.

    python examples/lightning_fabric.py                      # one process, tiny GPT-2, 3 steps
    torchrun --nproc_per_node=2 examples/lightning_fabric.py --strategy ddp
    torchrun --nproc_per_node=2 examples/lightning_fabric.py --strategy fsdp
    torchrun --nproc_per_node=2 examples/lightning_fabric.py --strategy model-parallel
    torchrun --nproc_per_node=2 examples/lightning_fabric.py --strategy model-parallel --tp 2

remat's tiny GPT-2 (dropout 0.1; it returns its own loss) is trained by a plain Fabric loop twice
from the same seed and weights on each rank's own batches: once set up as is, once with

    model = fabric_setup(fabric, model, example=(ids, labels), budget="60%")

which plans the step under the budget and installs the plan before Fabric wraps the model (DDP,
FSDP1 with each block its own unit, or ModelParallelStrategy's `parallelize_fn`: FSDP2 block by
block), then checks it survived the wrapping (`remat.integrations.lightning`). With `--tp 2`
the model is remat's tiny Llama and `parallelize_fn` lays it out tensor-parallel, plans it there
with `remat.auto` (the plan must see the rank's layout) and then shards it; `fabric.setup` is
Fabric's own. Both runs give the same loss at every step on every rank, each rank checks the plan
with `remat.verify` (measured in one process and under DDP), and the script fails otherwise.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy
from lightning_trainer import arguments, exit_with, fsdp1_on_cpu, report
from torch.distributed.fsdp import fully_shard

import remat
from remat import models
from remat.integrations.lightning import fabric_setup
from remat.layouts.parallel import tensor_parallel
from remat.models.gpt import Block


class FabricFSDPOnCPU(FSDPStrategy):
    """Fabric's FSDPStrategy on CPU processes (as `lightning_trainer.FSDPOnCPU`)."""

    def setup_module(self, module):
        with fsdp1_on_cpu():
            return super().setup_module(module)


def blocks(model: torch.nn.Module) -> torch.nn.ModuleList:
    return getattr(model, "h", None) or model.layers


def parallelize(tp: int, example: tuple, budget: str | None):
    """ModelParallelStrategy's `parallelize_fn`: tensor parallelism over `tp` ranks (with a plan
    on that layout when `budget` is given), then FSDP2 block by block over the others."""

    def parallelize_fn(model, mesh):
        if tp > 1:
            tensor_parallel(model, tp, mesh=mesh["tensor_parallel"])
            if budget is not None:
                remat.auto(model, *example, budget=budget)
        for block in blocks(model):
            fully_shard(block, mesh=mesh["data_parallel"])
        return fully_shard(model, mesh=mesh["data_parallel"])

    return parallelize_fn


def make_strategy(name: str, world: int, tp: int, example: tuple, budget: str | None) -> Any:
    if name == "ddp":
        return DDPStrategy(process_group_backend="gloo")
    if name == "fsdp":
        return FabricFSDPOnCPU(auto_wrap_policy={Block})
    if name == "model-parallel":
        return ModelParallelStrategy(
            parallelize(tp, example, budget),
            data_parallel_size=world // tp,
            tensor_parallel_size=tp,
        )
    return "auto"


def train(args, world: int, batches: list, budget: str | None) -> tuple[list[float], Any]:
    """`args.steps` steps on this rank's `batches` from seed `args.seed`; planned when `budget`."""
    ids = batches[0]
    example = (ids[:, :-1], ids[:, 1:].contiguous())
    fabric = Fabric(
        accelerator="cpu",
        devices=world,
        strategy=make_strategy(args.strategy, world, args.tp, example, budget),
    )
    fabric.launch()
    fabric.seed_everything(args.seed, verbose=False)
    preset, overrides = ("llama-3.2-1b", {}) if args.tp > 1 else ("gpt2", {"dropout": 0.1})
    model, _ = models.build(preset, tiny=True, device="cpu", batch=1, seq=args.seq, **overrides)
    if budget is None or args.tp > 1:  # with tensor parallelism parallelize_fn plans
        model = fabric.setup(model)
    else:
        model = fabric_setup(fabric, model, example=example, budget=budget)
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=1e-2))
    losses = []
    for ids in batches:
        loss = model(ids[:, :-1], labels=ids[:, 1:].contiguous())
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    return losses, model.module


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = arguments(__doc__, argv)
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    # tensor-parallel ranks take the same batches; data-parallel ranks their own
    g = torch.Generator().manual_seed(args.seed + rank // args.tp)
    batches = [torch.randint(0, 256, (4, args.seq), generator=g) for _ in range(args.steps)]

    baseline, _ = train(args, world, batches, None)
    with_remat, planned = train(args, world, batches, args.budget)
    ids = batches[0]
    measured = args.strategy in ("auto", "ddp")  # the others' parameters are shards: no own step
    inputs = (ids[:, :-1], ids[:, 1:].contiguous()) if measured else ()
    check = remat.verify(planned, *inputs)
    plan = remat.installed_plan(planned)
    remat.remove(planned)

    return report(f"Fabric {args.strategy} on {world} process(es)", baseline, with_remat,
                  args.steps, plan, check)  # fmt: skip


if __name__ == "__main__":
    exit_with(main())
