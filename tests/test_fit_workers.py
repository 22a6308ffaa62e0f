"""A fit's rows over worker processes (`remat.answers.fit_workers`, issue 35): the same rows as one
process gives, each row started from the row the serial fit starts it from, errors of a worker
raised in the fit."""

from __future__ import annotations

import os
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from remat import models
from remat.answers import fit_workers
from remat.answers.fit_rows import nearest_row
from remat.answers.fit_workers import default_workers, row_groups, share_out
from remat.device.gpus import allocator_limit_bytes, custom_gpu
from remat.errors import RematError

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the workers are forked (Linux)"
)


def test_a_row_joins_the_group_of_the_row_it_starts_from_and_groups_it_links_merge():
    peaks = [1000, 5000, 1005, 5040, 1010, None, 9000]
    assert nearest_row(peaks[:2], 1005) == 0 and nearest_row(peaks[:4], 1010) == 2
    assert row_groups(peaks, judged_by_allocator=True) == [[0, 2, 4], [1, 3], [5], [6]]
    # without the allocator's judgement no row starts from another
    assert row_groups(peaks, judged_by_allocator=False) == [[i] for i in range(7)]


@given(
    st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=4), min_size=1, max_size=8),
    st.integers(1, 4),
)
def test_the_groups_dealt_out_whole_every_row_once_in_order_the_load_balanced(sizes, workers):
    """Each group lands whole in one share, every row in exactly one, each share in the fit's
    order; no share is heavier than the lightest by more than the heaviest group (greedy)."""
    groups, rows = [], 0
    for weights in sizes:
        groups.append(list(range(rows, rows + len(weights))))
        rows += len(weights)
    weights = [w for ws in sizes for w in ws]
    shares = share_out(groups, weights, workers)
    assert sorted(i for s in shares for i in s) == list(range(rows))
    assert all(s == sorted(s) for s in shares) and len(shares) <= workers
    for g in groups:
        assert sum(set(g) <= set(s) for s in shares) == 1
    loads = [sum(weights[i] for i in s) for s in shares]
    heaviest = max(sum(weights[i] for i in g) for g in groups)
    if len(shares) == min(workers, len(groups)):
        assert max(loads) - min(loads) <= heaviest


def test_default_workers_from_the_environment(monkeypatch):
    monkeypatch.setenv("REMAT_WORKERS", "3")
    assert default_workers() == 3
    for bad in ("0", "two"):
        monkeypatch.setenv("REMAT_WORKERS", bad)
        with pytest.raises(RematError, match="REMAT_WORKERS"):
            default_workers()
    monkeypatch.delenv("REMAT_WORKERS")
    assert default_workers() == len(os.sched_getaffinity(0))


def _build(b, s):
    return models.build("gpt2", batch=b, seq=s, tiny=True, device="meta", block_size=4096)


@pytest.fixture(scope="module")
def gpu():
    """A GPU where every row fits at batch 2, seq 64 and the rows' largest sizes differ (full,
    Megatron's and torchtitan's selective share a peak there: rows that start from others)."""
    from remat.answers.fit_rows import judge_step
    from remat.answers.fit_steps import FitSteps

    roomy = custom_gpu(1 << 40, "h100")
    steps = FitSteps(_build, roomy, "fp32", "sgd", 1, None)
    at2 = steps.gpu_memories(2, 64, judge_step(steps, "full", 2, 64, 1 << 40)[1])[0]
    outside = roomy.capacity_bytes - allocator_limit_bytes(roomy)
    return custom_gpu(at2.reserved_bytes * 3 // 2 + outside, "h100")


def _fit(gpu, workers):
    from remat.answers.fit import fit

    return fit(
        _build, model="gpt2", gpu=gpu, precision="fp32", optimizer="sgd", batch=2, seq=64,
        max_batch=64, max_seq=2048, workers=workers,
    )  # fmt: skip


@pytest.mark.parametrize("workers", [2, 8])
def test_rows_over_several_processes_are_the_rows_of_one(gpu, monkeypatch, tmp_path, workers):
    """Every row (peaks, largest batch and sequence, allocator figures, plans), the advice and
    the number of traces equal to one process's, from the same sizes judged (each row started
    from the row the serial fit starts it from: auto, judged after the workers started, went
    where that row was); workers ran rows (with 8, more workers start than there are groups of
    rows: those without a share are stopped)."""
    from remat.answers import fit_rows

    started = []
    worker, judge = fit_workers._Worker, fit_rows.judge_step

    class Counted(worker):
        def __init__(self, task):
            started.append(task)
            super().__init__(task)

    def judged_sizes(workers):
        log = tmp_path / f"judged-{workers}"

        def logged(steps, name, batch, seq, *args, **kwargs):
            with open(log, "a") as out:  # appended to by every process
                out.write(f"{name} {batch} {seq}\n")
            return judge(steps, name, batch, seq, *args, **kwargs)

        monkeypatch.setattr(fit_rows, "judge_step", logged)
        report = _fit(gpu, workers)
        return report, sorted(log.read_text().splitlines())

    one, sizes_one = judged_sizes(1)
    monkeypatch.setattr(fit_workers, "_Worker", Counted)
    two, sizes_two = judged_sizes(workers)
    assert len(started) == min(workers, 4) - 1  # the fixed rows: store_all, full, 2 selective
    assert sizes_two == sizes_one and len(sizes_one) > 10
    assert two.rows == one.rows and two.advice == one.advice and two.traces == one.traces
    assert [r.solved.regions for r in two.rows] == [r.solved.regions for r in one.rows]
    assert len({r.max_seq for r in one.rows}) > 2 and {r.fits for r in one.rows} == {True}
    peaks = [r.peak_bytes for r in one.rows]
    assert any(nearest_row(peaks[:i], p) is not None for i, p in enumerate(peaks))


def test_an_error_in_a_worker_is_raised_by_the_fit(gpu, monkeypatch):
    """A `RematError` raised in a worker's row reaches the caller as it was; a worker that dies
    without answering is named, with the way to fit in one process."""
    parent = os.getpid()
    searched = fit_workers.searched_row

    def failing(steps, name, *args, **kwargs):
        if os.getpid() != parent:
            raise RematError(f"row {name} failed in a worker")
        return searched(steps, name, *args, **kwargs)

    monkeypatch.setattr(fit_workers, "searched_row", failing)
    with pytest.raises(RematError, match="failed in a worker"):
        _fit(gpu, workers=2)

    def dying(steps, name, *args, **kwargs):
        if os.getpid() != parent:
            os._exit(3)
        return searched(steps, name, *args, **kwargs)

    monkeypatch.setattr(fit_workers, "searched_row", dying)
    with pytest.raises(RematError, match="exit code 3.*REMAT_WORKERS=1"):
        _fit(gpu, workers=2)
