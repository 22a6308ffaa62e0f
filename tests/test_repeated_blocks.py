"""Blocks the forward calls more than once: one block run in a loop (a universal transformer,
ALBERT's shared layer) and one block object at several depths. Each call is a block of its own,
a region checkpoints the calls it was planned on and no other, and tracing leaves the caller's
model as it was."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat import Plan


class Block(nn.Module):
    def __init__(self, d: int = 16):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Loop(nn.Module):
    """One block object, run four times."""

    def __init__(self):
        super().__init__()
        self.block = Block()

    def forward(self, x):
        for _ in range(4):
            x = self.block(x)
        return x


class OneGroup(nn.Module):
    """ALBERT's layout: one numbered group (`groups.0`) run four times."""

    def __init__(self):
        super().__init__()
        self.groups = nn.ModuleList([Block()])

    def forward(self, x):
        for _ in range(4):
            x = self.groups[0](x)
        return x


class SharedAtTwoDepths(nn.Module):
    """Blocks a, b, a, b: `a` and `b` are registered under their own names and as `layers.*`."""

    def __init__(self):
        super().__init__()
        self.a, self.b = Block(), Block()
        self.layers = nn.ModuleList([self.a, self.b, self.a, self.b])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _inputs():
    return (torch.randn(8, 32, 16, generator=torch.Generator().manual_seed(0)),)


def _grads(model, x):
    model.zero_grad(set_to_none=True)
    model(x).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_tracing_a_model_with_a_block_under_two_names_leaves_its_parameters_real():
    # torch's _reparametrize_module(tie_weights=True) swapped the shared block's tensors under
    # each of its names and put the fake stand-in back under the second: the caller's model
    # came out of remat.trace holding FakeTensors
    model = SharedAtTwoDepths()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    remat.trace(model, *_inputs())
    for name, p in model.named_parameters():
        assert type(p) is nn.Parameter, name
        assert torch.equal(p.detach(), before[name]), name


@pytest.mark.parametrize("model_class", [Loop, OneGroup, SharedAtTwoDepths])
def test_each_call_of_a_repeated_block_is_a_block(model_class):
    graph = remat.trace(model_class(), *_inputs())
    blocks = remat.Planner(graph).blocks
    assert len(blocks) == 4
    paths = {Loop: ["block"] * 4, OneGroup: ["groups.0"] * 4}.get(model_class, ["a", "b"] * 2)
    assert [b.path for b in blocks] == paths


@pytest.mark.parametrize("strategy", ["first_k", "full", "sqrt", "milp"])
@pytest.mark.parametrize("model_class", [Loop, OneGroup, SharedAtTwoDepths])
def test_regions_on_calls_of_a_repeated_block_hold_what_was_planned(model_class, strategy):
    torch.manual_seed(0)
    model, inputs = model_class(), _inputs()
    reference = _grads(copy.deepcopy(model), *inputs)
    planner = remat.Planner(remat.trace(model, *inputs))
    # first_k checkpoints the first calls alone: the module's other calls must run unplanned
    # (before, every call of the module was checkpointed: ALBERT's held 0.29 of the plan's)
    budget = (planner.estimate.peak_bytes + planner.lowest_peak().predicted_peak_bytes) // 2
    plan = planner.plan(budget, strategy)
    assert plan.regions and all(r.calls for r in plan.regions)
    if strategy == "first_k":
        assert len(plan.regions) < 4
    remat.apply(model, plan)
    got = _grads(model, *inputs)
    assert got.keys() == reference.keys()
    assert all(torch.equal(got[n], reference[n]) for n in reference)
    check = remat.verify(model, *inputs)
    assert check.ok, check
    assert check.held_bytes_measured == check.held_bytes_predicted == plan.held_bytes
    assert check.peak_bytes_measured == check.peak_bytes_predicted == plan.predicted_peak_bytes
    remat.remove(model)
    assert not any("forward" in vars(m) for m in model.modules())


def test_a_plan_on_a_repeated_block_survives_json_deepcopy_and_pickle():
    model, inputs = Loop(), _inputs()
    plan = remat.auto(model, *inputs, strategy="full", budget="1TiB", tune=False)
    assert [r.calls for r in plan.regions] == [(0,), (1,), (2,), (3,)]
    assert Plan.from_json(plan.to_json()).regions == plan.regions
    reference = _grads(model, *inputs)
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        got = _grads(twin, *inputs)
        assert all(torch.equal(got[n], reference[n]) for n in reference)
        assert remat.verify(twin, *inputs).ok


def test_auto_says_why_a_model_without_blocks_has_nothing_to_recompute():
    class Unrepeated(nn.Module):  # two different blocks, each called once, not numbered
        def __init__(self):
            super().__init__()
            self.first, self.second = Block(), Block()

        def forward(self, x):
            return self.second(self.first(x))

    with pytest.raises(remat.InfeasibleBudget, match="this model has none .no numbered"):
        remat.auto(Unrepeated(), *_inputs(), budget="50%", tune=False)


def test_bench_wraps_a_block_run_in_a_loop_once_and_says_why_sequential_cannot():
    from remat.answers.bench import bench
    from remat.prediction.schedule import rng_state_bytes

    model, inputs = Loop(), _inputs()
    planner = remat.Planner(remat.trace(model, *inputs))
    names = ["full", "torch:checkpoint-per-block", "torch:checkpoint_sequential"]
    rows = {r.strategy: r for r in bench(model, inputs, planner, names, budget="1TiB", steps=1)}
    per_block = rows["torch:checkpoint-per-block"]
    assert per_block.ran and per_block.grad_max_abs_diff == 0
    # every call checkpointed once, each keeping the RNG state that remat's regions without a
    # random op leave out
    rng = rng_state_bytes(planner.graph)
    assert per_block.held_bytes == rows["full"].held_bytes + 4 * rng
    assert not rows["torch:checkpoint_sequential"].ran
    assert "called more than once" in rows["torch:checkpoint_sequential"].note


def test_offload_leaves_a_block_called_more_than_once_on_the_device():
    # apply offloads by module path, every call alike, where the planner offloaded one call of
    # `block` (the lowest plan had offload=('block',))
    from remat.planning.offload import OffloadSettings

    model, inputs = Loop(), _inputs()
    planner = remat.Planner(
        remat.trace(model, *inputs), "h100", offload=OffloadSettings(min_bytes=1)
    )
    assert planner.lowest_peak().offload == ()
    for budget in ("90%", "60%", "30%"):
        try:
            plan = planner.plan(planner.budget_bytes(budget), "auto")
        except remat.InfeasibleBudget:
            continue
        assert plan.offload == (), budget
