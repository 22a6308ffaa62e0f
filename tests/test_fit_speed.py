"""Shortcuts that make `fit` at 70B scale faster (issue 35): figures kept per graph, the search's
shortcut past auto's solvers judging one candidate plan at a time. Each must give what working
everything out afresh gives."""

from __future__ import annotations

import itertools

import pytest

from remat import models
from remat.answers import fit_rows
from remat.answers.fit_steps import FitSteps
from remat.device.gpus import custom_gpu
from remat.graph import Graph
from remat.planning import strategies
from remat.planning.planner import Planner
from remat.prediction import estimate as estimate_module
from remat.prediction import schedule as schedule_module


@pytest.fixture(scope="module")
def llama() -> Graph:
    from remat.tracing.trace import trace

    model, inputs = models.build("llama-2-7b", batch=2, seq=64, tiny=True, n_layers=4)
    return trace(model, *inputs)


def _afresh(graph: Graph) -> Graph:
    """The same graph with nothing kept (`Graph.memo` empty)."""
    return Graph(
        graph.ops, graph.tensors, graph.storages, graph.saved, graph.nodes, graph.modules,
        dict(graph.info),
    )  # fmt: skip


def test_param_dtypes_kept_per_graph_equal_a_fresh_reading(llama):
    kept = estimate_module.param_dtypes(llama)
    kept["spoilt"] = "float8"  # a caller's change does not reach what is kept
    again = estimate_module.param_dtypes(llama)
    assert "param_dtypes" in llama.memo
    assert again == estimate_module.param_dtypes(_afresh(llama))
    assert "spoilt" not in again and again


def test_simulations_with_the_forward_storages_kept_equal_fresh_ones(llama):
    planner = Planner(llama, "h100", "adamw")
    for regions in ((), planner.every_block("full"), planner.block_regions([[0], [1]])):
        kept = schedule_module._simulate(llama, tuple(regions), None)
        assert "forward_made" in llama.memo
        assert kept == schedule_module._simulate(_afresh(llama), tuple(regions), None)
    assert kept.held_bytes > 0


@pytest.mark.parametrize("room", ["roomy", "tight"])
def test_candidate_fits_judging_one_plan_at_a_time_answers_as_judging_all(llama, room):
    """Where a fixed plan's reserved bytes fit, the lowest-peak plan (a plan per block count and
    a MILP) is not worked out; the answer is the one judging every candidate gives, with a GPU
    where store-all fits and with one where nothing does."""
    capacity = 1 << 40 if room == "roomy" else 1 << 20
    steps = FitSteps(
        lambda b, s: models.build("llama-2-7b", batch=b, seq=s, tiny=True, n_layers=4),
        custom_gpu(capacity, "h100"), "fp32", "adamw", 1, None,
    )  # fmt: skip
    steps.traced[(2, 64)] = llama
    answer = fit_rows.candidate_fits(steps, 2, 64)
    planner = steps.planner(2, 64)
    assert (planner._lowest is None) == (room == "roomy")
    whole = any(steps.gpu_memories(2, 64, p)[0].fits for p in steps.candidates(planner))
    assert answer == whole == (room == "roomy")
    assert list(itertools.islice(steps.fixed_plans(planner), 1))


def test_rank_peaks_kept_per_planner_equal_a_fresh_sharding(llama):
    """`FitSteps.rank_peak` keeps each plan's per-rank peak by planner, regions and ranks: asked
    again (the searches return to a size), at other ranks, or of a new planner of the same
    graph, it is what `shard_step` gives afresh."""
    from remat.prediction.estimate import shard_step

    steps = FitSteps(None, custom_gpu(1 << 40, "h100"), "bf16-fsdp", "adamw", 4, None)  # type: ignore[arg-type]
    planner = Planner(llama, "h100", "adamw")
    plans = list(steps.fixed_plans(planner))
    for shard in (4, 8, 4):
        for p in plans:
            fresh = shard_step(llama, planner.simulate(p.regions), shard, "adamw", 2)
            expected = max(max(fresh.timeline), fresh.optimizer_step_bytes)
            assert steps.rank_peak(planner, p, shard) == expected
    assert len(steps.rank_peaks) == 2 * len({p.regions for p in plans})
    other = Planner(llama, "h100", "sgd")  # another optimizer's planner: its own peaks
    p = plans[0]
    fresh = shard_step(llama, other.simulate(p.regions), 4, "adamw", 2)
    assert steps.rank_peak(other, p, 4) == max(max(fresh.timeline), fresh.optimizer_step_bytes)


