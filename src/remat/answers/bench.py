"""Side by side, in one process on the same data: remat's plans and the baselines users already
have, each measured by `remat.measure` (which shares no code with the planner).

Baselines are written the way users write them, not through `remat.apply`: `torch.utils.checkpoint`
around every block, `checkpoint_sequential` over sqrt(n) segments, and for Hugging Face models
`gradient_checkpointing_enable()`.

Memory is measured once per row. Time is measured in interleaved rounds: each round sets up every
row in turn (applies its plan, wraps its baseline), times one training step and tears it down, so
that a slow spell of a noisy machine lands on every row alike instead of on whichever row ran then.
The first round runs one untimed warm step per row before its timed one; each round starts one row
later than the previous one, so no row is always first after the others.
"""

from __future__ import annotations

import contextlib
import functools
import math
import random
import statistics
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

from remat.applying import tune_steps
from remat.applying.auto import plan_for_training
from remat.applying.eager import apply, installed_offloader, installed_plan, remove
from remat.errors import InfeasibleBudget, RematError
from remat.measuring.measure import measure, time_steps
from remat.planning import strategies
from remat.planning.planner import Planner
from remat.planning.plans import DEFAULT_BUDGET, Plan
from remat.tracing.trace import default_loss
from remat.units import format_bytes, format_ms

BASELINES = (
    "torch:checkpoint-per-block",
    "torch:checkpoint_sequential",
    "hf:gradient_checkpointing",
)

#: Default number of interleaved timing rounds (`steps` of `bench` and `bench_compiled`).
ROUNDS = 7


@dataclass(frozen=True)
class BenchRow:
    """One strategy, baseline or compiled variant, measured on the real model.

    Memory comes from one step measured by `remat.measure`; time from one step per interleaved
    round (see the module docstring), summarized as the median and the range of the rounds.

    Attributes:
        held_bytes: measured: what the forward left live for the backward.
        peak_bytes: measured peak of the step.
        predicted_peak_bytes: remat's prediction (for an infeasible budget: the least feasible).
        step_seconds: median step time over the rounds.
        step_seconds_min, step_seconds_max: fastest and slowest round.
        rounds: every round's step time, in order.
        time_ratio: `step_seconds` / store_all's `step_seconds` (the eager store_all row's, for
            compiled rows).
        within_noise: True when the middle half of this row's rounds (their interquartile
            range) overlaps store_all's: the rounds cannot tell the two apart, so the ratio is
            not evidence of a difference. Quartiles, not min-max: one slow round of store_all
            does not make every row "within noise". store_all's own row is True. None where
            there is no time or no reference range.
        noisy: the row's slowest round took more than `NOISY_SPREAD` times its fastest: the
            machine was busy, and its median is no result (re-run with more rounds, or idle).
        grad_max_abs_diff: largest absolute difference from store_all's parameter gradients.
        grad_max_rel_diff: that difference over the largest store_all gradient magnitude.
        grad_vs_compiled_rel_diff: for compiled rows, the same relative difference from
            torch.compile's default (`torch.compile@1`): what remat's partitioner changes beyond
            what compiling alone does (fused kernels sum in another order). None for eager rows.
        note: why a row has no measurement, or what it ran (plan strategy, compiler, ...).
    """

    strategy: str
    held_bytes: int | None = None
    peak_bytes: int | None = None
    predicted_peak_bytes: int | None = None
    step_seconds: float | None = None
    step_seconds_min: float | None = None
    step_seconds_max: float | None = None
    time_ratio: float | None = None
    within_noise: bool | None = None
    noisy: bool = False
    rounds: tuple[float, ...] = ()  # every round's step seconds, in order
    grad_max_abs_diff: float | None = None
    grad_max_rel_diff: float | None = None
    grad_vs_compiled_rel_diff: float | None = None
    note: str = ""

    @property
    def ran(self) -> bool:
        """Whether the row was measured (False: an infeasible budget, a baseline that does not
        apply, a reference-only plan; `note` says which)."""
        return self.peak_bytes is not None

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
    the sum of the outputs), from a fixed RNG seed (torch's, Python's and NumPy's: wav2vec2's
    SpecAugment masks come from NumPy) so that every run draws the same masks; grads are left
    cleared."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    model.zero_grad(set_to_none=True)
    loss_fn(model(*inputs, **kwargs)).backward()
    grads = {
        n.removeprefix("_orig_mod."): p.grad.detach().clone()  # torch.compile's wrapper
        for n, p in model.named_parameters()
        if p.grad is not None
    }
    model.zero_grad(set_to_none=True)
    return grads


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, float]:
    """The largest |a - b| over every gradient, and that relative to the largest |b| (a compiled
    model's fused kernels round differently: 0.8 on gradients near 1e4 is 1e-4 of them)."""
    diff = max(((a[k].float() - b[k].float()).abs().max().item() for k in a), default=0.0)
    scale = max((b[k].float().abs().max().item() for k in a), default=0.0)
    return diff, diff / scale if scale else 0.0


