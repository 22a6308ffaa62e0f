"""Simulate a training step run with checkpoint regions, as eager PyTorch runs it.

Semantics of `torch.utils.checkpoint(use_reentrant=False)` with a selective-checkpoint policy,
which is what `remat.apply` installs (torch/utils/checkpoint.py: `_checkpoint_hook`,
`_recomputation_hook`, `_CachingTorchDispatchMode`, `_CachedTorchDispatchMode`):
- Forward: every tensor a node *inside* the region saves, whatever made it, is swapped for an
  empty holder; autograd holds none of them. The checkpoint frame holds the region's inputs and,
  when the region draws random numbers, the RNG state; the policy's cache holds the outputs of
  the ops it keeps (MUST_SAVE). Outside tensors that region nodes saved stay alive only through
  the frame (inputs) or their other owners.
- Backward: the first unpack of *any* of the region's holders, i.e. the first region node that
  saved anything (kept tensors and parameters included), re-runs the region from its first op and
  stops right after the last save of the forward has been re-made (early stop): after that op's
  kernel when the save is one of its outputs, before it when it is an input. Kept ops reached by the
  replay hand over their cached outputs (the cache lets go of them); the others run again.
- Every value the replay re-saves sits in the frame until its node unpacks it, so it lives until the
  last region node that saved it has run, kept tensors too. The rest of the replay's tensors die
  as in the forward, or when the replay stops. A kept output the replay did not reach stays in the
  cache until the frame dies.
- The frame (its inputs, RNG state, cache, and remat's BatchNorm snapshot) lives until its last
  holder is released: after the last region node that saved anything has run.

The result is the live-bytes timeline of the whole step under the plan, so the peak a plan predicts
and the one `remat.measure` sees are the same quantity.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from remat.errors import StatefulModuleError
from remat.estimate import kernel_workspace_bytes
from remat.graph import Graph, Op

#: `torch.utils.checkpoint` (preserve_rng_state=True) keeps a copy of the CPU generator's state per
#: region call in its frame, until the frame dies: `torch.get_rng_state().numel()` bytes.
CPU_RNG_STATE_BYTES = 5056


#: A kept op as the real run can find it: (module path, aten target, occurrence of that target in
#: that module within the region's call). Stable where positions are not: a real run may issue ops
#: a fake trace did not (`scalar_tensor`, `where`, `expand`) or the other way round.
OpKey = tuple[str, str, int]


@dataclass(frozen=True)
class Region:
    """A checkpoint region over forward ops `first_op..last_op` (one module call, or consecutive
    blocks), recomputed in backward except the ops named in `keep` (kept by the policy), which the
    real run finds by `keep_keys`. `random` says whether the region draws random numbers, and so
    whether checkpoint must keep the RNG state to replay it."""

    modules: tuple[str, ...]
    first_op: int
    last_op: int
    keep: tuple[str, ...] = ()
    keep_keys: tuple[OpKey, ...] = ()
    random: bool = True

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


def op_keys(ops: Sequence[Op]) -> list[OpKey]:
    """The stable key of each op of a region's forward, in order."""
    seen: dict[tuple[str, str], int] = defaultdict(int)
    keys = []
    for op in ops:
        keys.append((op.module, op.target, seen[(op.module, op.target)]))
        seen[(op.module, op.target)] += 1
    return keys


def make_region(
    graph: Graph, modules: tuple[str, ...], first_op: int, last_op: int, keep: set[str] | tuple = ()
) -> Region:
    """A region over forward ops first_op..last_op that keeps the ops named in `keep`. Refused for
    a module call that writes tensors into state outside its outputs: a replay writes them again."""
    for call in graph.stateful_calls:
        if call.path in modules and first_op <= call.first_op <= last_op:
            op = graph.ops[call.escaped[0]]
            raise StatefulModuleError(
                f"module {call.path!r} keeps {len(call.escaped)} tensor(s) made in its forward "
                f"alive outside its outputs (first: {op.name}, {op.target}): it writes them into "
                "state such as a cache or an attribute, which recomputing it would write again. "
                "Call the model with use_cache=False (remat turns Hugging Face caches off "
                "itself), stop storing tensors on modules while training, or leave this module "
                "unplanned (strategy store_all)",
                module=call.path,
            )
    ops = graph.ops[first_op : last_op + 1]
    random = any(op.random for op in ops)
    if not keep:
        return Region(modules, first_op, last_op, random=random)
    keys = op_keys(ops)
    return Region(
        modules,
        first_op,
        last_op,
        keep=tuple(sorted(keep)),
        keep_keys=tuple(k for k, op in zip(keys, ops, strict=True) if op.name in keep),
        random=random,
    )


