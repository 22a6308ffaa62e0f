"""The chain checkpointing solvers: the DP against the textbook recursion and exhaustive search
(tests/oracles.py), the textbook schedules against the sqrt(n) articles' table, and the budget
contract (fits, monotone, exact infeasibility).

Everything here is pure arithmetic over a model chain; no torch.
"""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from oracles import chain_brute_force, textbook_chain_dp

from remat.errors import InfeasibleBudget
from remat.planning.solvers.chain import (
    Chain,
    ChainBlock,
    ChainSchedule,
    chain_dp,
    chain_peak_bytes,
    chain_recompute_seconds,
    full,
    min_feasible_bytes,
    sqrt,
    store_all,
    store_none,
)

MiB = 2**20


def same_seconds(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)


ROUND_SECONDS = [0.0, 0.25, 0.5, 1.0]
# Times: arbitrary floats (tiny ones, under ~2^-21 of the chain's total, make the DP add float64
# rather than integer units), or round values, which make many schedules tie exactly on recompute.
seconds = st.one_of(st.floats(0.0, 1.0, allow_nan=False), st.sampled_from(ROUND_SECONDS))


@st.composite
def chains(draw: st.DrawFn, max_blocks: int = 12, round_seconds: bool = False) -> Chain:
    n = draw(st.integers(1, max_blocks))
    time_values = st.sampled_from(ROUND_SECONDS) if round_seconds else seconds
    blocks = tuple(
        ChainBlock(
            f"b{i}",
            draw(time_values),
            draw(st.integers(0, 1000)),
            draw(st.integers(0, 4000)),
        )
        for i in range(n)
    )
    transients = st.integers(0, 2000)
    return Chain(blocks, draw(st.integers(0, 500)), draw(transients), draw(transients))


def random_schedule(draw: st.DrawFn, n: int) -> ChainSchedule:
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=n - 1))) if n > 1 else []
    bounds = [0, *cuts, n]
    return ChainSchedule(tuple((a, b, draw(st.booleans())) for a, b in itertools.pairwise(bounds)))


def distinct_chain(n: int, seed: int) -> Chain:
    """A transformer-ish chain whose blocks all differ in time and size."""
    rng = random.Random(seed)
    blocks = tuple(
        ChainBlock(
            f"block{i}",
            rng.uniform(1e-3, 1e-2),
            rng.randint(1 * MiB, 8 * MiB),
            rng.randint(8 * MiB, 40 * MiB),
        )
        for i in range(n)
    )
    return Chain(blocks, 1000 * MiB, 10 * MiB, 20 * MiB)


def uniform_chain(n: int) -> Chain:
    """n equal blocks; one block's saved tensors of gradients in flight, no fixed bytes, so the
    peaks are activation memory as in the articles."""
    block = ChainBlock("block", 1e-3, MiB, 4 * MiB)
    return Chain((block,) * n, 0, 0, 4 * MiB)


def test_chain_peak_bytes_counts_a_hand_worked_schedule() -> None:
    # Blocks (input, saved): (10, 100), (20, 200), (30, 300), (40, 400); fixed 1000.
    chain = Chain(
        tuple(ChainBlock(f"b{i}", 0.1 * (i + 1), 10 * (i + 1), 100 * (i + 1)) for i in range(4)),
        fixed_bytes=1000,
        forward_transient_bytes=7,
        backward_transient_bytes=5,
    )
    # [0,2) checkpointed keeps 10; [2,3) stored keeps 300; [3,4) checkpointed keeps 40.
    schedule = ChainSchedule(((0, 2, True), (2, 3, False), (3, 4, True)))
    forward = 1000 + (10 + 300 + 40) + 7
    last = 1000 + (10 + 300) + (40 + 400) + 5
    stored = 1000 + 10 + 300 + 5
    first = 1000 + 0 + (10 + 100 + 200) + 5
    assert chain_peak_bytes(chain, schedule) == max(forward, last, stored, first) == 1755
    assert chain_recompute_seconds(chain, schedule) == math.fsum([0.1, 0.2, 0.4])
    with pytest.raises(ValueError, match="covers blocks 0..3"):
        chain_peak_bytes(chain, ChainSchedule(((0, 3, False),)))


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_splitting_a_stored_segment_changes_neither_peak_nor_recompute(data: st.DataObject) -> None:
    """What lets the DP and chain_brute_force treat a run of stored segments as one segment."""
    chain = data.draw(chains())
    n = len(chain.blocks)
    schedule = random_schedule(data.draw, n)
    merged: list[tuple[int, int, bool]] = []
    for start, stop, checkpointed in schedule.segments:
        if merged and not checkpointed and not merged[-1][2]:
            merged[-1] = (merged[-1][0], stop, False)
        else:
            merged.append((start, stop, checkpointed))
    merged_schedule = ChainSchedule(tuple(merged))
    assert chain_peak_bytes(chain, schedule) == chain_peak_bytes(chain, merged_schedule)
    assert chain_recompute_seconds(chain, schedule) == chain_recompute_seconds(
        chain, merged_schedule
    )