def progress_total(names: list[str], steps: int = ROUNDS, compiled: bool = False) -> int:
    """How many times `bench` (and, with `compiled`, `bench_compiled`) call `progress`: once per
    row for the memory pass and once per timing round."""
    total = len(_row_names(names)) + steps
    if compiled:
        total += len(TORCH_COMPILE_BUDGETS) + len(strategies.available("compile")) + steps
    return total


#: The row of `bench` for `remat.auto(..., tune=True)`: the fastest measured plan that fits, shown
#: only where it differs from the `auto` row (what `remat.auto` leaves after its first steps).
TUNED = "auto:tuned"


def _row_names(names: list[str]) -> list[str]:
    return list(dict.fromkeys(["store_all", *names]))


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


@contextmanager
def plan_applied(model: nn.Module, plan: Plan) -> Iterator[None]:
    """`plan` installed on `model` for the length of the block (a setup for `interleaved_rounds`)."""
    apply(model, plan)
    try:
        yield
    finally:
        remove(model)


@contextmanager
def _hf_checkpointing(inner: nn.Module) -> Iterator[None]:
    inner.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    try:
        yield
    finally:
        inner.gradient_checkpointing_disable()


Setup = Callable[[], AbstractContextManager[Any]]


def _regions(plan: Plan) -> tuple:
    return tuple((r.modules, r.keep) for r in plan.regions)


def auto_as_installed(
    model: nn.Module,
    inputs: tuple,
    planner: Planner,
    budget_bytes: int,
    rounds: int = tune_steps.ROUNDS,
) -> tuple[Plan, str]:
    """The plan `remat.auto(model, *inputs, budget=budget_bytes)` leaves installed once its first
    training steps are tuned (`remat.applying.tune_steps`, `rounds` timed rounds as auto's; these
    steps run here, on `inputs`), and what it tried and kept, said in a few words. A result kept from an earlier run (the
    cache) is used as `auto` would, and said so. With offload (`planner.offload`), the cost
    model's plan, untimed, as `remat.auto(offload=...)` installs it."""
    if planner.offload:
        return planner.plan(budget_bytes, "auto"), ""
    chosen, trials, key = plan_for_training(
        model,
        planner.graph,
        inputs,
        {},
        budget_bytes,
        "auto",
        planner.profile,
        planner.optimizer,
        "steps",
    )
    if not trials:
        kept = (
            "kept from an earlier run's first steps" if chosen.strategy.endswith(", tuned)") else ""
        )
        return chosen, kept
    apply(model, chosen)
    try:
        tuner = tune_steps.install(model, trials, key, rounds)
        for _ in range(len(tuner.schedule) + 2 if tuner is not None else 0):
            if not tune_steps.tuning(model):
                break
            time_steps(model, *inputs, steps=1)
        result = tune_steps.result(model)
    finally:
        tune_steps.install(model, [], None)
        remove(model)
    if result is None:
        return chosen, "its first steps were not all timed"
    tried = ", ".join(f"{n} {format_ms(s)}" for n, s in result.seconds.items())
    return result.chosen, f"first {len(trials)} plans timed on the first steps: {tried}"


def _baseline_setup(model: nn.Module, name: str, paths: list[str]) -> Setup | str:
    """How to set up baseline `name` on `model`, or why it does not apply."""
    if name == "hf:gradient_checkpointing":
        inner = getattr(model, "model", None)
        if inner is None or not hasattr(inner, "gradient_checkpointing_enable"):
            return "not a Hugging Face model"
        return lambda: _hf_checkpointing(inner)
    if not paths:
        return "no repeated blocks"
    sequential = name.endswith("sequential")
    if len(set(paths)) < len(paths):  # a block run more than once: each module wrapped once
        if sequential:
            return "a block is called more than once (its calls are not a list of modules)"
        paths = list(dict.fromkeys(paths))
    return lambda: _blocks_checkpointed(model, paths, sequential=sequential)


