"""`remat estimate`: the activation memory and peak of a traced step, as tables or JSON."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

from rich.console import Console

from remat.answers.cli.common import model_name, precision_of, trace_model
from remat.errors import RematError

if TYPE_CHECKING:
    from remat.graph import Graph
    from remat.prediction.compiled_estimate import CompiledEstimate
    from remat.prediction.estimate import MemoryEstimate
    from remat.prediction.gpu_memory import Fsdp


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
    setup = precision_of(args)
    fsdp = _fsdp(args, setup, graph)
    if args.compile:
        from remat.prediction.compiled_estimate import estimate_compiled

        with console.status(f"compiling ({args.compile}) on fake tensors with inductor ..."):
            compiled = estimate_compiled(
                graph,
                model,
                *inputs,
                compile=args.compile,
                optimizer=args.optimizer,
                autocast=setup.autocast if setup else None,
                ac=args.ac,
                gpu=getattr(args, "gpu", None),
                fsdp=fsdp,
            )
    shard, scale = (fsdp.shard, fsdp.master_scale) if fsdp else (1, 1)
    est = estimate(graph, optimizer=args.optimizer, shard=shard, master_scale=scale)
    return show_estimate(graph, est, args, console, seconds, compiled, fsdp)


def _fsdp(args: argparse.Namespace, setup: Any, graph: Graph) -> Fsdp | None:
    """One rank of FSDP2 over --shard ranks (fp32 shards where --precision says so), as fit's
    per-rank rows have it; None on one rank. Refuses what fit refuses, by name."""
    from remat.prediction.gpu_memory import Fsdp

    scale = setup.master_scale if setup is not None else 1
    units = tuple(getattr(args, "fsdp_unit", []))
    if units and args.shard == 1:
        raise RematError(
            "--fsdp-unit is a unit of FSDP2: give the number of ranks (--shard 2 or more)"
        )
    if args.shard == 1:
        if scale != 1:
            raise RematError(
                f"--precision {args.precision} is FSDP2's MixedPrecisionPolicy over sharded fp32 "
                "parameters: give the number of ranks (--shard 2 or more)"
            )
        return None
    if "layout" in graph.info:
        raise RematError("--shard with --tp / --cp: use remat fit, which lays out every rank")
    if args.compile == "whole" or (args.compile and getattr(args, "gpu", None) is None):
        raise RematError(
            "--shard with --compile: one rank's compiled step is judged by the allocator with "
            "each block compiled on its own: give --compile blocks (or blocks+loss) and a --gpu"
        )
    return Fsdp(args.shard, scale, units)


def _gpu_memories(graph: Graph, args: argparse.Namespace, fsdp: Fsdp | None = None) -> list[Any]:
    """The step as `--gpu` would report it, under each allocator setting `remat.prediction.gpu_memory`
    knows (none without --gpu); one rank's of `fsdp` if given."""
    if getattr(args, "gpu", None) is None:
        return []
    from remat.prediction.gpu_memory import gpu_memories

    return gpu_memories(graph, args.gpu, optimizer=args.optimizer, fsdp=fsdp)


def show_estimate(
    graph: Graph,
    est: MemoryEstimate,
    args: argparse.Namespace,
    console: Console,
    trace_seconds: float,
    compiled: CompiledEstimate | None = None,
    fsdp: Fsdp | None = None,
) -> int:
    from remat.answers.report import estimate_dict, estimate_tables

    context = {
        "model": args.model,
        "batch": args.batch,
        "seq": args.seq,
        "dtype": args.dtype,
        "optimizer": args.optimizer,
        **({"precision": args.precision} if getattr(args, "precision", None) else {}),
        **({"shard": fsdp.shard} if fsdp else {}),
        "trace_seconds": round(trace_seconds, 3),
    }
    memories = _gpu_memories(graph, args, fsdp)
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
