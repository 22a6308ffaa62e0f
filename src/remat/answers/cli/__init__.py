"""`remat` command line: a thin layer over the library. Exit codes: 0 ok, 2 bad input, 3 infeasible
budget."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape

from remat._version import __version__
from remat.answers.bench import ROUNDS
from remat.errors import InfeasibleBudget, RematError, exit_code
from remat.prediction.estimate import OPTIMIZERS

if TYPE_CHECKING:
    from remat.graph import Graph
    from remat.planning.planner import Planner
    from remat.prediction.compiled_estimate import CompiledEstimate
    from remat.prediction.estimate import MemoryEstimate

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
DEFAULT_MODEL = {"model": "gpt2", "batch": 4, "seq": 256, "dtype": "fp32"}
#: The demo's model: GPT-2's architecture, narrowed so a real training step takes about a second
#: on a 2-core CPU and activations dominate (so a 50% budget has room to work).
DEMO = {
    "model": "gpt2",
    "batch": 4,
    "seq": 256,
    "dtype": "fp32",
    "set": ["n_layer=6", "n_embd=256", "n_head=8", "vocab_size=4096"],
}
DEMO_STRATEGIES = "store_all,full,sqrt,auto,torch:checkpoint-per-block"

EPILOG = """\
models:  a preset (remat estimate --model list), a Hugging Face type (hf:gpt2, hf:llama; needs
         `pip install 'remat[hf]'`), or your own factory `pkg.module:make_model` returning
         (model, example_inputs).
examples:
  remat demo
  remat estimate --model llama-3.1-70b --batch 1 --seq 8192 --dtype bf16
  remat estimate --model gpt2 --batch 8 --seq 1024 --optimizer adamw --json
"""


PLAN_EXAMPLES = """\
Exit code 3 when nothing fits: the message gives the smallest feasible budget.
examples:
  remat plan --model gpt2 --batch 8 --seq 1024 --budget 50%
  remat plan --model llama-3.1-8b --batch 1 --seq 8192 --dtype bf16 --budget 60GiB --profile h100 --plot pareto.png
