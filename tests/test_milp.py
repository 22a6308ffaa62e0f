"""The block MILP: it finds the least recompute that fits (checked against enumeration), every plan
it returns fits exactly, and it says how sure it is when the time limit cuts it short."""

from __future__ import annotations

import math
from contextlib import contextmanager

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from oracles import blocks_brute_force
from scipy import optimize

from remat.errors import InfeasibleBudget
from remat.planning.solvers import block_front
from remat.planning.solvers import milp as milp_module
from remat.planning.solvers.milp import (
    BlockOption,
    BlockProblem,
    block_peak_bytes,
    block_recompute_seconds,
    milp,
    min_peak,
)

GB = 10**9
SOLVERS = ("front", "highs")


@contextmanager
def solved_by(solver: str):
    """Answer with the exact front, or with HiGHS alone (the front gives up at once)."""
    saved = block_front.MAX_LABELS
    milp_module._fronts.clear()
    if solver == "highs":
        block_front.MAX_LABELS = 0
    try:
        yield
    finally:
        block_front.MAX_LABELS = saved
        milp_module._fronts.clear()


@contextmanager
def counting_highs_runs():
    """The number of HiGHS runs made inside, as a one-element list."""
    runs = [0]
    solve = optimize.milp

    def counted(*args, **kwargs):
        runs[0] += 1
        return solve(*args, **kwargs)

    optimize.milp = counted
    try:
        yield runs
    finally:
        optimize.milp = solve


# -- helpers --------------------------------------------------------------------------------------
SECONDS = st.floats(0, 1)


@st.composite
def problems(draw, seconds=SECONDS) -> BlockProblem:
    """1..8 blocks of 1..4 options, bytes in 0..10_000 with backward >= kept."""
    blocks = []
    for b in range(draw(st.integers(1, 8))):
        options = []
        for k in range(draw(st.integers(1, 4))):
            kept = draw(st.integers(0, 10_000))
            backward = draw(st.integers(kept, 10_000))
            options.append(BlockOption(f"b{b}o{k}", kept, backward, draw(seconds)))
        blocks.append(tuple(options))
    return BlockProblem(
        tuple(blocks),
        fixed_bytes=draw(st.integers(0, 10_000)),
        forward_extra_bytes=draw(st.integers(0, 10_000)),
    )


def lowest_peak(problem: BlockProblem) -> int:
    """The least peak over all choices, by enumeration."""
    with pytest.raises(InfeasibleBudget) as info:
        blocks_brute_force(problem, -1)
    return info.value.min_feasible_bytes


def highest_peak(problem: BlockProblem) -> int:
    """The largest peak over all choices: each peak expression is a sum of per-block terms, so
    its maximum takes every block's largest term, and the peak's maximum is the largest of those."""
    kept = [max(option.kept_bytes for option in block) for block in problem.options]
    backward = [max(option.backward_bytes for option in block) for block in problem.options]
    rows = [sum(kept) + problem.forward_extra_bytes]
    rows += [sum(kept[:b]) + backward[b] for b in range(len(kept))]
    return problem.fixed_bytes + max(rows)


def same_seconds(a: float, b: float, problem: BlockProblem) -> bool:
    """Equal up to 1e-9 relative. The absolute part, 1e-9 of the costliest option, only matters for
    subnormal-sized seconds, which the solver (costs scaled to the costliest) cannot tell from 0."""
    largest = max(option.recompute_seconds for block in problem.options for option in block)
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9 * largest)


