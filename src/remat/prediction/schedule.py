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
- Every value the replay re-saves sits in the frame until its node unpacks it; the unpack hands it
  over (the frame keeps nothing), so it lives until the backward function of the last region node
  that saved it has returned, kept tensors too: before the engine reduces that node's gradients
  to their inputs' shapes (`sum_to`) and releases the node (`Saved.unpacked_until`). The rest of
  the replay's tensors die as in the forward, or when the replay stops. A kept output the replay did not reach stays in the
  cache until the frame dies.
- The frame (its inputs, RNG state, cache, and remat's BatchNorm snapshot) lives until its last
  holder is released: after the last region node that saved anything has run.

The result is the live-bytes timeline of the whole step under the plan, so the peak a plan predicts
and the one `remat.measure` sees are the same quantity. With no regions it is the store-all step
that `remat.estimate` reports: one judge of a step's memory, not two.

`simulate` works in three steps:
1. regions (`analyse_regions`): which forward ops each region's replay re-runs, before which
   backward op, and what its frame holds until when (`RegionReplay`);
2. the schedule (`build_schedule`): forward ops, then backward ops with each replay inserted
   right before its trigger (`Schedule`);
3. liveness (`storage_lives`, `live_bytes`): when each storage is born and dies on that schedule,
   and the live bytes at each of its positions.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import OrderedDict, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from remat.device.targets import get_target, ops_scratch_bytes
from remat.errors import StatefulModuleError
from remat.graph import Graph, ModuleCall, Op, Saved, Storage


def rng_state_bytes(graph: Graph) -> int:
    """The device memory `torch.utils.checkpoint` (preserve_rng_state=True) holds per random
    region: a copy of the RNG state in its frame until the frame dies, and one more while its
    replay runs inside `torch.random.fork_rng`. On the CPU the generator's state
    (`targets.CPU_RNG_STATE_BYTES`); on a CUDA target none, both states live on the host."""
    return get_target(graph.info.get("target")).rng_state_bytes


#: A kept op as the real run can find it: (module path, aten target, occurrence of that target in
#: that module within the region's call). Stable where positions are not: a real run may issue ops
#: a fake trace did not (`scalar_tensor`, `where`, `expand`) or the other way round.
OpKey = tuple[str, str, int]


@dataclass(frozen=True)
class Region:
    """A checkpoint region over forward ops `first_op..last_op` (one module call, or consecutive
    blocks), recomputed in backward except the ops named in `keep` (kept by the policy), which the
    real run finds by `keep_keys`. `random` says whether the region draws random numbers, and so
    whether checkpoint must keep the RNG state to replay it. A region of several blocks calls each
    later block with the first one's arguments but `carry_argument` (a positional index as digits,
    or a keyword), which takes the previous block's output at `carry_output` (indices, keys or
    attribute names into it; empty: the output itself). `calls`: where a module of the region is
    one the forward calls more than once, which call of each module it is (0: the first); empty
    where each is called once."""

    modules: tuple[str, ...]
    first_op: int
    last_op: int
    keep: tuple[str, ...] = ()
    keep_keys: tuple[OpKey, ...] = ()
    random: bool = True
    carry_output: tuple[int | str, ...] = ()
    carry_argument: str = "0"
    calls: tuple[int, ...] = ()

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


#: The fused backends of `scaled_dot_product_attention`: one op each, saving its output and
#: log-sum-exp alike, picked when the step runs by the GPU and the torch build (an H100 with
#: torch 2.11+cu130 runs cuDNN's where a CUDA 12 build runs flash's). A kept attention op is
#: found whichever of them runs.
FUSED_ATTENTION = "aten._scaled_dot_product_fused_attention"
_FUSED_ATTENTION_OPS = tuple(
    f"aten._scaled_dot_product_{b}."
    for b in (
        "flash_attention",
        "cudnn_attention",
        "efficient_attention",
        "flash_attention_for_cpu",
    )
)


def key_target(target: str) -> str:
    """The aten target as an `OpKey` names it: a fused attention backend's as `FUSED_ATTENTION`."""
    return FUSED_ATTENTION if target.startswith(_FUSED_ATTENTION_OPS) else target


def op_keys(ops: Sequence[Op]) -> list[OpKey]:
    """The stable key of each op of a region's forward, in order."""
    seen: dict[tuple[str, str], int] = defaultdict(int)
    keys = []
    for op in ops:
        at = (op.module, key_target(op.target))
        keys.append((*at, seen[at]))
        seen[at] += 1
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
    keys = zip(op_keys(ops), ops, strict=True) if keep else ()
    return Region(
        modules,
        first_op,
        last_op,
        keep=tuple(sorted(keep)),
        keep_keys=tuple(k for k, op in keys if op.name in keep),
        random=any(op.random for op in ops),
        calls=graph.call_numbers(modules, first_op, last_op),
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


# -- 1. regions: what each one replays, when, and what its frame holds ----------------------------
@dataclass(frozen=True)
class RegionReplay:
    """What checkpoint does with one region in backward. Times are op indices, `len(graph.ops)`
    meaning the end of the step.

    `holders`: each storage the region's nodes saved -> the op after which the last of those nodes
    has run (the frame refills the holder in the replay and keeps the value until then).
    `frame_until`: the op after which the frame dies with its last holder, and with it the region's
    inputs (`frame_inputs`, storages) and `overhead_bytes` (RNG state, BatchNorm snapshot).
    `trigger`: the backward op the replay runs just before (the first unpack of a holder); None
    when no holder is ever unpacked. `stop_at`: the forward op the replay stops after (early stop;
    None when the region saves nothing). `ops`: the forward ops the replay re-runs, in order: the
    region's from its first up to `stop_at`, less the kept ones (empty when never triggered).
    `first_pack`: the position in `graph.saved` of the region's first save, which orders replays
    that share a trigger.
    """

    region: Region
    holders: dict[int, int]
    frame_until: int
    frame_inputs: tuple[int, ...]
    overhead_bytes: int
    trigger: int | None
    stop_at: int | None
    ops: tuple[int, ...]
    first_pack: int


@dataclass(frozen=True)
class RegionAnalysis:
    """The regions of a step, analysed: `region_of_op` (index into `replays`, -1 outside every
    region, one entry per op), the indices of the kept ops, one `RegionReplay` per region, and
    `autograd_holds`: storage -> the op after which autograd lets go of a save made by a node
    outside every region (when that node has run)."""

    region_of_op: tuple[int, ...]
    kept_ops: frozenset[int]
    replays: tuple[RegionReplay, ...]
    autograd_holds: dict[int, int]
    #: offloaded saves' second lives on the device: (storage, first op, last op), merged per storage
    reloads: tuple[tuple[int, int, int], ...] = ()
    #: region index -> its frame inputs held on the host (`Offload.frames`), and when they come
    #: back at the earliest (`Offload.reload_from`)
    offloaded_frames: Mapping[int, frozenset[int]] = field(default_factory=dict)
    reload_from: Mapping[int, int] = field(default_factory=dict)
    #: region index -> its kept ops' outputs whose cached copy is on the host (`Offload.kept`)
    offloaded_kept: Mapping[int, frozenset[int]] = field(default_factory=dict)


@dataclass(frozen=True)
class Offload:
    """Saves that go to host memory (`remat.applying.eager`'s saved-tensor hooks): `saves` are
    indices into `graph.saved`, made by nodes outside every region. Autograd then holds no device
    copy: the storage dies when the program drops it, or after op `device_until[storage]` where
    the copy to host is still in flight then. It comes back before its node runs in backward, from
    op `reload_from[storage]` when prefetched earlier (default: its node's first backward op),
    until that node has run. Host bytes are each offloaded storage's once (`host_bytes`).

    `frames`: region index -> storages among its checkpoint frame's inputs that go to host
    (checkpoint saves its inputs through the saved-tensor hooks active around it): the frame
    then holds no device copy; they come back when the region's replay starts, until the frame
    dies.

    `kept`: region index -> storages its kept ops made whose selective-checkpoint cache entry
    goes to host (`remat.applying.offload.OffloadingCache`): the cache holds no device copy, so
    the storage dies when the program drops it; it comes back when the replay reaches its op
    (from `reload_from` when prefetched), and lives from there as a cached value would."""

    saves: frozenset[int]
    device_until: Mapping[int, int] = field(default_factory=dict)
    reload_from: Mapping[int, int] = field(default_factory=dict)
    frames: Mapping[int, frozenset[int]] = field(default_factory=dict)
    kept: Mapping[int, frozenset[int]] = field(default_factory=dict)

    def storages(self, graph: Graph) -> set[int]:
        out = {graph.saved[i].storage for i in self.saves}
        for storages in (*self.frames.values(), *self.kept.values()):
            out.update(storages)
        return out

    def host_bytes(self, graph: Graph) -> int:
        """Pinned host memory the offloaded storages take, each once."""
        return sum(graph.storages[sid].nbytes for sid in self.storages(graph))


def analyse_regions(
    graph: Graph, regions: Sequence[Region], offload: Offload | None = None
) -> RegionAnalysis:
    """Which ops each region replays, before which backward op, and what its frame holds until
    when (see the module docstring for the checkpoint semantics). Raises if regions overlap.
    `offload`'s saves are held on the host, not by autograd, and come back for their nodes."""
    ops = graph.ops
    end = len(ops)
    region_of_op = [-1] * end
    for r, reg in enumerate(regions):
        for i in range(reg.first_op, reg.last_op + 1):
            if region_of_op[i] != -1:
                raise ValueError(f"regions overlap at op {ops[i].name}")
            region_of_op[i] = r
    kept_ops = frozenset(graph.op_by_name[name].index for reg in regions for name in reg.keep)

    def release(node_id: int | None) -> int:
        return node_release(graph, node_id)

    def released(sv: Saved) -> int:
        return save_release(graph, sv)

    def handed_until(sv: Saved) -> int:
        """Until when the value a replay re-made for a save lives once its node has unpacked it:
        the frame hands it over and keeps nothing, so only the node's backward function holds
        it, until it returns (`Saved.unpacked_until`), before autograd reduces the node's
        gradients (`sum_to`) and releases the node; traces without it: until the release."""
        if sv.node is None or sv.unpacked_until is None:
            return released(sv)
        return sv.unpacked_until

    def region_of_save(sv: Saved) -> int:
        return save_region(graph, sv, region_of_op)

    # Saves made by nodes outside every region are held by autograd until it lets go of them.
    # Inside a region, checkpoint's pack hook swaps every save for a holder: the frame refills the
    # holders still alive in backward, by replaying the region, and hands each value over at its
    # node; a save whose node never runs leaves nothing to refill (its holder died with it).
    autograd_holds: dict[int, int] = {}
    region_saves: dict[int, list[tuple[int, Saved]]] = defaultdict(list)  # in pack order
    offloaded: list[Saved] = []
    for pack, sv in enumerate(graph.saved):
        r = region_of_save(sv)
        if r != -1:
            if offload is not None and pack in offload.saves:
                raise ValueError(
                    f"save {pack} is inside a checkpoint region: it cannot be offloaded"
                )
            region_saves[r].append((pack, sv))
        elif graph.storages[sv.storage].allocated_at is not None:
            held = released(sv)
            if offload is not None and pack in offload.saves:
                offloaded.append(sv)
                held = offload.device_until.get(sv.storage, -1)
            autograd_holds[sv.storage] = max(autograd_holds.get(sv.storage, -1), held)

    first_backward_op: dict[int, int] = {}
    for op in graph.backward_ops:
        if op.node is not None:
            first_backward_op.setdefault(op.node, op.index)
    reloads = _reloads(graph, offloaded, offload, first_backward_op, release)
    calls = {(m.path, m.first_op): m for m in graph.modules}
    rng_bytes = rng_state_bytes(graph)
    replays = []
    for r, reg in enumerate(regions):
        saves = [sv for _, sv in region_saves.get(r, ())]
        trigger = None
        for sv in saves:
            if sv.node is None:
                continue  # never unpacked: it triggers nothing
            # A node that ran without issuing an op unpacked right after the op before its end.
            start = first_backward_op.get(sv.node, release(sv.node) + 1)
            if start < end:
                trigger = start if trigger is None else min(trigger, start)
        holders: dict[int, int] = {}
        for sv in saves:
            if trigger is not None and released(sv) >= trigger:
                holders[sv.storage] = max(holders.get(sv.storage, -1), handed_until(sv))
        stop_at = _early_stop(graph, saves[-1]) if saves else None
        replayed = () if trigger is None else range(reg.first_op, stop_at + 1)
        replays.append(
            RegionReplay(
                region=reg,
                holders=holders,
                # the frame lives while any of its holders does, unpacked or not
                frame_until=max((released(sv) for sv in saves), default=end),
                frame_inputs=_frame_inputs(graph, calls.get((reg.modules[0], reg.first_op))),
                overhead_bytes=(rng_bytes * reg.random + batchnorm_snapshot_bytes(graph, reg)),
                trigger=trigger,
                stop_at=stop_at,
                ops=tuple(i for i in replayed if i not in kept_ops),
                first_pack=region_saves[r][0][0] if saves else len(graph.saved),
            )
        )
    frames = {} if offload is None else dict(offload.frames)
    kept = {} if offload is None else dict(offload.kept)
    for storages in (*frames.values(), *kept.values()):
        for sid in storages:
            autograd_holds[sid] = max(
                autograd_holds.get(sid, -1), offload.device_until.get(sid, -1)
            )
    reload_from = {} if offload is None else dict(offload.reload_from)
    return RegionAnalysis(
        tuple(region_of_op),
        kept_ops,
        tuple(replays),
        autograd_holds,
        reloads,
        frames,
        reload_from,
        kept,
    )


def node_release(graph: Graph, node_id: int | None) -> int:
    """The op after which autograd releases node `node_id` (the end of the step: never)."""
    node = graph.nodes.get(node_id) if node_id is not None else None
    return len(graph.ops) if node is None or node.released_after is None else node.released_after


def save_release(graph: Graph, sv: Saved) -> int:
    """When autograd lets go of a save: after its node has run; a save no node unpacked when the
    trace saw it go (its node destroyed unrun with the forward's tensors that led to it: a
    loop's last state update, an output the loss does not use), else at the end."""
    if sv.node is None:
        return len(graph.ops) if sv.released_after is None else sv.released_after
    return node_release(graph, sv.node)


def save_region(graph: Graph, sv: Saved, region_of_op: Sequence[int]) -> int:
    """The index of the region whose node made save `sv` (-1: outside every region)."""
    node = graph.nodes.get(sv.node) if sv.node is not None else None
    op = sv.forward_op if node is None else node.forward_op
    return -1 if op is None or op >= len(graph.ops) else region_of_op[op]


def _reloads(
    graph, offloaded, offload, first_backward_op, release
) -> tuple[tuple[int, int, int], ...]:
    """When each offloaded save is back on the device: from its node's first backward op (or the
    prefetch's `reload_from`) until the node has run; a storage several nodes saved comes back
    once per node, the spans that overlap merged (the hooks share a copy that is still alive)."""
    spans: dict[int, list[tuple[int, int]]] = defaultdict(list)
    end = len(graph.ops)
    for sv in offloaded:
        if sv.node is None:
            continue  # never unpacked: nothing comes back
        start = first_backward_op.get(sv.node, release(sv.node) + 1)
        if start >= end:
            continue
        start = min(start, offload.reload_from.get(sv.storage, start))
        spans[sv.storage].append((start, max(release(sv.node), start)))
    out = []
    for sid, found in spans.items():
        merged: list[list[int]] = []
        for first, last in sorted(found):
            if merged and first <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], last)
            else:
                merged.append([first, last])
        out.extend((sid, first, last) for first, last in merged)
    return tuple(out)


