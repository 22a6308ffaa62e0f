"""Roofline time of each op: how long recomputing it would take on a given device.

An op takes as long as the slower of its arithmetic and its memory traffic:
`max(flops / rate, bytes_moved / bandwidth)`, where the rate is the matrix-unit peak for
matmul-class ops and the (much lower) vector rate for everything else. This is the model the
planners price recomputation with; it ignores launch overhead, caches and fusion, which is why it is
only a ranking device and `measure` stays the ground truth.

Nothing here imports torch, so the planners can price a saved graph on a machine without it: to
measure the machine at hand instead of trusting `PROFILES`, use `remat.measuring.calibrate.calibrate_profile`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from math import prod

from remat.errors import UnknownProfileError
from remat.graph import Graph, Op


@dataclass(frozen=True)
class DeviceProfile:
    """What the roofline needs to know of a device: FLOP/s of its matrix units for the training
    dtype (`peak_flops`), FLOP/s of everything else (`vector_flops`), and memory bandwidth in
    bytes/s; and what eager checkpointing itself costs on the host, which no op's roofline shows:

    - `region_seconds`: per checkpointed region and step, `torch.utils.checkpoint`'s own work (its
      frame, the pack and unpack hook of every tensor the region saves, setting up the replay);
    - `policy_op_seconds`: per op that a region with a selective-checkpoint policy runs, in its
      forward and again in its replay (kept ops included: they hand over their cached output):
      the policy's dispatch mode and the policy function are Python, called once per op.

    Both are added to a plan's predicted recompute time (`checkpoint_overhead_seconds`), so that
    between plans of near-equal recompute the planner does not pick the one whose checkpointing
    costs more than it saves.

    `transcendental_ops`: vector operations one element of a transcendental op (exp, sin, tanh,
    erf, sigmoid, GELU, SiLU, ...) costs, for the compiled path's price of a pointwise op
    recomputed inside a fused kernel (`fused_op_seconds_all`).

    `link_bandwidth`: bytes/s a rank sends over the interconnect of its tensor-parallel group,
    which prices the collectives a tensor-parallel step runs (`collective_seconds`): recomputing
    a region replays its all-gathers and all-reduces.

    `attention_flops`: FLOP/s of the fused attention kernels (SDPA and its flash, memory-efficient
    and CPU backends) per FLOP torch's counter gives them (both matmuls of the full score matrix,
    a causal mask's skipped half included); 0 means `peak_flops`. On this project's 2-core CPU a
    causal SDPA ran at ~0.45 of the matmul rate by that count, and priced at `peak_flops` it looked
    2x cheaper to recompute than it was (`calibrate_profile` measures it).

    `element_ops`: (op short name, vector operations an element) for the pointwise kinds measured
    on the device (`calibrate_profile`: GELU, SiLU, softmax, log-softmax), in place of
    `transcendental_ops` for them: on this project's CPU GELU costs ~12 vector operations an
    element where sin, exp and tanh cost ~4.5, and a softmax's exp, max and sum are no
    transcendental by name at all."""

    name: str
    peak_flops: float
    vector_flops: float
    bandwidth: float
    region_seconds: float = 0.0
    policy_op_seconds: float = 0.0
    transcendental_ops: float = 4.0
    link_bandwidth: float = 450e9
    attention_flops: float = 0.0
    element_ops: tuple[tuple[str, float], ...] = ()

    @property
    def attention_rate(self) -> float:
        """FLOP/s of the fused attention kernels, per FLOP torch's counter gives them."""
        return self.attention_flops or self.peak_flops