@settings(max_examples=250, deadline=None)
@given(st.data())
def test_chain_dp_matches_exhaustive_search(data: st.DataObject) -> None:
    chain = data.draw(chains())
    budget = data.draw(st.integers(min_feasible_bytes(chain), store_all(chain).peak_bytes))
    dp, exhaustive = chain_dp(chain, budget), chain_brute_force(chain, budget)
    assert same_seconds(dp.recompute_seconds, exhaustive.recompute_seconds)
    assert dp.peak_bytes == chain_peak_bytes(chain, dp.schedule) <= budget
    assert exhaustive.peak_bytes == chain_peak_bytes(chain, exhaustive.schedule) <= budget
    assert dp.recompute_seconds == chain_recompute_seconds(chain, dp.schedule)


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_chain_dp_breaks_recompute_ties_by_lower_peak(data: st.DataObject) -> None:
    # Round times: exact in both solvers, so the optimal (recompute, peak) pair is unique.
    chain = data.draw(chains(max_blocks=9, round_seconds=True))
    budget = data.draw(st.integers(min_feasible_bytes(chain), store_all(chain).peak_bytes))
    dp, exhaustive = chain_dp(chain, budget), chain_brute_force(chain, budget)
    assert (dp.recompute_seconds, dp.peak_bytes) == (
        exhaustive.recompute_seconds,
        exhaustive.peak_bytes,
    )


def test_chain_dp_matches_exhaustive_search_when_times_span_many_magnitudes() -> None:
    # 2**-80 next to 1.0: the exact integer sum needs more than 62 bits, so the DP adds float64.
    rng = random.Random(7)
    for _ in range(20):
        blocks = tuple(
            ChainBlock(
                f"b{i}",
                rng.choice([1.0, 3.0, 2**-80, 0.1]),
                rng.randint(0, 50),
                rng.randint(0, 200),
            )
            for i in range(9)
        )
        chain = Chain(blocks, 10, 5, 5)
        budget = rng.randint(min_feasible_bytes(chain), store_all(chain).peak_bytes)
        assert same_seconds(
            chain_dp(chain, budget).recompute_seconds,
            chain_brute_force(chain, budget).recompute_seconds,
        )


def _assert_matches_the_textbook_recursion(chain: Chain, budget: int) -> None:
    """Same least recompute as `textbook_chain_dp`, both plans within the budget, and the same
    verdict when nothing fits."""
    reference = textbook_chain_dp(chain, budget)
    if reference is None:
        with pytest.raises(InfeasibleBudget):
            chain_dp(chain, budget)
        return
    dp = chain_dp(chain, budget)
    assert same_seconds(dp.recompute_seconds, chain_recompute_seconds(chain, reference))
    assert dp.peak_bytes == chain_peak_bytes(chain, dp.schedule) <= budget
    assert chain_peak_bytes(chain, reference) <= budget


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_chain_dp_matches_the_textbook_recursion(data: st.DataObject) -> None:
    chain = data.draw(chains())
    low, high = min_feasible_bytes(chain), store_all(chain).peak_bytes
    _assert_matches_the_textbook_recursion(chain, data.draw(st.integers(low - 100, high)))


@pytest.mark.parametrize("seed", range(3))
def test_chain_dp_matches_the_textbook_recursion_past_exhaustive_sizes(seed: int) -> None:
    # 24 blocks (2 * 3^23 schedules): bytes kept small so the recursion's memo stays small.
    rng = random.Random(seed)
    blocks = tuple(
        ChainBlock(f"b{i}", rng.uniform(0.0, 1.0), rng.randint(0, 8), rng.randint(0, 40))
        for i in range(24)
    )
    chain = Chain(blocks, 100, rng.randint(0, 20), rng.randint(0, 20))
    low, high = min_feasible_bytes(chain), store_all(chain).peak_bytes
    for budget in np.linspace(low, high, 6).round().astype(int).tolist():
        _assert_matches_the_textbook_recursion(chain, budget)