def _early_stop(graph: Graph, last_save: Saved) -> int:
    """The forward op a replay stops after: the one recorded last before the region's last save
    was packed (checkpoint counts packs, unpacked or not). Without that record (older graphs), the
    op whose node made the save, after its kernel when the save is one of its outputs, before it
    when it is an input."""
    if last_save.packed_after is not None:
        return last_save.packed_after
    op = graph.ops[graph.nodes[last_save.node].forward_op]
    return op.index if last_save.tensor in op.outputs else op.index - 1


def replay_stop(graph: Graph, first_op: int, last_op: int) -> int | None:
    """The forward op the replay of one region over `first_op..last_op` stops after, as
    `analyse_regions` finds it for that region alone (`RegionReplay.stop_at`), without
    analysing the whole step: the region's last save, by each op's last save in pack order,
    worked out once per graph."""
    end = len(graph.ops)

    def last_save_of_op() -> dict[int, int]:
        out: dict[int, int] = {}
        for pack, sv in enumerate(graph.saved):  # `analyse_regions`' region_of_save
            node = graph.nodes.get(sv.node) if sv.node is not None else None
            op = sv.forward_op if node is None else node.forward_op
            if op is not None and op < end:
                out[op] = pack
        return out

    last = graph.derived("last_save_of_op", last_save_of_op, graph.saved, graph.nodes, graph.ops)
    packs = [last[i] for i in range(first_op, last_op + 1) if i in last]
    return _early_stop(graph, graph.saved[max(packs)]) if packs else None