"""


def _strategies_help() -> str:
    """The strategies as the registry lists them, one per line, for `remat plan --help`."""
    from remat.planning import strategies

    lines = ["strategies (--strategy):"]
    for s in strategies.available():
        paths = " + ".join(s.paths)
        lines.append(f"  {s.name:<24} {s.summary} [{paths}]")
    return "\n".join(lines) + "\n"


def _add_optimizer_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default=None,
        help="count optimizer state and step in the peak. adamw: torch's default implementation "
        "for the device (foreach on a GPU, for-loop on the CPU); adamw-foreach/-fused/-for-loop "
        "name one (AdamW(foreach=True), fused=True, foreach=False); adamw-8bit: bitsandbytes",
    )


def _add_budget_arg(p: argparse.ArgumentParser) -> None:
    from remat.planning.plans import DEFAULT_BUDGET

    p.add_argument(
        "--budget",
        default=DEFAULT_BUDGET,
        help="the memory budget of the whole step: bytes (40GiB, 512MiB, 1e9); a share (50%%: "
        "the fixed memory of params, grads and optimizer state + 50%% of the rest of store-all's "
        "peak); or a time overhead (+10%%: the lowest peak whose predicted recompute is at most "
        "10%% of the step, always feasible) (default: %(default)s)",
    )


def _add_compile_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--compile",
        choices=["whole", "blocks"],
        help="also predict the step under torch.compile: whole (torch.compile(model)) or blocks "
        "(each block compiled, the rest eager, as torchtitan does); inductor's own buffers, "
        "generated for its CPU backend on fake tensors",
    )
    p.add_argument(
        "--ac",
        choices=["full"],
        help="with --compile blocks: each block under full activation checkpointing before it is "
        "compiled (torchtitan's compile + AC)",
    )


def _add_profile_arg(p: argparse.ArgumentParser) -> None:
    from remat.device.cost import PROFILES

    p.add_argument(
        "--profile",
        default="cpu",
        help=f"cost profile recompute time is predicted on: {', '.join(PROFILES)} "
        "(default: %(default)s)",
    )


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL["model"],
        help="preset, hf:<type> or pkg.module:factory (default: %(default)s); 'list' prints the presets",
    )
    p.add_argument(
        "--batch",
        type=int,
        default=DEFAULT_MODEL["batch"],
        help="batch size (default: %(default)s)",
    )
    p.add_argument(
        "--seq",
        type=int,
        default=DEFAULT_MODEL["seq"],
        help="sequence length; ignored by image models (default: %(default)s)",
    )
    p.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=DEFAULT_MODEL["dtype"],
        help="parameter and activation dtype (default: %(default)s)",
    )
    p.add_argument(
        "--tiny", action="store_true", help="the preset's tiny configuration (for quick checks)"
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a config field of the preset, e.g. --set n_layer=2 for gpt2 or --set "
        "n_layers=2 for llama (repeatable; an unknown field lists the valid ones)",
    )
    p.add_argument(
        "--trace-device",
        default="meta",
        help="meta (default: fake tensors, nothing allocated) or cpu (real tensors: for models with data-dependent shapes)",
    )


def _trace_model(args: argparse.Namespace, console: Console):
    """Build the model named by the arguments and trace one training step of it: (graph, trace
    seconds, (model, inputs))."""
    from remat import models
    from remat.tracing.trace import trace

    if args.model == "list":
        console.print("presets: " + ", ".join(models.preset_names()))
        console.print(
            "Hugging Face, shipped configs (real size, own loss): "
            + ", ".join(f"hf:{n}" for n in models.hf.shipped_names())
        )
        console.print("also: hf:<model_type> (e.g. hf:gpt2, hf:llama), pkg.module:factory")
        raise SystemExit(0)
    device = "meta" if args.trace_device == "meta" else args.trace_device
    model, inputs = models.build(
        args.model,
        batch=args.batch,
        seq=args.seq,
        dtype=DTYPES[args.dtype],
        device=device,
        tiny=args.tiny,
        **models.parse_overrides(args.set),
    )
    where = "fake tensors" if device == "meta" else f"real {device} tensors"
    start = time.perf_counter()
    gpu = getattr(args, "gpu", None)
    target = None
    if gpu is not None and args.command == "estimate":
        from remat.device.gpus import get_gpu

        target = get_gpu(gpu).target
        where += f", with {target.describe()}'s kernels"
    layout = _layout(args)
    with console.status(f"tracing one training step of {args.model} on {where} ..."):
        if layout.ranks > 1:  # one rank's step: estimate --tp / --cp

            def build(batch: int, seq: int):
                return models.build(
                    args.model, batch=batch, seq=seq, dtype=DTYPES[args.dtype], tiny=args.tiny,
                    **models.parse_overrides(args.set),
                )  # fmt: skip

            graph = layout.trace(build, args.batch, args.seq, target=target)
            graph.info["layout"] = layout.describe(graph)
        else:
            graph = trace(model, *inputs, device=device, target=target)
    graph.info.update(
        model=args.model,
        shape=_shape(args, inputs)
        + (f", one rank of {graph.info['layout']}" if "layout" in graph.info else ""),
        batch=args.batch,
        seq=args.seq,
        dtype=args.dtype,
    )
    return graph, time.perf_counter() - start, (model, inputs)


def _shape(args: argparse.Namespace, inputs: tuple) -> str:
    """What was built, for titles: a preset's batch and seq, or a factory's input shapes (it may
    ignore --batch and --seq)."""
    if ":" in args.model and not args.model.startswith("hf:"):
        shapes = [tuple(t.shape) for t in inputs if hasattr(t, "shape")]
        return "inputs " + ", ".join(str(s) for s in shapes)
    return f"batch {args.batch}, seq {args.seq}"


def _title(args: argparse.Namespace, planner: Planner) -> str:
    """The model as built and where it is costed, for titles of tables and plots."""
    shape = planner.graph.info["shape"]
    return f"{_model_name(args)}, {shape}, {args.dtype}, costs on {planner.profile.name}"


def _model_name(args: argparse.Namespace) -> str:
    """The model spec with its overrides: the demo's gpt2 is narrowed, and says so."""
    tiny = " tiny" if args.tiny else ""
    return f"{args.model}{tiny}" + (f" ({', '.join(args.set)})" if args.set else "")


def _writable(path: str | None, option: str) -> None:
    """Refuse an output path whose folder does not exist before the work, not after it."""
    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise RematError(f"{option} {path}: the folder {folder} does not exist; create it first")
    if not os.access(folder, os.W_OK):
        raise RematError(f"{option} {path}: the folder {folder} is not writable")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not at least 1")
    return value


def cmd_estimate(args: argparse.Namespace, console: Console) -> int:
    from remat.prediction.estimate import estimate

    graph, seconds, (model, inputs) = _trace_model(args, console)
    compiled = None
    if args.ac and args.compile != "blocks":
        raise RematError(
            "--ac full checkpoints each block before compiling it: add --compile blocks"
        )
    if args.compile and "layout" in graph.info:
        raise RematError("--compile is predicted on one rank: leave out --tp / --cp")
    if args.compile:
        from remat.prediction.compiled_estimate import estimate_compiled

        with console.status(f"compiling ({args.compile}) on fake tensors with inductor ..."):
            compiled = estimate_compiled(
                graph, model, *inputs, compile=args.compile, optimizer=args.optimizer, ac=args.ac
            )
    est = estimate(graph, optimizer=args.optimizer)
    return _show_estimate(graph, est, args, console, seconds, compiled)


def _gpu_memories(graph: Graph, args: argparse.Namespace) -> list[Any]:
    """The step as `--gpu` would report it, under each allocator setting `remat.prediction.gpu_memory`
    knows (none without --gpu)."""
    if getattr(args, "gpu", None) is None:
        return []
    from remat.prediction.gpu_memory import ALLOCATOR_SETTINGS, gpu_memory

    return [
        gpu_memory(graph, args.gpu, optimizer=args.optimizer, settings=s)
        for s in ALLOCATOR_SETTINGS
    ]


