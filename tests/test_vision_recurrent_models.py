"""Models past language models: a recurrent loop inside a checkpointed block, and plain-torch
vision nets (ResNet, ConvNeXt, a ViT with a conv patch embedding), planned by `remat.auto` at three
budgets; every plan is checked on a real step (held bytes within 2%, the peak within 3%) and its
gradients against an unplanned copy's, bit for bit."""

from __future__ import annotations

import pytest
import torch
from planned_steps import sweep_three_budgets
from torch import nn

import remat
from remat import models


class Scan(nn.Module):
    """A recurrence over the sequence as RWKV's CPU kernel writes it: each step reads the state
    and updates it, and the update after the last step is never used (its autograd nodes die
    unrun when the block returns, with the saves that pin views of `k` and `v`)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.k, self.v, self.o = (nn.Linear(hidden, hidden) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k, v = self.k(x), self.v(x)
        state = torch.zeros_like(x[:, 0])
        outs = []
        for t in range(x.shape[1]):
            kt, vt = k[:, t], v[:, t]
            outs.append(state + kt)
            state = state * torch.sigmoid(kt) + vt * kt
        return x + self.o(torch.stack(outs, 1))


class ScanNet(nn.Module):
    def __init__(self, hidden: int = 32, layers: int = 3):
        super().__init__()
        self.blocks = nn.ModuleList(Scan(hidden) for _ in range(layers))
        self.head = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x).pow(2).mean()


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out


@pytest.mark.parametrize("seq", [8, 32])
def test_a_loop_inside_a_region_is_held_as_measured_at_every_length(seq):
    """Saves no backward node reads (the loop's last state update) die with their nodes during
    the forward: not held to the end of the step, and inside a region not held at all."""
    torch.manual_seed(0)
    model, x = ScanNet(), torch.randn(4, seq, 32)
    graph = remat.trace(model, x, loss_fn=_loss)
    full = remat.plan(graph, budget="100%", strategy="full")
    store_all = remat.plan(graph, budget="100%", strategy="store_all")
    halfway = (full.predicted_peak_bytes + store_all.predicted_peak_bytes) // 2
    for plan in (store_all, full, remat.plan(graph, budget=halfway, strategy="auto")):
        remat.apply(model, plan)
        v = remat.verify(model, x, loss_fn=_loss)
        remat.remove(model)
        assert v.held_ratio == pytest.approx(1, abs=0.02), (plan.strategy, v)
        assert v.peak_ratio == pytest.approx(1, abs=0.02), (plan.strategy, v)


class _TwoOutputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.linear(x)
        return torch.tanh(h), torch.sigmoid(h).exp()  # the second output is not in the loss


class _KeepsUnusedOutputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(_TwoOutputs() for _ in range(3))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        unused = []
        for block in self.blocks:
            x, extra = block(x)
            unused.append(extra)
        return x.pow(2).mean(), unused


def test_saves_of_an_output_the_loss_does_not_use_are_held_while_the_program_keeps_it():
    """The other side of the loop's case: nodes that never run but whose outputs the program
    keeps to the end of the step keep their saves (and, in a region, the frame) as long."""
    model, x = _KeepsUnusedOutputs(), torch.randn(16, 32)
    graph = remat.trace(model, x, loss_fn=lambda out: out[0])
    never_read = [sv for sv in graph.saved if sv.node is None]
    assert len(never_read) == 6 and all(sv.released_after is None for sv in never_read)
    for strategy in ("store_all", "full"):
        remat.apply(model, remat.plan(graph, budget="1GiB", strategy=strategy))
        v = remat.verify(model, x, loss_fn=lambda out: out[0])
        remat.remove(model)
        assert v.held_ratio == pytest.approx(1, abs=0.02), (strategy, v)
        assert v.peak_ratio == pytest.approx(1, abs=0.02), (strategy, v)


# -- the sweep: three budgets per model, each checked on a real step --------------------------------
def _own_loss(out: torch.Tensor) -> torch.Tensor:
    return out


@pytest.mark.parametrize(
    ("name", "batch"),
    # at batch 2 the tiny ViT peaks in its patch embedding's backward, outside every region
    [("resnet18", 2), ("resnet50", 2), ("convnext-t", 2), ("vit-b-16", 8)],
)
def test_vision_nets_plan_step_and_verify_at_three_budgets(name, batch):
    """Convolutions (their oneDNN scratch measured at trace time), BatchNorm (its running
    statistics restored after recomputation), depthwise 7x7 convs, conv patch embeddings."""
    torch.manual_seed(0)
    model, inputs = models.build(name, batch=batch, device="cpu", tiny=True)
    sweep_three_budgets(model, inputs, loss_fn=_own_loss)


def test_a_recurrent_net_plans_step_and_verifies_at_three_budgets():
    """A loop over time steps inside each block (`Scan`), at three budgets."""
    torch.manual_seed(0)
    sweep_three_budgets(ScanNet(), (torch.randn(4, 24, 32),), loss_fn=_own_loss)


@pytest.mark.slow
def test_hugging_face_rwkv_plans_steps_and_verifies_at_three_budgets():
    """RWKV's CPU kernel: a Python loop over the tokens in every block's attention."""
    pytest.importorskip("transformers")
    from remat.models.hf import build_for_training

    model, inputs = build_for_training("rwkv", batch=2, seq=16)
    sweep_three_budgets(model, loss_fn=lambda out: out.loss, **inputs)
