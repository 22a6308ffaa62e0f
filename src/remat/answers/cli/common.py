"""What the commands share: their model, budget, optimizer, profile and compile arguments, the
traced model and planner those name, and the titles and output checks around them."""

from __future__ import annotations

import argparse
import os
import time
from typing import TYPE_CHECKING, Any

from rich.console import Console

from remat.errors import RematError
from remat.prediction.estimate import OPTIMIZERS

if TYPE_CHECKING:
    from remat.planning.planner import Planner


DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
DEFAULT_MODEL = {"model": "gpt2", "batch": 4, "seq": 256, "dtype": "fp32"}


def add_optimizer_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default=None,
        help="count optimizer state and step in the peak. adamw: torch's default implementation "
        "for the device (foreach on a GPU, for-loop on the CPU); adamw-foreach/-fused/-for-loop "
        "name one (AdamW(foreach=True), fused=True, foreach=False); adamw-8bit(-paged): "
        "bitsandbytes AdamW8bit (PagedAdamW8bit: unified memory, reported apart); "
        "adamw-8bit-torchao, adamw-4bit: torchao; adamw-cpu-offload: torchao's CPUOffloadOptimizer",
    )
    add_loop_args(p)


def add_loop_args(p: argparse.ArgumentParser) -> None:
    """The training loop's treatment of gradients (`remat.prediction.loop.Loop`)."""
    p.add_argument(
        "--optimizer-in-backward",
        action="store_true",
        help="the loop steps each parameter in backward and frees its gradient (torchtune's "
        "optimizer_in_bwd): the gradients never all live at once",
    )
    p.add_argument(
        "--keep-grads",
        action="store_true",
        help="zero_grad(set_to_none=False): the gradients live between steps, and each "
        "backward's gradient is a temporary added into them",
    )
    p.add_argument(
        "--grad-accumulation",
        type=int,
        default=1,
        metavar="N",
        help="micro-batches a step accumulates (--batch is one micro-batch): above 1 the "
        "gradients live through every micro-step after the first, as with --keep-grads",
    )
    p.add_argument(
        "--keep-logits",
        action="store_true",
        help="the loop keeps the logits its loss reads until the backward ends (pred = model(x); "
        "loss_fn(pred, labels).backward() with pred in scope, as torchtitan's loop of 2024); "
        "default: freed once the loss is computed (del logits, or a model returning its loss)",
    )
    p.add_argument(
        "--loss-chunks",
        type=int,
        metavar="N",
        help="cross-entropy over N sequence chunks, each upcast to fp32 on its own (torchtune's "
        "CEWithChunkedOutputLoss; the llama presets' loss_chunks) instead of the whole logits",
    )


def loop_of(args: argparse.Namespace) -> Any:
    """The `Loop` of --optimizer-in-backward, --keep-grads and --grad-accumulation."""
    from remat.prediction.loop import Loop

    accumulation = getattr(args, "grad_accumulation", 1)
    if accumulation < 1:
        raise RematError(f"--grad-accumulation {accumulation}: give 1 or more micro-batches")
    return Loop(
        optimizer_in_backward=getattr(args, "optimizer_in_backward", False),
        keep_grads=getattr(args, "keep_grads", False) or accumulation > 1,
        keep_logits=getattr(args, "keep_logits", False),
    )


def model_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The model's config overrides: --set's, and the chunked loss of --loss-chunks in the
    words of the model's own code (`remat.models.loss_chunks_overrides`)."""
    from remat import models

    overrides = models.parse_overrides(args.set)
    chunks = getattr(args, "loss_chunks", None)
    if chunks is not None:
        overrides.update(models.loss_chunks_overrides(args.model, chunks))
    return overrides


def add_budget_arg(p: argparse.ArgumentParser) -> None:
    from remat.planning.plans import DEFAULT_BUDGET

    p.add_argument(
        "--budget",
        default=DEFAULT_BUDGET,
        help="the memory budget of the whole step: bytes (40GiB, 512MiB, 1e9); a share (50%%: "
        "the fixed memory of params, grads and optimizer state + 50%% of the rest of store-all's "
        "peak); or a time overhead (+10%%: the lowest peak whose predicted recompute is at most "
        "10%% of the step, always feasible) (default: %(default)s)",
    )


def add_compile_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--compile",
        choices=["whole", "blocks", "blocks+loss"],
        help="also predict the step under torch.compile: whole (torch.compile(model)), blocks "
        "(each block compiled, the rest eager) or blocks+loss (each block and the loss module "
        "compiled on their own, as torchtitan's --training.compile and torchtune's compile "
        "flags do); inductor's own buffers, generated for its CPU backend on fake tensors",
    )
    p.add_argument(
        "--ac",
        metavar="STRATEGY",
        help="with --compile: each block checkpointed before it is compiled, as torchtitan's "
        "apply_ac wraps it: full, selective:torchtitan (torchtitan's op SAC, its default with "
        "compile), selective:save-matmuls or selective:megatron (fused attention only); "
        "store_all: none",
    )