def _show_estimate(
    graph: Graph,
    est: MemoryEstimate,
    args: argparse.Namespace,
    console: Console,
    trace_seconds: float,
    compiled: CompiledEstimate | None = None,
) -> int:
    from remat.answers.report import estimate_dict, estimate_tables

    context = {
        "model": args.model,
        "batch": args.batch,
        "seq": args.seq,
        "dtype": args.dtype,
        "optimizer": args.optimizer,
        "trace_seconds": round(trace_seconds, 3),
    }
    memories = _gpu_memories(graph, args)
    if args.json:
        out = estimate_dict(graph, est, compiled, **context)
        if memories:
            out["gpu"] = args.gpu
            out["gpu_memory"] = [m.to_dict() for m in memories]
        print(json.dumps(out, indent=2))
        return 0
    title = f"{_model_name(args)}, {graph.info['shape']}, {args.dtype}" + (
        f", {args.optimizer}" if args.optimizer else ""
    )
    for table in estimate_tables(graph, est, title, top=args.top, compiled=compiled):
        console.print(table)
    if memories:
        from remat.answers.report import gpu_memory_table

        console.print(gpu_memory_table(memories, f"as {args.gpu} would report it"))
    console.print(
        f"[dim]{len(graph.forward_ops)} forward + {len(graph.backward_ops)} backward ops traced "
        f"in {trace_seconds:.1f} s[/dim]"
    )
    return 0


def _planner(args: argparse.Namespace, console: Console) -> Planner:
    """Trace the model the arguments name and prepare it for planning on `--profile`."""
    from remat.planning.planner import Planner

    graph, seconds, _ = _trace_model(args, console)
    planner = Planner(graph, args.profile, args.optimizer)
    planner.graph.info["trace_seconds"] = seconds
    return planner


def cmd_plan(args: argparse.Namespace, console: Console) -> int:
    from remat.planning import strategies

    strategies.get(args.strategy, "eager")  # bad input fails before the trace
    if getattr(args, "gpu", None) or getattr(args, "capacity", None):
        _report_precision(args)
    _writable(args.out, "--out")
    _writable(args.plot, "--plot")
    _writable(args.html, "--html")
    return _show_plan(_planner(args, console), args, console)


def _show_plan(planner: Planner, args: argparse.Namespace, console: Console) -> int:
    from remat.answers.report import explain_table, plan_dict, plan_table, plot_frontier
    from remat.planning.plans import describe_budget
    from remat.units import format_bytes

    with console.status(f"resolving the budget {args.budget} ..."):
        budget_bytes = planner.budget_bytes(args.budget)
    if not args.json:
        console.print(
            f"budget {args.budget}: {format_bytes(budget_bytes)} ({describe_budget(args.budget)})"
        )
    with console.status(f"planning {args.strategy} under {format_bytes(budget_bytes)} ..."):
        rows = planner.compare(budget_bytes)
        chosen = planner.plan(budget_bytes, args.strategy)
    step_seconds = planner.step_seconds
    context = {
        "model": args.model,
        "batch": args.batch,
        "seq": args.seq,
        "dtype": args.dtype,
        "budget": args.budget,
    }
    if args.out:
        with open(args.out, "w") as f:
            f.write(chosen.to_json())
    if args.plot:
        with console.status("sweeping budgets for the Pareto frontier ..."):
            plot_frontier(
                planner.pareto(),
                args.plot,
                title=f"{_title(args, planner)}: predicted memory / recompute frontier",
                budget_bytes=budget_bytes,
                chosen=chosen,
                step_seconds=step_seconds,
            )
    if args.html:
        from remat.answers.html import write_report

        fitted = None
        if getattr(args, "gpu", None) or getattr(args, "capacity", None):
            fitted = _fit_report(args, console, _report_precision(args), shard=1).table_rows()
        with console.status("writing the HTML report ..."):
            write_report(
                args.html,
                planner,
                title=_title(args, planner),
                budget_bytes=budget_bytes,
                chosen=chosen,
                fit_rows=fitted,
            )
    if args.json:
        d = plan_dict(chosen, **context)
        d["comparison"] = [
            {
                "strategy": row.strategy,
                "note": row.note,
                **(
                    {}
                    if row.plan is None
                    else {
                        "predicted_peak_bytes": row.plan.predicted_peak_bytes,
                        "held_bytes": row.plan.held_bytes,
                        "recompute_flops": row.plan.recompute_flops,
                        "recompute_seconds": row.plan.recompute_seconds,
                    }
                ),
            }
            for row in rows
        ]
        print(json.dumps(d, indent=2))
        return 0
    console.print(plan_table(rows, chosen, step_seconds, budget_bytes))
    if args.explain:
        console.print(explain_table(chosen.explain(planner.graph)))
    console.print(
        f"[bold]chosen: {chosen.strategy}[/bold]: predicted peak {format_bytes(chosen.predicted_peak_bytes)}, "
        f"{_step_time_words(chosen, step_seconds, planner.profile.name)}\n{escape(chosen.reason)}"
    )
    regions = ", ".join(
        r.modules[0]
        + (f"..{r.modules[-1]}" if len(r.modules) > 1 else "")
        + (f" (keeps {len(r.keep)} ops)" if r.keep else "")
        for r in chosen.regions
    )
    console.print(f"checkpoint regions: {escape(regions) or 'none'}")
    if args.out:
        console.print(f"plan written to {escape(args.out)}")
    if args.plot:
        console.print(f"frontier plotted to {escape(args.plot)}")
    if args.html:
        console.print(f"report written to {escape(args.html)}")
    return 0


