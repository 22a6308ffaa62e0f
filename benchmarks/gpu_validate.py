"""Check remat's predictions against a real device in one command: peaks planned against peaks
measured, and the step time each strategy really costs.

    python benchmarks/gpu_validate.py [--device cuda|cpu] [--tiny] [--rounds N] [--models ...]
        [--strategies ...] [--parts memory speed allocator offload] [--out DIR] [--md PATH]
        [--skip-compiled] [--allocator-models ...]

Memory: for each zoo model, every eager strategy's plan (made from a trace of a meta copy with the GPU's kernel
rules, as `remat plan --gpu` makes it) is applied to the real model and one step is measured by `remat.measure`;
then `remat.compile`'s plans likewise, under inductor. Peaks are compared above the step's start,
as `measure` counts them: the plan's predicted peak less what is live before the step
(parameters, buffers, inputs), against the measured peak less `baseline_bytes` (on CUDA, the
caching allocator's `max_memory_allocated` above its count when the step began).

Allocator (`--parts allocator`, CUDA only): for one preset and one Hugging Face model, two real
training steps with AdamW on the GPU, and `torch.cuda.memory_stats()`'s requested, allocated and
reserved peaks against `remat.prediction.gpu_memory`'s prediction from a meta copy traced for this GPU
(`remat.device.gpus.get_gpu(torch.cuda.get_device_name())`); and the bytes autograd saves per op in a
real CUDA trace against the fake trace with the GPU's kernel rules (`remat.device.targets`).

Offload (`--parts offload`): GPT-2 planned with offload (docs/offload.md) at full checkpointing's
predicted peak, applied to the real model: the drop of the peak offload makes, measured with its
hooks on and off, against the predicted drop; host bytes copied against the plan's; step time
with offload on and off against the predicted copy time not hidden. Then the same model through
`remat.compile(offload=...)` (torch's compile offload pass): the compiled step's peak with and
without offload, measured against predicted.

Speed: on a Llama (bf16-mixed at 4096 tokens on a GPU), the step time of each strategy relative
to store_all, torch.compile at `activation_memory_budget=0.5` and remat.compile at the peak torch
measured, timed in interleaved rounds: each round times one step of every variant in turn,
starting one variant later than the round before, so that a slow spell of the machine lands on
every variant alike.

Writes results/gpu-validate-<device>[-tiny][-<part>].json (every row, the device, torch's
version, the settings) and .md (the tables, also printed), again after each part and model, so
that a run stopped at a device lease's limit keeps what it measured; progress goes to stderr. A row that
fails keeps its error and the run goes on; the exit status is then 1. A full run compiles 14
times: where one command may only run minutes, split it with --parts, --models or
--skip-compiled.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import json
import re
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

import remat
from remat import Planner, models
from remat.answers.bench import plan_applied
from remat.applying.compiled import plans_of
from remat.device.cost import DeviceProfile
from remat.errors import InfeasibleBudget, NoBlocksError, RematError
from remat.graph import Graph
from remat.measuring.calibrate import calibrate_profile
from remat.measuring.measure import Measurement, measure, time_steps
from remat.planning import strategies
from remat.tracing.trace import default_loss
from remat.units import format_bytes

MODELS = ("gpt2", "llama-3.2-1b", "megatron-gpt", "mlp-chain-16")
STRATEGIES = (
    "store_all",
    "full",
    "sqrt",
    "chain_dp",
    "selective:megatron",
    "selective:torchtitan",
    "auto",
)
#: remat.compile's variants in the memory part: (strategy, budget).
COMPILED = (("mincut", None), ("auto", "100%"), ("auto", "50%"))
#: Memory-part shapes: small enough for any data-center GPU, large enough that activations matter.
SHAPES = {
    "gpt2": {"batch": 4, "seq": 1024},
    "llama-3.2-1b": {"batch": 1, "seq": 2048},
    "megatron-gpt": {"batch": 2, "seq": 2048},
    "mlp-chain-16": {"batch": 8192},
}
#: With --tiny: the tiny presets, at sizes where activations still outweigh the parameters.
TINY_SHAPES = {"mlp-chain-16": {"batch": 256}}
TINY_SHAPE = {"batch": 4, "seq": 128}
SPEED_MODEL = "llama-3.2-1b"
#: The allocator part: a preset and a Hugging Face model, each at (batch, seq).
ALLOCATOR_MODELS = ("llama-3.2-1b", "hf:gpt2")
ALLOCATOR_SHAPE = {"batch": 4, "seq": 1024}
SPEED_EAGER = ("store_all", "full", "selective:megatron", "selective:torchtitan")
TORCH_BUDGET = 0.5  # torch.compile's activation_memory_budget in the speed part
RESULTS = Path(__file__).resolve().parent / "results"
#: Precision: (the dtype parameters are built in, the autocast dtype of forward and loss), as in
#: `remat fit`; bf16-mixed holds fp32 parameters and gradients.
PRECISIONS: dict[str, tuple[str, torch.dtype | None]] = {
    "fp32": ("fp32", None),
    "bf16": ("bf16", None),
    "bf16-mixed": ("fp32", torch.bfloat16),
}

Progress = Callable[[str], None]
Setup = Callable[[], AbstractContextManager[Any]]


@dataclass
class Row:
    """One variant of a model's training step, measured.

    Peaks are above the step's start (what was live before it). `held` says what the held
    columns compare: "held", for eager plans, is `Plan.held_bytes` against what the forward left
    live for the backward (`Measurement.held_bytes`); "saved", for compiled graphs, is the plans'
    `held_bytes` against the bytes autograd saved (`Measurement.activation_bytes`)."""

    part: str
    model: str
    variant: str
    plan: str = ""
    start_bytes: int | None = None
    predicted_peak_bytes: int | None = None
    measured_peak_bytes: int | None = None
    held: str = ""
    predicted_held_bytes: int | None = None
    measured_held_bytes: int | None = None
    step_seconds: list[float] = field(default_factory=list)
    time_ratio: float | None = None
    note: str = ""
    error: str = ""

    @property
    def peak_ratio(self) -> float | None:
        """Measured over predicted peak, both above the step's start."""
        if self.measured_peak_bytes is None or not self.predicted_peak_bytes:
            return None
        return self.measured_peak_bytes / self.predicted_peak_bytes

    @property
    def median_seconds(self) -> float | None:
        return statistics.median(self.step_seconds) if self.step_seconds else None

    def to_dict(self) -> dict[str, Any]:
        times = self.step_seconds
        return {
            **asdict(self),
            "peak_ratio": self.peak_ratio,
            "step_seconds_median": self.median_seconds,
            "step_seconds_min": min(times, default=None),
            "step_seconds_max": max(times, default=None),
        }


