"""The per-block models' numbers: one block option applied to every block, read off one exact
simulation (`BlockMetrics`), with each byte kept through the forward charged to one block.

Which block a kept storage is charged to is what makes a mix of options add up. The chain model
(`remat.planning.solvers.chain`) charges it to the block that made it (a block's output is its
"kept" under full checkpointing, the next block's input). The MILP's options can change whether a
storage is kept at all (offload moves it to host memory), so it charges each storage to the block
whose option decides that (`deciding_blocks`): the block whose forward first saves it, which for a
block's input is that block, not the one before (checkpoint keeps it as the region's input,
offload copies it out in that block's forward). Charged to its maker, a mix where block b+1
offloads block b's output counted those bytes as kept, and the embeddings' output (made before
any block) stayed in the forward's constant even when block 0 offloads it: on GPT-2 tiny at 4 x
512 the MILP called 0.95 x full checkpointing's peak infeasible while a plan at 0.93 x existed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from remat.graph import Graph, ModuleCall
from remat.prediction.schedule import Region, Simulation


@dataclass(frozen=True)
class BlockMetrics:
    """One block option applied to every block, measured by one exact simulation: the bytes each
    block keeps through the forward (`kept`), the bytes live during its backward above what
    earlier blocks keep (`backward`), its recompute seconds, and two plan-wide terms: `pre`, the
    most live above all kept bytes before the first block's backward (the forward, the head's
    backward), and `post`, the most live after the blocks' backward (gradient accumulation of
    embeddings), when no activation is left."""

    kept: tuple[int, ...]
    backward: tuple[int, ...]
    seconds: tuple[float, ...]
    pre: int
    post: int


def block_of_ops(blocks: Sequence[ModuleCall]) -> dict[int, int]:
    """Forward op index -> the index of the block it runs in."""
    return {i: b for b, call in enumerate(blocks) for i in range(call.first_op, call.last_op + 1)}


def maker_blocks(graph: Graph, blocks: Sequence[ModuleCall]) -> dict[int, int]:
    """Storage -> the block that allocated it (the chain model's charge)."""
    of_op = block_of_ops(blocks)
    return {s.id: of_op[s.allocated_at] for s in graph.storages.values() if s.allocated_at in of_op}


def deciding_blocks(graph: Graph, blocks: Sequence[ModuleCall]) -> dict[int, int]:
    """Storage -> the block whose option decides whether it is kept through the forward: the
    block of the first forward op in a block that saves it, else that reads it, else the block
    that allocated it. A storage no block touches (the head's) is charged to none."""
    of_op = block_of_ops(blocks)
    out: dict[int, int] = {}
    for sv in graph.saved:
        node = graph.nodes.get(sv.node) if sv.node is not None else None
        op = sv.forward_op if node is None else node.forward_op
        if sv.phase == "forward" and op in of_op:
            out[sv.storage] = min(out.get(sv.storage, of_op[op]), of_op[op])
    readers: dict[int, int] = {}
    for op in graph.forward_ops:
        if op.index in of_op:
            for t in op.inputs:
                readers.setdefault(graph.tensors[t].storage, of_op[op.index])
    makers = maker_blocks(graph, blocks)
    for sid in graph.storages:
        if sid not in out:
            b = readers.get(sid, makers.get(sid))
            if b is not None:
                out[sid] = b
    return out


def measure(
    graph: Graph,
    blocks: Sequence[ModuleCall],
    sim: Simulation,
    timeline: Sequence[int],
    charge: Mapping[int, int],
    seconds: Sequence[float],
) -> BlockMetrics:
    """The `BlockMetrics` of one simulation whose live bytes above the base are `timeline`, each
    kept storage charged to block `charge[storage]`; `seconds` per block as given."""
    n = len(blocks)
    of_op = block_of_ops(blocks)
    end_of_forward = sim.schedule.index(("op", len(graph.forward_ops) - 1))
    kept = [0] * n
    for sid, death in sim.deaths.items():
        if sid in charge and death > end_of_forward:
            kept[charge[sid]] += graph.storages[sid].nbytes
    first_pos: list[int | None] = [None] * n
    last_pos: list[int | None] = [None] * n
    for pos, (kind, i) in enumerate(sim.schedule):
        if kind == "replay":
            b = of_op[i]
        elif pos > end_of_forward and graph.ops[i].node is not None:
            b = of_op.get(graph.nodes[graph.ops[i].node].forward_op)
        else:
            continue
        if b is not None:
            first_pos[b] = pos if first_pos[b] is None else first_pos[b]
            last_pos[b] = pos
    # Backward visits blocks n-1 .. 0: block b owns the positions from its first one to just
    # before block b-1's first one; block 0 owns up to its last one.
    starts = [p if p is not None else len(sim.schedule) for p in first_pos]
    stops = [
        starts[b - 1] if b else (last_pos[0] if last_pos[0] is not None else starts[0]) + 1
        for b in range(n)
    ]
    prefix = [0] * (n + 1)
    for b in range(n):
        prefix[b + 1] = prefix[b] + kept[b]
    return BlockMetrics(
        kept=tuple(kept),
        backward=tuple(
            max(timeline[starts[b] : stops[b]], default=0) - prefix[b] for b in range(n)
        ),
        seconds=tuple(seconds),
        pre=max(timeline[: min(starts)], default=0) - prefix[n],
        post=max(timeline[stops[0] :], default=0),
    )


def block_seconds(
    blocks: Sequence[ModuleCall],
    sim: Simulation,
    regions: Sequence[Region],
    op_seconds: Sequence[float],
    overheads: Sequence[float],
) -> list[float]:
    """Each block's recompute seconds in `sim`, with its region's checkpoint overhead."""
    of_op = block_of_ops(blocks)
    seconds = [0.0] * len(blocks)
    for i in sim.recompute_ops:
        seconds[of_op[i]] += op_seconds[i]
    for region, overhead in zip(regions, overheads, strict=True):
        seconds[of_op[region.first_op]] += overhead
    return seconds
