"""Checkpoint regions call blocks the way the model calls them (issue 33, item 1): positional,
keyword-only or mixed arguments, non-tensor arguments, outputs that are tensors, tuples, dicts or
dataclasses; one block per region (`full`) and several (`sqrt`). A region of several blocks runs
the later ones itself, so it hands the previous block's output on the way the traced step did, and
is not formed where it cannot (blocks called with different non-tensor arguments)."""

from __future__ import annotations

import copy
import dataclasses
import gc
import json
import pickle

import pytest
import torch
from torch import nn

import remat
from remat.graph import Graph
from remat.tracing.calls import call_shape, output_path, output_tensors, pick


@dataclasses.dataclass
class BlockOutput:
    """A plain dataclass, which torch's pytree does not look into."""

    sample: torch.Tensor


class Block(nn.Module):
    def __init__(self, returns: str):
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.returns = returns

    def forward(self, hidden_states, temb=None, scale=1.0):
        h = self.linear(hidden_states)
        if scale != 1.0:
            h = h * scale
        h = torch.tanh(h)
        if temb is not None:
            h = h + temb
        if self.returns == "tuple":
            return (h, None)
        if self.returns == "dict":
            return {"hidden_states": h}
        if self.returns == "dataclass":
            return BlockOutput(sample=h)
        if self.returns == "base_output":  # diffusers' BaseOutput: an OrderedDict and a dataclass
            from diffusers.models.unets.unet_2d_condition import UNet2DConditionOutput

            return UNet2DConditionOutput(sample=h)
        return h


def _take(out, returns: str) -> torch.Tensor:
    if returns == "tuple":
        return out[0]
    if returns == "dict":
        return out["hidden_states"]
    if returns in ("dataclass", "base_output"):
        return out.sample
    return out


class Stack(nn.Module):
    """Four blocks, called as `call` says; `varied`: each with its own non-tensor `scale`."""

    def __init__(self, call: str, returns: str, varied: bool = False):
        super().__init__()
        self.blocks = nn.ModuleList(Block(returns) for _ in range(4))
        self.call, self.returns, self.varied = call, returns, varied

    def forward(self, x, temb):
        h = x
        for i, block in enumerate(self.blocks):
            scale = 1.0 + 0.5 * i if self.varied else 1.0
            if self.call == "positional":
                out = block(h, temb, scale)
            elif self.call == "keyword":
                out = block(hidden_states=h, temb=temb, scale=scale)
            else:
                out = block(h, temb=temb, scale=scale)
            h = _take(out, self.returns)
        return h.square().mean()


def _loss(out):
    return out


def _grads(model, *inputs):
    model.zero_grad(set_to_none=True)
    loss = model(*inputs)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)


@pytest.mark.parametrize("strategy", ["full", "sqrt"])
@pytest.mark.parametrize("returns", ["tensor", "tuple", "dict", "dataclass", "base_output"])
@pytest.mark.parametrize("call", ["positional", "keyword", "mixed"])
def test_regions_call_blocks_as_the_model_does_with_bit_identical_gradients(
    call, returns, strategy
):
    if returns == "base_output":
        pytest.importorskip("diffusers")
    torch.manual_seed(0)
    model, inputs = Stack(call, returns), _inputs()
    loss, reference = _grads(model, *inputs)
    plan = remat.auto(model, *inputs, strategy=strategy, budget="1TiB", loss_fn=_loss)
    carried = {"positional": "0", "keyword": "hidden_states", "mixed": "0"}[call]
    where = {"tensor": (), "tuple": (0,), "dict": ("hidden_states",)}.get(returns, ("sample",))
    if strategy == "sqrt":  # runs of two blocks, each handing its output on as the model did
        assert [len(r.modules) for r in plan.regions] == [2, 2]
        assert {(r.carry_output, r.carry_argument) for r in plan.regions} == {(where, carried)}
    else:
        assert [len(r.modules) for r in plan.regions] == [1, 1, 1, 1]
    got_loss, got = _grads(model, *inputs)
    assert torch.equal(got_loss, loss)
    for name, g in reference.items():
        assert torch.equal(got[name], g), name
    v = remat.verify(model, *inputs, loss_fn=_loss)
    assert v.held_ratio == pytest.approx(1, abs=0.02), v
    remat.remove(model)


@pytest.mark.parametrize("call", ["positional", "keyword", "mixed"])
def test_blocks_called_with_different_non_tensor_arguments_are_never_one_region(call):
    """A region calls its later blocks with its first block's arguments: blocks whose `scale`
    differs would all run at the first's scale, so the planner does not join them."""
    torch.manual_seed(0)
    model, inputs = Stack(call, "tensor", varied=True), _inputs()
    loss, reference = _grads(model, *inputs)
    plan = remat.auto(model, *inputs, strategy="sqrt", budget="1TiB", loss_fn=_loss)
    assert [len(r.modules) for r in plan.regions] == [1, 1, 1, 1]
    assert "blocks.0 .. blocks.1: they are called with different non-tensor" in plan.reason
    got_loss, got = _grads(model, *inputs)
    assert torch.equal(got_loss, loss)
    for name, g in reference.items():
        assert torch.equal(got[name], g), name


@pytest.mark.parametrize("returns", ["tuple", "base_output"])
def test_a_region_of_several_blocks_runs_them_under_no_grad_too(returns):
    if returns == "base_output":
        pytest.importorskip("diffusers")
    model, inputs = Stack("keyword", returns), _inputs()
    with torch.no_grad():
        expected = model(*inputs)
    plan = remat.auto(model, *inputs, strategy="sqrt", budget="1TiB", loss_fn=_loss)
    assert [len(r.modules) for r in plan.regions] == [2, 2]
    with torch.no_grad():
        assert torch.equal(model(*inputs), expected)