@dataclass(frozen=True)
class Settings:
    """What every part needs: where to run, in which precision, with which cost profile."""

    device: torch.device
    precision: str
    profile: DeviceProfile
    tiny: bool
    budget: str
    trace_real: bool
    #: The kernel rules a meta copy is traced with: the GPU's (`remat.device.targets`) on CUDA,
    #: as `remat plan --gpu` traces; None on the CPU.
    target: Any = None

    @property
    def dtype(self) -> str:
        return PRECISIONS[self.precision][0]

    @property
    def autocast(self) -> torch.dtype | None:
        return PRECISIONS[self.precision][1]


class Step(nn.Module):
    """A model's forward and loss as `remat.trace(..., autocast=dtype)` runs them: both under
    autocast (none when `dtype` is None), the backward outside it. Returns (output, loss) with
    `loss_of` as the loss, so the output stays referenced until the step ends, as in the trace."""

    def __init__(self, model: nn.Module, dtype: torch.dtype | None, device_type: str) -> None:
        super().__init__()
        self.model, self.dtype, self.device_type = model, dtype, device_type

    def forward(self, *inputs: Any) -> tuple[Any, torch.Tensor]:
        mixed = torch.autocast(
            self.device_type, dtype=self.dtype or torch.bfloat16, enabled=self.dtype is not None
        )
        with mixed:
            out = self.model(*inputs)
            return out, default_loss(out)


def loss_of(result: tuple[Any, torch.Tensor]) -> torch.Tensor:
    return result[1]


@dataclass
class Variant:
    """A measured row that can be timed: the `Step` to run and what to set up around each step."""

    row: Row
    step: Step
    setup: Setup = contextlib.nullcontext


class Skipped(Exception):
    """A variant that does not apply here (no blocks, infeasible budget): a note, not an error."""


def _attempt(row: Row, measure_row: Callable[[Row], Variant]) -> Variant | None:
    """Run `measure_row`, recording a skip as the row's note and a failure as its error."""
    try:
        return measure_row(row)
    except (Skipped, InfeasibleBudget, NoBlocksError) as e:
        row.note = f"skipped: {e}"
    except Exception as e:
        row.error = f"{type(e).__name__}: {e}"
    return None


def _measured(row: Row, m: Measurement, held: str) -> None:
    row.start_bytes = m.baseline_bytes
    row.measured_peak_bytes = m.peak_bytes - m.baseline_bytes
    row.held = held
    row.measured_held_bytes = m.held_bytes if held == "held" else m.activation_bytes


def memory_shape(name: str, tiny: bool) -> dict[str, int]:
    if tiny:
        return TINY_SHAPES.get(name, TINY_SHAPE)
    return SHAPES.get(name, {"batch": 2, "seq": 1024})


