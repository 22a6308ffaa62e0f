"""`remat.answers.bench`: interleaved timing rounds, the spread and noise flag of each row, the table that
shows them, and `remat.measuring.measure.time_steps`."""

from __future__ import annotations

import io
from contextlib import contextmanager
from dataclasses import replace

import pytest
import torch
from rich.console import Console

from remat import Planner, models, trace
from remat.answers.bench import BenchRow, bench, bench_compiled, interleaved_rounds, progress_total
from remat.answers.report import bench_table
from remat.errors import RematError
from remat.measuring.measure import time_steps

MIB = 2**20
LONG_NOTE = (
    "strategy selective:torchtitan predicts a peak of 2.3 GiB, over the budget of 1.1 GiB: the "
    "smallest budget it fits is 2.2 GiB (strategy auto picks among all); "
    "compiled with inductor, predicted recompute 0.12 ms, held 123456 B; " * 2
)[:300]


def measured(name, mib, predicted, ms, ratio, noise, diff=0.0) -> BenchRow:
    """A measured row: held and peak `mib` (MiB), step times `ms` = (median, min, max)."""
    return BenchRow(
        strategy=name,
        held_bytes=int(mib[0] * MIB),
        peak_bytes=int(mib[1] * MIB),
        predicted_peak_bytes=int(predicted * MIB) if predicted else None,
        step_seconds=ms[0] / 1e3,
        step_seconds_min=ms[1] / 1e3,
        step_seconds_max=ms[2] / 1e3,
        time_ratio=ratio,
        within_noise=noise,
        grad_max_abs_diff=diff,
        note=LONG_NOTE,
    )


def table_rows() -> list[BenchRow]:
    """Measured rows with a 300-character note each, wide numbers and long names, and two rows
    without a measurement."""
    assert len(LONG_NOTE) == 300
    return [
        measured("store_all", (12345, 23456), 23400, (123.4, 120.1, 130.2), 1.0, True),
        measured("full", (1234, 2345), 2340, (152.34, 140.1, 160.3), 1.2345, False),
        measured(
            "torch:checkpoint_sequential", (1234, 2345), None, (9.34, 9.1, 10.1), 0.9, True, 1.5e-7
        ),
        measured(
            "torch.compile@0.5", (1234, 2345), 2340, (1152.3, 1140.1, 12160.3), 12.3456, False
        ),
        BenchRow("hf:gradient_checkpointing", note="not a Hugging Face model"),
        BenchRow("selective:torchtitan", predicted_peak_bytes=5 * MIB, note=LONG_NOTE),
    ]


def render(console: Console, rows: list[BenchRow]) -> str:
    console.print(bench_table(rows, title="gpt2 b2 s32 float32 on cpu, budget 50%"))
    return console.file.getvalue()


@pytest.mark.parametrize(
    "console",
    [
        Console(file=io.StringIO(), width=80, force_terminal=True, color_system=None),
        Console(file=io.StringIO(), width=100, force_terminal=True, color_system=None),
        Console(file=io.StringIO()),  # piped: not a terminal
    ],
    ids=["80-columns", "100-columns", "not-a-terminal"],
)
def test_table_keeps_every_number_whole_beside_long_notes(console):
    rows = table_rows()
    text = render(console, rows)
    lines = text.splitlines()
    assert max(map(len, lines)) <= console.width
    expected = {
        "store_all": ("1.00x", "123", "120-130", "12345.0", "23456.0", "23400.0"),
        "full": ("1.23x", "152", "140-160", "1234.0", "2345.0", "2340.0"),
        "torch:checkpoint_sequential": ("~0.90x", "9.34", "9.10-10.1", "1.5e-07"),
        "torch.compile@0.5": ("12.35x", "1152", "1140-12160"),
    }
    for strategy, cells in expected.items():
        # the row's first line starts with the strategy (folded or not) and holds every number
        line = next(x for x in lines if x.startswith(strategy[:8]))
        for cell in cells:
            assert f" {cell} " in f" {line} ", (strategy, cell, line)
    assert "..." not in text and "…" not in text
    # the notes are under the table, whole (folded into lines), after their rows' names
    assert "".join(text.split()).count("".join(LONG_NOTE.split())) == 5
    assert "hf:gradient_checkpointing: not a Hugging Face model" in " ".join(text.split())
    assert "~ = within noise" in text