def _frame_inputs(graph: Graph, call: ModuleCall | None) -> tuple[int, ...]:
    """The storages allocated during the step that a region's frame holds as its inputs."""
    storages = (graph.tensors[t].storage for t in call.inputs) if call is not None else ()
    return tuple(sid for sid in storages if graph.storages[sid].allocated_at is not None)


# -- 2. the schedule: forward ops, then backward ops with the replays inserted --------------------
@dataclass(frozen=True)
class Schedule:
    """The positions of a step: `order` holds ("op", i) or ("replay", i) per position;
    `position_of_op[i]` is op i's position, `replay_position[i]` forward op i's re-run's."""

    order: tuple[tuple[str, int], ...]
    position_of_op: tuple[int, ...]
    replay_position: dict[int, int]

    def after(self, op_index: int) -> int:
        """The position of op `op_index`; for the end of the step (`len(graph.ops)`), past the last."""
        if op_index >= len(self.position_of_op):
            return len(self.order)
        return self.position_of_op[op_index]


def replay_order(replays: Iterable[RegionReplay]) -> list[RegionReplay]:
    """The regions that replay, in the order they do: by trigger, then by pack order."""
    triggered = (rep for rep in replays if rep.trigger is not None)
    return sorted(triggered, key=lambda rep: (rep.trigger, rep.first_pack))


