"""`remat fit`: the largest batch and sequence that fit are exact (fits at the answer, not one
past it), confirmed by real CPU steps; the advice follows from the rows."""

from __future__ import annotations

import pytest

import remat
from remat import models
from remat.answers.fit import fit
from remat.answers.fit_rows import SEQ_STEP


def _build(batch: int, seq: int, device: str = "meta"):
    return models.build("gpt2", batch=batch, seq=seq, tiny=True, device=device)


def _store_all_peak(batch: int, seq: int, optimizer: str | None) -> int:
    model, inputs = _build(batch, seq)
    graph = remat.trace(model, *inputs, target=_gpu(1 << 40).target)  # fit traces for the GPU
    return remat.estimate(graph, optimizer=optimizer).peak_bytes


@pytest.fixture(scope="module")
def capacity_for_batch_3() -> int:
    """A GPU whose usable memory sits between store-all's peak at batch 3 and at batch 4."""
    at3, at4 = _store_all_peak(3, 64, "sgd"), _store_all_peak(4, 64, "sgd")
    return (at3 + at4) // 2


def _gpu(capacity: int):
    from remat.device.gpus import custom_gpu

    return custom_gpu(capacity, "h100")


def _fit(capacity: int, **asked):
    """`fit` of tiny GPT-2 (fp32 parameters) at batch 1, seq 64, fp32 and SGD on a GPU of
    `capacity` bytes, all usable, unless `asked` says otherwise."""
    setup = {"batch": 1, "seq": 64, "precision": "fp32", "optimizer": "sgd", "reserve": 0}
    return fit(_build, model="gpt2", gpu=_gpu(capacity), **{**setup, **asked})


def test_the_largest_batch_is_exact_and_confirmed_by_real_steps(capacity_for_batch_3):
    report = _fit(capacity_for_batch_3, strategies_to_fit=("store_all", "full", "auto"))
    rows = {r.strategy: r for r in report.rows}
    assert report.usable_bytes == capacity_for_batch_3
    assert rows["store_all"].max_batch == 3
    assert rows["full"].max_batch >= 3 and rows["auto"].max_batch >= rows["full"].max_batch
    # measured: the answer's step fits the capacity, one more does not
    for batch, fits in ((3, True), (4, False)):
        model, inputs = _build(batch, 64, device="cpu")
        measured = remat.measure(model, *inputs, optimizer="sgd")
        assert (measured.peak_bytes <= capacity_for_batch_3) is fits, (batch, measured.peak_bytes)
    assert "store-all fits" in report.advice[0]


def test_the_largest_sequence_is_a_confirmed_multiple_of_the_step(capacity_for_batch_3):
    report = _fit(capacity_for_batch_3, strategies_to_fit=("store_all",))
    (row,) = report.rows
    assert row.max_seq % SEQ_STEP == 0
    assert _store_all_peak(1, row.max_seq, "sgd") <= capacity_for_batch_3
    assert _store_all_peak(1, row.max_seq + SEQ_STEP, "sgd") > capacity_for_batch_3


def test_nothing_fits_says_what_would(capacity_for_batch_3):
    report = _fit(capacity_for_batch_3, batch=16, strategies_to_fit=("store_all", "full", "auto"))
    assert not any(r.fits for r in report.rows)
    text = " ".join(report.advice)
    assert "nothing fits" in text and "accumulation" in text and "--shard" in text


def test_mixed_precision_traces_under_autocast():
    peaks = {}
    for precision in ("fp32", "bf16-mixed"):
        # batch 8: activations decide the peak (at batch 1 the tied embedding's two fp32
        # gradients do, in both precisions alike)
        report = _fit(
            1 << 30,
            batch=8,
            precision=precision,
            optimizer="adamw",
            strategies_to_fit=("store_all",),
        )
        assert report.rows[0].fits and report.rows[0].max_batch > 1
        peaks[precision] = report.rows[0].peak_bytes
    assert peaks["bf16-mixed"] != peaks["fp32"]  # bf16 activations, and the weights' bf16 copies


