"""A planned model is an ordinary model to the code around it: `copy.deepcopy` (EMA, teacher and
reference models), `pickle` / `torch.save`, `state_dict` round trips and multiprocessing spawn
keep its plan working on its own modules, and each copy keeps or removes its own plan."""

from __future__ import annotations

import copy
import io
import multiprocessing
import pickle

import pytest
import torch

import remat
from remat import Planner, models
from remat.answers.bench import gradients

NAMES = ["gpt2", "hf:llama"]


def _planned(name: str):
    """A tiny model with a selective plan (torchtitan's op list) installed, the same bare model, and
    the bare model's gradients."""
    torch.manual_seed(0)
    model, inputs = models.build(name, batch=2, seq=32, device="cpu", tiny=True)
    bare = copy.deepcopy(model)
    reference = gradients(bare, inputs)
    graph = remat.trace(model, *inputs)
    plan = Planner(graph).plan("1TiB", "selective:torchtitan")
    assert any(region.keep_keys for region in plan.regions)  # a selective plan: the hard case
    remat.apply(model, plan)
    return model, inputs, reference


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-6, atol=1e-6, msg=name)


@pytest.mark.parametrize("name", NAMES)
def test_a_deep_copy_runs_its_own_plan_on_its_own_modules_and_removes_it_alone(name):
    model, inputs, reference = _planned(name)
    twin = copy.deepcopy(model)
    calls = []
    handles = [m.register_forward_hook(lambda *a: calls.append(1)) for m in model.modules()]
    _assert_same(gradients(twin, inputs), reference)
    assert remat.verify(twin, *inputs).ok
    assert not calls  # the copy's regions ran the copy's blocks, not the original's
    for h in handles:
        h.remove()
    remat.remove(twin)  # was: TypeError: 'object' object is not callable
    _assert_same(gradients(twin, inputs), reference)
    assert not any("forward" in vars(m) for m in twin.modules())
    assert remat.verify(model, *inputs).ok  # the original keeps its plan
    _assert_same(gradients(model, inputs), reference)


@pytest.mark.parametrize("name", NAMES)
def test_pickle_and_torch_save_round_trips_keep_the_plan(name):
    model, inputs, reference = _planned(name)
    buffer = io.BytesIO()
    torch.save(model, buffer)  # was: Can't pickle local object 'CachesOff._hook.<locals>.hook'
    buffer.seek(0)
    for loaded in (torch.load(buffer, weights_only=False), pickle.loads(pickle.dumps(model))):
        _assert_same(gradients(loaded, inputs), reference)
        assert remat.verify(loaded, *inputs).ok
        remat.remove(loaded)
        _assert_same(gradients(loaded, inputs), reference)


def test_state_dict_of_a_planned_model_is_the_bare_models():
    model, inputs, reference = _planned("hf:llama")
    bare, _ = models.build("hf:llama", batch=2, seq=32, device="cpu", tiny=True)
    assert list(model.state_dict()) == list(bare.state_dict())
    bare.load_state_dict(model.state_dict())
    _assert_same(gradients(bare, inputs), reference)
    model.load_state_dict(bare.state_dict())
    _assert_same(gradients(model, inputs), reference)


def _gradients_in_child(model, inputs):
    return gradients(model, inputs), remat.verify(model, *inputs).ok


def test_a_planned_model_crosses_a_spawned_process():
    model, inputs, reference = _planned("gpt2")
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        grads, ok = pool.apply(_gradients_in_child, (model, inputs))
    assert ok
    _assert_same(grads, reference)
