"""The compiled path: remat decides the save set inside torch.compile, with a byte budget.

AOTAutograd traces the forward and backward of a compiled graph into one joint FX graph and hands it
to a partition function, which splits it into the forward graph (which also returns the values to
save) and the backward graph (which recomputes what was not saved). Torch's own partitioner picks
the save set with a min-cut plus a 0-1 `activation_memory_budget`, a share of saved bytes that does
not bound the peak. remat keeps torch's partitioning machinery (dead-code elimination, CSE,
selective-checkpoint tags, RNG functionalisation, effect tokens, graph extraction, the backward's
autograd order: the field's own parts) and replaces only the decision, `choose_saved_values_set`:

1. the joint graph becomes a remat `Graph` (forward ops, backward ops, storages from the fake
   tensors' storages, FLOPs from `torch.utils.flop_counter`), so the solvers in `solvers/` run on
   it unchanged;
2. `mincut` is the min-cut article's network (solvers/mincut.py), banning recomputation of
   compute-intensive ops as AOTAutograd does; `milp` is the budgeted save set (solvers/saveset.py):
   least recompute + traffic seconds with a predicted peak within the budget; `auto` takes the
   min-cut when it fits the budget, else the budgeted one;
3. user intent wins: ops a selective-checkpoint policy tagged MUST_SAVE are never recomputed,
   MUST_RECOMPUTE / PREFER_RECOMPUTE ones never saved, and random ops are never recomputed unless
   tagged so (torch then replays their RNG state).

Each compiled graph's decision is kept as a `Plan` (explainable, JSON) on the backend.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import CheckpointPolicy
from torch.utils.flop_counter import flop_registry

from remat.applying import compiled_offload
from remat.applying.first_step import check_compiled
from remat.device.cost import DeviceProfile, get_profile
from remat.errors import RematError
from remat.graph import Graph, Node, Op, Saved, Storage, Tensor
from remat.planning import strategies
from remat.planning.joint import JointContext, indices_of
from remat.planning.offload import OffloadSettings, settings_for
from remat.planning.plans import Plan, PlanStatus, SavedTensor, resolve_budget
from remat.planning.solvers.mincut import JointProblem
from remat.planning.solvers.saveset import (
    PeakModel,
    SaveSet,
    describe_save_set,
    joint_peak,
    loss_bytes,
)
from remat.tracing.kernels import EXTRA_FLOPS
from remat.tracing.tensors import dtype_name, storage_key, storage_nbytes
from remat.units import format_bytes

COMPILERS = ("inductor", "aot_eager")
#: How a compiled plan's peak is predicted: from inductor's own generated code (exact up to
#: kernels' internal scratch; one code generation per save set tried), or op by op (instant;
#: exact under aot_eager, 0-18% off under inductor's fusion).
PEAK_MODELS = ("inductor", "op-by-op")

_RECOMPUTE_TAGS = (CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE)


@dataclass
class JointGraph:
    """A joint graph as remat sees it: the `Graph`, and for each value name the FX node to save."""

    graph: Graph
    node_of_value: dict[str, fx.Node]
    must_save: frozenset[str]  # op names tagged MUST_SAVE
    must_recompute: frozenset[str]  # op names tagged MUST_RECOMPUTE or PREFER_RECOMPUTE
    saved_symbols: list[fx.Node]  # non-tensor forward values backward reads (sizes)


def _tensors_of(val: Any) -> list[torch.Tensor | None]:
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (tuple, list)):
        return [v if isinstance(v, torch.Tensor) else None for v in val]
    return []


def _flops(node: fx.Node) -> int:
    """The node's FLOPs by torch's formulas, else by remat's (`EXTRA_FLOPS`: the CPU's flash
    attention, which without them was priced as traffic alone, 0.6 ms for 8 ms of work on the
    issue 38 harness GPT-2, so budgeted plans recomputed all 12 layers' attention)."""
    packet = getattr(node.target, "_overloadpacket", None)
    formula = flop_registry.get(packet) or EXTRA_FLOPS.get(getattr(packet, "__name__", ""))
    if formula is None:
        return 0
    args, kwargs = pytree.tree_map_only(
        fx.Node, lambda n: n.meta.get("val"), (node.args, node.kwargs)
    )
    try:
        return int(formula(*args, **kwargs, out_val=node.meta.get("val")))
    except Exception:  # a formula that cannot read these arguments: count no FLOPs
        return 0


