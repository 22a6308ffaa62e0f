"""The budgeted save set on a joint graph: what a compiled training step keeps for backward so its
predicted peak fits a byte budget, at the least predicted time.

The min-cut (solvers/mincut.py) minimises memory traffic alone and has no notion of a budget. Here
the same values, the same rules (random ops, banned ops and user tags; see `joint_problem`) and the
same traffic are priced in seconds next to the time of recomputing each op, and the saved bytes are
capped. As an integer program over the graph (HiGHS through `scipy.optimize.milp`):

- `s_v` = 1 if value v is saved; `r_o` = 1 if backward recomputes forward op o; `y_m` = 1 if
  storage m is held for backward (a view and its base share one storage, paid once).
- Every value backward reads is saved or its op recomputed: `s_v + r_op(v) >= 1`.
- A recomputed op has each input saved or recomputed: `s_u + r_op(u) >= r_o` (a forward input,
  a random op, an op banned from recomputation: `r = 0`, so it must be saved).
- `y_m >= s_v` for v on m; the activation bytes held, `sum bytes_m y_m`, are at most the cap.
- Minimise `sum seconds_o r_o + sum traffic_v s_v / bandwidth`: what recomputation costs plus what
  moving the saved values costs, both in seconds on the device profile.
- Offload (the compiled path's `offload=`; docs/offload.md): `o_m` = 1 if storage m goes to host
  memory between its last forward and first backward reader. Only a storage `Offloadable` names,
  through the one value of it the offload pass can move: `o_m <= s_v` for that value, and
  `o_m + s_u <= 1` for every other value u on m (a saved view would keep it on the device). Held
  bytes become `sum bytes_m (y_m - o_m)`, host bytes `sum bytes_m o_m` are capped, and each o_m
  costs its copy seconds: keep, recompute or offload, per tensor, under one byte cap.

A byte budget bounds the *peak*, not the saved bytes. A `PeakModel` predicts the peak of a save
set: `joint_peak` here runs the step's two programs (forward, then backward with each recomputed
op just before its first use, as AOTAutograd's partitioner orders them) over storages, exact when
the graphs run op by op (aot_eager); under inductor the compiled path passes inductor's own buffer
plan instead (`remat.prediction.inductor_plan`, read per save set by code generation, so it is consulted
lazily). Holding fewer bytes does not always lower the peak, so `save_set_within` solves a fixed
ladder of caps and takes, cheapest first, the first save set whose predicted peak fits.

The peak model is the compiled path's judge, as `remat.prediction.schedule.simulate` is the eager path's: it
runs over the joint graph AOTAutograd partitions (a different graph from the eager trace that
`simulate` replays checkpoint regions on; no regions, frames or replays here), and its peak is
the one a compiled plan reports.

Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from math import prod

import numpy as np
from scipy import optimize
from scipy.sparse import coo_matrix

from remat.errors import InfeasibleBudget, RematError
from remat.graph import PERSISTENT_KINDS, Graph, Op
from remat.planning.solvers import peak_windows
from remat.planning.solvers.mincut import JointProblem, recomputed_values
from remat.planning.solvers.peak_windows import Window
from remat.units import format_bytes

#: Rungs of the ladder of caps on held bytes that `candidate_save_sets` solves.
_RUNGS = 12


@dataclass(frozen=True)
class Offloadable:
    """What a save set may move to host memory: storage -> the name of the one value on it the
    offload pass can move, and storage -> the copy seconds it costs; host memory capped (None:
    no cap)."""

    values: Mapping[int, str]
    seconds: Mapping[int, float]
    host_budget_bytes: int | None = None


@dataclass(frozen=True)
class SaveSet:
    """A save set and what it predicts. `saved`: value names (as in `MinCutResult`); `recomputed`:
    forward ops backward re-runs; `held_bytes`: bytes of the saved storages that are not parameters
    or buffers; `held_activation_bytes`: of those, the ones that exist only because they are saved
    (activations; inputs exist anyway); `peak_bytes`: predicted peak of the step."""

    saved: tuple[str, ...]
    recomputed: tuple[str, ...]
    held_bytes: int
    held_activation_bytes: int
    traffic_bytes: int
    recompute_seconds: float
    peak_bytes: int
    #: values whose storage goes to host memory (`Offloadable`), and their copies' seconds
    offloaded: tuple[str, ...] = ()
    transfer_seconds: float = 0.0


def joint_peak(
    graph: Graph,
    problem: JointProblem,
    saved: set[int],
    recomputed: list[int],
    offloaded: frozenset[int] = frozenset(),
) -> int:
    """Predicted peak bytes of the step when the values `saved` are saved and `recomputed` (from
    `recomputed_values`) are recomputed. Every op's new output storage is allocated when it runs
    and freed after its last reader in the same program; saved storages live until their last backward reader; the
    forward's outputs (`graph.info["forward_outputs"]`, tensor ids) until the end, and so do the
    backward's (`graph.info["backward_outputs"]`: the gradients). Persistent storages (parameters,
    buffers, inputs) count throughout. Exact when the graphs run op by op (aot_eager); under
    inductor, fusion drops intermediates, buffers are reused in place and kernels run in
    inductor's order (0-18% off on CPU), which is why the compiled path reads inductor's own plan
    there (`remat.prediction.inductor_plan`) and uses this only when that plan cannot be read.

    `offloaded` (storage ids of saved values) are what torch's compile offload pass moves to host
    memory (`remat.applying.compiled_offload`): each leaves the device after its last forward
    reader (the pass copies it there) and comes back just before its first backward reader,
    living until its last one; host memory is not counted."""
    values = problem.values
    tensors = graph.tensors
    storages = graph.storages
    saved_storages = {values[v].storage for v in saved}
    forward_outputs = {tensors[t].storage for t in graph.info.get("forward_outputs", ())}
    backward_outputs = {tensors[t].storage for t in graph.info.get("backward_outputs", ())}
    persistent = {sid for sid, s in storages.items() if s.kind in PERSISTENT_KINDS}

    wanted = {graph.op_by_name[values[v].op].index for v in saved if values[v].op is not None}
    wanted |= {tensors[t].producer for t in graph.info.get("forward_outputs", ())} - {None}
    forward = _ancestors(graph, wanted)
    replayed = {graph.op_by_name[values[v].op].index for v in recomputed}
    backward = _lazy_order(graph, replayed)

    live = {sid: storages[sid].nbytes for sid in persistent}
    keep = persistent | (saved_storages - offloaded) | forward_outputs
    peak = _run(graph, forward, live, keep, 0)
    for sid in {tensors[t].storage for op in graph.backward_ops for t in op.inputs}:
        if storages[sid].kind == "grad" and storages[sid].allocated_at is None:
            live[sid] = storages[sid].nbytes  # the tangents backward starts from
    live[_LOSS] = loss_bytes(graph)
    keep = persistent | forward_outputs | backward_outputs | {_LOSS}
    return _run(graph, backward, live, keep, peak, reload=offloaded)


#: `joint_peak`'s key for the loss outside the graph (storage ids are never negative).
_LOSS = -1


def loss_bytes(graph: Graph) -> int:
    """What the step holds outside the compiled graph while backward runs: the scalar gradient
    autograd seeds backward with (the graph's backward gets a copy of it, its tangent) and the
    scalar loss the user computed from the outputs, one element each of the first output's dtype
    (a loss for `.backward()` is a scalar). A 0-dim first output is the model's own loss (the
    presets and Hugging Face models given labels): it is held with the outputs, only the seed is
    outside (before this was told apart every such prediction was 4 bytes over the measured peak)."""
    outputs = graph.info.get("forward_outputs", ())
    if not outputs:
        return 0
    first = graph.tensors[outputs[0]]
    element = first.nbytes // max(prod(first.shape), 1)
    return element if first.shape == () else 2 * element


def _ancestors(graph: Graph, wanted: set[int]) -> list[Op]:
    """The forward ops that must run to produce ops `wanted`, in order."""
    need = set(wanted)
    for op in reversed(graph.forward_ops):
        if op.index in need:
            need.update(p for t in op.inputs if (p := graph.tensors[t].producer) is not None)
    return [op for op in graph.forward_ops if op.index in need]


def _lazy_order(graph: Graph, replayed: set[int]) -> list[Op]:
    """The backward program: backward ops in order, each recomputed forward op placed just before
    the first op that reads it (its own inputs first)."""
    order: list[Op] = []
    placed: set[int] = set()

    def place(index: int) -> None:
        if index in placed:
            return
        placed.add(index)
        op = graph.ops[index]
        for t in op.inputs:
            p = graph.tensors[t].producer
            if p is not None and p in replayed:
                place(p)
        order.append(op)

    for op in graph.backward_ops:
        for t in op.inputs:
            p = graph.tensors[t].producer
            if p is not None and p in replayed:
                place(p)
        order.append(op)
    return order


def _run(
    graph: Graph,
    program: list[Op],
    live: dict[int, int],
    keep: set[int],
    peak: int,
    reload: frozenset[int] = frozenset(),
) -> int:
    """Run `program` over `live` (storage -> bytes, updated in place) and return the peak seen;
    a storage of `reload` not live comes back (from host memory) just before an op reads it."""
    tensors = graph.tensors
    last_use: dict[int, int] = {}
    for pos, op in enumerate(program):
        for t in op.inputs:
            last_use[tensors[t].storage] = pos
    total = sum(live.values())
    for pos, op in enumerate(program):
        for t in op.inputs:
            sid = tensors[t].storage
            if sid in reload and sid not in live:
                live[sid] = graph.storages[sid].nbytes
                total += live[sid]
        for t in op.outputs:
            sid = tensors[t].storage
            if sid not in live:
                live[sid] = graph.storages[sid].nbytes
                total += live[sid]
        peak = max(peak, total)
        for t in (*op.inputs, *op.outputs):
            sid = tensors[t].storage
            if sid in live and sid not in keep and last_use.get(sid, -1) <= pos:
                total -= live.pop(sid)
    return peak


#: A save set's predicted peak: (graph, problem, saved, recomputed[, offloaded storages]) -> bytes.
#: `joint_peak` runs the graphs op by op; the compiled path gives inductor's own plan where it
#: compiles with it (without offload).
PeakModel = Callable[..., int]


def describe_save_set(
    graph: Graph,
    problem: JointProblem,
    saved: set[int],
    op_seconds: Sequence[float],
    peak_model: PeakModel = joint_peak,
    offloaded: frozenset[int] = frozenset(),
    offload: Offloadable | None = None,
) -> SaveSet:
    """A valid save set (indices into `problem.values`) with its bytes, time and predicted peak
    (by `peak_model`, given the `offloaded` storages, priced by `offload`); values backward
    does not reach are dropped from it."""
    values = problem.values
    recomputed = recomputed_values(problem, saved)
    if recomputed is None:
        raise RematError(
            "not a valid save set: backward needs a value it can neither read nor recompute"
        )
    saved = _reached(problem, saved, recomputed)
    storages = graph.storages
    kept = {values[v].storage for v in saved}
    ops = _recomputed_ops(problem, recomputed)
    offloaded = frozenset(offloaded & kept)
    if offloaded:
        peak = peak_model(graph, problem, saved, recomputed, offloaded)
    else:
        peak = peak_model(graph, problem, saved, recomputed)
    return SaveSet(
        saved=tuple(values[v].name for v in sorted(saved)),
        recomputed=ops,
        held_bytes=sum(
            storages[m].nbytes for m in kept if storages[m].kind not in ("param", "buffer")
        ),
        held_activation_bytes=_held_activation_bytes(graph, problem, saved),
        traffic_bytes=sum(values[v].cost for v in saved),
        recompute_seconds=sum(op_seconds[graph.op_by_name[o].index] for o in ops),
        peak_bytes=peak,
        offloaded=tuple(offload.values[m] for m in sorted(offloaded)) if offload else (),
        transfer_seconds=sum(offload.seconds[m] for m in offloaded) if offload else 0.0,
    )


def _recomputed_ops(problem: JointProblem, recomputed: list[int]) -> tuple[str, ...]:
    """The forward ops backward re-runs to recompute the values `recomputed`, each once."""
    return tuple(dict.fromkeys(problem.values[v].op for v in sorted(recomputed)))


def _reached(problem: JointProblem, saved: set[int], recomputed: list[int]) -> set[int]:
    """`saved` less the values backward never reads, directly or to recompute."""
    values = problem.values
    reached = {u for v in recomputed for u in values[v].inputs} | set(problem.needed)
    return {v for v in saved if v in reached}


def _held_activation_bytes(graph: Graph, problem: JointProblem, saved: set[int]) -> int:
    """Bytes of the storages of `saved` that exist only because they are saved (no inputs)."""
    storages = {problem.values[v].storage for v in saved}
    return sum(
        graph.storages[m].nbytes for m in storages if graph.storages[m].kind not in PERSISTENT_KINDS
    )


def cheapest_save_set(
    graph: Graph,
    problem: JointProblem,
    op_seconds: Sequence[float],
    bandwidth: float,
    max_held_activation_bytes: int | None,
    *,
    traffic_weight: float = 1.0,
    time_limit_s: float = 30.0,
) -> set[int] | None:
    """The save set of least recompute + traffic seconds that holds at most `max_held_activation_bytes` of
    activations for backward (None: no cap); None if no save set fits the cap. With
    `traffic_weight=0` the least recompute time alone, the measure torch's budgeted partitioner
    is compared on. Solved to proven optimality (no MIP gap)."""
    found = cheapest_choice(
        graph,
        problem,
        op_seconds,
        bandwidth,
        max_held_activation_bytes,
        traffic_weight=traffic_weight,
        time_limit_s=time_limit_s,
    )
    return None if found is None else found[0]


def cheapest_choice(
    graph: Graph,
    problem: JointProblem,
    op_seconds: Sequence[float],
    bandwidth: float,
    max_held_activation_bytes: int | None,
    offload: Offloadable | None = None,
    *,
    traffic_weight: float = 1.0,
    time_limit_s: float = 30.0,
    windows: Sequence[Window] = (),
) -> tuple[set[int], frozenset[int]] | None:
    """`cheapest_save_set` where storages `offload` names may also go to host memory (their
    bytes out of the cap, their copy seconds in the cost): the save set and the offloaded
    storages of least recompute + traffic + copy seconds, or None if nothing fits the cap.
    `windows` (solvers/peak_windows.py): more caps, each on the bytes of some storages held."""
    values = problem.values
    n = len(values)
    op_names = list(dict.fromkeys(v.op for v in values if v.op is not None))
    op_col = {name: n + k for k, name in enumerate(op_names)}
    held = sorted(
        {v.storage for v in values if graph.storages[v.storage].kind not in PERSISTENT_KINDS}
    )
    store_col = {m: n + len(op_names) + k for k, m in enumerate(held)}
    index_of = {v.name: i for i, v in enumerate(values)}
    movable = sorted(
        m
        for m, name in (offload.values.items() if offload else ())
        if m in store_col and name in index_of
    )
    host_col = {m: n + len(op_names) + len(held) + k for k, m in enumerate(movable)}
    columns = n + len(op_names) + len(held) + len(movable)

    rows: list[int] = []
    cols: list[int] = []
    coef: list[float] = []
    lower: list[float] = []
    upper: list[float] = []

    def row(entries: list[tuple[int, float]], lo: float, hi: float) -> None:
        r = len(lower)
        for c, a in entries:
            rows.append(r)
            cols.append(c)
            coef.append(a)
        lower.append(lo)
        upper.append(hi)

    for v in problem.needed:
        op = values[v].op
        row([(v, 1.0)] + ([(op_col[op], 1.0)] if op is not None else []), 1, np.inf)
    inputs_of = {values[v].op: values[v].inputs for v in range(n) if values[v].op is not None}
    for op, inputs in inputs_of.items():
        for u in inputs:
            producer = values[u].op
            entries = [(u, 1.0), (op_col[op], -1.0)]
            if producer is not None:
                entries.append((op_col[producer], 1.0))
            row(entries, 0, np.inf)
    for v in range(n):
        if values[v].storage in store_col:
            row([(store_col[values[v].storage], 1.0), (v, -1.0)], 0, np.inf)
    for m, c in host_col.items():  # offload m only through its movable value, saved alone
        mover = index_of[offload.values[m]]
        row([(c, 1.0), (mover, -1.0)], -np.inf, 0)
        for u in range(n):
            if u != mover and values[u].storage == m:
                row([(c, 1.0), (u, 1.0)], -np.inf, 1)
    if max_held_activation_bytes is not None:
        row(
            [(store_col[m], float(graph.storages[m].nbytes)) for m in held]
            + [(c, -float(graph.storages[m].nbytes)) for m, c in host_col.items()],
            -np.inf,
            max_held_activation_bytes,
        )
    for members, cap in windows:
        entries = [
            (store_col[m], float(graph.storages[m].nbytes)) for m in members if m in store_col
        ]
        if entries:
            row(entries, -np.inf, cap)
    if host_col and offload.host_budget_bytes is not None:
        row(
            [(c, float(graph.storages[m].nbytes)) for m, c in host_col.items()],
            -np.inf,
            offload.host_budget_bytes,
        )

    cost = np.zeros(columns)
    ub = np.ones(columns)
    for v in range(n):
        cost[v] = traffic_weight * values[v].cost / bandwidth
        if v in problem.unsaveable:
            ub[v] = 0
    pinned_ops = {v.op for v in values if v.pinned and v.op is not None}
    for name, c in op_col.items():
        cost[c] = op_seconds[graph.op_by_name[name].index]
        if name in pinned_ops:
            ub[c] = 0
    for m, c in host_col.items():
        cost[c] = offload.seconds[m]
    # Seconds per value are ~1e-9 on small graphs, below HiGHS's absolute optimality gap (1e-6,
    # which scipy does not expose): scaled so the largest cost is 1, the optimum is exact.
    scale = cost.max(initial=0.0)
    res = optimize.milp(
        cost / scale if scale > 0 else cost,
        integrality=np.ones(columns),
        bounds=optimize.Bounds(0, ub),
        constraints=[
            optimize.LinearConstraint(
                coo_matrix((coef, (rows, cols)), shape=(len(lower), columns)).tocsr(), lower, upper
            )
        ],
        options={"time_limit": time_limit_s, "mip_rel_gap": 0.0},
    )
    if res.x is None:
        return None
    return (
        {v for v in range(n) if res.x[v] > 0.5},
        frozenset(m for m, c in host_col.items() if res.x[c] > 0.5),
    )


def candidate_save_sets(
    graph: Graph,
    problem: JointProblem,
    op_seconds: Sequence[float],
    bandwidth: float,
    rungs: int = _RUNGS,
    offload: Offloadable | None = None,
) -> list[tuple[set[int], frozenset[int]]]:
    """Save sets along a ladder of caps on the activation bytes held for backward, from the
    cheapest uncapped one down to holding none, and saving everything backward reads. Holding
    less does not always lower the peak (recomputing a long chain in backward keeps it all alive
    at once), so a budget is met by checking each rung's predicted peak; the ladder does not
    depend on the budget, which makes the chosen plan's peak never grow as the budget shrinks.
    Each candidate comes with the storages it offloads (`offload`; none without it)."""
    top = cheapest_choice(graph, problem, op_seconds, bandwidth, None, offload)
    if top is None:
        raise RematError(
            "no save set obeys the rules (a needed value can be neither saved nor recomputed)"
        )
    top_held = _held_activation_bytes(graph, problem, _valid(problem, top[0]))
    found = [top]
    if not problem.unsaveable & set(problem.needed):  # saving all backward reads: store-all
        found.append((set(problem.needed), frozenset()))
    for k in range(rungs - 1, -1, -1):
        cap = top_held * k // rungs
        chosen = cheapest_choice(graph, problem, op_seconds, bandwidth, cap, offload)
        if chosen is not None:
            found.append(chosen)
    unique = dict.fromkeys((frozenset(_valid(problem, saved)), moved) for saved, moved in found)
    return [(set(saved), moved) for saved, moved in unique]


def _valid(problem: JointProblem, saved: set[int]) -> set[int]:
    """A solver's save set less the values backward never reads (as `describe_save_set` drops
    them)."""
    return _reached(problem, saved, recomputed_values(problem, saved) or [])


def save_set_within(
    graph: Graph,
    problem: JointProblem,
    op_seconds: Sequence[float],
    bandwidth: float,
    budget_bytes: int | None,
    peak_model: PeakModel = joint_peak,
    offload: Offloadable | None = None,
) -> SaveSet:
    """The cheapest candidate save set (recompute + traffic + copy seconds; fewer saved values on
    a tie) whose predicted peak fits `budget_bytes`; None: the cheapest of all. Candidates are
    priced by `peak_model` cheapest first and only until one fits (a peak model may be costly:
    inductor's is a code generation). Unless the uncapped cheapest fits (or with `offload`),
    the search under per-window caps (`_shaped_within`) is tried too and kept where cheaper: the
    ladder's single caps cannot say that a late layer's values die before most gradients exist
    (issue 38: at full checkpointing's peak on a 12-layer GPT-2 the ladder recomputed matmuls).
    Raises InfeasibleBudget with the lowest predicted peak of any candidate when none fits."""
    if budget_bytes is None:
        top = cheapest_choice(graph, problem, op_seconds, bandwidth, None, offload)
        if top is None:
            raise RematError("no save set obeys the rules")
        return describe_save_set(graph, problem, top[0], op_seconds, peak_model, top[1], offload)

    def seconds(choice: tuple[set[int], frozenset[int]]) -> float:
        saved, moved = choice
        ops = _recomputed_ops(problem, recomputed_values(problem, saved) or [])
        recompute = sum(op_seconds[graph.op_by_name[o].index] for o in ops)
        copies = sum(offload.seconds[m] for m in moved) if offload else 0.0
        return recompute + sum(problem.values[v].cost for v in saved) / bandwidth + copies

    candidates = candidate_save_sets(graph, problem, op_seconds, bandwidth, offload=offload)
    described: list[SaveSet] = []
    fits = None
    for saved, moved in sorted(
        candidates, key=lambda choice: (seconds(choice), len(choice[0]), len(choice[1]))
    ):
        candidate = describe_save_set(graph, problem, saved, op_seconds, peak_model, moved, offload)
        if candidate.peak_bytes <= budget_bytes:
            fits = candidate
            break
        described.append(candidate)
    if offload is None and described:  # the uncapped cheapest (tried first) fits: no better
        reference = fits or min(described, key=lambda c: c.peak_bytes)
        shaped = _shaped_within(
            graph, problem, op_seconds, bandwidth, budget_bytes, peak_model, reference
        )
        if shaped is not None and (
            fits is None or _seconds(shaped, bandwidth) < _seconds(fits, bandwidth)
        ):
            return shaped
    if fits is not None:
        return fits
    lowest = min(described, key=lambda c: c.peak_bytes)
    raise InfeasibleBudget(
        f"no save set fits {format_bytes(budget_bytes)}: the lowest predicted peak is "
        f"{format_bytes(lowest.peak_bytes)} (holding {format_bytes(lowest.held_activation_bytes)} of "
        "activations for backward); raise the budget to at least that",
        budget_bytes=budget_bytes,
        min_feasible_bytes=lowest.peak_bytes,
    )


#: How many save sets `_shaped_within` solves and prices, searching for the caps' offset.
_SHAPED_TRIES = 6


def _seconds(save_set: SaveSet, bandwidth: float) -> float:
    """What `save_set_within` minimises: recompute, traffic and copy seconds."""
    return (
        save_set.recompute_seconds + save_set.traffic_bytes / bandwidth + save_set.transfer_seconds
    )


def _shaped_within(
    graph: Graph,
    problem: JointProblem,
    op_seconds: Sequence[float],
    bandwidth: float,
    budget_bytes: int,
    peak_model: PeakModel,
    reference: SaveSet,
) -> SaveSet | None:
    """The cheapest save set found under per-window caps (solvers/peak_windows.py) whose peak by
    `peak_model` fits the budget, or None. A window's cap is the budget less the persistent
    storages, the gradients made by then and one offset for everything else (the loss, the
    values being recomputed, the kernels' buffers): what those take depends on the peak model
    (inductor fuses what `joint_peak` counts op by op), so the offset is searched against it,
    starting from what `reference` needs beyond its held values and gradients: raised by what
    a save set overshot, lowered by what it left unused, then halved between the two,
    `_SHAPED_TRIES` save sets in all."""
    by_name = {v.name: i for i, v in enumerate(problem.values)}
    ends = peak_windows.backward_ends(graph, problem)
    storages = sorted({v.storage for v in problem.values})
    base = peak_windows.gradients_made(graph)
    persistent = sum(s.nbytes for s in graph.storages.values() if s.kind in PERSISTENT_KINDS)
    held = peak_windows.held_alive(
        graph, ends, {problem.values[by_name[n]].storage for n in reference.saved}
    )
    offset = reference.peak_bytes - persistent - max(g + h for g, h in zip(base, held, strict=True))
    best: SaveSet | None = None
    fits_at: int | None = None  # the largest offset known to fit, and the least known not to
    fails_at: int | None = None
    for _ in range(_SHAPED_TRIES):
        other = [persistent + g + offset for g in base]
        rows = peak_windows.windows(graph, ends, other, budget_bytes, storages)
        found = cheapest_choice(graph, problem, op_seconds, bandwidth, None, windows=rows)
        if found is None:  # too tight for any save set: loosen
            fits_at = offset
            move = -(abs(offset) // 2 + 1)
        else:
            candidate = describe_save_set(graph, problem, found[0], op_seconds, peak_model)
            move = candidate.peak_bytes - budget_bytes
            if move <= 0:
                fits_at = offset
                if best is None or _seconds(candidate, bandwidth) < _seconds(best, bandwidth):
                    best = candidate
            else:
                fails_at = offset
        if fits_at is not None and fails_at is not None:
            following = (fits_at + fails_at) // 2
        elif move > 0:  # overshot: tighten by at least a step, or a few bytes over stop it
            following = offset + max(move, budget_bytes // 1000)
        else:
            following = offset + move
        if best is not None and abs(following - offset) <= budget_bytes // 1000:
            break
        offset = following
    return best