def random_problem(rng: np.random.Generator, blocks: int, options: int) -> BlockProblem:
    """Blocks of GB-scale options with independent random bytes and seconds."""
    made = []
    for _ in range(blocks):
        kept = rng.integers(0, GB, options)
        backward = kept + rng.integers(0, GB, options)
        seconds = rng.uniform(0, 1, options)
        made.append(
            tuple(
                BlockOption(f"o{k}", int(kept[k]), int(backward[k]), float(seconds[k]))
                for k in range(options)
            )
        )
    return BlockProblem(tuple(made), fixed_bytes=10 * GB, forward_extra_bytes=GB // 10)


def near_identical_blocks(blocks: int = 128) -> BlockProblem:
    """Transformer-like blocks (store, full, two selective policies) whose kept bytes and seconds
    carry measurement noise: a subset-sum in disguise, on which HiGHS keeps a gap for a long time."""
    rng = np.random.default_rng(0)
    saved, block_input, grads = 800_000_000, 50_000_000, 200_000_000
    backward = saved + grads + block_input
    base = [
        ("store", saved, saved + grads, 0.0),
        ("full", block_input, backward, 0.01),
        ("selective:a", 300_000_000, backward, 0.004),
        ("selective:b", 500_000_000, backward, 0.002),
    ]
    return BlockProblem(
        tuple(
            tuple(
                BlockOption(
                    name, kept + int(rng.integers(0, 1000)), live, s * (1 + rng.uniform(0, 1e-3))
                )
                for name, kept, live, s in base
            )
            for _ in range(blocks)
        )
    )


# -- the model ------------------------------------------------------------------------------------
def test_block_peak_bytes_is_the_worst_of_forward_and_each_backward():
    store = BlockOption("store", 10, 15, 0.0)
    full = BlockOption("full", 2, 17, 1.5)
    problem = BlockProblem(((store, full),) * 3, fixed_bytes=100, forward_extra_bytes=4)
    # kept 10, 2, 10: forward 100 + 22 + 4 = 126; backward of block 2: 100 + 12 + 15 = 127
    assert block_peak_bytes(problem, (0, 1, 0)) == 127
    # kept 2, 2, 2: forward 100 + 6 + 4 = 110; backward of block 2: 100 + 4 + 17 = 121
    assert block_peak_bytes(problem, (1, 1, 1)) == 121
    # kept 10, 10, 10: forward 100 + 30 + 4 = 134; backward of block 2: 100 + 20 + 15 = 135
    assert block_peak_bytes(problem, (0, 0, 0)) == 135
    assert block_recompute_seconds(problem, (1, 0, 1)) == 3.0


def test_invalid_inputs_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="kept_bytes <= backward_bytes"):
        BlockOption("store", 10, 5, 0.0)
    with pytest.raises(ValueError, match="recompute_seconds"):
        BlockOption("full", 0, 5, math.nan)
    with pytest.raises(ValueError, match="at least one block"):
        BlockProblem(())
    with pytest.raises(ValueError, match=r"blocks \[1\] have none"):
        BlockProblem(((BlockOption("store", 0, 0, 0.0),), ()))
    with pytest.raises(ValueError, match=">= 0"):
        BlockProblem(((BlockOption("store", 0, 0, 0.0),),), fixed_bytes=-1)
    problem = BlockProblem(((BlockOption("store", 0, 0, 0.0),),) * 2)
    with pytest.raises(ValueError, match="one option index per block"):
        block_peak_bytes(problem, (0,))
    with pytest.raises(ValueError, match=r"blocks \[1\]"):
        block_peak_bytes(problem, (0, 1))
    two = (BlockOption("store", 0, 0, 0.0), BlockOption("full", 0, 0, 0.0))
    with pytest.raises(ValueError, match="at most"):
        blocks_brute_force(BlockProblem((two,) * 21), 0)


