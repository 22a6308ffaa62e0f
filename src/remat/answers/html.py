"""One training step as a self-contained HTML page: the header facts and the chosen plan, the
live memory over the step, where the saved bytes come from, the frontier, the plan's decisions,
the strategies side by side, and optional fit and bench tables.

The page is one file with nothing to fetch: the figures are inline SVG (matplotlib, text kept as
text), the styles inline, and the numbers behind them in a `<script type="application/json"
id="remat-data">` block for a program to read back. No script runs in it.
"""

from __future__ import annotations

import html
import io
import json
import re
from collections.abc import Iterable, Sequence
from typing import Any

from remat._version import __version__
from remat.answers.per_rank import RankView
from remat.errors import InfeasibleBudget
from remat.planning.planner import Comparison, Planner
from remat.planning.plans import Plan
from remat.units import format_bytes

#: The section headings, in order (ids are the anchors of the page's contents line).
SECTIONS = {
    "fit": "Fit",
    "timeline": "Memory over the step",
    "breakdown": "Where the saved bytes come from",
    "frontier": "Memory / recompute frontier",
    "decisions": "The plan's decisions",
    "strategies": "Strategies at the budget",
    "bench": "Measured",
}
#: Rows of the decisions table; the rest are counted under it.
TOP_DECISIONS = 40

_CSS = """
:root { --fg: #1d232a; --muted: #5b6570; --line: #dde2e7; --soft: #f5f7f9; --accent: #1a7f37; }
* { box-sizing: border-box; }
body { margin: 0; color: var(--fg); background: #fff;
  font: 14px/1.45 system-ui, -apple-system, "Segoe UI", "DejaVu Sans", Helvetica, Arial, sans-serif; }
main { max-width: 1180px; margin: 0 auto; padding: 24px 28px 48px; }
h1 { font-size: 24px; margin: 0 0 4px; }
h2 { font-size: 18px; margin: 36px 0 6px; padding-bottom: 4px; border-bottom: 1px solid var(--line); }
p { margin: 6px 0; }
.sub, .note, figcaption { color: var(--muted); }
.note, figcaption { font-size: 13px; }
nav { font-size: 13px; margin: 8px 0 16px; color: var(--muted); }
nav a { color: var(--muted); margin-right: 12px; }
.facts { display: grid; grid-template-columns: repeat(auto-fill, minmax(170px, 1fr)); gap: 8px;
  margin: 16px 0; }
.fact { background: var(--soft); border: 1px solid var(--line); border-radius: 6px; padding: 8px 10px; }
.fact .k { font-size: 12px; color: var(--muted); }
.fact .v { font-size: 18px; font-weight: 600; font-variant-numeric: tabular-nums; }
.fact.budget.fits .v { color: seagreen; }
.fact.budget.over .v { color: crimson; }
.chosen { border-left: 4px solid var(--accent); background: #eef7f0; padding: 10px 14px;
  border-radius: 0 6px 6px 0; margin: 12px 0; }
.chosen.none { border-color: crimson; background: #fbeeee; }
.chosen .reason { color: var(--muted); font-size: 13px; margin-top: 4px; }
figure { margin: 8px 0; }
figure svg { display: block; width: 100%; height: auto; }
table { border-collapse: collapse; margin: 8px 0; font-size: 13px; width: 100%; }
th, td { padding: 4px 8px; border-bottom: 1px solid var(--line); text-align: left; vertical-align: top; }
th { background: var(--soft); font-weight: 600; white-space: nowrap; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
td.why { min-width: 300px; }
table.compact { width: auto; min-width: 50%; }
td.name { font-family: ui-monospace, "DejaVu Sans Mono", Menlo, Consolas, monospace; font-size: 12px; }
tr.pick td { background: #eef7f0; font-weight: 600; }
tr.off td { color: var(--muted); }
tr.more td { color: var(--muted); font-style: italic; }
.tag { display: inline-block; padding: 0 6px; border-radius: 9px; font-size: 12px; }
.tag.keep { background: #e6eef9; color: #1f4f8f; }
.tag.recompute { background: #fdf0dc; color: #8a5300; }
footer { margin-top: 40px; font-size: 12px; color: var(--muted); }
.scroll { overflow-x: auto; max-width: 100%; }
.advice { border-left: 4px solid #1f4f8f; background: #eef3fa; padding: 10px 14px;
  border-radius: 0 6px 6px 0; margin: 12px 0; }
.advice p { margin: 4px 0; overflow-wrap: anywhere; }
.advice code { white-space: pre-wrap; word-break: break-word; }
@media (max-width: 640px) {
  main { padding: 12px 12px 32px; }
  h1 { font-size: 20px; }
  .facts { grid-template-columns: repeat(2, minmax(0, 1fr)); }
  .fact .v { font-size: 16px; }
}
"""