def test_step_lives_kept_per_graph_serve_the_walk_as_fresh_ones(llama):
    """A plan simulated, then walked by the allocator, reads the lives kept from its simulation:
    the walk's events equal those of a graph with nothing kept."""
    from remat.prediction.gpu_memory import Fsdp, step_events

    planner = Planner(llama, "h100", "adamw")
    regions = planner.block_regions([[0, 1], [2]])
    planner.simulate(regions)
    assert tuple(regions) in llama.memo["lives"][1]  # (what it reads, the kept lives)
    for fsdp in (None, Fsdp(4, 2)):
        kept = list(step_events(llama, regions, "adamw", fsdp=fsdp))
        assert kept == list(step_events(_afresh(llama), regions, "adamw", fsdp=fsdp))


def test_a_regions_replay_stop_is_what_analysing_it_alone_finds(llama):
    """`replay_stop` (a region's early stop from each op's last save, kept per graph) is the
    `stop_at` of `analyse_regions` on that region alone: for every run of blocks, every single
    forward op (most save nothing: None) and spans that cut through blocks."""
    from remat.prediction.schedule import Region, analyse_regions, replay_stop

    blocks = llama.blocks
    spans = [(a.first_op, b.last_op) for i, a in enumerate(blocks) for b in blocks[i:]]
    spans += [(op.index, op.index) for op in llama.forward_ops]
    spans += [(b.first_op + 3, b.last_op - 2) for b in blocks] + [(0, len(llama.forward_ops) - 1)]
    stops = []
    for first, last in spans:
        alone = analyse_regions(_afresh(llama), [Region(("",), first, last, random=False)])
        stops.append(replay_stop(llama, first, last))
        assert stops[-1] == alone.replays[0].stop_at, (first, last)
    assert None in stops and len(set(stops)) > len(blocks)


@pytest.mark.parametrize("name", ["param_gather_bytes", "param_blocks", "grad_blocks"])
def test_fsdp_figures_kept_per_graph_equal_a_fresh_reading(llama, name):
    """What FSDP's per-rank figures read of a graph (the bytes each parameter gathers, the block
    that owns each parameter and each gradient) is worked out once per graph: asked again, and
    after a caller changed its copy, it is what a graph with nothing kept gives."""
    read = getattr(estimate_module, name)
    kept = read(llama)
    kept[-1] = kept[next(iter(kept))]  # a caller's change does not reach what is kept
    again = read(llama)
    assert name in llama.memo
    assert again == read(_afresh(llama)) and -1 not in again
    assert len(set(again.values())) > 1  # blocks and the root; parameters of several sizes


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved-1f1b"])
def test_schedule_orders_kept_per_arguments_equal_torchs_built_afresh(schedule):
    """`pipeline_order` builds torch's order once per (schedule, stages, micro-batches, ranks)
    (the micro-batch searches ask each count for every strategy): asked again, and after a
    caller changed its copy, it is the order torch's class gives with nothing kept."""
    from remat.layouts import pipeline_schedules

    stages, ranks = (8, 4) if schedule == "interleaved-1f1b" else (4, 4)
    for microbatches in (4, 8, 12):
        kept = pipeline_schedules.pipeline_order(schedule, stages, microbatches, ranks)
        kept[0].clear()  # a caller's change does not reach what is kept
        again = pipeline_schedules.pipeline_order(schedule, stages, microbatches, ranks)
        pipeline_schedules._order.cache_clear()
        afresh = pipeline_schedules.pipeline_order(schedule, stages, microbatches, ranks)
        assert again == afresh and len(afresh) == ranks and afresh[0]
        counts = pipeline_schedules.in_flight(schedule, stages, microbatches, ranks)
        pipeline_schedules._order.cache_clear()
        assert counts == pipeline_schedules.in_flight(schedule, stages, microbatches, ranks)


