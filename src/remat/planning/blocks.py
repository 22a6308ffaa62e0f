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

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from remat.graph import Graph, ModuleCall, Op
from remat.prediction.schedule import Region, Simulation, replay_stop


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


def replay_reach(graph: Graph, first_op: int, last_op: int) -> list[Op]:
    """The ops of a region over `first_op..last_op` that its replay reaches: up to its early stop,
    after the op that made the region's last save, whatever the region keeps. A selective policy's
    cache holds a kept op's output from the forward until the region's backward, and only the
    replay reads it: an op past the stop (a block's last Linear, whose output only the residual
    add reads; save-matmuls keeps it, as torch's op lists do) would hold its bytes and save no
    recompute, so no policy here keeps one."""
    stop = replay_stop(graph, first_op, last_op)
    return graph.ops[first_op : (first_op - 1 if stop is None else stop) + 1]


def ladder_sizes(dearest: Sequence[str], named: Iterable[Iterable[str]], most: int) -> list[int]:
    """The rungs of a block's keep ladder to offer (`Planner.block_options`): n for keeping the
    first n of `dearest` (its ops, dearest to recompute per byte first), from 1 to one less than
    all of them, less those that keep what a `named` policy keeps; `most` of them at most,
    spread evenly over the ladder."""
    taken = {frozenset(keep) for keep in named}
    sizes = [n for n in range(1, len(dearest)) if frozenset(dearest[:n]) not in taken]
    if len(sizes) > most:
        sizes = [sizes[round(k * (len(sizes) - 1) / (most - 1))] for k in range(most)]
    return sizes


#: How a block hands its output to the next: (where it sits in the first's output, the argument of
#: the second that takes it); `Region.carry_output` and `Region.carry_argument`.
Carry = tuple[tuple[int | str, ...], str]


def carry(a: ModuleCall, b: ModuleCall) -> Carry | str:
    """How call `b` takes call `a`'s output where one checkpoint region can run both, else why
    not (a sentence). The region calls `b` with `a`'s arguments but one, so: no op between them;
    `a` returned one tensor (anywhere in a tuple, dict or dataclass) and `b` took it as an
    argument of its own; `b` was called like `a` (`ModuleCall.repeats`: the same non-tensor
    values in and out); and every other tensor argument is the same tensor in the same place."""
    if a.last_op + 1 != b.first_op:
        return "ops run between them"
    if len(a.outputs) != 1 or a.output_path is None:
        return f"{a.path} returns {len(a.outputs)} tensors, not one the next block takes"
    if a.path not in b.repeats:
        return "they are called with different non-tensor arguments or return different things"
    if len(a.arguments) != len(a.inputs) or len(b.arguments) != len(b.inputs):
        return "the trace did not record how they were called"
    taken = [i for i, t in enumerate(b.inputs) if t == a.outputs[0] and b.arguments[i]]
    if len(taken) != 1 or b.arguments[taken[0]] not in a.arguments:
        return f"{b.path} does not take {a.path}'s output as one argument of its own"
    i = taken[0]
    name = b.arguments[i]
    j = a.arguments.index(name)
    if (
        a.inputs[:j] + a.inputs[j + 1 :] != b.inputs[:i] + b.inputs[i + 1 :]
        or a.arguments[:j] + a.arguments[j + 1 :] != b.arguments[:i] + b.arguments[i + 1 :]
    ):
        return f"{b.path} takes other tensors than {a.path} besides {name!r}"
    return a.output_path, name