def _build(name: str, shape: dict[str, Any], device: str, settings: Settings, **overrides: Any):
    torch.manual_seed(0)
    return models.build(
        name, device=device, dtype=settings.dtype, tiny=settings.tiny, **shape, **overrides
    )


def _planner(
    name: str, shape: dict[str, Any], model: nn.Module, inputs: tuple, settings: Settings, **kw: Any
) -> Planner:
    """A planner from a trace of a meta copy of the model (of the real model with --trace-real)."""
    if settings.trace_real:
        graph = remat.trace(model, *inputs, device=settings.device.type, autocast=settings.autocast)
    else:
        meta, meta_inputs = _build(name, shape, "meta", settings, **kw)
        graph = remat.trace(meta, *meta_inputs, autocast=settings.autocast, target=settings.target)
    return Planner(graph, settings.profile)


def _eager(
    row: Row,
    model: nn.Module,
    inputs: tuple,
    planner: Planner,
    settings: Settings,
    name: str,
    budget: int | str,
) -> Variant:
    """The plan of strategy `name` (budgeted ones at `budget`) applied to `model`, measured."""
    strategy = strategies.get(name, "eager")
    budget_bytes = planner.budget_bytes(budget)
    if strategy.budgeted:
        p = planner.plan(budget_bytes, name)
    else:
        p = planner.solve(strategy, budget_bytes)
    if not p.appliable:
        raise Skipped("reference only: remat cannot apply this plan")
    row.plan = p.strategy
    row.predicted_peak_bytes = p.predicted_peak_bytes - planner.base_bytes
    row.predicted_held_bytes = p.held_bytes
    setup = functools.partial(plan_applied, model, p)
    step = Step(model, settings.autocast, settings.device.type)
    with setup():
        _measured(row, measure(step, *inputs, loss_fn=loss_of), "held")
    return Variant(row, step, setup)


def _persistent_bytes(graph: Graph) -> int:
    """What a compiled graph has before the step: parameters, buffers and inputs (not the
    gradient of its outputs, which the step makes)."""
    return sum(
        s.nbytes for s in graph.storages.values() if s.allocated_at is None and s.kind != "grad"
    )


def _compiled(
    row: Row,
    model: nn.Module,
    inputs: tuple,
    settings: Settings,
    strategy: str,
    budget: int | str | None,
) -> Variant:
    """`remat.compile(model)` with `strategy` at `budget`, measured (its first call compiles)."""
    compiled = remat.compile(model, budget=budget, strategy=strategy, profile=settings.profile)
    step = Step(compiled, settings.autocast, settings.device.type)
    m = measure(step, *inputs, loss_fn=loss_of)
    plans, graphs = plans_of(compiled), compiled.remat_backend.graphs
    # A compiled plan is "optimal" exactly when it is the min-cut (`remat.applying.compiled.decide`).
    row.plan = ", ".join("min-cut" if p.status == "optimal" else "budgeted save set" for p in plans)
    row.predicted_peak_bytes = max(
        p.predicted_peak_bytes - _persistent_bytes(g) for p, g in zip(plans, graphs, strict=True)
    )
    row.predicted_held_bytes = sum(p.held_bytes for p in plans)
    if len(plans) != 1:
        row.note = f"{len(plans)} graphs: the largest peak of any, the sum of their saves"
    _measured(row, m, "saved")
    return Variant(row, step)


def memory_part(
    name: str, names: Sequence[str], settings: Settings, compiled: bool, progress: Progress
) -> list[Row]:
    """Every strategy in `names`, then remat.compile's variants, on model `name`."""
    shape = memory_shape(name, settings.tiny)
    progress(f"memory: {name} {shape}: tracing")
    try:
        model, inputs = _build(name, shape, str(settings.device), settings)
        planner = _planner(name, shape, model, inputs, settings)
    except Exception as e:
        return [Row("memory", name, "trace", error=f"{type(e).__name__}: {e}")]
    rows = []
    for s in names:
        budgeted = strategies.get(s, "eager").budgeted
        row = Row("memory", name, f"{s}@{settings.budget}" if budgeted else s)
        progress(f"memory: {name}: {row.variant}")
        _attempt(
            row, lambda r, s=s: _eager(r, model, inputs, planner, settings, s, settings.budget)
        )
        rows.append(row)
    if compiled:
        for strategy, budget in COMPILED:
            row = Row("memory", name, f"compile:{strategy}" + (f"@{budget}" if budget else ""))
            progress(f"memory: {name}: {row.variant}")
            torch._dynamo.reset()
            _attempt(
                row,
                lambda r, s=strategy, b=budget: _compiled(r, model, inputs, settings, s, b),
            )
            rows.append(row)
        torch._dynamo.reset()
    return rows


