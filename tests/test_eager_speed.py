"""What eager checkpointing itself costs, in the cost model (issue 11, item 7): a region's own work
and the selective policy's Python per op are part of a plan's predicted recompute time, so that
`auto` does not pick a selective plan whose policy costs more than the recompute it saves. No
timing here: the numbers are the profile's, the properties are the accounting's."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

import remat
from remat import models
from remat.device.cost import PROFILES, DeviceProfile, checkpoint_overhead_seconds
from remat.planning import strategies
from remat.prediction.schedule import analyse_regions

BARE = DeviceProfile("bare", peak_flops=1e11, vector_flops=2e10, bandwidth=2e10)


@pytest.fixture(scope="module")
def graph() -> remat.Graph:
    model, inputs = models.build("gpt2", batch=2, seq=64, tiny=True)
    return remat.trace(model, *inputs)


def _plan(graph, profile, name, budget=None):
    planner = remat.Planner(graph, profile)
    if budget is None:
        return planner.solve(strategies.get(name), planner.estimate.peak_bytes)
    return planner.plan(budget, name)


def _policy_ops(graph, plan) -> int:
    """Ops the selective policy sees: each selective region's forward ops, and the ops its replay
    runs up to its early stop, kept ones included (they are served from the policy's cache)."""
    total = 0
    for replay in analyse_regions(graph, plan.regions).replays:
        r = replay.region
        if not r.keep_keys:
            continue
        total += r.last_op - r.first_op + 1
        if replay.trigger is not None:
            total += replay.stop_at - r.first_op + 1
    return total


def test_the_policy_cost_is_charged_for_exactly_the_ops_selective_regions_run(graph):
    per_op = 1e-3
    priced = replace(BARE, name="per-op", policy_op_seconds=per_op)
    bare = _plan(graph, BARE, "selective:torchtitan")
    dear = _plan(graph, priced, "selective:torchtitan")
    assert dear.regions == bare.regions and dear.regions
    ops = _policy_ops(graph, bare)
    forward_ops = sum(r.last_op - r.first_op + 1 for r in bare.regions)
    # every forward op of every region, plus a replay that reaches at least one op and at most all
    assert forward_ops < ops <= 2 * forward_ops
    assert dear.recompute_seconds - bare.recompute_seconds == pytest.approx(ops * per_op)
    # a region without a policy pays nothing per op, and store_all nothing at all
    for name in ("full", "store_all"):
        assert _plan(graph, priced, name).recompute_seconds == pytest.approx(
            _plan(graph, BARE, name).recompute_seconds
        )


def test_every_region_pays_the_region_cost_once(graph):
    priced = replace(BARE, name="per-region", region_seconds=1e-3)
    for name in ("full", "sqrt", "selective:torchtitan", "store_all"):
        bare, dear = _plan(graph, BARE, name), _plan(graph, priced, name)
        assert dear.recompute_seconds - bare.recompute_seconds == pytest.approx(
            1e-3 * len(bare.regions)
        )
    assert checkpoint_overhead_seconds(priced, 3, 100) == pytest.approx(3e-3)


def test_the_milp_prices_each_block_option_with_its_overhead(graph):
    priced = replace(BARE, name="both", region_seconds=2e-3, policy_op_seconds=1e-4)
    bare, dear = remat.Planner(graph, BARE), remat.Planner(graph, priced)
    for option in ("full", "selective:torchtitan", "selective:megatron"):
        regions = bare.every_block(option)
        extra = dear.region_overheads(regions)
        assert all(e >= 2e-3 for e in extra)
        for b, (a, d) in enumerate(
            zip(bare.block_metrics[option].seconds, dear.block_metrics[option].seconds, strict=True)
        ):
            assert d - a == pytest.approx(extra[b])
    assert dear.block_metrics["store"].seconds == bare.block_metrics["store"].seconds


def test_auto_prefers_plain_checkpointing_when_the_policy_costs_more_than_it_saves(graph):
    titan = _plan(graph, BARE, "selective:torchtitan")
    budget = titan.predicted_peak_bytes
    cheap = _plan(graph, BARE, "auto", budget)
    # with checkpointing free, the selective plans win at this budget
    assert any(r.keep for r in cheap.regions)
    dear_profile = replace(BARE, name="dear-policy", policy_op_seconds=1.0)
    dear = _plan(graph, dear_profile, "auto", budget)
    assert dear.predicted_peak_bytes <= budget
    assert not any(r.keep for r in dear.regions)  # no selective region: full blocks or segments
    assert dear.recompute_seconds <= _plan(graph, dear_profile, "full").recompute_seconds
    assert (
        dear.recompute_seconds
        < _plan(graph, dear_profile, "selective:torchtitan").recompute_seconds
    )


def test_shipped_and_custom_profiles_leave_checkpointing_free_unless_calibrated():
    # shipped rooflines have no launch cost, so a fixed host cost would swamp a small model's step
    for p in PROFILES.values():
        assert (p.region_seconds, p.policy_op_seconds) == (0.0, 0.0), p.name
    assert (BARE.region_seconds, BARE.policy_op_seconds) == (0.0, 0.0)
    assert math.isclose(checkpoint_overhead_seconds(BARE, 12, 1000), 0.0)


def test_checkpointing_overheads_on_the_cpu_are_the_threads_own_work(monkeypatch):
    """On a CPU shared with other processes the wall clock counts their turns too (at load 13 on
    2 cores: 67 us an op of torch's policy mode where the thread worked 12), while the ops they
    are ranked against are priced unloaded: the CPU's figures come from the thread's CPU clock. A
    thread clock that never moves gives no overhead at all; the wall clock moves regardless."""
    import time

    import torch

    from remat.measuring.calibrate import checkpoint_overheads

    monkeypatch.setattr(time, "thread_time", lambda: 0.0)
    assert checkpoint_overheads(torch.device("cpu"), ops=4, reps=2) == (0.0, 0.0)