def cmd_bench(args: argparse.Namespace, console: Console) -> int:
    _writable(args.json, "--json")
    _writable(args.plot, "--plot")
    _writable(args.html, "--html")
    return _show_bench(_planner(args, console), args, console)


def _show_bench(planner: Planner, args: argparse.Namespace, console: Console) -> int:
    from remat import models
    from remat.answers.bench import bench, bench_compiled, progress_total, quartile_range
    from remat.answers.report import bench_table, plot_bench
    from remat.planning.plans import describe_budget
    from remat.units import format_bytes

    model, inputs = models.build(
        args.model,
        batch=args.batch,
        seq=args.seq,
        dtype=DTYPES[args.dtype],
        device=args.device,
        tiny=args.tiny,
        **models.parse_overrides(args.set),
    )
    names = _bench_names(args)
    with console.status(f"resolving the budget {args.budget} ..."):
        budget_bytes = planner.budget_bytes(args.budget)
    console.print(
        f"budget {args.budget}: {format_bytes(budget_bytes)} ({describe_budget(args.budget)}), "
        "for every row"
    )
    with _progress(console, progress_total(names, args.steps, args.compile)) as advance:
        rows = bench(
            model, inputs, planner, names, budget=budget_bytes, steps=args.steps, progress=advance
        )
        if args.compile:
            base = next(r for r in rows if r.strategy == "store_all")
            rows += bench_compiled(
                model,
                inputs,
                budget=budget_bytes,
                steps=args.steps,
                compiler=args.compiler,
                profile=args.profile,
                base_seconds=base.step_seconds,
                base_range=quartile_range(list(base.rounds)),
                progress=advance,
            )
    title = (
        f"{_title(args, planner)}, measured on {args.device}, budget {format_bytes(budget_bytes)}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "model": args.model,
                    "batch": args.batch,
                    "seq": args.seq,
                    "dtype": args.dtype,
                    "device": args.device,
                    "budget": args.budget,
                    "budget_bytes": budget_bytes,
                    "rows": [r.to_dict() for r in rows],
                },
                f,
                indent=2,
            )
    console.print(bench_table(rows, title=title, budget_bytes=budget_bytes))
    failed = [r for r in rows if not r.ran]
    if failed:
        console.print(
            f"[yellow]{len(failed)} of {len(rows)} rows could not run:[/yellow] "
            + escape("; ".join(f"{r.strategy} ({r.note.split(';')[0]})" for r in failed))
        )
    if args.plot:
        plot_bench(
            rows,
            planner.pareto(),
            planner.step_seconds,
            args.plot,
            title=title,
            budget_bytes=budget_bytes,
        )
        console.print(f"plot written to {escape(args.plot)}")
    if args.html:
        from remat.answers.html import write_report

        write_report(args.html, planner, title=title, budget_bytes=budget_bytes, bench_rows=rows)
        console.print(f"report written to {escape(args.html)}")
    return 0


#: What `remat bench` compares by default: remat's plans and the baselines users write.
BENCH_STRATEGIES = (
    "store_all,full,sqrt,selective:megatron,chain_dp,auto,"
    "torch:checkpoint-per-block,torch:checkpoint_sequential"
)


def _bench_names(args: argparse.Namespace) -> list[str]:
    """The rows to measure: --strategies, or the defaults plus Hugging Face's own gradient
    checkpointing for hf: models (the only ones it applies to)."""
    text = args.strategies or BENCH_STRATEGIES + (
        ",hf:gradient_checkpointing" if args.model.startswith("hf:") else ""
    )
    return [s.strip() for s in text.split(",") if s.strip()]


@contextlib.contextmanager
def _progress(console: Console, total: int) -> Iterator[Callable[[str], None]]:
    """A progress bar on a terminal; on a pipe (where rich draws nothing) one line per step on
    stderr, so a long bench shows that it moves."""
    from rich.progress import Progress

    if not console.is_terminal:
        done = 0

        def line(name: str) -> None:
            nonlocal done
            done += 1
            print(f"[{done}/{total}] measuring {name}", file=sys.stderr, flush=True)

        yield line
        return
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task("measuring", total=total)
        yield lambda name: bar.update(task, advance=1, description=f"measuring {name}")


def cmd_demo(args: argparse.Namespace, console: Console) -> int:
    from pathlib import Path

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    demo = argparse.Namespace(
        **DEMO,
        tiny=False,
        trace_device="meta",
        optimizer=None,
        profile="cpu",
        json=False,
        top=6,
        budget="50%",
        strategy="auto",
        explain=False,
        out=str(out / "plan.json"),
        plot=str(out / "pareto.png"),
        strategies=DEMO_STRATEGIES,
        device="cpu",
        steps=5,
        compile=False,
        compiler="inductor",
        html=None,
    )
    console.rule("1. estimate: activation memory and the peak of a training step (fake tensors)")
    planner = _planner(demo, console)  # one trace and one frontier for the three steps
    _show_estimate(
        planner.graph, planner.estimate, demo, console, planner.graph.info["trace_seconds"]
    )
    console.rule("2. plan: every strategy at a 50% budget, and the Pareto frontier")
    _show_plan(planner, demo, console)
    console.rule("3. apply and measure: real CPU steps, side by side with the baselines")
    demo.json, demo.plot = str(out / "bench.json"), str(out / "bench.png")
    _show_bench(planner, demo, console)
    console.print(
        f"[bold]results in {escape(str(out))}/[/bold]: plan.json, pareto.png, bench.json, bench.png"
    )
    return 0


