"""A compiled training step's allocation events, for the caching allocator model.

`remat.prediction.gpu_memory.step_events` lays out an eager step's events from its lives. A
compiled step's come from inductor's own wrapper, replayed (`inductor_plan.StepPeak.events`): its
forward's allocations and frees in order, the tangents, its backward's. These functions lay them
out the same way, two steps of them, so that `gpu_memory.memory_of_events` judges a compiled step
as it judges an eager one:

- `whole`: the model's one graph is the step (`whole_step_events`);
- `blocks`: the eager step with each block's forward and backward spans replaced by its compiled
  forward's and backward's events (`blocks_step_events`). The eager storages a span makes that
  outlive it (a block's output, its gradients) are handed over at the span's end: the compiled
  outputs freed and the eager storages allocated, the same bytes, so the cached block is reused.
  An eager storage made outside a span that dies inside it (the block's input, the gradient of
  its output) is freed at the span's end, or at the end of its backward span where the compiled
  forward saves it (`saved_inputs`: a compiled loss keeps the logits it was given). Under FSDP
  (`fsdp`) the per-unit all-gathers, unsharded parameters and reduce-scatters are
  `gpu_memory.fsdp_events`', made around the
  spans: a block's forward span sits between its pre-forward and post-forward, its backward
  span between its pre-backward and post-backward, as `fully_shard` on each compiled block
  runs them (torchtitan: AC, compile, then FSDP per block).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from remat.device.allocator import Alloc, Free
from remat.device.targets import ops_scratch_bytes
from remat.graph import Graph
from remat.prediction.estimate import Optimizer
from remat.prediction.gpu_memory import (
    BLAS_OPS,
    Fsdp,
    Positions,
    fsdp_events,
    grad_shard_frees,
    optimizer_events,
)
from remat.prediction.inductor_plan import StepPeak
from remat.prediction.schedule import analyse_regions, build_schedule, storage_lives

Event = Alloc | Free


def _persistent(graph: Graph) -> tuple[list[Event], dict[int, int], list[Any]]:
    """The parameters and buffers as built (one allocation each, the model's order), the
    parameters' bytes by storage, and the inputs each step allocates."""
    before = sorted(
        (s for s in graph.storages.values() if s.allocated_at is None), key=lambda s: s.id
    )
    params = {s.id: s.nbytes for s in before if s.kind == "param"}
    events: list[Event] = [Alloc(("persistent", sid), n) for sid, n in params.items() if n]
    events += [
        Alloc(("persistent", s.id), s.nbytes)
        for s in before
        if s.kind not in ("param", "input") and s.nbytes
    ]
    return events, params, [s for s in before if s.kind == "input" and s.nbytes]


def whole_step_events(
    graph: Graph, step: StepPeak, optimizer: Optimizer, workspaces: list[int], steps: int = 2
) -> list[Event]:
    """The events of `steps` training steps of the compiled `step`: the parameters and buffers
    once, each step's inputs, the compiled forward's and backward's own events, the optimizer
    step (its state created in the first), then what the step still holds freed
    (`zero_grad(set_to_none=True)`, the outputs and the batch dropped). The BLAS workspaces are
    made before the first forward (eager makes them at its first matmul, which here is inside
    the replay)."""
    events, params, inputs = _persistent(graph)
    for k in range(steps):
        events += [Alloc(("input", k, s.id), s.nbytes) for s in inputs]
        if k == 0:
            events += [Alloc(("blas", i), n) for i, n in enumerate(workspaces)]
        live: dict[Any, None] = {}
        for e in step.events:
            if isinstance(e, Alloc):
                events.append(Alloc((k, e.key), e.nbytes))
                live[e.key] = None
            else:
                events.append(Free((k, e.key)))
                live.pop(e.key, None)
        events += optimizer_events(graph, optimizer, k, params, create_state=k == 0)
        events += [Free((k, key)) for key in live]
        events += [Free(("input", k, s.id)) for s in inputs]
    return events


def blocks_step_events(
    graph: Graph,
    spans: Sequence[tuple[int, int, int, int, StepPeak]],
    optimizer: Optimizer,
    workspaces: list[int],
    steps: int = 2,
    fsdp: Fsdp | None = None,
) -> list[Event]:
    """The events of `steps` training steps of `graph` with blocks compiled: `spans` gives each
    block's (first forward op, last forward op, first backward op, last backward op, its compiled
    step); everything outside the spans runs as traced (see the module's docstring); on one
    rank of `fsdp` if given."""
    analysis = analyse_regions(graph, ())
    schedule = build_schedule(graph, analysis)
    _, lives, owners = storage_lives(graph, analysis, schedule)
    total = len(schedule.order)
    pos = schedule.position_of_op
    # each replaced span by position: (start, end, block, "fw" | "bw")
    ranges = [(pos[f0], pos[f1], b, "fw") for b, (f0, f1, _, _, _) in enumerate(spans)]
    ranges += [(pos[g0], pos[g1], b, "bw") for b, (_, _, g0, g1, _) in enumerate(spans)]
    inside: dict[int, tuple[int, int, int, str]] = {}
    for r in ranges:
        for p in range(r[0], r[1] + 1):
            inside[p] = r
    op_scratch = ops_scratch_bytes(graph)
    events, params, inputs = _persistent(graph)
    # inputs a compiled forward saves (a compiled loss's logits): freed after its backward
    kept_until = {
        sid: pos[g1] for f0, f1, _, g1, step in spans for sid in saved_inputs(graph, f0, f1, step)
    }
    grad_lives = {
        n: sid
        for n, sid in enumerate(owners)
        if fsdp is not None and sid is not None and graph.storages[sid].kind == "grad"
    }
    sizes = params
    workspaces_made = False
    for k in range(steps):
        before: defaultdict[int, list[Event]] = defaultdict(list)
        after: defaultdict[int, list[Event]] = defaultdict(list)
        at = Positions()
        before_step: list[Event] = []
        after_backward: list[Event] = []
        if fsdp is not None:
            before_step, after_backward, sizes = fsdp_events(
                graph, schedule, fsdp, k, at, grad_lives
            )
            if k == 0:  # the model as built holds the shards, not the parameters
                events = [
                    e for e in events if not (isinstance(e.key, tuple) and e.key[1] in params)
                ]
                events[:0] = [Alloc(("persistent", sid), n) for sid, n in sizes.items() if n]
        handed: defaultdict[tuple[int, str], list[Event]] = defaultdict(list)
        for n, (first, last, nbytes) in enumerate(lives):
            if not nbytes:
                continue
            key = ("life", k, n)
            start = inside.get(first)
            if start is not None:
                s0, s1, b, half = start
                g0, g1 = pos[spans[b][2]], pos[spans[b][3]]
                escapes = last > s1 and not (half == "fw" and g0 <= last <= g1)
                if not escapes:
                    continue  # replaced by the compiled span's own storages
                handed[(b, half)].append(Alloc(key, nbytes))
            else:
                before[first].append(Alloc(key, nbytes))
            if n in grad_lives:
                continue  # freed at its unit's reduce-scatter (fsdp_events)
            end = inside.get(min(last, total))
            free_at = end[1] if end is not None else min(last, total)
            after[max(free_at, kept_until.get(owners[n], free_at))].append(Free(key))
        events += [Alloc(("input", k, s.id), s.nbytes) for s in inputs]
        events += before_step
        live: dict[Any, None] = {}
        emitted: set[tuple[int, str]] = set()
        for p, (_, i) in enumerate(schedule.order):
            span = inside.get(p)
            if not workspaces_made and graph.ops[i].short in BLAS_OPS:
                events += [Alloc(("blas", j), n) for j, n in enumerate(workspaces)]
                workspaces_made = True
            if span is None:
                events += at.before.get(p, ())
                events += before.get(p, ())
                if op_scratch[i]:
                    events += [Alloc(("scratch", k, p), op_scratch[i]), Free(("scratch", k, p))]
            elif (span[2], span[3]) not in emitted:
                emitted.add((span[2], span[3]))
                for q in range(span[0], span[1] + 1):  # FSDP's pre-forward / pre-backward
                    events += at.before.get(q, ())
                events += _span_events(spans[span[2]][4], span[3], (k, span[2]), live)
            if span is None or p == span[1]:
                if span is not None:  # hand the compiled outputs over to the eager storages
                    events += _handover(spans[span[2]][4], span[3], (k, span[2]), live)
                    events += handed.get((span[2], span[3]), ())
                    for q in range(span[0], span[1] + 1):  # FSDP's post-forward / backward
                        events += at.after.get(q, ())
                else:
                    events += at.after.get(p, ())
                events += after.get(p, ())
        events += after_backward
        events += optimizer_events(graph, optimizer, k, sizes, create_state=k == 0)
        events += after.get(total, ())
        events += at.after.get(total, ())
        if fsdp is not None:
            events += grad_shard_frees(graph, fsdp, k)
        events += [Free(key) for key in live]
        events += [Free(("input", k, s.id)) for s in inputs]
    return events


def saved_inputs(graph: Graph, first: int, last: int, step: StepPeak) -> set[int]:
    """The storages of `graph` made before forward op `first` and read by ops `first..last` (a
    compiled unit's inputs, its parameters and the step's inputs aside) that the unit's compiled
    forward saves (`StepPeak.saved_inputs`): of the inputs of one layout, in the order the span
    first reads them (dynamo makes a graph input where the code first touches it, so the
    compiled unit's inputs come in that order), those at the ranks it saves."""
    wanted = {(shape, dtype): set() for shape, dtype, _ in step.saved_inputs}
    for shape, dtype, rank in step.saved_inputs:
        wanted[(shape, dtype)].add(rank)
    alike: dict[tuple[tuple[int, ...], str], list[int]] = {layout: [] for layout in wanted}
    for op in graph.ops[first : last + 1]:
        for t in op.inputs:
            tensor = graph.tensors[t]
            made = graph.storages[tensor.storage].allocated_at
            seen = alike.get((tensor.shape, tensor.dtype))
            if seen is None or made is None or made >= first or tensor.storage in seen:
                continue
            seen.append(tensor.storage)
    return {
        sid
        for layout, ranks in wanted.items()
        for rank, sid in enumerate(alike[layout])
        if rank in ranks
    }


def _span_events(step: StepPeak, half: str, prefix: tuple, live: dict[Any, None]) -> list[Event]:
    """A compiled block's forward (`half` "fw") or backward ("bw") events under `prefix`, without
    the tangents (the eager step's storages) or a loss; `live` tracks what is allocated."""
    cut = step.forward_event_count
    part = step.events[:cut] if half == "fw" else step.events[cut:]
    skipped = set(step.tangent_keys) | {("loss",)}
    out: list[Event] = []
    for e in part:
        if e.key in skipped:
            continue
        key = (*prefix, e.key)
        if isinstance(e, Alloc):
            live[key] = None
            out.append(Alloc(key, e.nbytes))
        elif key in live:
            del live[key]
            out.append(Free(key))
    return out


def _handover(step: StepPeak, half: str, prefix: tuple, live: dict[Any, None]) -> list[Event]:
    """At a span's end: the compiled outputs the eager step takes over are freed (the user
    outputs after the forward; the gradients, and what the backward left, after the backward)."""
    if half == "fw":
        keys = [(*prefix, key) for key in step.user_output_keys]
    else:
        keys = [key for key in live if key[: len(prefix)] == prefix]
    freed = [key for key in keys if key in live]
    for key in freed:
        del live[key]
    return [Free(key) for key in freed]
