"""A remat plan under DDP or FSDP2 (`fully_shard`), two processes on CPU with gloo.

    torchrun --nproc_per_node=2 examples/distributed.py --mode ddp
    torchrun --nproc_per_node=2 examples/distributed.py --mode fsdp

Each rank trains on its own micro-batch; the gradients (averaged by DDP, reduce-scattered by
FSDP2) must equal the single-process average of both micro-batches' gradients without
checkpointing. The plan is made once from a fake-tensor trace and applied before wrapping, as with
any activation checkpointing (torchtitan applies AC, then FSDP).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import remat
from remat import models


def build():
    torch.manual_seed(0)
    return models.build("gpt2", batch=2, seq=32, device="cpu", tiny=True)


def batch_of(rank: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s micro-batch: token ids and their labels."""
    g = torch.Generator().manual_seed(100 + rank)
    return tuple(torch.randint(0, 512, like.shape, generator=g) for _ in range(2))


def reference_grads(world: int) -> dict[str, torch.Tensor]:
    """Without remat or wrapping: the average over ranks of each micro-batch's gradients."""
    model, (ids, _) = build()
    for rank in range(world):
        (model(*batch_of(rank, ids)) / world).backward()  # the model returns its loss
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["ddp", "fsdp"], required=True)
    parser.add_argument("--strategy", default="full")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    model, (ids, labels) = build()
    graph = remat.trace(model, ids, labels)
    remat.apply(model, remat.plan(graph, budget="1TiB", strategy=args.strategy))
    if args.mode == "ddp":
        wrapped = DistributedDataParallel(model)
    else:
        for block in model.h:
            fully_shard(block)
        wrapped = fully_shard(model)
    wrapped(*batch_of(rank, ids)).backward()

    expected = reference_grads(world)
    worst = 0.0
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        worst = max(worst, (grad - expected[name]).abs().max().item())
    if rank == 0:
        print(f"{args.mode} {args.strategy}: max |grad - single-process grad| = {worst:.2e}")
    assert worst < 1e-5, worst
    if rank == 0:
        print("OK")
    dist.destroy_process_group()


def exit_before_interpreter_teardown() -> None:
    """End the process without Python's finalisation, which races with gloo's worker threads.

    A gloo worker thread drops its finished collective (and the Python-visible tensors it holds)
    after `wait()` has already returned; that needs the GIL. If the main thread is finalising the
    interpreter by then, the worker thread is killed inside a noexcept destructor and the process
    aborts ("terminate called without an active exception", about 1 run in 15 here under FSDP2,
    whose mesh keeps the process group and its threads alive past `destroy_process_group`).
    See pytorch/pytorch#179291. Everything the run had to say is flushed first.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
    exit_before_interpreter_teardown()
