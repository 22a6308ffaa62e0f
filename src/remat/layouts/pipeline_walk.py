"""Pipeline walk: each rank's peak, walked over its actions in torch's order (`peak_of_rank`), with
what its stages keep for the whole step (`stage_fixed_bytes`, under FSDP `Sharding`), and the per-stage
and per-rank answers it gives (`StagePrediction`, `PipelineReport`).

The prediction walks that order for each rank over one traced step per stage (`StageStep`): before
each action, what the other micro-batches keep (their forward's held bytes until their backward,
then what the schedule's loop still references through their sends: the output sent on and the
input's gradient sent back), plus the action's own peak from the trace: the forward's, or the
backward's, with the parameters' gradients already there from the second backward on. On top sits
what a rank keeps for the whole step: the stage's parameters, buffers and optimizer state,
`PipelineStage`'s receive buffers (one per micro-batch for activations on every stage but the
first, for gradients on every stage but the last) and the rank's slice of the batch. Checked
against real pipelines by `examples/pipeline.py` (docs/parallelism.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from remat.graph import Graph
from remat.layouts.pipeline_schedules import Action
from remat.layouts.pipeline_steps import StageStep, TracedStage
from remat.planning.plans import Plan
from remat.prediction.estimate import (
    OPTIMIZER_MEMORY,
    Optimizer,
    param_sizes,
    resolve_optimizer,
    trainable_param_bytes,
    trainable_param_elements,
)
from remat.units import format_bytes


@dataclass(frozen=True)
class StagePrediction:
    """One stage of a pipeline step: where it runs, what it holds per micro-batch in flight, and
    the peak of its rank (shared by the stages of one rank under an interleaved schedule).

    `fixed_bytes`: what the stage keeps on its rank for the whole step (parameters, buffers,
    optimizer state, `PipelineStage`'s receive buffers, its micro-batches of token ids or labels).
    `held_bytes_per_microbatch`: what one micro-batch keeps between its forward and backward.
    `plan`: the plan the step was predicted with (None: store-all)."""

    stage: int
    rank: int
    layers: range
    in_flight: int
    held_bytes_per_microbatch: int
    fixed_bytes: int
    peak_bytes: int
    step: StageStep
    plan: Plan | None = None

    def __repr__(self) -> str:
        plan = f", plan {self.plan.strategy}" if self.plan is not None else ""
        first, last = self.layers.start, self.layers.stop - 1
        return (
            f"StagePrediction(stage {self.stage} on rank {self.rank}, blocks {first}..{last}: "
            f"peak {format_bytes(self.peak_bytes)}, {self.in_flight} in flight x "
            f"{format_bytes(self.held_bytes_per_microbatch)} held, fixed "
            f"{format_bytes(self.fixed_bytes)}{plan})"
        )


@dataclass(frozen=True)
class PipelineReport:
    """Per stage and per rank predictions of one pipeline step of `microbatches` micro-batches of
    `microbatch_size` under `schedule`; `tightest_rank` is the rank of the highest peak."""

    schedule: str
    microbatches: int
    microbatch_size: int
    stages: tuple[StagePrediction, ...]
    rank_peak_bytes: tuple[int, ...]

    @property
    def tightest_rank(self) -> int:
        return max(range(len(self.rank_peak_bytes)), key=self.rank_peak_bytes.__getitem__)

    @property
    def tightest_stages(self) -> tuple[int, ...]:
        """The stages on the tightest rank (one, but for interleaved schedules)."""
        return tuple(s.stage for s in self.stages if s.rank == self.tightest_rank)

    @property
    def peak_bytes(self) -> int:
        return max(self.rank_peak_bytes)

    def __repr__(self) -> str:
        head = (
            f"PipelineReport({self.schedule}, {len(self.stages)} stages on "
            f"{len(self.rank_peak_bytes)} ranks, {self.microbatches} micro-batches of "
            f"{self.microbatch_size}: peak {format_bytes(self.peak_bytes)} on rank "
            f"{self.tightest_rank} (stage {', '.join(map(str, self.tightest_stages))})"
        )
        return "\n  ".join([head, *map(repr, self.stages)]) + ")"


def _optimizer_bytes(graph: Graph, optimizer: Optimizer) -> tuple[int, int]:
    """(state, step transient) of `optimizer` over the stage's trainable parameters."""
    if optimizer is None:
        return 0, 0
    memory = OPTIMIZER_MEMORY[resolve_optimizer(optimizer, graph)]
    trainable, elements = trainable_param_bytes(graph), trainable_param_elements(graph)
    return (
        memory.state_bytes(trainable, elements),
        memory.step_temp_bytes(trainable, elements, param_sizes(graph)),
    )


@dataclass(frozen=True)
class Sharding:
    """FSDP2 over `ranks` data-parallel ranks under a pipeline, as torchtitan runs it: the
    stage's parameters stay gathered through the whole step (`reshard_after_forward=False` with
    pipelining), so the trace's parameters and its gradients (accumulated over the micro-batches)
    are held as traced; what is divided over the ranks are the sharded parameters (a fp32 master
    copy, `master_scale` bytes per traced byte, under FSDP2's bf16 mixed precision) and the
    optimizer's state."""

    ranks: int = 1
    master_scale: int = 1


UNSHARDED = Sharding()


def stage_fixed_bytes(
    traced: TracedStage, microbatches: int, optimizer: Optimizer, sharding: Sharding = UNSHARDED
) -> int:
    """What `traced`'s stage keeps on its rank through the step: the trace's own persistent
    storages (parameters, buffers, one micro-batch of inputs and labels), the other micro-batches'
    inputs (token ids, or `PipelineStage`'s activation receive buffers) and labels, one gradient
    receive buffer per micro-batch on all but the last stage, and the optimizer's state; under
    FSDP (`sharding`), the sharded parameters too, and the state divided over the ranks."""
    persistent = sum(s.nbytes for s in traced.graph.storages.values() if s.allocated_at is None)
    state, _ = _optimizer_bytes(traced.graph, optimizer)
    shards = 0
    if sharding.ranks > 1:
        scale = sharding.master_scale
        shards = -(-trainable_param_bytes(traced.graph) * scale // sharding.ranks)
        state = -(-state * scale // sharding.ranks)
    return (
        persistent
        + (microbatches - 1) * traced.input_bytes
        + microbatches * traced.output_bytes
        + state
        + shards
    )


def sent_counts(schedule: str, done: int, in_flight: int, steady: bool) -> tuple[int, int]:
    """(outputs, input gradients) of micro-batches already backwarded that the schedule's own
    loop still references through the works and ops of their sends (a sent tensor lives as long
    as its send does).

    GPipe and the interleaved runtime keep every send's work until the step ends, with the
    output sent forward and the input's gradient sent back. 1F1B fuses each gradient send with
    the next receive, and so keeps the last backward's input gradient; and its warmup keeps the
    last output it sent (`send_work`, with 2 or more warmup forwards) through the steady phase."""
    if schedule != "1f1b":
        return done, done
    return int(bool(done and in_flight >= 2 and steady)), min(done, 1)


def _sent_bytes(step: StageStep, schedule: str, done: int, in_flight: int, steady: bool) -> int:
    """The bytes of `sent_counts`."""
    outputs, grads = sent_counts(schedule, done, in_flight, steady)
    return outputs * step.output_bytes + grads * step.input_grad_bytes


def _walk(
    actions: Sequence[Action], steps: dict[int, StageStep], schedule: str, counts: Sequence[int]
) -> int:
    """The most bytes live above the fixed ones over a rank's `actions`: before each, what the
    other micro-batches keep (held bytes between their forward and backward, what their sends
    keep after it, and the parameters' gradients from the first backward on), plus the action's
    own peak from the traced step."""
    in_flight = dict.fromkeys(steps, 0)
    done = dict.fromkeys(steps, 0)
    previous = dict.fromkeys(steps, "F")
    peak = 0
    for a in actions:
        if a.kind == "B":
            in_flight[a.stage] -= 1
        # 1F1B's steady phase: a forward, or a backward right after one
        steady = {t: previous[t] == "F" or (t == a.stage and a.kind == "F") for t in steps}
        kept = sum(
            in_flight[t] * s.held_bytes
            + _sent_bytes(s, schedule, done[t], counts[t], steady[t])
            + (s.grad_bytes if done[t] and t != a.stage else 0)  # the action's own: in its peak
            for t, s in steps.items()
        )
        s = steps[a.stage]
        if a.kind == "F":
            own = s.forward_peak_bytes + (s.grad_bytes if done[a.stage] else 0)
            in_flight[a.stage] += 1
        else:
            own = s.later_backward_peak_bytes if done[a.stage] else s.backward_peak_bytes
            done[a.stage] += 1
        previous[a.stage] = a.kind
        peak = max(peak, kept + own)
    return peak


def peak_of_rank(
    traced: Sequence[TracedStage],
    steps: dict[int, StageStep],
    actions: Sequence[Action],
    schedule: str,
    counts: Sequence[int],
    microbatches: int,
    optimizer: Optimizer,
    sharding: Sharding = UNSHARDED,
) -> int:
    """A rank's peak: its fixed bytes plus the walk, or its optimizer step after the schedule's
    step has returned (the gradients and the optimizer's transient)."""
    fixed = sum(stage_fixed_bytes(t, microbatches, optimizer, sharding) for t in traced)
    after = sum(
        steps[t.stage.index].grad_bytes + _optimizer_bytes(t.graph, optimizer)[1] for t in traced
    )
    return fixed + max(
        _walk(actions, steps, schedule, counts), after if optimizer is not None else 0
    )