def _module_path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
    if not stack:
        return ""
    path = str(list(stack.values())[-1][0])
    return path.replace("L['self'].", "").replace("L['self']", "")


def joint_graph(joint: fx.Graph, node_info: Any, num_fwd_outputs: int) -> JointGraph:
    """The joint graph (after torch's partitioner prepared it) as a remat `Graph`: forward ops are
    the nodes that do not depend on the tangents, in graph order, then the backward ops. Value
    names are FX node names (`<node>:<k>` for output k of a multi-output node)."""
    bw_nodes = set(node_info.tangents_closure) | set(node_info.required_bw_nodes)
    primals = set(node_info.inputs)
    params = set(node_info.static_lifetime_input_nodes)
    storages: dict[int, Storage] = {}
    by_key: dict[int, int] = {}
    tensors: dict[int, Tensor] = {}
    tensor_of: dict[fx.Node, list[int]] = {}
    node_of_value: dict[str, fx.Node] = {}
    ops: list[Op] = []

    def new_tensor(t: torch.Tensor, kind: str, producer: int | None) -> int:
        key = storage_key(t)
        if key not in by_key:
            sid = by_key[key] = len(storages)
            at = producer if kind == "activation" else None
            storages[sid] = Storage(sid, storage_nbytes(t), kind, at)
        tid = len(tensors)
        tensors[tid] = Tensor(
            tid,
            by_key[key],
            tuple(t.shape),
            dtype_name(t.dtype),
            t.numel() * t.element_size(),
            producer,
            tuple(t.stride()),
        )
        return tid

    for node in joint.nodes:
        val = node.meta.get("val")
        if node.op != "placeholder" or not isinstance(val, torch.Tensor):
            continue
        kind = "param" if node in params else "input" if node in primals else "grad"
        tid = new_tensor(val, kind, None)
        tensor_of[node] = [tid]
        if kind != "grad":
            node_of_value.setdefault(f"input:{tensors[tid].storage}", node)

    calls = [n for n in joint.nodes if n.op == "call_function"]
    ordered = [n for n in calls if n not in bw_nodes] + [n for n in calls if n in bw_nodes]
    elements: dict[fx.Node, list[int | None]] = {}
    for node in ordered:
        if node.target is operator.getitem:
            source, k = node.args
            tid = elements.get(source, [])[k] if k < len(elements.get(source, [])) else None
            tensor_of[node] = [tid] if tid is not None else []
            continue
        index = len(ops)
        inputs = tuple(
            dict.fromkeys(
                tid
                for arg in pytree.tree_leaves((node.args, node.kwargs))
                if isinstance(arg, fx.Node)
                for tid in tensor_of.get(arg, [])
            )
        )
        val = node.meta.get("val")
        outs = _tensors_of(val)
        ids = [new_tensor(t, "activation", index) if t is not None else None for t in outs]
        present = [tid for tid in ids if tid is not None]
        elements[node] = ids
        tensor_of[node] = present if isinstance(val, torch.Tensor) else []
        ops.append(
            Op(
                index=index,
                name=node.name,
                target=str(node.target),
                module=_module_path(node),
                phase="backward" if node in bw_nodes else "forward",
                inputs=inputs,
                outputs=tuple(present),
                flops=_flops(node),
                node=0 if node in bw_nodes else None,
            )
        )
        if isinstance(val, torch.Tensor):
            node_of_value[node.name] = node
        for user in node.users:
            if user.target is operator.getitem and ids[user.args[1]] is not None:
                k = present.index(ids[user.args[1]])
                node_of_value[f"{node.name}:{k}" if len(present) > 1 else node.name] = user

    output = next(n for n in joint.nodes if n.op == "output")
    results = list(output.args[0])
    fwd_outputs = [n for n in results[:num_fwd_outputs] if isinstance(n, fx.Node)]
    bwd_outputs = [n for n in results[num_fwd_outputs:] if isinstance(n, fx.Node)]
    forward_made = {tid for op in ops if op.phase == "forward" for tid in op.outputs}
    forward_made |= {
        tid for tid, t in tensors.items() if storages[t.storage].kind in ("param", "input")
    }
    needed: dict[int, int] = {}
    readers = [tid for op in ops if op.phase == "backward" for tid in op.inputs]
    readers += [tid for n in bwd_outputs for tid in tensor_of.get(n, [])]
    for tid in readers:
        if tid in forward_made:
            needed.setdefault(tid, tensors[tid].storage)
    backward_ops = [op for op in ops if op.phase == "backward"]
    saved_symbols = [
        n
        for n in joint.nodes
        if n not in bw_nodes
        and n.op != "output"
        and isinstance(n.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool))
        and any(u in bw_nodes for u in n.users)
    ]
    graph = Graph(
        ops=ops,
        tensors=tensors,
        storages=storages,
        saved=[Saved(storage=sid, tensor=tid, node=0) for tid, sid in needed.items()],
        nodes={0: Node(0, "backward", None, backward_ops[-1].index if backward_ops else None)},
        modules=[],
        info={
            "forward_outputs": [t for n in fwd_outputs for t in tensor_of.get(n, [])],
            "backward_outputs": [t for n in bwd_outputs for t in tensor_of.get(n, [])],
        },
    )
    tags = {n.name: n.meta.get("recompute") for n in ordered}
    return JointGraph(
        graph=graph,
        node_of_value=node_of_value,
        must_save=frozenset(k for k, v in tags.items() if v == CheckpointPolicy.MUST_SAVE),
        must_recompute=frozenset(k for k, v in tags.items() if v in _RECOMPUTE_TAGS),
        saved_symbols=saved_symbols,
    )


