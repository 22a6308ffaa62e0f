"""Offload as a plan's third choice beside keep and recompute: which saves of a step go to host
memory, what they cost in copy time not hidden behind compute, and how much host memory they take.

The rule here is the one `remat.applying.offload`'s hooks follow at run time, so that the
prediction and the run agree save for save: every save made while an offloaded block's forward
runs (a node whose forward op lies in the block's op range), outside every checkpoint region, of
a storage allocated in the step (not a parameter, buffer or input) of at least `min_bytes`.

Copy windows (docs/offload.md): block b's device-to-host copies start as its forward ends and
hide behind the forward of the blocks after it; its host-to-device copies are prefetched while
block b+1 runs its backward, and hide behind it. On a GPU the bytes in flight are on the device:
block b's saves stay until the forward of block b+1 has ended (`device_until`), and are back from
the start of block b+1's backward (`reload_from`). Where the copy takes longer than the compute
it hides behind, the difference is step time (`OffloadCost.exposed_seconds`). Without a link (the
CPU profile: copies run synchronously in the hooks) the windows are the hooks' own: gone when the
forward drops them, back at their node's first backward op.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from remat.device import gpus
from remat.device.host_link import MIN_OFFLOAD_BYTES, HostLink, host_link, transfer_seconds
from remat.graph import Graph, ModuleCall
from remat.planning.solvers.selective import POLICIES
from remat.prediction.schedule import Offload, Region, analyse_regions

#: The MILP's offload options, each over the checkpoint option it runs with: a stored block whose
#: saves go to host, a checkpointed block whose region's inputs do, and a selectively
#: checkpointed one whose region's inputs and kept ops' outputs (the policy's cache) do.
OPTIONS = {
    "offload": "store",
    "full+offload": "full",
    **{f"selective:{p}+offload": f"selective:{p}" for p in POLICIES},
}


@dataclass(frozen=True)
class OffloadSettings:
    """What offload may do: the smallest storage worth a copy, the pinned host memory a rank may
    take (None: no cap), the link its copies take (None: a CPU step, copies synchronous) and how
    many ranks share that link (None: as many as it serves)."""

    min_bytes: int = MIN_OFFLOAD_BYTES
    host_budget_bytes: int | None = None
    link: HostLink | None = None
    ranks_on_link: int | None = None

    @property
    def link_name(self) -> str:
        return self.link.name if self.link else "none (synchronous copies on the CPU)"

    @classmethod
    def for_profile(
        cls,
        profile: object,
        host_memory_bytes: int | None = None,
        min_bytes: int = MIN_OFFLOAD_BYTES,
        ranks_on_link: int | None = None,
    ) -> OffloadSettings:
        """The settings of the GPU whose cost profile is `profile` (its name or a
        `DeviceProfile`): its link, and by default as much host memory as the GPU has
        (`remat.device.host_link.HOST_MEMORY_SOURCE`). The CPU profile has no link and no cap."""
        name = getattr(profile, "name", profile)
        gpu = next((g for g in gpus.GPUS.values() if g.profile == name or g.name == name), None)
        if name == "cpu" or gpu is None and not isinstance(name, str):
            return cls(min_bytes, host_memory_bytes, None, ranks_on_link)
        link = host_link(gpu.name if gpu is not None else str(name))
        cap = host_memory_bytes
        if cap is None and gpu is not None:
            cap = gpu.capacity_bytes
        return cls(min_bytes, cap, link, ranks_on_link)


@dataclass(frozen=True)
class OffloadChoice:
    """A plan's offload: the saves and their windows, the blocks by path, the minimum size the
    hooks apply, and the copy seconds no compute hides."""

    offload: Offload
    blocks: tuple[str, ...]
    min_bytes: int
    exposed_seconds: float
    #: a stored block that offloads some of its storages: their places in its save order
    chosen: Mapping[str, tuple[int, ...]] = field(default_factory=dict)


def offloaded_saves(
    graph: Graph,
    regions: Sequence[Region],
    blocks: Sequence[ModuleCall],
    min_bytes: int,
    chosen: Mapping[str, Collection[int]] | None = None,
) -> frozenset[int]:
    """The indices into `graph.saved` that the hooks move to host memory for `blocks`; for a
    block in `chosen`, only the saves of its storages whose place in the order they are first
    saved in its forward (`block_storages`) is listed there."""
    spans = [(b.first_op, b.last_op, b.path) for b in blocks]
    in_region = set()
    for r in regions:
        in_region.update(range(r.first_op, r.last_op + 1))
    out = set()
    order: dict[str, dict[int, int]] = {}  # block -> storage -> its place in the block
    for pack, sv in enumerate(graph.saved):
        storage = graph.storages[sv.storage]
        if sv.phase != "forward" or storage.allocated_at is None or storage.nbytes < min_bytes:
            continue
        op = _save_op(graph, pack)
        if op is None or op in in_region:
            continue
        path = next((p for first, last, p in spans if first <= op <= last), None)
        if path is None:
            continue
        places = order.setdefault(path, {})
        place = places.setdefault(sv.storage, len(places))
        if chosen is None or path not in chosen or place in chosen[path]:
            out.add(pack)
    return frozenset(out)


def block_storages(graph: Graph, block: ModuleCall, min_bytes: int) -> list[int]:
    """A stored block's offloadable storages in the order its forward first saves them: the
    order in which the hooks number them (`remat.applying.offload.Offloader`)."""
    out: dict[int, None] = {}
    for pack in sorted(offloaded_saves(graph, (), [block], min_bytes)):
        out.setdefault(graph.saved[pack].storage)
    return list(out)


def prefix_lengths(sizes: Sequence[int], most: int = 8) -> list[int]:
    """How many of a block's offloadable storages (in save order) each partial offload option
    takes: every prefix short of all of them where those are at most `most`, else the shortest
    prefix to reach each of `most` evenly spaced shares of their bytes (fewer where one prefix
    passes several), so that a block has a bounded number of options whatever its saves."""
    if len(sizes) <= most + 1:
        return list(range(1, len(sizes)))
    total, running, out = sum(sizes), 0, []
    shares = iter(total * (j + 1) / (most + 1) for j in range(most))
    share = next(shares)
    for k, size in enumerate(sizes[:-1], start=1):
        running += size
        if running >= share:
            out.append(k)
            share = next((x for x in shares if x > running), math.inf)
    return out


def offloaded_frames(
    graph: Graph, regions: Sequence[Region], blocks: Sequence[ModuleCall], min_bytes: int
) -> dict[int, frozenset[int]]:
    """Region index -> the frame inputs the hooks move to host for the regions that start at one
    of `blocks` (checkpoint saves its inputs through the hooks around the region)."""
    paths = {b.path for b in blocks}
    calls = {(m.path, m.first_op): m for m in graph.modules}
    out = {}
    for r, rep in enumerate(analyse_regions(graph, regions).replays):
        call = calls.get((rep.region.modules[0], rep.region.first_op))
        if rep.region.modules[0] not in paths or call is None:
            continue
        # checkpoint saves its positional tensor arguments; it keeps keyword and nested ones in
        # the closure it replays (torch.utils.checkpoint: `_CheckpointFrame.save_inputs(*args)`)
        positional = {
            graph.tensors[t].storage
            for t, how in zip(call.inputs, call.arguments, strict=False)
            if how.isdigit()
        }
        out[r] = frozenset(
            sid
            for sid in rep.frame_inputs
            if sid in positional
            and graph.storages[sid].allocated_at is not None
            and graph.storages[sid].nbytes >= min_bytes
        )
    return out


def offloaded_kept(
    graph: Graph, regions: Sequence[Region], blocks: Sequence[ModuleCall], min_bytes: int
) -> dict[int, frozenset[int]]:
    """Region index -> the outputs of its kept ops whose selective-checkpoint cache entry the
    hooks move to host, for the regions that start at one of `blocks`: storages a kept op made
    itself (not a view's), allocated in the step, of at least `min_bytes`
    (`remat.applying.offload.OffloadingCache` applies the same rule at run time)."""
    paths = {b.path for b in blocks}
    out = {}
    for r, region in enumerate(regions):
        if region.modules[0] not in paths or not region.keep:
            continue
        storages = set()
        for name in region.keep:
            op = graph.op_by_name[name]
            for t in op.outputs:
                storage = graph.storages[graph.tensors[t].storage]
                if storage.allocated_at == op.index and storage.nbytes >= min_bytes:
                    storages.add(storage.id)
        if storages:
            out[r] = frozenset(storages)
    return out


def block_offload(
    graph: Graph,
    regions: Sequence[Region],
    blocks: Sequence[ModuleCall],
    min_bytes: int,
    in_flight: bool,
    all_blocks: Sequence[ModuleCall] = (),
    chosen: Mapping[str, Collection[int]] | None = None,
) -> Offload:
    """The `Offload` of `blocks`: the saves of those not checkpointed, the frame inputs of the
    regions that start at one; synchronous windows, or with `in_flight` the GPU's (a block's
    saves on the device until the next block of `all_blocks` ends its forward, a region's inputs
    until its own forward ends; both back from the next block's first backward op). `chosen`:
    as `offloaded_saves` takes it. A block the forward calls more than once is left out: apply
    offloads by module path, every call of it alike."""
    blocks = [b for b in blocks if b.path not in graph.repeated_paths]
    saves = offloaded_saves(graph, regions, blocks, min_bytes, chosen)
    frames = offloaded_frames(graph, regions, blocks, min_bytes)
    kept = offloaded_kept(graph, regions, blocks, min_bytes)
    if not in_flight:
        return Offload(saves, frames=frames, kept=kept)
    following = {a.path: b for a, b in zip(all_blocks, all_blocks[1:], strict=False)}
    first_backward: dict[int, int] = {}
    for op in graph.backward_ops:
        if op.node is not None:
            forward_op = graph.nodes[op.node].forward_op
            if forward_op is not None:
                first_backward.setdefault(forward_op, op.index)
    region_at = {r.modules[0]: k for k, r in enumerate(regions)}
    device_until: dict[int, int] = {}
    reload_from: dict[int, int] = {}
    for block in blocks:
        nxt = following.get(block.path)
        if nxt is None:
            continue
        span = range(nxt.first_op, nxt.last_op + 1)
        start = min((first_backward[i] for i in span if i in first_backward), default=None)
        if block.path in region_at:
            r = region_at[block.path]
            storages = frames.get(r, frozenset()) | kept.get(r, frozenset())
            until = block.last_op
        else:
            storages = {
                graph.saved[p].storage
                for p in saves
                if _save_op(graph, p) in range(block.first_op, block.last_op + 1)
            }
            until = nxt.last_op
        for sid in storages:
            device_until[sid] = max(device_until.get(sid, -1), until)
            if start is not None:
                reload_from[sid] = min(reload_from.get(sid, start), start)
    return Offload(saves, device_until, reload_from, frames, kept)


def _save_op(graph: Graph, pack: int) -> int | None:
    sv = graph.saved[pack]
    node = graph.nodes.get(sv.node) if sv.node is not None else None
    return sv.forward_op if node is None else node.forward_op


@dataclass(frozen=True)
class OffloadCost:
    """What offloading one block costs: host bytes, the copy seconds each way, and the part of
    them no compute hides (`exposed_seconds`, step time)."""

    host_bytes: int
    device_to_host_seconds: float
    host_to_device_seconds: float
    exposed_seconds: float


def copy_cost(
    host_bytes: int,
    link: HostLink | None,
    forward_window_seconds: float,
    backward_window_seconds: float,
    ranks_on_link: int | None = None,
) -> OffloadCost:
    """The cost of copying `host_bytes` out behind `forward_window_seconds` of forward compute and
    back behind `backward_window_seconds` of backward compute. Without a link (a CPU step) the
    copies are synchronous memcpys: all exposed, at the host's ~10 GB/s (see docs/offload.md)."""
    if link is None:
        seconds = transfer_seconds(host_bytes, CPU_COPY_BYTES_PER_S)
        return OffloadCost(host_bytes, seconds, seconds, 2 * seconds)
    h2d, d2h = link.per_rank(ranks_on_link)
    out, back = transfer_seconds(host_bytes, d2h), transfer_seconds(host_bytes, h2d)
    exposed = max(0.0, out - forward_window_seconds) + max(0.0, back - backward_window_seconds)
    return OffloadCost(host_bytes, out, back, exposed)


#: A memcpy between two host buffers: about 10 GB/s on one core of a server CPU (STREAM copy).
CPU_COPY_BYTES_PER_S = 10e9


def block_windows(
    graph: Graph, blocks: Sequence[ModuleCall], op_seconds: Sequence[float]
) -> tuple[list[float], list[float]]:
    """Each block's forward and backward compute seconds: the windows its copies hide behind."""
    forward = [sum(op_seconds[b.first_op : b.last_op + 1]) for b in blocks]
    backward = [0.0] * len(blocks)
    block_of_op = {i: k for k, b in enumerate(blocks) for i in range(b.first_op, b.last_op + 1)}
    for op in graph.backward_ops:
        node = graph.nodes.get(op.node) if op.node is not None else None
        k = block_of_op.get(node.forward_op) if node is not None else None
        if k is not None:
            backward[k] += op_seconds[op.index]
    return forward, backward


def block_cost(
    host_bytes: int,
    k: int,
    checkpointed: bool,
    windows: tuple[list[float], list[float]],
    settings: OffloadSettings,
) -> OffloadCost:
    """Block k's copies of `host_bytes`: out behind the next block's forward (a stored block's
    saves) or its own (a checkpointed block's region inputs and kept outputs), back behind the
    next block's backward."""
    forward, backward = windows
    after = (forward[k + 1], backward[k + 1]) if k + 1 < len(forward) else (0.0, 0.0)
    out_window = forward[k] if checkpointed else after[0]
    return copy_cost(host_bytes, settings.link, out_window, after[1], settings.ranks_on_link)


def block_costs(
    graph: Graph,
    blocks: Sequence[ModuleCall],
    op_seconds: Sequence[float],
    settings: OffloadSettings | None,
    regions_of: Mapping[str, Sequence[Region]],
) -> dict[str, list[OffloadCost]]:
    """Per block and offload option (`OPTIONS`), what its copies cost: `offload`, the block stored
    with its saves on the host; `full+offload` and `selective:<policy>+offload`, the block
    checkpointed (`regions_of[option]`: one region per block) with its region's inputs, and a
    selective region's kept outputs, on the host. Host bytes count each storage once per block."""
    settings = settings or OffloadSettings()
    windows = block_windows(graph, blocks, op_seconds)
    out: dict[str, list[OffloadCost]] = {}
    for option, base in OPTIONS.items():
        if base == "store":
            per_block = [
                {
                    graph.saved[i].storage
                    for i in offloaded_saves(graph, (), [b], settings.min_bytes)
                }
                for b in blocks
            ]
        else:
            regions = regions_of[base]
            frames = offloaded_frames(graph, regions, blocks, settings.min_bytes)
            kept = offloaded_kept(graph, regions, blocks, settings.min_bytes)
            per_block = [
                frames.get(k, frozenset()) | kept.get(k, frozenset()) for k in range(len(blocks))
            ]
        out[option] = [
            block_cost(
                sum(graph.storages[sid].nbytes for sid in storages),
                k,
                base != "store",
                windows,
                settings,
            )
            for k, storages in enumerate(per_block)
        ]
    return out


# -- what the planner (`remat.planning.planner.Planner`, passed as `planner`) asks of offload ----
def settings_for(profile: Any, offload: OffloadSettings | bool | None) -> OffloadSettings | None:
    """`offload=` as the API takes it: True means the settings of `profile`'s GPU."""
    if offload is True:
        return OffloadSettings.for_profile(profile)
    return offload or None


def costs_of(planner: Any) -> dict[str, list[OffloadCost]]:
    """`block_costs` on the planner's blocks, each checkpointed option's regions one per block."""
    regions_of = {base: planner.every_block(base) for base in set(OPTIONS.values()) - {"store"}}
    return block_costs(
        planner.graph, planner.blocks, planner.op_seconds, planner.offload, regions_of
    )


def settings_of(planner: Any) -> OffloadSettings:
    return planner.offload or OffloadSettings()


def choose(
    planner: Any,
    regions: Sequence[Region],
    indices: Iterable[int],
    in_flight: bool = True,
    chosen: Mapping[str, Collection[int]] | None = None,
) -> OffloadChoice:
    """The plan's offload of these block indices, with the link's windows (`in_flight=False`:
    synchronous ones, as the MILP's per-block metrics take them, its `prefetch_bytes` adding
    the bytes in flight) and exposed seconds. `chosen`: a stored block's storages by their place
    in its save order (`offloaded_saves`), for those that offload only some."""
    settings = settings_of(planner)
    indices = tuple(indices)
    chosen = {path: tuple(sorted(places)) for path, places in (chosen or {}).items()}
    offload = block_offload(
        planner.graph,
        regions,
        [planner.blocks[b] for b in indices],
        settings.min_bytes,
        in_flight=in_flight and settings.link is not None,
        all_blocks=planner.blocks,
        chosen=chosen,
    )
    region_at = {r.modules[0]: k for k, r in enumerate(regions)}
    windows = block_windows(planner.graph, planner.blocks, planner.op_seconds)
    exposed = 0.0
    for b in indices:
        block = planner.blocks[b]
        r = region_at.get(block.path)
        if r is None:
            span = range(block.first_op, block.last_op + 1)
            storages = {
                planner.graph.saved[p].storage
                for p in offload.saves
                if _save_op(planner.graph, p) in span
            }
        else:
            storages = offload.frames.get(r, frozenset()) | offload.kept.get(r, frozenset())
        host = sum(planner.graph.storages[sid].nbytes for sid in storages)
        exposed += block_cost(host, b, r is not None, windows, settings).exposed_seconds
    return OffloadChoice(
        offload,
        tuple(planner.blocks[b].path for b in indices),
        settings.min_bytes,
        exposed,
        chosen,
    )


def block_option(planner: Any, option: str, b: int, metrics: Any) -> Any:
    """Block b's offload option of the MILP (`remat.planning.solvers.milp.BlockOption`): what it
    keeps on the device, its backward as stored, its host bytes, the bytes prefetched during the
    next block's backward where a link copies ahead, and the copy seconds no compute hides."""
    from remat.planning.solvers import milp

    cost = planner.offload_costs[option][b]
    in_flight = settings_of(planner).link is not None
    return milp.BlockOption(
        name=option,
        kept_bytes=metrics.kept[b],
        backward_bytes=max(metrics.backward[b], metrics.kept[b]),
        recompute_seconds=metrics.seconds[b] + cost.exposed_seconds,
        host_bytes=cost.host_bytes,
        prefetch_bytes=cost.host_bytes if in_flight else 0,
    )


#: A stored block offloading the first k of its storages in save order (`prefix_lengths`)
PARTIAL = "offload:"


def partial_options(planner: Any, b: int, store: Any, charge: Mapping[int, int]) -> list[Any]:
    """Block b stored with only the first k of its offloadable storages on the host, for each k
    of `prefix_lengths`: per tensor offload, in the order the block saves them (the earliest
    have the most of the forward after them to hide their copy behind, and are needed last in
    backward). Derived from the stored block's metrics `store` (no simulation of their own): it
    keeps less by the bytes of those storages charged to it (`charge`, storage -> block), and
    its backward is taken as stored, the most it can be (they come back before it ends)."""
    from remat.planning.solvers import milp

    settings = settings_of(planner)
    graph = planner.graph
    storages = block_storages(graph, planner.blocks[b], settings.min_bytes)
    sizes = [graph.storages[sid].nbytes for sid in storages]
    windows = block_windows(graph, planner.blocks, planner.op_seconds)
    out = []
    for k in prefix_lengths(sizes):
        host = sum(sizes[:k])
        freed = sum(
            size for sid, size in zip(storages[:k], sizes, strict=False) if charge.get(sid) == b
        )
        kept = max(store.kept[b] - freed, 0)
        cost = block_cost(host, b, False, windows, settings)
        out.append(
            milp.BlockOption(
                name=f"{PARTIAL}{k}",
                kept_bytes=kept,
                backward_bytes=max(store.backward[b], kept),
                recompute_seconds=store.seconds[b] + cost.exposed_seconds,
                host_bytes=host,
                prefetch_bytes=host if settings.link is not None else 0,
            )
        )
    return out


def plan_offload(planner: Any, plan: Any) -> Offload | None:
    """The `Offload` a plan (`remat.planning.plans.Plan`) made on `planner`'s graph holds, for
    simulating it again (per rank, under FSDP); None when it offloads nothing."""
    if not plan.offload:
        return None
    named = set(plan.offload)
    indices = [b for b, call in enumerate(planner.blocks) if call.path in named]
    return choose(planner, plan.regions, indices, chosen=plan.offload_saves).offload
