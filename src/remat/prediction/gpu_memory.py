"""What a GPU reports for a training step: requested, allocated and reserved bytes, and the rest.

`remat.estimate` predicts live tensor bytes. A GPU user reads other numbers: torch's
`max_memory_allocated` (live blocks after the caching allocator's rounding), `max_memory_reserved`
(the segments it took from cudaMalloc, which torchtitan logs and which is what runs out), and
nvidia-smi (reserved plus what sits outside the allocator: the CUDA context, NCCL's buffers). This
module turns a step's lives into the allocation events a real loop makes, runs them through the
caching allocator model (`remat.device.allocator`), and puts the fixed lines of `remat.device.gpus` beside them.

The events of steady-state training, two steps of them (the first creates the optimizer state,
which then sits where the first step's free blocks were, as on the GPU):

- before the first step: parameters and buffers, one allocation each in the model's order;
- each step: the inputs; every life of the step's simulation (`remat.prediction.schedule.storage_lives`, the
  same lives `estimate` and every plan are judged on), allocated where it begins and freed after
  it ends, with each op's kernel scratch (`remat.device.targets.scratch_bytes`) allocated and freed
  around the op; at the first matmul, the BLAS workspaces (cuBLAS and cuBLASLt keep theirs in
  the caching allocator for the life of the process);
- the optimizer step after the backward (first step: its state, per parameter in order, as
  `_init_group` creates it), its temporaries as its implementation allocates them
  (`remat.prediction.estimate.OPTIMIZER_MEMORY`); then the gradients, outputs and inputs are freed
  (`zero_grad(set_to_none=True)` and the loop dropping the batch).

Pure Python on the graph: no torch.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from remat.device.allocator import Alloc, AllocatorSettings, Free, simulate
from remat.device.gpus import (
    BLAS_HANDLES,
    Gpu,
    allocator_limit_bytes,
    blas_workspace_bytes,
    fixed_memory,
    get_gpu,
)
from remat.device.targets import ops_scratch_bytes
from remat.errors import RematError
from remat.graph import Graph
from remat.prediction.estimate import (
    OPTIMIZER_MEMORY,
    Optimizer,
    dtype_bytes,
    grad_blocks,
    param_blocks,
    param_dtypes,
    param_gather_bytes,
    resolve_optimizer,
)
from remat.prediction.schedule import Region, step_lives

Event = Alloc | Free

#: ops whose first call creates the BLAS handles' workspaces
BLAS_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_scaled_mm"})


#: The streams allocations are made on: the caching allocator never hands a block freed on one
#: stream to a request on another, so FSDP's side streams keep segments of their own.
COMPUTE_STREAM, ALL_GATHER_STREAM, REDUCE_SCATTER_STREAM = 0, 1, 2


@dataclass(frozen=True)
class FsdpUnit:
    """`fully_shard` on the modules at `paths` together (outside the blocks), as torchtitan
    wraps its embedding, and its final norm with the output head; `reshard_after_forward`
    False keeps the unit's parameters gathered from its forward to its post-backward."""

    paths: tuple[str, ...]
    reshard_after_forward: bool = True

    @property
    def name(self) -> str:
        return "+".join(self.paths)

    def holds(self, module: str) -> bool:
        return any(module == p or module.startswith(p + ".") for p in self.paths)


