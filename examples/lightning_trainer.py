"""remat with Lightning: one callback, `RematCallback(budget=...)`.

    python examples/lightning_trainer.py            # tiny GPT-2 preset, 3 steps, budget 70%

A LightningModule around remat's tiny GPT-2 preset (dropout on) is trained by `lightning.Trainer`
twice from the same seed and the same initial weights: once as is, once with

    Trainer(..., callbacks=[RematCallback(budget="70%")])

whose `on_train_start` traces `training_step` on the Trainer's first batch, plans under the
budget and installs the checkpointing (`remat.integrations.lightning`). Recomputation replays the
same dropout masks, so both runs log the same loss at every step; the script prints them side by
side, checks the plan with `remat.verify`, and fails if anything differs.
"""

from __future__ import annotations

import argparse
import copy
from typing import Any

import lightning.pytorch as L
import torch

import remat
from remat import models
from remat.integrations.lightning import RematCallback


class LitLM(L.LightningModule):
    def __init__(self, seq: int):
        super().__init__()
        self.model, _ = models.build("gpt2", tiny=True, device="cpu", batch=1, seq=seq)

    def training_step(self, batch, batch_idx):
        ids = batch[0]
        loss = self.model(ids[:, :-1], labels=ids[:, 1:].contiguous())  # nanoGPT's loss
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-2)


class Losses(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


def train(module: LitLM, data, steps: int, seed: int, callbacks: list) -> list[float]:
    L.seed_everything(seed, verbose=False)
    losses = Losses()
    trainer = L.Trainer(
        max_steps=steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[*callbacks, losses],
    )
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4, shuffle=True))
    return losses.losses


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seq", type=int, default=65)
    parser.add_argument("--budget", default="70%")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    module = LitLM(args.seq)
    initial = copy.deepcopy(module.state_dict())
    vocab = module.model.wte.num_embeddings
    data = torch.utils.data.TensorDataset(torch.randint(0, vocab, (4 * args.steps, args.seq)))

    baseline = train(module, data, args.steps, args.seed, [])
    module.load_state_dict(initial)
    callback = RematCallback(budget=args.budget)
    with_remat = train(module, data, args.steps, args.seed, [callback])
    batch = (data.tensors[0][:4],)
    check = remat.verify(callback.step, batch)
    remat.remove(callback.step)

    plan = callback.plan
    print(f"\nremat plan: {plan!r}\nverify: {check!r}")
    print(f"{'step':>4}  {'loss, no remat':>16}  {'loss, remat':>16}")
    for step, (a, b) in enumerate(zip(baseline, with_remat, strict=False), start=1):
        print(f"{step:>4}  {a:>16.10f}  {b:>16.10f}")
    equal = len(baseline) == len(with_remat) == args.steps and torch.allclose(
        torch.tensor(baseline), torch.tensor(with_remat), rtol=1e-6, atol=0
    )
    print("losses equal:", equal, "| verify ok:", check.ok)
    return {"baseline": baseline, "remat": with_remat, "equal": equal, "plan": plan,
            "verified": check.ok}  # fmt: skip


if __name__ == "__main__":
    result = main()
    raise SystemExit(0 if result["equal"] and result["verified"] else 1)
