"""remat with the Hugging Face `Trainer`: one callback, `RematCallback(budget=...)`.

    python examples/hf_trainer.py                      # tiny GPT-2, 4 steps, budget 90%
    python examples/hf_trainer.py --model-type llama --steps 8 --budget 60%

A causal LM is built from its transformers config with the defaults (dropout, `use_cache=True`)
and only the sizes made small, and trained on random token ids by `transformers.Trainer` twice
from the same seed and the same initial weights: once as is, once with

    Trainer(..., callbacks=[RematCallback(budget="70%")])

whose `on_train_begin` traces one training step of the Trainer's first batch on fake tensors,
plans which activations to keep and which to recompute under the budget, and installs the
checkpointing on the model in place (`remat.integrations.hf`). Recomputation
replays the same dropout masks (checkpoint restores the RNG state), so the two runs log the same
loss at every step; the script prints both side by side and fails if they differ.
"""

from __future__ import annotations

import argparse
import copy
import tempfile
from typing import Any

import torch

import remat
from remat.integrations.hf import RematCallback
from remat.units import format_bytes


def build_model(model_type: str, seq: int, seed: int) -> torch.nn.Module:
    """A causal LM from its default config (dropout and caching as they are), small sizes, in
    training mode: `remat.models.hf.build_for_training`."""
    from remat.models.hf import build_for_training

    model, _ = build_for_training(model_type, seq=seq, seed=seed)
    return model


class RandomTokens(torch.utils.data.Dataset):
    """`n` sequences of random token ids; the model shifts `labels` itself for next-token loss."""

    def __init__(self, n: int, seq: int, vocab: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def train(
    model: torch.nn.Module,
    dataset: RandomTokens,
    *,
    steps: int,
    batch: int,
    seed: int,
    callbacks: list | None = None,
) -> dict[str, list[float]]:
    """Train with `Trainer` for `steps` optimizer steps; the loss and gradient norm at each."""
    from transformers import Trainer, TrainingArguments

    torch.manual_seed(seed)
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out,
            max_steps=steps,
            per_device_train_batch_size=batch,
            learning_rate=1e-3,
            warmup_steps=1,
            logging_steps=1,
            report_to=[],
            save_strategy="no",
            use_cpu=True,
            seed=seed,
            disable_tqdm=True,
        )
        trainer = Trainer(model=model, args=args, train_dataset=dataset, callbacks=callbacks)
        trainer.train()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    return {
        "loss": [entry["loss"] for entry in logged],
        "grad_norm": [entry["grad_norm"] for entry in logged],
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-type", default="gpt2", help="a transformers model type")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--budget", default="70%", help='bytes, "40MiB", or "70%%" of store-all')
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: fastest for tiny models)"
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    model = build_model(args.model_type, args.seq, args.seed)
    initial = copy.deepcopy(model.state_dict())
    use_cache = model.config.use_cache
    dataset = RandomTokens(
        args.batch * args.steps, args.seq, model.config.vocab_size, seed=args.seed + 1
    )
    run = {"steps": args.steps, "batch": args.batch, "seed": args.seed}

    baseline = train(model, dataset, **run)

    # The second run starts from the same weights, and from the model as built: Trainer turned its
    # KV cache off (TrainingArguments.use_cache), which remat.auto does by itself.
    model.load_state_dict(initial)
    model.config.use_cache = use_cache
    callback = RematCallback(budget=args.budget)
    with_remat = train(model, dataset, **run, callbacks=[callback])
    plan = callback.plan
    example = {k: torch.stack([dataset[i][k] for i in range(args.batch)]) for k in dataset[0]}
    # the plan carried out (kept ops matched), and one measured step's bytes against it
    check = remat.verify(model, **example, loss_fn=lambda out: out.loss)
    remat.remove(model)

    regions = "; ".join(", ".join(r.modules) for r in plan.regions) or "nothing"
    print(
        f"\nremat plan: {plan.strategy}, budget {format_bytes(plan.budget_bytes or 0)}, predicted "
        f"peak {format_bytes(plan.predicted_peak_bytes)}, held for backward "
        f"{format_bytes(plan.held_bytes)}, recompute +{plan.recompute_flops_share:.0%} of the "
        f"forward's FLOPs\n  checkpointed: {regions}; kept ops matched "
        f"{check.kept_ops_matched}/{check.kept_ops_expected}; verify ok: {check.ok}"
    )
    print(f"{'step':>4}  {'loss, no remat':>16}  {'loss, remat':>16}  {'grad norm, both':>19}")
    columns = (baseline["loss"], with_remat["loss"], baseline["grad_norm"], with_remat["grad_norm"])
    rows = zip(*columns, strict=False)
    for step, (a, b, ga, gb) in enumerate(rows, start=1):
        print(f"{step:>4}  {a:>16.10f}  {b:>16.10f}  {ga:>9.6f} {gb:>9.6f}")
    ref, got = torch.tensor(baseline["loss"]), torch.tensor(with_remat["loss"])
    equal = (
        len(ref) == len(got) == args.steps
        and bool(torch.isfinite(ref).all())
        and torch.allclose(ref, got, rtol=1e-6, atol=0)
    )
    print("losses equal:", equal)
    equal = equal and check.ok
    return {
        "baseline": baseline["loss"],
        "remat": with_remat["loss"],
        "grad_norm": {"baseline": baseline["grad_norm"], "remat": with_remat["grad_norm"]},
        "equal": equal,
        "plan": plan,
        "verified": check.ok,
    }


if __name__ == "__main__":
    raise SystemExit(0 if main()["equal"] else 1)
