"""Turn results into what a person reads (rich tables) or a program reads (JSON-ready dicts).

The figures (PNGs and the HTML report's) are drawn in `remat.answers.plots`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.measure import Measurement
from rich.table import Table

from remat.graph import Graph
from remat.planning.planner import Comparison
from remat.planning.plans import Plan
from remat.prediction.estimate import MemoryEstimate
from remat.units import format_bytes

if TYPE_CHECKING:
    from rich.console import Console

    from remat.prediction.compiled_estimate import CompiledEstimate


def block_activation_bytes(graph: Graph, est: MemoryEstimate) -> list[tuple[str, int]]:
    """Saved bytes of each repeated block (transformer layer, ...), in forward order."""
    by_module = {m.module: m.activation_bytes for m in est.by_module}
    return [(b.path, by_module.get(b.path, 0)) for b in graph.blocks]


def estimate_dict(
    graph: Graph,
    est: MemoryEstimate,
    compiled: CompiledEstimate | None = None,
    **context: Any,
) -> dict[str, Any]:
    """The `remat estimate --json` object; with `compiled` (`--compile`), its `compiled` object."""
    blocks = block_activation_bytes(graph, est)
    return {
        **context,
        **({"compiled": compiled.to_dict()} if compiled is not None else {}),
        "activation_bytes": est.activation_bytes,
        "peak_bytes": est.peak_bytes,
        "param_bytes": est.param_bytes,
        "buffer_bytes": est.buffer_bytes,
        "input_bytes": est.input_bytes,
        "grad_bytes": est.grad_bytes,
        "optimizer_state_bytes": est.optimizer_state_bytes,
        "paged_optimizer_state_bytes": est.paged_optimizer_state_bytes,
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


def gpu_memory_table(memories: list[Any], title: str) -> Table:
    """A step as the GPU reports it (`remat.prediction.gpu_memory.GpuMemory`), one column per allocator
    setting: the figures torch and nvidia-smi print, and the lines outside the allocator."""
    table = Table(title=title, title_justify="left")
    table.add_column("what", no_wrap=True)
    for m in memories:
        table.add_column(m.settings, justify="right", no_wrap=True)
    table.add_column("torch / tool", style="dim")
    lines = [
        ("requested (live tensors)", "requested_bytes", "memory_stats requested_bytes.all.peak"),
        ("allocated", "allocated_bytes", "max_memory_allocated()"),
        ("reserved", "reserved_bytes", "max_memory_reserved()"),
        ("  of which BLAS workspaces", "blas_workspace_bytes", "cuBLAS + cuBLASLt"),
        ("CUDA context", "context_bytes", "outside the allocator"),
        ("NCCL buffers", "nccl_bytes", "outside the allocator"),
        ("nvidia-smi used", "nvidia_smi_bytes", "reserved + context + NCCL"),
        ("allocator limit", "limit_bytes", "total_memory - context - NCCL"),
    ]
    for label, attr, note in lines:
        table.add_row(label, *(format_bytes(getattr(m, attr)) for m in memories), note)
    table.add_row(
        "[bold]fits[/bold]",
        *("[green]yes[/green]" if m.fits else "[red]no: out of memory[/red]" for m in memories),
        "reserved within the limit",
    )
    return table


def estimate_tables(
    graph: Graph,
    est: MemoryEstimate,
    title: str,
    top: int = 12,
    compiled: CompiledEstimate | None = None,
) -> list[Table]:
    """Totals, the largest modules by saved bytes (blocks summarised), and the largest op types;
    with `compiled`, the compiled step's peak under the eager one."""
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
    if est.paged_optimizer_state_bytes:  # unified memory: not in the peak, nor the allocator's
        rows.append(
            (
                "paged optimizer state",
                est.paged_optimizer_state_bytes,
                "CUDA unified memory, outside the peak",
            )
        )
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
    if compiled is not None:
        change = compiled.peak_bytes / est.peak_bytes - 1 if est.peak_bytes else 0.0
        totals.add_row(
            f"[bold]peak, torch.compile ({compiled.mode}"
            + (f" + {compiled.ac} AC" if compiled.ac else "")
            + ")[/bold]",
            f"[bold]{format_bytes(compiled.peak_bytes)}[/bold]",
            f"{change:+.1%} vs eager, {compiled.peak_phase}; {compiled.backend}, "
            f"{compiled.graphs_compiled} graph(s) generated",
        )

    modules = Table(title="Saved bytes by module (one block broken down)", title_justify="left")
    modules.add_column("module", no_wrap=True)
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
    ops.add_column("op", no_wrap=True)
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
    t.caption = (
        "peak: the step's predicted highest memory; kept for backward: activations live when the "
        "forward ends; recompute FLOPs: extra forward work, share of the forward's; step time: "
        "predicted change"
    )
    t.caption_justify = "left"
    t.add_column("strategy", no_wrap=True)  # names are never cut
    offloads = any(row.plan is not None and row.plan.offload for row in rows)
    columns = ["peak", "kept for backward", "recompute FLOPs", "step time"]
    if offloads:  # offload (docs/offload.md): host memory, and the copies no compute hides
        columns[3:3] = ["host memory", "copies not hidden"]
        t.caption += "; host memory: offloaded activations; copies not hidden: step time they add"
    for col in columns:
        t.add_column(col, justify="right")
    t.add_column("vs budget")
    for row in rows:
        name, p, note = row.strategy, row.plan, row.note
        if p is None:
            t.add_row(name, *["-"] * len(columns), f"[dim]{note}[/dim]")
            continue
        host = []
        if offloads:
            host = [format_bytes(p.host_bytes), f"{p.transfer_seconds * 1e3:.3g} ms"]
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
            *host,
            f"{p.added_seconds / step_seconds:+.1%}" if step_seconds else "-",
            note,
        )
    return t


