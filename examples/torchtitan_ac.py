"""remat as torchtitan's activation checkpointing: `RematAC.Config(budget=...)`.

    python examples/torchtitan_ac.py                  # tiny llama3 debug model, 3 steps, 60%
    python examples/torchtitan_ac.py --steps 5 --budget 50% --mixed-precision bfloat16

torchtitan's llama3 `debugmodel` (its own model code; 3 layers and a 512-token vocabulary so that
a step takes well under a second on a CPU, attention through SDPA: torchtitan's FlexAttention is
compiled) is laid out by torchtitan's own `parallelize_llama`, in one gloo process: the
activation-checkpointing policy is applied to the meta model, then FSDP2's `fully_shard` with
torchtitan's mixed precision, then the trainer's `to_empty` and `init_weights`. It is trained
twice from the same seed on the same random tokens with torchtitan's CrossEntropyLoss: once with
`ac_config=None`, once with

    ac_config=RematAC.Config(budget="60%", local_batch_size=4, seq_len=128,
                             mixed_precision_param="float32")

whose `apply` traces the meta model's step on fake tensors, plans which activations to keep and
which to recompute under the budget, and installs the plan on the blocks. The two runs log the
same loss and gradient norm at every step (llama3 has no dropout; a region that drew random
numbers would replay them); the script prints them side by side, and `remat.verify` checks that
the last step carried out the plan (every kept op matched). One measured step compares what the
blocks held for backward with the plan's prediction; its peak is not compared: the plan is made
for the traced step, without FSDP's fp32 shards, gathered copies and reduce-scatter buffers.
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import tempfile
from typing import Any

import torch
import torch.distributed as dist

import remat
from remat.integrations.torchtitan import RematAC
from remat.units import format_bytes


@contextlib.contextmanager
def one_process_group():
    """A gloo process group of one rank, and torchtitan's meshes on the CPU, where this example
    trains: torchtitan takes its device type from the machine (`tools.utils.device_type`), and
    says "cuda" where there is no accelerator."""
    import torchtitan.distributed.parallel_dims as parallel_dims

    owned = not dist.is_initialized()
    if owned:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    device_type = parallel_dims.device_type
    parallel_dims.device_type = "cpu"
    try:
        yield
    finally:
        parallel_dims.device_type = device_type
        if owned:
            dist.destroy_process_group()


def build(args: argparse.Namespace, ac_config: Any) -> torch.nn.Module:
    """The model as torchtitan's trainer makes it: built on meta, `parallelize_llama` (tensor
    parallelism: none here; activation checkpointing; FSDP2 with mixed precision), `to_empty`,
    `init_weights` from the seed."""
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.llama3 import parallelize_llama

    from remat.models import build as build_model

    step, _ = build_model(
        "torchtitan:llama3:debugmodel",
        seq=args.seq,
        device="meta",
        n_layers=args.layers,
        vocab_size=args.vocab,
    )
    model = step.model
    parallelism = ParallelismConfig()
    dims = ParallelDims.from_config(parallelism, world_size=1)
    dims.build_mesh()
    training = TrainingConfig(
        local_batch_size=args.batch, seq_len=args.seq, mixed_precision_param=args.mixed_precision
    )
    with tempfile.TemporaryDirectory() as dump:
        model = parallelize_llama(
            model,
            parallel_dims=dims,
            training=training,
            parallelism=parallelism,
            compile_config=CompileConfig(),
            ac_config=ac_config,
            dump_folder=dump,
        )
    model.to_empty(device="cpu")
    torch.manual_seed(args.seed)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model.train()


def batches(args: argparse.Namespace) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(tokens, labels, positions) per step: random ids, next-token labels, one document a row."""
    g = torch.Generator().manual_seed(args.seed + 1)
    out = []
    for _ in range(args.steps):
        ids = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
        positions = torch.arange(args.seq).expand(args.batch, args.seq)
        out.append((ids[:, :-1], ids[:, 1:], positions))
    return out