def test_uniform_chains_reproduce_the_sqrt_articles_table() -> None:
    sizes = [16, 64, 256]
    chains_by_size = [uniform_chain(n) for n in sizes]

    def exponent(values: list[float]) -> float:
        return float(np.polyfit(np.log(sizes), np.log(values), 1)[0])

    memory_rich = exponent([store_all(c).peak_bytes for c in chains_by_size])
    memory_poor = exponent([store_none(c).recompute_seconds for c in chains_by_size])
    checkpointed = exponent([sqrt(c).peak_bytes for c in chains_by_size])
    assert memory_rich == pytest.approx(1.0, abs=0.1)
    assert memory_poor == pytest.approx(2.0, abs=0.1)
    assert checkpointed == pytest.approx(0.5, abs=0.1)
    for chain in chains_by_size:
        one_forward = math.fsum(block.forward_seconds for block in chain.blocks)
        assert sqrt(chain).recompute_seconds == one_forward
        assert full(chain).recompute_seconds == one_forward
        assert store_all(chain).recompute_seconds == 0.0
        # Memory poor keeps the input and one block's saved tensors: flat in N.
        assert store_none(chain).peak_bytes == MiB + 4 * MiB + 4 * MiB


def test_store_none_counts_the_quadratic_rerun_by_hand() -> None:
    chain = Chain(
        (
            ChainBlock("a", 1.0, 10, 100),
            ChainBlock("b", 2.0, 20, 300),
            ChainBlock("c", 4.0, 30, 200),
        ),
        fixed_bytes=1000,
        forward_transient_bytes=7,
        backward_transient_bytes=5,
    )
    plan = store_none(chain)
    # Block k's backward re-runs blocks 0..k: a, then a b, then a b c.
    assert plan.recompute_seconds == 1.0 + (1.0 + 2.0) + (1.0 + 2.0 + 4.0)
    assert plan.peak_bytes == 1000 + 10 + 300 + 7
    assert plan.schedule is None and plan.strategy == "store_none"


def test_sqrt_cuts_regions_of_rounded_sqrt_n_blocks() -> None:
    plan = sqrt(uniform_chain(10))
    assert plan.schedule == ChainSchedule(((0, 3, True), (3, 6, True), (6, 9, True), (9, 10, True)))
    assert full(uniform_chain(3)).schedule == ChainSchedule(
        ((0, 1, True), (1, 2, True), (2, 3, True))
    )


@pytest.mark.parametrize("seed", range(3))
def test_every_plan_fits_its_budget_and_dp_recompute_grows_as_budget_shrinks(seed: int) -> None:
    chain = distinct_chain(24, seed)
    for plan in (store_all(chain), full(chain), sqrt(chain)):
        assert plan.peak_bytes == chain_peak_bytes(chain, plan.schedule)
        assert plan.recompute_seconds == chain_recompute_seconds(chain, plan.schedule)
    top, bottom = store_all(chain).peak_bytes, min_feasible_bytes(chain)
    at_top = chain_dp(chain, top)
    assert at_top.recompute_seconds == 0.0
    assert at_top.schedule == ChainSchedule(((0, 24, False),))
    previous = at_top.recompute_seconds
    for budget in np.linspace(top, bottom, 25).round().astype(int).tolist():
        plan = chain_dp(chain, budget)
        assert plan.peak_bytes == chain_peak_bytes(chain, plan.schedule) <= budget
        assert plan.recompute_seconds >= previous
        previous = plan.recompute_seconds
    assert previous > at_top.recompute_seconds  # and it did grow: the bottom budget recomputes
    assert chain_dp(chain, bottom).peak_bytes == bottom


@settings(max_examples=40, deadline=None)
@given(chains(max_blocks=8))
def test_infeasible_budget_raises_with_the_exact_min_feasible_bytes(chain: Chain) -> None:
    # At a budget nothing meets, chain_brute_force has computed every schedule's peak.
    with pytest.raises(InfeasibleBudget) as raised:
        chain_brute_force(chain, -1)
    lowest = raised.value.min_feasible_bytes
    assert lowest == min_feasible_bytes(chain)
    with pytest.raises(InfeasibleBudget) as raised:
        chain_dp(chain, lowest - 1)
    assert raised.value.budget_bytes == lowest - 1
    assert raised.value.min_feasible_bytes == lowest
    assert str(lowest - 1) in str(raised.value) and str(lowest) in str(raised.value)
    assert chain_dp(chain, lowest).peak_bytes == lowest


def test_chain_dp_fits_128_distinct_blocks_at_every_budget() -> None:
    # its speed (under 2 s a solve) is a target in benchmarks/solver_speed.py, not a test
    chain = distinct_chain(128, seed=0)
    bottom, top = min_feasible_bytes(chain), store_all(chain).peak_bytes
    for fraction in (0.1, 0.25, 0.5, 0.9):
        budget = int(bottom + fraction * (top - bottom))
        assert chain_dp(chain, budget).peak_bytes <= budget
