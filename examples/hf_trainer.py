"""remat with the Hugging Face `Trainer`: one callback, `RematCallback(budget=...)`.

    python examples/hf_trainer.py                      # tiny GPT-2, 4 steps, budget 70%
    python examples/hf_trainer.py --model-type llama --steps 8 --budget 60%
    python examples/hf_trainer.py --lora               # PEFT LoRA adapters on the attention
    python examples/hf_trainer.py --trl                # TRL's SFTTrainer (its gradient
                                                       # checkpointing, on by default, goes off)
    torchrun --nproc_per_node=2 examples/hf_trainer.py --fsdp     # accelerate's FSDP2, 2 ranks

A causal LM is built from its transformers config with the defaults (dropout, `use_cache=True`)
and only the sizes made small, and trained on random token ids by `transformers.Trainer` twice
from the same seed and the same initial weights: once as is, once with

    Trainer(..., callbacks=[RematCallback(budget="70%")])

whose `on_train_begin` traces one training step of the Trainer's first batch on fake tensors,
plans which activations to keep and which to recompute under the budget, and installs the
checkpointing on the model in place (`remat.integrations.hf`). Recomputation
replays the same dropout masks (checkpoint restores the RNG state), so the two runs log the same
loss at every step; the script prints both side by side and fails if they differ.

`--fsdp` trains under `TrainingArguments(fsdp=True, fsdp_config={"fsdp_version": 2})`: the
callback then sees the model accelerate has sharded and plans it as the bare model; its plan
must equal the one made on the unsharded model, and hold as predicted there (`remat.verify`),
while the sharded run's steps keep the planned ops. `--gradient-checkpointing` turns Hugging
Face's own on in both runs: the callback switches it off, saying so.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Any

import torch

import remat
from remat.applying import first_step
from remat.integrations.hf import RematCallback, enable
from remat.units import format_bytes


def build_model(model_type: str, seq: int, seed: int, lora: bool = False) -> torch.nn.Module:
    """A causal LM from its default config (dropout and caching as they are), small sizes, in
    training mode: `remat.models.hf.build_for_training`; with `lora`, PEFT's LoRA adapters (r 4,
    dropout 0.1) on its attention projections, the base weights frozen."""
    from remat.models.hf import build_for_training

    model, _ = build_for_training(model_type, seq=seq, seed=seed)
    if lora:
        import peft

        targets = ["c_attn"] if model_type == "gpt2" else ["q_proj", "v_proj"]
        config = peft.LoraConfig(r=4, lora_dropout=0.1, target_modules=targets)
        model = peft.get_peft_model(model, config)
    return model


class RandomTokens(torch.utils.data.Dataset):
    """`n` sequences of random token ids; the model shifts `labels` itself for next-token loss.
    Ids start at 2: 0 and 1 are the padding and end tokens of `tokenizer` (TRL)."""

    def __init__(self, n: int, seq: int, vocab: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.vocab = vocab
        self.ids = torch.randint(2, vocab, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tokenizer(vocab: int) -> Any:
    """A word-level tokenizer over `vocab` made-up words, built here (nothing downloaded): TRL's
    SFTTrainer asks its tokenizer for the padding and end tokens."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, vocab)}}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(words, unk_token="<pad>")),
        pad_token="<pad>",
        eos_token="<eos>",
    )


def fsdp_on_cpu(accelerator: Any, plugin: Any) -> None:
    """Give `accelerator` the state FSDP has on GPUs. accelerate 1.15 runs FSDP only on
    accelerators: with `cpu=True` under torchrun (MULTI_CPU, gloo) it drops the FSDP plugin
    without a word and wraps the model in DDP. torch's `fully_shard` itself runs on CPU."""
    from accelerate.utils import DistributedType

    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin


def _trainer_class(fsdp: bool, trl: bool) -> type:
    from transformers import Trainer

    base: type = Trainer
    if trl:
        from trl import SFTTrainer

        base = SFTTrainer
    if not fsdp:
        return base

    class CPUFSDPTrainer(base):  # type: ignore[misc, valid-type]
        def create_accelerator_and_postprocess(self) -> None:
            from accelerate.utils import FullyShardedDataParallelPlugin

            super().create_accelerator_and_postprocess()
            plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
            fsdp_on_cpu(self.accelerator, plugin)
            self.is_fsdp_enabled = True

    return CPUFSDPTrainer


