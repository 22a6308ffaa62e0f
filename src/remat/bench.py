"""Side by side, in one process on the same data: remat's plans and the baselines users already
have, each measured by `remat.measure` (which shares no code with the planner).

Baselines are written the way users write them, not through `remat.apply`: `torch.utils.checkpoint`
around every block, `checkpoint_sequential` over sqrt(n) segments, and for Hugging Face models
`gradient_checkpointing_enable()`.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

from remat import Planner, strategies
from remat.eager import apply, remove
from remat.errors import InfeasibleBudget
from remat.measure import measure
from remat.trace import default_loss

BASELINES = (
    "torch:checkpoint-per-block",
    "torch:checkpoint_sequential",
    "hf:gradient_checkpointing",
)


@dataclass(frozen=True)
class BenchRow:
    strategy: str
    held_bytes: int | None  # measured: what the forward left live for the backward
    peak_bytes: int | None  # measured peak of the step
    predicted_peak_bytes: int | None
    step_seconds: float | None  # median over the timed steps
    time_ratio: float | None  # to store_all's median
    grad_max_abs_diff: float | None  # against store_all's gradients
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def gradients(
    model: nn.Module,
    inputs: tuple,
    seed: int = 0,
    loss_fn: Callable[[Any], torch.Tensor] = default_loss,
    **kwargs: Any,
) -> dict[str, torch.Tensor]:
    """Parameter gradients of one step of `loss_fn(model(*inputs, **kwargs))` (default: remat's,
    the sum of the outputs), from a fixed RNG seed so that dropout draws the same masks in every
    run; grads are left cleared."""
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    loss_fn(model(*inputs, **kwargs)).backward()
    grads = {
        n.removeprefix("_orig_mod."): p.grad.detach().clone()  # torch.compile's wrapper
        for n, p in model.named_parameters()
        if p.grad is not None
    }
    model.zero_grad(set_to_none=True)
    return grads


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(((a[k].float() - b[k].float()).abs().max().item() for k in a), default=0.0)


@contextmanager
def _blocks_checkpointed(model: nn.Module, paths: list[str], sequential: bool) -> Iterator[None]:
    """The users' baseline: wrap each block in `checkpoint`, or the block list in
    `checkpoint_sequential` with sqrt(n) segments."""
    named = dict(model.named_modules())
    blocks = [named[p] for p in paths]
    originals = [b.forward for b in blocks]
    if sequential:
        segments = max(1, round(math.sqrt(len(blocks))))

        def run_all(x, *rest, **kwargs):
            functions = [lambda h, f=f: f(h, *rest, **kwargs) for f in originals]
            return checkpoint_sequential(functions, segments, x, use_reentrant=False)

        blocks[0].forward = run_all
        for b in blocks[1:]:
            b.forward = lambda x, *a, **k: x
    else:
        for b, f in zip(blocks, originals, strict=True):
            b.forward = lambda *a, f=f, **k: checkpoint(f, *a, use_reentrant=False, **k)
    try:
        yield
    finally:
        for b in blocks:
            del b.forward


def bench(
    model: nn.Module,
    inputs: tuple,
    planner: Planner,
    names: list[str],
    budget: int | str = "50%",
    steps: int = 3,
    progress: Callable[[str], None] | None = None,
) -> list[BenchRow]:
    """Measure store_all, each named strategy's plan (made by `planner`, on the same model's
    trace) and the baselines on `model` (real tensors)."""
    paths = [b.path for b in planner.blocks]
    reference = gradients(model, inputs)
    rows: list[BenchRow] = []
    base_seconds: float | None = None

    def run(name: str, predicted: int | None, note: str = "") -> None:
        nonlocal base_seconds
        if progress:
            progress(name)
        m = measure(model, *inputs, steps=steps)
        seconds = statistics.median(m.step_seconds)
        if name == "store_all":
            base_seconds = seconds
        rows.append(
            BenchRow(
                strategy=name,
                held_bytes=m.held_bytes,
                peak_bytes=m.peak_bytes,
                predicted_peak_bytes=predicted,
                step_seconds=seconds,
                time_ratio=seconds / base_seconds if base_seconds else None,
                grad_max_abs_diff=_max_diff(gradients(model, inputs), reference),
                note=note,
            )
        )

    for name in ["store_all", *[s for s in names if s != "store_all"]]:
        if name in BASELINES:
            run_baseline(model, name, paths, run, rows)
            continue
        try:
            p = planner.plan("1TiB" if name == "store_all" else budget, name)
        except InfeasibleBudget as e:
            rows.append(BenchRow(name, None, None, e.min_feasible_bytes, None, None, None, str(e)))
            continue
        if not p.appliable:
            rows.append(
                BenchRow(
                    name, None, None, p.predicted_peak_bytes, None, None, None, "reference only"
                )
            )
            continue
        apply(model, p)
        try:
            run(name, p.predicted_peak_bytes, p.strategy)
        finally:
            remove(model)
    return rows


def run_baseline(model: nn.Module, name: str, paths: list[str], run, rows: list[BenchRow]) -> None:
    if name == "hf:gradient_checkpointing":
        inner = getattr(model, "model", None)
        if inner is None or not hasattr(inner, "gradient_checkpointing_enable"):
            rows.append(
                BenchRow(name, None, None, None, None, None, None, "not a Hugging Face model")
            )
            return
        inner.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        try:
            run(name, None)
        finally:
            inner.gradient_checkpointing_disable()
        return
    if not paths:
        rows.append(BenchRow(name, None, None, None, None, None, None, "no repeated blocks"))
        return
    with _blocks_checkpointed(model, paths, sequential=name.endswith("sequential")):
        run(name, None)


#: Torch's own partitioner at these `activation_memory_budget` values (1.0 is its default).
TORCH_COMPILE_BUDGETS = (1.0, 0.5, 0.0)


def bench_compiled(
    model: nn.Module,
    inputs: tuple,
    budget: int | str | None = "50%",
    steps: int = 3,
    compiler: str = "inductor",
    profile: str = "cpu",
    base_seconds: float | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[BenchRow]:
    """Rows for torch.compile: torch's partitioner at each of `TORCH_COMPILE_BUDGETS` (its save set
    priced by remat's model), then remat's partitioner with each strategy that has a compiled
    path (`remat.strategies.available("compile")`), all measured
    like the eager rows. Every row compiles from scratch (`torch._dynamo.reset()`)."""
    from torch._functorch import config as functorch_config

    from remat.compiled import RematBackend, remat_error_cause

    reference = gradients(model, inputs)
    rows: list[BenchRow] = []
    runs: list[tuple[str, RematBackend, float | None]] = [
        (
            f"torch.compile@{b:g}",
            RematBackend(strategy="torch", profile=profile, compiler=compiler),
            b,
        )
        for b in TORCH_COMPILE_BUDGETS
    ]
    runs += [
        (
            f"compile:{s.name}",
            RematBackend(
                budget=budget if s.budgeted else None,
                strategy=s.name,
                profile=profile,
                compiler=compiler,
            ),
            None,
        )
        for s in strategies.available("compile")
    ]
    for name, backend, torch_budget in runs:
        if progress:
            progress(name)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=backend, dynamic=False)
        patch = functorch_config.patch(
            activation_memory_budget=1.0 if torch_budget is None else torch_budget
        )
        try:
            with patch:
                diff = _max_diff(gradients(compiled, inputs), reference)
        except Exception as e:
            infeasible = remat_error_cause(e, InfeasibleBudget)
            if infeasible is None:
                raise
            rows.append(
                BenchRow(
                    name,
                    None,
                    None,
                    infeasible.min_feasible_bytes,
                    None,
                    None,
                    None,
                    str(infeasible),
                )
            )
            continue
        m = measure(compiled, *inputs, steps=steps)
        seconds = statistics.median(m.step_seconds)
        plans = backend.plans
        rows.append(
            BenchRow(
                strategy=name,
                held_bytes=m.held_bytes,
                peak_bytes=m.peak_bytes,
                predicted_peak_bytes=max(p.predicted_peak_bytes for p in plans) if plans else None,
                step_seconds=seconds,
                time_ratio=seconds / base_seconds if base_seconds else None,
                grad_max_abs_diff=diff,
                note=f"{compiler}; predicted recompute "
                f"{sum(p.recompute_seconds for p in plans) * 1e3:.2f} ms, held "
                f"{sum(p.held_bytes for p in plans)} B",
            )
        )
    torch._dynamo.reset()
    return rows
