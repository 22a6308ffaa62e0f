"""`tune`: the fastest of the plans that fit, timed on the model, wins over the cost model's pick
(checked with a fake clock, so the test does not depend on this machine's speed); results are
cached per model, shapes and budget, for the process and on disk."""

from __future__ import annotations

import json

import pytest
import torch

import remat
from remat import models
from remat.applying.tune import _CACHE, candidate_plans, tune


@pytest.fixture()
def setup():
    torch.manual_seed(0)
    model, inputs = models.build("gpt2", tiny=True, device="cpu", batch=8, seq=128, n_layer=4)
    planner = remat.Planner(remat.trace(model, *inputs))
    budget = planner.budget_bytes("90%")
    _CACHE.clear()
    return model, inputs, planner, budget


def _installed(model) -> str:
    return vars(model)["_remat_applied"].plan.strategy


def test_candidates_fit_the_budget_are_distinct_and_cheapest_first(setup):
    _, _, planner, budget = setup
    plans = candidate_plans(planner, budget, candidates=10)
    assert len(plans) >= 2
    assert all(p.predicted_peak_bytes <= budget and p.appliable for p in plans)
    assert [p.recompute_seconds for p in plans] == sorted(p.recompute_seconds for p in plans)
    assert len({tuple((r.modules, r.keep) for r in p.regions) for p in plans}) == len(plans)


def test_the_fastest_measured_plan_wins_over_the_predicted_cheapest(setup):
    model, inputs, planner, budget = setup
    plans = candidate_plans(planner, budget)
    slowest_predicted = plans[-1].strategy
    calls: list[str] = []

    def fake_clock(m, args, kwargs):  # the cost model's last pick is the machine's fastest
        calls.append(_installed(m))
        return 0.010 if _installed(m) == slowest_predicted else 0.050

    tuned = tune(model, *inputs, planner=planner, budget_bytes=budget, rounds=3, timer=fake_clock)
    assert (
        tuned.chosen.strategy
        == f"auto ({slowest_predicted.removeprefix('auto (').removesuffix(')')}, tuned)"
    )
    assert tuned.chosen.predicted_peak_bytes <= budget
    assert "fastest measured" in tuned.chosen.reason
    assert len(calls) == len(plans) * (3 + 1)  # three timed rounds and a warmup each
    assert calls[: len(plans)] != calls[len(plans) * 2 : len(plans) * 3]  # order rotates
    assert "_remat_applied" not in vars(model)  # every candidate removed after its step

    again = tune(model, *inputs, planner=planner, budget_bytes=budget, timer=fake_clock)
    assert again.cached and again.chosen == tuned.chosen and len(calls) == len(plans) * 4


def test_noise_does_not_overrule_the_cost_models_pick(setup):
    """A candidate with the least median that was not faster than the cost model's pick in every
    round is noise, not a win: the pick stays. One faster in every round wins."""
    model, inputs, planner, budget = setup
    plans = candidate_plans(planner, budget)
    assert len(plans) >= 2
    first, other = plans[0].strategy, plans[1].strategy
    rounds: dict[str, int] = {}

    def noisy(m, args, kwargs):  # `other`: faster in 4 rounds of 5 (warmups included), one spike
        name = _installed(m)
        rounds[name] = rounds.get(name, 0) + 1
        if name == other:
            return 0.080 if rounds[name] == 4 else 0.010
        return 0.020 if name == first else 0.050

    kept = tune(model, *inputs, planner=planner, budget_bytes=budget + 1, timer=noisy)
    assert kept.chosen.regions == plans[0].regions
    assert kept.seconds[other] < kept.seconds[first]  # its median was lower all the same

    def clear(m, args, kwargs):
        return 0.010 if _installed(m) == other else 0.020

    won = tune(model, *inputs, planner=planner, budget_bytes=budget + 2, timer=clear)
    assert won.chosen.regions == plans[1].regions


def test_a_tuned_plan_is_kept_on_disk_for_the_next_process(setup, monkeypatch, tmp_path):
    """A new process (the in-process cache cleared) applies the kept plan without timing again;
    a file this remat cannot read is said and timed again; REMAT_CACHE_DIR=off keeps nothing."""
    model, inputs, planner, budget = setup
    plans = candidate_plans(planner, budget)
    last = plans[-1].strategy
    calls: list[str] = []

    def clock(m, args, kwargs):
        calls.append(_installed(m))
        return 0.010 if _installed(m) == last else 0.050

    tuned = tune(model, *inputs, planner=planner, budget_bytes=budget, timer=clock)
    assert tuned.cache_file is not None and tuned.cache_file.is_relative_to(tmp_path)
    assert tuned.cache_file.exists() and not tuned.cached
    timed = len(calls)
    _CACHE.clear()
    again = tune(model, *inputs, planner=planner, budget_bytes=budget, timer=clock)
    assert again.cached and len(calls) == timed
    assert again.chosen.regions == tuned.chosen.regions and again.seconds == tuned.seconds
    assert again.chosen.reason == tuned.chosen.reason
    other_budget = tune(model, *inputs, planner=planner, budget_bytes=budget - 1, timer=clock)
    assert not other_budget.cached and other_budget.cache_file != tuned.cache_file

    _CACHE.clear()
    tuned.cache_file.write_text("{not json")
    with pytest.warns(remat.RematWarning, match="ignoring the tuned-plan cache file"):
        redone = tune(model, *inputs, planner=planner, budget_bytes=budget, timer=clock)
    assert not redone.cached and len(calls) > timed + len(plans)
    assert json.loads(tuned.cache_file.read_text())["chosen"]["regions"]  # written again

    _CACHE.clear()
    kept = sorted(tmp_path.rglob("*.json"))
    assert len(kept) == 2  # the two budgets
    monkeypatch.setenv("REMAT_CACHE_DIR", "off")
    off = tune(model, *inputs, planner=planner, budget_bytes=budget + 3, timer=clock)
    assert off.cache_file is None and sorted(tmp_path.rglob("*.json")) == kept