def test_the_search_finds_the_largest_fitting_size_from_any_guess():
    from hypothesis import given
    from hypothesis import strategies as st

    from remat.answers.fit_rows import _largest

    @given(st.integers(1, 500), st.integers(0, 500), st.integers(-10, 1000))
    def check(high, answer, guess):
        calls = []

        def fits(n):
            calls.append(n)
            return n <= answer

        found = _largest(fits, guess, 1, high)
        expected = min(answer, high) if answer >= 1 else None
        assert found == expected
        if found is not None and found < high:
            assert found in calls and found + 1 in calls  # confirmed both ways
        assert len(calls) <= 4 * (high.bit_length() + 2)

    check()


def test_sharding_lowers_the_per_rank_peak_and_the_advice_names_the_ranks():
    peaks = {}
    for shard in (1, 4):
        report = _fit(
            1 << 30, optimizer="adamw", shard=shard, strategies_to_fit=("store_all", "auto")
        )
        peaks[shard] = {r.strategy: r.peak_bytes for r in report.rows}
    assert peaks[4]["store_all"] < peaks[1]["store_all"]
    assert peaks[4]["auto"] <= peaks[1]["auto"]
    tight = (peaks[1]["auto"] + peaks[4]["auto"]) // 2  # fits sharded, not on one device
    report = _fit(tight, optimizer="adamw", strategies_to_fit=("store_all", "auto"))
    assert not any(r.fits for r in report.rows)
    ranks = report.extra["ranks_to_fit"]
    assert ranks in (2, 4) and f"--shard {ranks}" in " ".join(report.advice)


def test_a_size_model_that_does_not_hold_falls_back_to_traces():
    """The zoo Llama's rotary table is max(seq, 128) long, so the parabola through 64, 128 and 192
    tokens is wrong further out: the trace at the answer shows it, and the answer comes from
    traces."""

    def build(batch: int, seq: int):
        return models.build("llama-3.2-1b", batch=batch, seq=seq, tiny=True, device="meta")

    def peak(seq: int) -> int:
        model, inputs = build(1, seq)
        graph = remat.trace(model, *inputs, target=_gpu(1 << 40).target)
        return remat.estimate(graph, optimizer="sgd").peak_bytes

    capacity = (peak(1024) + peak(1088)) // 2
    setup = {"batch": 1, "seq": 64, "precision": "fp32", "optimizer": "sgd", "reserve": 0}
    report = fit(
        build, model="llama", gpu=_gpu(capacity), strategies_to_fit=("store_all",), **setup
    )
    assert report.rows[0].max_seq == 1024


def test_the_search_traces_a_few_steps_not_every_candidate(capacity_for_batch_3):
    report = _fit(capacity_for_batch_3, strategies_to_fit=("store_all", "full"))
    # the asked step, two batch and three sequence anchors, and one trace per distinct answer
    answers = {r.max_batch for r in report.rows} | {r.max_seq for r in report.rows}
    assert report.traces <= 1 + 2 + 3 + len(answers)


def test_fsdp2_mixed_precision_needs_ranks_and_drops_autocasts_weight_copies():
    def build(batch: int, seq: int):
        return models.build("gpt2", batch=batch, seq=seq, tiny=True, device="meta", dtype="bf16")

    setup = {"batch": 2, "seq": 64, "optimizer": "adamw", "reserve": 0}
    setup["strategies_to_fit"] = ("store_all",)
    with pytest.raises(remat.RematError, match="--shard"):
        fit(build, model="gpt2", gpu=_gpu(1 << 30), precision="bf16-fsdp", **setup)
    peaks = {
        precision: fit(
            build if precision == "bf16-fsdp" else _build,
            model="gpt2",
            gpu=_gpu(1 << 30),
            precision=precision,
            shard=4,
            **setup,
        )
        .rows[0]
        .peak_bytes
        for precision in ("bf16-mixed", "bf16-fsdp")
    }
    # same fp32 shards; bf16 gathered units instead of fp32 ones plus autocast's bf16 copies
    assert peaks["bf16-fsdp"] < peaks["bf16-mixed"]