def add_profile_arg(p: argparse.ArgumentParser) -> None:
    from remat.device.cost import PROFILES

    p.add_argument(
        "--profile",
        default="cpu",
        help=f"cost profile recompute time is predicted on: {', '.join(PROFILES)} "
        "(default: %(default)s)",
    )


def add_offload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--offload",
        action="store_true",
        help="let plans move blocks' saved activations to pinned host memory and back, priced on "
        "the GPU's host link (PCIe Gen4/5, NVLink-C2C): offload beside keep and recompute "
        "(docs/offload.md)",
    )
    p.add_argument(
        "--host-memory",
        metavar="SIZE",
        help="with --offload: the pinned host memory one rank may take, e.g. 64GiB (default: the "
        "GPU's memory; none on the cpu profile)",
    )


def offload_settings(args: argparse.Namespace, profile: Any) -> Any:
    """The `OffloadSettings` of --offload and --host-memory on `profile`, or None without them."""
    from remat.planning.offload import OffloadSettings
    from remat.units import parse_bytes

    host = getattr(args, "host_memory", None)
    if not getattr(args, "offload", False):
        if host:
            raise RematError("--host-memory caps what --offload moves to the host: add --offload")
        return None
    return OffloadSettings.for_profile(profile, parse_bytes(host) if host else None)


def add_model_args(p: argparse.ArgumentParser) -> None:
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
        "n_layers=2 for llama (repeatable; an unknown field lists the valid ones). Values read "
        "as Python or JSON: True/false, None/null, 2, 1e-5, 'text', [1, 2]; a bare name is text",
    )
    p.add_argument(
        "--trace-device",
        default="meta",
        help="meta (default: fake tensors, nothing allocated) or cpu (real tensors: for models with data-dependent shapes)",
    )
    p.add_argument(
        "--full-trace",
        action="store_true",
        help="trace every block, not a few repeated blocks laid out at the model's depth (the "
        "same graph, byte for byte, slower)",
    )


def trace_model(args: argparse.Namespace, console: Console):
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
    setup = precision_of(args)
    if setup is not None:  # estimate --precision: built and traced as fit traces it
        args.dtype = setup.param_dtype
    model, inputs = models.build(
        args.model,
        batch=args.batch,
        seq=args.seq,
        dtype=DTYPES[args.dtype],
        device=device,
        tiny=args.tiny,
        **model_overrides(args),
    )
    autocast = None
    if setup is not None:
        model, autocast = setup.prepare(model), setup.autocast
    where = "fake tensors" if device == "meta" else f"real {device} tensors"
    start = time.perf_counter()
    gpu = getattr(args, "gpu", None)
    target = None
    if gpu is not None and args.command == "estimate":
        from remat.device.gpus import get_gpu

        target = get_gpu(gpu).target
        where += f", with {target.describe()}'s kernels"
    layout = layout_of(args)
    with console.status(f"tracing one training step of {args.model} on {where} ..."):
        if layout.ranks > 1:  # one rank's step: estimate --tp / --cp

            def build(batch: int, seq: int):
                built, built_inputs = models.build(
                    args.model, batch=batch, seq=seq, dtype=DTYPES[args.dtype], tiny=args.tiny,
                    **model_overrides(args),
                )  # fmt: skip
                return (setup.prepare(built) if setup else built), built_inputs

            graph = layout.trace(
                build,
                args.batch,
                args.seq,
                autocast=autocast,
                target=target,
                replicate_depth=not getattr(args, "full_trace", False),
            )
            graph.info["layout"] = layout.describe(graph)
        else:
            graph = trace(
                model,
                *inputs,
                device=device,
                target=target,
                autocast=autocast,
                replicate_depth=device == "meta" and not getattr(args, "full_trace", False),
            )
    graph = loop_of(args).apply(graph)
    graph.info.update(
        model=args.model,
        shape=_shape(args, inputs)
        + (f", one rank of {graph.info['layout']}" if "layout" in graph.info else ""),
        batch=args.batch,
        seq=args.seq,
        dtype=args.dtype,
    )
    return graph, time.perf_counter() - start, (model, inputs)


