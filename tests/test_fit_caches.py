"""What `fit` keeps between questions (issue 35): the MILP's answer per program and room, a
planner's judged plan per regions, a step's allocator walk per plan; and where a search spares
auto's solvers (a fixed plan's reserved bytes fit). Each is a shortcut that must not change an
answer: the same figures come back with it and without it."""

from __future__ import annotations

import json
from collections import OrderedDict

import pytest

from remat import models
from remat.answers import fit_rows, fit_steps
from remat.errors import InfeasibleBudget
from remat.planning import planner as planner_module
from remat.planning.solvers import block_front
from remat.planning.solvers import milp as milp_module
from remat.planning.solvers.milp import BlockOption, BlockProblem, milp


class _Forgetful(OrderedDict):
    """A cache that keeps nothing: every question is answered afresh."""

    def __setitem__(self, key, value) -> None:
        pass


def _problem(fixed: int) -> BlockProblem:
    """Six blocks, each stored, fully recomputed or half kept, on `fixed` bytes."""
    block = (
        BlockOption("store", 100, 160, 0.0),
        BlockOption("full", 10, 170, 1.0),
        BlockOption("half", 50, 165, 0.4),
    )
    return BlockProblem((block,) * 6, fixed_bytes=fixed, forward_extra_bytes=20)


def _solving_with(monkeypatch, cache: str) -> None:
    """Empty caches; where `cache` is HiGHS's (`_solved`), the front gives up so HiGHS answers."""
    monkeypatch.setattr(milp_module, "_fronts", OrderedDict())
    monkeypatch.setattr(milp_module, "_solved", OrderedDict())
    if cache == "_solved":
        monkeypatch.setattr(block_front, "MAX_LABELS", 0)


@pytest.mark.parametrize("cache", ["_fronts", "_solved"])
def test_the_milp_answers_a_program_shifted_by_its_fixed_bytes_as_if_solved_afresh(
    monkeypatch, cache
):
    """Two optimizers' planners of one step pose the same program on other fixed bytes: the
    kept answer (the front, or HiGHS's answer at that room), asked at the same room, is what
    solving the shifted program gives."""
    _solving_with(monkeypatch, cache)
    first = milp(_problem(1_000), 1_000 + 400)
    assert len(getattr(milp_module, cache)) == 1
    kept = milp(_problem(7_777), 7_777 + 400)
    assert len(getattr(milp_module, cache)) == 1  # answered from what was kept
    monkeypatch.setattr(milp_module, cache, _Forgetful())
    fresh = milp(_problem(7_777), 7_777 + 400)
    assert kept == fresh
    assert kept.peak_bytes == first.peak_bytes + 6_777


@pytest.mark.parametrize("cache", ["_fronts", "_solved"])
def test_the_milp_refuses_a_shifted_program_with_its_own_bytes(monkeypatch, cache):
    """An infeasible room is kept too; the refusal names the asked program's budget and peak."""
    _solving_with(monkeypatch, cache)
    with pytest.raises(InfeasibleBudget):
        milp(_problem(0), 100)
    with pytest.raises(InfeasibleBudget) as kept:
        milp(_problem(5_000), 5_100)
    monkeypatch.setattr(milp_module, cache, _Forgetful())
    with pytest.raises(InfeasibleBudget) as fresh:
        milp(_problem(5_000), 5_100)
    assert str(kept.value) == str(fresh.value)
    assert kept.value.min_feasible_bytes == fresh.value.min_feasible_bytes
    assert kept.value.budget_bytes == fresh.value.budget_bytes == 5_100


def _fit_json(capacity: int) -> dict:
    from remat.answers.fit import fit
    from remat.device.gpus import with_capacity

    def build_for(precision: str):
        dtype = fit_steps.PRECISIONS[precision].param_dtype
        return lambda b, s: models.build(
            "llama-2-7b", batch=b, seq=s, tiny=True, n_layers=4, dtype=dtype
        )

    report = fit(
        build_for("bf16-mixed"),
        model="llama",
        batch=2,
        seq=128,
        gpu=with_capacity("h100", capacity),
        precision="bf16-mixed",
        optimizer="adamw",
        build_for=build_for,
    )
    out = report.to_dict()
    del out["seconds"]
    return json.loads(json.dumps(out, default=str))


