"""Every figure remat draws, with matplotlib: the PNGs of `remat plan --plot` (`plot_frontier`: the
predicted frontier with the fixed strategies, the budget and the chosen plan) and `remat bench
--plot` (`plot_bench`: measured steps over the predicted frontier), and the figures of the HTML
report (`remat.answers.html`: live memory over the step, saved bytes by module and op).

Apart from `remat.answers.report`'s tables and JSON so that each holds one kind of output;
matplotlib is imported inside the functions that draw, so importing this module does not need it.
Figures are not registered with pyplot (`_new_figure`): nothing to close, no global backend."""

from __future__ import annotations

import textwrap
from typing import Any

from remat.planning.planner import Frontier
from remat.planning.plans import Plan
from remat.prediction.estimate import MemoryEstimate
from remat.units import format_bytes

#: Marker shapes and colours given to strategies in order; the star is kept for the chosen plan.
_MARKERS = ("o", "s", "D", "^", "v", "P", "X", "<", ">", "h", "p", "d")
#: tab10 without its red (C3), which is the budget line's colour: no series is drawn in it.
_COLORS = tuple(f"C{i}" for i in range(10) if i != 3)


def _byte_unit(values) -> tuple[str, int]:
    """The binary unit the largest of `values` reads best in (at least 1 of it): KiB, MiB, GiB."""
    top = max((abs(v) for v in values if v is not None), default=2**20)
    name, scale = "B", 1
    for unit, size in (("KiB", 2**10), ("MiB", 2**20), ("GiB", 2**30), ("TiB", 2**40)):
        if top >= size:
            name, scale = unit, size
    return name, scale


def _time_unit(seconds) -> tuple[str, float]:
    """The unit (s, ms, us) the largest of `seconds` reads best in."""
    top = max((abs(s) for s in seconds if s is not None), default=1e-3)
    if top >= 1:
        return "s", 1.0
    if top >= 1e-3:
        return "ms", 1e-3
    return "\N{MICRO SIGN}s", 1e-6


def _style(k: int) -> dict[str, Any]:
    return {"marker": _MARKERS[k % len(_MARKERS)], "color": _COLORS[k % len(_COLORS)]}


def _new_figure():
    """A figure not registered with pyplot (nothing to close, no global backend), laid out so that
    a legend outside the axes stays on the canvas."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 4.8), layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def _dodge(points: list[tuple[float, float]], xspan: float, yspan: float) -> list[float]:
    """Horizontal offsets (in points) that set side by side the markers of points that would
    hide each other (closer than about a marker in both axes), centred on their place;
    deterministic, in the order given."""
    offsets = [0.0] * len(points)
    clusters: list[list[int]] = []
    for i, (x, y) in enumerate(points):
        for c in clusters:
            x0, y0 = points[c[0]]
            if abs(x - x0) <= 0.015 * xspan and abs(y - y0) <= 0.03 * yspan:
                c.append(i)
                break
        else:
            clusters.append([i])
    for c in clusters:
        for k, i in enumerate(c):
            offsets[i] = (k - (len(c) - 1) / 2) * 9.0
    return offsets


def _span(values) -> float:
    values = [v for v in values if v is not None]
    return (max(values) - min(values)) or 1.0 if values else 1.0


def _shifted(ax, dx_points: float):
    """The data transform shifted right by `dx_points`. Artists drawn with it do not widen the
    axes' limits: pass their points to `ax.update_datalim`."""
    from matplotlib.transforms import ScaledTranslation

    return ax.transData + ScaledTranslation(dx_points / 72, 0, ax.figure.dpi_scale_trans)