def recompute_ops(replays: Iterable[RegionReplay]) -> tuple[int, ...]:
    """The forward ops the replays re-run, in the order they do (`Simulation.recompute_ops`)."""
    return tuple(i for rep in replay_order(replays) for i in rep.ops)


def build_schedule(graph: Graph, analysis: RegionAnalysis) -> Schedule:
    """Forward ops, then backward ops, each region's replay inserted right before its trigger.

    Two regions sharing a trigger (not seen on any model we trace) are not modelled: only the
    last in `replay_order` is inserted, though both count in `Simulation.recompute_ops`."""
    replay_before = {rep.trigger: rep.ops for rep in replay_order(analysis.replays)}
    order: list[tuple[str, int]] = []
    position_of_op = []
    replay_position: dict[int, int] = {}
    for op in graph.ops:
        for i in replay_before.get(op.index, ()):
            replay_position[i] = len(order)
            order.append(("replay", i))
        position_of_op.append(len(order))
        order.append(("op", op.index))
    return Schedule(tuple(order), tuple(position_of_op), replay_position)


# -- 3. liveness: when each storage is born and dies, and the live bytes at each position ---------
#: A span of memory on a schedule: (first position, last position, bytes), both ends inclusive.
Life = tuple[int, int, int]


def storage_lives(
    graph: Graph, analysis: RegionAnalysis, schedule: Schedule
) -> tuple[dict[int, int], list[Life], list[int | None]]:
    """Each storage allocated during the step -> the position after which its first life ends,
    and every life on `schedule`: each storage's first life (from its op until both the program
    and its holders let go), a second life for a storage a replay makes again, each region's
    frame overhead (RNG state, BatchNorm snapshot) from its region's first op until it dies, and
    the RNG state `fork_rng` keeps while a random region's replay runs. The third list names
    each life's storage (None for a frame's overhead), for who must tell lives apart (the
    allocation events of `remat.prediction.gpu_memory`)."""
    end = len(graph.ops)
    held_until = dict(analysis.autograd_holds)
    # The frame holds the region's inputs (its saved arguments) until it dies with its last holder.
    for r, rep in enumerate(analysis.replays):
        on_host = analysis.offloaded_frames.get(r, frozenset())
        for sid in rep.frame_inputs:
            if sid not in on_host:
                held_until[sid] = max(held_until.get(sid, -1), rep.frame_until)

    deaths: dict[int, int] = {}
    lives: list[Life] = []
    owners: list[int | None] = []
    region_of_op = analysis.region_of_op
    for s in graph.storages.values():
        if s.allocated_at is None:
            continue
        death, found = storage_life(
            s, held_until.get(s.id, -1), region_of_op[s.allocated_at], analysis, schedule, end
        )
        deaths[s.id] = death
        lives.extend(found)
        owners.extend([s.id] * len(found))
    for sid, first_op, last_op in analysis.reloads:
        lives.append(
            (schedule.position_of_op[first_op], schedule.after(last_op), graph.storages[sid].nbytes)
        )
        owners.append(sid)
    for r, storages in analysis.offloaded_frames.items():
        rep = analysis.replays[r]
        if rep.trigger is None:
            continue  # never replayed: its inputs never come back
        replayed = [schedule.replay_position[i] for i in rep.ops if i in schedule.replay_position]
        first = replayed[0] if replayed else schedule.position_of_op[rep.trigger]
        for sid in storages:
            start = first
            if sid in analysis.reload_from:  # prefetched before the replay
                start = min(start, schedule.position_of_op[analysis.reload_from[sid]])
            lives.append((start, schedule.after(rep.frame_until), graph.storages[sid].nbytes))
            owners.append(sid)
    rng_bytes = rng_state_bytes(graph)
    for rep in analysis.replays:
        found = frame_lives(rep, schedule, rng_bytes)
        lives.extend(found)
        owners.extend([None] * len(found))
    return deaths, lives, owners