def test_table_marks_only_rows_within_noise():
    rows = table_rows()
    text = render(Console(file=io.StringIO(), width=160), rows)
    assert "~0.90x" in text and "~1.23x" not in text and "~1.00x" not in text


def test_time_steps_returns_the_asked_number_of_positive_durations():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    x = torch.randn(4, 8)
    seconds = time_steps(model, x, steps=3)
    assert len(seconds) == 3 and all(isinstance(s, float) and s > 0 for s in seconds)
    assert len(time_steps(model, x, warmup=2)) == 1
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(RematError, match="steps >= 1"):
        time_steps(model, x, steps=0)


@pytest.fixture(scope="module")
def tiny_mlp():
    model, inputs = models.build("mlp-chain-8", batch=8, tiny=True, device="cpu")
    return model, inputs, Planner(trace(model, *inputs))


def test_bench_times_rows_in_rounds_and_reports_their_spread(tiny_mlp):
    model, inputs, planner = tiny_mlp
    names = ["full", "torch:checkpoint-per-block", "hf:gradient_checkpointing"]
    calls: list[str] = []
    rows = bench(model, inputs, planner, names, budget="1TiB", steps=3, progress=calls.append)
    by_name = {r.strategy: r for r in rows}
    assert [r.strategy for r in rows] == ["store_all", *names]
    assert calls == ["store_all", *names, "round 1/3", "round 2/3", "round 3/3"]
    assert len(calls) == progress_total(names, steps=3)

    measured = [by_name[n] for n in ("store_all", "full", "torch:checkpoint-per-block")]
    for r in measured:
        assert 0 < r.step_seconds_min <= r.step_seconds <= r.step_seconds_max, r
        assert isinstance(r.within_noise, bool)
        assert r.grad_max_abs_diff == 0.0
        assert r.time_ratio == pytest.approx(r.step_seconds / by_name["store_all"].step_seconds)
    assert by_name["store_all"].time_ratio == 1.0 and by_name["store_all"].within_noise is True
    assert by_name["full"].predicted_peak_bytes is not None
    hf = by_name["hf:gradient_checkpointing"]
    assert hf.step_seconds is None and hf.within_noise is None
    assert hf.note == "not a Hugging Face model"
    # the plans and baselines came off again: the model is store_all's
    assert not any("forward" in vars(m) for m in model.modules())


def test_bench_rows_are_json_ready(tiny_mlp):
    model, inputs, planner = tiny_mlp
    rows = bench(model, inputs, planner, ["full", "chain_dp"], budget="1%", steps=1)
    full, chain_dp = rows[1], rows[2]
    assert full.ran and "over the budget" in full.note  # a fixed strategy is a reference point
    d = chain_dp.to_dict()
    assert not chain_dp.ran and d["step_seconds"] is None and d["within_noise"] is None
    assert "chain_dp" in d["note"]
    assert set(rows[0].to_dict()) >= {
        "step_seconds",
        "step_seconds_min",
        "step_seconds_max",
        "time_ratio",
        "within_noise",
    }


def test_rounds_interleave_the_rows_each_set_up_alone():
    model = torch.nn.Linear(4, 1)
    x = torch.randn(2, 4)
    log: list[str] = []

    def setup(name: str):
        @contextmanager
        def installed():
            log.append(f"+{name}")
            yield
            log.append(f"-{name}")

        return installed

    times = interleaved_rounds(
        [(model, setup("a")), (model, setup("b")), (model, setup("c"))], (x,), 2, log.append
    )
    assert [len(t) for t in times] == [2, 2, 2]
    assert log == [
        *("round 1/2", "+a", "-a", "+b", "-b", "+c", "-c"),
        *("round 2/2", "+b", "-b", "+c", "-c", "+a", "-a"),  # each round starts one row later
    ]