def _budget_line(ax, budget_bytes: int, scale: int) -> None:
    """The budget as a dashed vertical line labelled along its top, on the side with more room.
    Call it once the data are drawn: a budget far off the data (a quarter of their width or more)
    is not given room that would squash them: a label at that edge points to it instead."""
    label = f"budget {format_bytes(budget_bytes)}"
    style = {"color": "crimson", "linestyle": "--", "linewidth": 1.2, "label": label, "zorder": 1}
    text = {"fontsize": 8, "color": "crimson", "va": "top", "textcoords": "offset points"}
    x = budget_bytes / scale
    lo, hi = ax.get_xlim()
    margin = 0.25 * (hi - lo)
    if lo - margin <= x <= hi + margin:
        ax.axvline(x, **style)
        lo, hi = ax.get_xlim()
        left = x - lo > (hi - lo) / 2
        ax.annotate(
            label,
            (x, 1),
            xycoords=("data", "axes fraction"),
            xytext=(-3 if left else 3, -4),
            rotation=90,
            ha="right" if left else "left",
            **text,
        )
        return
    ax.plot([], [], **style)  # the legend entry alone
    right = x > hi
    ax.annotate(
        f"{label} \N{RIGHTWARDS ARROW}" if right else f"\N{LEFTWARDS ARROW} {label}",
        (1 if right else 0, 1),
        xycoords="axes fraction",
        xytext=(-4 if right else 4, -4),
        ha="right" if right else "left",
        **text,
    )


def _finish(fig, ax, title: str, xlabel: str, ylabel: str) -> None:
    # Above the axes and the legend both (constrained layout makes room), wrapped to the figure.
    fig.suptitle(textwrap.fill(title, 100), fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    # The frontier first, then the chosen plan and the budget, then the strategies as drawn.
    first = ("auto frontier", "predicted frontier", "chosen: ", "budget ")
    order = sorted(
        range(len(labels)),
        key=lambda i: next((k for k, f in enumerate(first) if labels[i].startswith(f)), len(first)),
    )
    handles, labels = [handles[i] for i in order], [labels[i] for i in order]
    if handles:
        fig.legend(handles, labels, loc="outside right center", fontsize=8, frameon=False)


def frontier_figure(
    frontier: Frontier,
    title: str = "",
    budget_bytes: int | None = None,
    chosen: Plan | None = None,
    step_seconds: float | None = None,
):
    """The figure `plot_frontier` saves (a `matplotlib.figure.Figure`)."""
    from matplotlib.ticker import FuncFormatter

    fig, ax = _new_figure()
    plans = [*frontier.points, *frontier.named, *([chosen] if chosen is not None else [])]
    unit, scale = _byte_unit([p.predicted_peak_bytes for p in plans] or [budget_bytes])
    if step_seconds:
        ys_unit, tscale = "+% of predicted step", step_seconds / 100

        def fmt(v: float) -> str:
            return f"{v:+.3g}%" if v else "0%"

        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: fmt(v)))
    else:
        ys_unit, tscale = _time_unit([p.recompute_seconds for p in plans])

        def fmt(v: float) -> str:
            return f"{v:.3g} {ys_unit}"

    def y(p: Plan) -> float:
        return p.recompute_seconds / tscale

    profile = next((p.profile for p in plans), "")
    if frontier.points:
        xs = [p.predicted_peak_bytes / scale for p in frontier.points]
        ys = [y(p) for p in frontier.points]
        ax.step(
            xs,
            ys,
            where="post",
            color="black",
            linewidth=1.2,
            marker="o",
            markersize=3,
            label=f"auto frontier ({profile} profile)" if profile else "auto frontier",
            zorder=2,
        )
    if chosen is not None:
        ax.plot(
            chosen.predicted_peak_bytes / scale,
            y(chosen),
            linestyle="none",
            marker="*",
            markersize=20,
            color="gold",
            markeredgecolor="black",
            markeredgewidth=1.0,
            label=f"chosen: {chosen.strategy} at {format_bytes(chosen.predicted_peak_bytes)}, "
            f"{fmt(y(chosen))}",
            zorder=4,
        )
    # Fixed strategies that land on the same point share one marker and one legend entry.
    groups: dict[tuple[int, float], list[str]] = {}
    for p in frontier.named:
        groups.setdefault((p.predicted_peak_bytes, round(p.recompute_seconds, 12)), []).append(
            p.strategy
        )
    points = [(peak / scale, seconds / tscale) for peak, seconds in groups]
    dx = _dodge(
        points,
        _span([p.predicted_peak_bytes / scale for p in plans]),
        _span([y(p) for p in plans]),
    )
    if points:
        ax.update_datalim(points)
    for k, ((peak, _), names) in enumerate(groups.items()):
        px, py = points[k]
        ax.plot(
            px,
            py,
            transform=_shifted(ax, dx[k]),
            linestyle="none",
            markersize=8,
            markeredgecolor="white",
            markeredgewidth=0.6,
            alpha=0.9,
            label=f"{' / '.join(names)} at {format_bytes(peak)}, {fmt(py)}",
            zorder=3,
            **_style(k),
        )
    ax.autoscale_view()
    if budget_bytes is not None:
        _budget_line(ax, budget_bytes, scale)
    _finish(
        fig,
        ax,
        title or "predicted memory / recompute frontier",
        f"predicted peak of the step ({unit})",
        f"predicted recompute time ({ys_unit})",
    )
    return fig