def write_report(
    path: str,
    planner: Planner,
    *,
    title: str,
    budget_bytes: int,
    chosen: Plan | None = None,
    fit_rows: list[dict] | None = None,
    bench_rows: list | None = None,
    advice: Sequence[str] = (),
    fit_caption: str = "",
    rank: RankView | None = None,
) -> str:
    """Write the HTML report of `planner`'s step at `budget_bytes` to `path` and return `path`.

    `chosen` is the plan to show (default: `planner.plan(budget_bytes)`, strategy auto, or none
    when nothing fits). `fit_rows` (dicts, one column per key) and `bench_rows` (objects with
    `to_dict()`, such as `remat.answers.bench.BenchRow`) add their tables when given. `advice` (a fit's
    advice, the command that fits last) leads the page; `fit_caption` is the fit table's
    arithmetic (what fits means, what usable memory is). `rank`: one rank's view of a sharded
    step (`remat.answers.per_rank.RankView`): every card, figure and table is then that rank's,
    `budget_bytes` and `chosen` included, and the header says so."""
    text = render_report(
        planner,
        title=title,
        budget_bytes=budget_bytes,
        chosen=chosen,
        fit_rows=fit_rows,
        bench_rows=bench_rows,
        advice=advice,
        fit_caption=fit_caption,
        rank=rank,
    )
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path


