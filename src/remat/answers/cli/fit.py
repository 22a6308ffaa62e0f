"""`remat fit`: whether a step fits a GPU, with which strategy, and at what batch and sequence;
the fit table `remat report --gpu` adds comes from here too."""

from __future__ import annotations

import argparse
import json
import shlex
from typing import Any

from rich.console import Console
from rich.markup import escape

from remat.answers.cli.common import layout_of, loop_of, model_name, model_overrides, writable
from remat.errors import RematError


def _fit_caption(report: Any) -> str:
    """What the fit table's columns mean and how usable memory was reckoned: under the table in
    the terminal and on the page."""
    from remat.units import format_bytes

    if any(r.gpu_memory for r in report.rows):
        limit = report.rows[0].gpu_memory[0]["limit_bytes"] if report.rows[0].gpu_memory else 0
        judged = (
            "peak: live tensors; allocated / reserved: the CUDA caching allocator simulated (OOM: "
            "it ran out of memory), expandable: reserved with expandable_segments:True; fits: "
            f"{report.allocator} ({format_bytes(limit)} = total_memory "
            f"{format_bytes(report.capacity_bytes)} - CUDA context - NCCL buffers; nvidia-smi "
            "shows reserved + context; --json's bytes_legend names torch's statistic of each)"
        )
    else:
        judged = (
            f"fits: {report.allocator}; usable {format_bytes(report.usable_bytes)} = capacity "
            f"{format_bytes(report.capacity_bytes)} - reserve {format_bytes(report.reserve_bytes)}"
        )
    if "stages" in report.extra:  # a pipeline: stage traces, micro-batches, no sequence search
        searched = (
            f"max micro-batch on the line through two traced sizes; {report.traces} stage "
            f"traces in {report.seconds:.0f} s"
        )
    else:
        searched = (
            f"max seq in steps of 64; {report.traces} step{'s' if report.traces != 1 else ''} "
            f"traced in {report.seconds:.0f} s"
        )
    depth = report.extra.get("depth")
    if depth is not None and depth["traced"] == "replicated":
        searched += (
            " ("
            + ", ".join(
                f"{s['traced']} of {s['layers']} blocks traced, the rest laid out"
                for s in depth["stacks"].values()
            )
            + "; --full-trace traces every block)"
        )
    elif depth is not None and depth["reason"]:
        searched += f" (every block traced: {depth['reason']})"
    return f"{judged}; step time: predicted recompute on the {report.profile} profile; {searched}"


def _fit_command(args: argparse.Namespace, setup: dict[str, Any]) -> str:
    """The `remat fit` command of these arguments under another precision, optimizer and rank
    count: what the advice says fits, to run as printed."""
    parts = ["remat", "fit", "--model", args.model, "--batch", str(setup.get("batch", args.batch))]
    parts += ["--seq", str(args.seq)]
    parts += ["--capacity", args.capacity] if args.capacity else []
    parts += ["--gpu", args.gpu] if args.gpu else []
    parts += ["--precision", setup["precision"], "--optimizer", setup["optimizer"] or "none"]
    parts += ["--shard", str(setup["shard"])] if setup["shard"] > 1 else []
    for unit in getattr(args, "fsdp_unit", []) if setup["shard"] > 1 else []:
        parts += [
            "--fsdp-unit",
            ",".join(unit.paths) + ("" if unit.reshard_after_forward else ":keep"),
        ]
    for flag in ("tp", "cp", "pp"):  # the layout asked, or the one found
        degree = setup.get(flag, getattr(args, flag, 1))
        parts += [f"--{flag}", str(degree)] if degree > 1 else []
    if setup.get("pp", getattr(args, "pp", 1)) > 1:
        microbatches = setup.get("microbatches", getattr(args, "microbatches", None))
        parts += ["--microbatches", str(microbatches)] if microbatches else []
        parts += ["--schedule", setup.get("schedule", getattr(args, "schedule", "1f1b"))]
    parts += ["--reserve", str(args.reserve)] if getattr(args, "reserve", None) else []
    for flag in ("torch_version", "cuda_context"):
        value = getattr(args, flag, None)
        parts += [f"--{flag.replace('_', '-')}", value] if value is not None else []
    parts += ["--tiny"] if args.tiny else []
    parts += ["--optimizer-in-backward"] if getattr(args, "optimizer_in_backward", False) else []
    parts += ["--keep-grads"] if getattr(args, "keep_grads", False) else []
    accumulation = getattr(args, "grad_accumulation", 1)
    parts += ["--grad-accumulation", str(accumulation)] if accumulation > 1 else []
    parts += ["--keep-logits"] if getattr(args, "keep_logits", False) else []
    chunks = getattr(args, "loss_chunks", None)
    parts += ["--loss-chunks", str(chunks)] if chunks is not None else []
    for item in args.set or []:
        parts += ["--set", item]
    return " ".join(shlex.quote(p) for p in parts)