def decide(
    jg: JointGraph,
    strategy: str,
    budget: int | str | None,
    profile: DeviceProfile,
    peak_model: PeakModel = joint_peak,
    offload: OffloadSettings | None = None,
) -> tuple[SaveSet, Plan]:
    """remat's save set for one joint graph by the registered `strategy`, and its plan; peaks
    (and budgets given as a share) by `peak_model`. With `offload`, the budgeted save set may
    also move storages to host memory, tensor by tensor (`compiled_offload.candidates`)."""
    joint = JointContext(jg.graph, jg.must_save, jg.must_recompute, profile, peak_model)
    if offload is not None:
        joint.offload = compiled_offload.candidates(
            jg.node_of_value, jg.graph, joint.problem(), offload
        )
    budget_bytes = (
        None
        if budget is None
        else resolve_budget(budget, joint.fixed_bytes, joint.store_all.peak_bytes)
    )
    solve = strategies.get(strategy, "compile").solve_compiled
    chosen = solve(joint, budget_bytes)
    status = "optimal" if chosen is joint.__dict__.get("min_cut") else "feasible"
    return chosen, _plan(jg, chosen, strategy, budget_bytes, profile, joint.store_all, status)


def _plan(
    jg: JointGraph,
    chosen: SaveSet,
    strategy: str,
    budget_bytes: int | None,
    profile: DeviceProfile,
    store_all: SaveSet,
    status: PlanStatus,
) -> Plan:
    graph = jg.graph
    by_name = graph.op_by_name
    saved = []
    for name in chosen.saved:
        node = jg.node_of_value[name]
        val = node.meta.get("val")
        nbytes = storage_nbytes(val) if isinstance(val, torch.Tensor) else 0
        saved.append(
            SavedTensor(name, str(node.target) if node.op == "call_function" else "input", nbytes)
        )
    moved = {"offloaded_values": list(chosen.offloaded)} if chosen.offloaded else {}
    recompute_flops = sum(by_name[o].flops for o in chosen.recomputed)
    reason = (
        f"{strategy}: saves {len(chosen.saved)} values ({format_bytes(chosen.held_bytes)}, "
        f"{format_bytes(chosen.traffic_bytes)} of traffic) and recomputes "
        f"{len(chosen.recomputed)} forward ops in backward; store-all saves "
        f"{format_bytes(store_all.held_bytes)}"
    )
    return Plan(
        strategy=f"compile:{strategy}",
        budget_bytes=budget_bytes,
        regions=(),
        predicted_peak_bytes=chosen.peak_bytes,
        held_bytes=chosen.held_bytes,
        recompute_flops=recompute_flops,
        recompute_seconds=chosen.recompute_seconds,
        forward_flops=sum(op.flops for op in graph.forward_ops),
        profile=profile.name,
        reason=reason,
        path="compile",
        appliable=False,
        status=status,
        saved=tuple(saved),
        recomputed=chosen.recomputed,
        details={
            "held_activation_bytes": chosen.held_activation_bytes,  # held_bytes less the graph's inputs
            "traffic_bytes": chosen.traffic_bytes,
            "store_all_peak_bytes": store_all.peak_bytes,
            "store_all_held_bytes": store_all.held_bytes,
            **moved,
        },
    )