def test_advice_names_fsdp2_mixed_precision_when_no_rank_count_fits_autocast():
    from remat.answers.fit import FitReport, FitRow, advice

    row = FitRow("full", 200 << 30, False, 0.25, None, None, plan="full")
    common = {"model": "m", "batch": 1, "seq": 8192, "gpu": "h100-80gb", "profile": "h100"}
    sizes = {"capacity_bytes": 80 << 30, "reserve_bytes": 5 << 30, "usable_bytes": 75 << 30}
    for precision, shard, named in (("bf16-mixed", 8, True), ("bf16-mixed", 1, False)):
        report = FitReport(
            **common,
            **sizes,
            precision=precision,
            optimizer="adamw",
            shard=shard,
            rows=(row,),
            advice=(),
        )
        assert ("--precision bf16-fsdp" in " ".join(advice(report))) is named


def test_rows_are_judged_by_the_caching_allocators_reserved_bytes():
    """Without --reserve, a row fits when the simulated allocator's reserved bytes stay within its
    limit (total_memory less what sits outside the allocator): a GPU with exactly that room fits,
    one whose allocator cannot even hold the live bytes does not; the JSON row carries them."""
    from remat.device.gpus import allocator_limit_bytes
    from remat.prediction.gpu_memory import gpu_memory

    big = _gpu(1 << 40)
    outside = big.capacity_bytes - allocator_limit_bytes(big)
    model, inputs = _build(2, 64)
    graph = remat.trace(model, *inputs, target=big.target)
    memory = gpu_memory(graph, big, optimizer="sgd")
    asked = {"batch": 2, "seq": 64, "precision": "fp32", "optimizer": "sgd"}
    for capacity, fits in (
        (memory.reserved_bytes + outside, True),
        (memory.requested_bytes + outside - 1, False),
    ):
        report = fit(
            _build, model="gpt2", gpu=_gpu(capacity), strategies_to_fit=("store_all",), **asked
        )
        (row,) = report.to_dict()["rows"]
        assert row["fits"] is fits
        if fits:  # (an out-of-memory simulation stops at the request it cannot serve)
            assert row["requested_bytes"] == memory.requested_bytes
            assert row["reserved_bytes"] == memory.reserved_bytes
            assert row["requested_bytes"] <= row["allocated_bytes"] <= row["reserved_bytes"]
        assert "expandable_segments:False" in report.allocator


def _agrees(row, batch: int, seq: int) -> bool:
    """A row's verdict and its maxima agree: a row that fits names at least what was asked, one
    that does not names less (or nothing)."""
    if row.fits:
        return row.max_batch >= batch and row.max_seq >= seq
    return (row.max_batch or 0) < batch and (row.max_seq or 0) < seq


