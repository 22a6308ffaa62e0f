"""The memory-traffic min-cut: which forward values to save so backward reads and writes least.

Horace He's formulation (AOTAutograd's partitioner), on our `Graph`. Under a fusing compiler a chain
of pointwise ops recomputes for free, so what costs is traffic: a saved intermediate is written once
and read once (2 x its bytes), a forward input already in memory is only read (1 x). Every value
backward needs must be either saved or recomputable from saved values; the cheapest such save set
is a minimum s-t cut of this network:

- Values. One value per output tensor of a forward op (an op with several outputs, e.g.
  `native_dropout`'s result and mask, gives one value each, named `<op>:<k>`; a single-output op's
  value is named as the op), and one per storage that the forward reads without producing it
  (parameters, buffers, inputs, constants: `input:<storage id>`). View ops are ordinary ops here:
  recomputing one is free, and saving one costs its own bytes.
- B(v), the bytes of a value: its tensor's `nbytes`, capped by its storage's (an `expand` of a
  scalar stores 4 bytes, not numel x 4); a forward input's is its storage's `nbytes`.
- Node splitting: each value v is `v_in -> v_out` with capacity 2 B(v), or 1 B(v) for an input.
  Cutting that edge means saving v.
- Data flow: `u_out -> v_in`, infinite, for each input u of the op producing v.
- `SRC -> v_in`, infinite, for every input, so an input is never "recomputed": it is read (saved)
  or not used by backward. Random ops (dropout, rand*, bernoulli, normal, ...) get the same edge:
  recomputing one would draw different numbers, so it must run in forward and, where backward
  needs it or anything recomputed from it, be saved. So do the ops `never_recompute` names:
  the pure traffic model counts recomputation as free, matmuls included, and on a transformer
  its optimum is to save the inputs and re-run the whole forward (`never_recompute=is_matmul`
  is AOTAutograd's ban on recomputing ops a fusing compiler cannot fuse).
- In-place writes: a value whose storage a later forward op overwrites in place (`relu_` on a
  matmul's output, `div_` on dropout's mask) no longer exists when backward runs, so its split
  edge is infinite: it can be recomputed or consumed in forward, never saved. Values autograd saved
  are exempt (autograd's version counter guarantees they were not overwritten), which keeps
  saving exactly what autograd saves a finite cut.
- `v_out -> SNK`, infinite, for every value autograd saved for a backward node that ran
  (`Graph.saved`, parameters included: backward reads them too). Traced backward ops read forward
  values only through saved tensors, so these are the tangent closure's frontier.

scipy's `maximum_flow` needs int32 capacities: all finite capacities are divided by their gcd and,
if their sum still does not fit, by the smallest power of two 2^k that makes it fit, rounding up
(so no positive cost becomes free). The cut found is then optimal to within g x 2^k bytes per saved
value; `MinCutResult.cut_cost_bytes` is always the exact cost of the save set chosen.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import breadth_first_order, maximum_flow

from remat.device.cost import is_view
from remat.errors import RematError
from remat.graph import Graph, Op
from remat.units import format_bytes

_INT32_MAX = 2**31 - 1
_SRC, _SNK = 0, 1


@dataclass(frozen=True)
class MinCutResult:
    """The save set of minimum memory traffic.

    `saved`: the values saved for backward, by value name (`<op>`, `<op>:<k>` for the k-th output of
    a multi-output op, `input:<storage id>`), in forward order. `saved_storages`: their distinct
    storages, parameters and inputs included. `recomputed`: the forward ops backward re-runs, in
    forward order. `cut_cost_bytes`: exact traffic of the save set (2 B per intermediate, 1 B per
    input). `held_bytes`: bytes of the saved storages that are not parameters or buffers, i.e. what
    the plan holds for backward, comparable with `Graph.activation_bytes`."""

    saved: tuple[str, ...]
    saved_storages: tuple[int, ...]
    recomputed: tuple[str, ...]
    cut_cost_bytes: int
    held_bytes: int
    reason: str


@dataclass(frozen=True)
class _Value:
    name: str
    op: str | None  # the producing forward op's name; None for a forward input
    made_at: int  # index of the producing op; -1 for a forward input
    storage: int
    cost: int  # 2 B(v) for an intermediate, 1 B(v) for an input
    inputs: tuple[int, ...]  # the values the producing op reads
    pinned: bool  # input, random or banned: never recomputed


@dataclass(frozen=True)
class JointProblem:
    """The forward values of a graph as the min-cut and the budgeted save set see them: `needed`
    are the values backward reads, `unsaveable` those that cannot be held until backward."""

    values: list[_Value]
    needed: list[int]
    unsaveable: frozenset[int]


def joint_problem(
    graph: Graph,
    never_recompute: Callable[[Op], bool] | None,
    never_save: Callable[[Op], bool] | None = None,
) -> JointProblem:
    values: list[_Value] = []
    by_tensor: dict[int, int] = {}
    by_input: dict[int, int] = {}

    def value_of(tid: int) -> int | None:
        """The value tensor `tid` holds; None for a value made in backward."""
        if tid in by_tensor:
            return by_tensor[tid]
        t = graph.tensors[tid]
        if t.producer is not None:
            return None
        if t.storage not in by_input:
            s = graph.storages[t.storage]
            by_input[t.storage] = len(values)
            values.append(_Value(f"input:{s.id}", None, -1, s.id, s.nbytes, (), pinned=True))
        return by_input[t.storage]

    ops = graph.op_by_name
    last_write: dict[int, int] = {}  # storage -> last forward op that wrote it in place
    for op in graph.forward_ops:
        inputs = tuple(sorted({v for t in op.inputs if (v := value_of(t)) is not None}))
        read = {graph.tensors[t].storage for t in op.inputs}
        # A random op the caller lets no one save (a user's MUST_RECOMPUTE tag) is recomputed
        # with its RNG state replayed (torch's functionalize_rng_ops): only then is it not pinned.
        tagged_recompute = never_save is not None and never_save(op)
        pinned = (op.random and not tagged_recompute) or (
            never_recompute is not None and never_recompute(op)
        )
        for k, tid in enumerate(op.outputs):
            t = graph.tensors[tid]
            if t.storage in read and not is_view(op):
                last_write[t.storage] = op.index
            nbytes = min(t.nbytes, graph.storages[t.storage].nbytes)
            name = f"{op.name}:{k}" if len(op.outputs) > 1 else op.name
            by_tensor[tid] = len(values)
            values.append(_Value(name, op.name, op.index, t.storage, 2 * nbytes, inputs, pinned))
    needed = {value_of(s.tensor) for s in graph.saved if s.node is not None}
    needed.discard(None)
    clobbered = {i for i, v in enumerate(values) if last_write.get(v.storage, -1) > v.made_at}
    banned = set()
    if never_save is not None:
        banned = {i for i, v in enumerate(values) if v.op is not None and never_save(ops[v.op])}
    return JointProblem(values, sorted(needed), frozenset((clobbered - needed) | banned))


def _scaled(costs: np.ndarray) -> np.ndarray:
    """Integer capacities whose sum fits int32 with room for an 'infinite' one above it."""
    positive = costs[costs > 0]
    gcd = int(np.gcd.reduce(positive)) if positive.size else 1
    scaled = costs // gcd
    shift = 0
    while int(np.sum(-(-scaled >> shift))) >= _INT32_MAX:
        shift += 1
    return -(-scaled >> shift)


def _source_side(problem: JointProblem) -> np.ndarray:
    """Whether each network node is on the source side of a minimum cut (node 2+2v is v_in, 3+2v
    is v_out): the nodes the source reaches in the residual graph of a maximum flow."""
    values = problem.values
    n = len(values)
    unsaveable = problem.unsaveable
    costs = [0 if i in unsaveable else v.cost for i, v in enumerate(values)]
    caps = _scaled(np.array(costs, dtype=np.int64))
    inf = int(caps.sum()) + 1
    rows: list[int] = []
    cols: list[int] = []
    data: list[int] = []
    for i, v in enumerate(values):
        rows.append(2 + 2 * i)
        cols.append(3 + 2 * i)
        data.append(inf if i in unsaveable else int(caps[i]))
        for u in v.inputs:
            rows.append(3 + 2 * u)
            cols.append(2 + 2 * i)
            data.append(inf)
        if v.pinned:
            rows.append(_SRC)
            cols.append(2 + 2 * i)
            data.append(inf)
    for i in problem.needed:
        rows.append(3 + 2 * i)
        cols.append(_SNK)
        data.append(inf)
    size = 2 + 2 * n
    capacity = csr_matrix(
        (np.array(data, dtype=np.int32), (np.array(rows), np.array(cols))), shape=(size, size)
    )
    flow = maximum_flow(capacity, _SRC, _SNK).flow
    residual = capacity - flow
    residual.data[residual.data < 0] = 0
    residual.eliminate_zeros()
    reached = breadth_first_order(residual, _SRC, directed=True, return_predecessors=False)
    side = np.zeros(size, dtype=bool)
    side[reached] = True
    return side


def _walk_back(problem: JointProblem, saved: set[int]) -> tuple[set[int], int | None]:
    """Walk back from what backward needs through unsaved values: the values to recompute, and
    the first pinned one met (which makes `saved` invalid), if any."""
    values = problem.values
    recomputed: set[int] = set()
    stack = list(problem.needed)
    while stack:
        v = stack.pop()
        if v in saved or v in recomputed:
            continue
        if values[v].pinned:
            return recomputed, v
        recomputed.add(v)
        stack.extend(values[v].inputs)
    return recomputed, None


def recomputed_values(problem: JointProblem, saved: set[int]) -> list[int] | None:
    """The values backward recomputes when `saved` are saved, or None if some needed value
    cannot be had without recomputing an input or a pinned op."""
    recomputed, stuck = _walk_back(problem, saved)
    return None if stuck is not None else sorted(recomputed)


def _index(problem: JointProblem, names: list[str]) -> set[int]:
    by_name = {v.name: i for i, v in enumerate(problem.values)}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise RematError(
            f"{unknown[0]!r} is not a forward value of this graph: name a forward op (`<op>:<k>` "
            "for output k of a multi-output op) or an input read by the forward (`input:<id>`)"
        )
    return {by_name[n] for n in names}


def _no_save_set(problem: JointProblem, saved: set[int]) -> str:
    """Why no save set exists: recomputing a value backward needs reaches one that may be neither
    saved nor recomputed."""
    _, stuck = _walk_back(problem, saved)
    name = problem.values[stuck].name if stuck is not None else "a value"
    return (
        f"no save set obeys the rules: {name!r} may be neither saved nor recomputed, and backward "
        "needs it; relax its MUST_RECOMPUTE tag or its ban"
    )


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def default_save_set(graph: Graph) -> tuple[str, ...]:
    """The values autograd itself saves (for backward nodes that ran), by value name: the save set
    that recomputes nothing."""
    problem = joint_problem(graph, None)
    return tuple(problem.values[v].name for v in problem.needed)


def cut_cost(
    graph: Graph,
    saved: Iterable[str],
    *,
    never_recompute: Callable[[Op], bool] | None = None,
    never_save: Callable[[Op], bool] | None = None,
) -> int | None:
    """Exact traffic in bytes of saving the values named in `saved` (2 B per intermediate, 1 B per
    input, superfluous ones included), or None if they are not a valid save set: one of them is
    overwritten in place later in the forward, or some value backward needs could only be had by
    recomputing an input, a random op or an op `never_recompute` names. Raises RematError on a
    name that is not a forward value."""
    problem = joint_problem(graph, never_recompute, never_save)
    chosen = _index(problem, list(saved))
    if chosen & problem.unsaveable or recomputed_values(problem, chosen) is None:
        return None
    return sum(problem.values[v].cost for v in chosen)


def mincut(
    graph: Graph,
    *,
    never_recompute: Callable[[Op], bool] | None = None,
    never_save: Callable[[Op], bool] | None = None,
) -> MinCutResult:
    """The save set of minimum memory traffic between forward and backward (see the module
    docstring for the network), recomputing neither random ops nor those `never_recompute` names,
    and saving no output of an op `never_save` names. Only values backward actually reaches are
    reported as saved or recomputed. Raises RematError when no save set obeys both."""
    problem = joint_problem(graph, never_recompute, never_save)
    values = problem.values
    side = _source_side(problem)
    # A value the walk back from what backward needs reaches is saved if its split edge is cut
    # (v_in on the source side; v_out is then on the sink side, or an infinite edge would be cut).
    cut = {i for i in range(len(values)) if side[2 + 2 * i] and not side[3 + 2 * i]}
    # Only an infinite edge left to cut (a value that may be neither saved nor recomputed) makes
    # the cut invalid: it then either recomputes a pinned value or saves an unsaveable one.
    cut -= problem.unsaveable
    recomputed = recomputed_values(problem, cut)
    if recomputed is None:
        raise RematError(_no_save_set(problem, cut))
    saved = sorted(
        {u for v in recomputed for u in values[v].inputs if u in cut}
        | {v for v in problem.needed if v in cut}
    )
    storages = list(dict.fromkeys(values[v].storage for v in saved))
    cost = sum(values[v].cost for v in saved)
    default = sum(values[v].cost for v in problem.needed)
    ops = list(dict.fromkeys(values[v].op for v in recomputed))
    held_bytes = sum(
        graph.storages[s].nbytes
        for s in storages
        if graph.storages[s].kind not in ("param", "buffer")
    )
    reason = (
        f"saving {_count(len(saved), 'value')} moves {format_bytes(cost)} between forward and "
        f"backward (autograd's own {_count(len(problem.needed), 'save')}: "
        f"{format_bytes(default)}); backward recomputes {_count(len(ops), 'forward op')}, free "
        "under a fusing compiler"
    )
    return MinCutResult(
        saved=tuple(values[v].name for v in saved),
        saved_storages=tuple(storages),
        recomputed=tuple(ops),
        cut_cost_bytes=cost,
        held_bytes=held_bytes,
        reason=reason,
    )
