"""Plan Hugging Face models built from their default configs, then train: `remat.auto` at a
budget, three AdamW steps against an unplanned copy (losses and parameters must be
bit-identical), and `remat.verify`'s held and peak bytes.

    python benchmarks/hf_default_train.py [--batch 4] [--seq 512] [--budget 75%]

Needs transformers (the `hf` extra). On this 2-core CPU at the defaults: ~3.5 minutes.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

import remat


def builders():
    from transformers import BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel

    return [
        ("BertForMaskedLM(BertConfig())", lambda: BertForMaskedLM(BertConfig())),
        ("GPT2LMHeadModel(GPT2Config())", lambda: GPT2LMHeadModel(GPT2Config())),
    ]


def losses_of(model, ids, steps: int = 3) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    torch.manual_seed(1)
    losses = []
    for _ in range(steps):
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(out.loss.item())
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--budget", default="75%")
    args = parser.parse_args()
    for name, build in builders():
        torch.manual_seed(0)
        model = build().train()
        reference = copy.deepcopy(model)
        ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq))
        start = time.perf_counter()
        plan = remat.auto(model, budget=args.budget, optimizer="adamw", input_ids=ids, labels=ids)
        print(f"{name}: {plan.strategy} in {time.perf_counter() - start:.1f} s")
        same = losses_of(model, ids) == losses_of(reference, ids)
        pairs = zip(model.parameters(), reference.parameters(), strict=True)
        params = all(torch.equal(p, q) for p, q in pairs)
        print(f"  3 AdamW steps: losses equal {same}, parameters equal {params}")
        print(f"  {remat.verify(model, input_ids=ids, labels=ids)}")


if __name__ == "__main__":
    main()