def train(model: torch.nn.Module, data: list, lr: float = 8e-4) -> dict[str, list[float]]:
    """torchtitan's step: forward with positions, CrossEntropyLoss over the valid tokens,
    backward, gradient clipping at 1.0, AdamW."""
    from torchtitan.components.loss import CrossEntropyLoss

    loss_fn = CrossEntropyLoss.Config().build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, foreach=False)
    losses, norms = [], []
    for tokens, labels, positions in data:
        optimizer.zero_grad()
        pred = model(tokens, positions=positions)
        loss, _ = loss_fn(pred, labels, torch.tensor(labels.numel()))
        del pred
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=False)
        optimizer.step()
        losses.append(loss.item())
        norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
    return {"loss": losses, "grad_norm": norms}


class TokenLoss:
    """torchtitan's loss of one step on `labels`, for `remat.verify`'s measured step."""

    def __init__(self, labels: torch.Tensor):
        self.labels = labels

    def __call__(self, pred: torch.Tensor) -> torch.Tensor:
        from torchtitan.components.loss import cross_entropy_loss

        return cross_entropy_loss(pred, self.labels) / self.labels.numel()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--budget", default="60%", help='bytes, "40MiB", or "60%%" of store-all')
    parser.add_argument(
        "--mixed-precision",
        default="float32",
        choices=("bfloat16", "float32"),
        help="training.mixed_precision_param, the dtype fully_shard computes in (torchtitan's "
        "default is bfloat16; float32 here, bf16 matmuls are slow on most CPUs)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: fastest for tiny models)"
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    data = batches(args)

    with one_process_group():
        baseline = train(build(args, ac_config=None), data)
        ac_config = RematAC.Config(
            budget=args.budget,
            local_batch_size=args.batch,
            seq_len=args.seq,
            mixed_precision_param=args.mixed_precision,
            target="cpu",  # planned for where it trains (by default: this process's GPU if any)
        )
        model = build(args, ac_config=ac_config)
        with_remat = train(model, data)
        check = remat.verify(model)  # the last step's forward kept every op the plan keeps
        plan = RematAC.plan_of(model)
        # one measured step: what the blocks held for backward against the plan (the peak is not
        # comparable: the plan counts no FSDP copy of the parameters or gradients)
        tokens, labels, positions = data[-1]
        held = remat.verify(model, tokens, positions=positions, loss_fn=TokenLoss(labels))
    regions = "; ".join(", ".join(r.modules) for r in plan.regions) or "nothing"
    print(
        f"\nremat plan: {plan.strategy}, budget {format_bytes(plan.budget_bytes or 0)}, predicted "
        f"peak {format_bytes(plan.predicted_peak_bytes)}, held for backward "
        f"{format_bytes(plan.held_bytes)}, recompute +{plan.recompute_flops_share:.0%} of the "
        f"forward's FLOPs\n  checkpointed: {regions}; kept ops matched "
        f"{check.kept_ops_matched}/{check.kept_ops_expected}; verify ok: {check.ok}; held for "
        f"backward, measured / predicted: {held.held_ratio:.4f}"
    )
    print(f"{'step':>4}  {'loss, no AC':>16}  {'loss, RematAC':>16}  {'grad norm, both':>19}")
    columns = (baseline["loss"], with_remat["loss"], baseline["grad_norm"], with_remat["grad_norm"])
    for step, (a, b, ga, gb) in enumerate(zip(*columns, strict=True), start=1):
        print(f"{step:>4}  {a:>16.10f}  {b:>16.10f}  {ga:>9.6f} {gb:>9.6f}")
    equal = baseline == with_remat and len(baseline["loss"]) == args.steps
    print("losses and gradient norms equal:", equal)
    return {
        "baseline": baseline["loss"],
        "remat": with_remat["loss"],
        "grad_norm": {"baseline": baseline["grad_norm"], "remat": with_remat["grad_norm"]},
        "equal": equal and check.ok,
        "plan": plan,
        "verified": check.ok,
        "held_ratio": held.held_ratio,
    }


if __name__ == "__main__":
    raise SystemExit(0 if main()["equal"] else 1)