def storage_life(
    s: Storage,
    held: int,
    region: int,
    analysis: RegionAnalysis,
    schedule: Schedule,
    end: int,
) -> tuple[int, list[Life]]:
    """The position after which storage `s`'s first life ends, and its lives on `schedule`
    (`storage_lives`' rule for one storage): `held` is the op until which autograd or a frame
    holds it (-1: neither), `region` the index of the region its op is in (-1: none)."""
    lives: list[Life] = []
    program = end if s.released_after is None else s.released_after
    death = max(program, held)
    replay_death = -1
    if s.allocated_at in analysis.kept_ops:
        rep = analysis.replays[region]
        # The policy's cache holds a kept op's outputs until the replay reaches the op and
        # takes them back; from there they live as a replayed op's outputs would.
        reached = rep.trigger is not None and s.allocated_at <= rep.stop_at
        if s.id in analysis.offloaded_kept.get(region, ()):
            # the cache holds a host copy: the device copy dies with the program's, and the
            # one brought back when the replay reaches the op lives as the cached one would
            if reached:
                lives.append(_reloaded_kept_life(s, program, rep, schedule, analysis))
        elif not reached:
            death = max(death, rep.frame_until)
        elif s.id in rep.holders:
            death = max(death, rep.holders[s.id])
        else:
            replay_death = _handed_over_until(program, rep, schedule)
    last = max(schedule.after(death), replay_death)
    lives.append((schedule.position_of_op[s.allocated_at], last, s.nbytes))
    if s.allocated_at in schedule.replay_position:
        lives.append(_replayed_life(s, program, analysis.replays[region], schedule))
    return last, lives


