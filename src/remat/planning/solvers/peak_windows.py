"""Caps on the bytes held for backward, window by window of the backward: what lets the budgeted
save set (solvers/saveset.py) hold bytes where the step has room for them.

One cap on all the bytes held for backward is a poor stand-in for a cap on the peak. A value a
late layer saves dies early in backward, when few gradients exist yet; one an early layer saves
lives to the end of backward, beside every parameter's gradient. At full checkpointing's peak on a
12-layer GPT-2 (parameter gradients 373 MiB, the budget 393.5 MiB above the parameters) the last
layers may keep most of what they make and the first almost nothing, which no single cap says: the
ladder of single caps held 269 MiB where the step had room for far more, and recomputed 507 ops.

Here each window of the backward (between two moments some held storage dies) gets its own row:
the storages still alive in it, at most the budget less what the step holds there besides them:
the persistent storages, the gradients made by then (`gradients_made`), and one offset for the
rest (the loss, the values being recomputed, kernels' buffers), which the caller searches against
its own peak model (inductor's fuses what an op-by-op count holds). A storage's last backward
reader is read from the graph (`backward_ends`). Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Sequence

from remat.graph import PERSISTENT_KINDS, Graph
from remat.planning.solvers.mincut import JointProblem

#: At most this many window rows in one program (adjacent windows merge, conservatively).
MAX_WINDOWS = 48

#: One row: the storages it caps (their bytes summed) and the cap.
Window = tuple[tuple[int, ...], float]


def backward_ends(graph: Graph, problem: JointProblem) -> dict[int, int]:
    """Storage -> the position (in `graph.backward_ops`) of the last backward op that may read a
    value on it, were it saved: its last direct reader, or, for a value only a recomputation reads,
    the moment its latest forward reader is first wanted in backward (a recomputed op runs just
    before its first reader). Storages backward never reaches are left out."""
    tensors = graph.tensors
    position = {op.index: k for k, op in enumerate(graph.backward_ops)}
    first_read: dict[int, int] = {}
    last_read: dict[int, int] = {}
    for op in graph.backward_ops:
        k = position[op.index]
        for t in op.inputs:
            first_read.setdefault(t, k)
            sid = tensors[t].storage
            last_read[sid] = max(last_read.get(sid, -1), k)
    readers: dict[int, list[int]] = {}
    for op in graph.forward_ops:
        for t in op.inputs:
            readers.setdefault(t, []).append(op.index)
    never = len(graph.backward_ops)
    first_need: dict[int, int] = {}
    for op in reversed(graph.forward_ops):
        need = never
        for t in op.outputs:
            need = min(need, first_read.get(t, never))
            for d in readers.get(t, ()):
                need = min(need, first_need.get(d, never))
        first_need[op.index] = need
    ends = dict(last_read)
    for v in problem.values:
        if graph.storages[v.storage].kind in PERSISTENT_KINDS:
            continue
        tid_readers = [
            first_need[d]
            for t in _tensors_of_value(graph, v.storage, v.made_at)
            for d in readers.get(t, ())
            if first_need.get(d, never) < never
        ]
        if tid_readers:
            ends[v.storage] = max(ends.get(v.storage, -1), max(tid_readers))
    return ends


def _tensors_of_value(graph: Graph, storage: int, made_at: int) -> list[int]:
    return [t for t in graph.ops[made_at].outputs if graph.tensors[t].storage == storage]


def gradients_made(graph: Graph) -> list[int]:
    """Per backward op (position in `graph.backward_ops`), the bytes of the step's gradients
    (the backward's outputs) made by then: they live to the end of the step."""
    outputs = {graph.tensors[t].storage for t in graph.info.get("backward_outputs", ())}
    out, total, seen = [], 0, set()
    for op in graph.backward_ops:
        for t in op.outputs:
            sid = graph.tensors[t].storage
            if sid in outputs and sid not in seen:
                seen.add(sid)
                total += graph.storages[sid].nbytes
        out.append(total)
    return out


def held_alive(graph: Graph, ends: dict[int, int], held: set[int]) -> list[int]:
    """Per backward op, the bytes of the storages `held` for backward still alive by `ends`."""
    out = [0] * (len(graph.backward_ops) + 1)
    for m in held:
        if m in ends and graph.storages[m].kind not in PERSISTENT_KINDS:
            out[0] += graph.storages[m].nbytes
            out[ends[m] + 1] -= graph.storages[m].nbytes
    for k in range(1, len(out)):
        out[k] += out[k - 1]
    return out[:-1]


def windows(
    graph: Graph,
    ends: dict[int, int],
    other: Sequence[int],
    budget_bytes: int,
    storages: Sequence[int],
) -> list[Window]:
    """Rows capping, between consecutive deaths of `storages` (by `ends`), the bytes of those
    still alive at `budget_bytes` less the most `other` holds there. Merged down to
    `MAX_WINDOWS` rows, each merged row keeping its first window's storages (the most) and its
    lowest cap: never looser than the rows it replaces."""
    alive = [m for m in storages if m in ends and graph.storages[m].kind not in PERSISTENT_KINDS]
    cuts = sorted({ends[m] for m in alive})
    rows: list[Window] = []
    start = 0
    for cut in cuts:  # window [start, cut]: storages with end >= start are alive throughout
        if cut < start:
            continue
        members = tuple(m for m in alive if ends[m] >= start)
        room = budget_bytes - max(other[start : cut + 1], default=0)
        rows.append((members, float(room)))
        start = cut + 1
    if len(rows) <= MAX_WINDOWS:
        return rows
    step = -(-len(rows) // MAX_WINDOWS)
    return [
        (rows[i][0], min(cap for _, cap in rows[i : i + step])) for i in range(0, len(rows), step)
    ]