def render_report(
    planner: Planner,
    *,
    title: str,
    budget_bytes: int,
    chosen: Plan | None = None,
    fit_rows: list[dict] | None = None,
    bench_rows: list | None = None,
    advice: Sequence[str] = (),
    fit_caption: str = "",
    rank: RankView | None = None,
) -> str:
    """The page `write_report` writes, as a string."""
    from remat.answers.plots import (
        breakdown_figure,
        frontier_figure,
        module_breakdown,
        timeline_figure,
    )

    view = rank or RankView(planner)
    graph, est = planner.graph, view.estimate
    step = planner.step_seconds
    nothing_fits = ""
    if chosen is None:
        try:
            chosen = planner.plan(view.whole_budget(budget_bytes))
        except InfeasibleBudget as e:
            nothing_fits = str(e)
    chosen = None if chosen is None else view.plan(chosen)
    comparison = view.compare(planner.compare(view.whole_budget(budget_bytes)))
    frontier = view.frontier(planner.pareto())
    per_rank = view.describe()
    if per_rank:  # every figure's title says whose step it is
        title = f"{title} ({per_rank})" if per_rank not in title else title

    # 2. the timeline: store_all, full (a model with blocks), the chosen plan
    plans: list[tuple[str, Plan | None, Any]] = [("store_all", None, view.simulate(()))]
    if planner.blocks:
        full = planner.every_block("full")
        if chosen is None or tuple(chosen.regions) != tuple(full):
            plans.append(("full (every block checkpointed)", None, view.simulate(full)))
    if chosen is not None:
        label = f"chosen: {chosen.strategy}"
        if not chosen.regions:
            plans = [(label + " (= store_all)", chosen, plans[0][2]), *plans[1:]]
        else:
            plans.append((label, chosen, view.simulate(chosen.regions)))
    timeline_fig = timeline_figure(
        [(label, sim) for label, _, sim in plans],
        forward_ops=len(graph.forward_ops),
        budget_bytes=budget_bytes,
        base_bytes=view.base_bytes,
        title=f"{title}: live memory over one training step",
        emphasize_last=chosen is not None and bool(chosen.regions),
    )

    # 3. the breakdown
    modules, block = module_breakdown(est, [b.path for b in planner.blocks])
    ops = [(o.op, o.activation_bytes, o.count) for o in est.by_op[:10]]
    breakdown_fig = breakdown_figure(
        modules,
        ops,
        est.activation_bytes,
        block=block,
        blocks=len(planner.blocks),
        title=f"{title}: {format_bytes(est.activation_bytes)} of activations saved for backward",
    )

    # 4. the frontier
    frontier_fig = frontier_figure(
        frontier,
        f"{title}: predicted memory / recompute frontier",
        budget_bytes,
        chosen,
        step,
    )
    frontier_fig.set_size_inches(11, 5.2)  # the width of the other figures

    explained = chosen.explain(graph) if chosen is not None else []
    data = {
        "remat_version": __version__,
        "title": title,
        "profile": planner.profile.name,
        "budget_bytes": budget_bytes,
        "step_seconds": step,
        "model": {
            "param_count": graph.info.get("param_count"),
            "ops": {"forward": len(graph.forward_ops), "backward": len(graph.backward_ops)},
            "blocks": [b.path for b in planner.blocks],
        },
        "estimate": {k: v for k, v in est.to_dict().items() if k != "timeline"}
        | {"fixed_bytes": est.fixed_bytes, "base_bytes": view.base_bytes},
        "per_rank": {"shard": view.shard, "layout": view.layout, "describe": per_rank},
        "chosen": _plan_summary(chosen, step, whole=True) if chosen is not None else None,
        "nothing_fits": nothing_fits or None,
        "timelines": [_timeline_data(label, sim.timeline) for label, _, sim in plans],
        "by_module": [{"module": p, "activation_bytes": b} for p, b in modules],
        "by_op": [{"op": o, "activation_bytes": b, "tensors": n} for o, b, n in ops],
        "frontier": {
            "points": [_plan_summary(p, step) for p in frontier.points],
            "named": [_plan_summary(p, step) for p in frontier.named],
        },
        "decisions": _decision_rows(explained)[:TOP_DECISIONS],
        "decisions_total": {
            "tensors": len(explained),
            "recomputed": sum(r["decision"] == "recompute" for r in explained),
        },
        "comparison": [
            {"strategy": c.strategy, "note": c.note}
            | (_plan_summary(c.plan, step) if c.plan is not None else {})
            for c in comparison
        ],
        "fit": fit_rows,
        "advice": list(advice),
        "bench": [r.to_dict() for r in bench_rows] if bench_rows is not None else None,
    }

    body = [
        _header(
            planner, view, title, budget_bytes, chosen, nothing_fits, fit_rows, bench_rows, advice
        ),
    ]
    if fit_rows is not None:  # a fit's answer comes first
        caption = f'<p class="note">{_e(fit_caption)}</p>' if fit_caption else ""
        body.append(_section("fit", _generic_table(fit_rows) + caption))
    body += [
        _section(
            "timeline",
            _figure(
                timeline_fig,
                "timeline",
                "Live bytes at each op of the step, exactly as remat simulates it. The dotted line "
                "is the end of the forward; \N{BLACK DOWN-POINTING TRIANGLE} marks each peak; the "
                "grey band is what is live before the step starts. A checkpointed plan frees its "
                "regions' activations in the forward and replays them in the backward (the extra "
                "spikes between backward ops).",
            ),
        ),
        _section(
            "breakdown",
            _figure(
                breakdown_fig,
                "breakdown",
                "Bytes autograd saves for the backward with no recomputation (store_all), charged "
                "to the module and the op type that produced them; a share is of all "
                f"{format_bytes(est.activation_bytes)}. Module rows add up to the total."
                + (
                    f" The middle panel breaks down one of the {len(planner.blocks)} repeated "
                    "blocks."
                    if block is not None
                    else ""
                ),
            ),
        ),
        _section(
            "frontier",
            _figure(
                frontier_fig,
                "frontier",
                "Each point is a plan: its predicted peak against the recompute time it adds "
                f"(share of the predicted step of {_seconds(step)} on the {planner.profile.name} "
                "profile). The black line is the best remat auto finds over budgets; the star is "
                "the chosen plan.",
            ),
        ),
        _section("decisions", _decisions(explained, chosen)),
        _section("strategies", _strategies(comparison, chosen, step, budget_bytes)),
    ]
    if bench_rows is not None:
        body.append(
            _section(
                "bench",
                _generic_table([r.to_dict() for r in bench_rows])
                + '<p class="note">Measured on the device the bench ran on: peak and held bytes '
                "from the allocator, step time the median over the timing rounds, time_ratio "
                "over store_all's.</p>",
            )
        )
    payload = json.dumps(data, default=_jsonable, separators=(",", ":"))
    payload = payload.replace("</", "<\\/")  # the block cannot be closed by a string inside it
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>{_e(title)}: remat report</title>\n<style>{_CSS}</style>\n</head>\n<body>\n<main>\n"
        + "\n".join(body)
        + f"\n<footer>remat {_e(__version__)}: predictions on the {_e(planner.profile.name)} "
        "profile. The numbers behind this page are in the JSON block "
        "<code>#remat-data</code> of its source.</footer>\n</main>\n"
        f'<script type="application/json" id="remat-data">{payload}</script>\n'
        "</body>\n</html>\n"
    )