def test_a_later_block_of_a_region_called_on_its_own_is_an_error_not_a_skipped_block():
    model, inputs = Stack("keyword", "tensor"), _inputs()
    remat.auto(model, *inputs, strategy="sqrt", budget="1TiB", loss_fn=_loss)
    with pytest.raises(remat.RematError, match=r"blocks\.0 \.\. blocks\.1: blocks\.1 was called"):
        model.blocks[1](hidden_states=inputs[0], temb=inputs[1])


class NormBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.norm = nn.BatchNorm1d(8)

    def forward(self, *, hidden_states):
        return torch.relu(self.norm(self.linear(hidden_states)))


@pytest.mark.parametrize("input_grad", [True, False])
def test_batchnorm_statistics_are_updated_once_in_a_block_called_with_keywords_only(input_grad):
    """Recomputation runs BatchNorm again; the region restores its running statistics after its
    backward, anchored on an input that needs a gradient (here a keyword argument), or where none
    does (the model's raw input) on one of its parameters. A forward without a backward between
    steps leaves nothing behind that would restore stale statistics later."""
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(NormBlock() for _ in range(2))

        def forward(self, x):
            for block in self.blocks:
                x = block(hidden_states=x)
            return x.mean()

    model, x = Net(), torch.randn(6, 8, requires_grad=input_grad)
    plan = remat.plan(remat.trace(model, x, loss_fn=_loss), budget="1TiB", strategy="full")
    twin = copy.deepcopy(model)
    remat.apply(model, plan)
    for net in (model, twin):
        net(x).backward()
        net(x * 2)  # no backward
        net(x * 3).backward()
    for (k, v), w in zip(model.state_dict().items(), twin.state_dict().values(), strict=True):
        assert torch.equal(v, w), k


def test_how_blocks_were_called_round_trips_through_graph_and_plan_json():
    model, inputs = Stack("keyword", "dict"), _inputs()
    graph = remat.trace(model, *inputs, loss_fn=_loss)
    again = Graph.from_json(graph.to_json())
    assert again.modules == graph.modules
    block = next(m for m in again.modules if m.path == "blocks.1")
    assert block.arguments == ("hidden_states", "temb")
    assert block.output_path == ("hidden_states",)
    assert "blocks.0" in block.repeats
    plan = remat.plan(graph, budget="1TiB", strategy="sqrt")
    read = remat.Plan.from_json(plan.to_json())
    assert read.regions == plan.regions
    assert read.regions[0].carry_argument == "hidden_states"


def test_a_plan_written_before_regions_named_their_carried_argument_reads_as_positional():
    model, inputs = Stack("positional", "tensor"), _inputs()
    graph = remat.trace(model, *inputs, loss_fn=_loss)
    d = json.loads(remat.plan(graph, budget="1TiB", strategy="sqrt").to_json())
    for r in d["regions"]:
        del r["carry_output"], r["carry_argument"]
    read = remat.Plan.from_json(json.dumps(d))
    assert {(r.carry_output, r.carry_argument) for r in read.regions} == {((), "0")}
    loss, reference = _grads(model, *inputs)
    remat.apply(model, read)
    got_loss, got = _grads(model, *inputs)
    assert torch.equal(got_loss, loss)
    for name, g in reference.items():
        assert torch.equal(got[name], g), name


def test_copies_of_a_model_with_several_block_regions_run_their_own_blocks():
    """deepcopy and pickle keep a later block's forward tied to its own region's first block."""
    model, inputs = Stack("keyword", "tuple"), _inputs()
    loss, reference = _grads(model, *inputs)
    remat.auto(model, *inputs, strategy="sqrt", budget="1TiB", loss_fn=_loss)
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert twin.blocks[1].forward.region is twin.blocks[0].forward
        got_loss, got = _grads(twin, *inputs)
        assert torch.equal(got_loss, loss)
        for name, g in reference.items():
            assert torch.equal(got[name], g), name


def test_non_tensor_arguments_compare_by_value_or_by_identity_of_a_live_object():
    """Two calls are alike only if their non-tensor values are: numbers by value, other objects
    by identity while alive, so one made later at a dead one's address is not taken for it."""

    class Thing:
        pass

    t = torch.ones(1)
    assert call_shape(((t, 2, "a"), {"k": None})) == call_shape(((t * 2, 2, "a"), {"k": None}))
    assert call_shape(((t, 2), {})) != call_shape(((t, 3), {}))
    assert call_shape(((t,), {"k": 1})) != call_shape(((t,), {"j": 1}))
    thing = Thing()
    assert call_shape(((thing,), {})) == call_shape(((thing,), {}))
    before = call_shape(((thing,), {}))
    del thing
    gc.collect()
    assert all(call_shape(((Thing(),), {})) != before for _ in range(10))


def test_the_one_output_tensor_is_found_where_the_model_takes_it():
    @dataclasses.dataclass
    class Late:
        sample: torch.Tensor
        extra: int = dataclasses.field(init=False)  # never set: read as absent

    t = torch.ones(1)
    for out, path in [
        (t, ()),
        ((None, [t]), (1, 0)),
        ({"a": None, "h": t}, ("h",)),
        (BlockOutput(sample=t), ("sample",)),
        (Late(t), ("sample",)),
    ]:
        assert output_tensors(out) == [t]
        assert output_path(out) == path
        assert pick(out, path) is t
    assert output_path((t, t * 2)) is None