def test_fits_and_the_largest_batch_and_sequence_are_judged_by_one_rule():
    """Where the allocator is simulated, `fits`, `max batch` and `max seq` are all its judgement:
    on a GPU where batch 2's reserved bytes do not fit but its live bytes would, no row says "no"
    next to a maximum of 2 or more (store-all, Megatron's and torchtitan's selective did: the
    maxima were searched on live bytes); the step at each maximum fits the allocator, one more
    does not."""
    from remat.device.gpus import allocator_limit_bytes
    from remat.planning import strategies
    from remat.planning.planner import Planner
    from remat.prediction.gpu_memory import gpu_memory

    big = _gpu(1 << 40)
    outside = big.capacity_bytes - allocator_limit_bytes(big)

    def memory(gpu, strategy: str, batch: int, seq: int):
        model, inputs = _build(batch, seq)
        planner = Planner(remat.trace(model, *inputs, target=big.target), gpu.profile, "sgd")
        p = planner.solve(strategies.get(strategy, "eager"), planner.estimate.peak_bytes)
        return gpu_memory(planner.graph, gpu, p.regions, "sgd")

    at2 = memory(big, "store_all", 2, 64)
    gpu = _gpu(at2.requested_bytes + outside + (at2.reserved_bytes - at2.requested_bytes) // 6)
    asked = {"batch": 2, "seq": 64, "precision": "fp32", "optimizer": "sgd"}
    report = fit(_build, model="gpt2", gpu=gpu, max_batch=64, max_seq=1024, **asked)
    assert {r.fits for r in report.rows} == {True, False}
    for row in report.rows:
        assert _agrees(row, 2, 64), (row.strategy, row.fits, row.max_batch, row.max_seq)
        if row.strategy == "auto" or not row.max_batch:
            continue
        assert memory(gpu, row.strategy, row.max_batch, 64).fits, row.strategy
        assert not memory(gpu, row.strategy, row.max_batch + 1, 64).fits, row.strategy


@pytest.mark.slow
def test_fits_and_maxima_agree_for_llama_3_2_1b_on_an_rtx_4090():
    """The case a user met: Llama 3.2 1B at seq 2048 on an RTX 4090 said `selective:megatron ...
    no ... max batch 1, max seq 2048` and `selective:torchtitan ... no ... max batch 2`."""
    from remat.device.gpus import get_gpu

    def build(batch: int, seq: int):
        return models.build("llama-3.2-1b", batch=batch, seq=seq, dtype="fp32", device="meta")

    report = fit(
        build, model="llama-3.2-1b", batch=1, seq=2048, gpu=get_gpu("rtx4090"),
        strategies_to_fit=("selective:megatron", "selective:torchtitan"),
    )  # fmt: skip
    for row in report.rows:
        assert _agrees(row, 1, 2048), (row.strategy, row.fits, row.max_batch, row.max_seq)


def test_when_nothing_fits_the_advice_ends_with_a_command_that_fits(capsys):
    """`fit` searches precision, optimizer and ranks for a setup that fits at the least cost and
    prints it as one command; run as printed, that command answers "fits"."""
    import json
    import shlex

    from remat.answers.cli import main

    asked = ["fit", "--model", "gpt2", "--tiny", "--batch", "4", "--seq", "256"]
    asked += ["--precision", "bf16-mixed", "--optimizer", "adamw"]
    assert main([*asked, "--capacity", "80GiB", "--json"]) == 0
    roomy = json.loads(capsys.readouterr().out)
    lowest = min(r["reserved_bytes"] for r in roomy["rows"])
    limit = roomy["rows"][0]["gpu_memory"][0]["limit_bytes"]
    capacity = roomy["capacity_bytes"] - (limit - (lowest - 4 * 2**20))  # 4 MiB short

    assert main([*asked, "--capacity", f"{capacity}B"]) == 0
    out = capsys.readouterr().out
    assert "nothing fits" in out
    run = next(line for line in out.splitlines() if line.startswith("run: "))
    command = shlex.split(run.removeprefix("run: "))
    assert command[:2] == ["remat", "fit"] and f"{capacity}B" in command
    assert main([*command[1:], "--json"]) == 0
    advised = json.loads(capsys.readouterr().out)
    assert any(r["fits"] for r in advised["rows"])
    assert (advised["precision"], advised["optimizer"]) != ("bf16-mixed", "adamw")


def _llama(batch: int, seq: int):
    return models.build("llama-2-7b", batch=batch, seq=seq, tiny=True, n_layers=4)


def test_a_tensor_parallel_fit_is_the_traced_ranks_step():
    """`fit(layout=Layout(tp=2))`'s per-rank peak is the peak of the rank's own trace (its shards
    and collectives, `Layout.trace`), and below the one-rank step's."""
    from remat.layouts.parallel import Layout

    gpu = _gpu(1 << 40)
    asked = {"batch": 2, "seq": 64, "precision": "fp32", "optimizer": None, "reserve": 0}
    peaks = {}
    for tp in (1, 2):
        report = fit(
            _llama, model="llama", gpu=gpu, layout=Layout(tp=tp), **asked,
            strategies_to_fit=("store_all",),
        )  # fmt: skip
        peaks[tp] = report.rows[0].peak_bytes
        graph = Layout(tp=tp).trace(_llama, 2, 64, target=gpu.target)
        assert peaks[tp] == remat.estimate(graph).peak_bytes
    assert peaks[2] < peaks[1]
    assert report.layout == "tp 2 + sp (torchtitan's plan of Llama)"
    report = fit(
        _llama, model="llama", gpu=gpu, layout=Layout(tp=2, sequence_parallel=False), **asked,
        strategies_to_fit=("store_all",),
    )  # fmt: skip
    assert report.layout == "tp 2 (torchtitan's plan of Llama)"  # --no-sp
    assert report.rows[0].peak_bytes != peaks[2]


def test_a_pipeline_fit_names_the_tightest_stage_and_plans_each_stage():
    """`fit(layout=Layout(pp=2, microbatches=4))`: every row is its tightest rank's peak (the
    highest of its stages'), the table per stage holds each rank's peak, and auto's plan fits
    every rank where store-all does not."""
    from remat.layouts.fit_pipeline import pipeline_rows
    from remat.layouts.parallel import Layout
    from remat.layouts.pipeline import Sharding, TracedPipeline

    layout = Layout(pp=2, microbatches=4)
    gpu = _gpu(1 << 40)
    traced = TracedPipeline.of(
        _llama, 2 * 4, 64, stages=2, microbatches=4, schedule="1f1b", target=gpu.target
    )
    store_all = traced.report(optimizer="sgd", sharding=Sharding())
    usable = store_all.peak_bytes * 9 // 10
    answer = pipeline_rows(
        _llama, layout=layout, gpu=gpu, autocast=None, master_scale=1, optimizer="sgd",
        shard=1, microbatch=2, seq=64, usable=usable, strategies_to_fit=("store_all", "auto"),
        progress=None, simulate_allocator=False,
    )  # fmt: skip
    by_name = {r["strategy"]: r for r in answer.rows}
    assert by_name["store_all"]["peak_bytes"] == store_all.peak_bytes
    assert not by_name["store_all"]["fits"]
    assert by_name["auto"]["fits"] and by_name["auto"]["peak_bytes"] <= usable
    auto = answer.stages["auto"]
    assert auto.peak_bytes == max(s.peak_bytes for s in auto.stages)
    assert f"rank {auto.tightest_rank}" in by_name["auto"]["note"]
    assert all(s.in_flight == 2 - s.stage for s in auto.stages)  # 1F1B: p - i in flight


def test_a_pipeline_fit_is_judged_by_each_ranks_caching_allocator():
    """`fit --pp` runs each rank's walk through the caching allocator (`remat.layouts.pipeline.
    rank_events`): on a GPU whose allocator limit is exactly store-all's requested bytes on its
    tightest rank, store-all's live bytes fit but its blocks do not (rounding, fragmentation), so
    it does not fit; auto plans again within what the allocator leaves and fits by its reserved
    bytes; the per-stage table gives each rank's reserved bytes."""
    from remat.device.gpus import custom_gpu, fixed_memory
    from remat.layouts.parallel import Layout
    from remat.layouts.pipeline import TracedPipeline

    big = _gpu(1 << 40)
    traced = TracedPipeline.of(
        _llama, 4 * 4, 128, stages=2, microbatches=4, schedule="1f1b", target=big.target
    )
    memories = [traced.gpu_memories(r, big, optimizer="sgd")[0] for r in (0, 1)]
    requested = max(m.requested_bytes for m in memories)
    assert all(m.allocated_bytes >= m.requested_bytes for m in memories)
    assert all(m.reserved_bytes >= m.allocated_bytes for m in memories)
    gpu = custom_gpu(fixed_memory(big, 2).outside_allocator_bytes + requested, "h100")
    report = fit(
        _llama, model="llama", batch=4 * 4, seq=128, gpu=gpu, precision="fp32", optimizer="sgd",
        layout=Layout(pp=2, microbatches=4), strategies_to_fit=("store_all", "auto"),
    )  # fmt: skip
    store_all, auto = report.rows
    assert store_all.peak_bytes <= report.usable_bytes  # live bytes fit ...
    assert not store_all.fits and store_all.gpu_memory[0]["out_of_memory"]  # ... blocks do not
    assert auto.fits and auto.peak_bytes < store_all.peak_bytes
    assert auto.reserved_bytes <= auto.gpu_memory[0]["limit_bytes"]
    assert "caching allocator" in report.allocator
    assert all("rank reserved" in row for row in report.extra["stages"]["auto"])


def test_a_pipeline_fits_batch_is_the_steps_as_pipeline_predict_takes_it():
    """`fit(batch=8, layout=Layout(pp=2, microbatches=4))` is the step of
    `remat.layouts.pipeline.predict(build, 8, ...)`: 4 micro-batches of 2 (before issue 39 it
    was 4 micro-batches of 8, where predict's batch 8 is 4 of 2); a batch that does not split
    is refused."""
    from remat.errors import RematError
    from remat.layouts.parallel import Layout
    from remat.layouts.pipeline import TracedPipeline

    gpu = _gpu(1 << 40)
    asked = {"model": "llama", "seq": 64, "gpu": gpu, "precision": "fp32", "optimizer": "sgd"}
    layout = Layout(pp=2, microbatches=4)
    report = fit(
        _llama, batch=8, layout=layout, reserve=0, strategies_to_fit=("store_all",), **asked
    )
    assert report.extra["microbatch"] == 2 and report.batch == 8
    # predict(_llama, 8, 64, stages=2, microbatches=4), on the GPU's kernels as fit traces
    traced = TracedPipeline.of(_llama, 8, 64, stages=2, microbatches=4, target=gpu.target)
    assert traced.microbatch_size == 2
    assert report.rows[0].peak_bytes == traced.report(optimizer="sgd").peak_bytes
    with pytest.raises(RematError, match="batch 6 does not split into 4"):
        fit(_llama, batch=6, layout=layout, **asked)


def test_the_tightest_rank_is_the_one_judged_and_ties_go_to_the_higher_live_peak():
    """Two ranks of equal reserved bytes (70 MiB each, the allocator's 2 MiB blocks) whose live
    peaks differ: the tightest is the one of the higher live peak, the row's column (it was
    rank 0, the first of the tie, under a live peak of 5.1 vs 5.54 MiB); one that does not fit
    comes first."""
    from types import SimpleNamespace

    from remat.layouts.fit_pipeline import RankMemory
    from remat.layouts.pipeline_walk import Sharding

    memory = RankMemory(_gpu(1 << 40), None, Sharding(), 2)
    report = SimpleNamespace(rank_peak_bytes=(5_100_000, 5_540_000), tightest_rank=1)
    rank = lambda fits, reserved: [SimpleNamespace(fits=fits, reserved_bytes=reserved)]  # noqa: E731
    assert memory.tightest_rank([rank(True, 70 << 20), rank(True, 70 << 20)], report) == 1
    assert memory.tightest_rank([rank(True, 72 << 20), rank(True, 70 << 20)], report) == 0
    assert memory.tightest_rank([rank(False, 60 << 20), rank(True, 70 << 20)], report) == 0
    assert memory.tightest_rank([], report) == report.tightest_rank


def test_a_pipeline_that_fits_nowhere_names_a_layout_that_fits():
    """GPipe holds every micro-batch on every stage; where no plan fits that, the advice finds
    the layout that does (1F1B on the same ranks, fewer micro-batches in flight) and its plan
    fits every rank there."""
    from remat.layouts.fit_pipeline import layout_that_fits
    from remat.layouts.parallel import Layout
    from remat.layouts.pipeline import TracedPipeline

    gpu = _gpu(1 << 40)
    traced = TracedPipeline.of(_llama, 2 * 4, 64, stages=2, microbatches=4, schedule="1f1b")
    usable = traced.report(optimizer="sgd").peak_bytes  # store-all fits 1F1B: 2 and 1 in flight
    gpipe = TracedPipeline.of(_llama, 2 * 4, 64, stages=2, microbatches=4, schedule="gpipe")
    assert gpipe.report(optimizer="sgd").peak_bytes > usable
    found = layout_that_fits(
        _llama, layout=Layout(pp=2, microbatches=4, schedule="gpipe"), gpu=gpu, autocast=None,
        master_scale=1, optimizer="sgd", shard=1, microbatch=2, seq=64, usable=usable, progress=None,
    )  # fmt: skip
    assert found["schedule"] == "1f1b" and (found["tp"], found["pp"]) == (1, 2)
    assert found["peak_bytes"] <= usable


@pytest.mark.slow
def test_the_json_carries_the_advice_its_apply_line_and_the_command(capsys):
    """`fit --json` has the advice as fields: `advice`, the row it applies (`advised`, a row of the
    table), the `apply` line with its budget in units and what that budget is made of, and `run`
    (the command that fits, None when the asked setup does). The apply line, run as printed, makes
    a plan within its budget; under --shard the budget says what sharding adds to a rank's."""
    import json
    import re

    from remat.answers.cli import main
    from remat.units import parse_bytes

    asked = ["fit", "--model", "gpt2", "--tiny", "--batch", "4", "--seq", "256"]
    asked += ["--precision", "bf16-mixed", "--optimizer", "adamw", "--reserve", "0"]
    assert main([*asked, "--capacity", "80GiB", "--json"]) == 0
    roomy = json.loads(capsys.readouterr().out)
    assert roomy["advised"] is None and roomy["apply"] is None and roomy["run"] is None
    peaks = {r["strategy"]: r["peak_bytes"] for r in roomy["rows"]}
    capacity = (peaks["store_all"] + peaks["full"]) // 2  # store-all does not fit, full does

    assert main([*asked, "--capacity", f"{capacity}B", "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    rows = {r["strategy"]: r for r in answer["rows"]}
    assert not rows["store_all"]["fits"]
    advised = answer["advised"]
    assert advised["strategy"] in rows and rows[advised["strategy"]]["fits"]
    assert answer["apply"] == rows[advised["strategy"]]["apply"]
    assert answer["apply"] in answer["advice"][0] and answer["run"] is None
    budget = re.search(r'budget="([0-9.]+[GM]iB)"', answer["apply"]).group(1)
    assert f"# the live bytes the step may reach on h100-80gb@{capacity}B" in answer["apply"]
    model, inputs = models.build("gpt2", batch=4, seq=256, tiny=True)
    plan = eval(answer["apply"], {"remat": remat, "model": model, "inputs": inputs})
    assert plan.predicted_peak_bytes <= parse_bytes(budget)

    assert main([*asked, "--capacity", f"{capacity}B", "--shard", "4", "--json"]) == 0
    sharded = json.loads(capsys.readouterr().out)
    made = re.search(
        r'budget="([0-9.]+[GM]iB)".*# the whole model\'s step: (.+) a rank \+ (.+) of '
        r"parameters, gradients and optimizer state that sharding over 4 ranks takes off each",
        sharded["apply"] or sharded["rows"][-1]["apply"],
    )
    assert made, sharded["rows"][-1]["apply"]


def test_the_largest_sequence_stops_at_the_models_positions_and_says_how_to_build_more():
    """GPT-2's 1024 learned positions end the sequence search on a GPU with room for more; the
    row says that limit and the lever, not the build error's advice to ask for less."""
    report = _fit(1 << 40, seq=1024, strategies_to_fit=("store_all",))
    (row,) = report.rows
    assert row.max_seq == 1024
    assert "max seq: 1024, the longest the model is built for (more: --set block_size=N)" in (
        row.note
    )
    with pytest.raises(remat.SequenceLimitError) as raised:
        _build(1, 1024 + SEQ_STEP)
    assert raised.value.limit == 1024