#: Checkpointing's own host cost (`DeviceProfile.region_seconds`, `policy_op_seconds`) is left at 0
#: in the shipped profiles: their op times are rooflines without per-op launch cost, so a small
#: model's predicted step is microseconds and a fixed host cost would swamp it (the `+10%` budget
#: would always mean store_all). `remat.measuring.calibrate.calibrate_profile()` measures both on the machine at
#: hand; this project's shared 2-core VM measured ~1.0-1.1 ms per region and 22 us per op for
#: torch's selective-checkpoint mode alone, 39 us with remat's policy and module-scope hooks
#: (docs/benchmarks.md, issue 11 item 7). A GPU host runs the same Python on a faster core, partly
#: overlapped with the kernels: about 0.3 ms and 10 us, as an upper bound.
#: `link_bandwidth` of the GPUs: one direction of their peer links, from the same datasheets: NVLink
#: 4 (H100/H200 SXM) 450 GB/s, NVLink 3 (A100) 300, NVLink 2 (V100) 150, PCIe Gen5 x16 (H100 PCIe
#: without a bridge) 64, PCIe Gen4 x16 (L4, RTX 4090) 32, MI300X's seven Infinity Fabric links 448.
PROFILES: dict[str, DeviceProfile] = {
    # Placeholders for a modest 2-core CPU, in the right order of magnitude only: run
    # `remat.measuring.calibrate.calibrate_profile()` to measure the machine at hand.
    # transcendental_ops: 10, measured on this project's 2-core VM: calibrate_profile's eager
    # sin/exp/tanh cost 8.4-9.8 vector operations an element, one more sin/exp/tanh in a chain
    # inductor fused cost 1.36 ns an element against 0.113 ns a vector operation, i.e. 12
    # (benchmarks/fused_recompute_cost.py). GPUs keep the default 4: their special-function
    # units run at a quarter to an eighth of the FP32 rate (calibrate_profile measures it).
    # link_bandwidth: gloo between processes of one host, through shared memory and sockets.
    "cpu": DeviceProfile(
        "cpu",
        peak_flops=1e11,
        vector_flops=2e10,
        bandwidth=2e10,
        transcendental_ops=10.0,
        link_bandwidth=2e9,
    ),
    # Dense (no sparsity) BF16 tensor-core peak, FP32 CUDA-core rate as the vector rate, and HBM
    # bandwidth, from NVIDIA's datasheets: "NVIDIA A100 Tensor Core GPU" (A100 80GB SXM),
    # "NVIDIA H100 Tensor Core GPU" (H100 SXM) and "NVIDIA H200 Tensor Core GPU" (H200 SXM).
    "a100": DeviceProfile(
        "a100", peak_flops=312e12, vector_flops=19.5e12, bandwidth=2.039e12, link_bandwidth=300e9
    ),
    "h100": DeviceProfile(
        "h100", peak_flops=989e12, vector_flops=67e12, bandwidth=3.35e12, link_bandwidth=450e9
    ),
    "h200": DeviceProfile(
        "h200", peak_flops=989e12, vector_flops=67e12, bandwidth=4.8e12, link_bandwidth=450e9
    ),
    # H100 PCIe, the same datasheet's PCIe column: BF16 tensor 756 TFLOPS dense (1,513 with
    # sparsity), FP32 51 TFLOPS, HBM2e 2.0 TB/s.
    "h100-pcie": DeviceProfile(
        "h100-pcie", peak_flops=756e12, vector_flops=51e12, bandwidth=2.0e12, link_bandwidth=64e9
    ),
    # "NVIDIA Tesla V100 GPU Accelerator" datasheet (SXM2): FP16 tensor 125 TFLOPS (Volta has no
    # BF16), FP32 15.7 TFLOPS, HBM2 900 GB/s.
    "v100": DeviceProfile(
        "v100", peak_flops=125e12, vector_flops=15.7e12, bandwidth=900e9, link_bandwidth=150e9
    ),
    # A100 40GB SXM: the A100 datasheet's compute, with its 1,555 GB/s of HBM2.
    "a100-40gb": DeviceProfile(
        "a100-40gb",
        peak_flops=312e12,
        vector_flops=19.5e12,
        bandwidth=1.555e12,
        link_bandwidth=300e9,
    ),
    # "NVIDIA L4 Tensor Core GPU" datasheet: BF16 tensor 242 TFLOPS with sparsity (121 dense),
    # FP32 30.3 TFLOPS, GDDR6 300 GB/s.
    "l4": DeviceProfile(
        "l4", peak_flops=121e12, vector_flops=30.3e12, bandwidth=300e9, link_bandwidth=32e9
    ),
    # GeForce RTX 4090, "NVIDIA Ada GPU Architecture" whitepaper (appendix table): BF16 tensor with
    # FP32 accumulate 165.2 TFLOPS dense (330.4 with sparsity), FP32 82.6 TFLOPS, GDDR6X 1,008 GB/s.
    "rtx4090": DeviceProfile(
        "rtx4090",
        peak_flops=165.2e12,
        vector_flops=82.6e12,
        bandwidth=1.008e12,
        link_bandwidth=32e9,
    ),
    # "NVIDIA DGX B200" datasheet (8 GPUs: 72 PFLOPS FP8 training with sparsity, 64 TB/s HBM3e,
    # 14.4 TB/s NVLink) per GPU: BF16 tensor 2.25 PFLOPS dense, HBM3e 8 TB/s, NVLink 5 900 GB/s a
    # direction; FP32 75 TFLOPS ("NVIDIA HGX B200" spec table).
    "b200": DeviceProfile(
        "b200", peak_flops=2.25e15, vector_flops=75e12, bandwidth=8e12, link_bandwidth=900e9
    ),
    # "NVIDIA A10 Tensor Core GPU" datasheet: BF16 tensor 125 TFLOPS dense (250 with sparsity),
    # FP32 31.2 TFLOPS, GDDR6 600 GB/s, PCIe Gen4. AWS's A10G (g5 instances) has no datasheet of
    # its own; the A10's figures stand for it.
    "a10g": DeviceProfile(
        "a10g", peak_flops=125e12, vector_flops=31.2e12, bandwidth=600e9, link_bandwidth=32e9
    ),
    # "NVIDIA T4 Tensor Core GPU" datasheet: FP16 tensor (mixed precision) 65 TFLOPS (Turing has
    # no BF16), FP32 8.1 TFLOPS, GDDR6 320 GB/s, PCIe Gen3 x16.
    "t4": DeviceProfile(
        "t4", peak_flops=65e12, vector_flops=8.1e12, bandwidth=320e9, link_bandwidth=16e9
    ),
    # GeForce RTX 3090, "NVIDIA Ampere GA102 GPU Architecture" whitepaper (table 1): FP16 tensor
    # with FP32 accumulate 71 TFLOPS dense, FP32 35.6 TFLOPS, GDDR6X 936 GB/s.
    "rtx3090": DeviceProfile(
        "rtx3090", peak_flops=71e12, vector_flops=35.6e12, bandwidth=936e9, link_bandwidth=32e9
    ),
    # GeForce RTX 4080, the Ada whitepaper's appendix table: FP16 tensor with FP32 accumulate
    # 97.5 TFLOPS dense, FP32 48.7 TFLOPS, GDDR6X 716.8 GB/s.
    "rtx4080": DeviceProfile(
        "rtx4080", peak_flops=97.5e12, vector_flops=48.7e12, bandwidth=716.8e9, link_bandwidth=32e9
    ),
    # GeForce RTX 4070 Ti SUPER (2024, after the whitepaper): derived from NVIDIA's product page
    # (66 SMs, 2.61 GHz boost, 256-bit GDDR6X at 21 Gbps) at the Ada per-SM rates the whitepaper
    # gives the 4090 (512 FP16-with-FP32-accumulate tensor and 256 FP32 FLOP per SM and clock):
    # 88.2 TFLOPS tensor, 44.1 TFLOPS FP32, 672 GB/s.
    "rtx4070-ti-super": DeviceProfile(
        "rtx4070-ti-super",
        peak_flops=88.2e12,
        vector_flops=44.1e12,
        bandwidth=672e9,
        link_bandwidth=32e9,
    ),
    # "AMD Instinct MI300X Accelerator" data sheet: BF16 matrix 1,307.4 TFLOPS dense (2,614.9 with
    # sparsity), FP32 vector 163.4 TFLOPS, HBM3 5.3 TB/s.
    "mi300x": DeviceProfile(
        "mi300x",
        peak_flops=1307.4e12,
        vector_flops=163.4e12,
        bandwidth=5.3e12,
        link_bandwidth=448e9,
    ),
}