class BenchInterrupted(KeyboardInterrupt):
    """Ctrl-C during a bench: `rows` are those measured so far (each row's memory and
    gradients; step times from the `rounds` rounds that completed, none when no round did), for
    the table a user still wants to read."""

    def __init__(self, rows: list[BenchRow], rounds: int, times: list[list[float]] = ()) -> None:
        super().__init__(f"interrupted after {len(rows)} rows and {rounds} timing rounds")
        self.rows, self.rounds, self.times = rows, rounds, list(times)


def interleaved_rounds(
    runs: list[tuple[nn.Module, Setup]],
    inputs: tuple,
    rounds: int,
    progress: Callable[[str], None] | None,
    label: str = "round",
) -> list[list[float]]:
    """Per run, its step time in each of `rounds` rounds: each round times one step of every run
    in turn, set up just before and torn down just after; the first round warms each run with one
    untimed step first, and round r starts at run r (mod the number of runs). Interrupted, it
    raises `BenchInterrupted` with the times of the rounds that completed."""
    times: list[list[float]] = [[] for _ in runs]
    try:
        for r in range(rounds):
            if progress:
                progress(f"{label} {r + 1}/{rounds}")
            for k in range(len(runs)):
                i = (r + k) % len(runs)
                module, setup = runs[i]
                with setup():
                    times[i] += time_steps(module, *inputs, steps=1, warmup=1 if r == 0 else 0)
    except KeyboardInterrupt:
        done = min((len(t) for t in times), default=0)
        raise BenchInterrupted([], done, [t[:done] for t in times]) from None
    return times


def _check_rounds(steps: int) -> None:
    if steps < 1:
        raise RematError(f"bench needs at least one timing round, got steps={steps}")


def _overlaps(a: tuple[float, float], b: tuple[float, float]) -> bool:
    return a[0] <= b[1] and b[0] <= a[1]


#: A row whose slowest round is more than this many times its fastest is marked noisy.
NOISY_SPREAD = 1.5


def quartile_range(times: list[float]) -> tuple[float, float]:
    """The first and third quartiles of `times` (inclusive method; one time: itself twice)."""
    if len(times) < 2:
        return times[0], times[0]
    q1, _, q3 = statistics.quantiles(times, n=4, method="inclusive")
    return q1, q3


def _timed_row(
    row: BenchRow,
    times: list[float],
    base_seconds: float | None,
    base_range: tuple[float, float] | None,
) -> BenchRow:
    """`row` with the median and range of `times`, its ratio to `base_seconds`, whether its
    interquartile range overlaps `base_range` (store_all's) and whether it is noisy."""
    median, low, high = statistics.median(times), min(times), max(times)
    return replace(
        row,
        step_seconds=median,
        step_seconds_min=low,
        step_seconds_max=high,
        time_ratio=median / base_seconds if base_seconds else None,
        within_noise=_overlaps(quartile_range(times), base_range) if base_range else None,
        noisy=high > NOISY_SPREAD * low,
        rounds=tuple(times),
    )


def bench(
    model: nn.Module,
    inputs: tuple,
    planner: Planner,
    names: list[str],
    budget: int | str = DEFAULT_BUDGET,
    steps: int = ROUNDS,
    progress: Callable[[str], None] | None = None,
    tune_rounds: int = tune_steps.ROUNDS,
) -> list[BenchRow]:
    """Measure store_all, each named strategy's plan (made by `planner`, on the same model's
    trace) and the baselines on `model` (real tensors), in that order. A budgeted strategy that
    cannot fit `budget` is a row that could not run (`BenchRow.ran` is False); a fixed one runs
    whatever its peak, with a note when it is over the budget.

    Each row's memory and gradients come from one pass (`remat.measure`, one measured step);
    its time from `steps` interleaved rounds (see the module docstring), each timing one step of
    every row. `progress(text)` is called with each row's name in the memory pass, then with
    "round i/steps" at the start of each round (`progress_total` counts the calls).
    `tune_rounds`: the timed rounds of the `auto` row's first-steps tuning (`remat.auto`'s 5;
    fewer is a quicker, noisier pick, as `REMAT_QUICK=1` runs the CLI's). Interrupted (Ctrl-C),
    it raises `BenchInterrupted` with the rows measured so far."""
    _check_rounds(steps)
    budget_bytes = planner.budget_bytes(budget)
    paths = [b.path for b in planner.blocks]
    reference = gradients(model, inputs)
    rows: list[BenchRow] = []
    timed: list[tuple[int, Setup]] = []  # (index in rows, setup) of the rows that run

    try:
        _memory_pass(model, inputs, planner, names, budget_bytes, paths, reference, rows, timed,
                     progress, tune_rounds)  # fmt: skip
    except KeyboardInterrupt:
        raise BenchInterrupted(rows, 0) from None
    try:
        times = interleaved_rounds([(model, s) for _, s in timed], inputs, steps, progress)
    except BenchInterrupted as stopped:
        times = stopped.times if stopped.rounds else []
        rows = _timed_rows(rows, timed, times) if times else rows
        raise BenchInterrupted(rows, stopped.rounds) from None
    return _timed_rows(rows, timed, times)


