"""Pipeline events: as the GPU reports it, the caching allocator over a rank's walk. A stage's
forward, first and later backwards as allocation events for any micro-batch (`StageLives`), and a
rank's optimizer step over its stages (`optimizer_step_events`): the pieces `rank_events` strings
together in torch's order for `remat.prediction.gpu_memory`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from remat.device.allocator import Alloc, Free
from remat.device.targets import ops_scratch_bytes
from remat.graph import Graph
from remat.layouts.pipeline_steps import TracedStage
from remat.layouts.pipeline_walk import Sharding
from remat.prediction.estimate import Optimizer
from remat.prediction.gpu_memory import BLAS_OPS, Event, optimizer_events
from remat.prediction.schedule import Region, step_lives

#: One event of a stage's action, for any micro-batch: ("A" or "F", life index or a scratch's
#: ("scratch", position), bytes)
_Template = tuple[str, Any, int]


@dataclass(frozen=True)
class _Action:
    """A stage's forward, first backward or later backward as events for any micro-batch:
    `events`, the index in them of its first matmul (None: none), and by role the lives that
    outlast it ("param_grad", "input_grad", "output")."""

    events: tuple[_Template, ...]
    blas_at: int | None
    kept: dict[str, tuple[int, ...]]

    def of(
        self, step: int, stage: int, microbatch: int, workspaces: Sequence[Event] = ()
    ) -> tuple[list[Event], dict[str, list[Any]]]:
        """The events of `microbatch` (`workspaces` made at the first matmul) and the keys of
        the lives that outlast them."""
        tag = (step, stage, microbatch)
        events: list[Event] = [
            Alloc((tag, k), n) if kind == "A" else Free((tag, k)) for kind, k, n in self.events
        ]
        if workspaces and self.blas_at is not None:
            events[self.blas_at : self.blas_at] = workspaces
        return events, {role: [(tag, k) for k in ks] for role, ks in self.kept.items()}


@dataclass(frozen=True)
class StageLives:
    """A stage's one-micro-batch step as lives on its schedule (`remat.prediction.schedule.storage_lives`,
    the lives its simulation and every plan are judged on), cut where the backward begins into
    its actions, each life told by what it is to the pipeline: a parameter's gradient (kept
    from the first backward, a temporary added into it in later ones), the input's gradient and
    the output (sent: kept as long as their sends, `sent_counts`), or the step's own (freed
    where it ends, or as the backward does)."""

    forward: _Action
    first_backward: _Action
    later_backward: _Action

    @classmethod
    def of(cls, traced: TracedStage, regions: Sequence[Region]) -> StageLives:
        graph = traced.graph
        _, schedule, _, lives, owners = step_lives(graph, regions)
        input_grads = set(graph.info.get("input_grad_storages", ()))
        outputs = set(graph.info.get("output_storages", ())) if traced.output_bytes else set()

        def role(sid: int | None) -> str:
            if sid in input_grads:
                return "input_grad"
            if sid is not None and graph.storages[sid].kind == "grad":
                return "param_grad"
            return "output" if sid in outputs else "step"

        ops, order = graph.ops, schedule.order
        op_scratch = ops_scratch_bytes(graph)
        backward_from = next(
            (p for p, (what, i) in enumerate(order) if what != "op" or ops[i].phase != "forward"),
            len(order),
        )
        roles = [role(sid) for sid in owners]

        def action(lo: int, hi: int, first_backward: bool) -> _Action:
            total, forward = len(order), lo == 0
            before: dict[int, list[_Template]] = defaultdict(list)
            after: dict[int, list[_Template]] = defaultdict(list)
            kept: dict[str, list[int]] = defaultdict(list)
            for k, ((first, last, nbytes), what) in enumerate(zip(lives, roles, strict=True)):
                if not nbytes:
                    continue
                if lo <= first < hi:
                    before[first].append(("A", k, nbytes))
                    if what == "param_grad" and not first_backward:  # added into the kept one
                        after[first].append(("F", k, nbytes))
                        continue
                if last < total and lo <= last < hi:
                    after[last].append(("F", k, nbytes))
                elif last >= total and not forward:
                    if what == "step":
                        after[total - 1].append(("F", k, nbytes))
                    elif what != "param_grad" or first_backward:
                        kept[what].append(k)
            events: list[_Template] = []
            blas_at = None
            for position in range(lo, hi):
                op = ops[order[position][1]]
                if blas_at is None and op.short in BLAS_OPS:
                    blas_at = len(events)
                events += before[position]
                scratch = op_scratch[order[position][1]]
                if scratch:
                    events += [("A", ("scratch", position), scratch)]
                    events += [("F", ("scratch", position), scratch)]
                events += after[position]
            return _Action(tuple(events), blas_at, {r: tuple(ks) for r, ks in kept.items()})

        total = len(order)
        return cls(
            forward=action(0, backward_from, False),
            first_backward=action(backward_from, total, True),
            later_backward=action(backward_from, total, False),
        )


def _tagged(events: Sequence[Event], tag: Any) -> list[Event]:
    """`events` with `tag` put before each key: events of several stages on one rank apart."""
    return [
        Alloc((tag, *e.key), e.nbytes) if isinstance(e, Alloc) else Free((tag, *e.key))
        for e in events
    ]


def shard_sizes(graph: Graph, sharding: Sharding) -> dict[int, int]:
    """Parameter storage -> the bytes its optimizer state is kept over: the parameter, or its
    FSDP shard of the fp32 master copy."""
    params = {s.id: s.nbytes for s in graph.storages_of(("param",))}
    if sharding.ranks == 1:
        return params
    return {sid: -(-n * sharding.master_scale // sharding.ranks) for sid, n in params.items()}


def optimizer_step_events(
    stages: Sequence[tuple[int, Graph]], optimizer: Optimizer, step: int, sharding: Sharding
) -> list[Event]:
    """One optimizer over the parameters of a rank's `stages`: each stage's state made on the
    first step, then their temporaries as one foreach step makes them (all, then all freed), then
    any per-parameter ones (`remat.prediction.gpu_memory.optimizer_events`)."""
    per_stage = [
        _tagged(optimizer_events(g, optimizer, step, shard_sizes(g, sharding), step == 0), i)
        for i, g in stages
    ]
    events = [e for es in per_stage for e in es]
    state = [e for e in events if e.key[1] == "state"]
    foreach = [e for e in events if e.key[1] == "tmp" and isinstance(e, Alloc)]
    foreach += [e for e in events if e.key[1] == "tmp" and isinstance(e, Free)]
    rest = [e for e in events if e.key[1] not in ("state", "tmp")]
    return state + foreach + rest