#: Ops (by short name) whose outputs alias an input's storage: they only build new tensor metadata,
#: read and write no data, and so cost 0 bytes and 0 seconds.
VIEW_OPS = frozenset(
    {
        "_reshape_alias",
        "_unsafe_view",
        "alias",
        "as_strided",
        "detach",
        "diagonal",
        "expand",
        "permute",
        "select",
        "slice",
        "split",
        "split_with_sizes",
        "squeeze",
        "t",
        "transpose",
        "unbind",
        "unfold",
        "unsqueeze",
        "view",
        "view_as_complex",  # complex views of real pairs and back (RoPE as torchtitan applies it)
        "view_as_real",
        "real",
        "imag",
    }
)

#: Matmul-class ops (by short name), which run on the matrix units at `peak_flops`.
MATMUL_OPS = frozenset(
    {
        "_convolution",
        "_grouped_mm",
        "addbmm",
        "addmm",
        "baddbmm",
        "bmm",
        "convolution",
        "convolution_backward",
        "linear",
        "matmul",
        "mm",
    }
)
#: Pointwise ops (by short name) whose elements cost several vector operations each: exponentials,
#: logarithms, trigonometric and error functions, and the activations built on them.
TRANSCENDENTAL_OPS = frozenset(
    {
        "cos",
        "elu",
        "erf",
        "erfc",
        "erfinv",
        "exp",
        "exp2",
        "expm1",
        "gelu",
        "gelu_backward",
        "log",
        "log10",
        "log1p",
        "log2",
        "logit",
        "mish",
        "pow",
        "sigmoid",
        "silu",
        "silu_backward",
        "sin",
        "softplus",
        "tan",
        "tanh",
    }
)
#: Prefixes of the fused attention kernels (SDPA and its flash / memory-efficient backends, forward
#: and backward), which are matmul-class as well.
ATTENTION_PREFIXES = (
    "_scaled_dot_product_",
    "scaled_dot_product_",
    "_flash_attention_",
    "_efficient_attention_",
)

