"""`remat estimate`: the activation memory and peak of a traced step, as tables or JSON."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

from rich.console import Console

from remat.answers.cli.common import model_name, trace_model
from remat.errors import RematError

if TYPE_CHECKING:
    from remat.graph import Graph
    from remat.prediction.compiled_estimate import CompiledEstimate
    from remat.prediction.estimate import MemoryEstimate


def cmd_estimate(args: argparse.Namespace, console: Console) -> int:
    from remat.prediction.estimate import estimate

    graph, seconds, (model, inputs) = trace_model(args, console)
    compiled = None
    if args.ac and not args.compile:
        raise RematError(
            f"--ac {args.ac} checkpoints each block before it is compiled: add --compile whole "
            "or blocks (the eager rows of fit price every strategy without it)"
        )
    if args.compile and "layout" in graph.info:
        raise RematError("--compile is predicted on one rank: leave out --tp / --cp")
    if args.compile:
        from remat.prediction.compiled_estimate import estimate_compiled

        with console.status(f"compiling ({args.compile}) on fake tensors with inductor ..."):
            compiled = estimate_compiled(
                graph,
                model,
                *inputs,
                compile=args.compile,
                optimizer=args.optimizer,
                ac=args.ac,
                gpu=getattr(args, "gpu", None),
            )
    est = estimate(graph, optimizer=args.optimizer)
    return show_estimate(graph, est, args, console, seconds, compiled)


def _gpu_memories(graph: Graph, args: argparse.Namespace) -> list[Any]:
    """The step as `--gpu` would report it, under each allocator setting `remat.prediction.gpu_memory`
    knows (none without --gpu)."""
    if getattr(args, "gpu", None) is None:
        return []
    from remat.prediction.gpu_memory import gpu_memories

    return gpu_memories(graph, args.gpu, optimizer=args.optimizer)


def show_estimate(
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
    title = f"{model_name(args)}, {graph.info['shape']}, {args.dtype}" + (
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
