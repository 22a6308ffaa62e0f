"""Offload in the compiled path: which saved values of a joint graph torch's compile offload pass
moves to host memory, the peak with them gone from the device, and the pass run for one compile.

torch 2.13's pass (`torch._functorch._activation_offloading`, run inside
`min_cut_rematerialization_partition` when `torch._functorch.config.enable_activation_offloading`
is on) offloads the forward nodes whose `meta["should_offload"]` is set. remat's partitioner sets
it on the saved values its plan offloads, with the config on only while that partition runs.

What the pass does (read from its source; docs/offload.md): by default (one stream) it inserts
`prims.device_put(x, cpu, non_blocking=True)` after the last forward reader of `x` and returns
that copy instead of `x`, and in backward `prims.device_put(x_cpu, device)` just before the first
reader. The copies run on the compute stream, so none hides behind compute: each is step time.
Its other mode (`activation_offload_separate_stream`: a side stream, waits sunk to the forward's
end, reloads prefetched by timing nodes on the GPU) remat leaves off: its pinned buffers are pooled
only inside `pinned_memory_pool()`, and its prefetch depends on kernel timings no plan has.
On the CPU the pass runs too, as same-device copies: the graphs carry the offload and reload ops
for exactly the tagged values and gradients are unchanged, but the bytes stay in the same memory.

The pass refuses views, `getitem`s (outputs of multi-output ops), non-contiguous tensors and the
model's outputs; remat offloads only what it accepts, and only storages the step allocates (not
parameters or inputs) that no other saved value shares, of at least `min_bytes`. With a budget
the budgeted save set's integer program chooses, per storage, keep, recompute or offload
(`remat.planning.solvers.saveset.Offloadable`); without one, every such storage goes.
"""

from __future__ import annotations

import contextlib
import importlib
import operator
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import torch
from torch import fx

from remat.device.cost import DeviceProfile
from remat.errors import RematError
from remat.planning.joint import JointContext, indices_of
from remat.planning.offload import OffloadSettings, copy_cost
from remat.planning.plans import Plan
from remat.planning.solvers.mincut import JointProblem, recomputed_values
from remat.planning.solvers.saveset import Offloadable, PeakModel, joint_peak
from remat.tracing.tensors import storage_nbytes

#: The names the pass gives the nodes it inserts (its `CPU_OFFLOAD_PREFIX`, `GPU_RELOAD_PREFIX`).
OFFLOAD_PREFIX = "cpu_offload_"
RELOAD_PREFIX = "gpu_reload_"


def pass_missing() -> str | None:
    """Why the installed torch cannot offload compiled graphs, or None where it can."""
    from torch._functorch import config as functorch_config

    if not hasattr(functorch_config, "enable_activation_offloading"):
        return "torch._functorch.config has no enable_activation_offloading"
    try:
        activation_offloading = importlib.import_module(
            "torch._functorch._activation_offloading.activation_offloading"
        )
    except ImportError as err:
        return f"torch._functorch._activation_offloading does not import ({err})"
    if not hasattr(activation_offloading, "enable_activation_offloading"):
        return "torch._functorch._activation_offloading has no enable_activation_offloading"
    return None


def require_pass() -> None:
    """Raise a `RematError` naming the torch version where compiled offload cannot run."""
    missing = pass_missing()
    if missing is not None:
        raise RematError(
            f"remat.compile(offload=...): torch {torch.__version__} has no compile offload pass "
            f"({missing}); install torch >= 2.13, or offload the eager step instead: "
            "remat.auto(model, *inputs, offload=True) or remat.apply(model, plan)"
        )


@contextlib.contextmanager
def pass_enabled() -> Iterator[None]:
    """torch's offload pass on (one stream, see the module's doc) for the partition inside,
    the config as it was after."""
    from torch._functorch import config as functorch_config

    with functorch_config.patch(
        enable_activation_offloading=True, activation_offload_separate_stream=False
    ):
        yield


def _offloadable(node: fx.Node) -> bool:
    """What torch's `can_offload` accepts of a saved value's node (model outputs aside)."""
    from torch._functorch.partitioners import get_default_op_list

    val = node.meta.get("val")
    return (
        node.op == "call_function"
        and node.target is not operator.getitem
        and not get_default_op_list().is_view(node)
        and isinstance(val, torch.Tensor)
        and val.is_contiguous()
    )


def candidates(
    node_of_value: dict[str, fx.Node],
    graph: Any,
    problem: JointProblem,
    settings: OffloadSettings,
) -> Offloadable:
    """The storages a save set may offload and their copy seconds (all exposed: the pass copies
    on the compute stream): an activation's storage of at least `min_bytes`, not a forward
    output, moved through the value of the op that allocated it, where the pass accepts that
    value (the one to tag; a view of it saved as well keeps the storage on the device, which the
    save set's program and `offloaded_storages` rule out)."""
    outputs = {graph.tensors[t].storage for t in graph.info.get("forward_outputs", ())}
    values = {}
    for value in problem.values:
        storage = graph.storages[value.storage]
        if (
            value.op is not None
            and graph.op_by_name[value.op].index == storage.allocated_at
            and storage.kind == "activation"
            and storage.nbytes >= settings.min_bytes
            and storage.id not in outputs
            and _offloadable(node_of_value[value.name])
        ):
            values.setdefault(storage.id, value.name)
    seconds = {
        m: copy_cost(
            graph.storages[m].nbytes, settings.link, 0.0, 0.0, settings.ranks_on_link
        ).exposed_seconds
        for m in values
    }
    return Offloadable(values, seconds, settings.host_budget_bytes)