# -- optimality -----------------------------------------------------------------------------------
@pytest.mark.parametrize("solver", SOLVERS)
@settings(max_examples=250, deadline=None)
@given(problem=problems(), data=st.data())
def test_milp_matches_enumeration(solver, problem, data):
    low, high = lowest_peak(problem), highest_peak(problem)
    budget = data.draw(st.integers(low - (high - low) // 10 - 1, high), label="budget")
    if budget < low:
        with solved_by(solver), pytest.raises(InfeasibleBudget) as info:
            milp(problem, budget)
        assert info.value.min_feasible_bytes == low
        assert info.value.budget_bytes == budget
        assert f"({budget} bytes)" in str(info.value) and f"({low} bytes)" in str(info.value)
        return
    expected = blocks_brute_force(problem, budget)
    with solved_by(solver):
        result = milp(problem, budget)
    assert same_seconds(result.recompute_seconds, expected.recompute_seconds, problem)
    assert result.peak_bytes == block_peak_bytes(problem, result.choice) <= budget
    assert result.recompute_seconds == block_recompute_seconds(problem, result.choice)
    assert result.option_names == tuple(
        block[k].name for block, k in zip(problem.options, result.choice, strict=True)
    )
    assert (result.status, result.mip_gap) == ("optimal", 0.0)
    # the time it names is the recompute's, not the step's (the demo read "46 ms a step")
    assert "of recompute a step (not the step's time)" in result.reason


@pytest.mark.parametrize("solver", SOLVERS)
@settings(max_examples=100, deadline=None)
@given(
    problem=problems(seconds=st.integers(0, 4).map(lambda quarters: quarters / 4)), data=st.data()
)
def test_equal_recompute_ties_go_to_the_lower_peak(solver, problem, data):
    """Quarter seconds add exactly, so ties are real and the peak must match enumeration's."""
    budget = data.draw(st.integers(lowest_peak(problem), highest_peak(problem)), label="budget")
    with solved_by(solver):
        expected, result = blocks_brute_force(problem, budget), milp(problem, budget)
    assert (result.recompute_seconds, result.peak_bytes) == (
        expected.recompute_seconds,
        expected.peak_bytes,
    )


@pytest.mark.parametrize("solver", SOLVERS)
@settings(max_examples=50, deadline=None)
@given(problem=problems())
def test_min_peak_is_the_least_peak_of_any_choice(solver, problem):
    with solved_by(solver):
        assert min_peak(problem) == lowest_peak(problem)


def test_plans_fit_and_recompute_never_decreases_as_the_budget_shrinks():
    problem = random_problem(np.random.default_rng(30), blocks=30, options=4)
    low, high = min_peak(problem), highest_peak(problem)
    seconds = []
    for budget in np.linspace(high, low, 20).round().astype(int):
        result = milp(problem, int(budget))
        assert result.peak_bytes == block_peak_bytes(problem, result.choice) <= budget
        assert result.status == "optimal"
        seconds.append(result.recompute_seconds)
    assert all(b >= a * (1 - 1e-9) for a, b in zip(seconds, seconds[1:], strict=False))
    assert seconds[-1] > seconds[0]
    with pytest.raises(InfeasibleBudget) as info:
        milp(problem, low - 1)
    assert info.value.min_feasible_bytes == low


@pytest.mark.parametrize("solver", SOLVERS)
def test_a_plan_over_budget_by_solver_rounding_is_cut_off_and_resolved(solver):
    """1 byte over a 1e12-byte budget is within HiGHS's feasibility tolerance, so HiGHS picks the
    free option first; the exact check rejects it and the re-solve takes the one that fits."""
    problem = BlockProblem(
        ((BlockOption("store", 10**12, 10**12, 0.0), BlockOption("full", 0, 1, 1.0)),)
    )
    with solved_by(solver):
        result = milp(problem, 10**12 - 1)
    assert result.option_names == ("full",)
    assert result.peak_bytes == 1


# -- status, gap and time -------------------------------------------------------------------------
def test_a_time_limited_hard_instance_reports_its_gap_and_still_fits():
    problem = near_identical_blocks()
    low, high = min_peak(problem), block_peak_bytes(problem, (0,) * 128)
    budget = int(low + 0.7 * (high - low))
    result = milp(problem, budget, time_limit_s=1.0, node_limit=10**9)
    assert result.status == "time_limit"
    assert 0 < result.mip_gap < 0.1
    assert result.peak_bytes == block_peak_bytes(problem, result.choice) <= budget
    assert "time limit" in result.reason


@pytest.mark.slow
def test_a_node_limit_not_the_clock_ends_a_hard_instance_so_its_answer_is_always_the_same():
    """The front gives up on noisy near-identical blocks (a subset-sum); HiGHS then stops at its
    node limit, which makes the answer a function of the problem: the same plan and gap again."""
    problem = near_identical_blocks()
    assert block_front.front(problem) is None
    low, high = min_peak(problem), block_peak_bytes(problem, (0,) * 128)
    budget = int(low + 0.7 * (high - low))
    first = milp(problem, budget, node_limit=5)
    milp_module._solved.clear()
    again = milp(problem, budget, node_limit=5)
    assert first == again
    assert first.status == "node_limit" and 0 < first.mip_gap < 0.1
    assert first.peak_bytes == block_peak_bytes(problem, first.choice) <= budget
    assert "limit of 5 branch-and-bound nodes" in first.reason


#: One Llama 3.1 8B block at seq 8192 on an H100 (bf16-mixed): store, full and three selective
#: policies, as `Planner.block_problem` measured them (kept, backward bytes, recompute seconds).
LLAMA_BLOCK = (
    BlockOption("store", 2517696536, 31513919520, 0.0),
    BlockOption("full", 134217728, 31513919520, 0.005788054758273669),
    BlockOption("selective:megatron", 2449539072, 31648137248, 0.0024001099471842808),
    BlockOption("selective:save-matmuls", 907018264, 31581028384, 0.002035929638208955),
    BlockOption("selective:torchtitan", 588251160, 31581028384, 0.003356121810083576),
)


def test_repeated_blocks_are_solved_exactly_without_highs_or_the_clock():
    """Seven identical gigabyte blocks: HiGHS's row tolerance let over-budget arrangements of one
    mix through, one exact re-check and HiGHS run per arrangement (9-26 runs a budget on 8B), and
    its wall-clock limit made the answer depend on load. The front answers every budget exactly,
    with no HiGHS run, and without looking at the clock."""
    problem = BlockProblem((LLAMA_BLOCK,) * 7, fixed_bytes=40 * GB, forward_extra_bytes=23 * GB)
    low, high = lowest_peak(problem), highest_peak(problem)
    with counting_highs_runs() as runs:
        for budget in np.linspace(low, high, 6).round().astype(int):
            result = milp(problem, int(budget), time_limit_s=0.0)
            expected = blocks_brute_force(problem, int(budget))
            assert (result.recompute_seconds, result.peak_bytes) == (
                expected.recompute_seconds,
                expected.peak_bytes,
            )
            assert (result.status, result.mip_gap) == ("optimal", 0.0)
        assert min_peak(problem) == low
    assert runs[0] == 0


def test_seconds_too_far_apart_to_add_exactly_are_left_to_highs():
    """A subnormal option beside a 1 s one needs over a thousand bits to add exactly: the front
    declines (rather than round), and HiGHS's answer still matches enumeration's."""
    block = (
        BlockOption("store", 100, 200, 0.0),
        BlockOption("full", 10, 200, 1.0),
        BlockOption("tiny", 50, 200, 5e-324),
    )
    problem = BlockProblem((block,) * 3, forward_extra_bytes=20)
    assert block_front.front(problem) is None
    for budget in (230, 320, 400):
        expected, result = blocks_brute_force(problem, budget), milp(problem, budget)
        assert same_seconds(result.recompute_seconds, expected.recompute_seconds, problem)
        assert result.peak_bytes <= budget


def test_no_plan_in_time_falls_back_to_the_lowest_peak_or_raises():
    problem = near_identical_blocks()
    low = min_peak(problem)
    result = milp(problem, low + GB, time_limit_s=0.0)
    assert (result.status, result.mip_gap) == ("time_limit", math.inf)
    assert result.peak_bytes == low
    with pytest.raises(InfeasibleBudget) as info:
        milp(problem, low - 1, time_limit_s=0.0)
    assert info.value.min_feasible_bytes == low


def test_128_blocks_of_4_options_solve_to_optimality():
    # its speed (under 5 s) is a target in benchmarks/solver_speed.py, not a test
    problem = random_problem(np.random.default_rng(128), blocks=128, options=4)
    low, high = min_peak(problem), highest_peak(problem)
    budget = (low + high) // 2
    result = milp(problem, budget)
    assert result.status == "optimal"
    assert result.peak_bytes <= budget
