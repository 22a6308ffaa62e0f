"""Memory of a training step, predicted from a `Graph` by a liveness simulation.

A storage allocated by op `a` is live from `a` until both the program has dropped it
(`Storage.released_after`) and every autograd node that saved it has run (`Node.released_after`).
What exists before the step (parameters, buffers, inputs, optimizer state) is live throughout.
The peak of the step is the largest live total over all ops, forward, backward and optimizer step.

The step's liveness is `remat.schedule.simulate` with no checkpoint regions, the same judge that
checks every plan; this module adds what is not a plan's business: the optimizer step after the
backward, and the breakdown of saved bytes by module and by op type.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Literal

from remat.errors import RematError
from remat.graph import Graph
from remat.schedule import simulate

Optimizer = Literal["sgd", "adamw"] | None

#: Optimizer state per trainable parameter byte (torch.optim defaults: SGD without momentum keeps
#: nothing; AdamW keeps exp_avg and exp_avg_sq in the parameter's dtype).
OPTIMIZER_STATE_PER_PARAM_BYTE = {None: 0, "sgd": 0, "adamw": 2}
#: Transient bytes per parameter byte while `step()` runs: the foreach AdamW allocates the
#: sqrt(exp_avg_sq) list for all parameters of a device/dtype group at once.
OPTIMIZER_STEP_TEMP_PER_PARAM_BYTE = {None: 0, "sgd": 0, "adamw": 1}


@dataclass(frozen=True)
class ModuleBytes:
    module: str
    activation_bytes: int


@dataclass(frozen=True)
class OpBytes:
    op: str
    activation_bytes: int
    count: int


@dataclass(frozen=True)
class MemoryEstimate:
    activation_bytes: int
    peak_bytes: int
    param_bytes: int
    buffer_bytes: int
    input_bytes: int
    grad_bytes: int
    optimizer_state_bytes: int
    peak_op: str
    peak_phase: str
    by_module: tuple[ModuleBytes, ...]
    by_op: tuple[OpBytes, ...]
    timeline: tuple[tuple[int, int], ...]

    @property
    def fixed_bytes(self) -> int:
        """Memory no recomputation can save: parameters, buffers, inputs, grads, optimizer state."""
        return (
            self.param_bytes
            + self.buffer_bytes
            + self.input_bytes
            + self.grad_bytes
            + self.optimizer_state_bytes
        )

    def to_dict(self) -> dict:
        """The fields as plain data (`by_module`, `by_op` and `timeline` as tuples of dicts and
        pairs, which `json.dumps` writes as lists)."""
        return asdict(self)


def storage_deaths(graph: Graph) -> dict[int, int]:
    """Op index after which each storage allocated during the step is freed (len(ops) = at the end).

    With no regions the simulation's positions are the op indices."""
    return simulate(graph, (), base_bytes=0).deaths


def live_bytes_timeline(graph: Graph, base_bytes: int = 0) -> list[int]:
    """Live bytes while each op runs: its inputs, its new outputs and its kernel's scratch."""
    return list(simulate(graph, (), base_bytes=base_bytes).timeline)


def estimate(graph: Graph, optimizer: Optimizer = None) -> MemoryEstimate:
    """Activation bytes and the peak of the whole step (store-all: no recomputation)."""
    if optimizer not in OPTIMIZER_STATE_PER_PARAM_BYTE:
        raise RematError(f"optimizer must be one of None, 'sgd', 'adamw', got {optimizer!r}")
    trainable = (
        graph.bytes_of("param")
        if graph.info.get("trainable_param_bytes") is None
        else int(graph.info["trainable_param_bytes"])
    )
    state = OPTIMIZER_STATE_PER_PARAM_BYTE[optimizer] * trainable
    persistent = sum(s.nbytes for s in graph.storages.values() if s.allocated_at is None)
    step = simulate(graph, (), base_bytes=persistent + state)
    peak, peak_op, peak_phase = (
        step.peak_bytes,
        graph.ops[step.peak_position].name,
        graph.ops[step.peak_position].phase,
    )
    if optimizer is not None:
        at_end = (
            persistent
            + state
            + sum(
                graph.storages[sid].nbytes for sid, d in step.deaths.items() if d >= len(graph.ops)
            )
        )
        step_peak = at_end + OPTIMIZER_STEP_TEMP_PER_PARAM_BYTE[optimizer] * trainable
        if step_peak > peak:
            peak, peak_op, peak_phase = step_peak, f"{optimizer}.step", "optimizer"
    return MemoryEstimate(
        activation_bytes=graph.activation_bytes,
        peak_bytes=peak,
        param_bytes=graph.param_bytes,
        buffer_bytes=graph.buffer_bytes,
        input_bytes=graph.input_bytes,
        grad_bytes=graph.grad_bytes,
        optimizer_state_bytes=state,
        peak_op=peak_op,
        peak_phase=peak_phase,
        by_module=activation_bytes_by_module(graph),
        by_op=activation_bytes_by_op(graph),
        timeline=tuple(enumerate(step.timeline)),
    )


def _saved_owner(graph: Graph, storage_id: int) -> str | None:
    """The op a saved storage is charged to: the op that produced it, else the first op whose
    autograd node saved it (a model input saved by the first layer is charged to that layer)."""
    producer = graph.producer_op(storage_id)
    if producer is not None:
        return producer.name
    for sv in graph.saved_storages[storage_id]:
        node = graph.nodes.get(sv.node) if sv.node is not None else None
        if node is not None and node.forward_op is not None:
            return graph.ops[node.forward_op].name
    return None


def activation_bytes_by_module(graph: Graph) -> tuple[ModuleBytes, ...]:
    """Saved bytes per module path, inclusive of submodules, in forward order."""
    totals: dict[str, int] = defaultdict(int)
    for sid in graph.saved_storages:
        owner = _saved_owner(graph, sid)
        path = graph.op_by_name[owner].module if owner is not None else ""
        parts = path.split(".") if path else []
        totals[""] += graph.storages[sid].nbytes
        for depth in range(1, len(parts) + 1):
            totals[".".join(parts[:depth])] += graph.storages[sid].nbytes
    order = {m.path: i for i, m in reversed(list(enumerate(graph.modules)))}
    return tuple(
        ModuleBytes(module=p, activation_bytes=b)
        for p, b in sorted(totals.items(), key=lambda kv: order.get(kv[0], len(order)))
    )


def activation_bytes_by_op(graph: Graph) -> tuple[OpBytes, ...]:
    """Saved bytes per op type (`mm`, `native_dropout`, ...), largest first."""
    totals: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for sid in graph.saved_storages:
        owner = _saved_owner(graph, sid)
        key = graph.op_by_name[owner].short if owner is not None else "<input>"
        totals[key][0] += graph.storages[sid].nbytes
        totals[key][1] += 1
    return tuple(
        OpBytes(op=k, activation_bytes=v[0], count=v[1])
        for k, v in sorted(totals.items(), key=lambda kv: -kv[1][0])
    )