# -- sections -------------------------------------------------------------------------------------
def _header(
    planner: Planner,
    view: RankView,
    title: str,
    budget_bytes: int,
    chosen: Plan | None,
    nothing_fits: str,
    fit_rows,
    bench_rows,
    advice: Sequence[str] = (),
) -> str:
    graph, est = planner.graph, view.estimate
    params = graph.info.get("param_count")
    facts = [
        (
            "parameters (whole model)" if view.shard > 1 else "parameters",
            f"{params:,}" if isinstance(params, int) else "-",
            "",
        ),
        ("activations saved", format_bytes(est.activation_bytes), ""),
        ("store-all peak", format_bytes(est.peak_bytes), ""),
        ("fixed (params, grads, state)", format_bytes(est.fixed_bytes), ""),
        (
            "usable for the step (live)" if advice else "budget",
            format_bytes(budget_bytes),
            # its colour says whether the chosen plan fits (it was crimson whatever the answer):
            # on a fit page by the auto row's verdict, the allocator's where it is simulated
            "budget fits" if _chosen_fits(chosen, budget_bytes, fit_rows) else "budget over",
        ),
        ("predicted step", _seconds(planner.step_seconds), ""),
        ("blocks", str(len(planner.blocks)) if planner.blocks else "none", ""),
        ("ops (forward + backward)", f"{len(graph.forward_ops)} + {len(graph.backward_ops)}", ""),
    ]
    cards = "".join(
        f'<div class="fact {cls}"><div class="k">{_e(k)}</div><div class="v">{_e(v)}</div></div>'
        for k, v, cls in facts
    )
    if chosen is not None:
        step = planner.step_seconds
        saved = est.peak_bytes - chosen.predicted_peak_bytes
        overhead = f"{chosen.recompute_seconds / step:+.1%}" if step else "-"
        sentence = (
            f"<strong>Chosen: {_e(chosen.strategy)}</strong>, predicted peak "
            f"<strong>{format_bytes(chosen.predicted_peak_bytes)}</strong>"
            + (
                f" ({format_bytes(saved)} below store-all's)"
                if saved > 0
                else " (the same as store-all's)"
                if saved == 0
                else ""
            )
            + f", at <strong>{overhead}</strong> step time "
            f"({_seconds(chosen.recompute_seconds)} of recompute on the "
            f"{_e(planner.profile.name)} profile), "
            f"{'within' if chosen.predicted_peak_bytes <= budget_bytes else 'over'} the budget of "
            f"{format_bytes(budget_bytes)}."
        )
        plan = (
            f'<div class="chosen"><div>{sentence}</div>'
            f'<div class="reason">Why: {_e(chosen.reason)}</div></div>'
        )
    else:
        plan = (
            '<div class="chosen none"><strong>No plan fits the budget of '
            f"{format_bytes(budget_bytes)}.</strong>"
            f'<div class="reason">{_e(nothing_fits)}</div></div>'
        )
    if advice:  # a fit's page: its advice is the answer, which a plan at one budget would blur
        plan = ""
    shown = ["fit"] if fit_rows is not None else []
    shown += [k for k in SECTIONS if k not in ("fit", "bench")]
    shown += ["bench"] if bench_rows is not None else []
    nav = " ".join(f'<a href="#{k}">{_e(SECTIONS[k])}</a>' for k in shown)
    return (
        f"<header><h1>{_e(title)}</h1>"
        '<p class="sub">remat report of one traced training step: what autograd saves, what a '
        "plan keeps and recomputes, and what it costs."
        + (
            f" <strong>Every figure is one rank's ({_e(view.describe())}):</strong> its shards of "
            "parameters, gradients and optimizer state, the parameters it gathers, its own "
            "activations."
            if view.describe()
            else ""
        )
        + "</p>"
        f"<nav>{nav}</nav>{_advice(advice)}"
        f'<div class="facts">{cards}</div>{plan}</header>'
    )