def test_a_ranks_walk_is_kept_by_its_own_stages_plans_and_equals_a_fresh_one(monkeypatch):
    """`RankMemory.of` keeps each rank's walk by its own stages' regions (a rank's events read
    no other stage's plan): plans that change one stage walk again only the rank holding it,
    and every rank's memories equal a fresh `RankMemory`'s."""
    from remat.device.gpus import custom_gpu
    from remat.layouts.fit_pipeline import RankMemory
    from remat.layouts.pipeline_traced import TracedPipeline
    from remat.layouts.pipeline_walk import Sharding
    from remat.planning import strategies

    def llama(batch: int, seq: int):
        return models.build("llama-2-7b", batch=batch, seq=seq, tiny=True, n_layers=4)

    traced = TracedPipeline.of(llama, 2, 32, stages=2, microbatches=2)
    gpu = custom_gpu(1 << 40, "h100")

    def full(stage: int):
        planner = traced.planner(stage, gpu.profile, "sgd")
        return planner.solve(strategies.get("full", "eager"), planner.estimate.peak_bytes)

    walks = []
    gpu_memories = TracedPipeline.gpu_memories

    def counted(self, rank, *args, **kwargs):
        walks.append(rank)
        return gpu_memories(self, rank, *args, **kwargs)

    monkeypatch.setattr(TracedPipeline, "gpu_memories", counted)
    memory = RankMemory(gpu, "sgd", Sharding(2, 1), 4)
    answers = []
    for plans, walked in (({}, [0, 1]), ({0: full(0)}, [0]), ({0: full(0), 1: full(1)}, [1])):
        walks.clear()
        answers.append(memory.of(traced, plans))
        assert walks == walked
        assert answers[-1] == RankMemory(gpu, "sgd", Sharding(2, 1), 4).of(traced, plans)
    walks.clear()
    assert memory.of(traced, {}) == answers[0] and not walks
    assert answers[0][0] != answers[1][0] and answers[0][1] == answers[1][1]


@pytest.mark.parametrize(
    ("precision", "optimizer", "shard"),
    [("fp32", "adamw", 1), ("bf16-mixed", "adamw-8bit", 1), ("bf16-fsdp", "adamw", 4)],
)
def test_what_every_size_holds_is_below_every_plans_requested_bytes(precision, optimizer, shard):
    """`held_at_every_size` (parameters, buffers, gradients, optimizer state per rank) is a floor
    of the allocator's requested bytes under every plan: where it exceeds the limit, no plan and
    no size can fit, so `fit` may skip its searches."""
    steps = FitSteps(
        lambda b, s: models.build("llama-2-7b", batch=b, seq=s, tiny=True, n_layers=4),
        custom_gpu(1 << 40, "h100"), precision, optimizer, shard, None,
    )  # fmt: skip
    held = steps.held_at_every_size(1, 64)
    planner = steps.planner(1, 64)
    requested = [steps.gpu_memories(1, 64, p)[0].requested_bytes for p in steps.candidates(planner)]
    assert 0 < held <= min(requested)


