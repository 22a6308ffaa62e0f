"""Simulate a training step run with checkpoint regions, as eager PyTorch runs it.

Semantics of `torch.utils.checkpoint(use_reentrant=False)` with a selective-checkpoint policy,
which is what `remat.apply` installs:
- Forward: the region runs normally, but autograd does not hold what nodes *inside* the region save
  of tensors made inside it, unless the op that made them is kept by the policy (MUST_SAVE). Tensors
  made outside the region (its inputs, parameters) stay held, by the checkpoint frame or autograd.
- Backward: the first node of the region to run re-runs the region's forward from its first op up to
  the last op whose output a node needs (early stop). Kept ops return their cached output. Each
  recomputed tensor a node needs lives until that node has run; the others die during the replay as
  they did in the forward.

The result is the live-bytes timeline of the whole step under the plan, so the peak a plan predicts
and the one `remat.measure` sees are the same quantity.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from remat.estimate import kernel_workspace_bytes
from remat.graph import Graph

#: `torch.utils.checkpoint` (preserve_rng_state=True) keeps a copy of the CPU generator's state per
#: region call until the region's backward: `torch.get_rng_state().numel()` bytes.
CPU_RNG_STATE_BYTES = 5056


@dataclass(frozen=True)
class Region:
    """A checkpoint region over forward ops `first_op..last_op` (one module call, or consecutive
    blocks), recomputed in backward except the ops named in `keep` (kept by the policy)."""

    modules: tuple[str, ...]
    first_op: int
    last_op: int
    keep: tuple[str, ...] = ()
    # For a selective region: the aten targets of its forward ops in order, and the positions in
    # that stream whose outputs are kept, so a plan read from JSON applies without the trace.
    targets: tuple[str, ...] = ()
    keep_at: tuple[int, ...] = ()

    def covers(self, op_index: int | None) -> bool:
        return op_index is not None and self.first_op <= op_index <= self.last_op


def batchnorm_snapshot_bytes(graph: Graph, region: Region) -> int:
    """`remat.apply` keeps a copy of the running statistics of the BatchNorms in a region from its
    forward until its backward (to undo recomputation's second update): their buffers' bytes."""
    ops = graph.ops[region.first_op : region.last_op + 1]
    if not any("batch_norm" in op.short for op in ops):
        return 0
    buffers = {
        graph.tensors[t].storage
        for op in ops
        for t in op.inputs
        if graph.storages[graph.tensors[t].storage].kind == "buffer"
    }
    return sum(graph.storages[sid].nbytes for sid in buffers)


def make_region(
    graph: Graph, modules: tuple[str, ...], first_op: int, last_op: int, keep: set[str] | tuple = ()
) -> Region:
    """A region over forward ops first_op..last_op that keeps the ops named in `keep`."""
    if not keep:
        return Region(modules, first_op, last_op)
    ops = graph.ops[first_op : last_op + 1]
    return Region(
        modules,
        first_op,
        last_op,
        keep=tuple(sorted(keep)),
        targets=tuple(op.target for op in ops),
        keep_at=tuple(i for i, op in enumerate(ops) if op.name in keep),
    )


@dataclass(frozen=True)
class Simulation:
    peak_bytes: int
    peak_position: int
    saved_bytes: int  # activation bytes held from the forward for backward (the plan's "kept")
    retained_bytes: int  # everything the forward allocated that is still live when backward starts
    recompute_ops: tuple[int, ...]  # forward op indices re-run in backward, in replay order
    timeline: tuple[int, ...]  # live bytes at each position of the schedule
    schedule: tuple[tuple[str, int], ...]  # ("op", i) or ("replay", i) per position
    deaths: dict[int, int]  # storage -> position after which its first life ends


def simulate(
    graph: Graph, regions: Sequence[Region] = (), base_bytes: int | None = None
) -> Simulation:
    """The live-bytes timeline of one step with `regions` checkpointed (none: store-all, which then
    equals `estimate.live_bytes_timeline`). `base_bytes` defaults to the storages that exist before
    the step; pass it to add optimizer state."""
    ops = graph.ops
    n = len(ops)
    end = n
    if base_bytes is None:
        base_bytes = sum(s.nbytes for s in graph.storages.values() if s.allocated_at is None)
    region_of_op = [-1] * n
    for r, reg in enumerate(regions):
        for i in range(reg.first_op, reg.last_op + 1):
            if region_of_op[i] != -1:
                raise ValueError(f"regions overlap at op {ops[i].name}")
            region_of_op[i] = r
    keep = {graph.op_by_name[name].index for reg in regions for name in reg.keep}

    def node_release(node_id: int | None) -> int:
        node = graph.nodes.get(node_id) if node_id is not None else None
        return end if node is None or node.released_after is None else node.released_after

    def node_region(node_id: int | None) -> int:
        node = graph.nodes.get(node_id) if node_id is not None else None
        if node is None or node.forward_op is None or node.forward_op >= n:
            return -1
        return region_of_op[node.forward_op]

    # Which saves autograd still holds, and which a region drops (to recompute them).
    held_until: dict[int, int] = {}
    dropped: dict[int, list[int]] = defaultdict(list)  # region -> storages it must recompute
    dropped_releases: dict[int, int] = {}  # storage -> last release among nodes needing it again
    for sv in graph.saved:
        s = graph.storages[sv.storage]
        if s.allocated_at is None:
            continue
        r = node_region(sv.node)
        produced_inside = r != -1 and region_of_op[s.allocated_at] == r
        release = node_release(sv.node)
        if produced_inside and s.allocated_at not in keep:
            dropped[r].append(s.id)
            dropped_releases[s.id] = max(dropped_releases.get(s.id, -1), release)
        else:
            held_until[s.id] = max(held_until.get(s.id, -1), release)

    # Where each region's replay goes: before the first backward op of a node that needs it.
    trigger: dict[int, int] = {}
    needing = {r: set() for r in dropped}
    for sv in graph.saved:
        r = node_region(sv.node)
        if r in needing and sv.storage in dropped_releases:
            needing[r].add(sv.node)
    for op in graph.backward_ops:
        for r, nodes in needing.items():
            if r not in trigger and op.node in nodes:
                trigger[r] = op.index
    # The checkpoint frame (its policy cache, RNG state, BatchNorm snapshot) lives until the
    # region's replay, or, for a region that never replays, until its last node has run.
    frame_until = {}
    for node in graph.nodes.values():
        r = node_region(node.id)
        if r != -1:
            frame_until[r] = max(frame_until.get(r, -1), node_release(node.id))
    for r in range(len(regions)):
        frame_until[r] = trigger.get(r, frame_until.get(r, end))
    # A kept op's output sits in the policy's cache until then, whether or not a node saved it.
    for r, reg in enumerate(regions):
        until = frame_until[r]
        for name in reg.keep:
            for t in graph.op_by_name[name].outputs:
                sid = graph.tensors[t].storage
                if graph.storages[sid].allocated_at == graph.op_by_name[name].index:
                    held_until[sid] = max(held_until.get(sid, -1), until)
    replays: dict[int, list[int]] = defaultdict(list)  # backward op index -> replayed forward ops
    recompute_ops: list[int] = []
    for r, storages in dropped.items():
        if r not in trigger:
            continue
        reg = regions[r]
        stop = max(graph.storages[sid].allocated_at for sid in storages)
        replay = [i for i in range(reg.first_op, stop + 1) if i not in keep]
        replays[trigger[r]].extend(replay)
        recompute_ops.extend(replay)

    # Positions: forward ops, then backward ops with replays inserted before their trigger.
    schedule: list[tuple[str, int]] = []
    position_of_op = [0] * n
    replay_position: dict[int, int] = {}
    for op in ops:
        for i in replays.get(op.index, ()):
            replay_position[i] = len(schedule)
            schedule.append(("replay", i))
        position_of_op[op.index] = len(schedule)
        schedule.append(("op", op.index))
    total = len(schedule)

    def position_after(op_index: int) -> int:
        return total if op_index >= end else position_of_op[op_index]

    delta = [0] * (total + 2)

    def live(start: int, stop: int, nbytes: int) -> None:
        delta[start] += nbytes
        delta[min(stop, total) + 1] -= nbytes

    saved_bytes = sum(
        graph.storages[sid].nbytes
        for sid in graph.saved_storages
        if graph.storages[sid].allocated_at is None or sid in held_until
    )
    deaths: dict[int, int] = {}
    for s in graph.storages.values():
        if s.allocated_at is None:
            continue
        program = end if s.released_after is None else s.released_after
        death = max(program, held_until.get(s.id, -1))
        deaths[s.id] = position_after(death)
        live(position_of_op[s.allocated_at], deaths[s.id], s.nbytes)
        if s.allocated_at in replay_position:
            r = region_of_op[s.allocated_at]
            replay_end = max(replay_position[i] for i in replays[trigger[r]])
            if s.id in dropped_releases:
                stop = position_after(dropped_releases[s.id])
            elif program in replay_position:
                stop = replay_position[program]
            else:
                stop = replay_end
            live(
                replay_position[s.allocated_at],
                max(stop, replay_position[s.allocated_at]),
                s.nbytes,
            )

    overhead = [CPU_RNG_STATE_BYTES + batchnorm_snapshot_bytes(graph, reg) for reg in regions]
    for r, reg in enumerate(regions):
        live(position_of_op[reg.first_op], position_after(frame_until[r]), overhead[r])
    end_of_forward = position_of_op[len(graph.forward_ops) - 1]
    retained_bytes = sum(overhead) + sum(
        graph.storages[sid].nbytes
        for sid, death in deaths.items()
        if death > end_of_forward and graph.ops[graph.storages[sid].allocated_at].phase == "forward"
    )
    timeline, current = [], base_bytes
    for pos, (_, i) in enumerate(schedule):
        current += delta[pos]
        timeline.append(current + kernel_workspace_bytes(graph, ops[i]))
    peak_position = max(range(total), key=timeline.__getitem__)
    return Simulation(
        peak_bytes=timeline[peak_position],
        peak_position=peak_position,
        saved_bytes=saved_bytes,
        retained_bytes=retained_bytes,
        recompute_ops=tuple(recompute_ops),
        timeline=tuple(timeline),
        schedule=tuple(schedule),
        deaths=deaths,
    )
