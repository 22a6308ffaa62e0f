"""Memory of a training step, predicted from a `Graph` by a liveness simulation.

A storage allocated by op `a` is live from `a` until both the program has dropped it
(`Storage.released_after`) and every autograd node that saved it has run (`Node.released_after`).
What exists before the step (parameters, buffers, inputs, optimizer state) is live throughout.
The peak of the step is the largest live total over all ops, forward, backward and optimizer step.

The step's liveness is `remat.prediction.schedule.simulate` with no checkpoint regions, the same judge that
checks every plan; this module adds what is not a plan's business: the optimizer step after the
backward, the breakdown of saved bytes by module and by op type, and the per-rank arithmetic of
FSDP2 / ZeRO-3 sharding (`estimate(..., shard=N)`, `sharded_timeline`).
"""

from __future__ import annotations

import bisect
import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Literal, get_args

from remat.errors import RematError
from remat.graph import Graph
from remat.prediction.optimizer_state import (
    BNB_8BIT,
    BNB_8BIT_PAGED,
    TORCHAO_4BIT,
    TORCHAO_8BIT,
    BlockQuantized,
)
from remat.prediction.schedule import Simulation, simulate
from remat.units import format_bytes

Optimizer = (
    Literal[
        "sgd",
        "sgd-momentum",
        "adamw",
        "adamw-foreach",
        "adamw-fused",
        "adamw-for-loop",
        "adamw-8bit",
        "adamw-8bit-paged",
        "adamw-8bit-torchao",
        "adamw-4bit",
        "adamw-cpu-offload",
    ]
    | None
)

#: The optimizer names `estimate` accepts (besides None: no optimizer), for CLI choices.
OPTIMIZERS: tuple[str, ...] = get_args(get_args(Optimizer)[0])


