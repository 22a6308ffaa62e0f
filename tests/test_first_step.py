"""The first training step after a plan is installed checks itself (issue 33): it counts the bytes
the forward leaves for the backward, by module, against the plan; a wrong prediction warns after
step one naming the module, a right one does not, `check=False` turns it off, it runs once, and
the gradients are those of an unchecked step."""

from __future__ import annotations

import warnings
from dataclasses import replace

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

import remat
from remat import models
from remat.applying import first_step
from remat.errors import RematWarning


class SavesMoreForReal(nn.Module):
    """On real tensors its forward runs one more op than on the fake tensors remat traces: `sin`
    saves its input for the backward, a tensor the plan does not know."""

    def __init__(self, d: int):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        y = self.fc(x)
        return y if isinstance(y, FakeTensor) else torch.sin(y)


def _sneaky(d: int = 64) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(d, d), nn.ReLU(), SavesMoreForReal(d), nn.Linear(d, d))


def _step(model: nn.Module, *inputs) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(*inputs).sum().backward()
    return [w for w in caught if issubclass(w.category, RematWarning)]


def _check_of(model: nn.Module) -> first_step.FirstStepCheck | None:
    found = [getattr(h, "__self__", None) for h in model._forward_pre_hooks.values()]
    return next((c for c in found if isinstance(c, first_step.FirstStepCheck)), None)


@pytest.mark.parametrize("strategy", ["store_all", "full", "selective:torchtitan"])
def test_a_right_plan_counts_what_it_predicts_module_by_module_and_does_not_warn(strategy):
    model, inputs = models.build("gpt2", tiny=True, device="cpu")
    remat.auto(model, *inputs, strategy=strategy, budget="1TiB")
    check = _check_of(model)
    assert _step(model, *inputs) == []
    report = check.report
    assert report.held_bytes_counted == report.held_bytes_predicted > 0
    assert all(predicted == counted for _, predicted, counted in report.by_module)
    assert not report.warned and report.peak_bytes is None  # no allocator's peak on the CPU


def test_a_forward_that_saves_more_than_traced_warns_after_the_first_step_naming_the_module():
    model, x = _sneaky(), torch.randn(256, 64)
    remat.auto(model, x, strategy="store_all", budget="1TiB")
    (warning,) = _step(model, x)
    message = str(warning.message)
    assert "the first training step of Sequential under plan store_all held" in message
    assert "'2' 64 KiB counted / 0 B predicted" in message  # sin's input, in module '2'
    assert _check_of(model) is None  # the check took itself off


def test_a_plan_edited_to_claim_fewer_held_bytes_warns_naming_its_region():
    model, inputs = models.build("gpt2", tiny=True, device="cpu")
    plan = remat.Planner(remat.trace(model, *inputs)).plan("1TiB", "full")
    claimed = dict(plan.held_by_module)
    claimed["h.1"] //= 2
    edited = replace(plan, held_bytes=plan.held_bytes - claimed["h.1"], held_by_module=claimed)
    remat.apply(model, edited)
    check = first_step.install(model, edited)
    (warning,) = _step(model, *inputs)
    assert f"'h.1' 64 KiB counted / {claimed['h.1'] // 1024} KiB predicted" in str(warning.message)
    assert check.report.warned


def test_check_false_neither_warns_nor_installs_anything():
    model, x = _sneaky(), torch.randn(256, 64)
    hooks = len(model._forward_pre_hooks), len(model._forward_hooks)
    remat.auto(model, x, strategy="store_all", budget="1TiB", check=False)
    assert (len(model._forward_pre_hooks), len(model._forward_hooks)) == hooks
    assert _step(model, x) == []


def test_the_check_runs_once_and_takes_itself_off():
    model, x = _sneaky(), torch.randn(256, 64)
    hooks = {id(m): (len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.modules()}
    remat.auto(model, x, strategy="store_all", budget="1TiB")
    with torch.no_grad():
        model(x)  # not a training step: the check waits for one
    assert _check_of(model) is not None
    assert len(_step(model, x)) == 1
    assert {id(m): (len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.modules()} == (
        hooks
    )
    assert _step(model, x) == []


def test_the_checked_step_has_the_gradients_of_an_unchecked_one():
    grads = []
    for check in (True, False):
        torch.manual_seed(0)
        model, inputs = models.build("gpt2", tiny=True, device="cpu", dropout=0.1)
        remat.auto(model, *inputs, strategy="full", budget="1TiB", check=check)
        torch.manual_seed(1)
        _step(model, *inputs)
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])


def test_a_trace_of_the_planned_model_is_not_its_first_step():
    model, x = _sneaky(), torch.randn(256, 64)
    remat.auto(model, x, strategy="store_all", budget="1TiB")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        remat.trace(model, x)  # under remat's dispatch mode, on fake tensors
    assert first_step.report(model) is None
    assert len(_step(model, x)) == 1


def test_a_planned_model_copied_before_its_first_step_checks_its_own():
    import copy

    model, x = _sneaky(), torch.randn(256, 64)
    remat.auto(model, x, strategy="store_all", budget="1TiB")
    twin = copy.deepcopy(model)
    assert len(_step(twin, x)) == 1
    assert len(_step(model, x)) == 1


def test_a_compiled_plan_checks_its_first_step_against_what_autograd_saves():
    model, inputs = models.build("gpt2", tiny=True, device="cpu")
    compiled = remat.compile(model, compiler="aot_eager")
    assert _step(compiled, *inputs) == []
    (plan,) = remat.applying.compiled.plans_of(compiled)
    halved = replace(plan, held_bytes=plan.held_bytes // 2)
    checked = first_step.check_compiled(compiled.forward, [halved], model)
    (warning,) = _step(checked, *inputs)
    assert "saved 1.79 MiB for the backward, 100.0% over" in str(warning.message)
    assert _step(checked, *inputs) == []  # once


def test_compile_with_check_false_does_not_check(monkeypatch):
    monkeypatch.setattr(first_step, "HELD_TOLERANCE", -1.0)  # every check warns
    x = torch.randn(4, 8)
    assert len(_step(remat.compile(nn.Linear(8, 8), compiler="aot_eager"), x)) == 1
    assert _step(remat.compile(nn.Linear(8, 8), compiler="aot_eager", check=False), x) == []