@contextlib.contextmanager
def _replaced(module: Any, name: str, value: Any) -> Iterator[None]:
    original = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, original)


class _UnreadablePlan(Exception):
    """Inductor's plan for a save set could not be generated or replayed (a torch internal
    changed, an op without a meta kernel): the decision falls back to the op-by-op model."""


class _InductorPeaks:
    """A `PeakModel` from inductor's own buffer plan (remat.prediction.inductor_plan): the save set is
    partitioned by torch's pipeline, both graphs are code-generated by inductor and replayed on
    meta tensors. Memoised per save set: each reading is a code generation (seconds)."""

    def __init__(
        self,
        root: fx.GraphModule,
        joint: fx.Graph,
        joint_inputs: Any,
        partition_kwargs: dict[str, Any],
        jg: JointGraph,
    ):
        self.root = root
        self.joint = joint
        self.joint_inputs = joint_inputs
        self.partition_kwargs = partition_kwargs
        self.jg = jg
        self.cache: dict[tuple[str, ...], int] = {}
        #: save set (its nodes' names) -> the bytes autograd saves for it under inductor
        self.saved_bytes: dict[frozenset[str], int] = {}

    def __call__(
        self, graph: Graph, problem: JointProblem, saved: set[int], recomputed: list[int]
    ) -> int:
        from remat.prediction import inductor_plan

        names = tuple(
            self.jg.node_of_value[problem.values[v].name].name for v in sorted(saved)
        ) + tuple(n.name for n in self.jg.saved_symbols)
        if names not in self.cache:
            try:
                forward, backward = inductor_plan.partition(
                    self.root, self.joint, self.joint_inputs, names, self.partition_kwargs
                )
                step = inductor_plan.step_peak(
                    forward,
                    backward,
                    self.partition_kwargs["num_fwd_outputs"],
                    self.partition_kwargs.get("static_lifetime_input_indices") or [],
                    loss_bytes(graph),
                )
            except Exception as err:  # noqa: BLE001 - any failure means: no inductor plan here
                raise _UnreadablePlan(f"{type(err).__name__}: {err}") from err
            self.cache[names] = step.peak_bytes
            self.saved_bytes[frozenset(names)] = step.saved_bytes
        return self.cache[names]


try:  # torch >= 2.9 lets inductor take a custom partitioner
    from torch._inductor.custom_graph_pass import CustomPartitionerFn as _PartitionerBase
except ImportError:  # pragma: no cover - older torch: only compiler="aot_eager"
    _PartitionerBase = object  # type: ignore[assignment,misc]