#: torchtitan's per-op selective checkpointing (`_save_list` of
#: torchtitan/models/llama3/infra/parallelize.py at 6fc499f6, the commit of torchao's B200 table),
#: by op overload: these outputs are saved, every second `aten.mm` excepted. `aten.max.default`
#: is the full reduction torchao's tensorwise float8 casts take their amax with (a scalar, "for
#: low precision training"); `aten.amax` (rowwise scales) and `aten.max.dim` are not in it.
TORCHTITAN_SAVE_LIST = frozenset(
    {
        "aten.mm.default",
        "aten._scaled_dot_product_efficient_attention.default",
        "aten._scaled_dot_product_flash_attention.default",
        "_c10d_functional.reduce_scatter_tensor.default",
        "aten.max.default",
    }
)
#: The ops torchtitan's policy counts as `aten.mm` beside it: `addmm` (a linear with a bias;
#: torchtitan's models have none) and `_scaled_mm`, the float8 matmul that torchao's
#: `Float8Linear` runs as `aten.mm` on its float8 tensor subclass: the policy (a dispatch mode)
#: sees that `aten.mm` before the subclass turns it into `_scaled_mm`, and remat's stand-in of
#: torchao (`remat.models.float8`) calls `_scaled_mm` itself.
TORCHTITAN_MM_OPS = frozenset({"aten.mm.default", "aten.addmm.default", "aten._scaled_mm.default"})
#: The CPU and emulated stand-ins of the attention kernels torchtitan's list names
#: (`_scaled_dot_product_flash_attention_for_cpu`, cuDNN's, ...): saved as the GPU's would be.
TORCHTITAN_ATTENTION_PREFIX = "aten._scaled_dot_product_"


