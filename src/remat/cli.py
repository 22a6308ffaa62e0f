"""`remat` command line: a thin layer over the library. Exit codes: 0 ok, 2 bad input, 3 infeasible
budget."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from rich.console import Console

from remat.errors import InfeasibleBudget, RematError

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
DEFAULT_MODEL = {"model": "gpt2", "batch": 4, "seq": 256, "dtype": "fp32"}

EPILOG = """\
models:  a preset (remat estimate --model list), a Hugging Face type (hf:gpt2, hf:llama; needs
         `pip install 'remat[hf]'`), or your own factory `pkg.module:make_model` returning
         (model, example_inputs).
examples:
  remat demo
  remat estimate --model llama-3.1-70b --batch 1 --seq 8192 --dtype bf16
  remat estimate --model gpt2 --batch 8 --seq 1024 --optimizer adamw --json
"""


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
        help="override a config field, e.g. --set n_layers=2 (repeatable)",
    )
    p.add_argument(
        "--trace-device",
        default="meta",
        help="meta (default: fake tensors, nothing allocated) or cpu (real tensors: for models with data-dependent shapes)",
    )


def _parse_overrides(items: Sequence[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise RematError(f"--set {item!r}: write FIELD=VALUE, e.g. --set n_layers=2")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def _trace_model(args: argparse.Namespace, console: Console):
    """Build the model named by the arguments and trace one training step of it."""
    from remat import models, trace

    if args.model == "list":
        console.print("presets: " + ", ".join(models.preset_names()))
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
        **_parse_overrides(args.set),
    )
    where = "fake tensors" if device == "meta" else f"real {device} tensors"
    start = time.perf_counter()
    with console.status(f"tracing one training step of {args.model} on {where} ..."):
        graph = trace(model, *inputs, device=device)
    graph.info.update(model=args.model, batch=args.batch, seq=args.seq, dtype=args.dtype)
    return graph, time.perf_counter() - start


def cmd_estimate(args: argparse.Namespace, console: Console) -> int:
    from remat.estimate import estimate
    from remat.report import estimate_dict, estimate_tables

    graph, seconds = _trace_model(args, console)
    est = estimate(graph, optimizer=args.optimizer)
    context = {
        "model": args.model,
        "batch": args.batch,
        "seq": args.seq,
        "dtype": args.dtype,
        "optimizer": args.optimizer,
        "trace_seconds": round(seconds, 3),
    }
    if args.json:
        print(json.dumps(estimate_dict(graph, est, **context), indent=2))
        return 0
    title = f"{args.model}  batch {args.batch}  seq {args.seq}  {args.dtype}" + (
        f"  {args.optimizer}" if args.optimizer else ""
    )
    for table in estimate_tables(graph, est, title, top=args.top):
        console.print(table)
    console.print(
        f"[dim]{len(graph.forward_ops)} forward + {len(graph.backward_ops)} backward ops traced in {seconds:.1f} s[/dim]"
    )
    return 0


def cmd_demo(args: argparse.Namespace, console: Console) -> int:
    console.print(
        f"[bold]remat demo[/bold]: activation memory of {DEFAULT_MODEL['model']} "
        f"(batch {DEFAULT_MODEL['batch']}, seq {DEFAULT_MODEL['seq']}, {DEFAULT_MODEL['dtype']}), "
        "traced on fake tensors"
    )
    ns = argparse.Namespace(
        **DEFAULT_MODEL,
        tiny=False,
        set=[],
        trace_device="meta",
        optimizer="adamw",
        json=False,
        top=8,
    )
    return cmd_estimate(ns, console)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="remat",
        description="Decide which activations a PyTorch training step keeps and which it recomputes.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the pipeline on the built-in default model")
    demo.set_defaults(func=cmd_demo)
    est = sub.add_parser(
        "estimate",
        help="trace a model and break down its activation memory and the peak of a training step",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_model_args(est)
    est.add_argument(
        "--optimizer",
        choices=["sgd", "adamw"],
        default=None,
        help="count optimizer state and step in the peak",
    )
    est.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    est.add_argument("--top", type=int, default=12, help="rows in the by-module and by-op tables")
    est.set_defaults(func=cmd_estimate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = Console(stderr=False)
    err = Console(stderr=True)
    try:
        return args.func(args, console)
    except InfeasibleBudget as e:
        err.print(f"[red]infeasible budget:[/red] {e}")
        return 3
    except RematError as e:
        err.print(f"[red]error:[/red] {e}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
