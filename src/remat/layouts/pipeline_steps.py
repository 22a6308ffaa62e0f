"""Pipeline steps: each stage's step traced for one micro-batch (`TracedStage`, as
`PipelineStage` receives its input and the next stage's gradient), and what that step keeps and
peaks at once simulated under a plan (`StageStep`), the unit every rank's walk is counted in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from remat.graph import Graph
from remat.layouts.pipeline_stages import Stage
from remat.prediction.estimate import trainable_param_bytes
from remat.prediction.schedule import Simulation
from remat.tracing.hfcompat import as_real_run
from remat.tracing.trace import trace


class _GradientFromOutput(torch.autograd.Function):
    """The scalar a non-last stage is traced with: its backward hands the stage output a dense
    gradient of the output's own shape, as the next stage's gradient arrives in `PipelineStage`'s
    preallocated receive buffer. The buffer is counted in the rank's fixed bytes; here the gradient
    aliases the output (held through the backward anyway), so it adds nothing to the step, where
    `output.sum()` would hand a broadcast one that kernels copy to dense memory."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor) -> torch.Tensor:
        ctx.output = output.detach()
        return output.sum()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return ctx.output


@dataclass(frozen=True)
class StageStep:
    """One micro-batch's step on a stage, simulated with a plan's regions (none: store-all); bytes
    above what exists before the step.

    `held_bytes`: allocated by the forward and kept for the backward (saved activations, the
    stage output, the loss). `forward_peak_bytes`, `backward_peak_bytes`: the most live during
    each; `later_backward_peak_bytes`: the backward's with the parameters' gradients already
    there (every backward but the first accumulates into them). `input_grad_bytes`: the
    gradient of the stage input (hidden states), sent back. `grad_bytes`: the parameters'
    gradients. `output_bytes`: the stage output sent on (0 on the last stage)."""

    held_bytes: int
    forward_peak_bytes: int
    backward_peak_bytes: int
    later_backward_peak_bytes: int
    input_grad_bytes: int
    grad_bytes: int
    output_bytes: int

    @classmethod
    def of(cls, graph: Graph, sim: Simulation, base_bytes: int, output_bytes: int) -> StageStep:
        """From `sim`, a simulation of `graph` over `base_bytes` that exist before the step."""
        ops = graph.ops
        grads = [s for s in graph.storages.values() if s.kind == "grad"]
        grad_bytes = trainable_param_bytes(graph)
        # the input's gradient is the one grad storage beyond the parameters' (non-first stages)
        input_grad = sum(s.nbytes for s in grads) - grad_bytes
        forward, backward = [], []
        allocated = 0  # gradients allocated before the position
        grad_at: dict[int, int] = {}
        for s in grads:
            grad_at[s.allocated_at] = grad_at.get(s.allocated_at, 0) + s.nbytes
        for (what, i), live in zip(sim.schedule, sim.timeline, strict=True):
            above = live - base_bytes
            if ops[i].phase == "forward" and what == "op":
                forward.append(above)
                continue
            backward.append((above, above + max(grad_bytes - allocated, 0)))
            if what == "op":
                allocated += grad_at.get(i, 0)
        return cls(
            held_bytes=sim.held_bytes,
            forward_peak_bytes=max(forward),
            backward_peak_bytes=max(b for b, _ in backward),
            later_backward_peak_bytes=max(b for _, b in backward),
            input_grad_bytes=input_grad,
            grad_bytes=grad_bytes,
            output_bytes=output_bytes,
        )


@dataclass(frozen=True)
class TracedStage:
    """A stage's one-micro-batch step and the byte counts of what flows between stages."""

    stage: Stage
    rank: int
    graph: Graph
    input_bytes: int  # its traced inputs (token ids or received hidden states) and labels
    output_bytes: int  # hidden states sent on (0 on the last stage)


def trace_stages(
    stages: Sequence[Stage],
    ids: torch.Tensor,
    labels: torch.Tensor,
    ranks: int,
    trace_options: dict[str, Any],
    reuse_alike: bool = False,
) -> list[TracedStage]:
    """Trace each stage's step for one micro-batch of `ids` (shape-only when they are meta
    tensors): the first stage from the token ids, each later one from hidden states shaped as
    the stage before returns them, requiring grad as `PipelineStage` receives them.
    `reuse_alike`: a middle stage with as many blocks as one traced before takes that one's
    graph (the same ops on other blocks: every byte and FLOP alike, module names not), which
    answers sizes and peaks at a fraction of the time but makes no plan to apply."""
    out, x = [], ids
    target = torch.zeros(labels.shape, dtype=labels.dtype)  # token ids: small, real

    def last_loss(logits: torch.Tensor, stage: Stage) -> torch.Tensor:
        """The loss on the labels, made a fake tensor of the trace's own mode up front: one the
        mode converts itself would come out of the loss's first view as a new storage."""
        mode = getattr(logits, "fake_mode", None)
        return stage.loss_fn(logits, target if mode is None else mode.from_tensor(target))

    alike: dict[int, Graph] = {}
    for stage in stages:
        middle = not (stage.is_first or stage.is_last)
        if reuse_alike and middle and len(stage.layer_indices) in alike:
            graph = alike[len(stage.layer_indices)]
            out.append(replace(out[-1], stage=stage, rank=stage.index % ranks, graph=graph))
            continue
        if stage.is_last:
            loss_fn = lambda logits, stage=stage: last_loss(logits, stage)  # noqa: E731
        else:
            loss_fn = _GradientFromOutput.apply
        arg = x if stage.is_first else x.detach().requires_grad_()
        graph = trace(stage, arg, loss_fn=loss_fn, **trace_options)
        if middle:
            alike[len(stage.layer_indices)] = graph
        with torch.no_grad(), as_real_run({}):  # the next stage's input, shape only on meta
            x = stage(x)
        out.append(
            TracedStage(
                stage=stage,
                rank=stage.index % ranks,
                graph=graph,
                input_bytes=graph.input_bytes,
                output_bytes=0 if stage.is_last else x.numel() * x.element_size(),
            )
        )
    return out