class _Partitioner(_PartitionerBase):  # type: ignore[misc,valid-type]
    """AOTAutograd's min-cut partition pipeline with remat's choice of the values to save."""

    def __init__(self, backend: RematBackend):
        self.backend = backend

    def __call__(
        self, gm: fx.GraphModule, joint_inputs: Any, **kwargs: Any
    ) -> tuple[fx.GraphModule, fx.GraphModule]:
        from torch._functorch import partitioners

        num_fwd_outputs = kwargs["num_fwd_outputs"]
        torch_choice = partitioners.choose_saved_values_set
        backend = self.backend

        settings = backend.offload
        # with a budget the save set's program chooses what to offload, per tensor; without
        # one, everything the pass can move goes (the lowest peak)
        budgeted = settings is not None and backend.budget is not None

        def choose(joint: fx.Graph, node_info: Any, memory_budget: float = 1) -> list[fx.Node]:
            jg = joint_graph(joint, node_info, num_fwd_outputs)
            peaks = (
                _InductorPeaks(gm, joint, joint_inputs, kwargs, jg)
                if backend.peak_model == "inductor"
                else None
            )
            op_by_op = (
                joint_peak
                if settings is None or budgeted
                else compiled_offload.offloading_peaks(jg.node_of_value, settings)
            )

            def decision(peak_model: PeakModel) -> tuple[list[fx.Node], Plan]:
                if backend.strategy == "torch":
                    nodes = torch_choice(joint, node_info, memory_budget=memory_budget)
                    _, plan = _priced(jg, nodes, backend.profile, memory_budget, peak_model)
                    return nodes, plan
                chosen, plan = decide(
                    jg,
                    backend.strategy,
                    backend.budget,
                    backend.profile,
                    peak_model,
                    settings if budgeted else None,
                )
                return [jg.node_of_value[n] for n in chosen.saved] + jg.saved_symbols, plan

            if peaks is None:
                nodes, plan = decision(op_by_op)
                plan.details["peak_model"] = "op-by-op"
            else:
                try:
                    nodes, plan = decision(peaks)
                    plan.details["peak_model"] = "inductor"
                    plan.details["inductor_plans_read"] = len(peaks.cache)
                    # what inductor's forward saves: its layout copies (a convolution's
                    # channels-last input and weight) instead of the values they copy
                    held = peaks.saved_bytes.get(frozenset(n.name for n in nodes))
                    if held is not None:
                        plan = replace(plan, held_bytes=held)
                except _UnreadablePlan as unreadable:
                    warnings.warn(
                        f"remat could not read inductor's buffer plan ({unreadable}); this "
                        "graph's peaks are counted op by op, which under inductor's fusion is an "
                        "estimate, not inductor's own plan",
                        stacklevel=2,
                    )
                    nodes, plan = decision(joint_peak)
                    plan.details["peak_model"] = "op-by-op"
            if settings is not None:
                plan = compiled_offload.with_offload(
                    jg, nodes, plan, backend.profile, settings, budgeted
                )
            backend.graphs.append(jg.graph)
            backend.plans.append(plan)
            return nodes

        with contextlib.ExitStack() as stack:
            stack.enter_context(_replaced(partitioners, "choose_saved_values_set", choose))
            if settings is not None:
                stack.enter_context(compiled_offload.pass_enabled())
            forward, backward = partitioners.min_cut_rematerialization_partition(
                gm, joint_inputs, **kwargs
            )
        if settings is not None and backend.plans:
            backend.plans[-1].details.update(compiled_offload.graph_transfers(forward, backward))
        return forward, backward

    def uuid(self) -> None:
        return None  # no inductor cache: a cached graph would skip the partitioner and its plan


def _priced(
    jg: JointGraph,
    nodes: list[fx.Node],
    profile: DeviceProfile,
    memory_budget: float,
    peak_model: PeakModel = joint_peak,
) -> tuple[SaveSet, Plan]:
    """Torch's own save set, priced and described by remat's model (for side-by-side rows)."""
    joint = JointContext(jg.graph, jg.must_save, jg.must_recompute, profile, peak_model)
    problem = joint.problem()
    name_of = {node: name for name, node in jg.node_of_value.items()}
    chosen = indices_of(problem, [name_of[n] for n in nodes if n in name_of])
    save_set = describe_save_set(jg.graph, problem, chosen, joint.op_seconds, peak_model)
    plan = _plan(
        jg, save_set, f"torch@{memory_budget:g}", None, profile, joint.store_all, "feasible"
    )
    return save_set, plan