def test_a_gpu_too_small_for_what_every_size_holds_is_answered_without_searching(monkeypatch):
    """Where parameters, gradients and optimizer state alone exceed the allocator's limit, each
    row is judged at the asked size only (one size traced) and answers what the full search
    answers."""
    from remat.answers import fit as fit_module
    from remat.device.gpus import allocator_limit_bytes

    def build(b, s):  # 400 MiB held in fp32 with AdamW: above the BLAS workspaces' 64 MiB
        return models.build(
            "llama-2-7b", batch=b, seq=s, tiny=True, n_layers=2, d_model=512, ffn_dim=1024,
            vocab_size=16384,
        )  # fmt: skip

    roomy = custom_gpu(1 << 40, "h100")
    held = FitSteps(build, roomy, "fp32", "adamw", 1, None).held_at_every_size(1, 64)
    # the allocator's limit (capacity less the CUDA context) at 90% of what is held
    gpu = custom_gpu(held * 9 // 10 + (1 << 40) - allocator_limit_bytes(roomy, 1), "h100")
    trace = FitSteps.trace

    def answer():
        traced = set()
        monkeypatch.setattr(
            FitSteps, "trace", lambda self, b, s: traced.add((b, s)) or trace(self, b, s)
        )
        report = fit_module.fit(
            build, model="llama", batch=1, seq=64, precision="fp32", gpu=gpu, optimizer="adamw",
            strategies_to_fit=("store_all", "full", "auto"),
        )  # fmt: skip
        return (
            [(r.strategy, r.peak_bytes, r.fits, r.max_batch, r.max_seq) for r in report.rows],
            {r.strategy: r.note for r in report.rows},
            traced,
        )

    rows, notes, traced = answer()
    monkeypatch.setattr(FitSteps, "held_at_every_size", lambda self, b, s: 0)
    searched_rows, _, searched_traced = answer()
    assert rows == searched_rows
    assert all(not fits and batch is None and seq is None for _, _, fits, batch, seq in rows)
    assert all("optimizer state alone" in note for note in notes.values())
    assert traced == {(1, 64)} and len(searched_traced) > 1


def test_a_search_walks_the_judging_allocator_setting_alone_as_walking_every_setting(llama):
    """The searches ask only whether a step fits, which torch's default allocator setting
    decides: `gpu_memories(judged_only=True)` walks that one, and it equals the first of every
    setting's walked afresh; asked for every setting after, the others are added to it."""
    from remat.prediction import gpu_memory
    from remat.prediction.gpu_memory import ALLOCATOR_SETTINGS

    walked = []
    simulate = gpu_memory.simulate

    def counted(events, settings):
        walked.append(settings.expandable_segments)
        return simulate(events, settings)

    steps = FitSteps(None, custom_gpu(1 << 40, "h100"), "bf16-fsdp", "adamw", 4, None)  # type: ignore[arg-type]
    steps.traced[(2, 64)] = llama
    plans = list(steps.fixed_plans(steps.planner(2, 64)))
    afresh = [
        gpu_memory.gpu_memories(llama, steps.gpu, p.regions, "adamw", steps.fsdp()) for p in plans
    ]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gpu_memory, "simulate", counted)
        for p, every in zip(plans, afresh, strict=True):
            judged = steps.gpu_memories(2, 64, p, judged_only=True)
            assert judged == every[:1] and steps.gpu_memories(2, 64, p) == every
            assert steps.gpu_memories(2, 64, p, judged_only=True) == judged
    assert len(afresh[0]) == len(ALLOCATOR_SETTINGS) == 2
    assert walked == [False, True] * len({p.regions for p in plans})
    assert len({m.reserved_bytes for p in plans for m in steps.gpu_memories(2, 64, p)}) > 1