def _timed_rows(
    rows: list[BenchRow], timed: list[tuple[int, Setup]], times: list[list[float]]
) -> list[BenchRow]:
    """`rows` with the step times of those that ran, store_all's the reference of each ratio."""
    rows = list(rows)
    base_seconds: float | None = None
    base_range: tuple[float, float] | None = None
    for (i, _), t in zip(timed, times, strict=True):
        if rows[i].strategy == "store_all":  # the first row: the reference of every ratio
            base_seconds, base_range = statistics.median(t), quartile_range(t)
        rows[i] = _timed_row(rows[i], t, base_seconds, base_range)
    return rows


def _memory_pass(
    model: nn.Module,
    inputs: tuple,
    planner: Planner,
    names: list[str],
    budget_bytes: int,
    paths: list[str],
    reference: dict[str, torch.Tensor],
    rows: list[BenchRow],
    timed: list[tuple[int, Setup]],
    progress: Callable[[str], None] | None,
    tune_rounds: int = tune_steps.ROUNDS,
) -> None:
    """Each row's plan, memory and gradients, appended to `rows` as it is measured (the rows
    that run also to `timed`, with their setup)."""
    auto_regions: tuple | None = None  # the auto row's plan, which auto:tuned does not repeat
    for name in _row_names(names):
        if progress:
            progress(name)
        predicted: int | None = None
        note = ""
        if name in BASELINES:
            setup = _baseline_setup(model, name, paths)
            if isinstance(setup, str):
                rows.append(BenchRow(name, note=setup))
                continue
        else:
            tried = ""
            try:
                if name == "auto":  # as users get it: tuned on its first training steps
                    p, tried = auto_as_installed(model, inputs, planner, budget_bytes, tune_rounds)
                    auto_regions = _regions(p)
                elif (
                    name == TUNED
                ):  # the machine's pick among the plans that fit (remat.applying.tune)
                    from remat.applying.tune import tune

                    p = tune(model, *inputs, planner=planner, budget_bytes=budget_bytes).chosen
                    if _regions(p) == auto_regions:
                        continue  # the auto row's plan: shown once
                else:  # a fixed strategy is measured even over the budget: a point of reference
                    strategy = strategies.get(name, "eager")
                    p = planner.solve(strategy, budget_bytes)
                    if strategy.budgeted and p.predicted_peak_bytes > budget_bytes:
                        p = planner.plan(budget_bytes, name)  # raises, naming the least feasible
            except InfeasibleBudget as e:
                rows.append(BenchRow(name, predicted_peak_bytes=e.min_feasible_bytes, note=str(e)))
                continue
            if not p.appliable:
                rows.append(
                    BenchRow(
                        name, predicted_peak_bytes=p.predicted_peak_bytes, note="reference only"
                    )
                )
                continue
            setup = functools.partial(plan_applied, model, p)
            predicted = p.predicted_peak_bytes
            notes = [p.strategy] if p.strategy != name else []  # what auto chose
            if tried:
                notes.append(tried)
            if p.predicted_peak_bytes > budget_bytes:
                notes.append(f"over the budget of {format_bytes(budget_bytes)}")
            note = "; ".join(notes)
        with setup():
            m = measure(model, *inputs, steps=1)
            diff, rel = _max_diff(gradients(model, inputs), reference)
            offloader = installed_offloader(model)
            if offloader is not None:  # the plan offloads (docs/offload.md)
                plan = installed_plan(model)
                note = "; ".join(
                    [
                        *([note] if note else []),
                        f"offloads {len(plan.offload)} blocks: "
                        f"{format_bytes(offloader.offloaded_bytes)} on the host (predicted "
                        f"{format_bytes(plan.host_bytes)}), "
                        f"{plan.transfer_seconds * 1e3:.3g} ms of copies not hidden (predicted)",
                    ]
                )
        timed.append((len(rows), setup))
        rows.append(
            BenchRow(
                strategy=name,
                held_bytes=m.held_bytes,
                peak_bytes=m.peak_bytes,
                predicted_peak_bytes=predicted,
                grad_max_abs_diff=diff,
                grad_max_rel_diff=rel,
                note=note,
            )
        )