def _torch_compiled(row: Row, model: nn.Module, inputs: tuple, settings: Settings) -> Variant:
    """torch.compile with its own partitioner at `TORCH_BUDGET` (read when the first call
    compiles), measured."""
    from torch._functorch import config as functorch_config

    step = Step(torch.compile(model, dynamic=False), settings.autocast, settings.device.type)
    with functorch_config.patch(activation_memory_budget=TORCH_BUDGET):
        _measured(row, measure(step, *inputs, loss_fn=loss_of), "saved")
    row.plan = "torch's min-cut partitioner"
    return Variant(row, step)


def _absolute_peak(row: Row) -> int | None:
    """The row's measured peak with what was live before the step (None if unmeasured): the
    terms of a compiled plan's budget, whose graph has the same parameters and inputs."""
    if row.measured_peak_bytes is None or row.start_bytes is None:
        return None
    return row.start_bytes + row.measured_peak_bytes


def speed_part(
    name: str,
    shape: dict[str, Any],
    overrides: dict[str, Any],
    settings: Settings,
    rounds: int,
    compiled: bool,
    progress: Progress,
) -> list[Row]:
    """Each speed variant measured once, then timed in `rounds` interleaved rounds."""
    progress(f"speed: {name} {shape}: tracing")
    try:
        model, inputs = _build(name, shape, str(settings.device), settings, **overrides)
        planner = _planner(name, shape, model, inputs, settings, **overrides)
    except Exception as e:
        return [Row("speed", name, "trace", error=f"{type(e).__name__}: {e}")]
    rows: list[Row] = []
    variants: list[Variant | None] = []

    def add(variant: str, measure_row: Callable[[Row], Variant]) -> Row:
        row = Row("speed", name, variant)
        progress(f"speed: {name}: {variant}")
        variants.append(_attempt(row, measure_row))
        rows.append(row)
        return row

    def eager(strategy: str, budget: int | str) -> Callable[[Row], Variant]:
        return lambda r: _eager(r, model, inputs, planner, settings, strategy, budget)

    for s in SPEED_EAGER:
        add(s, eager(s, settings.budget))
    add(f"auto@{settings.budget}", eager("auto", settings.budget))
    full = rows[SPEED_EAGER.index("full")]
    if full.measured_peak_bytes is not None:  # the same measured peak, in the planner's terms
        add("auto@full's peak", eager("auto", planner.base_bytes + full.measured_peak_bytes))
    if compiled:
        twin = copy.deepcopy(model)  # compiled variants never see the eager plans' patches
        torch._dynamo.reset()
        theirs = add(
            f"torch.compile@{TORCH_BUDGET:g}", lambda r: _torch_compiled(r, twin, inputs, settings)
        )
        torch_peak = _absolute_peak(theirs)
        if torch_peak is not None:
            add(
                "compile:auto@torch's peak",
                lambda r: _compiled(r, twin, inputs, settings, "auto", torch_peak),
            )
    timed = [v for v in variants if v is not None]
    try:
        _interleaved_rounds(timed, inputs, rounds, progress)
    finally:
        torch._dynamo.reset()
    base = rows[0].median_seconds if rows[0].variant == "store_all" else None
    for row in rows:
        if base and row.median_seconds:
            row.time_ratio = row.median_seconds / base
    return rows


def _interleaved_rounds(
    variants: list[Variant], inputs: tuple, rounds: int, progress: Progress
) -> None:
    """Append one step time per round to each variant's row: round r times one step of every
    variant, each set up just before and torn down just after, starting at variant r; the first
    round warms each variant with one untimed step. A compiled variant may not recompile while
    timed; a variant that fails keeps its error and leaves the later rounds."""
    from torch._dynamo import config as dynamo_config

    for r in range(rounds):
        progress(f"speed: round {r + 1}/{rounds}")
        for k in range(len(variants)):
            v = variants[(r + k) % len(variants)]
            if v.row.error:
                continue
            try:
                with v.setup(), dynamo_config.patch(error_on_recompile=True):
                    v.row.step_seconds += time_steps(
                        v.step, *inputs, steps=1, warmup=1 if r == 0 else 0, loss_fn=loss_of
                    )
            except Exception as e:
                v.row.error = f"while timing: {type(e).__name__}: {e}"


def saved_by_op(graph: Graph) -> dict[str, int]:
    """The bytes autograd saves, by the forward op that made each saved storage (each storage
    once): what a fake trace for a GPU must agree with in a real trace on it."""
    out: dict[str, int] = {}
    for sid in graph.saved_storages:
        op = graph.producer_op(sid)
        name = op.name if op is not None else f"<{graph.storages[sid].kind}>"
        out[name] = out.get(name, 0) + graph.storages[sid].nbytes
    return out


