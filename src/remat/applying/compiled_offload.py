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
parameters or inputs) that no other saved value shares, of at least `min_bytes`.
"""

from __future__ import annotations

import contextlib
import importlib
import operator
from collections.abc import Iterator
from typing import Any

import torch
from torch import fx

from remat.errors import RematError
from remat.planning.offload import OffloadSettings, copy_cost
from remat.planning.solvers.mincut import JointProblem
from remat.planning.solvers.saveset import PeakModel, joint_peak
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


def offloaded_values(
    node_of_value: dict[str, fx.Node],
    graph: Any,
    problem: JointProblem,
    saved: set[int],
    settings: OffloadSettings,
) -> list[int]:
    """The saved values (indices into `problem.values`) remat tags for the pass: an activation's
    whole storage, not shared with another saved value or a forward output, that the pass
    accepts, of at least `min_bytes`; the largest first while the host memory cap allows."""
    values = problem.values
    sharing: dict[int, int] = {}
    for v in saved:
        sharing[values[v].storage] = sharing.get(values[v].storage, 0) + 1
    outputs = {graph.tensors[t].storage for t in graph.info.get("forward_outputs", ())}
    candidates = []
    for v in saved:
        storage = graph.storages[values[v].storage]
        node = node_of_value[values[v].name]
        if (
            storage.kind == "activation"
            and storage.nbytes >= settings.min_bytes
            and sharing[storage.id] == 1
            and storage.id not in outputs
            and _offloadable(node)
        ):
            candidates.append(v)
    candidates.sort(key=lambda v: (-graph.storages[values[v].storage].nbytes, v))
    cap = settings.host_budget_bytes
    chosen, host = [], 0
    for v in candidates:
        nbytes = graph.storages[values[v].storage].nbytes
        if cap is None or host + nbytes <= cap:
            chosen.append(v)
            host += nbytes
    return sorted(chosen)


def offloading_peaks(node_of_value: dict[str, fx.Node], settings: OffloadSettings) -> PeakModel:
    """`joint_peak` with the values `offloaded_values` picks for each save set off the device
    between their last forward reader and their first backward one."""

    def peak(graph: Any, problem: JointProblem, saved: set[int], recomputed: list[int]) -> int:
        chosen = offloaded_values(node_of_value, graph, problem, saved, settings)
        storages = frozenset(problem.values[v].storage for v in chosen)
        return joint_peak(graph, problem, saved, recomputed, storages)

    return peak


def offload_fields(
    node_of_value: dict[str, fx.Node],
    graph: Any,
    problem: JointProblem,
    saved: set[int],
    recomputed: list[int],
    settings: OffloadSettings,
) -> dict[str, Any]:
    """A compiled plan's offload (`Plan` fields): the tagged values by node name, their host
    bytes, the copy seconds (all exposed: the pass copies on the compute stream) and how much
    lower the peak is than the same save set's without offload."""
    chosen = offloaded_values(node_of_value, graph, problem, saved, settings)
    storages = frozenset(problem.values[v].storage for v in chosen)
    host = sum(graph.storages[sid].nbytes for sid in storages)
    cost = copy_cost(host, settings.link, 0.0, 0.0, settings.ranks_on_link)
    drop = joint_peak(graph, problem, saved, recomputed) - joint_peak(
        graph, problem, saved, recomputed, storages
    )
    return {
        "offload": tuple(node_of_value[problem.values[v].name].name for v in chosen),
        "offload_min_bytes": settings.min_bytes,
        "host_bytes": host,
        "transfer_seconds": cost.exposed_seconds,
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