def frame_lives(rep: RegionReplay, schedule: Schedule, rng_bytes: int) -> list[Life]:
    """A region's frame overhead (RNG state, BatchNorm snapshot) from its first op until the
    frame dies, and the RNG state `fork_rng` keeps while a random region's replay runs."""
    first = schedule.position_of_op[rep.region.first_op]
    lives = [(first, schedule.after(rep.frame_until), rep.overhead_bytes)]
    replayed = [schedule.replay_position[i] for i in rep.ops if i in schedule.replay_position]
    if rep.region.random and replayed:
        lives.append((replayed[0], replayed[-1], rng_bytes))
    return lives


def _reloaded_kept_life(
    s: Storage, program: int, rep: RegionReplay, schedule: Schedule, analysis: RegionAnalysis
) -> Life:
    """The device life of a kept op's output whose cache entry was on the host: back when the
    replay reaches the op (before the first op it replays after it, else before its trigger; or
    from its prefetch), until a region node that saved it has run, or as `_handed_over_until`."""
    assert rep.trigger is not None
    later = [i for i in rep.ops if i > s.allocated_at and i in schedule.replay_position]
    born = schedule.replay_position[later[0]] if later else schedule.position_of_op[rep.trigger]
    if s.id in analysis.reload_from:
        born = min(born, schedule.position_of_op[analysis.reload_from[s.id]])
    if s.id in rep.holders:
        stop = schedule.after(rep.holders[s.id])
    else:
        stop = _handed_over_until(program, rep, schedule)
    return (born, max(stop, born), s.nbytes)