def plan_dict(plan, **context) -> dict[str, Any]:
    """The `remat plan --json` object."""
    d = plan.to_dict()
    d.pop("details", None)
    return {**context, **d, "recompute_flops_share": plan.recompute_flops_share}


def compact_table(title: str) -> Table:
    """A table with a rule under its header and no frame: the most columns in a narrow terminal."""
    from rich import box

    return Table(
        title=title,
        title_justify="left",
        caption_justify="left",
        caption_style="",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        padding=(0, 1),
        collapse_padding=True,
        pad_edge=False,
    )


def fitting_table(
    console: Console, title: str, headers: list[str], rows: list[list[str]], caption: str = ""
) -> Table:
    """`rows` under `headers` (the first column names each row) as a table no cell of which the
    console cuts: as given where it is wide enough, else turned on its side, one column per row
    (its name broken after a `:`) and one row per header, which needs about the widest row's name
    and figures, not every column's. Cells never wrap, so a number stays whole."""
    table = compact_table(title)
    for i, header in enumerate(headers):
        table.add_column(header, justify="left" if i == 0 else "right", no_wrap=True)
    for row in rows:
        table.add_row(*row)
    table.caption = caption
    needed = Measurement.get(console, console.options.update_width(10_000), table).minimum
    if needed <= console.width:
        return table
    turned = compact_table(title)
    turned.add_column(headers[0], justify="left", no_wrap=True)
    for row in rows:
        turned.add_column(row[0].replace(":", ":\n", 1), justify="right", no_wrap=True)
    for i, header in enumerate(headers[1:], start=1):
        turned.add_row(header.replace("-\n", "").replace("\n", " "), *(row[i] for row in rows))
    turned.caption = caption
    return turned


