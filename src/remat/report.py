"""Turn results into what a person reads (rich tables) or a program reads (JSON-ready dicts)."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from remat.estimate import MemoryEstimate
from remat.graph import Graph
from remat.planner import Comparison, Frontier
from remat.plans import Plan
from remat.units import format_bytes


def block_activation_bytes(graph: Graph, est: MemoryEstimate) -> list[tuple[str, int]]:
    """Saved bytes of each repeated block (transformer layer, ...), in forward order."""
    by_module = {m.module: m.activation_bytes for m in est.by_module}
    return [(b.path, by_module.get(b.path, 0)) for b in graph.blocks]


def estimate_dict(graph: Graph, est: MemoryEstimate, **context: Any) -> dict[str, Any]:
    """The `remat estimate --json` object."""
    blocks = block_activation_bytes(graph, est)
    return {
        **context,
        "activation_bytes": est.activation_bytes,
        "peak_bytes": est.peak_bytes,
        "param_bytes": est.param_bytes,
        "buffer_bytes": est.buffer_bytes,
        "input_bytes": est.input_bytes,
        "grad_bytes": est.grad_bytes,
        "optimizer_state_bytes": est.optimizer_state_bytes,
        "peak_op": est.peak_op,
        "peak_phase": est.peak_phase,
        "param_count": graph.info.get("param_count"),
        "ops": {"forward": len(graph.forward_ops), "backward": len(graph.backward_ops)},
        "per_block_activation_bytes": [{"module": p, "activation_bytes": b} for p, b in blocks],
        "by_module": [
            {"module": m.module or "<model>", "activation_bytes": m.activation_bytes}
            for m in est.by_module
        ],
        "by_op": [
            {"op": o.op, "activation_bytes": o.activation_bytes, "tensors": o.count}
            for o in est.by_op
        ],
    }


def estimate_tables(graph: Graph, est: MemoryEstimate, title: str, top: int = 12) -> list[Table]:
    """Totals, the largest modules by saved bytes (blocks summarised), and the largest op types."""
    totals = Table(title=title, show_header=False, title_justify="left")
    totals.add_column("what", no_wrap=True)
    totals.add_column("bytes", justify="right", no_wrap=True)
    totals.add_column("", style="dim")
    blocks = block_activation_bytes(graph, est)
    rows = [
        ("activations (saved for backward)", est.activation_bytes, "at the end of the forward"),
        ("parameters", est.param_bytes, f"{graph.info.get('param_count', 0):,} params"),
        ("gradients", est.grad_bytes, ""),
        ("optimizer state", est.optimizer_state_bytes, ""),
        ("buffers + inputs", est.buffer_bytes + est.input_bytes, ""),
    ]
    if blocks:
        per = [b for _, b in blocks]
        note = f"{len(per)} blocks" + (
            "" if min(per) == max(per) else f", {min(per):,}..{max(per):,} B"
        )
        rows.insert(1, ("  per block (mean)", sum(per) // len(per), note))
    for what, n, note in rows:
        totals.add_row(what, format_bytes(n), note)
    totals.add_row(
        "[bold]peak of the step[/bold]",
        f"[bold]{format_bytes(est.peak_bytes)}[/bold]",
        f"at {est.peak_op} ({est.peak_phase})",
    )

    modules = Table(title="Saved bytes by module (one block broken down)", title_justify="left")
    modules.add_column("module")
    modules.add_column("saved", justify="right")
    modules.add_column("share", justify="right")
    by_path = {m.module: m.activation_bytes for m in est.by_module}
    first_block = graph.blocks[0].path if graph.blocks else None
    container = first_block.rpartition(".")[0] if first_block else None
    shown = [p for p in by_path if p and p.count(".") == 0 and by_path[p]]
    if first_block:
        depth = first_block.count(".") + 1
        shown += [first_block] + [
            p for p in by_path if p.startswith(first_block + ".") and p.count(".") == depth
        ]
        if container and container not in shown:
            shown.insert(0, container)
    for path in shown[: top + 2]:
        share = by_path[path] / est.activation_bytes if est.activation_bytes else 0.0
        label = f"  {path}" if first_block and path.startswith(first_block + ".") else path
        modules.add_row(label, format_bytes(by_path[path]), f"{share:.1%}")

    ops = Table(title="Saved bytes by op", title_justify="left")
    ops.add_column("op")
    ops.add_column("tensors", justify="right")
    ops.add_column("saved", justify="right")
    for o in est.by_op[:top]:
        ops.add_row(o.op, str(o.count), format_bytes(o.activation_bytes))
    return [totals, modules, ops]


def plan_table(
    rows: list[Comparison], chosen: Plan | None, step_seconds: float, budget_bytes: int
) -> Table:
    """Strategies side by side at one budget: predicted peak, kept bytes, extra FLOPs, time."""
    t = Table(title=f"Strategies at a budget of {format_bytes(budget_bytes)}", title_justify="left")
    for col, just in [
        ("strategy", "left"),
        ("peak", "right"),
        ("held", "right"),
        ("recompute FLOPs", "right"),
        ("time overhead", "right"),
        ("", "left"),
    ]:
        t.add_column(col, justify=just)
    for row in rows:
        name, p, note = row.strategy, row.plan, row.note
        if p is None:
            t.add_row(name, "-", "-", "-", "-", f"[dim]{note}[/dim]")
            continue
        style = (
            "bold green"
            if chosen is not None
            and p.strategy == chosen.strategy.removeprefix("auto (").removesuffix(")")
            else ""
        )
        t.add_row(
            f"[{style}]{name}[/{style}]" if style else name,
            format_bytes(p.predicted_peak_bytes),
            format_bytes(p.held_bytes),
            f"{p.recompute_flops_share:.1%}",
            f"{p.recompute_seconds / step_seconds:+.1%}" if step_seconds else "-",
            note,
        )
    return t


def plan_dict(plan, **context) -> dict[str, Any]:
    """The `remat plan --json` object."""
    d = plan.to_dict()
    d.pop("details", None)
    return {**context, **d, "recompute_flops_share": plan.recompute_flops_share}


def bench_table(rows, title: str) -> Table:
    """Measured against predicted, per strategy, with store_all as the reference."""
    t = Table(title=title, title_justify="left")
    for col in ("strategy", "held MiB", "peak MiB", "predicted", "step ms", "ratio", "grad diff"):
        t.add_column(col, justify="left" if col == "strategy" else "right", no_wrap=True)
    mib = 2**20
    for r in rows:
        if r.peak_bytes is None:
            t.add_row(r.strategy, "-", "-", "-", "-", "-", f"[dim]{r.note[:40]}[/dim]")
            continue
        t.add_row(
            r.strategy,
            f"{r.held_bytes / mib:.1f}",
            f"{r.peak_bytes / mib:.1f}",
            f"{r.predicted_peak_bytes / mib:.1f}" if r.predicted_peak_bytes else "-",
            f"{r.step_seconds * 1e3:.0f}",
            f"{r.time_ratio:.2f}x" if r.time_ratio else "-",
            f"{r.grad_max_abs_diff:.1e}",
        )
    return t


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_frontier(frontier: Frontier, path: str, title: str = "") -> str:
    """A PNG of the predicted frontier (peak vs recompute time) with the fixed strategies marked."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    gib = 2**30
    xs = [p.predicted_peak_bytes / gib for p in frontier.points]
    ys = [p.recompute_seconds * 1e3 for p in frontier.points]
    ax.step(xs, ys, where="post", color="black", label="remat auto (frontier)")
    ax.scatter(xs, ys, color="black", s=12)
    for p in frontier.named:
        ax.scatter(p.predicted_peak_bytes / gib, p.recompute_seconds * 1e3, s=40, marker="D")
        ax.annotate(
            p.strategy,
            (p.predicted_peak_bytes / gib, p.recompute_seconds * 1e3),
            fontsize=8,
            xytext=(4, 4),
            textcoords="offset points",
        )
    ax.set_xlabel("predicted peak of the step (GiB)")
    profile = frontier.points[0].profile if frontier.points else ""
    ax.set_ylabel(f"predicted recompute time (ms, {profile})")
    ax.set_title(title or "memory / recompute frontier")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_bench(rows, frontier: Frontier, step_seconds: float, path: str) -> str:
    """Measured (peak, step-time ratio) of each row over remat's predicted frontier (recompute
    time as a share of the predicted `step_seconds`)."""
    plt = _pyplot()
    mib = 2**20
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.step(
        [p.predicted_peak_bytes / mib for p in frontier.points],
        [1 + p.recompute_seconds / step_seconds for p in frontier.points],
        where="post",
        color="black",
        label="predicted frontier (remat auto)",
    )
    for r in rows:
        if r.peak_bytes is None or r.time_ratio is None:
            continue
        ax.scatter(r.peak_bytes / mib, r.time_ratio, s=40, marker="o")
        ax.annotate(
            r.strategy,
            (r.peak_bytes / mib, r.time_ratio),
            fontsize=8,
            xytext=(4, 4),
            textcoords="offset points",
        )
    ax.set_xlabel("peak of the step (MiB): measured points, predicted line")
    ax.set_ylabel("step time / store_all")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def explain_table(rows: list[dict[str, Any]], top: int = 25) -> Table:
    """The plan's decision for the largest saved tensors."""
    t = Table(
        title=f"Decisions, largest {min(top, len(rows))} of {len(rows)} saved tensors",
        title_justify="left",
    )
    for col, just in [
        ("tensor", "left"),
        ("bytes", "right"),
        ("decision", "left"),
        ("recompute", "right"),
        ("why", "left"),
    ]:
        t.add_column(col, justify=just, no_wrap=col != "why")
    for r in sorted(rows, key=lambda r: -r["bytes"])[:top]:
        t.add_row(
            r["name"],
            format_bytes(r["bytes"]),
            r["decision"],
            f"{r['recompute_seconds'] * 1e6:.0f} us",
            r["why"],
        )
    return t