@dataclass(frozen=True)
class Fsdp:
    """FSDP2 over `shard` ranks, `fully_shard` on each of `graph.blocks`, on each of `units`
    (modules outside the blocks wrapped on their own), and then on the model (the root unit: the
    parameters left); `master_scale` as `remat.prediction.estimate.shard_step` takes it (2: bf16
    traced parameters over fp32 shards, reduce-scatter in fp32)."""

    shard: int
    master_scale: int = 1
    units: tuple[FsdpUnit, ...] = ()


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def optimizer_events(
    graph: Graph, optimizer: Optimizer, step: int, sizes: dict[int, int], create_state: bool
) -> list[Event]:
    """The optimizer step's allocations on the (sharded) parameters of `sizes` (storage id ->
    bytes as the optimizer holds them): its state when `create_state` (kept: never freed), then
    its temporaries, as its implementation makes them."""
    name = resolve_optimizer(optimizer, graph)
    if name is None:
        return []
    memory = OPTIMIZER_MEMORY[name]
    dtypes = param_dtypes(graph)
    params = sorted(sizes)
    events: list[Event] = []
    if create_state:
        shared = memory.quantized.shared_bytes if memory.quantized and params else 0
        events += [Alloc(("state", "shared", 0), shared)] if shared else []  # bnb's two maps
        for sid in params:
            traced = graph.storages[sid]
            elements = (
                traced.nbytes // dtype_bytes(dtypes[sid]) * sizes[sid] // max(traced.nbytes, 1)
            )
            state = [sizes[sid]] * memory.state_per_param_byte + [
                elements
            ] * memory.state_per_element
            if memory.quantized is not None:  # paged moments live outside the allocator
                q = memory.quantized
                moment = q.moment_bytes(elements, sizes[sid] // max(elements, 1))
                state = [] if q.paged(elements) else [moment, moment]
            events += [Alloc(("state", sid, k), n) for k, n in enumerate(state) if n]
    if memory.step_temp_per_param_byte and graph.info.get("optimizer_in_backward"):
        for sid in params:  # one optimizer a parameter: a list of one tensor at a time
            events += [Alloc(("tmp", step, sid), sizes[sid]), Free(("tmp", step, sid))]
    elif memory.step_temp_per_param_byte:  # foreach: the whole list at once, then freed
        events += [Alloc(("tmp", step, sid), sizes[sid]) for sid in params]
        events += [Free(("tmp", step, sid)) for sid in params]
    if memory.per_parameter:  # for-loop: sqrt, quotient; the previous denom freed on rebinding
        previous = None
        for sid in params:
            events += [
                Alloc(("sqrt", step, sid), sizes[sid]),
                Alloc(("denom", step, sid), sizes[sid]),
            ]
            events.append(Free(("sqrt", step, sid)))
            if previous is not None:
                events.append(Free(("denom", step, previous)))
            previous = sid
        if previous is not None:
            events.append(Free(("denom", step, previous)))
    return events


class Positions:
    """Per schedule position, the events to make before and after the op there."""

    def __init__(self) -> None:
        # by position, made where written: most positions have none (a 70B step has 10^5)
        self.before: defaultdict[int, list[Event]] = defaultdict(list)
        self.after: defaultdict[int, list[Event]] = defaultdict(list)


def fsdp_events(
    graph: Graph, schedule: Any, fsdp: Fsdp, step: int, at: Positions, grad_lives: dict[int, int]
) -> tuple[list[Event], list[Event], dict[int, int]]:
    """FSDP2's allocations around the step, per torch's `_fully_shard` (2.13): each unit's
    all-gather output on the all-gather stream (freed after the next unit's copy-out in forward,
    right after its own in backward), its unsharded parameters on the compute stream from its
    pre-forward to its post-forward and again from its pre-backward (the next unit's all-gather
    prefetched) to its post-backward; there its gradients are copied into the fp32 reduce-scatter
    input (compute stream, kept until the next unit's reduce-scatter) and freed, and the
    reduce-scatter output, the gradient shard, is allocated on the reduce-scatter stream and
    kept until `zero_grad`. The root unit (parameters outside every block) is gathered from the
    start of the forward to the end of the backward. Returns the events before the step, after
    the backward, and each trainable parameter's shard bytes. Mutates `at` and ends the block
    gradients' lives (`grad_lives`: life index -> storage) at their unit's post-backward."""
    n, m = fsdp.shard, fsdp.master_scale
    owner, grad_owner = _unit_owners(graph, fsdp.units)
    units: dict[str, list[int]] = defaultdict(list)
    for sid in sorted(owner):
        units[owner[sid]].append(sid)
    # the units of the forward in order: (path, first op, last op, resharded after forward)
    forward_units = [(b.path, b.first_op, b.last_op, True) for b in graph.blocks if b.path in units]
    kept: set[str] = set()  # not resharded after forward: no second all-gather in backward
    for unit in fsdp.units:
        calls = [c for c in graph.modules if unit.holds(c.path)]
        if unit.name in units and calls:
            first, last = min(c.first_op for c in calls), max(c.last_op for c in calls)
            forward_units.append((unit.name, first, last, unit.reshard_after_forward))
            if not unit.reshard_after_forward:
                kept.add(unit.name)
    forward_units.sort(key=lambda u: u[1])
    gathered = param_gather_bytes(graph)  # float8 all-gather: a byte an element
    unit_bytes = {u: sum(gathered[sid] for sid in sids) for u, sids in units.items()}
    shard_bytes = {sid: _ceil_div(graph.storages[sid].nbytes * m, n) for sid in owner}

    def gather(unit: str, phase: str) -> list[Event]:
        return [Alloc(("ag", step, phase, unit), unit_bytes[unit], ALL_GATHER_STREAM)]

    def unsharded(unit: str, phase: str) -> list[Event]:
        return [Alloc(("unsharded", step, phase, sid), gathered[sid]) for sid in units[unit]]

    def reshard(unit: str, phase: str) -> list[Event]:
        return [Free(("unsharded", step, phase, sid)) for sid in units[unit]]

    # forward: unit k's copy-out frees unit k-1's all-gather output
    root = "" in units
    before_step = gather("", "fwd") + unsharded("", "fwd") if root else []
    previous: str | None = "" if root else None
    for path, first_op, last_op, resharded in forward_units:
        first, last = schedule.position_of_op[first_op], schedule.position_of_op[last_op]
        at.before[first] += gather(path, "fwd")
        at.before[first] += [Free(("ag", step, "fwd", previous))] if previous is not None else []
        at.before[first] += unsharded(path, "fwd")
        at.after[last] += reshard(path, "fwd") if resharded else []
        previous = path
    # backward: the span of each unit's replays and backward ops
    span: dict[str, list[int]] = {}
    paths = [(path, path) for path, *_ in forward_units if path not in {u.name for u in fsdp.units}]
    paths += [(p, u.name) for u in fsdp.units if u.name in units for p in u.paths]
    unit_of_path: dict[str, tuple[int, str]] = {}  # a unit's path: the first of `paths` naming it
    for k, (p, u) in enumerate(paths):
        unit_of_path.setdefault(p, (k, u))

    def unit_of(module: str) -> str | None:
        """The unit of the first of `paths` that is `module` or holds it."""
        parts = module.split(".")
        held = (unit_of_path.get(".".join(parts[:n])) for n in range(1, len(parts) + 1))
        return min((h for h in held if h is not None), default=(0, None))[1]

    units_of: dict[str, str | None] = {}  # by module path: a 70B step has 10^4 ops, 10^3 modules
    for position, (kind, i) in enumerate(schedule.order):
        op = graph.ops[i]
        if kind == "op" and op.phase == "forward":
            continue
        unit = units_of.get(op.module, "")
        if unit == "":
            unit = units_of[op.module] = unit_of(op.module)
        if unit is not None:
            span.setdefault(unit, [position, position])[1] = position
    backward_first = min((first for first, _ in span.values()), default=len(schedule.order) - 1)
    if previous is not None:
        at.before[backward_first].insert(0, Free(("ag", step, "fwd", previous)))
    ordered = sorted(span, key=lambda u: span[u][0])
    grad_frees: dict[str, list[Event]] = defaultdict(list)
    for k, sid in grad_lives.items():  # gradients die in their unit's reduce-scatter copy-in
        unit = grad_owner.get(sid, "")
        grad_frees[unit if unit in span else ""].append(Free(("life", step, k)))
    rs_held: list[str] = []
    unit_grads: dict[str, int] = defaultdict(int)  # each unit's gradient bytes, summed once
    for sid, u in grad_owner.items():
        unit_grads[u] += graph.storages[sid].nbytes

    def reduce_scatter(unit: str) -> list[Event]:
        """A unit's post-backward: the previous reduce-scatter input freed (one kept in flight),
        the fp32 input on the compute stream, the gradients copied in and freed, the gradient
        shard on the reduce-scatter stream."""
        grads = unit_grads.get(unit, 0) * m
        if not grads:
            return grad_frees[unit]
        events: list[Event] = [Free(("rs_in", step, u)) for u in rs_held]
        rs_held[:] = [unit]
        events.append(Alloc(("rs_in", step, unit), grads))
        events += grad_frees[unit]
        events.append(Alloc(("grad_shard", step, unit), _ceil_div(grads, n), REDUCE_SCATTER_STREAM))
        return events

    for k, unit in enumerate(ordered):
        first = span[unit][0]
        events = []
        if unit not in kept:  # a kept unit is still gathered from its forward
            events += [] if k else gather(unit, "bwd")  # later units were prefetched
            events += unsharded(unit, "bwd") + [Free(("ag", step, "bwd", unit))]
        if k + 1 < len(ordered) and ordered[k + 1] not in kept:
            events += gather(ordered[k + 1], "bwd")
        at.before[first] += events
    # post-backward in the order the units' backward ends: a checkpointed run of several blocks
    # replays them all before the last one's backward, so their spans nest, not follow
    for unit in sorted(span, key=lambda u: span[u][1]):
        held = "fwd" if unit in kept else "bwd"
        at.after[span[unit][1]] += reduce_scatter(unit) + reshard(unit, held)
    after_backward = reduce_scatter("") + (reshard("", "fwd") if root else [])
    after_backward += [Free(("rs_in", step, u)) for u in rs_held]
    return before_step, after_backward, shard_bytes


def _unit_owners(graph: Graph, extra: Sequence[FsdpUnit]) -> tuple[dict[int, str], dict[int, str]]:
    """Each parameter's and each gradient's FSDP unit: its block (`param_blocks`,
    `grad_blocks`), else the unit of `extra` holding the module that first reads the parameter
    (makes the gradient), else the root ("")."""
    params, grads = param_blocks(graph), grad_blocks(graph)
    if not extra:
        return params, grads
    for op in graph.forward_ops:
        for tid in op.inputs:
            sid = graph.tensors[tid].storage
            if params.get(sid) == "":
                unit = next((u for u in extra if u.holds(op.module)), None)
                params[sid] = unit.name if unit is not None else "\0root"
    for sid, unit in params.items():
        params[sid] = "" if unit == "\0root" else unit
    held = set(params.values())
    for unit in extra:
        if unit.name not in held:
            tops = sorted({op.module.split(".")[0] for op in graph.forward_ops if op.module})
            raise RematError(
                f"FSDP unit {unit.name!r} holds no parameter of the model outside its blocks: "
                "name modules by their paths in the model (its top-level modules: "
                f"{', '.join(tops)})"
            )
    for sid, unit in grads.items():
        made = graph.storages[sid].allocated_at
        module = graph.ops[made].module if unit == "" and made is not None else ""
        grads[sid] = next((u.name for u in extra if module and u.holds(module)), unit)
    return params, grads


def grad_shard_frees(graph: Graph, fsdp: Fsdp, step: int) -> list[Event]:
    """`zero_grad(set_to_none=True)` under FSDP: each unit's gradient shard freed (the units
    whose parameters take gradients)."""
    _, grads = _unit_owners(graph, fsdp.units)
    return [Free(("grad_shard", step, u)) for u in sorted(set(grads.values()))]


def step_events(
    graph: Graph,
    regions: Sequence[Region] = (),
    optimizer: Optimizer = None,
    blas_workspaces: Sequence[int] = (),
    steps: int = 2,
    fsdp: Fsdp | None = None,
    keep_grads: bool = False,
) -> Iterator[Event]:
    """The allocation events of `steps` training steps of `graph` with `regions` checkpointed,
    on one rank of `fsdp` if given (see the module's docstring for what is allocated when).

    `keep_grads`: the gradients outlive the step, as under gradient accumulation or
    `zero_grad(set_to_none=False)` (torch < 2.0's default, and Hugging Face's Trainer then): the
    first step's stay allocated, and a later step's backward makes each gradient as a temporary
    that `AccumulateGrad` adds into the kept one and frees.

    Made as they are walked (`list` them to walk them again): a walk that runs out of memory
    stops early (two in three of the 70B `--shard 32` fit's walks, a quarter of the way in), and
    the events after it are never made."""
    _, schedule, _, lives, owners = step_lives(graph, regions)  # as the plan's simulation read
    total = len(schedule.order)
    op_scratch = ops_scratch_bytes(graph)
    before = sorted(
        (s for s in graph.storages.values() if s.allocated_at is None), key=lambda s: s.id
    )
    params = {s.id: s.nbytes for s in before if s.kind == "param"}
    grad_lives = {
        k: sid
        for k, sid in enumerate(owners)
        if sid is not None and graph.storages[sid].kind == "grad" and fsdp is not None
    }
    if keep_grads and fsdp is not None:
        raise RematError("keep_grads with fsdp: FSDP's gradient accumulation is not modelled")
    kept_grads = {
        k
        for k, sid in enumerate(owners)
        if keep_grads and sid is not None and graph.storages[sid].kind == "grad"
    }
    # the positions where ops allocate scratch, and the first BLAS op's (its workspaces): the
    # step's walk visits only positions where something happens (most have nothing)
    scratch_at: dict[int, int] = {}
    blas_at = None
    for position, (_, i) in enumerate(schedule.order):
        if op_scratch[i]:
            scratch_at[position] = op_scratch[i]
        if blas_at is None and graph.ops[i].short in BLAS_OPS:
            blas_at = position
    for step in range(steps):
        at = Positions()
        ended_early: set[int] = set()
        before_step: list[Event] = []
        after_backward: list[Event] = []
        sizes = params
        if fsdp is not None:
            before_step, after_backward, sizes = fsdp_events(
                graph, schedule, fsdp, step, at, grad_lives
            )
            ended_early = set(grad_lives)
        if step == 0:  # the model as built: parameters (or their shards) and buffers
            yield from (Alloc(("persistent", sid), n) for sid, n in sizes.items() if n)
            yield from (
                Alloc(("persistent", s.id), s.nbytes)
                for s in before
                if s.kind not in ("param", "input") and s.nbytes
            )
        inputs = [s for s in before if s.kind == "input" and s.nbytes]
        yield from (Alloc(("input", step, s.id), s.nbytes) for s in inputs)
        yield from before_step
        for k, (first, last, nbytes) in enumerate(lives):
            if not nbytes:
                continue
            at.before[first].append(Alloc(("life", step, k), nbytes))
            if k in kept_grads:  # the first step's gradient stays; later ones are added into it
                if step > 0:
                    at.after[first].append(Free(("life", step, k)))
            elif k not in ended_early:
                at.after[min(last, total)].append(Free(("life", step, k)))
        workspaces_at = blas_at if step == 0 else None  # made once, by the first matmul
        busy = {*at.before, *at.after, *scratch_at}
        if workspaces_at is not None:
            busy.add(workspaces_at)
        for position in sorted(p for p in busy if p < total):
            if position == workspaces_at:
                yield from (Alloc(("blas", k), n) for k, n in enumerate(blas_workspaces))
            yield from at.before.get(position, ())
            scratch = scratch_at.get(position)
            if scratch:
                yield Alloc(("scratch", step, position), scratch)
                yield Free(("scratch", step, position))
            yield from at.after.get(position, ())
        yield from after_backward
        yield from optimizer_events(graph, optimizer, step, sizes, create_state=step == 0)
        yield from at.after.get(total, ())  # zero_grad(set_to_none), the outputs and loss dropped
        if fsdp is not None:
            yield from grad_shard_frees(graph, fsdp, step)
        yield from (Free(("input", step, s.id)) for s in inputs)


@dataclass(frozen=True)
class GpuMemory:
    """A step's memory as the GPU reports it, per rank, under one allocator setting.

    `requested_bytes`: the peak of what live tensors asked for (`remat.estimate`'s peak plus the
    BLAS workspaces); `allocated_bytes`: the peak of the blocks handed out, after rounding
    (`torch.cuda.max_memory_allocated`); `reserved_bytes`: the peak of the segments taken from
    cudaMalloc (`max_memory_reserved`). Outside the allocator: the CUDA context and NCCL's buffers;
    `nvidia_smi_bytes` adds them to the reserved bytes. `out_of_memory`: the allocator could not
    serve a request within `limit_bytes` even after freeing its cache."""

    settings: str
    requested_bytes: int
    allocated_bytes: int
    reserved_bytes: int
    blas_workspace_bytes: int
    context_bytes: int
    nccl_bytes: int
    limit_bytes: int
    out_of_memory: bool
    alloc_retries: int

    @property
    def active_bytes(self) -> int:
        """torch's `active_bytes.all.peak` (torchtune's `peak_memory_active`): blocks allocated,
        plus blocks freed while another stream still uses them (`record_stream`). A simulated
        step frees no block under another stream's use, so it equals `allocated_bytes`."""
        return self.allocated_bytes

    @property
    def nvidia_smi_bytes(self) -> int:
        return self.reserved_bytes + self.context_bytes + self.nccl_bytes

    @property
    def live_bytes_that_fit(self) -> int:
        """The live bytes a step may reach and still fit, by this judgement at one size: the
        limit less the BLAS workspaces and the overhead (reserved less requested) shown here."""
        overhead = max(self.reserved_bytes - self.requested_bytes, 0)
        return self.limit_bytes - self.blas_workspace_bytes - overhead

    @property
    def fits(self) -> bool:
        return not self.out_of_memory and self.reserved_bytes <= self.limit_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "active_bytes": self.active_bytes,
            "nvidia_smi_bytes": self.nvidia_smi_bytes,
            "fits": self.fits,
        }