@dataclass(frozen=True)
class OptimizerMemory:
    """What an optimizer keeps between steps (`state_*`) and allocates only while `step()` runs
    (`step_temp_*`), as a multiple of the trainable parameter bytes (for state kept in the
    parameter's dtype) plus a multiple of the trainable parameter *elements* (for state whose
    dtype is fixed, such as 8-bit quantized moments). A per-parameter (for-loop) step allocates
    its temporaries one parameter at a time (`per_parameter`, see `for_loop_temp_bytes`)."""

    state_per_param_byte: int = 0
    state_per_element: int = 0
    step_temp_per_param_byte: int = 0
    step_temp_per_element: int = 0
    per_parameter: bool = False
    #: moments stored block-wise quantized, sized per tensor (`remat.prediction.optimizer_state`)
    quantized: BlockQuantized | None = None

    def state_bytes(
        self, param_bytes: int, elements: int, tensors: Sequence[tuple[int, int]] | None = None
    ) -> int:
        """The state on the device (in the caching allocator). `tensors`: each trainable
        parameter's (elements, bytes per element), for state sized tensor by tensor (quantized
        moments: block scales, a minimum size); None: the parameters taken as one tensor."""
        if self.quantized is not None:
            return self.quantized.state_bytes(self._tensors(param_bytes, elements, tensors))[0]
        return self.state_per_param_byte * param_bytes + self.state_per_element * elements

    def paged_state_bytes(
        self, param_bytes: int, elements: int, tensors: Sequence[tuple[int, int]] | None = None
    ) -> int:
        """The state in CUDA unified memory (paged optimizers), outside the caching allocator."""
        if self.quantized is None:
            return 0
        return self.quantized.state_bytes(self._tensors(param_bytes, elements, tensors))[1]

    @staticmethod
    def _tensors(
        param_bytes: int, elements: int, tensors: Sequence[tuple[int, int]] | None
    ) -> Sequence[tuple[int, int]]:
        if tensors is not None:
            return tensors
        return [(elements, param_bytes // elements)] if elements else []

    def step_temp_bytes(self, param_bytes: int, elements: int, param_sizes: Sequence[int]) -> int:
        """The step's transient; `param_sizes`: each trainable parameter's bytes, in the order
        the optimizer holds them (the model's `parameters()` order)."""
        return (
            self.step_temp_per_param_byte * param_bytes
            + self.step_temp_per_element * elements
            + (for_loop_temp_bytes(param_sizes) if self.per_parameter else 0)
        )


def for_loop_temp_bytes(param_sizes: Sequence[int]) -> int:
    """The transient of `_single_tensor_adam`: for parameter i, `exp_avg_sq.sqrt()` and its
    quotient by the bias correction are both live while the previous parameter's `denom` is
    still bound (Python rebinds `denom` only after the new one exists): 2 x b[i] + b[i-1] at most.
    Measured on CPU for sizes [1024, 65536, 4096] elements: 2 x 65536 + 1024 elements."""
    return max(
        (2 * size + (param_sizes[i - 1] if i else 0) for i, size in enumerate(param_sizes)),
        default=0,
    )


_ADAMW_STATE = 2  # exp_avg and exp_avg_sq, in the parameter's dtype

#: The optimizers as users run them, in steady state (after the first step created the state).
#: The step temporaries are read off torch 2.13's torch/optim/adam.py (AdamW is Adam with
#: decoupled weight decay) and pinned by measuring each implementation's step on CPU tensors
#: (tests/test_estimate.py):
#:
#: - None: no optimizer step is counted.
#: - "sgd": `torch.optim.SGD(momentum=0)` keeps nothing; its step updates the parameters in
#:   place (`_foreach_add_(params, grads, alpha=-lr)`, or `param.add_` per parameter): no
#:   transient. (A nonzero weight_decay would allocate grad + wd * param, not counted.)
#: - "sgd-momentum": `torch.optim.SGD(momentum>0)` keeps one `momentum_buffer` per parameter, in
#:   the parameter's dtype (1 x parameter bytes), updated in place with the parameters.
#: - "adamw-foreach" (`AdamW(foreach=True)`, torch's default for CUDA parameters and FSDP2's
#:   DTensors): keeps `exp_avg` and `exp_avg_sq` (2 x parameter bytes); `_multi_tensor_adam`
#:   allocates `exp_avg_sq_sqrt = _foreach_sqrt(exp_avg_sqs)` for all parameters of a
#:   device/dtype group at once (1 x parameter bytes).
#: - "adamw-for-loop" (`AdamW(foreach=False)`, torch's default for CPU parameters; per-parameter
#:   as Hugging Face's Trainer ran it before `adamw_torch`): `_single_tensor_adam` computes
#:   `denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)` one parameter at a time
#:   (`for_loop_temp_bytes`: about 2 x the largest parameter's bytes).
#: - "adamw-fused" (`AdamW(fused=True)`): one fused kernel per group updates parameters and
#:   moments in place: no transient.
#: - "adamw": the implementation torch picks for the target's device
#:   (`torch.optim.optimizer._default_to_fused_or_foreach`): foreach on a GPU, for-loop on the CPU.
#:   `resolve_optimizer` names it.
#: - "adamw-8bit": bitsandbytes' `AdamW8bit` (blockwise): both moments uint8 with an fp32 absmax
#:   per 256-element block (2.03 bytes an element), fp32 moments (8 bytes an element) for
#:   parameters under its `min_8bit_size` of 4096 elements (biases, norm weights), the two shared
#:   fp32 quantization maps (`remat.prediction.optimizer_state.BNB_8BIT`). Its fused kernel
#:   updates each parameter in place: no transient. "adamw-8bit-paged": `PagedAdamW8bit`, the same
#:   state with moments of 100,000 elements or more in CUDA unified memory: not in the
#:   allocator, reported apart (`MemoryEstimate.paged_optimizer_state_bytes`).
#: - "adamw-8bit-torchao", "adamw-4bit": torchao's `AdamW8bit` (256-element blocks) and
#:   `AdamW4bit` (128-element blocks, two codes a byte), quantized where a rank's tensor has 4096
#:   elements or more in whole blocks, else in the parameter's dtype (`TORCHAO_8BIT`,
#:   `TORCHAO_4BIT`). Their compiled step dequantizes one parameter at a time inside fused
#:   kernels: no transient counted.
#: - "adamw-cpu-offload": torchao's `CPUOffloadOptimizer(params, torch.optim.AdamW)`: the state
#:   and the step on the CPU (gradients copied to pinned host memory as each is accumulated, with
#:   `offload_gradients=False`, its default, kept on the GPU too): no state or transient on the
#:   GPU.
OPTIMIZER_MEMORY: dict[Optimizer, OptimizerMemory] = {
    None: OptimizerMemory(),
    "sgd": OptimizerMemory(),
    "sgd-momentum": OptimizerMemory(state_per_param_byte=1),
    "adamw-foreach": OptimizerMemory(state_per_param_byte=_ADAMW_STATE, step_temp_per_param_byte=1),
    "adamw-for-loop": OptimizerMemory(state_per_param_byte=_ADAMW_STATE, per_parameter=True),
    "adamw-fused": OptimizerMemory(state_per_param_byte=_ADAMW_STATE),
    "adamw-8bit": OptimizerMemory(quantized=BNB_8BIT),
    "adamw-8bit-paged": OptimizerMemory(quantized=BNB_8BIT_PAGED),
    "adamw-8bit-torchao": OptimizerMemory(quantized=TORCHAO_8BIT),
    "adamw-4bit": OptimizerMemory(quantized=TORCHAO_4BIT),
    "adamw-cpu-offload": OptimizerMemory(),
}


def resolve_optimizer(optimizer: Optimizer, graph: Graph) -> Optimizer:
    """The implementation `optimizer` runs as on the graph's target: "adamw" is torch's default
    there (foreach for CUDA parameters, for-loop for CPU ones); other names are themselves."""
    if optimizer not in OPTIMIZER_MEMORY and optimizer != "adamw":
        choices = ", ".join(["None", *(repr(o) for o in OPTIMIZERS)])
        raise RematError(f"optimizer must be one of {choices}, got {optimizer!r}")
    if optimizer != "adamw":
        return optimizer
    on_gpu = str(graph.info.get("target", "cpu")).startswith("cuda")
    return "adamw-foreach" if on_gpu else "adamw-for-loop"


#: Bytes per element of the dtypes a parameter may have (`str(torch.dtype)` without "torch.");
#: any other dtype is sized by the bit count in its name (`float8_e5m2fnuz` -> 1).
DTYPE_BYTES = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "complex128": 16,
    "complex64": 8,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}


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
    """The memory of one training step, per rank when `shard` > 1 (see `estimate`).

    `param_bytes`, `grad_bytes` and `optimizer_state_bytes` are what each rank keeps between steps
    (its 1/`shard`, rounded up); `gathered_param_bytes` and `unsharded_grad_bytes` are FSDP's
    transients during forward/backward (0 when `shard` is 1), in the peak but not in
    `fixed_bytes`. `trainable_param_count` is the trainable parameter elements of the whole model
    (not sharded). `paged_optimizer_state_bytes`: a paged optimizer's state in CUDA unified memory
    (`cudaMallocManaged`), outside the caching allocator and the peak: reported apart."""

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
    trainable_param_count: int = 0
    shard: int = 1
    gathered_param_bytes: int = 0
    unsharded_grad_bytes: int = 0
    paged_optimizer_state_bytes: int = 0

    @property
    def fixed_bytes(self) -> int:
        """Memory no recomputation can save: parameters, buffers, inputs, grads, optimizer state
        (per rank: FSDP's transient gathered parameters and unsharded grads are not included)."""
        return (
            self.param_bytes
            + self.buffer_bytes
            + self.input_bytes
            + self.grad_bytes
            + self.optimizer_state_bytes
        )

    def __repr__(self) -> str:
        """One line: the peak, where it is, and what it is made of (every field: `to_dict()`)."""
        per_rank = f" per rank of {self.shard}" if self.shard > 1 else ""
        return (
            f"MemoryEstimate(peak {format_bytes(self.peak_bytes)}{per_rank} at {self.peak_op} "
            f"({self.peak_phase}); activations saved {format_bytes(self.activation_bytes)}, "
            f"parameters {format_bytes(self.param_bytes)}, gradients "
            f"{format_bytes(self.grad_bytes)}, optimizer state "
            f"{format_bytes(self.optimizer_state_bytes)}, inputs and buffers "
            f"{format_bytes(self.input_bytes + self.buffer_bytes)}; {len(self.by_module)} "
            "modules in by_module)"
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


# -- parameters: dtypes, elements, what is trainable -----------------------------------------------
def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a dtype named as the graph names it (`float32`, `bfloat16`)."""
    if dtype in DTYPE_BYTES:
        return DTYPE_BYTES[dtype]
    bits = re.search(r"\d+", dtype)
    return max(1, int(bits.group()) // 8) if bits else 1


def param_dtypes(graph: Graph) -> dict[int, str]:
    """Parameter storage id -> the dtype of the parameter on it (the tensor that no op produced;
    any tensor of the storage if there is none; `float32` for a storage no tensor names). Read
    from every tensor once per graph (`Graph.derived`): each plan's per-rank figures ask again."""
    found = graph.derived(
        "param_dtypes", lambda: _param_dtypes(graph), graph.tensors, graph.storages
    )
    return dict(found)


def _param_dtypes(graph: Graph) -> dict[int, str]:
    out: dict[int, str] = {}
    exact: set[int] = set()
    for t in graph.tensors.values():
        if graph.storages[t.storage].kind != "param" or t.storage in exact:
            continue
        out[t.storage] = t.dtype
        if t.producer is None:
            exact.add(t.storage)
    return {s.id: out.get(s.id, "float32") for s in graph.storages_of(("param",))}


def param_elements(graph: Graph) -> int:
    """Parameter elements of the graph: each parameter storage's bytes over its dtype's size."""
    dtypes = param_dtypes(graph)
    return sum(s.nbytes // dtype_bytes(dtypes[s.id]) for s in graph.storages_of(("param",)))


def trainable_param_bytes(graph: Graph) -> int:
    """Bytes of the parameters that require grad (`graph.info["trainable_param_bytes"]`, which the
    tracer records; all parameter storages when the graph does not say)."""
    recorded = graph.info.get("trainable_param_bytes")
    return graph.param_bytes if recorded is None else int(recorded)


def param_sizes(graph: Graph) -> list[int]:
    """Each parameter storage's bytes in the order the model holds them (the tracer numbers
    storages in `named_parameters()` order), as a per-parameter optimizer step visits them."""
    return [s.nbytes for s in sorted(graph.storages_of(("param",)), key=lambda s: s.id)]


def param_tensors(graph: Graph, shard: int = 1, scale: int = 1) -> list[tuple[int, int]] | None:
    """Each trainable parameter's (elements, bytes per element) in the model's order, its 1/`shard`
    per rank (FSDP2 shards dim 0: a rank's local tensor) and its element size times `scale`
    (FSDP2's fp32 master copies of bf16-traced parameters); None when some parameters are frozen
    (the graph does not say which)."""
    if trainable_param_bytes(graph) < graph.param_bytes:
        return None
    dtypes = param_dtypes(graph)
    out = []
    for s in sorted(graph.storages_of(("param",)), key=lambda s: s.id):
        size = dtype_bytes(dtypes[s.id])
        out.append((_ceil_div(s.nbytes // size, shard), size * scale))
    return out


def trainable_param_elements(graph: Graph) -> int:
    """Elements of the parameters that require grad, from the parameter storages' dtypes.

    The graph records the trainable *bytes* but not which storages they are: when some parameters
    are frozen, the count is exact if all parameters share one element size, else the trainable
    share of the bytes applied to all elements."""
    total, trainable = graph.param_bytes, trainable_param_bytes(graph)
    if trainable >= total:
        return param_elements(graph)
    if trainable <= 0:
        return 0
    sizes = {dtype_bytes(d) for d in param_dtypes(graph).values()}
    if len(sizes) == 1:
        return trainable // sizes.pop()
    return param_elements(graph) * trainable // total


# -- FSDP2 / ZeRO-3 sharding -------------------------------------------------------------------------
def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def param_gather_bytes(graph: Graph) -> dict[int, int]:
    """Parameter storage id -> the bytes FSDP2 all-gathers of it: the traced bytes, or one byte an
    element where the step reads the parameter as float8 without casting it (a float8 view of
    its storage: torchao's float8 all-gather, `remat.models.float8`). Once per graph
    (`Graph.derived`): each plan's per-rank figures and allocator walk ask again."""
    found = graph.derived(
        "param_gather_bytes", lambda: _param_gather_bytes(graph), graph.tensors, graph.storages
    )
    return dict(found)


def _param_gather_bytes(graph: Graph) -> dict[int, int]:
    float8 = {
        t.storage
        for t in graph.tensors.values()
        if t.dtype.startswith("float8") and graph.storages[t.storage].kind == "param"
    }
    dtypes = param_dtypes(graph)
    return {
        s.id: s.nbytes // dtype_bytes(dtypes[s.id]) if s.id in float8 else s.nbytes
        for s in graph.storages_of(("param",))
    }


def param_blocks(graph: Graph) -> dict[int, str]:
    """Parameter storage id -> the path of the block (`graph.blocks`) whose forward first reads it;
    "" for the parameters first read outside every block (embeddings, final norm, head; tied
    weights go with their first use), which FSDP2's usual wrapping (`fully_shard` on each block,
    then on the model) leaves to the root unit. Once per graph (`Graph.derived`)."""
    found = graph.derived(
        "param_blocks",
        lambda: _param_blocks(graph),
        graph.ops,
        graph.tensors,
        graph.storages,
        graph.modules,
    )
    return dict(found)


def _param_blocks(graph: Graph) -> dict[int, str]:
    blocks = graph.blocks  # sorted by first op, and disjoint (all at one depth)
    starts = [b.first_op for b in blocks]
    owner = {s.id: "" for s in graph.storages_of(("param",))}
    seen: set[int] = set()
    for op in graph.forward_ops:
        for tid in op.inputs:
            sid = graph.tensors[tid].storage
            if sid in owner and sid not in seen:
                seen.add(sid)
                k = bisect.bisect_right(starts, op.index) - 1
                owner[sid] = blocks[k].path if k >= 0 and op.index <= blocks[k].last_op else ""
    return owner


def grad_blocks(graph: Graph) -> dict[int, str]:
    """Grad storage id -> the block whose backward allocated it (the module path of the op that
    did, which backward ops inherit from their forward op or parameter), "" for the root.
    Once per graph (`Graph.derived`)."""
    found = graph.derived(
        "grad_blocks", lambda: _grad_blocks(graph), graph.ops, graph.storages, graph.modules
    )
    return dict(found)


def _grad_blocks(graph: Graph) -> dict[int, str]:
    paths = [b.path for b in graph.blocks]
    out: dict[int, str] = {}
    for s in graph.storages_of(("grad",)):
        module = graph.ops[s.allocated_at].module if s.allocated_at is not None else ""
        out[s.id] = next((p for p in paths if module == p or module.startswith(p + ".")), "")
    return out


@dataclass(frozen=True)
class Sharding:
    """A step's memory per rank under FSDP2 / ZeRO-3 over `shard` ranks (see `shard_step`)."""

    shard: int
    param_bytes: int
    grad_bytes: int
    optimizer_state_bytes: int
    gathered_param_bytes: int
    unsharded_grad_bytes: int
    timeline: tuple[int, ...]
    optimizer_step_bytes: int


def shard_step(
    graph: Graph,
    sim: Simulation,
    shard: int,
    optimizer: Optimizer = None,
    master_scale: int = 1,
) -> Sharding:
    """Per-rank memory of the simulated step `sim` (store-all or any plan's: positions are read from
    `sim.schedule`) when the model is sharded FSDP2 / ZeRO-3 style over `shard` ranks.

    Arithmetic on top of the traced single-device step, not a trace of FSDP: no collective, no
    communication buffer and no DTensor is traced, and the model is assumed wrapped the usual
    way, `fully_shard` on each of `graph.blocks` and then on the whole model. `sim` must have been
    run with the optimizer state of `optimizer` in its base bytes, as `estimate` runs it (a
    planner applying this to a plan's simulation must do the same); with `shard=1` the timeline
    is `sim.timeline` unchanged. Per rank:

    - parameters, gradients and optimizer state kept between steps are 1/`shard` of the model's,
      rounded up; buffers, inputs and activations are unchanged (data parallel: each rank runs
      its own micro-batch);
    - `gathered_param_bytes`, live during the whole forward and backward: the root unit's
      parameters (those outside every block: FSDP2 does not reshard the root after forward, so
      they stay all-gathered until the end of backward) plus the largest block's parameters
      twice, the block computing and the next one prefetched. The model without blocks is one
      unit, all-gathered throughout. Gathered in the traced parameter dtype (one byte an
      element under torchao's float8 all-gather: `param_gather_bytes`): FSDP2's
      `MixedPrecisionPolicy(param_dtype=bf16)` over fp32 parameters gathers half of that;
    - gradients: a block's are reduce-scattered to their shard when its backward ends, with the
      largest block's full gradients (`unsharded_grad_bytes`) live during backward as the
      reduce-scatter input; the root unit's stay whole until the end of the backward;
    - the optimizer step runs on the shards: its transient is the optimizer's on 1/`shard` of the
      parameters.

    `master_scale`: the bytes of the sharded (master) parameters, gradients and optimizer state
    per traced parameter byte. 1 when the trace holds the master dtype; 2 for FSDP2's
    `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)` over fp32 parameters, traced in
    bf16: bf16 gathered parameters and compute, fp32 shards, and each block's gradients cast to an
    fp32 reduce-scatter input.
    """
    n, m = shard, master_scale
    memory = OPTIMIZER_MEMORY[resolve_optimizer(optimizer, graph)]
    param_total = graph.param_bytes
    t_bytes, t_elems = trainable_param_bytes(graph), trainable_param_elements(graph)
    state = memory.state_bytes(t_bytes, t_elems, param_tensors(graph))  # as simulated unsharded
    if memory.quantized is None:
        rank_state = _ceil_div(memory.state_bytes(t_bytes * m, t_elems), n)
    else:  # sized on each rank's local tensors, as the quantized optimizers allocate them
        rank_state = memory.state_bytes(
            _ceil_div(t_bytes * m, n), _ceil_div(t_elems, n), param_tensors(graph, n, m)
        )
    saving = (param_total - _ceil_div(param_total * m, n)) + (state - rank_state)

    blocks = graph.blocks
    by_block: dict[str, int] = defaultdict(int)
    gathered_bytes = param_gather_bytes(graph)
    for sid, path in param_blocks(graph).items():
        by_block[path] += gathered_bytes[sid]
    root = by_block.pop("", 0)
    gathered = root + 2 * max(by_block.values(), default=0) if n > 1 else 0
    grad_owner = grad_blocks(graph)
    grads_by_block: dict[str, int] = defaultdict(int)
    for sid, path in grad_owner.items():
        if path:
            grads_by_block[path] += graph.storages[sid].nbytes
    unsharded_grads = max(grads_by_block.values(), default=0) if n > 1 and blocks else 0

    # block gradients live at each position: +bytes at allocation, -bytes after death
    positions = len(sim.timeline)
    position_of_op = {i: p for p, (kind, i) in enumerate(sim.schedule) if kind == "op"}
    delta = [0] * (positions + 1)
    for sid, path in grad_owner.items():
        s = graph.storages[sid]
        if not path or s.allocated_at is None:
            continue
        delta[position_of_op[s.allocated_at]] += s.nbytes
        delta[min(sim.deaths.get(sid, positions), positions - 1) + 1] -= s.nbytes
    timeline, block_grads = [], 0
    for p, live in enumerate(sim.timeline):
        block_grads += delta[p]
        kind, i = sim.schedule[p]
        backward = kind != "op" or graph.ops[i].phase == "backward"
        transient = gathered + (unsharded_grads * m if backward else 0)
        timeline.append(live - saving - (block_grads - _ceil_div(block_grads * m, n)) + transient)

    grads_at_end = sum(
        graph.storages[sid].nbytes
        for sid in grad_owner
        if sim.deaths.get(sid, positions) >= positions
    )
    held_at_end = sum(graph.storages[sid].nbytes for sid, d in sim.deaths.items() if d >= positions)
    persistent = sum(s.nbytes for s in graph.storages.values() if s.allocated_at is None)
    step_bytes = (
        persistent
        + state
        + held_at_end
        - saving
        - (grads_at_end - _ceil_div(grads_at_end * m, n))
        + memory.step_temp_bytes(
            _ceil_div(t_bytes * m, n),
            _ceil_div(t_elems, n),
            [_ceil_div(b * m, n) for b in param_sizes(graph)],
        )
    )
    return Sharding(
        shard=n,
        param_bytes=_ceil_div(param_total * m, n),
        grad_bytes=_ceil_div(graph.grad_bytes * m, n),
        optimizer_state_bytes=rank_state,
        gathered_param_bytes=gathered,
        unsharded_grad_bytes=unsharded_grads,
        timeline=tuple(timeline),
        optimizer_step_bytes=step_bytes,
    )


def optimizer_step_bytes(graph: Graph, step: Simulation, optimizer: Optimizer) -> int:
    """Live bytes while the single-device optimizer step runs after the simulated `step` (which
    must hold the optimizer's state in its base bytes): what outlives the backward (parameters,
    inputs, gradients, outputs, state) plus the step's own transient."""
    memory = OPTIMIZER_MEMORY[resolve_optimizer(optimizer, graph)]
    trainable, elements = trainable_param_bytes(graph), trainable_param_elements(graph)
    persistent = sum(s.nbytes for s in graph.storages.values() if s.allocated_at is None)
    held = sum(graph.storages[sid].nbytes for sid, d in step.deaths.items() if d >= len(graph.ops))
    sizes = param_sizes(graph)
    if graph.info.get("optimizer_in_backward"):  # one optimizer a parameter, one at a time
        temp = max(
            (memory.step_temp_bytes(n, n * elements // max(trainable, 1), [n]) for n in sizes),
            default=0,
        )
    else:
        temp = memory.step_temp_bytes(trainable, elements, sizes)
    return persistent + memory.state_bytes(trainable, elements, param_tensors(graph)) + held + temp


def estimate(
    graph: Graph, optimizer: Optimizer = None, shard: int = 1, master_scale: int = 1
) -> MemoryEstimate:
    """Activation bytes and the peak of the whole step (store-all: no recomputation).

    `optimizer`: one of `OPTIMIZERS` (see `OPTIMIZER_MEMORY` for what each keeps and allocates in
    `step()`; "adamw" is the implementation torch picks on the graph's target, `resolve_optimizer`),
    or None to leave the optimizer out. Its state is sized from the trainable
    parameters of the graph, in their traced dtype: under bf16 autocast over fp32 parameters
    (mixed precision), AdamW's two moments are fp32, so weights, grads and state come to
    16 bytes per parameter; a pure bf16 model, 8.

    `shard`: the number of ranks the model is sharded over, FSDP2 / ZeRO-3 style; the figures are
    then per rank (`shard_step` says exactly what is divided and what FSDP adds: the all-gathered
    parameters of the root unit and of two blocks, the unsharded grads of one block). This is
    arithmetic on top of the traced single-device step: no collective is traced. `shard=1` is the
    single-device step, unchanged. `master_scale` (with `shard` > 1): see `shard_step`."""
    optimizer = resolve_optimizer(optimizer, graph)
    if isinstance(shard, bool) or not isinstance(shard, int) or shard < 1:
        raise RematError(f"shard must be a whole number of ranks >= 1, got {shard!r}")
    memory = OPTIMIZER_MEMORY[optimizer]
    trainable = trainable_param_bytes(graph)
    elements = trainable_param_elements(graph)
    state = memory.state_bytes(trainable, elements, param_tensors(graph))
    persistent = sum(s.nbytes for s in graph.storages.values() if s.allocated_at is None)
    step = simulate(graph, (), base_bytes=persistent + state)
    fields = {
        "param_bytes": graph.param_bytes,
        "grad_bytes": graph.grad_bytes,
        "optimizer_state_bytes": state,
        "paged_optimizer_state_bytes": memory.paged_state_bytes(
            trainable * master_scale, elements, param_tensors(graph, shard, master_scale)
        ),
        "shard": shard,
    }
    if shard == 1:
        if master_scale != 1:
            raise RematError(
                "master_scale is FSDP2's mixed precision (fp32 shards of bf16-traced parameters): "
                "it needs shard >= 2"
            )
        timeline = step.timeline
        step_peak = optimizer_step_bytes(graph, step, optimizer)
    else:
        sharded = shard_step(graph, step, shard, optimizer, master_scale)
        timeline, step_peak = sharded.timeline, sharded.optimizer_step_bytes
        fields.update(
            param_bytes=sharded.param_bytes,
            grad_bytes=sharded.grad_bytes,
            optimizer_state_bytes=sharded.optimizer_state_bytes,
            gathered_param_bytes=sharded.gathered_param_bytes,
            unsharded_grad_bytes=sharded.unsharded_grad_bytes,
        )
    position = max(range(len(timeline)), key=timeline.__getitem__)
    peak, peak_op, peak_phase = (
        timeline[position],
        graph.ops[position].name,
        graph.ops[position].phase,
    )
    if optimizer is not None and step_peak > peak:
        peak, peak_op, peak_phase = step_peak, f"{optimizer}.step", "optimizer"
    return MemoryEstimate(
        activation_bytes=graph.activation_bytes,
        peak_bytes=peak,
        buffer_bytes=graph.buffer_bytes,
        input_bytes=graph.input_bytes,
        peak_op=peak_op,
        peak_phase=peak_phase,
        by_module=activation_bytes_by_module(graph),
        by_op=activation_bytes_by_op(graph),
        timeline=tuple(enumerate(timeline)),
        trainable_param_count=elements,
        **fields,
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
    """Saved bytes per module path, inclusive of submodules, in forward order. A module is charged
    what the ops inside its calls saved, by the calls' op ranges: a submodule shared by several
    layers (one activation or RoPE module reused by all) counts in each layer that called it, and
    its own path sums all its calls."""
    per_op = [0] * (len(graph.ops) + 1)
    total = 0
    for sid in graph.saved_storages:
        nbytes = graph.storages[sid].nbytes
        total += nbytes
        owner = _saved_owner(graph, sid)
        if owner is not None:
            per_op[graph.op_by_name[owner].index] += nbytes
    prefix = [0]
    for b in per_op:
        prefix.append(prefix[-1] + b)
    totals: dict[str, int] = defaultdict(int)
    for call in graph.modules:
        if call.path:
            totals[call.path] += prefix[call.last_op + 1] - prefix[call.first_op]
    # containers never called themselves (a ModuleList "layers") sum their topmost called children
    called = set(totals)
    for path in list(called):
        parts = path.split(".")
        for depth in range(len(parts) - 1, 0, -1):
            parent = ".".join(parts[:depth])
            if parent in called:
                break
            totals[parent] += totals[path]
    totals[""] = total
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
