"""The check every sweep of models runs on a plan installed on a real model: one real step's
gradients against the unplanned model's, then `remat.verify`'s measured step against the plan."""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import torch
from torch import nn

import remat
from remat.answers.bench import gradients


def assert_step_as_planned(
    model: nn.Module,
    plan: remat.Plan,
    reference: dict[str, torch.Tensor],
    inputs: tuple = (),
    *,
    peak_tolerance: float = 0.03,
    bit_identical: bool = True,
    **kwargs: Any,
) -> None:
    """Gradients equal `reference` (bit for bit, or to float rounding where an architecture's
    kernels reorder sums), every kept op of the plan matched, the bytes held for the backward
    within 2% of the plan's and the peak within `peak_tolerance`. `kwargs`: the model's keyword
    inputs and `loss_fn`, as `remat.verify` takes them."""
    got = gradients(model, inputs, **kwargs)
    assert got.keys() == reference.keys()
    for name, g in reference.items():
        if bit_identical:
            assert torch.equal(got[name], g), (plan.strategy, name)
        else:
            torch.testing.assert_close(got[name], g, rtol=1e-6, atol=1e-7, msg=name)
    v = remat.verify(model, *inputs, **kwargs)
    assert v.kept_ops_matched == v.kept_ops_expected, [r.missing for r in v.regions]
    assert v.held_ratio == pytest.approx(1, abs=0.02), (plan.strategy, v)
    assert v.peak_ratio == pytest.approx(1, abs=peak_tolerance), (plan.strategy, v)
    assert v.ok


def sweep_three_budgets(
    model: nn.Module,
    inputs: tuple = (),
    *,
    peak_tolerance: float = 0.03,
    bit_identical: bool = True,
    **kwargs: Any,
) -> list[remat.Plan]:
    """`remat.auto` at 100%, then `auto` plans halfway to the lowest feasible budget and at it:
    each installed, stepped and checked against an unplanned copy (`assert_step_as_planned`), then
    removed, which gives every module its own `forward` back. The three plans, in that order."""
    reference = gradients(copy.deepcopy(model), inputs, **kwargs)
    check = functools.partial(
        assert_step_as_planned,
        inputs=inputs,
        peak_tolerance=peak_tolerance,
        bit_identical=bit_identical,
        **kwargs,
    )
    plans = [remat.auto(model, *inputs, budget="100%", **kwargs)]
    check(model, plans[0], reference)
    remat.remove(model)
    graph = remat.trace(model, *inputs, **kwargs)
    with pytest.raises(remat.InfeasibleBudget) as infeasible:
        remat.plan(graph, budget=1)
    lowest = infeasible.value.min_feasible_bytes
    for budget in ((lowest + plans[0].predicted_peak_bytes) // 2, lowest):
        plan = remat.plan(graph, budget=budget, strategy="auto")
        assert plan.predicted_peak_bytes <= budget
        remat.apply(model, plan)
        check(model, plan, reference)
        remat.remove(model)
        plans.append(plan)
    assert plans[-1].regions, "the lowest feasible budget needs recomputation"
    assert not [m for m in model.modules() if "forward" in vars(m)]
    return plans
