"""Tuning on the first real training steps: the best few plans that fit take turns on the steps a
training script runs anyway, each timed with the device's own clock, and the fastest is kept.

Every plan gives bit-identical gradients (recomputation replays the forward with the RNG state it
had), so the steps a plan is tried on train the model exactly as the cost model's pick would: the
tuning costs only the difference in speed of the plans tried. The schedule: each candidate, the
cost model's pick first, runs one untimed warm-up step (its first run: the allocator, lazy
buffers), then `rounds` rounds of one timed step of every candidate, each round starting one
candidate later (24 steps for 4 plans). A step the first-step check counts
(`remat.applying.first_step`, under a dispatch mode that slows it) is not one of them.
A step is timed from the start of the model's forward to the end of the backward through its
output: what a plan changes (`time.perf_counter` on the CPU, CUDA events on a GPU, so nothing
waits for the device). The plan for the next step is installed when the backward ends, never
during a forward. The winner is chosen by `remat.applying.tune`'s noise rule (another plan
replaces the cost model's pick only when it was faster in every round), one log line says what
was tried and kept, and the result is cached under `tune`'s key, so the next run of the script
starts on the winner and times nothing.

A forward without gradients (evaluation) is neither timed nor counted; a forward whose backward
never comes (an exception, a skipped batch) is not counted, and the next one is timed instead.
Tuning stops, leaving the plan installed as it is, when another plan replaces ours
(`remat.apply`, `remat.remove`) or torch.compile traces the model."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from remat.applying.eager import apply, installed_plan
from remat.applying.first_step import sharded
from remat.applying.tune import Tuning, fastest_of, keep
from remat.errors import log
from remat.planning.plans import Plan
from remat.units import format_ms

#: Timed rounds of the first-steps tuning (with 5, another plan of equal speed wins every round,
#: and so the cost model's pick is overruled by chance, 1 time in 32).
ROUNDS = 5

_TUNER = "_remat_tune_steps"


class StepTuner:
    """Forward pre-hook and hook on a planned model (`install`): times the steps of the schedule
    and swaps the candidates between them. An object of this class, not a closure, so that a
    planned model still deep-copies and pickles (a copy does not tune: its steps are its own)."""

    def __init__(
        self,
        model: nn.Module,
        plans: list[Plan],
        key: tuple | None,
        rounds: int = ROUNDS,
        clock: Callable[[], float] | None = None,
    ):
        self.plans = plans
        self.key = key
        self.rounds = rounds
        self.clock = clock
        self.model_name = type(model).__name__
        #: (candidate, timed) of each step, in order: the pick's step, warm-ups, timed rounds
        n = len(plans)
        self.schedule = [(i, False) for i in range(n)] + [
            ((r + k) % n, True) for r in range(rounds) for k in range(n)
        ]
        self.step = 0
        self.times: list[list[float]] = [[] for _ in plans]
        self.result: Tuning | None = None
        self.done = False
        self._handles: list[Any] = []
        self._started: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {"plans": self.plans, "result": self.result, "model_name": self.model_name}

    def __setstate__(self, state: dict[str, Any]) -> None:
        vars(self).update(state)
        self.done, self._handles, self._started = True, [], None
        self.schedule, self.step, self.times, self.key, self.rounds = [], 0, [], None, 0
        self.clock = None

    def before(self, model: nn.Module, args: tuple, kwargs: dict) -> None:
        self.begin(model)

    def after(self, model: nn.Module, args: tuple, output: Any) -> None:
        if self._started is not None and not self.done:
            _after_backward(output, lambda: self.end(model))

    @property
    def current(self) -> Plan:
        return self.plans[self.schedule[self.step][0]]

    def begin(self, model: nn.Module) -> None:
        """A training step starts (its forward, with gradients on): start its clock. A framework
        that calls the model's forward itself (Lightning's `training_step`) calls this and `end`
        from its own step hooks."""
        self._started = None
        if self.done or not torch.is_grad_enabled() or _get_current_dispatch_mode_stack():
            return
        if (
            torch.compiler.is_compiling()
            or installed_plan(model) is not self.current
            or sharded(model)
        ):
            # compiled, another plan installed, or sharded (FSDP units fixed on the pick's
            # regions): the pick, or the plan now installed, stays
            self._stop()
            return
        self._started = self._mark(model)

    def end(self, model: nn.Module) -> None:
        """The backward of the step `begin` started has ended: note its time, and install the
        next step's plan."""
        started, self._started = self._started, None
        if started is None or self.done or installed_plan(model) is not self.current:
            return
        index, timed = self.schedule[self.step]
        if timed:
            self.times[index].append(self._seconds(started, self._mark(model)))
        self.step += 1
        if self.step < len(self.schedule):
            if installed_plan(model) is not self.current:
                apply(model, self.current, between_steps=True)
            return
        self._finish(model)

    def _finish(self, model: nn.Module) -> None:
        times = [[_seconds(t) for t in ts] for ts in self.times]
        result = fastest_of(self.plans, times, "training steps")
        if self.key is not None:
            result = keep(self.key, result)
        self.result = result
        apply(model, result.chosen, between_steps=True)
        tried = ", ".join(f"{name} {format_ms(s)}" for name, s in result.seconds.items())
        log.info(
            "remat: tuned %s on its first %d training steps: kept %s (tried %s, median of %d "
            "timed steps each)%s",
            self.model_name,
            len(self.schedule),
            result.chosen.strategy,
            tried,
            self.rounds,
            f"; kept in {result.cache_file}, which the next run starts from"
            if result.cache_file
            else "",
        )
        self._stop()

    def _stop(self) -> None:
        self.done = True
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _mark(self, model: nn.Module) -> Any:
        """Now, on the step's clock: the injected one, a CUDA event recorded on the current
        stream, or `time.perf_counter` (after a synchronize on other accelerators)."""
        if self.clock is not None:
            return self.clock()
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        if device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        if device.type != "cpu":
            getattr(torch, device.type).synchronize()
        return time.perf_counter()

    @staticmethod
    def _seconds(start: Any, end: Any) -> Any:
        return (start, end) if isinstance(start, torch.cuda.Event) else end - start