def plot_frontier(
    frontier: Frontier,
    path: str,
    title: str = "",
    budget_bytes: int | None = None,
    chosen: Plan | None = None,
    step_seconds: float | None = None,
) -> str:
    """A PNG of the predicted frontier (peak vs recompute time) with the fixed strategies, the
    budget and the chosen plan marked. Recompute time is in % of `step_seconds` when given."""
    fig = frontier_figure(frontier, title, budget_bytes, chosen, step_seconds)
    fig.savefig(path, dpi=120)
    return path


def _bench_figure(
    rows,
    frontier: Frontier,
    step_seconds: float | None,
    title: str = "",
    budget_bytes: int | None = None,
):
    """The figure `plot_bench` saves (a `matplotlib.figure.Figure`)."""
    from matplotlib.ticker import FuncFormatter

    fig, ax = _new_figure()
    measured = [r for r in rows if r.peak_bytes is not None and r.time_ratio is not None]
    unit, scale = _byte_unit(
        [r.peak_bytes for r in measured] + [p.predicted_peak_bytes for p in frontier.points]
        or [budget_bytes]
    )
    if frontier.points and step_seconds:
        ax.step(
            [p.predicted_peak_bytes / scale for p in frontier.points],
            [1 + p.recompute_seconds / step_seconds for p in frontier.points],
            where="post",
            color="black",
            linewidth=1.2,
            label="predicted frontier (remat auto)",
            zorder=2,
        )
    base = next(
        (r.step_seconds for r in rows if r.strategy == "store_all" and r.step_seconds), None
    )
    spread = False
    dx = _dodge(
        [(r.peak_bytes / scale, r.time_ratio) for r in measured],
        _span(
            [r.peak_bytes / scale for r in measured]
            + [p.predicted_peak_bytes / scale for p in frontier.points]
        ),
        _span([r.time_ratio for r in measured] + [1.0]),
    )
    for k, r in enumerate(measured):
        lo = getattr(r, "step_seconds_min", None)
        hi = getattr(r, "step_seconds_max", None)
        yerr = None
        if base and lo is not None and hi is not None:
            yerr = [[max(r.time_ratio - lo / base, 0.0)], [max(hi / base - r.time_ratio, 0.0)]]
            spread = True
            ax.update_datalim(
                [(r.peak_bytes / scale, lo / base), (r.peak_bytes / scale, hi / base)]
            )
        ax.update_datalim([(r.peak_bytes / scale, r.time_ratio)])
        ax.errorbar(
            r.peak_bytes / scale,
            r.time_ratio,
            yerr=yerr,
            transform=_shifted(ax, dx[k]),
            linestyle="none",
            markersize=8,
            markeredgecolor="white",
            markeredgewidth=0.6,
            capsize=3,
            label=f"{r.strategy} at {format_bytes(r.peak_bytes)}, {r.time_ratio:.2f}x",
            zorder=3,
            **_style(k),
        )
    ax.autoscale_view()
    if budget_bytes is not None:
        _budget_line(ax, budget_bytes, scale)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.3g}x"))
    _finish(
        fig,
        ax,
        title or "measured steps over the predicted frontier",
        f"peak of the step ({unit}): measured points, predicted line",
        "step time / store_all"
        + (" (median; bars: fastest..slowest step)" if spread else " (median)"),
    )
    return fig