def compare_saved(real: dict[str, int], fake: dict[str, int]) -> dict[str, Any]:
    """Totals and the ops whose saved bytes differ (at most 10, largest difference first)."""
    ops = sorted(set(real) | set(fake), key=lambda k: -abs(real.get(k, 0) - fake.get(k, 0)))
    differ = [k for k in ops if real.get(k, 0) != fake.get(k, 0)]
    return {
        "real_saved_bytes": sum(real.values()),
        "predicted_saved_bytes": sum(fake.values()),
        "ops": len(ops),
        "ops_differing": len(differ),
        "largest_differences": [(k, real.get(k, 0), fake.get(k, 0)) for k in differ[:10]],
    }


def allocator_part(name: str, settings: Settings, progress: Progress) -> dict[str, Any]:
    """Two real AdamW steps of `name` on the GPU against `remat.prediction.gpu_memory`'s prediction, and the
    saved bytes per op of a real CUDA trace against the fake trace for this GPU."""
    row: dict[str, Any] = {"model": name, **ALLOCATOR_SHAPE}
    if settings.device.type != "cuda":
        row["note"] = "skipped: the caching allocator's statistics need a CUDA device"
        return row
    try:
        from remat.device.gpus import get_gpu
        from remat.prediction.gpu_memory import ALLOCATOR_SETTINGS, gpu_memory

        gpu = get_gpu(torch.cuda.get_device_name(settings.device))
        progress(f"allocator: {name} predicted for {gpu.name}")
        meta, meta_inputs = _build(name, ALLOCATOR_SHAPE, "meta", settings)
        fake = remat.trace(meta, *meta_inputs, autocast=settings.autocast, target=settings.target)
        predicted = gpu_memory(fake, gpu, optimizer="adamw", settings=ALLOCATOR_SETTINGS[0])
        progress(f"allocator: {name} measured, two AdamW steps")
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(settings.device)
        model, inputs = _build(name, ALLOCATOR_SHAPE, str(settings.device), settings)
        step = Step(model, settings.autocast, "cuda")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
        for _ in range(2):
            out = step(*inputs)  # held through the backward, as a training loop holds it
            loss_of(out).backward()
            del out
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize(settings.device)
        stats = torch.cuda.memory_stats(settings.device)
        for what in ("requested", "allocated", "reserved"):
            row[f"predicted_{what}_bytes"] = getattr(predicted, f"{what}_bytes")
            row[f"measured_{what}_bytes"] = stats[f"{what}_bytes.all.peak"]
        row["measured_alloc_retries"] = stats["num_alloc_retries"]
        progress(f"allocator: {name} saved bytes per op, real CUDA trace against the fake one")
        real = remat.trace(model, *inputs, device="cuda", autocast=settings.autocast)
        row["saved"] = compare_saved(saved_by_op(real), saved_by_op(fake))
        del model, inputs, optimizer, step, real
        torch.cuda.empty_cache()
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {e}"
    return row


#: The offload part: the model and its shape (tiny: `TINY_SHAPE`), as `remat fit --offload` plans.
OFFLOAD_MODEL = "gpt2"
OFFLOAD_SHAPE = {"batch": 8, "seq": 1024}