@dataclass
class RematBackend:
    """A torch.compile backend whose partitioner is remat's. `plans` and `graphs` collect, per
    compiled graph (one per graph break), the decision and the joint graph it was made on."""

    budget: int | str | None = None
    strategy: str = "auto"
    profile: str | DeviceProfile = "cpu"
    compiler: str = "inductor"
    peak_model: str | None = None  # None: "inductor" under inductor, else "op-by-op"
    #: saved values to host memory by torch's compile offload pass (None: none)
    offload: OffloadSettings | None = None
    plans: list[Plan] = field(default_factory=list)
    graphs: list[Graph] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.strategy != "torch":  # 'torch' records torch's own partitioner's choice
            strategies.get(self.strategy, "compile")
        if self.compiler not in COMPILERS:
            raise RematError(
                f"compiler {self.compiler!r} is unknown: choose 'inductor' (fused kernels) or "
                "'aot_eager' (the same graphs run op by op, for debugging)"
            )
        if self.offload is not None:
            compiled_offload.require_pass()
            if self.peak_model == "inductor":
                raise RematError(
                    "peak_model='inductor' does not fit offload: inductor's buffer plan is read "
                    "without torch's offload pass; choose peak_model='op-by-op' (the default "
                    "with offload)"
                )
            self.peak_model = "op-by-op"
        if self.peak_model is None:
            self.peak_model = "inductor" if self.compiler == "inductor" else "op-by-op"
        if self.peak_model not in PEAK_MODELS or (
            self.peak_model == "inductor" and self.compiler != "inductor"
        ):
            raise RematError(
                f"peak_model {self.peak_model!r} does not fit compiler {self.compiler!r}: choose "
                "'inductor' (inductor's own buffer plan, under compiler='inductor') or 'op-by-op'"
            )
        self.profile = get_profile(self.profile)

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        partitioner = _Partitioner(self)
        if self.compiler == "aot_eager":
            from torch._dynamo.backends.common import aot_autograd
            from torch._dynamo.backends.debugging import boxed_nop

            return aot_autograd(
                fw_compiler=boxed_nop, bw_compiler=boxed_nop, partition_fn=partitioner
            )(gm, example_inputs)
        from torch._inductor import config as inductor_config
        from torch._inductor.compile_fx import compile_fx

        if not hasattr(inductor_config, "custom_partitioner_fn"):
            raise RematError(
                f"torch {torch.__version__} cannot give inductor a custom partitioner; use "
                "compiler='aot_eager' or a newer torch"
            )
        from torch._functorch import config as functorch_config

        patches: dict[str, Any] = {"custom_partitioner_fn": partitioner, "fx_graph_cache": False}
        if self.strategy != "torch":  # torch's own rows keep inductor's rules as they are
            patches["post_grad_custom_pre_pass"] = _addmm_in_order_pass(
                inductor_config.post_grad_custom_pre_pass
            )
        # A cached graph would skip the partitioner (and so the plan): no caches for these graphs.
        # The patches hold for the backward too, which inductor compiles later, at first use.
        with functorch_config.patch(enable_autograd_cache=False):
            return compile_fx(gm, example_inputs, config_patches=patches)


#: The graphs (forward and backward, as inductor's post-grad passes see them) of remat's plans,
#: where inductor fuses `mm + c` into `addmm` only if `c` comes first (`_addmm_in_order_pass`).
_IN_ORDER_GRAPHS: weakref.WeakSet[fx.Graph] = weakref.WeakSet()


