"""The PNGs of `remat plan --plot` and `remat bench --plot`: what the figures show, read back from
matplotlib (title, units, budget line, legend entries, labels that neither overlap nor leave the
canvas), not only that a file was written."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
from matplotlib.container import ErrorbarContainer
from matplotlib.text import Text

import remat
from remat import models
from remat.answers.plots import (
    _bench_figure,
    _byte_unit,
    _dodge,
    frontier_figure,
    plot_bench,
    plot_frontier,
)
from remat.errors import InfeasibleBudget
from remat.units import format_bytes

MIB = 2**20


@pytest.fixture(scope="module")
def planned():
    model, inputs = models.build("gpt2", batch=2, seq=64, tiny=True)
    planner = remat.Planner(remat.trace(model, *inputs))
    frontier = planner.pareto(steps=6)
    try:
        chosen = planner.plan("90%")
    except InfeasibleBudget:
        chosen = planner.lowest_peak()
    budget = max(planner.budget_bytes("90%"), chosen.predicted_peak_bytes)
    return planner, frontier, chosen, budget


def legend_texts(fig) -> list[str]:
    legends = [*fig.legends, *(ax.get_legend() for ax in fig.axes)]
    return [t.get_text() for leg in legends if leg is not None for t in leg.get_texts()]


def drawn_texts(fig) -> list[Text]:
    """Every non-empty visible text the canvas draws, with tick labels limited to ticks in view."""
    fig.canvas.draw()
    ticks = set()
    for ax in fig.axes:
        for axis, (lo, hi) in ((ax.xaxis, ax.get_xlim()), (ax.yaxis, ax.get_ylim())):
            lo, hi = min(lo, hi), max(lo, hi)
            for tick in axis.get_major_ticks() + axis.get_minor_ticks():
                if not lo <= tick.get_loc() <= hi:
                    ticks.add(id(tick.label1))
                    ticks.add(id(tick.label2))
    texts = {
        id(t): t
        for t in fig.findobj(Text)
        if t.get_visible() and t.get_text().strip() and id(t) not in ticks
    }
    return list(texts.values())


def assert_readable_labels(fig) -> None:
    renderer = fig.canvas.get_renderer()
    boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in drawn_texts(fig)]
    canvas = fig.bbox
    for text, box in boxes:
        assert box.x0 >= canvas.x0 - 1 and box.x1 <= canvas.x1 + 1, f"{text!r} leaves the canvas"
        assert box.y0 >= canvas.y0 - 1 and box.y1 <= canvas.y1 + 1, f"{text!r} leaves the canvas"
    for (a, ba), (b, bb) in itertools.combinations(boxes, 2):
        assert not ba.overlaps(bb), f"labels {a!r} and {b!r} overlap"


def budget_lines(ax, budget_bytes: int, scale: int) -> list:
    x = budget_bytes / scale
    return [
        line
        for line in ax.get_lines()
        if line.get_linestyle() == "--"
        and len(line.get_xdata()) == 2
        and all(v == pytest.approx(x) for v in line.get_xdata())
    ]


def test_byte_unit_reads_from_the_data():
    assert _byte_unit([0.08 * 2**30, 0.15 * 2**30]) == ("MiB", MIB)
    assert _byte_unit([3 * 2**30, None]) == ("GiB", 2**30)
    assert _byte_unit([500 * 1024]) == ("KiB", 1024)
    assert _byte_unit([100]) == ("B", 1)


def test_dodge_sets_coincident_markers_side_by_side():
    offsets = _dodge([(1.0, 1.0), (1.0, 1.0), (5.0, 1.0), (1.0, 9.0)], xspan=4.0, yspan=8.0)
    assert offsets[0] == -offsets[1] != 0
    assert offsets[2] == offsets[3] == 0


def test_frontier_figure(planned):
    planner, frontier, chosen, budget = planned
    title = "gpt2 (tiny) b2 s64 float32 on cpu"
    fig = frontier_figure(
        frontier, title, budget_bytes=budget, chosen=chosen, step_seconds=planner.step_seconds
    )
    (ax,) = fig.axes
    assert fig.get_suptitle().replace("\n", " ") == title
    assert ax.get_xlabel() == "predicted peak of the step (MiB)"  # ~2.5 MiB: not GiB
    assert "% of predicted step" in ax.get_ylabel()
    # The y axis is in % of the step: store_all at 0, full's recompute well above 1%.
    full = next(p for p in frontier.named if p.strategy == "full")
    assert ax.get_ylim()[1] >= 100 * full.recompute_seconds / planner.step_seconds
    assert budget_lines(ax, budget, MIB)
    texts = legend_texts(fig)
    assert f"budget {format_bytes(budget)}" in texts
    assert [t for t in texts if t.startswith(f"chosen: {chosen.strategy} at ")]
    for p in frontier.named:
        assert any(p.strategy in t.split(" at ")[0].split(" / ") for t in texts), p.strategy
    assert any(t.startswith("auto frontier") for t in texts)
    # The chosen plan is its own large marker, where its peak and recompute time put it.
    star = [line for line in ax.get_lines() if line.get_marker() == "*"]
    assert len(star) == 1 and star[0].get_markersize() >= 15
    assert star[0].get_xdata()[0] == pytest.approx(chosen.predicted_peak_bytes / MIB)
    assert_readable_labels(fig)


def test_frontier_figure_defaults_in_time_units(planned):
    _, frontier, _, _ = planned
    fig = frontier_figure(frontier)
    (ax,) = fig.axes
    assert fig.get_suptitle()  # a default title
    assert ax.get_ylabel() in (
        "predicted recompute time (\N{MICRO SIGN}s)",
        "predicted recompute time (ms)",
    )
    assert not [line for line in ax.get_lines() if line.get_linestyle() == "--"]
    assert not [t for t in legend_texts(fig) if t.startswith(("chosen", "budget"))]
    assert_readable_labels(fig)


def test_frontier_figure_budget_at_the_edges(planned):
    planner, frontier, _, _ = planned
    lowest = planner.lowest_peak()
    # At the lowest feasible peak: the line at the left edge, its label inside the canvas.
    fig = frontier_figure(frontier, "t", budget_bytes=lowest.predicted_peak_bytes, chosen=lowest)
    assert budget_lines(fig.axes[0], lowest.predicted_peak_bytes, MIB)
    assert_readable_labels(fig)
    # Far above every plan: the axis keeps the data's width, a label at the edge points to it.
    far = 40 * 2**30
    fig = frontier_figure(frontier, "t", budget_bytes=far, chosen=planner.plan(far))
    (ax,) = fig.axes
    assert ax.get_xlabel().endswith("(MiB)")
    assert ax.get_xlim()[1] < 3
    assert "budget 40 GiB" in legend_texts(fig)
    assert "budget 40 GiB \N{RIGHTWARDS ARROW}" in [t.get_text() for t in drawn_texts(fig)]
    assert_readable_labels(fig)


def test_plot_frontier_writes_a_png(planned, tmp_path):
    planner, frontier, chosen, budget = planned
    path = str(tmp_path / "pareto.png")
    out = plot_frontier(
        frontier,
        path,
        title="gpt2",
        budget_bytes=budget,
        chosen=chosen,
        step_seconds=planner.step_seconds,
    )
    assert out == path
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def bench_rows(frontier, spread: bool) -> list[SimpleNamespace]:
    """BenchRow-like rows: the named strategies measured a little above their prediction, one row
    that failed (no peak), and `step_seconds_min/max` only when `spread`."""
    rows = []
    base = 0.010
    for p in frontier.named:
        ratio = 1 + 3 * p.recompute_seconds / 1e-3
        row = SimpleNamespace(
            strategy=p.strategy,
            held_bytes=p.held_bytes,
            peak_bytes=int(p.predicted_peak_bytes * 1.05),
            predicted_peak_bytes=p.predicted_peak_bytes,
            step_seconds=base * ratio,
            time_ratio=ratio,
            grad_max_abs_diff=0.0,
            note="",
        )
        if spread:
            row.step_seconds_min = 0.95 * base * ratio
            row.step_seconds_max = 1.10 * base * ratio
        rows.append(row)
    rows.append(
        SimpleNamespace(
            strategy="broken",
            held_bytes=None,
            peak_bytes=None,
            predicted_peak_bytes=None,
            step_seconds=None,
            time_ratio=None,
            grad_max_abs_diff=None,
            note="CUDA out of memory",
        )
    )
    return rows


@pytest.mark.parametrize("spread", [True, False])
def test_bench_figure(planned, spread):
    planner, frontier, _, budget = planned
    rows = bench_rows(frontier, spread)
    title = "gpt2 (tiny) b2 s64 float32 on cpu, budget 90%"
    fig = _bench_figure(rows, frontier, planner.step_seconds, title, budget_bytes=budget)
    (ax,) = fig.axes
    assert fig.get_suptitle().replace("\n", " ") == title
    assert "(MiB)" in ax.get_xlabel()
    assert "store_all" in ax.get_ylabel()
    assert budget_lines(ax, budget, MIB)
    texts = legend_texts(fig)
    assert f"budget {format_bytes(budget)}" in texts
    assert any(t.startswith("predicted frontier") for t in texts)
    measured = [r for r in rows if r.peak_bytes is not None]
    for r in measured:
        assert f"{r.strategy} at {format_bytes(r.peak_bytes)}, {r.time_ratio:.2f}x" in texts
    assert not [t for t in texts if "broken" in t]  # no peak: left out
    bars = [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
    assert len(bars) == len(measured)
    base = next(r.step_seconds for r in rows if r.strategy == "store_all")
    for r, c in zip(measured, bars, strict=True):
        (segments,) = [col.get_segments() for col in c[2]] or [[]]
        if spread:
            (segment,) = segments
            ys = sorted(y for _, y in segment)
            assert ys == pytest.approx([r.step_seconds_min / base, r.step_seconds_max / base])
        else:
            assert not c.has_yerr
    assert_readable_labels(fig)


def test_plot_bench_writes_a_png(planned, tmp_path):
    planner, frontier, _, budget = planned
    path = str(tmp_path / "bench.png")
    out = plot_bench(
        bench_rows(frontier, True), frontier, planner.step_seconds, path, "gpt2", budget
    )
    assert out == path
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
