"""`remat` command line: a thin layer over the library. Exit codes: 0 ok, 2 bad input, 3 infeasible
budget. Here the parser and `main`; each command in its module (`estimate`, `plan`, `fit`, `bench`,
`demo`), what they share in `common`."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import os
import sys
from collections.abc import Sequence
from typing import NoReturn, get_args

from rich.console import Console
from rich.markup import escape

from remat._version import __version__
from remat.answers.bench import ROUNDS
from remat.answers.cli.bench import BENCH_STRATEGIES, cmd_bench
from remat.answers.cli.common import (
    add_budget_arg,
    add_compile_arg,
    add_fsdp_unit_arg,
    add_loop_args,
    add_model_args,
    add_offload_args,
    add_optimizer_arg,
    add_profile_arg,
    add_tp_args,
    positive_int,
)
from remat.answers.cli.demo import cmd_demo
from remat.answers.cli.estimate import cmd_estimate
from remat.answers.cli.fit import cmd_fit
from remat.answers.cli.plan import cmd_plan
from remat.answers.fit_steps import Precision
from remat.collector import collector_paused
from remat.errors import InfeasibleBudget, RematError, exit_code
from remat.prediction.estimate import OPTIMIZERS

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
        help="the whole pipeline on a built-in model: estimate, plan, apply, measure",
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
    add_model_args(est)
    add_optimizer_arg(est)
    est.add_argument(
        "--gpu",
        help="predict the step on this GPU (h100, a100-80gb, v100-16gb, ...; `remat fit` lists "
        "them): traced with its CUDA kernels, and reported as the GPU reports it: requested, "
        "allocated and reserved bytes (the caching allocator, default and expandable segments), "
        "CUDA context and nvidia-smi",
    )
    add_tp_args(est)
    est.add_argument(
        "--cp", type=positive_int, default=1, help="one context-parallel rank's step (seq / cp)"
    )
    est.add_argument(
        "--precision",
        choices=get_args(Precision),
        help="as for fit (replaces --dtype): the parameters' dtype, autocast, float8 linears, "
        "and for bf16-fsdp / float8* fp32 shards under --shard (default: --dtype, no autocast)",
    )
    est.add_argument(
        "--shard",
        type=positive_int,
        default=1,
        help="one rank's step of FSDP2 over this many ranks, as fit's per-rank rows: parameters, "
        "gradients and optimizer state sharded, each block a unit; with --compile blocks or "
        "blocks+loss, judged by the allocator on --gpu (default: %(default)s)",
    )
    add_fsdp_unit_arg(est)
    est.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    est.add_argument(
        "--top", type=positive_int, default=12, help="rows in the by-module and by-op tables"
    )
    add_compile_arg(est)
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
        "The strategies' searches run in one process per core (Linux); REMAT_WORKERS=1 keeps\n"
        "them in one, with the same answer.\n"
        "Words: docs/glossary.md; arithmetic: docs/fit.md.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ft.add_argument(
        "--model", default="llama-3.1-8b", help="as for estimate (default: %(default)s)"
    )
    ft.add_argument(
        "--batch",
        type=positive_int,
        help="samples in one step on a rank (a micro-batch of gradient accumulation); with --pp "
        "the step's, cut into --microbatches micro-batches, as remat.layouts.pipeline.predict "
        "takes it (default: 1; with --pp one sample a micro-batch)",
    )
    ft.add_argument(
        "--seq", type=positive_int, default=4096, help="sequence length (default: %(default)s)"
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
        help="h100, h100-pcie, h200, b200, a100-40gb, a100-80gb, a10g, l4, t4, rtx3090, "
        "rtx4070-ti-super, rtx4080, rtx4090, mi300x, v100-16gb, "
        "v100-32gb, or the name torch reports (default: %(default)s)",
    )
    ft.add_argument(
        "--capacity", help="any other GPU: its memory, e.g. 70GiB (costs on --gpu's profile)"
    )
    ft.add_argument(
        "--torch-version",
        metavar="X.Y",
        help="the torch the run had, where older than the installed one: its autograd's saves "
        "(before 1.11, softmax kept its input too; remat.device.targets) (default: installed)",
    )
    ft.add_argument(
        "--cuda-context",
        metavar="BYTES",
        help="the CUDA context the run measured (e.g. 1343MiB), outside the allocator and in "
        "nvidia-smi's figure (default: --gpu's architecture's, remat.device.gpus)",
    )
    ft.add_argument(
        "--reserve",
        help="memory kept back for the CUDA context, BLAS workspaces, NCCL and fragmentation, e.g. "
        "3GiB (default: remat.device.gpus.fixed_memory + 5%% of the rest, docs/fit.md)",
    )
    ft.add_argument(
        "--precision",
        default="bf16-mixed",
        choices=get_args(Precision),
        help="bf16-mixed: fp32 master weights and grads, autocast bf16 forward (fp16-mixed: "
        "autocast fp16); bf16: everything in bf16; bf16-fsdp (with --shard): FSDP2's MixedPrecisionPolicy, bf16 gathered weights "
        "and compute over fp32 shards of weights, grads and state; float8 (with --shard): "
        "bf16-fsdp with torchao's Float8Linear (torchtitan's --model.converters float8), "
        "tensorwise scales and FSDP's float8 all-gather; float8-tensorwise: bf16 all-gather; "
        "float8-rowwise: rowwise scales (docs/fit.md) (default: %(default)s)",
    )
    ft.add_argument(
        "--optimizer",
        default="adamw",
        choices=["none", *OPTIMIZERS],
        help="optimizer state and step counted in the peak; adamw is torch's default on a GPU, "
        "foreach; 8-bit / 4-bit, paged and CPU-offload ones as for estimate (default: "
        "%(default)s)",
    )
    add_loop_args(ft)
    ft.add_argument(
        "--shard",
        type=positive_int,
        default=1,
        help="data-parallel ranks; FSDP2 / ZeRO-3 shards parameters, gradients and optimizer "
        "state over them times --cp, as torchtitan's dp_shard_cp mesh does (default: %(default)s)",
    )
    add_fsdp_unit_arg(ft)
    add_tp_args(ft)
    ft.add_argument(
        "--pp",
        type=positive_int,
        default=1,
        help="pipeline stages, one per rank (torch.distributed.pipelining; the model cut as "
        "torchtitan cuts it): --batch is then the micro-batch, and every figure the tightest "
        "rank's, with a table per stage (default: %(default)s)",
    )
    ft.add_argument(
        "--microbatches",
        type=positive_int,
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
        type=positive_int,
        default=1,
        help="context-parallel ranks, each holding seq / cp tokens (ring attention); FSDP "
        "shards over --shard x --cp ranks (default: %(default)s)",
    )
    ft.add_argument(
        "--full-trace",
        action="store_true",
        help="trace every block, not a few repeated blocks laid out at the model's depth (the "
        "same answer, byte for byte, slower)",
    )
    ft.add_argument("--json", action="store_true", help="print the answer as JSON")
    ft.add_argument(
        "--html", metavar="REPORT.html", help="also write the self-contained HTML report"
    )
    add_compile_arg(ft)
    add_offload_args(ft)
    ft.set_defaults(func=cmd_fit)
    pl = sub.add_parser(
        "plan",
        help="choose what to keep and what to recompute under a memory budget",
        epilog=_strategies_help() + PLAN_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_args(pl)
    add_budget_arg(pl)
    add_tp_args(pl)
    pl.add_argument(
        "--strategy",
        default="auto",
        help="one of the strategies listed below (default: %(default)s)",
    )
    add_profile_arg(pl)
    add_optimizer_arg(pl)
    add_offload_args(pl)
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
    add_model_args(rp)
    add_budget_arg(rp)
    add_profile_arg(rp)
    add_optimizer_arg(rp)
    rp.add_argument("--html", metavar="REPORT.html", required=True, help="where to write it")
    rp.add_argument(
        "--gpu",
        help="add the fit table for this GPU (h100, h200, b200, a100-80gb, a10g, l4, t4, rtx4090, "
        "mi300x, ...: remat fit --help) at --batch, --seq, --dtype and --optimizer; `remat fit --html` for mixed "
        "precision and sharding",
    )
    rp.add_argument("--capacity", help="add the fit table for a GPU of this memory, e.g. 24GiB")
    rp.set_defaults(func=cmd_plan, strategy="auto", json=False, explain=False, out=None, plot=None)
    be = sub.add_parser(
        "bench", help="apply each strategy to the real model and measure peak, time and gradients"
    )
    add_model_args(be)
    add_budget_arg(be)
    be.add_argument(
        "--strategies",
        default=None,
        help="comma-separated strategies and baselines (torch:checkpoint-per-block, "
        "torch:checkpoint_sequential, hf:gradient_checkpointing; auto: what remat.auto leaves "
        "installed once its first training steps are tuned, timed here; auto:tuned, the fastest "
        "of the plans that fit timed on the model, as remat.auto(..., tune=True), shown only "
        "where it differs from auto) (default: "
        f"{BENCH_STRATEGIES}, plus hf:gradient_checkpointing for hf: models)",
    )
    be.add_argument(
        "--device",
        default="cpu",
        help="where the real model runs: cpu or cuda (default: %(default)s)",
    )
    add_profile_arg(be)
    add_offload_args(be)
    be.add_argument(
        "--steps",
        type=positive_int,
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


#: The commands that only trace and plan, run with the cyclic garbage collector paused
#: (`remat.collector`); the others train, and a training loop's cycles want collecting.
ANALYSES = ("estimate", "plan", "report", "fit")

#: Set to 1 to run every command at its preset's tiny size with at most 2 timed steps (`demo`:
#: its own model at half its width and length, 2 rounds), bench's `auto` row tuned on 1 round
#: of first steps, not 5, and fit's compiled row read at the asked size only (its largest sizes not searched, one
#: compilation a size): how the README's and docs' commands are tested in minutes
#: (tests/test_readme.py, tests/test_doc_commands.py).
QUICK_ENV = "REMAT_QUICK"


def run() -> NoReturn:
    """The `remat` command: `main`, then the process ends without tearing down what the command
    made. A 70B fit leaves 3.4 million records in reference cycles (graphs, their memos, the
    allocator's linked blocks); the interpreter's last collection and its frees took 3 s after the
    answer was printed. Output is flushed and exit handlers run first, as at a normal exit. Under
    a profiler or tracer (`python -m cProfile -m remat`, coverage), a normal exit: it writes its
    data then."""
    code = main()
    if sys.getprofile() is not None or sys.gettrace() is not None:
        sys.exit(code)
    sys.stdout.flush()
    sys.stderr.flush()
    atexit._run_exitfuncs()  # logging's flush, multiprocessing's and torch's cleanups
    os._exit(code)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.quick = os.environ.get(QUICK_ENV) == "1"
    if args.quick and hasattr(args, "tiny"):
        args.tiny = args.tiny or ":" not in args.model or args.model.startswith("hf:")
        if hasattr(args, "steps"):
            args.steps = min(args.steps, 2)
    console = Console(emoji=False)  # "hf:llama:..." is a name, not rich's :llama: emoji
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console = Console(width=120, emoji=False)  # piped or captured: rich would assume 80 columns
    err = Console(stderr=True, soft_wrap=True, emoji=False)  # paths and sizes stay whole
    paused = collector_paused() if args.command in ANALYSES else contextlib.nullcontext()
    try:
        with paused:
            return args.func(args, console)
    except RematError as e:
        kind = "infeasible budget" if isinstance(e, InfeasibleBudget) else "error"
        err.print(f"[red]{kind}:[/red] {escape(str(e))}")
        return exit_code(e)
    except KeyboardInterrupt:  # Ctrl-C: one line, not the traceback of wherever it landed
        err.print(f"interrupted: remat {args.command} stopped before it finished")
        return 130