def torchtitan_saves(target: str, mm_count: int) -> bool:
    """Whether torchtitan's per-op policy saves the output of op `target` (an overload,
    `aten.mm.default`), `mm_count` being the region's count of mms so far, this one included
    (every second mm is recomputed)."""
    if target in TORCHTITAN_MM_OPS:
        return mm_count % 2 == 1
    return target in TORCHTITAN_SAVE_LIST or target.startswith(TORCHTITAN_ATTENTION_PREFIX)


def get_profile(name_or_profile: str | DeviceProfile) -> DeviceProfile:
    """A profile from `PROFILES` by name, or the given profile unchanged. Raises
    `UnknownProfileError`, listing the known names, for any other name."""
    if isinstance(name_or_profile, DeviceProfile):
        return name_or_profile
    try:
        return PROFILES[name_or_profile]
    except (KeyError, TypeError):
        raise UnknownProfileError(
            f"unknown device profile {name_or_profile!r}: choose one of "
            f"{', '.join(sorted(PROFILES))}, or pass a DeviceProfile "
            "(remat.measuring.calibrate.calibrate_profile() measures one)"
        ) from None


def checkpoint_overhead_seconds(
    profile: DeviceProfile | str, regions: int, policy_ops: int
) -> float:
    """Host seconds that checkpointing adds to a step beyond recomputing ops: `regions`
    checkpointed regions, and `policy_ops` ops run under a selective policy (a selective region's
    forward ops plus the ops its replay reaches)."""
    p = get_profile(profile)
    return regions * p.region_seconds + policy_ops * p.policy_op_seconds


def is_view(op: Op) -> bool:
    """A view op, or its in-place form (`t_`, `squeeze_`), which restrides and writes no data."""
    return op.short.rstrip("_") in VIEW_OPS


def is_matmul(op: Op) -> bool:
    short = op.short
    return short in MATMUL_OPS or short.startswith(ATTENTION_PREFIXES)


#: The functional collectives DTensor runs (`torch.ops._c10d_functional`), by target prefix.
COLLECTIVE_PREFIX = "_c10d_functional."


def collective_seconds(graph: Graph, op: Op, profile: DeviceProfile) -> float:
    """Seconds of a collective on the interconnect, as a ring runs it: an all-reduce sends about
    twice its tensor, an all-gather or reduce-scatter about its larger side (the whole tensor),
    at `profile.link_bandwidth`."""
    sizes = [graph.tensors[t].nbytes for t in (*op.inputs, *op.outputs)]
    sent = 2 * max(sizes, default=0) if "all_reduce" in op.short else max(sizes, default=0)
    return sent / profile.link_bandwidth


def op_bytes_moved(graph: Graph, op: Op) -> int:
    """Bytes the op reads and writes: the `nbytes` of its distinct input and output tensors (an
    in-place op reads its input and writes its result, so both count). 0 for a view op."""
    if is_view(op):
        return 0
    tensors = graph.tensors
    return sum(tensors[t].nbytes for t in set(op.inputs) | set(op.outputs))


def op_seconds(graph: Graph, op: Op, profile: DeviceProfile | str) -> float:
    """Roofline seconds of `op` on `profile`: max(compute time, memory time); 0 for a view op;
    a collective's time on the interconnect. A transcendental or random op's compute is
    `transcendental_ops` vector operations an element (`elementwise_flops`)."""
    p = get_profile(profile)
    if op.target.startswith(COLLECTIVE_PREFIX):
        return collective_seconds(graph, op, p)
    rate = matmul_rate(op, p) if is_matmul(op) else p.vector_flops
    flops = max(op.flops, elementwise_flops(graph, op, p))
    return max(flops / rate, op_bytes_moved(graph, op) / p.bandwidth)


def matmul_rate(op: Op, profile: DeviceProfile) -> float:
    """FLOP/s of a matmul-class op: the attention kernels' own rate where the profile has one."""
    return profile.attention_rate if op.short.startswith(ATTENTION_PREFIXES) else profile.peak_flops