def _report_precision(args: argparse.Namespace) -> str:
    """The fit precision of `remat report --gpu`: the model's --dtype, where fit has it."""
    from remat.answers.fit import PRECISIONS

    if args.dtype not in PRECISIONS:
        raise RematError(
            f"the report's fit table runs at --dtype fp32 or bf16, not {args.dtype}; "
            "`remat fit --precision ...` covers mixed precision"
        )
    return args.dtype


def _step_time_words(plan: Any, step_seconds: float, profile: str) -> str:
    """What a plan costs, time first: FLOPs alone mislead where the recomputed ops move memory
    (norms, activations) rather than multiply."""
    if not plan.recompute_seconds:
        return "no recompute"
    time = (
        f"{plan.recompute_seconds / step_seconds:+.1%} predicted step time on the {profile} profile"
    )
    share = plan.recompute_flops_share
    if share < 0.005:
        return f"{time} (the recomputed ops move memory; they add almost no FLOPs)"
    return f"{time} (recomputing {share:.1%} of the forward's FLOPs)"


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
            "shows reserved + context, see --json)"
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
    return f"{judged}; step time: predicted recompute on the {report.profile} profile; {searched}"


def _fit_command(args: argparse.Namespace, setup: dict[str, Any]) -> str:
    """The `remat fit` command of these arguments under another precision, optimizer and rank
    count: what the advice says fits, to run as printed."""
    parts = ["remat", "fit", "--model", args.model, "--batch", str(args.batch)]
    parts += ["--seq", str(args.seq)]
    parts += ["--capacity", args.capacity] if args.capacity else []
    parts += ["--gpu", args.gpu] if args.gpu else []
    parts += ["--precision", setup["precision"], "--optimizer", setup["optimizer"] or "none"]
    parts += ["--shard", str(setup["shard"])] if setup["shard"] > 1 else []
    for flag in ("tp", "cp", "pp"):  # the layout asked, or the one found
        degree = setup.get(flag, getattr(args, flag, 1))
        parts += [f"--{flag}", str(degree)] if degree > 1 else []
    if setup.get("pp", getattr(args, "pp", 1)) > 1:
        microbatches = setup.get("microbatches", getattr(args, "microbatches", None))
        parts += ["--microbatches", str(microbatches)] if microbatches else []
        parts += ["--schedule", setup.get("schedule", getattr(args, "schedule", "1f1b"))]
    parts += ["--reserve", str(args.reserve)] if getattr(args, "reserve", None) else []
    parts += ["--tiny"] if args.tiny else []
    for item in args.set or []:
        parts += ["--set", item]
    return " ".join(shlex.quote(p) for p in parts)


def _fit_report(
    args: argparse.Namespace,
    console: Console,
    precision: str,
    shard: int,
    compile: str | None = None,
    ac: str | None = None,
):
    """`remat.answers.fit` of the model the arguments name on `--gpu` (or `--capacity`); `compile`: also
    the step under torch.compile (`whole` or `blocks`, with `ac="full"` each block checkpointed)."""
    from remat import models
    from remat.answers.fit import PRECISIONS, fit
    from remat.device.gpus import custom_gpu, get_gpu

    gpu = custom_gpu(args.capacity, args.gpu or "h100") if args.capacity else get_gpu(args.gpu)
    overrides = models.parse_overrides(args.set)

    def build_for(precision: str):
        def build(batch: int, seq: int):
            return models.build(
                args.model,
                batch=batch,
                seq=seq,
                dtype=PRECISIONS[precision].param_dtype,
                tiny=args.tiny,
                **overrides,
            )

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
            layout=_layout(args),
        )


def _layout(args: argparse.Namespace) -> Any:
    from remat.layouts.parallel import Layout

    return Layout(
        tp=getattr(args, "tp", 1),
        cp=getattr(args, "cp", 1),
        pp=getattr(args, "pp", 1),
        microbatches=getattr(args, "microbatches", 0) or 0,
        schedule=getattr(args, "schedule", "1f1b"),
    )