def _addmm_in_order_pass(then: Any) -> Any:
    """A post-grad pre-pass (then inductor's passes, and `then`, a user's) that marks the graph
    for `_addmm_in_order`. Why: inductor's post-grad pattern fuses `mm(a, b) + c` into
    `addmm(c, a, b)`, which runs the product where `c` is ready. In a backward that can be the
    very end: a tied embedding's weight gradient (the LM head's product plus the embedding's
    gradient) then keeps the logits' gradient (batch x seq x vocab, fp32) and the head's input
    alive through the whole backward, which run op by op die at once (GPT-2 style, 12 layers,
    b4 s256: 32 MiB; without the rule remat.compile could not reach eager full checkpointing's
    peak). Returns `then` unchanged where this torch has no such pattern."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    if not _install_addmm_in_order():
        return then
    # One pass that runs the user's after it: torch < 2.13 takes a single pass, not a tuple.
    users = tuple(then) if isinstance(then, (list, tuple)) else (() if then is None else (then,))

    class AddmmInOrder(CustomGraphPass):
        def __call__(self, graph: fx.Graph) -> None:
            _IN_ORDER_GRAPHS.add(graph)
            for user_pass in users:
                user_pass(graph)

        def uuid(self) -> Any:
            keys = [getattr(p, "uuid", lambda: None)() for p in users]
            return None if None in keys else ("remat-addmm-in-order", *keys)

    return AddmmInOrder()


@functools.cache
def _install_addmm_in_order() -> bool:
    """Wrap the extra check of inductor's `mm + c -> addmm` patterns once, for the process: on a
    graph in `_IN_ORDER_GRAPHS` the fusion also needs `c` defined before the product; on any
    other graph the check is inductor's own. False where the patterns are not found."""
    try:
        from torch._inductor.fx_passes import post_grad
    except ImportError:  # pragma: no cover - no inductor
        return False
    original = getattr(post_grad, "is_valid_addmm_fusion", None)
    if original is None or not hasattr(post_grad, "pass_patterns"):
        return False

    def in_order(match: Any) -> bool:
        if not original(match):
            return False
        product = next((n for n in match.nodes if n.target is torch.ops.aten.mm.default), None)
        if product is None or product.graph not in _IN_ORDER_GRAPHS:
            return True
        addend = match.kwargs["inp"]
        for node in product.graph.nodes:  # whichever comes first
            if node is addend:
                return True
            if node is product:
                return False
        return True

    wrapped = 0
    for entries in post_grad.pass_patterns[2].patterns.values():
        for entry in entries:
            if getattr(entry, "extra_check", None) is original:
                object.__setattr__(entry, "extra_check", in_order)
                wrapped += 1
    return wrapped > 0


def backend(
    budget: int | str | None = None,
    strategy: str = "auto",
    profile: str | DeviceProfile = "cpu",
    compiler: str = "inductor",
    peak_model: str | None = None,
    offload: OffloadSettings | bool | None = None,
) -> RematBackend:
    """A torch.compile backend with remat's partitioner: `torch.compile(model, backend=...)`.

    `budget` bounds the predicted peak of each compiled graph's forward + backward, in bytes
    (`"2GiB"`, an int) or as a share (`"50%"`: the parameters, inputs and gradients plus that share
    of the rest of the peak when everything backward needs is saved). `strategy`: `mincut` (the
    article's least-traffic cut; no budget), `milp` (least recompute + traffic time within the
    budget), `auto` (the min-cut when it fits, else `milp`): `remat.planning.strategies.available("compile")`.
    `profile` names the cost profile (cpu, a100, h100, h200) or is a `DeviceProfile`.
    `peak_model`: how each candidate save set's peak is predicted: `"inductor"` (the default under
    inductor) reads inductor's own buffer plan, one code generation of both graphs per save set
    tried (seconds each; compiling takes that much longer); `"op-by-op"` counts each op's output
    (instant, the only choice under aot_eager, where it is exact).

    Errors: the backend runs lazily, on the compiled model's first call, inside dynamo, and dynamo
    re-raises what a backend raises as `torch._dynamo.exc.BackendCompilerFailed`, so
    `except remat.InfeasibleBudget` (a budget no save set meets) does not catch it there. The
    remat error is the wrapper's `inner_exception` and its `__context__` (dynamo raises
    `from None`: it is not the `__cause__`, and the traceback hides it);
    `remat.applying.compiled.remat_error_cause(err)` finds it in the chain, with its `budget_bytes` and
    `min_feasible_bytes`. `remat.compile` does this for you: it re-raises the remat error itself.
    With `torch._dynamo.config.suppress_errors = True`, dynamo raises nothing: it logs the error
    and runs that graph eagerly, without remat's plan (and adds no plan for it).

    `offload` (True: the settings of `profile`'s GPU, or an `OffloadSettings`): saved values go to
    host memory by torch's compile offload pass (`remat.applying.compiled_offload`): with a
    budget, those the budgeted save set's program picks, tensor by tensor, beside keep and
    recompute; without one, all the pass can move. Their bytes leave the predicted peak, their
    copies are in `Plan.transfer_seconds`."""
    return RematBackend(
        budget=budget,
        strategy=strategy,
        profile=profile,
        compiler=compiler,
        peak_model=peak_model,
        offload=settings_for(profile, offload),
    )