@lru_cache(maxsize=16)
def _element_ops(pairs: tuple[tuple[str, float], ...]) -> dict[str, float]:
    return dict(pairs)


def elementwise_flops(graph: Graph, op: Op, profile: DeviceProfile) -> float:
    """What FLOP counters leave out of a pointwise op that is dear an element: a transcendental
    (GELU, tanh, exp, ...) or a random draw (dropout's mask), `transcendental_ops` vector
    operations for each element of its largest tensor; 0 for any other op. Eager on this
    project's 2-core CPU, one thread: tanh-GELU of 3.1M floats 6.3 ms, priced 1.26 ms by its
    memory traffic alone, which is all the roofline saw of it (its FLOPs count 0); a GPU's
    pointwise ops stay memory-bound (4 operations an element against HBM's bytes). An op kind the
    profile measured (`element_ops`) costs what was measured of it."""
    measured = _element_ops(profile.element_ops).get(op.short) if profile.element_ops else None
    if measured is None:
        if not (op.short in TRANSCENDENTAL_OPS or op.random) or is_matmul(op):
            return 0.0
        measured = profile.transcendental_ops
    tensors = graph.tensors
    elements = max((prod(tensors[t].shape) for t in (*op.inputs, *op.outputs)), default=0)
    return elements * measured


def op_seconds_all(graph: Graph, profile: DeviceProfile | str) -> list[float]:
    """`op_seconds` of every op, indexed by op index; one pass, with the op kind looked up once per
    distinct target, for graphs of tens of thousands of ops."""
    p = get_profile(profile)
    kinds: dict[str, tuple[bool, bool, float]] = {}
    nbytes = {tid: t.nbytes for tid, t in graph.tensors.items()}
    out = [0.0] * len(graph.ops)
    for op in graph.ops:
        kind = kinds.get(op.target)
        if kind is None:
            matmul = is_matmul(op)
            rate = matmul_rate(op, p) if matmul else p.vector_flops
            kind = kinds[op.target] = (is_view(op), matmul, rate)
        view, matmul, rate = kind
        if view:
            continue
        if op.target.startswith(COLLECTIVE_PREFIX):
            out[op.index] = collective_seconds(graph, op, p)
            continue
        moved = sum(nbytes[t] for t in set(op.inputs) | set(op.outputs))
        flops = op.flops if matmul else max(op.flops, elementwise_flops(graph, op, p))
        out[op.index] = max(flops / rate, moved / p.bandwidth)
    return out


def fused_op_seconds_all(graph: Graph, profile: DeviceProfile | str) -> list[float]:
    """Seconds of recomputing each op inside a fused kernel (the compiled path): compute-intensive
    ops (matmuls, convolutions, attention) at their roofline time, views free, any other op at its
    arithmetic alone: one vector operation per element it reads or writes (FLOP counters count
    none for pointwise ops), `profile.transcendental_ops` for an exponential, sine, tanh, erf or an
    activation built on them. Under a fusing compiler such an op runs inside its consumer's kernel;
    its memory traffic is what the min-cut prices. Measured under inductor on this project's CPU
    (benchmarks/fused_recompute_cost.py, docs/compiled.md): one more add or mul in a fused chain
    costs 0.002 ns an element (nothing: the kernel is memory-bound; eager, 0.26 ns, a round trip
    to memory), one more sin/exp/tanh 1.36 ns (more than eager's 0.98: not free under fusion),
    and an inductor matmul (an extern kernel) runs at 97% of the calibrated roofline."""
    p = get_profile(profile)
    tensors = graph.tensors
    out = [0.0] * len(graph.ops)
    for op in graph.ops:
        if is_matmul(op) or op.target.startswith(COLLECTIVE_PREFIX):
            out[op.index] = op_seconds(graph, op, p)
        elif not is_view(op):
            elements = max((prod(tensors[t].shape) for t in (*op.inputs, *op.outputs)), default=0)
            weight = p.transcendental_ops if op.short in TRANSCENDENTAL_OPS else 1.0
            out[op.index] = max(op.flops, elements * weight) / p.vector_flops
    return out
