"""remat on vision nets and a recurrent one, measured on this CPU (issue 33).

Eager: for the zoo's resnet18, resnet50, convnext-t and vit-b-16 (tiny) and Hugging Face's RWKV
(a Python loop over the tokens in every block), at three budgets (store-all's peak, halfway, the
lowest feasible): the strategy `auto` chose, bytes held for the backward and the peak, measured /
predicted (`remat.verify`), and whether the gradients equal the unplanned model's bit for bit.
Compiled (`--compiled`): `remat.compile(model, budget="100%")`, the measured step's peak against
the plan's, for conv nets (a tiny diffusers UNet among them). Writes markdown tables.

    python benchmarks/vision_recurrent_models.py [--compiled] [MODEL ...]
"""

from __future__ import annotations

import argparse
import copy
import time
import warnings

import torch
from torch import nn

import remat
from remat import models
from remat.answers.bench import gradients
from remat.applying.compiled import plans_of
from remat.models.hf import build_for_training
from remat.units import format_bytes

#: name -> batch (at batch 2 the tiny ViT peaks in its patch embedding's backward, outside
#: every region, so no recomputing plan lowers its peak)
VISION = {"resnet18": 2, "resnet50": 2, "convnext-t": 2, "vit-b-16": 8}
RECURRENT = {"rwkv-16": 16, "rwkv-64": 64}


class PatchHead(nn.Module):
    """A ViT's conv patch embedding and a linear head."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Conv2d(3, 64, 8, stride=8)
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(x).flatten(2).transpose(1, 2).relu()).mean()


class _NoisePrediction(nn.Module):
    """A diffusers UNet trained as Stable Diffusion is: MSE of the predicted noise."""

    def __init__(self, unet: nn.Module):
        super().__init__()
        self.unet = unet

    def forward(self, latents, timesteps, text, noise):
        predicted = self.unet(latents, timesteps, encoder_hidden_states=text).sample
        return nn.functional.mse_loss(predicted, noise)


def _unet() -> tuple[nn.Module, tuple]:
    """A tiny `UNet2DConditionModel` (two levels, one cross-attention level, 8x8 latents)."""
    from diffusers import UNet2DConditionModel

    unet = UNet2DConditionModel(
        sample_size=8,
        layers_per_block=1,
        block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32,
        attention_head_dim=8,
        norm_num_groups=8,
    )
    inputs = (
        torch.randn(2, 4, 8, 8),
        torch.tensor([10, 500]),
        torch.randn(2, 7, 32),
        torch.randn(2, 4, 8, 8),
    )
    return _NoisePrediction(unet), inputs


def _build(name: str) -> tuple[nn.Module, tuple, dict]:
    torch.manual_seed(0)
    if name == "unet":
        model, inputs = _unet()
        return model, inputs, {"loss_fn": lambda out: out}
    if name in RECURRENT:
        model, inputs = build_for_training("rwkv", batch=2, seq=RECURRENT[name])
        return model, (), {"loss_fn": lambda out: out.loss, **inputs}
    if name == "patch-head":
        return PatchHead(), (torch.randn(8, 3, 32, 32),), {"loss_fn": lambda out: out}
    model, inputs = models.build(name, batch=VISION.get(name, 4), device="cpu", tiny=True)
    return model, inputs, {"loss_fn": lambda out: out}


def eager_rows(name: str) -> list[str]:
    model, inputs, kwargs = _build(name)
    reference = gradients(copy.deepcopy(model), inputs, **kwargs)
    graph = remat.trace(model, *inputs, **kwargs)
    try:
        remat.plan(graph, budget=1)
    except remat.InfeasibleBudget as e:
        lowest = e.min_feasible_bytes
    full = remat.plan(graph, budget="100%", strategy="store_all").predicted_peak_bytes
    rows = []
    for label, budget in (("100%", full), ("halfway", (lowest + full) // 2), ("lowest", lowest)):
        plan = remat.plan(graph, budget=budget, strategy="auto")
        remat.apply(model, plan)
        got = gradients(model, inputs, **kwargs)
        same = all(torch.equal(got[k], reference[k]) for k in reference)
        v = remat.verify(model, *inputs, **kwargs)
        remat.remove(model)
        rows.append(
            f"| {name} | {label} ({format_bytes(budget)}) | {plan.strategy} | "
            f"{format_bytes(v.held_bytes_measured)} / {format_bytes(v.held_bytes_predicted)} "
            f"({v.held_ratio:.4f}) | {format_bytes(v.peak_bytes_measured)} / "
            f"{format_bytes(v.peak_bytes_predicted)} ({v.peak_ratio:.4f}) | "
            f"{'yes' if same else 'no'} |"
        )
    return rows


def compiled_rows(name: str) -> list[str]:
    model, inputs, kwargs = _build(name)
    torch._dynamo.reset()
    compiled = remat.compile(model, budget="100%", strategy="auto")
    measured = remat.measure(compiled, *inputs)
    (plan,) = plans_of(compiled)
    torch._dynamo.reset()
    return [
        f"| {name} | {plan.details['peak_model']} | {measured.peak_bytes:,} B / "
        f"{plan.predicted_peak_bytes:,} B ({measured.peak_bytes / plan.predicted_peak_bytes:.4f}) |"
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*")
    parser.add_argument("--compiled", action="store_true", help="remat.compile rows instead")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    if args.compiled:
        names = args.models or [
            "patch-head",
            "vit-b-16",
            "resnet18",
            "resnet50",
            "convnext-t",
            "unet",
        ]
        lines = ["| model | peak model | peak measured / predicted |", "|---|---|---|"]
        make = compiled_rows
    else:
        names = args.models or [*VISION, *RECURRENT]
        lines = [
            "| model | budget | auto chose | held measured / predicted "
            "| peak measured / predicted | gradients bit-identical |",
            "|---|---|---|---|---|---|",
        ]
        make = eager_rows
    for name in names:
        start = time.perf_counter()
        rows = make(name)
        lines += rows
        print(f"{name}: {time.perf_counter() - start:.1f} s", *rows, sep="\n", flush=True)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