#: Torch's own partitioner at these `activation_memory_budget` values (1.0 is its default).
TORCH_COMPILE_BUDGETS = (1.0, 0.5, 0.0)


def bench_compiled(
    model: nn.Module,
    inputs: tuple,
    budget: int | str | None = "50%",
    steps: int = ROUNDS,
    compiler: str = "inductor",
    profile: str = "cpu",
    base_seconds: float | None = None,
    progress: Callable[[str], None] | None = None,
    base_range: tuple[float, float] | None = None,
) -> list[BenchRow]:
    """Rows for torch.compile: torch's partitioner at each of `TORCH_COMPILE_BUDGETS` (its save set
    priced by remat's model), then remat's partitioner with each strategy that has a compiled
    path (`remat.planning.strategies.available("compile")`).

    Each variant compiles once, from scratch (`torch._dynamo.reset()` before the first; each has
    its own backend, so their graphs do not share a cache entry), and its memory is measured like
    the eager rows. All compiled variants stay alive and are then timed in `steps` interleaved
    rounds among themselves (progress "torch.compile round i/steps"), without recompiling: a
    variant that recompiled anyway says so in its note. Ratios are to `base_seconds` (the eager
    store_all median); `within_noise` compares with `base_range` (the eager store_all's quartiles,
    max step time), and is None without it."""
    from torch._functorch import config as functorch_config

    from remat.applying.compiled import RematBackend, remat_error_cause

    _check_rounds(steps)
    reference = gradients(model, inputs)
    compiled_reference: dict[str, torch.Tensor] | None = None
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
    timed: list[tuple[int, nn.Module, RematBackend, int]] = []  # row, model, backend, graphs
    torch._dynamo.reset()
    try:
        for name, backend, torch_budget in runs:
            if progress:
                progress(name)
            compiled = torch.compile(model, backend=backend, dynamic=False)
            patch = functorch_config.patch(
                activation_memory_budget=1.0 if torch_budget is None else torch_budget
            )
            try:
                with patch:
                    grads = gradients(compiled, inputs)
            except Exception as e:
                infeasible = remat_error_cause(e, InfeasibleBudget)
                if infeasible is None:
                    raise
                rows.append(
                    BenchRow(
                        name,
                        predicted_peak_bytes=infeasible.min_feasible_bytes,
                        note=str(infeasible),
                    )
                )
                continue
            diff, rel = _max_diff(grads, reference)
            compiled_reference = compiled_reference or grads  # torch.compile@1, the first row
            m = measure(compiled, *inputs, steps=1)
            plans = backend.plans
            timed.append((len(rows), compiled, backend, len(plans)))
            rows.append(
                BenchRow(
                    strategy=name,
                    held_bytes=m.held_bytes,
                    peak_bytes=m.peak_bytes,
                    predicted_peak_bytes=max(p.predicted_peak_bytes for p in plans)
                    if plans
                    else None,
                    grad_max_abs_diff=diff,
                    grad_max_rel_diff=rel,
                    grad_vs_compiled_rel_diff=_max_diff(grads, compiled_reference)[1],
                    note=f"{compiler}; predicted recompute "
                    f"{sum(p.recompute_seconds for p in plans) * 1e3:.2f} ms, held "
                    f"{sum(p.held_bytes for p in plans)} B",
                )
            )
        times = interleaved_rounds(
            [(c, contextlib.nullcontext) for _, c, _, _ in timed],
            inputs,
            steps,
            progress,
            label="torch.compile round",
        )
    finally:
        torch._dynamo.reset()
    for (i, _, backend, graphs), t in zip(timed, times, strict=True):
        row = _timed_row(rows[i], t, base_seconds, base_range)
        if len(backend.plans) != graphs:
            row = replace(row, note=f"{row.note}; recompiled while timing")
        rows[i] = row
    return rows