def test_bench_compiled_times_every_variant_without_recompiling(tiny_mlp):
    model, inputs, _ = tiny_mlp
    calls: list[str] = []
    rows = bench_compiled(
        model,
        inputs,
        budget="1TiB",
        steps=2,
        compiler="aot_eager",
        base_seconds=0.5,
        base_range=(0.4, 0.6),
        progress=calls.append,
    )
    assert calls[-2:] == ["torch.compile round 1/2", "torch.compile round 2/2"]
    assert len(calls) == progress_total([], 2, compiled=True) - progress_total([], 2)
    for r in rows:
        assert 0 < r.step_seconds_min <= r.step_seconds <= r.step_seconds_max, r
        assert r.time_ratio == pytest.approx(r.step_seconds / 0.5)
        assert r.within_noise is False  # a tiny step is far below the made-up eager range
        assert r.grad_max_abs_diff <= 1e-6 and "recompiled" not in r.note, r
        assert r.grad_vs_compiled_rel_diff <= 1e-6  # op by op: the same gradients as torch's
    assert rows[0].strategy == "torch.compile@1" and rows[0].grad_vs_compiled_rel_diff == 0.0


def test_bench_needs_a_timing_round(tiny_mlp):
    model, inputs, planner = tiny_mlp
    with pytest.raises(RematError, match="at least one timing round"):
        bench(model, inputs, planner, [], steps=0)


def test_gradient_differences_are_given_relative_to_the_gradients_scale():
    from remat.answers.bench import _max_diff

    reference = {"w": torch.tensor([1e4, -2e4]), "b": torch.tensor([3.0])}
    compiled = {"w": torch.tensor([1e4 + 0.8, -2e4]), "b": torch.tensor([3.0])}
    diff, rel = _max_diff(compiled, reference)
    assert diff == pytest.approx(0.8, rel=1e-3) and rel == pytest.approx(0.8 / 2e4, rel=1e-3)
    assert _max_diff(reference, reference) == (0.0, 0.0)


def test_one_slow_round_of_store_all_does_not_put_every_row_within_noise():
    """Min-max overlap called 1.5x "within noise" when store_all had one slow round; the middle
    halves of the rounds do not."""
    from remat.answers.bench import _timed_row, quartile_range

    base = [0.100] * 8 + [0.500]
    row = _timed_row(BenchRow("full"), [0.150] * 9, 0.100, quartile_range(base))
    assert row.within_noise is False and not row.noisy
    close = _timed_row(BenchRow("auto"), [0.101, 0.099] * 4 + [0.100], 0.100, quartile_range(base))
    assert close.within_noise is True


def test_a_row_whose_rounds_disagree_is_marked_noisy_with_advice_to_rerun():
    from remat.answers.bench import _timed_row, quartile_range

    rounds = [0.247, 0.251, 2.042, 0.260, 0.255]  # a busy machine, as the first `remat demo`
    row = _timed_row(replace(table_rows()[1], note=""), rounds, 0.2, quartile_range([0.2] * 5))
    assert row.noisy and row.rounds == tuple(rounds)
    text = _render(bench_table([table_rows()[0], row], title="t"), width=200)
    assert "!" in text and "noisy" in text and "re-run" in text
    # several noisy rows: the advice once, naming each (bench --compile repeated it 14 times)
    other = replace(row, strategy="full")
    text = _render(bench_table([table_rows()[0], row, other], title="t"), width=200)
    assert text.count("re-run") == 1
    assert f"{row.strategy} (" in text and "full (" in text