def compile(
    model: nn.Module,
    budget: int | str | None = None,
    strategy: str = "auto",
    profile: str | DeviceProfile = "cpu",
    compiler: str = "inductor",
    peak_model: str | None = None,
    check: bool = True,
    offload: OffloadSettings | bool = False,
    **compile_kwargs: Any,
) -> nn.Module:
    """`torch.compile(model)` with remat's partitioner (see `backend`). The decisions appear, one
    plan per compiled graph, in `plans_of(compiled)` after the first call. Shapes are static
    (`dynamic=False`) unless `compile_kwargs` says otherwise.

    Compilation is lazy: a remat error (`InfeasibleBudget` when no save set fits `budget`) comes
    from the first call. That call raises the remat error itself, attributes intact, `from`
    dynamo's `BackendCompilerFailed` rather than wrapped in it. The result is still torch's
    compiled module (an `OptimizedModule`: same parameters, state_dict keys, attributes and
    train/eval); only its `forward` is wrapped.

    `check=True`: the first training call counts what autograd saves against the plans' held
    bytes and, on CUDA, the allocator's peak against the budget, once, warning where they differ
    (`remat.applying.first_step.check_compiled`).

    `offload=True` (or an `OffloadSettings`): each plan's saved values that torch's compile offload
    pass accepts go to host memory (see `backend`; docs/offload.md); where the installed torch has
    no such pass, a `RematError` says so here, before anything compiles."""
    chosen = backend(
        budget=budget,
        strategy=strategy,
        profile=profile,
        compiler=compiler,
        peak_model=peak_model,
        offload=offload,
    )
    compile_kwargs.setdefault("dynamic", False)
    compiled = torch.compile(model, backend=chosen, **compile_kwargs)
    if isinstance(compiled, nn.Module):
        compiled.forward = _raising_remat_errors(compiled.forward)
        if check:
            compiled.forward = check_compiled(compiled.forward, chosen.plans, model)
    else:  # a function: torch.compile returned a function
        compiled = _raising_remat_errors(compiled)
        if check:
            compiled = check_compiled(compiled, chosen.plans, None)
    compiled.remat_backend = chosen
    return compiled


_E = TypeVar("_E", bound=BaseException)


def remat_error_cause(
    error: BaseException,
    kind: type[_E] = RematError,  # type: ignore[assignment]
) -> _E | None:
    """The `kind` error (any `RematError` unless told) behind `error`, or None. Dynamo re-raises a
    backend's error as `BackendCompilerFailed` with the original as its `__context__`; other
    wrappers chain it as `__cause__`: this follows `__cause__`, else `__context__`."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, kind):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def _raising_remat_errors(call: Callable[..., Any]) -> Callable[..., Any]:
    """`call`, raising a remat error found in a failure's chain as itself, from the failure."""

    @functools.wraps(call)
    def call_raising_remat_errors(*args: Any, **kwargs: Any) -> Any:
        try:
            return call(*args, **kwargs)
        except RematError:
            raise
        except Exception as error:
            cause = remat_error_cause(error)
            if cause is None:
                raise
            raise cause from error

    return call_raising_remat_errors


def plans_of(compiled: nn.Module) -> list[Plan]:
    """The plans remat's partitioner made for a model from `remat.compile`, one per graph."""
    chosen = getattr(compiled, "remat_backend", None)
    if chosen is None:
        raise RematError("this model was not compiled with remat.compile")
    return chosen.plans