def _advice(lines: Sequence[str]) -> str:
    """A fit's advice, the answer, first; a line that is a command is shown as code."""
    if not lines:
        return ""
    body = "".join(
        f"<p><strong>Run:</strong> <code>{_e(line.removeprefix('run: '))}</code></p>"
        if line.startswith("run: ")
        else f"<p>{_e(line)}</p>"
        for line in lines
    )
    return f'<div class="advice"><strong>Advice</strong>{body}</div>'


def _section(key: str, content: str) -> str:
    return f'<section id="{key}"><h2>{_e(SECTIONS[key])}</h2>\n{content}\n</section>'


def _figure(fig, key: str, caption: str) -> str:
    return f"<figure>{_svg(fig, key)}<figcaption>{_e(caption)}</figcaption></figure>"


def _decisions(rows: list[dict[str, Any]], chosen: Plan | None) -> str:
    if chosen is None:
        return '<p class="note">No plan fits the budget: nothing to decide.</p>'
    ordered = _decision_rows(rows)
    shown, rest = ordered[:TOP_DECISIONS], ordered[TOP_DECISIONS:]
    recomputed = [r for r in rows if r["decision"] == "recompute"]
    recomputed_bytes = sum(r["bytes"] for r in recomputed)
    head = (
        f'<p class="note">{len(rows)} tensors autograd saves in store_all: the plan recomputes '
        f"{len(recomputed)} of them ({format_bytes(recomputed_bytes)}) and keeps "
        f"{len(rows) - len(recomputed)} "
        f"({format_bytes(sum(r['bytes'] for r in rows) - recomputed_bytes)}). Largest first; "
        "recompute is the time to re-run the op that made the tensor, on the plan's profile.</p>"
    )
    body = [
        "<tr>"
        f'<td class="name">{_e(r["name"])}'
        + (f" ({r['tensors']} tensors)" if r["tensors"] > 1 else "")
        + "</td>"
        f'<td class="num">{format_bytes(r["bytes"])}</td>'
        f'<td><span class="tag {_e(r["decision"])}">{_e(r["decision"])}</span></td>'
        f'<td class="num">{_seconds(r["recompute_seconds"])}</td>'
        f'<td class="why">{_e(r["why"])}</td></tr>'
        for r in shown
    ]
    if rest:
        tensors = sum(r["tensors"] for r in rest)
        again = sum(r["tensors"] for r in rest if r["decision"] == "recompute")
        body.append(
            f'<tr class="more"><td>{tensors} more tensors</td>'
            f'<td class="num">{format_bytes(sum(r["bytes"] for r in rest))}</td>'
            f"<td>{again} recomputed</td><td></td><td></td></tr>"
        )
    return head + _table(
        [
            ("tensor (the op that made it)", ""),
            ("bytes", "num"),
            ("decision", ""),
            ("recompute", "num"),
            ("why", ""),
        ],
        body,
    )