def plot_bench(
    rows,
    frontier: Frontier,
    step_seconds: float | None,
    path: str,
    title: str = "",
    budget_bytes: int | None = None,
) -> str:
    """Measured (peak, step-time ratio) of each row over remat's predicted frontier (recompute
    time as a share of the predicted `step_seconds`); rows without a measured peak are left out.
    Error bars span the fastest..slowest step when rows carry `step_seconds_min/max`."""
    fig = _bench_figure(rows, frontier, step_seconds, title, budget_bytes)
    fig.savefig(path, dpi=120)
    return path


# -- figures of the HTML report (`remat.answers.html`) ---------------------------------------------------
def _downsample(xs, ys, most: int = 4000):
    """At most about `most` points of a long timeline: the largest value of each bucket of
    consecutive points, so that peaks stay where they are and as high as they are."""
    if len(xs) <= most:
        return list(xs), list(ys)
    size = -(-len(xs) // (most // 2))
    out_x, out_y = [], []
    for k in range(0, len(xs), size):
        chunk = ys[k : k + size]
        top = max(range(len(chunk)), key=chunk.__getitem__)
        out_x.append(xs[k + top])
        out_y.append(chunk[top])
    return out_x, out_y


def _schedule_x(schedule) -> list[float]:
    """An x for each position of a simulated schedule on the axis of op indices: op i at i, and
    the replays that run before a backward op spread evenly over the gap before it, so that plans
    with and without recomputation line up op by op."""
    xs: list[float] = []
    pending = 0
    for kind, i in schedule:
        if kind == "replay":
            pending += 1
            continue
        if pending:
            xs.extend(i - 1 + (k + 1) / (pending + 1) for k in range(pending))
            pending = 0
        xs.append(float(i))
    if pending:  # replays after the last op (none in practice): after it
        last = xs[-1] if xs else 0.0
        xs.extend(last + (k + 1) / (pending + 1) for k in range(pending))
    return xs


#: Timeline colours: store_all in grey, then blue, the chosen plan (last) in green and thicker.
_TIMELINE_COLORS = ("0.55", "C0", "C1", "C4", "C5")


def timeline_figure(
    series,
    forward_ops: int,
    budget_bytes: int | None = None,
    base_bytes: int | None = None,
    title: str = "",
    emphasize_last: bool = True,
):
    """Live bytes over one training step for each `(label, Simulation)` of `series` (a
    `matplotlib.figure.Figure`). The x axis is the op index (`forward_ops` of them in the forward,
    the boundary marked); a plan's replays are drawn between the backward ops that trigger them.
    The budget is a dashed horizontal line, the memory live before the step (`base_bytes`:
    parameters, buffers, inputs) a grey band; the last series is drawn thicker when
    `emphasize_last`."""
    from matplotlib.ticker import FuncFormatter

    fig, ax = _new_figure()
    fig.set_size_inches(11, 4.6)
    peaks = [max(sim.timeline, default=0) for _, sim in series]
    unit, scale = _byte_unit([*peaks, budget_bytes or 0])
    if base_bytes:
        ax.axhspan(
            0,
            base_bytes / scale,
            color="0.9",
            zorder=0,
            label=f"live before the step (params, buffers, inputs): {format_bytes(base_bytes)}",
        )
    boundary = forward_ops - 0.5
    ax.axvspan(-0.5, boundary, color="C0", alpha=0.05, zorder=0, linewidth=0)
    ax.axvline(boundary, color="0.3", linewidth=0.8, linestyle=":", zorder=1)
    for text, x, ha in (
        ("forward \N{RIGHTWARDS ARROW}", boundary, "right"),
        ("\N{LEFTWARDS ARROW} backward", boundary, "left"),
    ):
        ax.annotate(
            text,
            (x, 0),
            xycoords=("data", "axes fraction"),
            xytext=(-4 if ha == "right" else 4, 4),
            textcoords="offset points",
            ha=ha,
            va="bottom",
            fontsize=8.5,
            color="0.25",
        )
    for k, ((label, sim), peak) in enumerate(zip(series, peaks, strict=True)):
        last = emphasize_last and k == len(series) - 1 and len(series) > 1
        color = "C2" if last else _TIMELINE_COLORS[k % len(_TIMELINE_COLORS)]
        xs, ys = _downsample(_schedule_x(sim.schedule), [v / scale for v in sim.timeline])
        replays = sum(1 for kind, _ in sim.schedule if kind == "replay")
        extra = f", {replays} replayed ops" if replays else ""
        # The emphasized line wide and under the others: where they coincide both stay visible.
        ax.plot(
            xs,
            ys,
            color=color,
            linewidth=2.8 if last else 1.1,
            alpha=0.75 if last else 1.0,
            label=f"{label}: peak {format_bytes(peak)}{extra}",
            zorder=2 if last else 3,
            drawstyle="steps-mid",
        )
        at = sim.timeline.index(peak) if sim.timeline else 0
        ax.plot(
            _schedule_x(sim.schedule)[at] if sim.schedule else 0,
            peak / scale,
            marker="v",
            markersize=7,
            color=color,
            markeredgecolor="white",
            linestyle="none",
            zorder=4,
        )
    if budget_bytes is not None:
        ax.axhline(
            budget_bytes / scale,
            color="crimson",
            linestyle="--",
            linewidth=1.2,
            zorder=1,
            label=f"budget {format_bytes(budget_bytes)}",
        )
    ax.set_ylim(bottom=0)
    ax.set_xlim(
        -0.5, max((max(_schedule_x(s.schedule), default=0) for _, s in series), default=0) + 0.5
    )
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.3g}"))
    fig.suptitle(textwrap.fill(title or "live memory over the step", 110), fontsize=10)
    ax.set_xlabel("op of the step (forward, then backward; replays drawn between backward ops)")
    ax.set_ylabel(f"live memory ({unit})")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncols=2, fontsize=8, frameon=False)
    return fig


