"""remat in a plain PyTorch training loop: AdamW, a warmup schedule, gradient accumulation.

    python examples/train_loop.py                       # tiny GPT-2 from transformers, 4 steps
    python examples/train_loop.py --model llama --budget 50% --steps 8
    python examples/train_loop.py --model remat:gpt2    # remat's own zoo, no transformers needed

`--model` is a transformers model type, built from its config with the defaults (dropout,
`use_cache=True`) and only the sizes made small, or `remat:<preset>` for a tiny model of remat's
zoo (`remat.models.build`). The loop trains it twice from the same seed and the same initial
weights: once as is, once after

    plan = remat.auto(model, example_ids, budget="70%", loss_fn=...)

which traces one training step on fake tensors, plans which activations to keep and which to
recompute under the budget, and installs the checkpointing on `model` in place. The loop itself
does not change. The two runs must log the same loss at every optimizer step and end with the same
parameters; the script prints the losses side by side.
"""

from __future__ import annotations

import argparse
import copy
from typing import Any

import torch
import torch.nn.functional as F

import remat
from remat.units import format_bytes

#: Token ids stay below this: the vocabulary of the small models (transformers' and the zoo's).
VOCAB = 512


def build_model(name: str, seq: int, seed: int) -> torch.nn.Module:
    """A transformers causal LM from its default config with small sizes, or a tiny zoo model."""
    torch.manual_seed(seed)
    if name.startswith("remat:"):
        from remat import models

        model, _ = models.build(name.removeprefix("remat:"), tiny=True, device="cpu")
        return model.train()
    from remat.models.hf import build_for_training

    model, _ = build_for_training(
        name, seq=seq, seed=seed
    )  # default config, small sizes, train mode
    return model


def next_token_loss(output: Any, ids: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of each position's logits against the next token. A transformers model returns
    a ModelOutput with `.logits`, a zoo model the logits tensor."""
    logits = getattr(output, "logits", output)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def random_batches(n: int, batch: int, seq: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (batch, seq), generator=g) for _ in range(n)]


def train(
    model: torch.nn.Module,
    batches: list[torch.Tensor],
    *,
    accumulation: int,
    lr: float,
    warmup: int,
    seed: int,
) -> list[float]:
    """One optimizer step per `accumulation` micro-batches; the mean micro-batch loss of each."""
    torch.manual_seed(seed)  # the dropout stream
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    steps = len(batches) // accumulation
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: min((step + 1) / warmup, max(0.0, (steps - step) / max(1, steps - warmup))),
    )
    model.train()
    losses = []
    for step in range(steps):
        total = 0.0
        for ids in batches[step * accumulation : (step + 1) * accumulation]:
            loss = next_token_loss(model(ids), ids)
            (loss / accumulation).backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total / accumulation)
    return losses


def install(model: torch.nn.Module, ids: torch.Tensor, budget: str | int):
    """`remat.auto` on one micro-batch with the loop's loss, and at the smallest feasible budget
    when the asked one is below it."""

    def loss_fn(output):
        return next_token_loss(output, ids)

    try:
        return remat.auto(model, ids, budget=budget, loss_fn=loss_fn)
    except remat.InfeasibleBudget as e:
        print(f"remat: {e}")
        if e.min_feasible_bytes is None:
            raise
        print(f"remat: planning at the smallest feasible budget, {e.min_feasible_bytes} bytes")
        return remat.auto(model, ids, budget=e.min_feasible_bytes, loss_fn=loss_fn)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default="gpt2", help="a transformers model type, or remat:<zoo preset>"
    )
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps")
    parser.add_argument("--accumulation", type=int, default=2, help="micro-batches per step")
    parser.add_argument("--batch", type=int, default=4, help="sequences per micro-batch")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--budget", default="70%", help='bytes, "40MiB", or "70%%" of store-all')
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: fastest for tiny models)"
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    model = build_model(args.model, args.seq, args.seed)
    initial = copy.deepcopy(model.state_dict())
    batches = random_batches(args.steps * args.accumulation, args.batch, args.seq, args.seed + 1)
    run = {"accumulation": args.accumulation, "lr": args.lr, "warmup": 2, "seed": args.seed}

    baseline = train(model, batches, **run)
    trained = {k: v.clone() for k, v in model.state_dict().items()}

    model.load_state_dict(initial)  # the second run starts from the same weights
    plan = install(model, batches[0], args.budget)
    with_remat = train(model, batches, **run)
    check = remat.verify(model)  # what the plan's policies kept in the last training forward
    remat.remove(model)

    regions = "; ".join(", ".join(r.modules) for r in plan.regions) or "nothing"
    print(
        f"remat plan: {plan.strategy}, budget {format_bytes(plan.budget_bytes or 0)}, predicted "
        f"peak {format_bytes(plan.predicted_peak_bytes)}, held for backward "
        f"{format_bytes(plan.held_bytes)}, recompute +{plan.recompute_flops_share:.0%} of the "
        f"forward's FLOPs\n  checkpointed: {regions}; kept ops matched "
        f"{check.kept_ops_matched}/{check.kept_ops_expected}"
    )
    print(f"{'step':>4}  {'loss, no remat':>16}  {'loss, remat':>16}")
    for step, (a, b) in enumerate(zip(baseline, with_remat, strict=False), start=1):
        print(f"{step:>4}  {a:>16.10f}  {b:>16.10f}")

    ref, got = torch.tensor(baseline), torch.tensor(with_remat)
    losses_equal = (
        len(ref) == len(got) == args.steps
        and bool(torch.isfinite(ref).all())
        and torch.allclose(ref, got, rtol=1e-6, atol=0)
    )
    final = model.state_dict()
    param_diff = max((final[k] - v).abs().max().item() for k, v in trained.items())
    params_equal = all(
        torch.allclose(final[k], v, rtol=1e-5, atol=1e-6) for k, v in trained.items()
    )
    print(
        f"losses equal: {losses_equal}; final parameters equal: {params_equal} (max |diff| "
        f"{param_diff:.2e})"
    )
    return {
        "baseline": baseline,
        "remat": with_remat,
        "equal": losses_equal and params_equal,
        "losses_equal": losses_equal,
        "params_equal": params_equal,
        "max_param_diff": param_diff,
        "plan": plan,
    }


if __name__ == "__main__":
    raise SystemExit(0 if main()["equal"] else 1)