def _decision_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The decisions, largest first; tensors of one op with the same fate share a row (layer norm
    saves its mean and its rstd)."""
    groups: dict[tuple[str, str, str], dict[str, Any]] = {}
    for r in rows:
        g = groups.setdefault((r["name"], r["decision"], r["why"]), {**r, "bytes": 0, "tensors": 0})
        g["bytes"] += r["bytes"]
        g["tensors"] += 1
    return sorted(groups.values(), key=lambda r: -r["bytes"])


def _strategies(rows: list[Comparison], chosen: Plan | None, step: float, budget_bytes: int) -> str:
    picked = (
        chosen.strategy.removeprefix("auto (").removesuffix(")") if chosen is not None else None
    )
    body = []
    for c in rows:
        p = c.plan
        if p is None:
            body.append(
                f'<tr class="off"><td>{_e(c.strategy)}</td>'
                + '<td class="num">-</td>' * 4
                + f"<td>{_e(c.note)}</td></tr>"
            )
            continue
        cls = (
            ' class="pick"'
            if p.strategy == picked
            else ' class="off"'
            if p.predicted_peak_bytes > budget_bytes
            else ""
        )
        body.append(
            f"<tr{cls}><td>{_e(c.strategy)}{' (chosen)' if p.strategy == picked else ''}</td>"
            f'<td class="num">{format_bytes(p.predicted_peak_bytes)}</td>'
            f'<td class="num">{format_bytes(p.held_bytes)}</td>'
            f'<td class="num">{p.recompute_flops_share:.1%}</td>'
            f'<td class="num">{f"{p.recompute_seconds / step:+.1%}" if step else "-"}</td>'
            f"<td>{_e(c.note)}</td></tr>"
        )
    return (
        f'<p class="note">Every strategy planned at the budget of {format_bytes(budget_bytes)}: '
        "peak and held (live at the end of the forward) are predicted; recompute FLOPs are a "
        "share of the forward's; time is the predicted change of the step time.</p>"
        + _table(
            [
                ("strategy", ""),
                ("peak", "num"),
                ("held", "num"),
                ("recompute FLOPs", "num"),
                ("step time", "num"),
                ("", ""),
            ],
            body,
        )
    )


def _generic_table(rows: list[dict[str, Any]]) -> str:
    """A table of dicts, one column per key in the order first seen; numbers right-aligned,
    `*_bytes` as sizes and `*_seconds` as times."""
    if not rows:
        return '<p class="note">No rows.</p>'
    columns: list[str] = []
    for r in rows:
        columns += [k for k in r if k not in columns]
    numeric = {
        k
        for k in columns
        if any(isinstance(r.get(k), int | float) and not isinstance(r.get(k), bool) for r in rows)
    }
    body = [
        "<tr>"
        + "".join(
            f'<td class="num">{_e(_cell(k, r.get(k)))}</td>'
            if k in numeric
            else f"<td>{_e(_cell(k, r.get(k)))}</td>"
            for k in columns
        )
        + "</tr>"
        for r in rows
    ]
    return _table(
        [(_header_text(k), "num" if k in numeric else "") for k in columns], body, "compact"
    )


def _header_text(key: str) -> str:
    """A column key as a reader's header: `predicted_peak_bytes` -> "predicted peak"."""
    return key.removesuffix("_bytes").replace("_", " ")


# -- pieces ---------------------------------------------------------------------------------------
def _table(columns: Iterable[tuple[str, str]], body: list[str], cls: str = "") -> str:
    head = "".join(
        f'<th class="{kind}">{_e(name)}</th>' if kind else f"<th>{_e(name)}</th>"
        for name, kind in columns
    )
    attr = f' class="{cls}"' if cls else ""
    return (
        f'<div class="scroll"><table{attr}><thead><tr>{head}</tr></thead>'
        f"<tbody>{''.join(body)}</tbody></table></div>"
    )


def _cell(key: str, value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int | float) and key.endswith("bytes"):
        return format_bytes(value)
    if isinstance(value, int | float) and key.endswith("seconds"):
        return _seconds(value)
    if isinstance(value, int | float) and key.endswith("ratio"):
        return f"{value:.2f}x"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list | tuple | dict):
        return json.dumps(value, default=_jsonable)
    return str(value)