def gpu_of(args: argparse.Namespace) -> Any:
    """The GPU `--gpu` names, sized by `--capacity` where given (h100's architecture if unnamed),
    under the torch of `--torch-version` and with the CUDA context of `--cuda-context`."""
    from dataclasses import replace

    from remat.device.gpus import get_gpu, with_capacity
    from remat.units import parse_bytes

    gpu = with_capacity(args.gpu or "h100", args.capacity) if args.capacity else get_gpu(args.gpu)
    version = getattr(args, "torch_version", None)
    if version is not None:
        parts = version.split(".")
        if len(parts) < 2 or not all(p.isdigit() for p in parts[:2]):
            raise RematError(f"--torch-version {version!r}: give major.minor, e.g. 1.10")
        gpu = replace(gpu, torch_version=(int(parts[0]), int(parts[1])))
    context = getattr(args, "cuda_context", None)
    if context is not None:
        gpu = replace(gpu, context_bytes=parse_bytes(context))
    return gpu


def fit_report(
    args: argparse.Namespace,
    console: Console,
    precision: str,
    shard: int,
    compile: str | None = None,
    ac: str | None = None,
):
    """`remat.answers.fit` of the model the arguments name on `--gpu` (or `--capacity`); `compile`: also
    the step under torch.compile (`whole` or `blocks`, each block checkpointed as `ac` names)."""
    from remat import models
    from remat.answers.fit import fit
    from remat.answers.fit_steps import PRECISIONS

    if getattr(args, "batch", None) is None:  # one sample a micro-batch
        args.batch = layout_of(args).microbatches if getattr(args, "pp", 1) > 1 else 1
    gpu = gpu_of(args)
    overrides = model_overrides(args)

    def build_for(precision: str):
        def build(batch: int, seq: int):
            model, inputs = models.build(
                args.model,
                batch=batch,
                seq=seq,
                dtype=PRECISIONS[precision].param_dtype,
                tiny=args.tiny,
                **overrides,
            )
            return PRECISIONS[precision].prepare(model), inputs

        return build

    optimizer = getattr(args, "optimizer", None)
    with console.status("tracing ...") as status:
        return fit(
            build_for(precision),
            model=args.model,
            batch=args.batch,
            seq=args.seq,
            gpu=gpu,
            precision=precision,
            optimizer=None if optimizer == "none" else optimizer,
            shard=shard,
            reserve=getattr(args, "reserve", None),
            compile=compile,
            ac=ac,
            progress=lambda text: status.update(text),
            build_for=build_for,
            layout=layout_of(args),
            loop=loop_of(args),
            full_trace=getattr(args, "full_trace", False),
            compiled_maxima=not getattr(args, "quick", False),  # REMAT_QUICK=1: the asked size
            fsdp_units=getattr(args, "fsdp_unit", []),
        )


def fit_cells(report: Any, batch: int, seq: int, pipeline: bool = False):
    """The fit table's headers and rows of cells (markup), one row per strategy."""
    from remat.units import format_bytes

    simulated = any(r.gpu_memory for r in report.rows)
    headers = [
        "strategy",
        "peak\n(live)",
        "fits",
        "step\ntime",
        f"max batch\n(seq {seq})",
        f"max seq\n(batch {batch})",
    ]
    if pipeline:  # micro-batches, no sequence search
        headers[-2:] = [f"max micro-\nbatch (seq {seq})"]
    if simulated:
        headers[2:2] = ["allocated", "reserved", "expand-\nable"]
    rows = []
    for r in report.rows:
        # a simulation that ran out of memory stopped at the limit: its peaks are not the step's
        memory = [
            "OOM" if m["out_of_memory"] else format_bytes(m[k])
            for m in r.gpu_memory[:1]
            for k in ("allocated_bytes", "reserved_bytes")
        ]
        expandable = [
            "OOM" if m["out_of_memory"] else format_bytes(m["reserved_bytes"])
            for m in r.gpu_memory[1:2]
        ]
        rows.append(
            [
                r.strategy,
                "-" if r.peak_bytes is None else format_bytes(r.peak_bytes),
                *((memory or ["-", "-"]) + (expandable or ["-"]) if simulated else []),
                "[green]yes[/green]" if r.fits else "[red]no[/red]",
                "-" if r.overhead is None else f"+{r.overhead:.1%}",
                str(r.max_batch) if r.max_batch else "-",
                *([] if pipeline else [str(r.max_seq) if r.max_seq else "-"]),
            ]
        )
    return headers, rows