#: The allocator settings `gpu_memory` reports by default: torch's, and expandable segments.
ALLOCATOR_SETTINGS = (AllocatorSettings(), AllocatorSettings(expandable_segments=True))


def gpu_memory(
    graph: Graph,
    gpu: Gpu | str,
    regions: Sequence[Region] = (),
    optimizer: Optimizer = None,
    fsdp: Fsdp | None = None,
    settings: AllocatorSettings | None = None,
    keep_grads: bool = False,
) -> GpuMemory:
    """The step of `graph` (with `regions` checkpointed, `optimizer`, and sharded by `fsdp` if
    given) on one rank of `gpu`, as
    the GPU reports it under the allocator `settings` (a `capacity` in them is replaced by the
    GPU's allocator limit: its total memory less the context and NCCL's buffers; None: torch's
    default settings). `keep_grads`: see `step_events`."""
    return gpu_memories(graph, gpu, regions, optimizer, fsdp, (settings,), keep_grads)[0]


def gpu_memories(
    graph: Graph,
    gpu: Gpu | str,
    regions: Sequence[Region] = (),
    optimizer: Optimizer = None,
    fsdp: Fsdp | None = None,
    settings: Sequence[AllocatorSettings | None] | None = None,
    keep_grads: bool = False,
) -> list[GpuMemory]:
    """`gpu_memory` under each of `settings` (None: `ALLOCATOR_SETTINGS`, torch's default first),
    from one step's events: the events do not depend on the settings."""
    ranks = 1 if fsdp is None else fsdp.shard
    workspaces = blas_workspaces(gpu)
    chosen = ALLOCATOR_SETTINGS if settings is None else settings
    events: Iterable[Event] = step_events(
        graph, regions, optimizer, workspaces, fsdp=fsdp, keep_grads=keep_grads
    )
    if len(chosen) > 1:  # walked once per setting
        events = list(events)
    return [memory_of_events(events, gpu, ranks, s) for s in chosen]