@pytest.mark.slow
def test_fit_answers_the_same_with_and_without_what_it_keeps(monkeypatch):
    """Two fits: one where everything fits (the searches for the largest batch and sequence run
    on the allocator's judgement), one where nothing fits as asked (so the advice tries other
    precisions, optimizers and ranks). Rows, maxima, allocator figures and the setup that fits
    are equal with the caches and shortcuts and with every one of them off."""
    monkeypatch.setattr(milp_module, "_solved", OrderedDict())
    spared = []
    candidate_fits = fit_rows.candidate_fits

    def counted(*args):
        spared.append(candidate_fits(*args))
        return spared[-1]

    monkeypatch.setattr(fit_rows, "candidate_fits", counted)
    roomy = _fit_json(80 * 2**30)
    limit = roomy["rows"][0]["gpu_memory"][0]["limit_bytes"]
    lowest = min(r["reserved_bytes"] for r in roomy["rows"])
    capacity = roomy["capacity_bytes"] - (limit - (lowest - 2 * 2**20))  # 2 MiB short
    tight = _fit_json(capacity)
    assert all(r["fits"] for r in roomy["rows"])
    assert not any(r["fits"] for r in tight["rows"]) and "setup_that_fits" in tight["extra"]
    assert True in spared  # a search took the shortcut past auto's solvers

    make_plan = planner_module.Planner.make_plan
    gpu_memories = fit_steps.FitSteps.gpu_memories

    def plan_afresh(self, *args, **kwargs):
        self._judged.clear()
        return make_plan(self, *args, **kwargs)

    def walk_afresh(self, *args, **kwargs):
        self.memories.clear()
        return gpu_memories(self, *args, **kwargs)

    monkeypatch.setattr(milp_module, "_solved", _Forgetful())
    monkeypatch.setattr(planner_module.Planner, "make_plan", plan_afresh)
    monkeypatch.setattr(fit_steps.FitSteps, "gpu_memories", walk_afresh)
    monkeypatch.setattr(fit_rows, "candidate_fits", lambda *args: False)
    assert _fit_json(80 * 2**30) == roomy
    assert _fit_json(capacity) == tight


def test_a_planner_judges_regions_once_and_labels_each_plan_as_asked():
    """`make_plan` of regions judged before: the same prediction under the new labels, equal to
    a fresh planner's plan of them."""
    from remat.tracing.trace import trace

    model, inputs = models.build("gpt2", batch=2, seq=32, tiny=True, device="meta")
    graph = trace(model, *inputs)
    warm = planner_module.Planner(graph, "h100", "adamw")
    regions = warm.every_block("full")
    warm.make_plan(regions, "full", None, "first")
    again = warm.make_plan(regions, "first_k", 123, "second", status="optimal", k=2)
    fresh = planner_module.Planner(graph, "h100", "adamw").make_plan(
        regions, "first_k", 123, "second", status="optimal", k=2
    )
    assert again == fresh
    assert again.regions is regions and again.details == {"k": 2}


def test_a_pipeline_fit_walks_each_ranks_plans_once_and_answers_the_same(monkeypatch):
    """`RankMemory.of` keeps each pipeline's walk by its stages' regions: on a roomy GPU auto's
    plan is store-all's on every stage, walked once; the fit is the same with every walk made
    afresh."""
    from remat.device.gpus import custom_gpu
    from remat.layouts import fit_pipeline
    from remat.layouts.parallel import Layout

    def llama(batch: int, seq: int):
        return models.build("llama-2-7b", batch=batch, seq=seq, tiny=True, n_layers=4)

    def pipeline_json() -> dict:
        from remat.answers.fit import fit

        report = fit(
            llama, model="llama", batch=8, seq=64, gpu=custom_gpu(1 << 40, "h100"),
            precision="fp32", optimizer="sgd", layout=Layout(pp=2, microbatches=4),
        )  # fmt: skip
        out = report.to_dict()
        del out["seconds"]
        return json.loads(json.dumps(out, default=str))

    walks = []
    gpu_memories = fit_pipeline.TracedPipeline.gpu_memories

    def counted(self, *args, **kwargs):
        walks.append(args[0])
        return gpu_memories(self, *args, **kwargs)

    monkeypatch.setattr(fit_pipeline.TracedPipeline, "gpu_memories", counted)
    kept = pipeline_json()
    rows = kept["rows"]
    assert [r["plan"] for r in rows if r["strategy"] == "auto"] == [
        "per stage: 0 store_all, 1 store_all"
    ]
    assert len(walks) == 2 * (len(rows) - 1)  # auto's ranks were store-all's, not walked again
    of = fit_pipeline.RankMemory.of

    def afresh(self, *args):
        self.walked.clear()
        return of(self, *args)

    monkeypatch.setattr(fit_pipeline.RankMemory, "of", afresh)
    assert pipeline_json() == kept