def module_breakdown(est: MemoryEstimate, blocks=(), top: int = 12):
    """Saved bytes by module at the shallowest depth that tells something: the top-level modules,
    a module holding most (half or more) of the bytes replaced by its children, again while one
    does; a module holding repeated blocks (`blocks`: their paths) stays one row, `<path> (N
    blocks)`, its blocks being broken down apart. Bytes a module saves in its own ops (not in a child's) are a row `<path> (own ops)`, so
    that the rows add up to the total. Returns `(rows, block)`: rows `(path, bytes)` largest first
    (at most `top`, the rest summed in a last row `N more modules`), and `block`, the first
    repeated block broken down the same way (`(path, rows)` with paths relative to the block),
    or None for a model without blocks."""
    by_path = {m.module: m.activation_bytes for m in est.by_module}
    containers: dict[str, int] = {}
    for b in blocks:
        containers[b.rpartition(".")[0]] = containers.get(b.rpartition(".")[0], 0) + 1

    def children(path: str) -> list[str]:
        depth = path.count(".") + 1 if path else 0
        prefix = f"{path}." if path else ""
        return [
            p
            for p, b in by_path.items()
            if p and b and p.startswith(prefix) and p.count(".") == depth
        ]

    def expand(root: str) -> list[tuple[str, int]]:
        total = by_path.get(root, 0)
        rows: list[tuple[str, int]] = []

        def add(path: str) -> None:
            kids = children(path)
            own = by_path[path] - sum(by_path[k] for k in kids)
            if path != root and path in containers:
                n = containers[path]
                rows.append((f"{path} ({n} block{'s' if n > 1 else ''})", by_path[path]))
            elif path == root or (kids and total and by_path[path] >= total / 2):
                for k in kids:
                    add(k)
                if own > 0:
                    name = path if path != root else (root or "<model>")
                    rows.append((f"{name} (own ops)", own))
            else:
                rows.append((path, by_path[path]))

        if root in by_path:
            add(root)
        rows.sort(key=lambda r: -r[1])
        if len(rows) > top:
            rest = rows[top - 1 :]
            rows = [*rows[: top - 1], (f"{len(rest)} more modules", sum(b for _, b in rest))]
        return rows

    rows = expand("")
    block = None
    if blocks:
        path = blocks[0]
        inner = [(p.removeprefix(path + "."), b) for p, b in expand(path)]
        block = (path, inner)
    return rows, block


