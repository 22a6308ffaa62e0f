"""A step whose ops depend on random draws (LayerDrop, random depth) is traced at both extremes of
the draws and planned for the longer one, so that the plan holds for every draw; regions hold
one block each, since a run of blocks cannot skip one; `verify` measures both extremes."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

import remat
from remat.errors import InfeasibleBudget, RematWarning


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))


class LayerDropNet(nn.Module):
    """Hugging Face's LayerDrop (wav2vec2, M2M100, ...): `torch.rand([]) < layerdrop` skips a
    layer; `python_draws` uses `random.uniform(0, 1)` as older models did."""

    def __init__(self, layerdrop: float = 0.5, n: int = 9, d: int = 32, python_draws=False):
        super().__init__()
        self.layers = nn.ModuleList(Block(d) for _ in range(n))
        self.layerdrop, self.python_draws = layerdrop, python_draws

    def forward(self, x):
        for layer in self.layers:
            if self.training:
                draw = random.uniform(0, 1) if self.python_draws else torch.rand([])
                if draw < self.layerdrop:
                    continue
            x = layer(x)
        return x


def _x():
    return torch.randn(16, 32)


@pytest.mark.parametrize("python_draws", [False, True])
def test_the_trace_finds_random_control_flow_and_keeps_the_longest_path(python_draws):
    torch.manual_seed(0)
    model = LayerDropNet(python_draws=python_draws)
    every_layer = remat.trace(LayerDropNet(layerdrop=0.0, python_draws=python_draws), _x())
    for device in ("meta", "cpu"):
        with pytest.warns(RematWarning, match="depend on random draws"):
            graph = remat.trace(model, _x(), device=device)
        assert "random_control" in graph.info
        assert graph.info["random_reads"]
        assert len(graph.forward_ops) == len(every_layer.forward_ops)
        assert graph.activation_bytes == every_layer.activation_bytes
    assert "random_control" not in every_layer.info and every_layer.info["random_reads"]  # at 0


def test_dropout_is_not_random_control_flow():
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 8))
    graph = remat.trace(model, torch.randn(4, 8))
    assert not graph.info["random_reads"] and "random_control" not in graph.info


@pytest.mark.filterwarnings("ignore:remat. the step's ops depend on random draws")
@pytest.mark.parametrize("python_draws", [False, True])
def test_plans_hold_for_every_draw_and_verify_measures_the_longest(python_draws):
    """Before: the real-tensor trace recorded one draw; a step running every layer then held
    more than the plan said and verify().ok was False. (Python's draws leave no op between the
    layers, so sqrt would group them: refused.)"""
    torch.manual_seed(0)
    model, x = LayerDropNet(python_draws=python_draws), _x()
    graph = remat.trace(model, x)
    planner = remat.Planner(graph)
    lowest = planner.lowest_peak()
    assert all(len(region.modules) == 1 for region in lowest.regions)
    if python_draws:
        with pytest.raises(InfeasibleBudget, match="skips blocks at random"):
            planner.plan("1TiB", "sqrt")
    else:  # torch's draws sit between the layers: sqrt's segments break there
        assert all(len(r.modules) == 1 for r in planner.plan("1TiB", "sqrt").regions)
    budget = (lowest.predicted_peak_bytes + planner.estimate.peak_bytes) // 2
    plan = remat.auto(model, x, budget=budget, trace_device="cpu")
    report = remat.verify(model, x)
    assert report.ok, report
    for seed in range(8):  # training draws: every step within the plan
        torch.manual_seed(seed)
        random.seed(seed)
        measured = remat.measure(model, x)
        assert measured.held_bytes <= plan.held_bytes
        assert measured.peak_bytes <= plan.predicted_peak_bytes


@pytest.mark.filterwarnings("ignore:remat. the step's ops depend on random draws")
def test_hugging_face_layerdrop_is_found_on_fake_tensors_and_plans_verify():
    """M2M100's default config drops encoder and decoder layers (`torch.rand([]) <
    layerdrop`): found on fake tensors, planned for every layer, carried out exactly."""
    pytest.importorskip("transformers")
    from remat.models.hf import build_for_training

    model, inputs = build_for_training("m2m_100")
    graph = remat.trace(model, loss_fn=lambda out: out.loss, **inputs)
    counts = graph.info["random_control"]["forward_ops"]
    assert counts["high"] > counts["low"] > 0  # low draws skip every layer (embeddings, head left)
    assert graph.info["random_control"]["draws"] == "high"
    planner = remat.Planner(graph)
    plan = planner.lowest_peak()
    remat.apply(model, plan)
    report = remat.verify(model, loss_fn=lambda out: out.loss, **inputs)
    assert report.ok, report


@pytest.mark.filterwarnings("ignore:remat. the step's ops depend on random draws")
def test_auto_leaves_out_a_strategy_that_refuses_and_says_why(remat_log):
    """Issue 33: sqrt refuses a step that skips blocks at random (its runs of blocks could not skip
    one), and that refusal used to end `auto` itself, from the frontier a `+10%` budget resolves
    on. Now auto's plan lists it as refused and picks among the rest; a time budget is always
    feasible (store-all qualifies)."""
    torch.manual_seed(0)
    model, x = LayerDropNet(python_draws=True), _x()
    with pytest.raises(remat.StrategyRefused, match="skips blocks at random") as refusal:
        remat.Planner(remat.trace(model, x)).plan("1TiB", "sqrt")
    assert isinstance(refusal.value, InfeasibleBudget) and refusal.value.strategy == "sqrt"
    plan = remat.auto(model, x, budget="+10%")
    assert plan.details["candidates"]["sqrt"].startswith("refused: ")
    assert "sqrt refused (strategy 'sqrt' checkpoints runs of several blocks" in plan.reason
    assert "auto left out sqrt, which refused" in remat_log.text
    assert all(len(region.modules) == 1 for region in plan.regions)
    assert remat.verify(model, x).ok