def offloaded_storages(
    node_of_value: dict[str, fx.Node],
    graph: Any,
    problem: JointProblem,
    saved: set[int],
    settings: OffloadSettings,
) -> frozenset[int]:
    """Without a budget, every storage of `candidates` whose value is saved and shares its
    storage with no other saved value; the largest first while the host memory cap allows."""
    movable = candidates(node_of_value, graph, problem, settings).values
    names = {problem.values[v].name for v in saved}
    saved_on: dict[int, int] = {}
    for v in saved:
        saved_on[problem.values[v].storage] = saved_on.get(problem.values[v].storage, 0) + 1
    chosen = sorted(
        (m for m, name in movable.items() if name in names and saved_on[m] == 1),
        key=lambda m: (-graph.storages[m].nbytes, m),
    )
    cap, host, out = settings.host_budget_bytes, 0, set()
    for m in chosen:
        if cap is None or host + graph.storages[m].nbytes <= cap:
            out.add(m)
            host += graph.storages[m].nbytes
    return frozenset(out)


def offloading_peaks(node_of_value: dict[str, fx.Node], settings: OffloadSettings) -> PeakModel:
    """`joint_peak` with `offloaded_storages` of each save set off the device between their last
    forward reader and their first backward one (the unbudgeted compile's offload)."""

    def peak(graph: Any, problem: JointProblem, saved: set[int], recomputed: list[int]) -> int:
        storages = offloaded_storages(node_of_value, graph, problem, saved, settings)
        return joint_peak(graph, problem, saved, recomputed, storages)

    return peak


def offload_fields(
    node_of_value: dict[str, fx.Node],
    graph: Any,
    problem: JointProblem,
    saved: set[int],
    recomputed: list[int],
    storages: frozenset[int],
    settings: OffloadSettings,
) -> dict[str, Any]:
    """A compiled plan's offload of `storages` (`Plan` fields): the tagged values by node name,
    their host bytes, the copy seconds (all exposed: the pass copies on the compute stream) and
    how much lower the peak is than the same save set's without offload."""
    movable = candidates(node_of_value, graph, problem, settings)
    host = sum(graph.storages[m].nbytes for m in storages)
    drop = joint_peak(graph, problem, saved, recomputed) - joint_peak(
        graph, problem, saved, recomputed, storages
    )
    return {
        "offload": tuple(node_of_value[movable.values[m]].name for m in sorted(storages)),
        "offload_min_bytes": settings.min_bytes,
        "host_bytes": host,
        "transfer_seconds": sum(movable.seconds[m] for m in storages),
        "offload_drop_bytes": drop,
    }


def tag(nodes: list[fx.Node], names: tuple[str, ...]) -> None:
    """Mark the saved nodes named `names` for the pass (and no other)."""
    wanted = set(names)
    for node in nodes:
        if node.name in wanted:
            node.meta["should_offload"] = True
        else:
            node.meta.pop("should_offload", None)


def graph_transfers(forward: fx.GraphModule, backward: fx.GraphModule) -> dict[str, Any]:
    """What the pass put in the partitioned graphs: the forward nodes it copies to host (name ->
    bytes) and the saved values backward reloads, read from the graphs' own nodes."""
    offloaded = {}
    for node in forward.graph.nodes:
        if node.op == "call_function" and node.name.startswith(OFFLOAD_PREFIX):
            val = node.args[0].meta.get("val")
            offloaded[node.name[len(OFFLOAD_PREFIX) :]] = storage_nbytes(val)
    reloaded = sorted(
        node.name[len(RELOAD_PREFIX) :]
        for node in backward.graph.nodes
        if node.op == "call_function" and node.name.startswith(RELOAD_PREFIX)
    )
    return {"offloaded_in_graph": offloaded, "reloaded_in_graph": reloaded}


def with_offload(
    jg: Any,
    nodes: list[fx.Node],
    plan: Plan,
    profile: DeviceProfile,
    settings: OffloadSettings,
    budgeted: bool,
) -> Plan:
    """`plan` (of `jg`, a `remat.applying.compiled.JointGraph`) with the saved values it
    offloads: those its budgeted save set chose, or without a budget all the pass can move;
    those nodes tagged for torch's offload pass."""
    problem = JointContext(jg.graph, jg.must_save, jg.must_recompute, profile).problem()
    saved = indices_of(problem, [s.name for s in plan.saved])
    recomputed = recomputed_values(problem, saved) or []
    if budgeted:
        moved = indices_of(problem, plan.details.get("offloaded_values", []))
        storages = frozenset(problem.values[v].storage for v in moved)
    else:
        storages = offloaded_storages(jg.node_of_value, jg.graph, problem, saved, settings)
    fields = offload_fields(
        jg.node_of_value, jg.graph, problem, saved, recomputed, storages, settings
    )
    tag(nodes, fields["offload"])
    return replace(plan, **fields)