def blas_workspaces(gpu: Gpu | str) -> list[int]:
    """The BLAS workspaces a process's first matmul makes on `gpu`, one per handle."""
    return [blas_workspace_bytes(gpu)] * BLAS_HANDLES


def memory_of_events(
    events: Iterable[Event],
    gpu: Gpu | str,
    ranks: int = 1,
    settings: AllocatorSettings | None = None,
) -> GpuMemory:
    """`events` (those of `blas_workspaces` among them) run through the caching allocator under
    `settings` (None: torch's defaults) up to `gpu`'s allocator limit in a job of `ranks` ranks,
    with the memory outside the allocator beside them."""
    settings = ALLOCATOR_SETTINGS[0] if settings is None else settings
    g = get_gpu(gpu)
    fixed = fixed_memory(g, ranks)
    limit = allocator_limit_bytes(g, ranks)
    peaks = simulate(events, _with_capacity(settings, limit))
    return GpuMemory(
        settings=settings.describe(),
        requested_bytes=peaks.requested_bytes,
        allocated_bytes=peaks.allocated_bytes,
        reserved_bytes=peaks.reserved_bytes,
        blas_workspace_bytes=sum(blas_workspaces(g)),
        context_bytes=fixed.context_bytes,
        nccl_bytes=fixed.nccl_bytes,
        limit_bytes=limit,
        out_of_memory=peaks.out_of_memory,
        alloc_retries=peaks.alloc_retries,
    )


def _with_capacity(settings: AllocatorSettings, limit: int) -> AllocatorSettings:
    return replace(settings, capacity=limit)
