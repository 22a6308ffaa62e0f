"""The strategy registry: one namespace for the eager and compiled paths, read by `plan`, `auto`,
`compare`, `pareto` and the CLI; a strategy of one's own is one file."""

from __future__ import annotations

import dataclasses
import importlib
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import remat
from remat import models
from remat.answers.cli import build_parser
from remat.planning import strategies
from remat.planning.strategies import Strategy

EVERY_OTHER = '''
"""Checkpoint every other block: a strategy written outside remat, in one file."""
from remat.planning.strategies import Strategy, register


def solve(planner, budget_bytes):
    groups = [[b] for b in range(0, len(planner.blocks), 2)]
    return planner.make_plan(
        planner.block_regions(groups), "every_other", budget_bytes, "every other block"
    )


STRATEGY = register(
    Strategy(name="every_other", summary="checkpoint every other block", solve=solve,
             needs_blocks=True)
)
'''


@pytest.fixture
def every_other_unregistered():
    yield
    strategies.unregister("every_other")


@pytest.fixture(scope="module")
def gpt2_graph():
    model, inputs = models.build("gpt2", batch=2, seq=64, tiny=True)
    return remat.trace(model, *inputs)


def test_a_strategy_in_one_new_file_is_planned_compared_chosen_and_listed(
    tmp_path, monkeypatch, every_other_unregistered, gpt2_graph
):
    (tmp_path / "every_other_strategy.py").write_text(textwrap.dedent(EVERY_OTHER))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("every_other_strategy", None)
    importlib.import_module("every_other_strategy")

    planner = remat.Planner(gpt2_graph)
    mine = planner.plan("1TiB", "every_other")
    full = planner.plan("1TiB", "full")
    store_all = planner.plan("1TiB", "store_all")
    assert len(mine.regions) == (len(planner.blocks) + 1) // 2
    assert full.held_bytes < mine.held_bytes < store_all.held_bytes
    assert full.predicted_peak_bytes <= mine.predicted_peak_bytes <= store_all.predicted_peak_bytes
    assert 0 < mine.recompute_seconds < full.recompute_seconds
    assert "every_other" in [row.strategy for row in planner.compare("1TiB")]
    # auto reads the registry: at exactly its peak, nothing fixed that fits is cheaper than it
    chosen = planner.plan(mine.predicted_peak_bytes, "auto")
    assert chosen.recompute_seconds <= mine.recompute_seconds
    help_text = build_parser()._subparsers._group_actions[0].choices["plan"].format_help()
    assert "every_other" in help_text and "checkpoint every other block" in help_text


def test_every_strategy_says_where_it_runs_and_is_listed_in_the_help():
    help_text = build_parser()._subparsers._group_actions[0].choices["plan"].format_help()
    names = [s.name for s in strategies.available()]
    assert {"store_all", "full", "sqrt", "chain_dp", "mincut", "milp", "auto"} <= set(names)
    for s in strategies.available():
        assert s.paths and s.summary and s.name in help_text
    compiled = {s.name for s in strategies.available("compile")}
    assert compiled == {"mincut", "milp", "auto"}  # the same names as eager, same ideas


def test_the_strategies_page_describes_every_registered_strategy_and_its_paths():
    page = (Path(__file__).resolve().parents[1] / "docs" / "strategies.md").read_text()
    rows = {
        line.split("|")[1].strip(" `"): line.split("|")[2]
        for line in page.splitlines()
        if line.startswith("| `")
    }
    for s in strategies.available():
        assert s.name in rows, f"docs/strategies.md has no row for {s.name}"
        assert all(path in rows[s.name] for path in s.paths), (s.name, rows[s.name])


def test_an_unknown_or_eager_only_strategy_is_refused_by_the_compiled_backend():
    with pytest.raises(remat.UnknownStrategyError, match="mincut") as err:
        remat.backend(strategy="magic")
    assert err.value.choices == ("mincut", "milp", "auto")
    with pytest.raises(remat.UnknownStrategyError, match="has no compile path"):
        remat.backend(strategy="full")


def test_a_block_strategy_on_a_model_without_blocks_is_bad_input_not_infeasible():
    graph = remat.trace(
        lambda a, b: torch.cos(torch.cos(a + b)).sum(),
        torch.randn(8, requires_grad=True),
        torch.randn(8, requires_grad=True),
    )
    with pytest.raises(remat.NoBlocksError, match="no numbered submodules") as err:
        remat.plan(graph, "1TiB", "full")
    assert err.value.strategy == "full"
    assert not isinstance(err.value, remat.InfeasibleBudget)
    rows = {row.strategy: row for row in remat.Planner(graph).compare("1TiB")}
    assert rows["full"].plan is None and rows["mincut"].plan is not None
    assert remat.plan(graph, "1TiB", "auto").predicted_peak_bytes > 0


def test_a_strategy_needs_a_solve_function():
    with pytest.raises(remat.RematError, match="neither"):
        strategies.register(strategies.Strategy(name="empty", summary="nothing"))


def test_first_k_checkpoints_the_fewest_first_blocks_that_fit():
    """Megatron-LM's block method: the smallest k whose plan (blocks 0..k-1 checkpointed, the
    rest kept) fits by the exact simulation; k - 1 does not."""
    from remat.planning.strategies import get

    model, inputs = models.build("gpt2", tiny=True, batch=8, seq=128, n_layer=6)
    planner = remat.Planner(remat.trace(model, *inputs))
    budget = planner.budget_bytes("70%")
    plan = planner.plan(budget, "first_k")
    k = plan.details["k"]
    assert [r.modules for r in plan.regions] == [(b.path,) for b in planner.blocks[:k]]
    assert plan.predicted_peak_bytes <= budget
    fewer = planner.make_plan(planner.block_regions([[b] for b in range(k - 1)]), "x", budget, "")
    assert fewer.predicted_peak_bytes > budget
    assert get("first_k").lowest_peak(planner).predicted_peak_bytes <= plan.predicted_peak_bytes


def test_a_time_budget_is_feasible_whatever_a_solver_answers_at_the_peak_it_resolves_to():
    """Issue 33: a time budget ("+10%") resolves to the peak of a plan on the frontier, found by
    a strategy at some budget; asked again at that peak, a budgeted solver may answer otherwise
    (here: only at generous budgets). `auto` then takes the frontier's plan, never raising."""
    model, inputs = models.build("mlp-chain-6", batch=64, device="cpu", tiny=True)
    planner = remat.Planner(remat.trace(model, *inputs))
    lowest = planner.lowest_peak()

    def only_when_generous(p, budget_bytes):
        if budget_bytes < planner.estimate.peak_bytes:
            raise remat.InfeasibleBudget(
                "tight", budget_bytes=budget_bytes, min_feasible_bytes=None
            )
        # a plan below every other strategy's lowest peak, at no recompute
        plan = p.make_plan(p.every_block("full"), "generous", budget_bytes, "a solver's answer")
        return dataclasses.replace(
            plan, predicted_peak_bytes=lowest.predicted_peak_bytes - 1, recompute_seconds=0.0
        )

    strategies.register(
        Strategy(name="generous", summary="answers only at generous budgets",
                 solve=only_when_generous, budgeted=True, needs_blocks=True)
    )  # fmt: skip
    try:
        plan = planner.plan("+10%", "auto")
    finally:
        strategies.unregister("generous")
    assert plan.strategy == "auto (generous)"
    assert plan.budget_bytes == plan.predicted_peak_bytes == lowest.predicted_peak_bytes - 1