def _chosen_fits(chosen: Plan | None, budget_bytes: int, fit_rows) -> bool:
    """The chosen plan fits: the fit table's auto row says so where there is one, else its
    predicted peak is within the budget."""
    auto = next((r for r in fit_rows or () if r.get("strategy") == "auto"), None)
    if auto is not None:
        return auto.get("fits") == "yes"
    return chosen is not None and chosen.predicted_peak_bytes <= budget_bytes


def _seconds(s: float) -> str:
    """Seconds in s, ms or us with three significant digits."""
    if s == 0:
        return "0"
    if abs(s) >= 1:
        return f"{s:.3g} s"
    if abs(s) >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} \N{MICRO SIGN}s"


#: Points of a timeline in the data block: the live bytes are max-pooled down to this many.
TIMELINE_POINTS = 400


def _timeline_data(label: str, timeline: Iterable[int]) -> dict[str, Any]:
    """A timeline for the data block: its peak exactly, and the live bytes max-pooled over runs of
    `stride` positions (at most `TIMELINE_POINTS` points: the page is for reading)."""
    live = list(timeline)
    stride = max(1, -(-len(live) // TIMELINE_POINTS))
    return {
        "label": label,
        "peak_bytes": max(live, default=0),
        "positions": len(live),
        "stride": stride,
        "live_bytes": [max(live[i : i + stride]) for i in range(0, len(live), stride)],
    }


def _plan_summary(p: Plan, step: float, whole: bool = False) -> dict[str, Any]:
    """A plan's figures for the data block; `whole` adds its reason and regions (the chosen plan:
    the others' would make the page mostly data)."""
    figures = {
        "strategy": p.strategy,
        "predicted_peak_bytes": p.predicted_peak_bytes,
        "held_bytes": p.held_bytes,
        "recompute_flops": p.recompute_flops,
        "recompute_flops_share": p.recompute_flops_share,
        "recompute_seconds": p.recompute_seconds,
        "step_time_overhead": p.recompute_seconds / step if step else None,
        "status": p.status,
        "appliable": p.appliable,
    }
    if not whole:
        return figures
    return figures | {
        "reason": p.reason,
        "regions": [{"modules": list(r.modules), "keep": list(r.keep)} for r in p.regions],
    }


def _jsonable(value: Any) -> Any:
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if isinstance(value, set | frozenset | tuple):
        return list(value)
    return str(value)


def _e(text: Any) -> str:
    return html.escape(str(text), quote=True)


_SVG_DROP = (
    re.compile(r"<metadata>.*?</metadata>\s*", re.DOTALL),
    re.compile(r'\s+xmlns(?::\w+)?="[^"]*"'),
    re.compile(r'\s+version="1\.1"'),
)


def _svg(fig, key: str) -> str:
    """`fig` as inline SVG for an HTML page: text kept as text, no XML prolog, no namespaces or
    metadata (nothing that names a URL), ids prefixed with `key` so that several figures on one
    page do not share any, sized by the page (its viewBox kept)."""
    import matplotlib

    buf = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": f"remat-{key}"}):
        fig.savefig(buf, format="svg", metadata={"Date": None})
    text = buf.getvalue()
    text = text[text.index("<svg") :]
    for pattern in _SVG_DROP:
        text = pattern.sub("", text)
    text = text.replace("xlink:href=", "href=")
    text = re.sub(r'\bid="', f'id="{key}-', text)
    text = text.replace('href="#', f'href="#{key}-').replace("url(#", f"url(#{key}-")
    # Never wider than drawn (text stays the size it was laid out at), narrower on a small window.
    size = re.match(r'<svg\s+width="([0-9.]+)pt"\s+height="[^"]*"', text)
    width = f' style="max-width: {float(size.group(1)) * 4 / 3:.0f}px"' if size else ""
    text = re.sub(
        r'<svg\s+width="[^"]*"\s+height="[^"]*"',
        f'<svg class="fig" role="img" aria-label="{_e(key)}"{width}',
        text,
        count=1,
    )
    return text.strip()
