"""The graph of a model's full depth from a trace of a few of its repeated blocks, exactly.

A transformer's step is periodic in depth: each block (or each period of alternating blocks) runs
the same ops, saves the same tensors and frees them at the same points; only ids, op indices and
module paths move. `replicate` takes the graph traced with `Stack.traced_layers` layers of each
stack (`start` layers, then `UNITS` units of `period` layers) and lays out the graph the full
depth would have traced, numbered as the tracer would have numbered it:

- every record (op, tensor, storage, node, save, module call; the state registration included)
  belongs to a *segment*: a unit of a stack in a phase (its parameters, its buffers, its forward,
  its backward) or a fixed stretch outside the units. A record belongs to the op it names (a
  tensor's producer, a node's forward op, a save's saving op), else to the next op recorded: the
  tracer's ids increase with time, so each segment is one run of ids and one run of op indices;
- the full graph emits the segments in the traced order: units 0, 1 and the last two as the full
  depth's first two and last two, unit 2 once for every unit between, unit 3 dropped; ids and op
  indices are renumbered in that order, saves' handles included (the ids the graph leaves out);
- a reference from a unit to a unit of its stack keeps their distance (the previous block's
  output, the next block's gradient); further, it reaches a first or last unit as a reference
  from outside does (the gradient of a tensor every block reads, which autograd adds into in place
  from the last block's backward on), and an inner one is `NotPeriodic`; from elsewhere it
  reaches the first two or the last two units. Module paths (`layers.7.attn`) and op names
  (`layers.7.attn.mm_0`; call counts of scopes outside the blocks recounted) follow the same rule.

The units at the ends may differ from those between (the last block's backward does not add its
gradient of a tensor all blocks read to another's); those between must repeat. `replicate(...,
units=[UNITS] * len(stacks))` lays out the traced depth itself, unit 3 a copy of unit 2 beside
unit 2 and unit 4: every pair of neighbours the full depth has, so that where it equals the trace
(`remat.tracing.depth` checks), the full depth's layout holds too. Nothing here imports torch.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from remat.graph import Graph, ModuleCall, Node, Op, Saved, Storage, Tensor

#: traced units of each stack: the first two and the last two stand for themselves, the third
#: for every unit of the full depth between, the fourth is traced to check that the third repeats
UNITS = 6


class NotPeriodic(Exception):
    """The traced units do not repeat (or the trace is not one this replication can lay out);
    the message says where. The caller traces the full depth instead."""


@dataclass(frozen=True)
class Stack:
    """A list of blocks (`path`, e.g. "model.layers") traced at `traced_layers` and wanted at
    `layers`: `start` layers before the periodic part, then units of `period` layers. Blocks are
    named by index from `first` (a pipeline stage's `layers.20`, `layers.21`, ...)."""

    path: str
    layers: int
    start: int
    period: int
    first: int = 0

    @property
    def traced_layers(self) -> int:
        return self.start + UNITS * self.period

    @property
    def units(self) -> int:
        return (self.layers - self.start) // self.period

    def unit_of(self, layer: int) -> int | None:
        """The unit of the block named `layer`; None for the blocks before the period."""
        position = layer - self.first
        return None if position < self.start else (position - self.start) // self.period

    def layer(self, unit: int, offset: int) -> int:
        """The name (index) of the block `offset` into `unit`."""
        return self.first + self.start + unit * self.period + offset


Key = tuple  # ("fixed", run) or (stack index, unit, phase)


@dataclass
class _Axis:
    """One numbering of the graph (op indices, or ids) cut into runs of one segment each."""

    starts: list[int] = field(default_factory=list)
    keys: list[Key] = field(default_factory=list)
    new_start: dict[tuple[Key, int | None], int] = field(default_factory=dict)
    #: segment -> (full unit, new start) of each copy
    copies: dict[Key, list[tuple[int | None, int]]] = field(default_factory=dict)
    #: (segment, context) -> how far a reference into the segment moves (`_Layout.move`)
    shifts: dict[tuple[int, tuple | None], int] = field(default_factory=dict)
    #: position -> segment (`tabulate`)
    table: list[int] = field(default_factory=list)

    def add(self, position: int, key: Key) -> None:
        if self.keys and self.keys[-1] == key:
            return
        if key[0] != "fixed" and key in self.keys:
            raise NotPeriodic(f"unit {key[1]} of stack {key[0]} ({key[2]}) is not one stretch")
        self.starts.append(position)
        self.keys.append(key)

    def locate(self, position: int) -> tuple[Key, int]:
        i = self.segment(position)
        return self.keys[i], position - self.starts[i]

    def segment(self, position: int) -> int:
        if 0 <= position < len(self.table):
            return self.table[position]
        return bisect.bisect_right(self.starts, position) - 1

    def tabulate(self, end: int) -> None:
        """Each position's segment in a list (`segment` reads it): a replicated 70B step moves
        some 10^5 references, and a list index is cheaper than a bisection each."""
        self.table = [i for i in range(len(self.starts)) for _ in range(self.size(i, end))]

    def size(self, i: int, end: int) -> int:
        return (self.starts[i + 1] if i + 1 < len(self.starts) else end) - self.starts[i]


def _fixed(keys: list[Key], key: Key | None) -> Key:
    """The key of a stretch outside the units: a new run after a unit, the same one otherwise."""
    if key is not None:
        return key
    last = keys[-1] if keys else None
    if last is not None and last[0] == "fixed":
        return last
    return ("fixed", sum(1 for k in keys if k[0] == "fixed"))


def _slot(key: Key, unit: int | None) -> tuple:
    """Where a segment lands: a fixed stretch as itself, a unit's by its stack, phase and full
    unit, whichever traced unit it is copied from (the traced units are laid out alike)."""
    return (key, None) if key[0] == "fixed" else ((key[0], key[2]), unit)


def _anchor(kind: str, record: object) -> int | None:
    """The op a record belongs to where it names one: a storage's allocating op, a tensor's
    producer, a node's forward op, a forward save's saving op. A node is made when the next op
    begins, and belongs with the op it is the node of."""
    if kind == "storage":
        return record.allocated_at  # type: ignore[attr-defined]
    if kind == "tensor":
        return record.producer  # type: ignore[attr-defined]
    if kind == "node":
        return record.forward_op  # type: ignore[attr-defined]
    if record.phase == "forward":  # type: ignore[attr-defined]
        return record.forward_op  # type: ignore[attr-defined]
    return None


Mover = Callable[[int | None], int | None]


class _Shifts(dict):
    """Segment -> how far a reference into it moves, seen from one context (`_Layout.move`),
    worked out as asked."""

    def __init__(self, lay: _Layout, axis: _Axis, context: tuple | None) -> None:
        super().__init__()
        self.lay, self.axis, self.context = lay, axis, context

    def __missing__(self, segment: int) -> int:
        shift = self[segment] = self.lay.move(
            self.axis, self.axis.starts[segment], self.context
        ) - self.axis.starts[segment]  # fmt: skip
        return shift


class _Layout:
    """The segments of a traced graph and where each lands in the replicated one."""

    def __init__(
        self, graph: Graph, stacks: list[Stack], units: list[int], state: list[str], params: int
    ) -> None:
        self.graph, self.stacks, self.units = graph, stacks, units
        self.state_names, self.params = state, params
        self.paths: dict[tuple[str, tuple | None], str] = {}
        self._movers: dict[tuple | None, tuple[Mover, Mover]] = {}
        self.patterns = [re.compile(re.escape(s.path) + r"\.(\d+)(?=[.:]|$)") for s in stacks]
        self.prefixes = [s.path + "." for s in stacks]
        self.ops = self._op_axis()
        self.ids, self.events = self._id_axis()
        for axis, end in ((self.ops, len(graph.ops)), (self.ids, len(self.events))):
            self._emit(axis, end)
            axis.tabulate(end)

    # -- segments ---------------------------------------------------------------------------------
    def layer_of(self, path: str) -> tuple[int, int] | None:
        """(stack, layer) of a module path or name under a stack's blocks."""
        where = self._span(path)
        return None if where is None else where[:2]

    def _span(self, path: str) -> tuple[int, int, int, int] | None:
        """(stack, layer, where the layer's digits begin and end in `path`): `patterns`' match,
        by hand (every op name is asked once: a regular expression each was most of it)."""
        for i, prefix in enumerate(self.prefixes):
            if path.startswith(prefix):
                begin = end = len(prefix)
                while end < len(path) and path[end] in "0123456789":
                    end += 1
                if end > begin and (end == len(path) or path[end] in ".:"):
                    return i, int(path[begin:end]), begin, end
        return None

    def unit_key(self, path: str, phase: str) -> Key | None:
        where = self.layer_of(path)
        if where is None:
            return None
        unit = self.stacks[where[0]].unit_of(where[1])
        return None if unit is None else (where[0], unit, phase)

    def _op_axis(self) -> _Axis:
        """Forward: a unit runs from its first block's first op to the next unit's (the last to
        its last block's last op). Backward: from its first op to the previous unit's first."""
        graph = self.graph
        keys: list[Key | None] = [None] * len(graph.ops)
        for si, stack in enumerate(self.stacks):
            calls: dict[int, list[ModuleCall]] = {}
            for call in graph.modules:
                m = self.patterns[si].fullmatch(call.path)
                if m:
                    calls.setdefault(int(m.group(1)), []).append(call)
            named = range(stack.first, stack.first + stack.traced_layers)
            if sorted(calls) != list(named) or any(len(c) != 1 for c in calls.values()):
                raise NotPeriodic(f"the blocks of '{stack.path}' are not each called once")
            firsts = [calls[stack.layer(u, 0)][0].first_op for u in range(UNITS)]
            firsts.append(calls[named[-1]][0].last_op + 1)
            backward: dict[int, list[int]] = {}
            for op in graph.backward_ops:
                key = self.unit_key(op.name, "backward")
                if key is not None and key[0] == si:
                    backward.setdefault(key[1], []).append(op.index)
            if sorted(backward) != list(range(UNITS)):
                raise NotPeriodic(f"not every unit of '{stack.path}' has a backward")
            bstarts = [min(backward[u]) for u in range(UNITS)]
            bends = [bstarts[u - 1] if u else max(backward[0]) + 1 for u in range(UNITS)]
            for u in range(UNITS):
                if any(not bstarts[u] <= i < bends[u] for i in backward[u]):
                    raise NotPeriodic(f"the backward of unit {u} of '{stack.path}' is interleaved")
                for lo, hi, phase in ((firsts[u], firsts[u + 1], "forward"),
                                      (bstarts[u], bends[u], "backward")):  # fmt: skip
                    for i in range(lo, hi):
                        if keys[i] is not None:
                            raise NotPeriodic(f"units of two stacks overlap at op {i}")
                        keys[i] = (si, u, phase)
        axis = _Axis()
        for i, key in enumerate(keys):
            axis.add(i, _fixed(axis.keys, key))
        return axis

    def _id_axis(self) -> tuple[_Axis, list[tuple[str, object]]]:
        """Every id the tracer handed out, in order, with its segment: the state's by the name
        of its parameter or buffer, the rest by the next op recorded at or after it."""
        graph = self.graph
        events: dict[int, tuple[str, object]] = {}
        for sid, s in graph.storages.items():
            events[sid] = ("storage", s)
        for tid, t in graph.tensors.items():
            events[tid] = ("tensor", t)
        for nid, n in graph.nodes.items():
            events[nid] = ("node", n)
        total = len(events) + len(graph.saved)
        gaps = [i for i in range(total) if i not in events]
        if len(gaps) != len(graph.saved) or len(events) != total - len(gaps):
            raise NotPeriodic("the graph's ids are not one run from 0 with the saves' handles")
        for handle, saved in zip(gaps, graph.saved, strict=True):
            events[handle] = ("saved", saved)
        order = list(range(total))
        state_names = self.state_names
        first_out = [min(op.outputs) for op in graph.ops]
        axis = _Axis()
        for i in order:
            if i < 2 * len(state_names):
                phase = "param" if i // 2 < self.params else "buffer"
                key = self.unit_key(state_names[i // 2], phase)
            else:
                at = _anchor(*events[i])
                if at is None:
                    at = bisect.bisect_left(first_out, i)
                key = self.ops.locate(at)[0] if at < len(graph.ops) else None
                key = None if key is None or key[0] == "fixed" else key
            axis.add(i, _fixed(axis.keys, key))
        return axis, [events[i] for i in order]

    def _emit(self, axis: _Axis, end: int) -> None:
        """Where each segment lands: the third unit once for each unit of the full depth but the
        first two and the last (forward, state: ascending; backward: descending), the fourth
        dropped."""
        at = 0
        for i, key in enumerate(axis.keys):
            size = axis.size(i, end)
            if key[0] == "fixed":
                targets: list[int | None] = [None]
            else:
                last = self.units[key[0]] - 1
                unit = key[1]
                if unit in (0, 1):
                    targets = [unit]
                elif unit >= UNITS - 2:
                    targets = [last - (UNITS - 1 - unit)]
                elif unit == 2:
                    targets = list(range(2, last - 1))
                    if key[2] == "backward":
                        targets.reverse()
                else:
                    targets = []
            for target in targets:
                axis.new_start[_slot(key, target)] = at
                axis.copies.setdefault(key, []).append((target, at))
                at += size
        axis.new_start[("end", None)] = at

    # -- references -------------------------------------------------------------------------------
    def target(self, key: Key, context: tuple[int, int, int] | None) -> int | None:
        """The full unit a reference to traced segment `key` lands in, from a record of traced
        unit `context[1]` emitted as full unit `context[2]` of stack `context[0]` (None: outside)."""
        if key[0] == "fixed":
            return None
        si, unit = key[0], key[1]
        if context is not None and context[0] == si:
            distance = unit - context[1]
            if abs(distance) <= 1:
                return context[2] + distance
            if 2 <= unit < UNITS - 2:
                raise NotPeriodic(
                    f"a block of '{self.stacks[si].path}' refers {abs(distance)} units away"
                )
            # a first or last block, as from outside: the gradient every block adds into in
            # place (a tensor all blocks read), made by the last block's backward
        if unit in (0, 1):
            return unit
        if unit >= UNITS - 2:
            return self.units[si] - (UNITS - unit)
        raise NotPeriodic(
            f"something outside the blocks of '{self.stacks[si].path}' refers to an inner one"
        )

    def move(self, axis: _Axis, position: int | None, context: tuple | None) -> int | None:
        """Where traced `position` lands, seen from a record emitted in `context`: by how far
        its segment moves, worked out once per segment and context."""
        if position is None or position < 0:
            return position
        segment = axis.segment(position)
        shift = axis.shifts.get((segment, context))
        if shift is None:
            key = axis.keys[segment]
            landing = axis.new_start[_slot(key, self.target(key, context))]
            shift = axis.shifts[(segment, context)] = landing - axis.starts[segment]
        return position + shift

    def movers(self, context: tuple | None) -> tuple[Mover, Mover]:
        """`move` along the ids and along the op indices, seen from `context`, as two functions
        (made once per context): what `replicate` calls for each reference it renumbers."""
        found = self._movers.get(context)
        if found is None:
            found = self._movers[context] = (
                self._mover(self.ids, context),
                self._mover(self.ops, context),
            )
        return found

    def _mover(self, axis: _Axis, context: tuple | None) -> Mover:
        table, last = axis.table, len(axis.starts) - 1
        size = len(table)
        shifts = _Shifts(self, axis, context)

        def move(position: int | None) -> int | None:
            if position is None or position < 0:
                return position
            return position + shifts[table[position] if position < size else last]

        return move

    def path(self, path: str, context: tuple | None) -> str:
        """`path` (or a name that begins with one) as seen from a record emitted in `context`."""
        found = self.paths.get((path, context))
        if found is None:
            found = self.paths[(path, context)] = self._path(path, context)
        return found

    def _path(self, path: str, context: tuple | None) -> str:
        where = self._span(path)
        if where is None:
            return path
        si, layer, begin, end = where
        stack = self.stacks[si]
        unit = stack.unit_of(layer)
        if unit is None:
            return path
        full = self.target((si, unit, ""), context)
        assert full is not None
        new = stack.layer(full, (layer - stack.first - stack.start) % stack.period)
        return f"{path[:begin]}{new}{path[end:]}"


def replicate(
    graph: Graph,
    stacks: list[Stack],
    state: list[str],
    params: int,
    units: list[int] | None = None,
    full_state: list[str] | None = None,
) -> Graph:
    """The graph of each stack at `units[i]` units (default: `Stack.units`), from `graph` traced
    at `UNITS` units each; `NotPeriodic` where the trace does not lay out as units. `state`: the
    traced model's parameter names, then its buffers' (`params` of them parameters), as the
    tracer registered them; `full_state`, the full model's, which the replicated registration
    must name in the same order."""
    units = [s.units for s in stacks] if units is None else units
    lay = _Layout(graph, stacks, units, state, params)
    ids, ops = lay.ids, lay.ops

    def copies(axis: _Axis, position: int) -> list[tuple[int, tuple | None]]:
        """(new position, context) of each copy of the record at traced `position`."""
        key, offset = axis.locate(position)
        fixed = key[0] == "fixed"
        return [
            (start + offset, None if fixed else (key[0], key[1], target))
            for target, start in axis.copies.get(key, [])
        ]

    def mid(values: tuple[int, ...], context: tuple | None) -> tuple[int, ...]:
        return tuple(lay.move(ids, v, context) for v in values)  # type: ignore[misc]

    def mop(values: tuple[int, ...], context: tuple | None) -> tuple[int, ...]:
        return tuple(lay.move(ops, v, context) for v in values)  # type: ignore[misc]

    # ops: each copy's name first (`_recount`: the call counts run over the laid-out order), then
    # the op, made once, in its place
    placed: list[tuple[Op, tuple | None, str] | None] = [None] * ops.new_start[("end", None)]
    for op in graph.ops:
        for index, c in copies(ops, op.index):
            placed[index] = (op, c, lay.path(op.name, c))
    names = _recount([(name, op.target) for op, _, name in placed])  # type: ignore[misc]
    ordered_ops = []
    for index, ((op, c, _), name) in enumerate(zip(placed, names, strict=True)):  # type: ignore[misc]
        mi, mo = lay.movers(c)
        ordered_ops.append(
            Op(
                index=index,
                name=name,
                target=op.target,
                module=lay.path(op.module, c),
                phase=op.phase,
                inputs=tuple(mi(v) for v in op.inputs),
                outputs=tuple(mi(v) for v in op.outputs),
                flops=op.flops,
                node=mi(op.node),
            )
        )

    # ids: every record in its new place, read back in order (the dicts keep ascending ids)
    slots: list[object] = [None] * ids.new_start[("end", None)]
    new_state: dict[int, str] = {}
    for position, (kind, rec) in enumerate(lay.events):
        for new, c in copies(ids, position):
            if position < 2 * len(state) and position % 2:
                new_state[new // 2] = lay.path(state[position // 2], c)
            mi, mo = lay.movers(c)
            if kind == "storage":
                s: Storage = rec  # type: ignore[assignment]
                slots[new] = Storage(
                    new, s.nbytes, s.kind, mo(s.allocated_at), mo(s.released_after)
                )
            elif kind == "tensor":
                t: Tensor = rec  # type: ignore[assignment]
                slots[new] = Tensor(
                    new, mi(t.storage), t.shape, t.dtype, t.nbytes, mo(t.producer), t.stride,  # type: ignore[arg-type]
                )  # fmt: skip
            elif kind == "node":
                n: Node = rec  # type: ignore[assignment]
                slots[new] = Node(new, n.name, mo(n.forward_op), mo(n.released_after))
            else:
                v: Saved = rec  # type: ignore[assignment]
                slots[new] = Saved(
                    mi(v.storage), mi(v.tensor), mi(v.node), v.phase, mo(v.forward_op),  # type: ignore[arg-type]
                    mo(v.packed_after), mo(v.released_after), mo(v.unpacked_until),
                )  # fmt: skip
    tensors: dict[int, Tensor] = {}
    storages: dict[int, Storage] = {}
    nodes: dict[int, Node] = {}
    saved: list[Saved] = []
    for new, record in enumerate(slots):
        if type(record) is Tensor:
            tensors[new] = record
        elif type(record) is Storage:
            storages[new] = record
        elif type(record) is Node:
            nodes[new] = record
        elif record is not None:
            saved.append(record)  # type: ignore[arg-type]

    if full_state is not None and [new_state[i] for i in sorted(new_state)] != full_state:
        raise NotPeriodic("the replicated parameters are not the model's, in its order")
    modules = _modules(graph, lay, mid, mop)
    info = dict(graph.info)
    info["kernel_scratch"] = {
        str(new): n
        for i, n in graph.info.get("kernel_scratch", {}).items()  # type: ignore[union-attr]
        for new, _ in copies(ops, int(i))
    }
    info["kernel_scratch"] = dict(sorted(info["kernel_scratch"].items(), key=lambda x: int(x[0])))
    for name in ("output_storages", "input_grad_storages"):
        info[name] = sorted(lay.move(ids, v, None) for v in graph.info.get(name, []))  # type: ignore[union-attr,misc]
    return Graph(
        ops=ordered_ops,
        tensors=tensors,
        storages=storages,
        saved=saved,
        nodes=nodes,
        modules=modules,
        info=info,
    )


def _modules(graph: Graph, lay: _Layout, mid, mop) -> list[ModuleCall]:  # noqa: ANN001
    """The module calls in the order they began: each belongs to the segment of its first op
    (calls begin in the order of their first ops), and its copies land where that segment does."""
    emitted: list[tuple[tuple[int, int], ModuleCall]] = []
    for i, call in enumerate(graph.modules):
        key, _ = lay.ops.locate(min(call.first_op, len(graph.ops) - 1))
        copies = lay.ops.copies.get(key, [])
        # a call over more than its unit (the model's own, a stack's) is the model's, once
        spans = call.last_op >= call.first_op and lay.ops.locate(call.last_op)[0] != key
        if spans and len(copies) > 1:
            raise NotPeriodic(f"module call '{call.path}' spans repeated units")
        for target, start in copies:
            c = None if key[0] == "fixed" or spans else (key[0], key[1], target)
            emitted.append(
                (
                    (start, i),
                    ModuleCall(
                        path=lay.path(call.path, c),
                        type=call.type,
                        first_op=lay.move(lay.ops, call.first_op, c),  # type: ignore[arg-type]
                        last_op=lay.move(lay.ops, call.last_op, c),  # type: ignore[arg-type]
                        inputs=mid(call.inputs, c),
                        outputs=mid(call.outputs, c),
                        escaped=mop(call.escaped, c),
                        arguments=call.arguments,
                        output_path=call.output_path,
                        repeats=tuple(lay.path(p, c) for p in call.repeats),
                    ),
                )
            )
    return [m for _, m in sorted(emitted, key=lambda x: x[0])]


def _recount(named: list[tuple[str, str]]) -> list[str]:
    """Op names (each with its op's target, in order) with their call counts as the tracer
    counts them: per scope and op. Scopes in a block count afresh in each copy; scopes outside
    the blocks (the root, `<backward>`) go on."""
    counts: dict[tuple[str, str], int] = {}
    shorts: dict[str, str] = {}
    out = []
    for name, target in named:
        short = shorts.get(target)
        if short is None:
            short = shorts[target] = target.split(".")[1] if "." in target else target
        head, _, _ = name.rpartition(f"{short}_")
        prefix = head[:-1] if head.endswith(".") else head
        count = counts.get((prefix, short), 0)
        counts[(prefix, short)] = count + 1
        out.append(f"{head}{short}_{count}")
    return out