def _after_backward(output: Any, callback: Callable[[], None]) -> None:
    """Run `callback` once, when the backward through any of `output`'s tensors that require grad
    ends (a loss may be made from any of them: a model's logits, or the loss it returns)."""
    anchors = [
        t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad
    ]
    queued = False

    def queue(grad: torch.Tensor) -> None:
        nonlocal queued
        if not queued:
            queued = True
            torch.autograd.Variable._execution_engine.queue_callback(callback)

    for t in anchors:
        t.register_hook(queue)


def _seconds(timed: Any) -> float:
    """A step's seconds: a float, or a pair of CUDA events read once the step is done."""
    if isinstance(timed, tuple):
        start, end = timed
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    return float(timed)


def install(
    model: nn.Module,
    plans: list[Plan],
    key: tuple | None,
    rounds: int = ROUNDS,
    clock: Callable[[], float] | None = None,
) -> StepTuner | None:
    """Tune `model` on its next training steps among `plans` (the first, the cost model's pick, is
    the one installed now), keeping the result under `key` (`remat.applying.tune.tuning_key`;
    None keeps nothing). `clock`: seconds now, for a step's time (default the device's clock).
    Nothing to tune (fewer than two plans): None."""
    old = vars(model).pop(_TUNER, None)
    if old is not None:
        old._stop()
    if len(plans) < 2:
        return None
    tuner = StepTuner(model, plans, key, rounds, clock)
    tuner._handles = [
        model.register_forward_pre_hook(tuner.before, with_kwargs=True),
        model.register_forward_hook(tuner.after, always_call=True),
    ]
    vars(model)[_TUNER] = tuner
    return tuner


def result(model: nn.Module) -> Tuning | None:
    """What the first-steps tuning of `model` kept (`remat.auto`'s default), or None: not tuned,
    or its steps not all run yet."""
    tuner = vars(model).get(_TUNER)
    return None if tuner is None else tuner.result


def step_began(model: nn.Module) -> None:
    """For a framework that calls the planned model's forward itself (Lightning calls
    `training_step`): a training step of `model` begins."""
    tuner = vars(model).get(_TUNER)
    if tuner is not None:
        tuner.begin(model)


def step_ended(model: nn.Module) -> None:
    """The backward of the step `step_began` marked has ended."""
    tuner = vars(model).get(_TUNER)
    if tuner is not None:
        tuner.end(model)


def tuning(model: nn.Module) -> bool:
    """Whether `model`'s first-steps tuning is still under way (its plan may change)."""
    tuner = vars(model).get(_TUNER)
    return tuner is not None and not tuner.done