def cmd_fit(args: argparse.Namespace, console: Console) -> int:
    from remat.answers.report import fitting_table

    writable(args.html, "--html")
    if args.ac and not args.compile:
        raise RematError(
            f"--ac {args.ac} checkpoints each block before it is compiled: add --compile whole "
            "or blocks (the eager rows of fit price every strategy without it)"
        )
    report = fit_report(args, console, args.precision, args.shard, args.compile, args.ac)
    offloaded = _offload_answer(args, console, report)
    gpu = report.gpu
    found = report.extra.get("setup_that_fits")
    laid_out = report.extra.get("layout_that_fits")
    if laid_out:  # a pipeline that fits laid out otherwise, asked precision and ranks
        found = {"precision": args.precision, "optimizer": report.optimizer, "shard": args.shard}
        found |= {k: laid_out[k] for k in ("tp", "pp", "microbatches", "schedule")}
        # the same micro-batch, so the step's batch grows with the micro-batches
        found["batch"] = report.extra["microbatch"] * laid_out["microbatches"]
    run = [f"run: {_fit_command(args, found)}"] if found else []
    if args.html:
        from remat.answers.fit_steps import PRECISIONS
        from remat.answers.html import write_report
        from remat.answers.per_rank import RankView

        # the page answers for the step the table judges: one rank's, under remat's plan
        auto = next((r.solved for r in report.rows if r.strategy == "auto"), None)
        write_report(
            args.html,
            report.planner,
            title=f"{model_name(args)}, batch {report.batch}, seq {args.seq}, {args.precision} on {gpu}"
            + (" (its step: the tightest rank's first stage)" if "stages" in report.extra else ""),
            budget_bytes=report.usable_bytes,
            chosen=auto,
            fit_rows=report.table_rows(),
            advice=[*report.advice, *run],
            fit_caption=_fit_caption(report),
            rank=RankView(
                report.planner,
                report.shard,
                PRECISIONS[report.precision].master_scale,
                report.layout,
            ),
        )
    if args.json:
        # the advice as data: its lines, the line that applies it, the command that fits
        answer = report.to_dict() | {"run": run[0].removeprefix("run: ") if run else None}
        if offloaded is not None:
            answer["offload"] = offloaded.to_dict()
        print(json.dumps(answer, indent=2))
        return 0
    micro = report.extra.get("microbatch")
    batch = f"batch {report.batch}" + (
        f" ({report.batch // micro} micro-batches of {micro})" if micro is not None else ""
    )
    title = (
        f"{model_name(args)}, {batch}, seq {args.seq}, {args.precision}, "
        f"{report.optimizer or 'no optimizer'}, on {gpu}"
        + (f", sharded over {args.shard} ranks" if args.shard > 1 else "")
        + (f", {report.layout}" if report.layout else "")
        + (" (per-rank figures)" if args.shard > 1 or report.layout else "")
    )
    headers, rows = fit_cells(report, report.batch, report.seq, pipeline=getattr(args, "pp", 1) > 1)
    table = fitting_table(console, title, headers, rows, _fit_caption(report))
    console.print(table)
    by_note: dict[str, list[str]] = {}
    for r in report.rows:
        if r.note:
            by_note.setdefault(r.note, []).append(r.strategy)
    for note, names in by_note.items():  # each fact once
        who = "every row" if len(names) == len(report.rows) > 1 else ", ".join(names)
        console.print(f"[dim]{escape(who)}: {escape(note)}[/dim]")
    _print_stages(console, report)
    for line in offloaded.lines() if offloaded is not None else ():
        console.print(f"[bold]offload:[/bold] {escape(line)}")
    for line in report.advice:
        console.print(f"[bold]advice:[/bold] {escape(line)}")
    for line in run:
        console.print(f"[bold]run:[/bold] {escape(line.removeprefix('run: '))}", soft_wrap=True)
    if args.html:
        console.print(f"report written to {escape(args.html)}")
    return 0


def _offload_answer(args: argparse.Namespace, console: Console, report: Any) -> Any:
    """With --offload: the plan with offload at full checkpointing's per-rank peak
    (`remat.answers.fit_offload`); None without it."""
    from remat.answers.cli.common import offload_settings
    from remat.answers.fit_offload import offload_at_full
    from remat.answers.fit_steps import PRECISIONS

    gpu = gpu_of(args)
    settings = offload_settings(args, gpu.profile)
    if settings is None:
        return None
    if report.planner is None or getattr(args, "pp", 1) > 1:
        raise RematError("--offload plans one rank's whole step: leave it out with --pp")
    with console.status("planning offload at full checkpointing's peak ..."):
        return offload_at_full(
            report.planner,
            gpu,
            shard=args.shard,
            optimizer=report.optimizer,
            master_scale=PRECISIONS[args.precision].master_scale,
            host_memory_bytes=settings.host_budget_bytes if args.host_memory else None,
        )


def _print_stages(console: Console, report: Any) -> None:
    """A pipeline's stages under remat's plan (auto), or the first strategy fitted: per stage,
    its rank, blocks, micro-batches in flight, bytes held per micro-batch, fixed bytes and its
    rank's peak; and the most micro-batches each strategy fits."""
    from remat.answers.report import fitting_table

    stages = report.extra.get("stages")
    if not stages:
        return
    name = "auto" if "auto" in stages else next(iter(stages))
    rows = stages[name]
    cells = [[escape(v) for v in row.values()] for row in rows]
    console.print(fitting_table(console, f"stages under {name}, per rank", list(rows[0]), cells))
    counts = report.extra.get("max_microbatches", {})
    if counts:
        most = ", ".join(f"{k} {v if v else '-'}" for k, v in counts.items())
        console.print(f"[dim]most micro-batches that fit (up to 1024): {escape(most)}[/dim]")