def cmd_fit(args: argparse.Namespace, console: Console) -> int:
    from remat.answers.report import compact_table
    from remat.units import format_bytes

    _writable(args.html, "--html")
    if args.ac and args.compile != "blocks":
        raise RematError(
            "--ac full checkpoints each block before compiling it: add --compile blocks"
        )
    report = _fit_report(args, console, args.precision, args.shard, args.compile, args.ac)
    gpu = report.gpu
    found = report.extra.get("setup_that_fits")
    laid_out = report.extra.get("layout_that_fits")
    if laid_out:  # a pipeline that fits laid out otherwise, asked precision and ranks
        found = {"precision": args.precision, "optimizer": report.optimizer, "shard": args.shard}
        found |= {k: laid_out[k] for k in ("tp", "pp", "microbatches", "schedule")}
    run = [f"run: {_fit_command(args, found)}"] if found else []
    if args.html:
        from remat.answers.html import write_report

        write_report(
            args.html,
            report.planner,
            title=f"{_model_name(args)}, batch {args.batch}, seq {args.seq}, {args.precision} on {gpu}"
            + (f", one rank of {report.layout}" if report.layout else "")
            + (" (its step: the tightest rank's first stage)" if "stages" in report.extra else ""),
            budget_bytes=report.usable_bytes,
            fit_rows=report.table_rows(),
            advice=[*report.advice, *run],
            fit_caption=_fit_caption(report),
        )
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
        return 0
    title = (
        f"{_model_name(args)}, batch {args.batch}, seq {args.seq}, {args.precision}, "
        f"{report.optimizer or 'no optimizer'}, on {gpu}"
        + (f", sharded over {args.shard} ranks" if args.shard > 1 else "")
        + (f", {report.layout}" if report.layout else "")
        + (" (per-rank figures)" if args.shard > 1 or report.layout else "")
    )
    table = compact_table(title)
    simulated = any(r.gpu_memory for r in report.rows)
    columns = [
        "strategy",
        "peak\n(live)",
        "fits",
        "step\ntime",
        f"max batch\n(seq {args.seq})",
        f"max seq\n(batch {args.batch})",
    ]
    if getattr(args, "pp", 1) > 1:  # a pipeline: micro-batches, no sequence search
        columns[-2:] = [f"max micro-\nbatch (seq {args.seq})"]
    if simulated:
        columns[2:2] = ["allocated", "reserved", "expand-\nable"]
    for col in columns:
        table.add_column(col, justify="left" if col == "strategy" else "right", no_wrap=True)
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
        cells = [
            r.strategy,
            "-" if r.peak_bytes is None else format_bytes(r.peak_bytes),
            *((memory or ["-", "-"]) + (expandable or ["-"]) if simulated else []),
            "[green]yes[/green]" if r.fits else "[red]no[/red]",
            "-" if r.overhead is None else f"+{r.overhead:.1%}",
            str(r.max_batch) if r.max_batch else "-",
            *([] if getattr(args, "pp", 1) > 1 else [str(r.max_seq) if r.max_seq else "-"]),
        ]
        table.add_row(*cells)
    table.caption = _fit_caption(report)
    console.print(table)
    by_note: dict[str, list[str]] = {}
    for r in report.rows:
        if r.note:
            by_note.setdefault(r.note, []).append(r.strategy)
    for note, names in by_note.items():  # each fact once
        who = "every row" if len(names) == len(report.rows) > 1 else ", ".join(names)
        console.print(f"[dim]{escape(who)}: {escape(note)}[/dim]")
    _print_stages(console, report)
    for line in report.advice:
        console.print(f"[bold]advice:[/bold] {escape(line)}")
    for line in run:
        console.print(f"[bold]run:[/bold] {escape(line.removeprefix('run: '))}", soft_wrap=True)
    if args.html:
        console.print(f"report written to {escape(args.html)}")
    return 0