def breakdown_figure(
    modules,
    ops,
    total_bytes: int,
    block=None,
    blocks: int = 0,
    title: str = "",
):
    """Horizontal bars of saved bytes (a `matplotlib.figure.Figure`): by module (`modules`,
    `(label, bytes)` rows as `module_breakdown` gives them), inside one block (`block`:
    `(path, rows)`, one of `blocks` repeated blocks) when given, and by op type (`ops`,
    `(op, bytes, tensors)` rows). Each bar is labelled with its bytes and share of
    `total_bytes`."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    panels = [("by module", modules, "C0")]
    if block is not None:
        panels.append((f"inside one block: {block[0]} (of {blocks})", block[1], "C1"))
    panels.append(
        ("by op type", [(f"{o} ({n}\N{MULTIPLICATION SIGN})", b) for o, b, n in ops], "C2")
    )
    rows = max(len(p[1]) for p in panels)
    fig = Figure(figsize=(11, 1.5 + 0.32 * max(rows, 3)), layout="constrained")
    FigureCanvasAgg(fig)
    unit, scale = _byte_unit([b for _, r, _ in panels for _, b in r] or [1])
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, (name, data, color) in zip(axes, panels, strict=True):
        labels = [
            label if len(label) <= 34 else label[:33] + "\N{HORIZONTAL ELLIPSIS}"
            for label, _ in data
        ]
        values = [b / scale for _, b in data]
        ys = range(len(data))
        ax.barh(ys, values, color=color, alpha=0.8, height=0.7)
        ax.set_yticks(list(ys), labels, fontsize=9)
        ax.set_ylim(max(rows, 1) - 0.5, -0.5)
        top = max(values, default=1) or 1
        ax.set_xlim(0, top * 1.45)
        for y, (_, b) in zip(ys, data, strict=True):
            share = f" ({b / total_bytes:.0%})" if total_bytes else ""
            ax.annotate(
                f"{format_bytes(b)}{share}",
                (b / scale, y),
                xytext=(3, 0),
                textcoords="offset points",
                va="center",
                fontsize=8,
            )
        ax.set_title(name, fontsize=10, loc="left")
        ax.set_xlabel(f"saved for backward ({unit})", fontsize=9)
        ax.tick_params(axis="x", labelsize=8)
        ax.grid(axis="x", alpha=0.3)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    fig.suptitle(
        textwrap.fill(
            title or f"activations saved for backward: {format_bytes(total_bytes)} in all", 110
        ),
        fontsize=10,
    )
    return fig
