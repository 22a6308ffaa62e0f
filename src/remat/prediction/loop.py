"""Training loops that move the peak, as changes to the traced step they run (`Loop.apply`).

- `optimizer_in_backward`: torchtune's `optimizer_in_bwd=True` (any loop that steps each parameter
  from a `register_post_accumulate_grad_hook` and sets its `.grad` to None): a parameter's
  gradient is freed as soon as its last accumulation has run and its own step is done, so the
  gradients never all live at once. The optimizer state still does. The step's own transient
  moves into the backward, one parameter at a time (one optimizer a parameter, as torchtune
  builds them: foreach over a one-tensor list, that parameter's bytes); it is not placed there:
  the step is counted at the end as before, one parameter's transient at a time
  (`estimate.optimizer_step_bytes`, `gpu_memory.optimizer_events`), where, the gradients gone,
  it is rarely the peak. Under torch.compile by blocks, a block's gradients come out of its
  compiled backward together and are stepped and freed at its end.
- `keep_grads`: `zero_grad(set_to_none=False)` (torch < 2.0's default, Hugging Face's Trainer
  then), or any micro-step of gradient accumulation after the first: every gradient exists
  before the step, and the backward's gradient for a parameter is a temporary that
  `AccumulateGrad` adds into it and frees. (The kept gradients are allocated before the step:
  the first step's order of allocation, which `remat.prediction.gpu_memory.step_events(...,
  keep_grads=True)` replays, is not.)
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from remat.errors import RematError
from remat.graph import Graph, Storage


@dataclass(frozen=True)
class Loop:
    """How the training loop around the traced step treats gradients (see the module)."""

    optimizer_in_backward: bool = False
    keep_grads: bool = False
    keep_logits: bool = False

    def __post_init__(self) -> None:
        if self.optimizer_in_backward and self.keep_grads:
            raise RematError(
                "optimizer in backward frees each gradient after its step; kept gradients "
                "(gradient accumulation, zero_grad(set_to_none=False)) cannot be stepped there: "
                "choose one"
            )

    def apply(self, graph: Graph) -> Graph:
        if self.keep_logits:
            graph = logits_kept(graph)
        if self.optimizer_in_backward:
            return optimizer_in_backward(graph)
        if self.keep_grads:
            return gradients_kept(graph)
        return graph

    def describe(self) -> str:
        said = [
            what
            for what, on in (
                ("optimizer in backward", self.optimizer_in_backward),
                ("gradients kept between steps", self.keep_grads),
                ("logits kept through backward", self.keep_logits),
            )
            if on
        ]
        return ", ".join(said)


def _last_writes(graph: Graph) -> dict[int, int]:
    """Gradient storage -> the last op that writes it (its AccumulateGrad, or the last in-place
    accumulation of a parameter used twice)."""
    last: dict[int, int] = {}
    for op in graph.ops:
        for t in op.outputs:
            sid = graph.tensors[t].storage
            if graph.storages[sid].kind == "grad":
                last[sid] = op.index
    return last


def optimizer_in_backward(graph: Graph) -> Graph:
    """`graph` with every gradient storage released after the last op that writes it, as a hook
    that steps and drops each gradient in backward leaves it."""
    last = _last_writes(graph)
    storages = {
        sid: replace(s, released_after=last.get(sid, s.allocated_at))
        if s.kind == "grad" and s.allocated_at is not None
        else s
        for sid, s in graph.storages.items()
    }
    return replace(graph, storages=storages, info={**graph.info, "optimizer_in_backward": True})


def gradients_kept(graph: Graph) -> Graph:
    """`graph` with every gradient kept from before the step (a storage of its bytes that exists
    from the start, as parameters do), and the backward's gradient a temporary freed after the
    last op that writes it (AccumulateGrad adds it into the kept one)."""
    last = _last_writes(graph)
    storages = dict(graph.storages)
    next_id = max(storages, default=-1) + 1
    for sid, s in graph.storages.items():
        if s.kind != "grad" or s.allocated_at is None:
            continue
        storages[sid] = replace(s, kind="activation", released_after=last.get(sid, s.allocated_at))
        storages[next_id] = Storage(next_id, s.nbytes, "grad")
        next_id += 1
    return replace(graph, storages=storages, info={**graph.info, "keep_grads": True})


def logits_kept(graph: Graph) -> Graph:
    """`graph` with the input of every forward log-softmax (the logits cross-entropy reads) held
    to the end of the step, as a loop that keeps its prediction referenced through `backward()`
    holds it. Refused where the step has no log-softmax: nothing would be kept."""
    kept = {
        graph.tensors[t].storage
        for op in graph.forward_ops
        if op.short == "_log_softmax"
        for t in op.inputs
    }
    kept = {sid for sid in kept if graph.storages[sid].kind == "activation"}
    if not kept:
        raise RematError(
            "--keep-logits keeps the logits a cross-entropy loss reads (its log-softmax's input) "
            "through the backward, but this step computes no log-softmax: leave --keep-logits out"
        )
    storages = {
        sid: replace(s, released_after=None) if sid in kept else s
        for sid, s in graph.storages.items()
    }
    return replace(graph, storages=storages, info={**graph.info, "keep_logits": True})