def _print_stages(console: Console, report: Any) -> None:
    """A pipeline's stages under remat's plan (auto), or the first strategy fitted: per stage,
    its rank, blocks, micro-batches in flight, bytes held per micro-batch, fixed bytes and its
    rank's peak; and the most micro-batches each strategy fits."""
    from remat.answers.report import compact_table

    stages = report.extra.get("stages")
    if not stages:
        return
    name = "auto" if "auto" in stages else next(iter(stages))
    table = compact_table(f"stages under {name}, per rank")
    rows = stages[name]
    for col in rows[0]:
        table.add_column(col, justify="left" if col == "plan" else "right", no_wrap=True)
    for row in rows:
        table.add_row(*(escape(v) for v in row.values()))
    console.print(table)
    counts = report.extra.get("max_microbatches", {})
    if counts:
        most = ", ".join(f"{k} {v if v else '-'}" for k, v in counts.items())
        console.print(f"[dim]most micro-batches that fit (up to 1024): {escape(most)}[/dim]")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="remat",
        description="Decide which activations a PyTorch training step keeps and which it recomputes.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"remat {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="the whole pipeline on a built-in model, in about a minute: estimate, plan, apply, measure",
    )
    demo.add_argument(
        "--out",
        default="remat-demo",
        help="folder for the plan, table and plots (default: %(default)s)",
    )
    demo.set_defaults(func=cmd_demo)
    est = sub.add_parser(
        "estimate",
        help="trace a model and break down its activation memory and the peak of a training step",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_model_args(est)
    _add_optimizer_arg(est)
    est.add_argument(
        "--gpu",
        help="predict the step on this GPU (h100, a100-80gb, v100-16gb, ...; `remat fit` lists "
        "them): traced with its CUDA kernels, and reported as the GPU reports it: requested, "
        "allocated and reserved bytes (the caching allocator, default and expandable segments), "
        "CUDA context and nvidia-smi",
    )
    est.add_argument(
        "--tp",
        type=_positive_int,
        default=1,
        help="one tensor-parallel rank's step (with sequence parallelism; docs/parallelism.md)",
    )
    est.add_argument(
        "--cp", type=_positive_int, default=1, help="one context-parallel rank's step (seq / cp)"
    )
    est.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    est.add_argument(
        "--top", type=_positive_int, default=12, help="rows in the by-module and by-op tables"
    )
    _add_compile_arg(est)
    est.set_defaults(func=cmd_estimate)
    ft = sub.add_parser(
        "fit",
        help="does a training step fit a GPU, with which strategy, and at what batch and sequence",
        epilog="examples:\n"
        "  remat fit --model llama-3.1-8b --seq 8192 --gpu h100 --optimizer adamw --precision bf16-mixed\n"
        "  remat fit --model llama-3.1-70b --seq 8192 --gpu h100 --shard 8\n"
        "  remat fit --model llama-3.1-70b --seq 8192 --gpu h100 --tp 8 --pp 4 --shard 4 --precision bf16-fsdp\n"
        "  remat fit --model gpt2 --seq 1024 --capacity 24GiB\n\n"
        "The table gives each strategy's per-rank peak (live bytes) and, on a GPU, the caching\n"
        "allocator's allocated / reserved bytes; a row fits when its reserved bytes do. When\n"
        "nothing fits, the advice ends with one command that does (run: remat fit ...): the\n"
        "fewest GPUs, then the least step time, over precision, 8-bit AdamW and --shard.\n"
        "Words: docs/glossary.md; arithmetic: docs/fit.md.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ft.add_argument(
        "--model", default="llama-3.1-8b", help="as for estimate (default: %(default)s)"
    )
    ft.add_argument(
        "--batch", type=_positive_int, default=1, help="micro-batch (default: %(default)s)"
    )
    ft.add_argument(
        "--seq", type=_positive_int, default=4096, help="sequence length (default: %(default)s)"
    )
    ft.add_argument("--tiny", action="store_true", help="the preset's tiny configuration")
    ft.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a config field (repeatable)",
    )
    ft.add_argument(
        "--gpu",
        default="h100",
        help="h100, h100-pcie, h200, a100-40gb, a100-80gb, l4, rtx4090, mi300x, v100-16gb, "
        "v100-32gb, or the name torch reports (default: %(default)s)",
    )
    ft.add_argument(
        "--capacity", help="any other GPU: its memory, e.g. 70GiB (costs on --gpu's profile)"
    )
    ft.add_argument(
        "--reserve",
        help="memory kept back for the CUDA context, BLAS workspaces, NCCL and fragmentation, e.g. "
        "3GiB (default: remat.device.gpus.fixed_memory + 5%% of the rest, docs/fit.md)",
    )
    ft.add_argument(
        "--precision",
        default="bf16-mixed",
        choices=["fp32", "bf16", "bf16-mixed", "bf16-fsdp"],
        help="bf16-mixed: fp32 master weights and grads, autocast bf16 forward; bf16: everything "
        "in bf16; bf16-fsdp (with --shard): FSDP2's MixedPrecisionPolicy, bf16 gathered weights "
        "and compute over fp32 shards of weights, grads and state (default: %(default)s)",
    )
    ft.add_argument(
        "--optimizer",
        default="adamw",
        choices=["none", *OPTIMIZERS],
        help="optimizer state and step counted in the peak; adamw is torch's default on a GPU, "
        "foreach (default: %(default)s)",
    )
    ft.add_argument(
        "--shard",
        type=_positive_int,
        default=1,
        help="FSDP2 / ZeRO-3 ranks that share parameters, gradients and optimizer state (default: %(default)s)",
    )
    ft.add_argument(
        "--tp",
        type=_positive_int,
        default=1,
        help="tensor-parallel ranks (torch's parallelize_module with sequence parallelism, as "
        "torchtitan lays out Llama): each rank's step is traced with its shards and collectives "
        "(default: %(default)s)",
    )
    ft.add_argument(
        "--pp",
        type=_positive_int,
        default=1,
        help="pipeline stages, one per rank (torch.distributed.pipelining; the model cut as "
        "torchtitan cuts it): --batch is then the micro-batch, and every figure the tightest "
        "rank's, with a table per stage (default: %(default)s)",
    )
    ft.add_argument(
        "--microbatches",
        type=_positive_int,
        help="micro-batches per step with --pp (default: one per stage)",
    )
    ft.add_argument(
        "--schedule",
        default="1f1b",
        choices=["gpipe", "1f1b", "interleaved-1f1b"],
        help="torch's pipeline schedule with --pp (default: %(default)s)",
    )
    ft.add_argument(
        "--cp",
        type=_positive_int,
        default=1,
        help="context-parallel ranks, each holding seq / cp tokens (ring attention) "
        "(default: %(default)s)",
    )
    ft.add_argument("--json", action="store_true", help="print the answer as JSON")
    ft.add_argument(
        "--html", metavar="REPORT.html", help="also write the self-contained HTML report"
    )
    _add_compile_arg(ft)
    ft.set_defaults(func=cmd_fit)
    pl = sub.add_parser(
        "plan",
        help="choose what to keep and what to recompute under a memory budget",
        epilog=_strategies_help() + PLAN_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_model_args(pl)
    _add_budget_arg(pl)
    pl.add_argument(
        "--strategy",
        default="auto",
        help="one of the strategies listed below (default: %(default)s)",
    )
    _add_profile_arg(pl)
    _add_optimizer_arg(pl)
    pl.add_argument(
        "--json", action="store_true", help="print the chosen plan and the comparison as JSON"
    )
    pl.add_argument(
        "--explain",
        action="store_true",
        help="print, for the largest saved tensors, whether each is kept or recomputed and why",
    )
    pl.add_argument(
        "--out", metavar="PLAN.json", help="write the chosen plan (Plan.from_json reads it back)"
    )
    pl.add_argument(
        "--plot",
        metavar="PARETO.png",
        help="plot the memory / recompute frontier with the strategies marked",
    )
    pl.add_argument(
        "--html", metavar="REPORT.html", help="also write the self-contained HTML report"
    )
    pl.set_defaults(func=cmd_plan)
    rp = sub.add_parser(
        "report",
        help="write one self-contained HTML report of a step: timeline, breakdown, frontier, plan",
        epilog="examples:\n  remat report --model gpt2 --tiny --html report.html\n"
        "  remat report --model gpt2 --seq 1024 --gpu l4 --optimizer adamw --html report.html",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_model_args(rp)
    _add_budget_arg(rp)
    _add_profile_arg(rp)
    _add_optimizer_arg(rp)
    rp.add_argument("--html", metavar="REPORT.html", required=True, help="where to write it")
    rp.add_argument(
        "--gpu",
        help="add the fit table for this GPU (h100, h200, a100-40gb, a100-80gb, l4, rtx4090, "
        "mi300x) at --batch, --seq, --dtype and --optimizer; `remat fit --html` for mixed "
        "precision and sharding",
    )
    rp.add_argument("--capacity", help="add the fit table for a GPU of this memory, e.g. 24GiB")
    rp.set_defaults(func=cmd_plan, strategy="auto", json=False, explain=False, out=None, plot=None)
    be = sub.add_parser(
        "bench", help="apply each strategy to the real model and measure peak, time and gradients"
    )
    _add_model_args(be)
    _add_budget_arg(be)
    be.add_argument(
        "--strategies",
        default=None,
        help="comma-separated strategies and baselines (torch:checkpoint-per-block, "
        "torch:checkpoint_sequential, hf:gradient_checkpointing; auto:tuned, the fastest of the "
        "plans that fit timed on the model, as remat.auto(..., tune=True)) (default: "
        f"{BENCH_STRATEGIES}, plus hf:gradient_checkpointing for hf: models)",
    )
    be.add_argument(
        "--device",
        default="cpu",
        help="where the real model runs: cpu or cuda (default: %(default)s)",
    )
    _add_profile_arg(be)
    be.add_argument(
        "--steps",
        type=_positive_int,
        default=ROUNDS,
        help="timing rounds: each times one step of every row in turn, so that a slow moment of "
        "the machine hits every row alike; the table shows the median and the range "
        "(default: %(default)s)",
    )
    be.add_argument(
        "--compile",
        action="store_true",
        help="also torch.compile the model: rows for torch's partitioner at "
        "activation_memory_budget 1.0 (its default), 0.5 and 0.0, and for remat's partitioner "
        "(compile:mincut, compile:milp and compile:auto at --budget)",
    )
    be.add_argument(
        "--compiler",
        default="inductor",
        choices=["inductor", "aot_eager"],
        help="with --compile: inductor (fused kernels; compiling takes a while on CPU, and "
        "remat's rows read inductor's own buffer plan for every save set they try, one code "
        "generation each) or aot_eager (the same partition run op by op) (default: %(default)s)",
    )
    be.add_argument("--json", metavar="OUT.json", help="write the rows as JSON")
    be.add_argument(
        "--html", metavar="REPORT.html", help="also write the self-contained HTML report"
    )
    be.add_argument("--plot", metavar="OUT.png", help="measured points on the predicted frontier")
    be.set_defaults(func=cmd_bench, optimizer=None)
    return parser


#: Set to 1 to run every command at its preset's tiny size with at most 2 timed steps: how the
#: README's own commands are tested in minutes (tests/test_readme.py).
QUICK_ENV = "REMAT_QUICK"


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if os.environ.get(QUICK_ENV) == "1" and hasattr(args, "tiny"):
        args.tiny = args.tiny or ":" not in args.model or args.model.startswith("hf:")
        if hasattr(args, "steps"):
            args.steps = min(args.steps, 2)
    console = Console()
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console = Console(width=120)  # piped or captured: rich would assume 80 columns
    err = Console(stderr=True, soft_wrap=True)  # paths and sizes in messages stay whole
    try:
        return args.func(args, console)
    except RematError as e:
        kind = "infeasible budget" if isinstance(e, InfeasibleBudget) else "error"
        err.print(f"[red]{kind}:[/red] {escape(str(e))}")
        return exit_code(e)


if __name__ == "__main__":
    sys.exit(main())