def test_rows_searched_from_an_earlier_rows_answer_find_the_largest_sizes_that_fit():
    """Where the allocator judges, a row starts its searches at the largest sizes of an earlier
    row of nearly the same peak (auto's plan is often a fixed strategy's), and searches on the
    allocator's judgement alone: each row answers what it answers alone, and what it answers
    when the earlier row's sizes are wrong; at its largest sequence its step fits, one more
    step of the sequence does not."""
    from dataclasses import replace

    from remat.answers.fit import _usable, fit
    from remat.answers.fit_rows import SEQ_STEP, fit_row, judge_step
    from remat.device.gpus import allocator_limit_bytes

    def build(b, s):
        return models.build("gpt2", batch=b, seq=s, tiny=True, device="meta", block_size=4096)

    def fresh(gpu):
        return FitSteps(build, gpu, "fp32", "sgd", 1, None)

    roomy = custom_gpu(1 << 40, "h100")
    at2 = fresh(roomy).gpu_memories(
        2, 64, fit_rows.judge_step(fresh(roomy), "full", 2, 64, 1 << 40)[1]
    )[0]
    outside = roomy.capacity_bytes - allocator_limit_bytes(roomy)
    # every row fits at batch 2, seq 64; full, Megatron's and torchtitan's selective have one
    # peak there and different largest sizes
    gpu = custom_gpu(at2.reserved_bytes * 3 // 2 + outside, "h100")
    asked = {"batch": 2, "seq": 64, "max_batch": 64, "max_seq": 2048}
    report = fit(build, model="gpt2", gpu=gpu, precision="fp32", optimizer="sgd", **asked)
    usable = _usable(gpu, 1, None)
    started = 0
    for row in report.rows:
        alone = fit_row(fresh(gpu), row.strategy, 2, 64, usable, 64, 2048)
        wrong = replace(
            row, max_batch=(row.max_batch or 0) + 7, max_seq=(row.max_seq or 0) * 2 + 64
        )
        misled = fit_row(fresh(gpu), row.strategy, 2, 64, usable, 64, 2048, earlier=[wrong])
        for other in (alone, misled):
            assert (other.max_batch, other.max_seq) == (row.max_batch, row.max_seq), row.strategy
        started += any(
            abs(r.peak_bytes - row.peak_bytes) <= row.peak_bytes // 100
            for r in report.rows
            if r is not row
        )
        if row.max_seq and row.max_seq < 2048:
            steps = fresh(gpu)
            for seq, fits in ((row.max_seq, True), (row.max_seq + SEQ_STEP, False)):
                found = judge_step(steps, row.strategy, 2, seq, usable)
                assert found is not None and fit_rows.fits_on(found[0], found[2], found[3]) is fits
    assert started and {r.fits for r in report.rows} == {True}
    assert len({r.max_batch for r in report.rows}) > 2


def test_the_search_between_two_guesses_finds_the_largest_fitting_size_from_any_pair():
    """`_largest` with a size `above` the answer expected not to fit (where the allocator's
    searches expect the live bytes to fill its limit) answers what it answers without it, from
    any guess and any `above`, wrong ones included; with a guess below the answer and an
    `above` over it, in a bisection between them."""
    from hypothesis import given
    from hypothesis import strategies as st

    from remat.answers.fit_rows import _largest

    @given(
        st.integers(1, 500),
        st.integers(0, 500),
        st.integers(-10, 1000),
        st.none() | st.integers(-10, 1000),
    )
    def check(high, answer, guess, above):
        calls = []

        def fits(n):
            calls.append(n)
            return n <= answer

        found = _largest(fits, guess, 1, high, above)
        assert found == (min(answer, high) if answer >= 1 else None)
        if found is not None and found < high:
            assert found in calls and found + 1 in calls  # confirmed both ways
        assert len(calls) <= 4 * (high.bit_length() + 2)
        if above is not None and 1 <= guess <= answer < above <= high:
            assert len(calls) <= 2 + (above - guess).bit_length()

    check()


def test_a_row_that_fits_no_more_samples_is_answered_without_the_batch_line():
    """A row that fits at the asked batch is judged at one more sample first (the batch line's
    first anchor): where that does not fit, the answer is the asked batch, as the search along
    the line answers, and the line's second anchor is never traced. At 256 tokens batches 2 and 3
    reserve different segments (at 64 both fit one 68 MiB reservation)."""
    from remat.answers.fit import _usable
    from remat.answers.fit_rows import fit_row, fits_on, judge_step
    from remat.device.gpus import allocator_limit_bytes

    def build(b, s):
        return models.build("gpt2", batch=b, seq=s, tiny=True, device="meta")

    roomy = custom_gpu(1 << 40, "h100")
    reserved = {}
    for b in (2, 3):
        steps = FitSteps(build, roomy, "fp32", "sgd", 1, None)
        reserved[b] = steps.gpu_memories(b, 256, judge_step(steps, "full", b, 256, 1 << 40)[1])[0]
    outside = roomy.capacity_bytes - allocator_limit_bytes(roomy)
    gpu = custom_gpu(
        (reserved[2].reserved_bytes + reserved[3].reserved_bytes) // 2 + outside, "h100"
    )
    usable = _usable(gpu, 1, None)
    steps = FitSteps(build, gpu, "fp32", "sgd", 1, None)
    row = fit_row(steps, "full", 2, 256, usable, 64, 1024)
    assert row.fits and row.max_batch == 2 and (3, 256) in steps.traced
    assert (4, 256) not in steps.traced and ("batch", 256) not in steps.models
    for b, fits in ((2, True), (3, False)):  # judged afresh
        found = judge_step(FitSteps(build, gpu, "fp32", "sgd", 1, None), "full", b, 256, usable)
        assert fits_on(found[0], found[2], found[3]) is fits


def test_a_confirmed_size_keeps_the_planner_of_its_model_and_answers_as_its_trace():
    """`FitSteps.confirm` traces the size an answer rests on; where the size model's graph
    equals the trace to the number, the planner judged on the model stays (with its plans and
    walks) and `traced` keeps its graph: every plan's peak and walk there are what a planner on
    the trace alone gives."""

    def build(b, s):
        return models.build("gpt2", batch=b, seq=s, tiny=True, device="meta")

    gpu = custom_gpu(1 << 40, "h100")
    steps = FitSteps(build, gpu, "fp32", "sgd", 1, None)
    steps.model_through("seq", 2, [64, 128, 192])
    modelled = steps.planner(2, 320)
    assert (2, 320) not in steps.traced
    plans = list(steps.fixed_plans(modelled))
    walks = [steps.gpu_memories(2, 320, p) for p in plans]
    assert steps.confirm("seq", 2, 320)
    assert steps.planner(2, 320) is modelled and steps.traced[(2, 320)] is modelled.graph
    alone = FitSteps(build, gpu, "fp32", "sgd", 1, None)
    traced = alone.planner(2, 320)
    assert traced.graph is not modelled.graph and (2, 320) in alone.traced
    for p, walked in zip(plans, walks, strict=True):
        again = traced.solve(
            strategies.get(p.strategy.split(" ")[0], "eager"), traced.estimate.peak_bytes
        )
        assert again.regions == p.regions
        assert alone.gpu_memories(2, 320, again) == walked == steps.gpu_memories(2, 320, p)
        assert alone.rank_peak(traced, again) == steps.rank_peak(modelled, p)

    # a model that does not hold there (drawn here as another length's step): its planner
    # goes, the trace judges
    wrong = steps.planners[(2, 384)] = steps.planner(2, 448)
    assert not steps.confirm("seq", 2, 384)
    assert steps.planner(2, 384).graph is steps.traced[(2, 384)] is not wrong.graph


def test_rows_out_of_memory_at_the_asked_size_find_the_largest_sizes_that_fit():
    """A row whose asked step runs out of memory shows no overhead to guess from: its searches
    start halfway to where its live bytes fill the allocator's limit, and still answer the
    largest sizes whose steps fit (judged afresh on traces), one more not."""
    from remat.answers.fit import _usable, fit
    from remat.answers.fit_rows import SEQ_STEP, fits_on, judge_step
    from remat.device.gpus import allocator_limit_bytes

    def build(b, s):
        return models.build("gpt2", batch=b, seq=s, tiny=True, device="meta", block_size=4096)

    roomy = custom_gpu(1 << 40, "h100")
    steps = FitSteps(build, roomy, "fp32", "sgd", 1, None)
    at2 = steps.gpu_memories(2, 64, judge_step(steps, "full", 2, 64, 1 << 40)[1])[0]
    outside = roomy.capacity_bytes - allocator_limit_bytes(roomy)
    gpu = custom_gpu(at2.reserved_bytes * 3 // 2 + outside, "h100")
    asked = {"batch": 2, "seq": 2048, "max_batch": 64, "max_seq": 4096}
    report = fit(build, model="gpt2", gpu=gpu, precision="fp32", optimizer="sgd", **asked)
    usable = _usable(gpu, 1, None)

    def fits(strategy: str, b: int, s: int) -> bool:
        found = judge_step(FitSteps(build, gpu, "fp32", "sgd", 1, None), strategy, b, s, usable)
        return found is not None and fits_on(found[0], found[2], found[3])

    assert all(r.gpu_memory[0]["out_of_memory"] for r in report.rows)
    for row in report.rows[:4]:  # the fixed strategies (auto: test_fit.py's rule)
        assert row.max_seq and fits(row.strategy, 2, row.max_seq), row.strategy
        assert not fits(row.strategy, 2, row.max_seq + SEQ_STEP), row.strategy
        if row.max_batch:
            assert fits(row.strategy, row.max_batch, 2048)
            assert not fits(row.strategy, row.max_batch + 1, 2048)
    assert len({r.max_seq for r in report.rows}) > 2