def offload_part(name: str, settings: Settings, progress: Progress) -> dict[str, Any]:
    """The plan with offload at full checkpointing's predicted peak (docs/offload.md), applied to
    the real model: the drop of the peak offload makes (measured with the hooks on and off, by
    `remat.verify`) against the predicted drop, the host bytes copied against the plan's, and
    the step time with offload on and off against the predicted copy time not hidden. Traced
    and measured without autocast, so that the plan and the step hold the same tensors."""
    from remat.applying.eager import installed_offloader
    from remat.device.gpus import get_gpu
    from remat.planning.offload import OffloadSettings

    shape = TINY_SHAPE if settings.tiny else OFFLOAD_SHAPE
    row: dict[str, Any] = {"model": name, **shape}
    try:
        cuda = settings.device.type == "cuda"
        gpu = get_gpu(torch.cuda.get_device_name(settings.device)) if cuda else None
        offload = (
            OffloadSettings.for_profile(gpu.name, gpu.capacity_bytes)
            if gpu is not None
            else OffloadSettings(min_bytes=1024 if settings.tiny else 2**20)
        )
        progress(f"offload: {name} planned on {offload.link_name}")
        meta, meta_inputs = _build(name, shape, "meta", settings)
        graph = remat.trace(meta, *meta_inputs, target=settings.target)
        planner = Planner(graph, settings.profile, offload=offload)
        full = planner.plan("1TiB", "full")
        plan = planner.plan(full.predicted_peak_bytes, "auto")
        row.update(
            strategy=plan.strategy,
            offloaded=list(plan.offload),
            predicted_drop_bytes=plan.offload_drop_bytes,
            predicted_host_bytes=plan.host_bytes,
            predicted_transfer_seconds=plan.transfer_seconds,
            predicted_peak_bytes=plan.predicted_peak_bytes,
            full_peak_bytes=full.predicted_peak_bytes,
            full_added_seconds=full.added_seconds,
            added_seconds=plan.added_seconds,
        )
        if not plan.offload:
            row["note"] = "the fastest plan at full's peak offloads nothing on this device"
            return row
        progress(f"offload: {name} measured with the hooks on and off")
        model, inputs = _build(name, shape, str(settings.device), settings)
        remat.apply(model, plan)
        checked = remat.verify(model, *inputs)
        offloader = installed_offloader(model)
        rounds = 3 if settings.tiny else 5
        on = remat.measure(model, *inputs, steps=rounds).step_seconds
        row.update(
            measured_drop_bytes=checked.offload_drop_measured,
            drop_ratio=checked.offload_drop_ratio,
            measured_host_bytes=offloader.offloaded_bytes,  # of the latest step, hooks on
            measured_peak_bytes=checked.peak_bytes_measured,
        )
        offloader.enabled = False
        off = remat.measure(model, *inputs, steps=rounds).step_seconds
        offloader.enabled = True
        row.update(
            step_seconds_offload=statistics.median(on),
            step_seconds_no_offload=statistics.median(off),
        )
        remat.remove(model)
        del model, inputs
        if cuda:
            torch.cuda.empty_cache()
        if cuda:  # on the CPU the pass's copies stay in the same memory: nothing to measure
            progress(f"offload: {name} compiled with and without torch's offload pass")
            row.update(_compiled_offload(name, shape, settings, offload))
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {e}"
    return row


def _compiled_offload(
    name: str, shape: dict[str, Any], settings: Settings, offload: Any
) -> dict[str, Any]:
    """The compiled step's peak with and without `remat.compile(offload=...)` (same save set:
    the min-cut), measured against predicted, and its step time."""
    out: dict[str, Any] = {}
    for key, chosen in (("compiled", False), ("compiled_offload", offload)):
        torch._dynamo.reset()
        model, inputs = _build(name, shape, str(settings.device), settings)
        compiled = remat.compile(
            model,
            strategy="mincut",
            profile=settings.profile,
            offload=chosen,
            peak_model="op-by-op",
        )
        measured = remat.measure(compiled, *inputs, steps=3)
        plans = compiled.remat_backend.plans
        out[f"{key}_peak_predicted"] = sum(p.predicted_peak_bytes for p in plans)
        out[f"{key}_peak_measured"] = measured.peak_bytes
        out[f"{key}_step_seconds"] = statistics.median(measured.step_seconds)
        out[f"{key}_host_bytes"] = sum(p.host_bytes for p in plans)
        out[f"{key}_predicted_drop_bytes"] = sum(p.offload_drop_bytes for p in plans)
        del model, inputs, compiled
    out["compiled_measured_drop_bytes"] = (
        out["compiled_peak_measured"] - out["compiled_offload_peak_measured"]
    )
    return out