def _handed_over_until(program: int, rep: RegionReplay, schedule: Schedule) -> int:
    """The position until which a kept op's output that no region node saved lives, once the
    replay has reached the op and taken it from the cache: the last replayed op up to the one
    after which the program dropped it (the replay's last, if it stops before), or the position
    before the replay when the program dropped it before any replayed op."""
    replayed = [i for i in rep.ops if i in schedule.replay_position]
    if not replayed:  # every op up to the early stop is kept: the replay runs no op of its own
        return schedule.after(rep.trigger) if rep.trigger is not None else len(schedule.order)
    last = bisect_right(replayed, program) - 1
    if last < 0:
        return schedule.replay_position[replayed[0]] - 1
    return schedule.replay_position[replayed[last]]


def _replayed_life(s: Storage, program: int, rep: RegionReplay, schedule: Schedule) -> Life:
    """The second life of a storage the replay makes again. A value a region node saved stays in
    the frame until that node has unpacked it and run; the others die in the replay when the
    program dropped them (the last replayed op up to `program`), or when the replay stops."""
    born = schedule.replay_position[s.allocated_at]
    if s.id in rep.holders:
        stop = schedule.after(rep.holders[s.id])
    else:
        stop = schedule.replay_position[rep.ops[bisect_right(rep.ops, program) - 1]]
    return (born, max(stop, born), s.nbytes)


def live_bytes(
    graph: Graph, order: Sequence[tuple[str, int]], lives: Iterable[Life], base_bytes: int
) -> list[int]:
    """Live bytes while each position of `order` runs: `base_bytes`, every life that spans the
    position, and the scratch of the op's kernel on the graph's target (`targets.scratch_bytes`)."""
    total = len(order)
    delta = [0] * (total + 2)
    for first, last, nbytes in lives:
        delta[first] += nbytes
        delta[min(last, total) + 1] -= nbytes
    timeline, current = [], base_bytes
    scratch = ops_scratch_bytes(graph)
    for position, (_, i) in enumerate(order):
        current += delta[position]
        timeline.append(current + scratch[i])
    return timeline