def test_a_tie_goes_to_the_cost_models_pick(setup):
    model, inputs, planner, budget = setup
    tuned = tune(model, *inputs, planner=planner, budget_bytes=budget, timer=lambda m, a, k: 0.02)
    assert tuned.chosen.regions == candidate_plans(planner, budget)[0].regions


def test_auto_with_tune_applies_the_fastest_and_keeps_gradients(setup, monkeypatch):
    model, inputs, _, _ = setup
    from remat.answers.bench import gradients

    reference = gradients(model, inputs)
    plan = remat.auto(model, *inputs, budget="90%", tune=True)
    assert plan.strategy.endswith(", tuned)") and _installed(model) == plan.strategy
    got = gradients(model, inputs)
    for name in reference:
        torch.testing.assert_close(got[name], reference[name], rtol=1e-6, atol=1e-6)
    with pytest.raises(remat.RematError, match="tune=True"):
        remat.auto(model, *inputs, budget="90%", tune=True, strategy="milp")
    remat.remove(model)


def test_candidates_are_ranked_with_checkpointings_cost_measured_on_this_device(monkeypatch):
    from remat.applying import tune
    from remat.applying.tune import with_measured_overheads
    from remat.device.cost import get_profile

    monkeypatch.setattr(tune, "_OVERHEADS", {})  # measured here, not conftest's pinned 0

    shipped = get_profile("cpu")
    assert shipped.region_seconds == shipped.policy_op_seconds == 0  # rooflines: no launch cost
    measured = with_measured_overheads(shipped, torch.device("cpu"))
    assert measured.region_seconds > 0 and measured.policy_op_seconds > 0
    assert (measured.peak_flops, measured.bandwidth) == (shipped.peak_flops, shipped.bandwidth)
    assert with_measured_overheads(measured, torch.device("cpu")) is measured  # given: kept


def test_untuned_auto_prices_ops_at_the_cpus_rates_measured_once_and_kept_on_disk(monkeypatch):
    """The shipped `cpu` profile's rates are placeholders that priced GPT-2's matmuls 1.6x dear
    against its layer norms and adds, and its attention 1.7x cheap, on this project's VM: auto
    ranks with the CPU's rates measured (`calibrate_rates`), once a machine (kept on disk under
    `$REMAT_CACHE_DIR/profile`, read by the next process) and once a process. A profile of other
    rates, or a model on a GPU, keeps what it was given."""
    from dataclasses import replace

    from remat.applying import tune
    from remat.applying.tune import measured_profile
    from remat.device.cost import get_profile

    fake = {
        "peak_flops": 2e11,
        "vector_flops": 1.5e10,
        "bandwidth": 1.3e10,
        "transcendental_ops": 4.5,
        "attention_flops": 9e10,
        "element_ops": (("gelu", 20.0), ("_softmax", 9.0)),
    }
    calls = []

    def calibrate(device):
        calls.append(device)
        return dict(fake)

    monkeypatch.setattr(tune, "calibrate_rates", calibrate)
    monkeypatch.setattr(tune, "_RATES", {})
    cpu = torch.device("cpu")
    shipped = get_profile("cpu")
    measured = measured_profile(shipped, cpu)
    assert [getattr(measured, k) for k in fake] == list(fake.values())
    assert measured.name == "cpu"  # tuned plans stay keyed by the profile's name
    assert measured_profile(shipped, cpu) == measured and len(calls) == 1  # once a process
    tune._RATES.clear()  # the next process: read from disk, not measured
    assert measured_profile(shipped, cpu) == measured and len(calls) == 1
    files = list((tune.cache_dir().parent / "profile").glob("cpu-*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["rates"]["attention_flops"] == 9e10

    mine = replace(shipped, name="mine", peak_flops=3e11)
    assert measured_profile(mine, cpu).peak_flops == 3e11
    on_gpu = replace(shipped, region_seconds=1e-3)  # overheads given: nothing measured on a GPU
    assert measured_profile(on_gpu, torch.device("cuda")) is on_gpu
    assert len(calls) == 1


def test_auto_keeps_the_traces_own_options_from_the_model_and_refuses_timing_without_autocast():
    # auto's keyword arguments are the model's: tune=True called forward(..., autocast=...)
    torch.manual_seed(0)
    model, inputs = models.build("gpt2", tiny=True, device="cpu", batch=8, seq=128, n_layer=4)
    plan = remat.auto(model, *inputs, budget="90%", target="cpu", tune=True)
    assert plan.strategy.endswith(", tuned)")
    with pytest.raises(remat.RematError, match="leave tune at 'steps'"):
        remat.auto(model, *inputs, budget="90%", autocast=torch.bfloat16, tune=True)
    remat.auto(model, *inputs, budget="90%", autocast=torch.bfloat16)  # tuned on the first steps
