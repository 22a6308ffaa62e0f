"""Shortcuts that make `fit` answer sooner (issue 35), each checked against what it replaces:
`first_k` steps one simulation through its block counts (`remat.prediction.prefix_peaks`)
instead of simulating each (the peaks, the plans it answers at any budget and its lowest-peak
plan are the same as simulating every count); every block's replay reach comes from one
analysis; the block front drops labels an earlier one beats before its sweep."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import remat
from remat import models
from remat.errors import InfeasibleBudget
from remat.planning.solvers import block_front
from remat.planning.strategies import first_k, get
from remat.prediction.prefix_peaks import prefixes
from remat.prediction.schedule import simulate

#: (preset, its overrides, trace target, autocast, optimizer): dropout (random regions, an RNG
#: state per frame), BatchNorm (its statistics' snapshot per frame), GQA, the CUDA target's kernel
#: scratch, an optimizer step that ties the later block counts' peaks
CASES = [
    ("resnet18", {}, None, None, "sgd"),
    ("gpt2", {"n_layer": 6, "dropout": 0.1}, None, None, None),
    ("gpt2", {"n_layer": 5}, "cuda", torch.bfloat16, "adamw"),
    ("llama-3.2-1b", {"n_layers": 5}, None, None, "adamw"),
    ("llama-3.1-8b", {"n_layers": 4}, "cuda", torch.bfloat16, "sgd"),
]


def _planner(name, overrides, target, autocast, optimizer, seq=64):
    model, inputs = models.build(name, tiny=True, batch=2, seq=seq, **overrides)
    graph = remat.trace(model, *inputs, target=target, autocast=autocast)
    return remat.Planner(graph, "h100" if target else "cpu", optimizer=optimizer)


def _every_count(planner):
    """first_k's plans as it made them before stepping: one simulation per block count."""
    n = len(planner.blocks)
    return [
        planner.make_plan(planner.block_regions([[b] for b in range(k)]), "x", None, "")
        for k in range(n + 1)
    ]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}-{c[2] or 'cpu'}-{c[4]}")
def planner(request):
    return _planner(*request.param)


def test_stepped_peaks_equal_each_block_count_simulated(planner):
    regions = planner.every_block()
    found = prefixes(planner.graph, regions)
    assert found is not None
    for k in range(len(regions) + 1):
        sim = simulate(planner.graph, regions[:k], base_bytes=0)
        assert found.peaks[k] == sim.peak_bytes, k
        assert found.recompute_ops(k) == sim.recompute_ops, k
    plans = _every_count(planner)
    assert first_k.predicted_peaks(planner) == [p.predicted_peak_bytes for p in plans]


def test_first_k_answers_as_simulating_every_block_count(planner):
    """At budgets between every two counts' peaks (and above and below all): the fewest blocks
    that fit, the same plan; below the lowest, the same refusal; the same lowest-peak plan, the
    fewest recompute among counts tied at the lowest peak."""
    plans = _every_count(planner)
    peaks = sorted({p.predicted_peak_bytes for p in plans})
    budgets = [
        peaks[0] - 1,
        *peaks,
        *(a + (b - a) // 2 for a, b in zip(peaks, peaks[1:], strict=False)),
        10**15,
    ]
    strategy = get("first_k")
    for budget in budgets:
        fits = [k for k, p in enumerate(plans) if p.predicted_peak_bytes <= budget]
        if not fits:
            with pytest.raises(InfeasibleBudget) as refused:
                first_k.solve(planner, budget)
            assert refused.value.min_feasible_bytes == peaks[0]
            continue
        plan = strategy.solve(planner, budget)
        assert plan.details["k"] == fits[0]
        assert plan.predicted_peak_bytes == plans[fits[0]].predicted_peak_bytes
        assert plan.recompute_seconds == plans[fits[0]].recompute_seconds
    lowest = min(plans, key=lambda p: (p.predicted_peak_bytes, p.recompute_seconds))
    found = first_k.lowest_peak(planner)
    assert found.regions == lowest.regions
    assert (found.predicted_peak_bytes, found.recompute_seconds) == (
        lowest.predicted_peak_bytes,
        lowest.recompute_seconds,
    )


def test_block_counts_tied_at_the_lowest_peak_are_told_apart_by_recompute():
    """An optimizer step above every checkpointed count's activations ties those counts: the
    lowest-peak plan is still the one of least recompute, the fewest blocks (the case above
    with AdamW's step, asserted to tie here so that the test keeps covering it)."""
    planner = _planner("gpt2", {"n_layer": 5}, "cuda", torch.bfloat16, "adamw", seq=16)
    peaks = first_k.predicted_peaks(planner)
    assert peaks.count(min(peaks)) > 1
    plans = _every_count(planner)
    lowest = min(plans, key=lambda p: (p.predicted_peak_bytes, p.recompute_seconds))
    assert first_k.lowest_peak(planner).regions == lowest.regions


@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("seed", range(6))
def test_block_front_keeps_the_labels_its_sweep_alone_keeps(seed, groups):
    """Labels with many ties (few distinct kept bytes, peaks and recompute): the labels kept, and
    their order, are the sweep's over every label; with one (prefetch, host) group the arrays
    drop most beaten labels first, with several the sweep sees them all."""
    rng = np.random.default_rng(seed)
    n = 3000
    kept, peak = rng.integers(0, 40, n), rng.integers(0, 40, n)
    high, low = rng.integers(0, 2, n), rng.integers(0, 30, n)
    prefetch, host = rng.integers(0, groups, n), np.zeros(n, dtype=np.int64)
    order = np.lexsort((peak, kept, low, high))
    alone = block_front._sweep(order, kept, prefetch, host, peak)
    found = block_front._undominated(kept, prefetch, host, peak, high, low)
    assert found.tolist() == alone.tolist()
    if groups == 1:
        beaten = block_front._beaten_by_earlier(kept[order], peak[order])
        assert beaten.sum() > n // 2  # the arrays do the most of it