def precision_of(args: argparse.Namespace) -> Any:
    """estimate's --precision as fit's `PrecisionSetup`, or None (--dtype, no autocast)."""
    # fit judges each precision itself; demo's namespace is built, not parsed: it has no command
    precision = (
        getattr(args, "precision", None) if getattr(args, "command", None) == "estimate" else None
    )
    if precision is None:
        return None
    from remat.answers.fit_steps import PRECISIONS

    return PRECISIONS[precision]


def _shape(args: argparse.Namespace, inputs: tuple) -> str:
    """What was built, for titles: a preset's batch and seq, or a factory's input shapes (it may
    ignore --batch and --seq)."""
    if ":" in args.model and not args.model.startswith("hf:"):
        shapes = [tuple(t.shape) for t in inputs if hasattr(t, "shape")]
        return "inputs " + ", ".join(str(s) for s in shapes)
    return f"batch {args.batch}, seq {args.seq}"


def title_of(args: argparse.Namespace, planner: Planner) -> str:
    """The model as built and where it is costed, for titles of tables and plots."""
    shape = planner.graph.info["shape"]
    return f"{model_name(args)}, {shape}, {args.dtype}, costs on {planner.profile.name}"


def model_name(args: argparse.Namespace) -> str:
    """The model spec with its overrides: the demo's gpt2 is narrowed, and says so."""
    tiny = " tiny" if args.tiny else ""
    return f"{args.model}{tiny}" + (f" ({', '.join(args.set)})" if args.set else "")


def writable(path: str | None, option: str) -> None:
    """Refuse an output path whose folder does not exist before the work, not after it."""
    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise RematError(f"{option} {path}: the folder {folder} does not exist; create it first")
    if not os.access(folder, os.W_OK):
        raise RematError(f"{option} {path}: the folder {folder} is not writable")


def positive_int(text: str) -> int:
    """argparse type of counts: a whole number, at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not at least 1")
    return value


def fsdp_unit(text: str) -> Any:
    """argparse type of --fsdp-unit: module paths joined by commas, `:keep` for a unit not
    resharded after its forward (`remat.prediction.gpu_memory.FsdpUnit`)."""
    from remat.prediction.gpu_memory import FsdpUnit

    paths, _, flag = text.partition(":")
    names = tuple(p.strip() for p in paths.split(",") if p.strip())
    if not names or flag not in ("", "keep"):
        raise argparse.ArgumentTypeError(
            f"{text!r}: give module paths joined by commas, with :keep for a unit kept gathered "
            "from its forward to its backward (e.g. tok_embeddings, or norm,output:keep)"
        )
    return FsdpUnit(names, reshard_after_forward=flag != "keep")


def add_fsdp_unit_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--fsdp-unit",
        type=fsdp_unit,
        action="append",
        default=[],
        metavar="PATH[,PATH...][:keep]",
        help="with --shard: modules outside the blocks that fully_shard wraps in a unit of their "
        "own, once per unit; :keep when not resharded after forward. torchtitan wraps "
        "'--fsdp-unit tok_embeddings --fsdp-unit norm,output:keep'; without it those "
        "parameters are the root unit's, gathered all step",
    )


def planner_for(args: argparse.Namespace, console: Console) -> Planner:
    """Trace the model the arguments name and prepare it for planning on `--profile`."""
    from remat.planning.planner import Planner

    graph, seconds, _ = trace_model(args, console)
    planner = Planner(graph, args.profile, args.optimizer, offload_settings(args, args.profile))
    planner.graph.info["trace_seconds"] = seconds
    return planner


def layout_of(args: argparse.Namespace) -> Any:
    """The parallel layout of --tp, --cp, --pp, --microbatches and --schedule (one rank, one
    micro-batch per stage and 1F1B where a command takes none)."""
    from remat.layouts.parallel import Layout

    return Layout(
        tp=getattr(args, "tp", 1),
        cp=getattr(args, "cp", 1),
        pp=getattr(args, "pp", 1),
        microbatches=getattr(args, "microbatches", 0) or 0,
        schedule=getattr(args, "schedule", "1f1b"),
        sequence_parallel=getattr(args, "sp", None),
    )


def add_tp_args(parser: argparse.ArgumentParser) -> None:
    """--tp and --sp / --no-sp: one tensor-parallel rank's step, laid out by the model's plan."""
    parser.add_argument(
        "--tp",
        type=positive_int,
        default=1,
        help="one tensor-parallel rank's step (torch's parallelize_module): the zoo's Llama and "
        "GPT as torchtitan / Megatron-LM lay them out, a Hugging Face model by its own "
        "base_model_tp_plan, a model of your own by its tp_plan attribute (docs/parallelism.md)",
    )
    parser.add_argument(
        "--sp",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="sequence parallelism with --tp (default: as the model's plan has it: on for the "
        "zoo's, off for transformers')",
    )