# -- the judge ------------------------------------------------------------------------------------
def simulate(
    graph: Graph,
    regions: Sequence[Region] = (),
    base_bytes: int | None = None,
    offload: Offload | None = None,
) -> Simulation:
    """The live-bytes timeline of one step with `regions` checkpointed (none: store-all, which is
    what `remat.estimate` reports) and `offload`'s saves on the host. `base_bytes` defaults to the
    storages that exist before the step; pass it to add optimizer state. Host memory is not in
    the timeline (it is not the device's)."""
    if base_bytes is None:
        base_bytes = sum(s.nbytes for s in graph.storages.values() if s.allocated_at is None)
    # The timeline is `base_bytes` plus what the regions make of the step: one simulation per
    # graph and regions serves every base (planners of other optimizers on the same graph).
    if offload is not None:  # not kept: each offload is asked once
        found = _simulate(graph, tuple(regions), offload)
    else:
        # kept while the ops' scratch is (`ops_scratch_bytes`: the same list until what it is
        # read from changes)
        kept: OrderedDict[tuple[Region, ...], Simulation] = graph.derived(
            "simulations", OrderedDict, ops_scratch_bytes(graph)
        )
        key = tuple(regions)
        found = kept.get(key)
        if found is None:
            found = kept[key] = _simulate(graph, key, None)
            if len(kept) > SIMULATIONS_KEPT:
                kept.popitem(last=False)
        else:
            kept.move_to_end(key)
    if not base_bytes:
        return found
    return replace(
        found,
        peak_bytes=found.peak_bytes + base_bytes,
        timeline=tuple(t + base_bytes for t in found.timeline),
    )


def _forward_made(graph: Graph) -> dict[int, int]:
    """Storage id -> bytes, of the storages a forward op allocated: worked out once per graph
    (`Graph.derived`), where each simulation of a plan asked every storage's op again."""
    return graph.derived(
        "forward_made",
        lambda: {
            s.id: s.nbytes
            for s in graph.storages.values()
            if s.allocated_at is not None and graph.ops[s.allocated_at].phase == "forward"
        },
        graph.storages,
        graph.ops,
    )


#: simulations kept per graph for `simulate` (a 70B step's timeline is 10^5 positions)
SIMULATIONS_KEPT = 64


def step_lives(
    graph: Graph, regions: Sequence[Region]
) -> tuple[RegionAnalysis, Schedule, dict[int, int], list[Life], list[int | None]]:
    """The analysis, schedule and `storage_lives` of the step with `regions` checkpointed (no
    offload), kept for the last regions asked per graph (`Graph.derived`): the simulation of a plan
    and its allocator walk (`remat.prediction.gpu_memory`) read the same. Read-only."""
    lives: OrderedDict[tuple[Region, ...], tuple] = graph.derived(
        "lives", OrderedDict, graph.ops, graph.storages
    )
    key = tuple(regions)
    found = lives.get(key)
    if found is None:
        analysis = analyse_regions(graph, key)
        schedule = build_schedule(graph, analysis)
        found = lives[key] = (analysis, schedule, *storage_lives(graph, analysis, schedule))
        if len(lives) > LIVES_KEPT:
            lives.popitem(last=False)
    else:
        lives.move_to_end(key)
    return found


#: `step_lives` kept per graph: a plan is simulated, then walked by the allocator (a 70B step's
#: lives are megabytes, and `fit` keeps the graph of every size it probes)
LIVES_KEPT = 2


def _simulate(graph: Graph, regions: tuple[Region, ...], offload: Offload | None) -> Simulation:
    """`simulate` from no bytes before the step."""
    base_bytes = 0
    if offload is None:
        analysis, schedule, deaths, lives, _ = step_lives(graph, regions)
    else:
        analysis = analyse_regions(graph, regions, offload)
        schedule = build_schedule(graph, analysis)
        deaths, lives, _ = storage_lives(graph, analysis, schedule)
    timeline = live_bytes(graph, schedule.order, lives, base_bytes)
    end_of_forward = schedule.position_of_op[len(graph.forward_ops) - 1]
    made = _forward_made(graph)
    held_bytes = sum(rep.overhead_bytes for rep in analysis.replays) + sum(
        made[sid] for sid, death in deaths.items() if death > end_of_forward and sid in made
    )
    peak_position = max(range(len(timeline)), key=timeline.__getitem__)
    return Simulation(
        peak_bytes=timeline[peak_position],
        peak_position=peak_position,
        held_bytes=held_bytes,
        recompute_ops=recompute_ops(analysis.replays),
        timeline=tuple(timeline),
        schedule=schedule.order,
        deaths=deaths,
    )