@dataclass(frozen=True)
class Simulation:
    peak_bytes: int
    peak_position: int
    # Everything the forward allocated that is still live when the backward starts: autograd's
    # saves, the frames' inputs, RNG states and BatchNorm snapshots, the policies' caches (every
    # output of a kept op), the output and the loss. `remat.measure` measures the same figure.
    held_bytes: int
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

    # Saves made by nodes outside every region are held by autograd until their node has run.
    # Inside a region, checkpoint's pack hook swaps every save for a holder: the frame refills the
    # holders in backward, by replaying the region, and hands each value over at its node.
    held_until: dict[int, int] = {}
    region_saves: dict[int, list] = defaultdict(list)  # region -> its saves, in pack order
    for sv in graph.saved:
        s = graph.storages[sv.storage]
        r = node_region(sv.node)
        if r != -1:
            region_saves[r].append(sv)
        elif s.allocated_at is not None:
            held_until[s.id] = max(held_until.get(s.id, -1), node_release(sv.node))

    # Replay: at the first unpack of any of the region's holders, i.e. before the first backward
    # op of a region node that saved something, from the region's first op up to the last pack
    # (early stop), which comes after its op's kernel when it saves an output, before otherwise.
    trigger: dict[int, int] = {}
    stop_at: dict[int, int] = {}
    frame_until: dict[int, int] = {}
    # region -> storage -> the last release among the region's nodes that saved it
    holder_release: dict[int, dict[int, int]] = defaultdict(dict)
    first_backward_op: dict[int, int] = {}
    for op in graph.backward_ops:
        if op.node is not None:
            first_backward_op.setdefault(op.node, op.index)
    for r, saves in region_saves.items():
        frame_until[r] = max(node_release(sv.node) for sv in saves)
        for sv in saves:
            release = node_release(sv.node)
            held = holder_release[r]
            held[sv.storage] = max(held.get(sv.storage, -1), release)
            # A node that ran without issuing an op unpacked right after the op before its end.
            start = first_backward_op.get(sv.node, release + 1)
            if start < end:
                trigger[r] = min(trigger.get(r, end), start)
        last = saves[-1]
        last_op = ops[graph.nodes[last.node].forward_op]
        stop_at[r] = last_op.index if last.tensor in last_op.outputs else last_op.index - 1
    for r in range(len(regions)):
        frame_until.setdefault(r, end)
    replays: dict[int, list[int]] = {}  # region -> its replayed forward ops, in order
    replay_before: dict[int, int] = {}  # backward op index -> the region replayed before it
    recompute_ops: list[int] = []
    for r, at in sorted(trigger.items(), key=lambda item: item[1]):
        reg = regions[r]
        replays[r] = [i for i in range(reg.first_op, stop_at[r] + 1) if i not in keep]
        replay_before[at] = r
        recompute_ops.extend(replays[r])

    # Positions: forward ops, then backward ops with replays inserted before their trigger.
    schedule: list[tuple[str, int]] = []
    position_of_op = [0] * n
    replay_position: dict[int, int] = {}
    for op in ops:
        for i in replays[replay_before[op.index]] if op.index in replay_before else ():
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

    # The frame holds the region's inputs (its saved arguments) until it dies with its last holder.
    calls = {(m.path, m.first_op): m for m in graph.modules}
    for r, reg in enumerate(regions):
        call = calls.get((reg.modules[0], reg.first_op))
        for t in call.inputs if call is not None else ():
            sid = graph.tensors[t].storage
            if graph.storages[sid].allocated_at is not None:
                held_until[sid] = max(held_until.get(sid, -1), frame_until[r])

    deaths: dict[int, int] = {}
    for s in graph.storages.values():
        if s.allocated_at is None:
            continue
        program = end if s.released_after is None else s.released_after
        death = max(program, held_until.get(s.id, -1))
        r = region_of_op[s.allocated_at]
        replayed = s.allocated_at in replay_position
        if s.allocated_at in keep:
            # The policy's cache holds a kept op's outputs until the replay reaches the op; from
            # there the holders of the region's nodes that saved it do, until those nodes ran.
            reached = r in trigger and s.allocated_at <= stop_at[r]
            death = max(death, trigger[r] if reached else frame_until[r])
            if reached:
                death = max(death, holder_release[r].get(s.id, -1))
        deaths[s.id] = position_after(death)
        live(position_of_op[s.allocated_at], deaths[s.id], s.nbytes)
        if replayed:
            # A replayed tensor that a region node saved stays in the frame until that node has
            # unpacked it and run; the others die in the replay when the program dropped them,
            # or when the replay stops.
            replay = replays[r]
            if s.id in holder_release[r]:
                stop = position_after(holder_release[r][s.id])
            else:  # the last replayed op up to the program's release, or the replay's last op
                stop = replay_position[replay[bisect_right(replay, program) - 1]]
            live(
                replay_position[s.allocated_at],
                max(stop, replay_position[s.allocated_at]),
                s.nbytes,
            )
    overhead = [
        CPU_RNG_STATE_BYTES * reg.random + batchnorm_snapshot_bytes(graph, reg) for reg in regions
    ]
    for r, reg in enumerate(regions):
        live(position_of_op[reg.first_op], position_after(frame_until[r]), overhead[r])
    end_of_forward = position_of_op[len(graph.forward_ops) - 1]
    held_bytes = sum(overhead) + sum(
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
        held_bytes=held_bytes,
        recompute_ops=tuple(recompute_ops),
        timeline=tuple(timeline),
        schedule=tuple(schedule),
        deaths=deaths,
    )