def offload_markdown(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return ""
    lines = ["", "## Offload at full checkpointing's peak", ""]
    lines += _table(
        [
            "model",
            "plan",
            "drop predicted",
            "drop measured",
            "ratio",
            "host predicted",
            "host measured",
            "copies not hidden (predicted)",
            "step on / off (measured)",
        ],
        [
            [
                r["model"],
                r.get("strategy", "-"),
                _bytes(r.get("predicted_drop_bytes")),
                _bytes(r.get("measured_drop_bytes")),
                _ratio(r.get("drop_ratio")),
                _bytes(r.get("predicted_host_bytes")),
                _bytes(r.get("measured_host_bytes")),
                _ms(r.get("predicted_transfer_seconds")),
                f"{_ms(r.get('step_seconds_offload'))} / {_ms(r.get('step_seconds_no_offload'))}",
            ]
            for r in rows
        ],
    )
    lines += [
        f"- {r['model']} compiled (min-cut): drop of the peak with offload predicted "
        f"{_bytes(r.get('compiled_offload_predicted_drop_bytes'))}, measured "
        f"{_bytes(r.get('compiled_measured_drop_bytes'))}; host "
        f"{_bytes(r.get('compiled_offload_host_bytes'))}; step "
        f"{_ms(r.get('compiled_offload_step_seconds'))} / {_ms(r.get('compiled_step_seconds'))}"
        for r in rows
        if "compiled_measured_drop_bytes" in r
    ]
    lines += [
        f"- {r['model']}: {r.get('error') or r.get('note')}"
        for r in rows
        if r.get("error") or r.get("note")
    ]
    return "\n".join(lines) + "\n"


def allocator_markdown(rows: list[dict[str, Any]]) -> str:
    """The allocator part's table: each figure predicted and measured, and the saved bytes."""
    if not rows:
        return ""
    lines = [
        "",
        "### The caching allocator: predicted and measured (torch.cuda.memory_stats peaks)",
        "",
    ]
    header = ["model", "batch x seq"] + [
        f"{w} {k}" for w in ("requested", "allocated", "reserved") for k in ("pred.", "meas.")
    ]
    header += ["saved bytes real / fake", "ops differing", "note"]
    body = []
    for r in rows:
        figures = [
            _bytes(r.get(f"{k}_{w}_bytes"))
            for w in ("requested", "allocated", "reserved")
            for k in ("predicted", "measured")
        ]
        saved = r.get("saved", {})
        body.append(
            [r["model"], f"{r['batch']} x {r['seq']}", *figures]
            + [
                f"{_bytes(saved.get('real_saved_bytes'))} / {_bytes(saved.get('predicted_saved_bytes'))}"
                if saved
                else "-",
                f"{saved.get('ops_differing', '-')} of {saved.get('ops', '-')}" if saved else "-",
                r.get("error") or r.get("note", ""),
            ]
        )
    return "\n".join(lines + _table(header, body)) + "\n"


def _stderr_progress() -> Progress:
    start = time.perf_counter()

    def progress(text: str) -> None:
        print(f"[{time.perf_counter() - start:7.1f}s] {text}", file=sys.stderr, flush=True)

    return progress


def _bytes(n: int | None) -> str:
    return "-" if n is None else format_bytes(n)


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _note(row: Row) -> str:
    text = f"error: {row.error}" if row.error else row.note
    return text.replace("|", "\\|").replace("\n", " ")


def _table(header: list[str], lines: list[list[str]]) -> list[str]:
    return [
        "| " + " | ".join(header) + " |",
        "|" + "|".join(" --- " for _ in header) + "|",
        *("| " + " | ".join(cells) + " |" for cells in lines),
    ]


def markdown(result: dict[str, Any], rows: list[Row]) -> str:
    """The report: a memory table (peaks above the step's start) and a speed table."""
    settings = result["settings"]
    out = [
        f"## remat on {result['device']} (torch {result['torch']}, remat {result['remat']}, "
        f"{settings['precision']})",
    ]
    memory = [r for r in rows if r.part == "memory"]
    if memory:
        out += [
            "",
            "### Memory: peak above the step's start, predicted and measured",
            "",
            *_table(
                [
                    "model",
                    "variant",
                    "plan",
                    "predicted peak",
                    "measured peak",
                    "measured / predicted",
                    "held or saved",
                    "predicted",
                    "measured",
                    "note",
                ],
                [
                    [
                        r.model,
                        r.variant,
                        r.plan,
                        _bytes(r.predicted_peak_bytes),
                        _bytes(r.measured_peak_bytes),
                        _ratio(r.peak_ratio),
                        r.held or "-",
                        _bytes(r.predicted_held_bytes),
                        _bytes(r.measured_held_bytes),
                        _note(r),
                    ]
                    for r in memory
                ],
            ),
        ]
    speed = [r for r in rows if r.part == "speed"]
    if speed:
        out += [
            "",
            f"### Speed: {settings['speed_model']} {settings['speed_shape']}, "
            f"{settings['rounds']} interleaved rounds",
            "",
            *_table(
                [
                    "variant",
                    "plan",
                    "step (median)",
                    "min - max",
                    "vs store_all",
                    "predicted peak",
                    "measured peak",
                    "measured / predicted",
                    "note",
                ],
                [
                    [
                        r.variant,
                        r.plan,
                        _ms(r.median_seconds),
                        f"{_ms(min(r.step_seconds))} - {_ms(max(r.step_seconds))}"
                        if r.step_seconds
                        else "-",
                        _ratio(r.time_ratio),
                        _bytes(r.predicted_peak_bytes),
                        _bytes(r.measured_peak_bytes),
                        _ratio(r.peak_ratio),
                        _note(r),
                    ]
                    for r in speed
                ],
            ),
        ]
    return "\n".join(out) + "\n"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f} ms"


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def _gpu_target(device: torch.device) -> Any:
    """The kernel rules of the CUDA device as this torch runs it (`targets.runtime_cuda`: its
    capability, the attention backend SDPA picks there); None on the CPU."""
    if device.type != "cuda":
        return None
    from remat.device.targets import runtime_cuda

    return runtime_cuda(device)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tiny", action="store_true", help="the models' tiny presets")
    parser.add_argument("--rounds", type=int, default=9, help="timing rounds (default: 9)")
    parser.add_argument("--models", nargs="+", default=list(MODELS), help="memory-part models")
    parser.add_argument(
        "--strategies", nargs="+", default=list(STRATEGIES), help="memory-part eager strategies"
    )
    parser.add_argument(
        "--parts",
        nargs="+",
        default=["memory", "speed"],
        choices=["memory", "speed", "allocator", "offload"],
    )
    parser.add_argument(
        "--allocator-models",
        nargs="+",
        default=list(ALLOCATOR_MODELS),
        help="allocator-part models (default: %(default)s)",
    )
    parser.add_argument("--budget", default="50%", help="of budgeted strategies (default: 50%%)")
    parser.add_argument(
        "--precision",
        choices=list(PRECISIONS),
        help="default: bf16-mixed on cuda, fp32 on cpu",
    )
    parser.add_argument("--speed-model", default=SPEED_MODEL)
    parser.add_argument("--speed-batch", type=int, help="default: 1 (4 with --tiny)")
    parser.add_argument("--speed-seq", type=int, help="default: 4096 (128 with --tiny)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a config field of the speed model, e.g. --set n_layers=8 (repeatable)",
    )
    parser.add_argument(
        "--trace-real",
        action="store_true",
        help="trace the real model on --device (its autocast op lists) instead of a meta copy",
    )
    parser.add_argument("--skip-compiled", action="store_true", help="eager variants only")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder of the JSON and .md")
    parser.add_argument("--md", type=Path, help="markdown file (default: beside the JSON)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    try:  # before any work: a typo should not cost a GPU run
        for name in args.strategies:
            strategies.get(name, "eager")
        args.overrides = models.parse_overrides(args.set)
    except RematError as e:
        parser.error(str(e))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the parts asked for, write the JSON and the markdown, print the markdown; 2 without
    the device, 1 when any row failed."""
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            f"gpu_validate: --device cuda, but this torch ({torch.__version__}) sees no CUDA "
            "device; run on a GPU machine, or pass --device cpu (with --tiny) to check the script",
            file=sys.stderr,
        )
        return 2
    progress = _stderr_progress()
    device = torch.device(args.device)
    label = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    progress(f"calibrating the cost profile of {label}")
    settings = Settings(
        device=device,
        precision=args.precision or ("bf16-mixed" if device.type == "cuda" else "fp32"),
        profile=calibrate_profile(args.device),
        tiny=args.tiny,
        budget=args.budget,
        trace_real=args.trace_real,
        target=_gpu_target(device),
    )
    default_shape = TINY_SHAPE if args.tiny else {"batch": 1, "seq": 4096}
    speed_shape = {
        "batch": args.speed_batch or default_shape["batch"],
        "seq": args.speed_seq or default_shape["seq"],
    }
    compiled = not args.skip_compiled
    rows: list[Row] = []
    allocator_rows: list[dict[str, Any]] = []
    offload_rows: list[dict[str, Any]] = []
    stem = f"gpu-validate-{_slug(label)}" + ("-tiny" if args.tiny else "")
    if len(args.parts) == 1:
        stem += f"-{args.parts[0]}"
    args.out.mkdir(parents=True, exist_ok=True)
    json_path = args.out / f"{stem}.json"
    md_path = args.md or args.out / f"{stem}.md"

    def write() -> str:
        """Write what is measured so far: a run stopped by a device lease's limit keeps it."""
        result = {
            "allocator": allocator_rows,
            "offload": offload_rows,
            "device": label,
            "torch": torch.__version__,
            "remat": remat.__version__,
            "settings": {
                **{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                "precision": settings.precision,
                "profile": asdict(settings.profile),
                "memory_shapes": {n: memory_shape(n, args.tiny) for n in args.models},
                "speed_shape": speed_shape,
            },
            "rows": [r.to_dict() for r in rows],
        }
        json_path.write_text(json.dumps(result, indent=2))
        text = markdown(result, rows) + allocator_markdown(allocator_rows)
        text += offload_markdown(offload_rows)
        md_path.write_text(text)
        return text

    if "allocator" in args.parts:
        for name in args.allocator_models:
            allocator_rows.append(allocator_part(name, settings, progress))
            write()
    if "memory" in args.parts:
        for name in args.models:
            rows += memory_part(name, args.strategies, settings, compiled, progress)
            write()
    if "speed" in args.parts:
        rows += speed_part(
            args.speed_model,
            speed_shape,
            args.overrides,
            settings,
            args.rounds,
            compiled,
            progress,
        )
        write()
    if "offload" in args.parts:
        offload_rows.append(offload_part(OFFLOAD_MODEL, settings, progress))
    print(write())
    failed = [r for r in rows if r.error] + [
        r for r in [*allocator_rows, *offload_rows] if r.get("error")
    ]
    progress(f"written {json_path} and {md_path}; {len(failed)} of {len(rows)} rows failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