def train(
    model: torch.nn.Module,
    dataset: RandomTokens,
    *,
    steps: int,
    batch: int,
    seed: int,
    callbacks: list | None = None,
    fsdp: bool = False,
    trl: bool = False,
    gradient_checkpointing: bool = False,
) -> dict[str, Any]:
    """Train with `Trainer` (TRL's `SFTTrainer` with `trl`; under accelerate's FSDP2 with
    `fsdp`) for `steps` optimizer steps; the loss and gradient norm at each, and the model as the
    Trainer left it (sharded under FSDP2)."""
    from transformers import Trainer, TrainingArguments

    torch.manual_seed(seed)
    settings = dict(
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
    if gradient_checkpointing:
        settings["gradient_checkpointing"] = True
    if fsdp:
        settings |= dict(fsdp=True, fsdp_config={"fsdp_version": 2})
    data: Any = dataset
    extra: dict[str, Any] = {}
    if trl:
        from datasets import Dataset

        data = Dataset.from_dict({"input_ids": dataset.ids.tolist()})  # tokenized already
        extra["processing_class"] = tokenizer(dataset.vocab)
    with tempfile.TemporaryDirectory() as out:
        if trl:
            from trl import SFTConfig

            args = SFTConfig(output_dir=out, **settings)
        else:
            args = TrainingArguments(output_dir=out, **settings)
        cls = _trainer_class(fsdp, trl) if fsdp or trl else Trainer
        trainer = cls(model=model, args=args, train_dataset=data, callbacks=callbacks, **extra)
        trainer.train()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    return {
        "loss": [entry["loss"] for entry in logged],
        "grad_norm": [entry["grad_norm"] for entry in logged],
        "model": trainer.model,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-type", default="gpt2", help="a transformers model type")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--budget", default="70%", help='bytes, "40MiB", or "70%%" of store-all')
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lora", action="store_true", help="PEFT LoRA adapters, base frozen")
    parser.add_argument("--trl", action="store_true", help="TRL's SFTTrainer")
    parser.add_argument("--fsdp", action="store_true", help="accelerate's FSDP2 (torchrun)")
    parser.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="TrainingArguments(gradient_checkpointing=True) in both runs",
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: fastest for tiny models)"
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rank = int(os.environ.get("RANK", 0))
    say = print if rank == 0 else lambda *a, **k: None

    def build() -> torch.nn.Module:
        return build_model(args.model_type, args.seq, args.seed, lora=args.lora)

    model = build()
    dataset = RandomTokens(
        args.batch * args.steps * 2, args.seq, model.config.vocab_size, seed=args.seed + 1
    )
    run = {
        "steps": args.steps,
        "batch": args.batch,
        "seed": args.seed,
        "fsdp": args.fsdp,
        "trl": args.trl,
        "gradient_checkpointing": args.gradient_checkpointing,
    }
    example = {k: torch.stack([dataset[i][k] for i in range(args.batch)]) for k in dataset[0]}

    baseline = train(model, dataset, **run)

    # The second run starts from a model built again, the same weights: a model a Trainer has
    # trained keeps what it set (accelerate's autocast around its forward under bf16, TRL's
    # default; FSDP2's sharding).
    model = build()
    callback = RematCallback(budget=args.budget)
    with_remat = train(model, dataset, **run, callbacks=[callback])
    plan = callback.plan
    if args.fsdp:
        # the kept ops matched in the sharded run's last step; what the plan predicts holds on
        # the unsharded model, for which the same plan is made
        carried_out = remat.verify(with_remat["model"])
        bare = build()
        same_plan = enable(bare, example, args.budget) == plan
        check = remat.verify(bare, **example, loss_fn=lambda out: out.loss)
        verified = carried_out.ok and check.ok and same_plan
        say(f"plan made on the sharded model == plan made on the bare model: {same_plan}")
        say(f"sharded run, kept ops matched {carried_out.kept_ops_matched}/"
            f"{carried_out.kept_ops_expected}")  # fmt: skip
    else:
        # the plan carried out (kept ops matched), and one measured step's bytes against it
        check = remat.verify(model, **example, loss_fn=lambda out: out.loss)
        verified = check.ok
        remat.remove(model)

    # nothing but remat checkpoints the trained model: the callback switched Hugging Face's
    # gradient checkpointing off (--gradient-checkpointing, TRL's default) and it stayed off
    others = remat.checkpointed_elsewhere(with_remat["model"])
    verified = verified and not others
    say(f"checkpointed by something else after training: {others or 'nothing'}")
    regions = "; ".join(", ".join(r.modules) for r in plan.regions) or "nothing"
    say(
        f"\nremat plan: {plan.strategy}, budget {format_bytes(plan.budget_bytes or 0)}, predicted "
        f"peak {format_bytes(plan.predicted_peak_bytes)}, held for backward "
        f"{format_bytes(plan.held_bytes)}, recompute +{plan.recompute_flops_share:.0%} of the "
        f"forward's FLOPs\n  checkpointed: {regions}; {check!r}"
    )
    say(f"{'step':>4}  {'loss, no remat':>16}  {'loss, remat':>16}  {'grad norm, both':>19}")
    columns = (baseline["loss"], with_remat["loss"], baseline["grad_norm"], with_remat["grad_norm"])
    rows = zip(*columns, strict=False)
    for step, (a, b, ga, gb) in enumerate(rows, start=1):
        say(f"{step:>4}  {a:>16.10f}  {b:>16.10f}  {ga:>9.6f} {gb:>9.6f}")
    ref, got = torch.tensor(baseline["loss"]), torch.tensor(with_remat["loss"])
    equal = (
        len(ref) == len(got) == args.steps
        and bool(torch.isfinite(ref).all())
        and torch.allclose(ref, got, rtol=1e-6, atol=0)
    )
    say("losses equal:", equal, "verify ok:", verified)
    return {
        "baseline": baseline["loss"],
        "remat": with_remat["loss"],
        "grad_norm": {"baseline": baseline["grad_norm"], "remat": with_remat["grad_norm"]},
        "equal": equal and verified,
        "plan": plan,
        "verified": verified,
        "first_step": first_step.report(with_remat["model"]),  # the first step's own check
    }


def exit_under_torchrun(ok: bool) -> None:
    """Print OK (what tests/torchrun.py looks for) and end without Python's finalisation, which
    races with gloo's worker threads under FSDP2 (see examples/distributed.py)."""
    if ok and int(os.environ.get("RANK", 0)) == 0:
        print("OK")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if ok else 1)


if __name__ == "__main__":
    passed = main()["equal"]
    if "RANK" in os.environ:
        exit_under_torchrun(passed)
    raise SystemExit(0 if passed else 1)