def bench_table(rows, title: str, budget_bytes: int | None = None) -> Table:
    """Measured against predicted, per strategy, with store_all as the reference.

    "step ms" is the median step time over the timing rounds and "min-max" its fastest and
    slowest round; "ratio" is the median over store_all's median, marked "~" where the row is
    within noise of store_all (the middle halves of their rounds overlap: the rounds cannot tell
    them apart) and "!" where its own rounds are more than 1.5x apart (noisy, with a note to
    re-run). Rows whose measured peak is over `budget_bytes` are named under the table. Numeric
    cells never wrap or truncate: on a narrow console only the strategy
    column folds. Notes (why a row was not measured, what a compiled row ran) are listed under
    the table, each after its row's name; rows without a measurement show "-"."""
    from rich.text import Text

    t = compact_table(title)
    t.add_column("strategy", overflow="fold")
    for col in (
        "held\nMiB",
        "peak\nMiB",
        "predicted\nMiB",
        "step ms\nmedian",
        "\nmin-max",
        "\nratio",
        "grad diff\n(rel.)",
    ):
        t.add_column(col, justify="right", no_wrap=True)
    mib = 2**20
    notes = Text()
    over: list[str] = []
    noisy: list[str] = []  # said once under the table, not once a row
    for r in rows:
        note = r.note
        if budget_bytes is not None:  # the caption names every row over the budget, once
            note = "; ".join(p for p in note.split("; ") if not p.startswith("over the budget"))
        if note and note != r.strategy:
            notes.append(f"\n{r.strategy}: ", style="bold")
            notes.append(note)
        if r.peak_bytes is None:
            t.add_row(r.strategy, *["-"] * 7, style="dim")
            continue
        low = getattr(r, "step_seconds_min", None)  # rows from before the spread had none
        high = getattr(r, "step_seconds_max", None)
        noise = "~" if getattr(r, "within_noise", None) and r.strategy != "store_all" else ""
        if getattr(r, "noisy", False):
            noise = "!" + noise
            noisy.append(f"{r.strategy} ({_ms(low)}-{_ms(high)} ms)")
        t.add_row(
            r.strategy,
            f"{r.held_bytes / mib:.1f}",
            f"{r.peak_bytes / mib:.1f}",
            f"{r.predicted_peak_bytes / mib:.1f}" if r.predicted_peak_bytes else "-",
            _ms(r.step_seconds) if r.step_seconds is not None else "-",
            f"{_ms(low)}-{_ms(high)}" if low is not None and high is not None else "-",
            f"{noise}{r.time_ratio:.2f}x" if r.time_ratio else "-",
            _grad_cell(r),
        )
        vs_compiled = getattr(r, "grad_vs_compiled_rel_diff", None)
        if vs_compiled is not None and r.strategy != "torch.compile@1" and r.grad_max_abs_diff:
            notes.append(f"\n{r.strategy}: ", style="bold")
            notes.append(f"grad diff {vs_compiled:.1e} from torch.compile@1's (relative)")
        if budget_bytes is not None and r.peak_bytes > budget_bytes:
            over.append(r.strategy)
    t.caption = Text.assemble(
        "held = bytes live for the backward when the forward ends; predicted = remat's peak; "
        "ratio = median step / store_all's median; ~ = within noise of store_all (the middle "
        "halves of their rounds overlap); ! = noisy rounds; grad diff = max |g - g_store_all| / "
        "max |g_store_all|",
        *(
            [
                f"; over the budget of {format_bytes(budget_bytes)} (measured peak): {', '.join(over)}"
            ]
            if over
            else []
        ),
        notes,
        *(
            [
                "\nnoisy rounds, more than 1.5x apart (the machine was busy: re-run with more "
                f"--steps on an idle machine before reading their ratios): {', '.join(noisy)}"
            ]
            if noisy
            else []
        ),
    )
    return t


def _grad_cell(row) -> str:
    """The gradient difference from store-all's, relative to its largest gradient (an absolute
    4e-1 on gradients near 5e4 is rounding); the absolute one where no relative one was kept."""
    rel = getattr(row, "grad_max_rel_diff", None)
    if rel is not None:
        return f"{rel:.1e}"
    return f"{row.grad_max_abs_diff:.1e}" if row.grad_max_abs_diff is not None else "-"


def _ms(seconds: float) -> str:
    """Milliseconds with about three significant digits, never in exponent form."""
    ms = seconds * 1e3
    return f"{ms:.0f}" if ms >= 100 else f"{ms:.1f}" if ms >= 10 else f"{ms:.2f}"


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
