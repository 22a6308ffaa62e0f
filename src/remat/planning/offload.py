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

from collections.abc import Sequence
from dataclasses import dataclass

from remat.device.host_link import HostLink, transfer_seconds
from remat.graph import Graph, ModuleCall
from remat.prediction.schedule import Offload, Region


def offloaded_saves(
    graph: Graph, regions: Sequence[Region], blocks: Sequence[ModuleCall], min_bytes: int
) -> frozenset[int]:
    """The indices into `graph.saved` that the hooks move to host memory for `blocks`."""
    spans = [(b.first_op, b.last_op) for b in blocks]
    in_region = set()
    for r in regions:
        in_region.update(range(r.first_op, r.last_op + 1))
    out = set()
    for pack, sv in enumerate(graph.saved):
        storage = graph.storages[sv.storage]
        if sv.phase != "forward" or storage.allocated_at is None or storage.nbytes < min_bytes:
            continue
        node = graph.nodes.get(sv.node) if sv.node is not None else None
        op = sv.forward_op if node is None else node.forward_op
        if op is None or op in in_region:
            continue
        if any(first <= op <= last for first, last in spans):
            out.add(pack)
    return frozenset(out)


def block_offload(
    graph: Graph,
    regions: Sequence[Region],
    blocks: Sequence[ModuleCall],
    min_bytes: int,
    in_flight: bool,
    all_blocks: Sequence[ModuleCall] = (),
) -> Offload:
    """The `Offload` of `blocks`: synchronous windows, or with `in_flight` the GPU's (each block's
    saves on the device until the next block of `all_blocks` ends its forward, and back from that
    block's first backward op)."""
    saves = offloaded_saves(graph, regions, blocks, min_bytes)
    if not in_flight:
        return Offload(saves)
    following = {a.path: b for a, b in zip(all_blocks, all_blocks[1:], strict=False)}
    first_backward: dict[int, int] = {}
    for op in graph.backward_ops:
        if op.node is not None:
            forward_op = graph.nodes[op.node].forward_op
            if forward_op is not None:
                first_backward.setdefault(forward_op, op.index)
    device_until: dict[int, int] = {}
    reload_from: dict[int, int] = {}
    for block in blocks:
        nxt = following.get(block.path)
        if nxt is None:
            continue
        starts = [
            first_backward[i] for i in range(nxt.first_op, nxt.last_op + 1) if i in first_backward
        ]
        for pack in saves:
            sv = graph.saved[pack]
            node = graph.nodes.get(sv.node) if sv.node is not None else None
            op = sv.forward_op if node is None else node.forward_op
            if op is not None and block.first_op <= op <= block.last_op:
                device_until[sv.storage] = max(device_until.get(sv.storage, -1), nxt.last_op)
                if starts:
                    reload_from[sv.storage] = min(reload_from.get(sv.storage, starts[0]), *starts)
    return Offload(saves, device_until, reload_from)


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