def test_gradient_column_is_relative_and_every_row_over_the_budget_is_named():
    compiled = replace(table_rows()[3], grad_max_abs_diff=0.44, grad_max_rel_diff=7.6e-6, note="")
    rows = [table_rows()[0], replace(table_rows()[1], note=""), compiled]
    text = _render(bench_table(rows, title="t", budget_bytes=3000 * MIB), width=200)
    assert "7.6e-06" in text and "4.4e-01" not in text
    assert "over the budget" in text
    named = text.split("over the budget", 1)[1].split("\n")[0]
    assert "store_all" in named and "torch.compile@0.5" not in named  # 2345 MiB < 3000 MiB


def _render(table, width: int) -> str:
    console = Console(file=io.StringIO(), width=width)
    console.print(table)
    return console.file.getvalue()


def test_no_series_of_the_bench_plot_has_the_budget_lines_colour():
    from matplotlib.colors import to_rgb

    from remat.answers.plots import _COLORS, _MARKERS

    assert to_rgb("crimson") not in [to_rgb(c) for c in _COLORS]
    assert to_rgb("C3") not in [to_rgb(c) for c in _COLORS]  # tab10's red, next to crimson
    styles = {(_COLORS[k % len(_COLORS)], _MARKERS[k % len(_MARKERS)]) for k in range(24)}
    assert len(styles) == 24  # every row of a bench keeps its own marker and colour


@pytest.mark.parametrize("stop_at", ["memory", "rounds"])
def test_an_interrupted_bench_prints_the_rows_it_measured_and_one_line(
    stop_at, monkeypatch, capsys
):
    """Ctrl-C during `remat bench` printed nothing of the rows it had finished: now the table of
    those rows (with the times of the rounds that completed), then one line, exit 130."""
    import remat.answers.bench as bench_module
    from remat.answers.cli import main

    calls = {"measure": 0, "time": 0}
    measure, time = bench_module.measure, bench_module.time_steps

    def measured(*args, **kwargs):
        calls["measure"] += 1
        if stop_at == "memory" and calls["measure"] == 2:
            raise KeyboardInterrupt
        return measure(*args, **kwargs)

    def timed(*args, **kwargs):
        calls["time"] += 1
        if calls["time"] == 3:  # two rows: the second round's first step
            raise KeyboardInterrupt
        return time(*args, **kwargs)

    monkeypatch.setattr(bench_module, "measure", measured)
    monkeypatch.setattr(bench_module, "time_steps", timed)
    argv = ["bench", "--model", "gpt2", "--tiny", "--batch", "1", "--seq", "32"]
    assert main([*argv, "--strategies", "store_all,full", "--steps", "3"]) == 130
    said = capsys.readouterr()
    assert (
        said.err.strip().splitlines()[-1] == "interrupted: remat bench stopped before it finished"
    )
    assert "Traceback" not in said.err
    lines = said.out.splitlines()
    assert any("interrupted" in line for line in lines)
    store_all = next(line for line in lines if line.startswith("store_all"))
    if stop_at == "memory":  # the first row's memory, no time
        assert not any(line.startswith("full") for line in lines)
        assert "0 of 3 timing rounds" in said.out
    else:  # both rows, timed by the one round that completed
        assert any(line.startswith("full") for line in lines)
        assert "1 of 3 timing rounds" in said.out
        assert "1.00x" in store_all


def test_the_auto_row_is_what_auto_leaves_after_its_first_steps_and_tuned_is_not_repeated():
    """The auto row runs remat.auto's first-steps tuning (its note names what it timed); the
    auto:tuned row, the same plan then, is not shown twice."""
    from remat.applying.tune import _CACHE

    _CACHE.clear()
    model, inputs = models.build("gpt2", tiny=True, device="cpu", batch=2, seq=64, n_layer=3)
    planner = Planner(trace(model, *inputs))
    rows = bench(model, inputs, planner, ["auto", "auto:tuned"], budget="70%", steps=1)
    assert [r.strategy for r in rows] == ["store_all", "auto"]
    auto = rows[1]
    assert auto.ran and "tuned)" in auto.note and "timed on the first steps" in auto.note
    assert not any("forward" in vars(m) for m in model.modules())
    assert "_remat_tune_steps" not in vars(model)
    _CACHE.clear()
