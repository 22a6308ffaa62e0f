"""The device a training step is predicted for, and what its kernels do, as data.

A step traced on fake CPU tensors runs the CPU's kernels; a GPU runs others, which save and
allocate different bytes. Tracing on fake CUDA tensors is not an option on a machine without a GPU
(autograd asks the CUDA runtime for a stream the moment a node is made), so the tracer runs on fake
CPU tensors and the CUDA target *re-routes* the CPU dispatch where the two devices differ. Every
difference is a row in one of the tables below; `remat.device.emulate` installs them for a trace, and
`remat.prediction.schedule` reads the scratch table of the target a graph was traced for
(`graph.info["target"]`). Nothing here imports torch.

What differs on CUDA (torch 2.13; each table says where in PyTorch its rows come from):

- `CUDA_AUTOCAST`: `torch.autocast("cuda")`'s op lists and cast policies (CPU autocast has other
  lists: layer_norm, softmax, log_softmax, exp, pow, rsqrt and sum run in fp32 only on CUDA);
- `CUDA_REROUTES`: composite ops whose CUDA path calls another kernel than the CPU's: dropout
  runs the fused `native_dropout` (a bool mask, 1 byte an element, is saved where the CPU saves a
  float mask), `rms_norm` the fused `_fused_rms_norm` (saving its input and an fp32 rstd where the
  composite saves fp32 copies), `scaled_dot_product_attention` the backend `select_attention`
  picks for the GPU (flash, cuDNN, memory-efficient or math), with their own saved tensors;
- `CUDA_FP32_STATISTICS`: normalisation kernels whose statistics are fp32 on CUDA whatever the
  input dtype (the CPU kernels keep them in the input's dtype);
- `CUDA_SCRATCH`: memory the CUDA kernels allocate and free inside one op (the flash-attention
  backward's fp32 accumulators), in place of the CPU kernels' (`CPU_SCRATCH`);
- `rng_state_bytes`: the device memory a checkpoint region's saved RNG state takes (CUDA keeps
  its generator state on the host: none).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from math import prod
from typing import Any

from remat.errors import RematError
from remat.graph import Graph, Op, Tensor

#: A rule for the scratch one kernel allocates and frees inside its op: bytes from the op's tensors.
ScratchRule = Callable[[Graph, Op], int]

#: Attention backends of `torch.nn.functional.scaled_dot_product_attention` on CUDA, by the name
#: torch's `SDPBackend` gives them, and the aten op each one runs.
ATTENTION_OPS: Mapping[str, str] = {
    "flash": "_scaled_dot_product_flash_attention",
    "efficient": "_scaled_dot_product_efficient_attention",
    "cudnn": "_scaled_dot_product_cudnn_attention",
    "math": "_scaled_dot_product_attention_math",
}
#: `at::globalContext().sDPPriorityOrder()`'s default (torch 2.13, aten/src/ATen/Context.h); torch
#: moves cuDNN first on sm90/sm100 when the runtime's cuDNN is newer than 9.15
#: (sdp_utils.cpp `check_prefer_cudnn_attention`), which the CUDA 12 wheels are not.
DEFAULT_ATTENTION_PRIORITY = ("flash", "efficient", "math", "cudnn")
CUDNN_FIRST_ATTENTION_PRIORITY = ("cudnn", "flash", "efficient", "math")


@dataclass(frozen=True)
class Target:
    """The device a step is predicted for. `name` is "cpu" or "cuda"; a CUDA target has the
    compute capability of its GPU (which decides the attention backends it can run) and the order
    in which SDPA tries them (`attention`: a priority tuple, or one backend name to force it)."""

    name: str
    capability: tuple[int, int] | None = None
    attention: tuple[str, ...] = ()
    rng_state_bytes: int = 0
    #: the torch whose autograd the run had, where it saved other tensors than torch 2.13's
    #: (`SOFTMAX_KEPT_INPUT_BEFORE`); None: torch 2.13's
    torch_version: tuple[int, int] | None = None
    #: streaming multiprocessors, which size a reduction's split across blocks (an H100 SXM's)
    multiprocessors: int = 132

    @property
    def threads_per_multiprocessor(self) -> int:
        """The resident threads per SM (CUDA's occupancy tables): 1024 on sm75, 1536 on sm86,
        sm89 and sm120, 2048 on the data-center parts."""
        return {(7, 5): 1024, (8, 6): 1536, (8, 9): 1536, (12, 0): 1536}.get(
            self.capability or (9, 0), 2048
        )

    @property
    def is_cuda(self) -> bool:
        return self.name == "cuda"

    def describe(self) -> str:
        """A short label: "cpu", "cuda sm90 (attention: flash > efficient > math > cudnn)"."""
        if not self.is_cuda:
            return self.name
        major, minor = self.capability or (0, 0)
        torch_version = ""
        if self.torch_version is not None:
            torch_version = ", torch {}.{}'s autograd".format(*self.torch_version)
        return f"cuda sm{major}{minor} (attention: {' > '.join(self.attention)}{torch_version})"

    @property
    def softmax_keeps_input(self) -> bool:
        """Before torch 1.11, softmax's and log_softmax's autograd kept their input as well as
        their output (pytorch/pytorch#64000, fixed by #65242)."""
        return self.torch_version is not None and self.torch_version < SOFTMAX_KEPT_INPUT_BEFORE


# -- scratch: what a kernel allocates and frees inside its op ----------------------------------------
def _itemsize(t: Tensor) -> int:
    """Bytes per element of a traced tensor (`nbytes` counts its elements, dense)."""
    return t.nbytes // max(prod(t.shape), 1)


def _dense_copy_of_broadcast_operands(graph: Graph, op: Op) -> int:
    """mm-class kernels (CPU BLAS and cuBLAS alike: `prepare_matrix_for_cublas` clones an operand
    whose strides no BLAS layout takes) copy a broadcast operand to dense memory."""
    return sum(graph.tensors[t].nbytes for t in op.inputs if graph.tensors[t].expanded)


def _cpu_promoted_operands(graph: Graph, op: Op) -> int:
    """CPU binary arithmetic copies each operand of another dtype than its result to the result's
    dtype before the loop (TensorIterator `promote_inputs_to_common_dtype`); CUDA casts in the
    loop. A 0-dim operand (a wrapped Python number) costs a few bytes: not counted."""
    if not op.outputs:
        return 0
    out = graph.tensors[op.outputs[0]]
    itemsize = _itemsize(out)
    return sum(
        prod(graph.tensors[t].shape) * itemsize
        for t in op.inputs
        if graph.tensors[t].shape and graph.tensors[t].dtype != out.dtype
    )


def _cpu_bool_mask_copy(graph: Graph, op: Op) -> int:
    """CPU dropout multiplies by its bool mask (Dropout.cpp: `input.mul(mask).mul_(scale)`, and
    `grad * mask * scale` backward): TensorIterator copies the mask to the float operand's dtype."""
    return graph.tensors[op.inputs[0]].nbytes


def _cpu_convolution_backward(graph: Graph, op: Op) -> int:
    """oneDNN's convolution backward reorders the input and its gradient into blocked layouts."""
    return 2 * graph.tensors[op.inputs[1]].nbytes


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _flash_attention_backward(graph: Graph, op: Op) -> int:
    """FlashAttention-2's backward (flash_api.cpp `mha_bwd`, as torch 2.13 builds it): `softmax_d`,
    fp32 (batch, heads, seq_q rounded to 128), and `dq_accum`, fp32 (batch, seq_q rounded to 128,
    heads, head_dim rounded to 32; 256 past 192), always (`loop = true`); with fewer K/V heads than
    query heads (GQA) also dk and dv expanded to every query head, in the inputs' dtype."""
    grad, query, key = (graph.tensors[t] for t in op.inputs[:3])
    batch, heads, seq_q, head_dim = query.shape
    seq_k, kv_heads = key.shape[2], key.shape[1]
    seq_q_rounded = _round_up(seq_q, 128)
    head_dim_rounded = _round_up(head_dim, 32) if head_dim <= 192 else 256
    fp32 = 4
    scratch = fp32 * batch * heads * seq_q_rounded * (1 + head_dim_rounded)
    if kv_heads != heads:
        itemsize = _itemsize(grad)
        scratch += 2 * batch * seq_k * heads * head_dim * itemsize
    return scratch


def _efficient_attention_backward(graph: Graph, op: Op) -> int:
    """The memory-efficient (xformers/CUTLASS) backward: `delta`, fp32 (batch, heads, seq_q), and
    in half precision an fp32 accumulator of the query's gradient (an approximation of the
    kernel's `workspace_size()`, which also depends on the key-split count)."""
    grad, query = (graph.tensors[t] for t in op.inputs[:2])
    batch, heads, seq_q, head_dim = query.shape
    itemsize = _itemsize(grad)
    accumulator = 4 * batch * heads * seq_q * head_dim if itemsize < 4 else 0
    return 4 * batch * heads * seq_q + accumulator


CPU_SCRATCH: Mapping[str, ScratchRule] = {
    "convolution_backward": _cpu_convolution_backward,
    **dict.fromkeys(("mm", "addmm", "bmm", "baddbmm"), _dense_copy_of_broadcast_operands),
    **dict.fromkeys(("native_dropout", "native_dropout_backward"), _cpu_bool_mask_copy),
    **dict.fromkeys(
        ("add", "add_", "sub", "sub_", "rsub", "mul", "mul_", "div", "div_"), _cpu_promoted_operands
    ),
}


def _cuda_softmax_backward(graph: Graph, op: Op) -> int:
    """CUDA's softmax backward (SoftMax.cu `softmax_backward_cuda_out`) first forms
    `tmp = grad * output`, a tensor of the gradient's shape in the two's promoted dtype. Measured
    on an H100: 512 MiB over the output for fp32 scores of 32 x 2048 x 2048."""
    grad, output = (graph.tensors[t] for t in op.inputs[:2])
    return max(_itemsize(grad), _itemsize(output)) * prod(grad.shape)


def _cuda_outer_reduction(graph: Graph, op: Op) -> int:
    """A sum over the leading dims of a contiguous tensor (a bias's gradient: the batch and
    sequence summed away) splits each output's inputs across thread blocks once a thread would
    sum 256 or more, and stages the blocks' partial sums in global memory: fp32 (double for
    fp64), `outputs x blocks per output x 32 lanes x 4` (vectorised outputs), plus an int
    semaphore per block column. This is `setReduceConfig` of ATen's Reduce.cuh for that case
    (block 32 x 4 threads, up to `SMs x threads per SM / 128` blocks). Measured on an H100
    (132 SMs), every one of 40 shapes from 256 to 32,768 rows by 256 to 8,192 columns, bf16 and
    fp32, to the byte: 0 at 256 rows, 25,166,336 B at 1,024 x 3,072, capped at 138,412,544 B.
    Other reductions are not modelled (their staging is small)."""
    source, result = graph.tensors[op.inputs[0]], graph.tensors[op.outputs[0]]
    shape, out = tuple(source.shape), tuple(result.shape)
    cut = next(
        (
            c
            for c in range(1, len(shape))
            if len(out) in (len(shape) - c, len(shape))
            and out[len(out) - len(shape) + c :] == shape[c:]
            and all(n == 1 for n in out[: len(out) - len(shape) + c])
        ),
        None,
    )
    if cut is None or source.expanded:
        return 0
    kept = shape[cut:]
    contiguous = [prod(source.shape[i + 1 :]) for i in range(len(source.shape))]
    if any(
        s != c for s, c, n in zip(source.stride, contiguous, source.shape, strict=True) if n > 1
    ):
        return 0
    outputs, rows = prod(kept), prod(source.shape[:cut])
    if outputs < 1 or rows < 1:
        return 0
    vector = next(v for v in (4, 2, 1) if outputs % v == 0)
    max_threads = 512 // vector
    width_pow2 = min(1 << ((outputs // vector).bit_length() - 1), max_threads)
    rows_pow2 = min(1 << (rows.bit_length() - 1), max_threads)
    block_height = min(rows_pow2, max_threads // min(width_pow2, 32))
    block_width = min(width_pow2, max_threads // block_height)
    if rows < block_height * 16 and rows < 256:
        return 0  # each warp sums its own outputs: no split across blocks
    per_thread = -(-rows // block_height)
    grid = -(-(outputs // vector) // block_width)
    target = graph.info.get("cuda_multiprocessors", 132) * (
        graph.info.get("cuda_threads_per_multiprocessor", 2048) // (block_width * block_height)
    )
    if per_thread < 256 or grid > target:
        return 0
    ctas = max(min(-(-target // grid), -(-per_thread // 16)), -(-per_thread // 256))
    if ctas <= 1:
        return 0
    accumulator = 8 if _itemsize(source) == 8 else 4
    staging = accumulator * outputs * ctas * block_width * vector
    semaphores = -(-4 * grid // 512) * 512  # an int per block column, in 512-byte blocks
    return staging + semaphores


CUDA_SCRATCH: Mapping[str, ScratchRule] = {
    "sum": _cuda_outer_reduction,
    **dict.fromkeys(("mm", "addmm", "bmm", "baddbmm"), _dense_copy_of_broadcast_operands),
    "_softmax_backward_data": _cuda_softmax_backward,
    "_scaled_dot_product_flash_attention_backward": _flash_attention_backward,
    # cuDNN's backward keeps an fp32 dQ accumulator and softmax statistics of the same shapes.
    "_scaled_dot_product_cudnn_attention_backward": _flash_attention_backward,
    "_scaled_dot_product_efficient_attention_backward": _efficient_attention_backward,
}


def scratch_bytes(graph: Graph, op: Op) -> int:
    """Scratch the kernel of `op` allocates and frees inside the op on the graph's target, which no
    traced tensor shows (docs/memory-model.md): measured at trace time where the trace could
    (`remat.device.kernel_scratch`: oneDNN's convolutions), else by the target's rule."""
    measured = graph.info.get("kernel_scratch", {}).get(str(op.index))
    if measured is not None:
        return measured
    rule = scratch_rules(graph.info.get("target", "cpu")).get(op.short)
    return rule(graph, op) if rule is not None else 0


def ops_scratch_bytes(graph: Graph) -> list[int]:
    """`scratch_bytes` of every op of `graph`, by index: worked out once per graph (`Graph.memo`),
    since every simulation of a plan adds them at each position. Worked out again when what they
    are read from changes: the ops, the measured scratch, the target."""
    key = (len(graph.ops), graph.info.get("kernel_scratch"), graph.info.get("target"))
    found = graph.memo.get("scratch_bytes")
    if found is None or found[0] != key:
        found = graph.memo["scratch_bytes"] = (key, [scratch_bytes(graph, op) for op in graph.ops])
    return found[1]


def scratch_rules(target_name: str) -> Mapping[str, ScratchRule]:
    return CUDA_SCRATCH if target_name == "cuda" else CPU_SCRATCH


def _ops(names: str) -> tuple[str, ...]:
    """Op names written as text, one or more a line."""
    return tuple(names.split())


# -- CUDA autocast ------------------------------------------------------------------------------------
#: `torch.autocast("cuda")`'s ops by cast policy, as torch 2.13 registers them for the AutocastCUDA
#: key (aten/src/ATen/autocast_mode.h, the AT_FORALL_* lists, and autocast_mode.cpp). Names are
#: `op` or `op.overload`; an op listed without its overload covers its default overload.
CUDA_AUTOCAST: Mapping[str, tuple[str, ...]] = {
    # cast every floating input to the autocast dtype (bf16 / fp16)
    "lower_precision_fp": _ops(
        """
        _convolution.deprecated _convolution conv1d conv2d conv3d conv_tbc conv_transpose1d
        conv_transpose2d.input conv_transpose3d.input convolution prelu addmm addmv addr matmul
        einsum mm mv linalg_vecdot linear addbmm baddbmm bmm chain_matmul linalg_multi_dot
        _thnn_fused_lstm_cell _thnn_fused_gru_cell lstm_cell gru_cell rnn_tanh_cell
        rnn_relu_cell _scaled_dot_product_flash_attention scaled_dot_product_attention
        cudnn_convolution cudnn_convolution_transpose
        """
    ),
    # cast every floating input to fp32
    "fp32": _ops(
        """
        acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan
        pow.Tensor_Scalar pow.Tensor_Tensor pow.Scalar softplus layer_norm native_layer_norm
        rms_norm group_norm frobenius_norm.dim nuclear_norm nuclear_norm.dim cosine_similarity
        poisson_nll_loss cosine_embedding_loss nll_loss nll_loss2d hinge_embedding_loss kl_div
        l1_loss smooth_l1_loss huber_loss mse_loss margin_ranking_loss multilabel_margin_loss
        soft_margin_loss triplet_margin_loss multi_margin_loss binary_cross_entropy_with_logits
        dist pdist cdist renorm logsumexp upsample_nearest1d _upsample_nearest_exact1d
        upsample_nearest2d _upsample_nearest_exact2d upsample_nearest3d
        _upsample_nearest_exact3d upsample_linear1d upsample_bilinear2d _upsample_bilinear2d_aa
        upsample_trilinear3d upsample_bicubic2d _upsample_bicubic2d_aa
        """
    ),
    # run in fp32 through the op's own `dtype` argument, unless the caller gave one
    "fp32_set_opt_dtype": _ops(
        """
        prod prod.dim_int softmax.int log_softmax.int cumprod cumsum linalg_vector_norm
        linalg_matrix_norm linalg_matrix_norm.str_ord sum sum.dim_IntList
        """
    ),
    # redispatch to the overload that takes a dtype, with fp32
    "fp32_append_dtype": _ops(
        """
        norm.Scalar norm.ScalarOpt_dim
        """
    ),
    # run in the widest floating dtype among the inputs
    "promote": _ops(
        """
        addcdiv addcmul atan2 bilinear cross dot vdot grid_sampler index_put tensordot
        scatter_add
        """
    ),
}

#: Ops CUDA autocast refuses (autocast_mode.cpp `binary_cross_entropy_banned`).
CUDA_AUTOCAST_BANNED = ("binary_cross_entropy",)

# -- kernels CUDA runs where the CPU runs others ------------------------------------------------------
#: Composite ops whose CUDA path calls another kernel; each is re-routed for a CUDA trace.
#: - dropout: Dropout.cpp `is_fused_kernel_acceptable` (CUDA, 0 < p < 1, not empty) runs the fused
#:   `native_dropout`, which saves a bool mask; the CPU path multiplies by a float mask it saves.
#: - rms_norm: layer_norm.cpp `rms_norm_symint` calls `_fused_rms_norm`, which has a CUDA kernel
#:   (native_functions.yaml) saving the input and an fp32 rstd; on the CPU it is composite.
#: - scaled_dot_product_attention: the backend `select_attention` picks (sdp_utils.cpp).
CUDA_REROUTES = ("dropout", "rms_norm", "scaled_dot_product_attention")

#: Normalisation kernels whose statistics outputs (by position) are fp32 on CUDA for half inputs:
#: layer_norm_kernel.cu allocates mean/rstd in the accumulate type; the batch-norm CUDA kernels
#: keep save_mean/save_invstd in it too (torch/_decomp `native_batch_norm_helper` casts them to
#: the input dtype on the CPU only).
CUDA_FP32_STATISTICS: Mapping[str, tuple[int, ...]] = {
    "native_layer_norm": (1, 2),
    "native_batch_norm": (1, 2),
    "_native_batch_norm_legit": (1, 2),
    "_fused_rms_norm": (1,),
}


# -- attention backend selection ----------------------------------------------------------------------
@dataclass(frozen=True)
class AttentionCall:
    """What SDPA's backend selection looks at (sdp_utils.cpp `sdp_params` and its checks)."""

    dtype: str
    head_dim_qk: int
    head_dim_v: int
    seq_q: int
    seq_k: int
    heads_q: int
    heads_kv: int
    has_mask: bool
    dropout: float
    is_causal: bool
    requires_grad: bool
    last_dim_contiguous: bool = True


def _within(capability: tuple[int, int], low: tuple[int, int], high: tuple[int, int]) -> bool:
    return low <= capability <= high


def attention_backend_fits(backend: str, call: AttentionCall, capability: tuple[int, int]) -> bool:
    """Whether torch 2.13's `can_use_<backend>_attention` accepts `call` on a GPU of `capability`
    (sdp_utils.cpp; the checks that depend on shapes, dtypes and the GPU, not on runtime flags)."""
    half = call.dtype in ("float16", "bfloat16")
    dtype_ok = call.dtype == "float16" or (call.dtype == "bfloat16" and capability >= (8, 0))
    if backend == "math":
        return True
    if not call.last_dim_contiguous:
        return False
    if backend == "flash":
        sm86_89_or_120 = _within(capability, (8, 6), (8, 9)) or _within(
            capability, (12, 0), (12, 1)
        )
        big_head = 192 < call.head_dim_qk <= 224 or (call.head_dim_qk > 224 and call.dropout > 0)
        return (
            _within(capability, (8, 0), (12, 1))
            and dtype_ok
            and call.head_dim_qk == call.head_dim_v <= 256
            and not call.has_mask
            and not (call.is_causal and call.seq_q != call.seq_k)
            and not (call.requires_grad and sm86_89_or_120 and big_head)
        )
    if backend == "efficient":
        alignment = (8 if half else 4) if capability >= (8, 0) else (8 if half else 1)
        return (
            _within(capability, (5, 0), (12, 1))
            and (dtype_ok or call.dtype == "float32")
            and call.heads_q == call.heads_kv
            and call.head_dim_qk % alignment == 0
            and call.head_dim_v % alignment == 0
        )
    if backend == "cudnn":
        limit = 256 if capability == (9, 0) else 128
        return (
            _within(capability, (8, 0), (12, 1))
            and dtype_ok
            and call.head_dim_qk <= limit
            and call.head_dim_v <= limit
            and call.head_dim_qk % 8 == 0
            and call.head_dim_v % 8 == 0
            and call.seq_k > 1
            and not (call.seq_q == 1 and call.dropout > 0)
        )
    raise RematError(
        f"unknown attention backend {backend!r}: choose one of {', '.join(ATTENTION_OPS)}"
    )


def select_attention(target: Target, call: AttentionCall) -> str:
    """The backend SDPA runs `call` with on `target`: the first of its priority order whose checks
    pass (math always does)."""
    capability = target.capability or (0, 0)
    for backend in target.attention:
        if attention_backend_fits(backend, call, capability):
            return backend
    return "math"


# -- constructors ----------------------------------------------------------------------------------
#: `torch.utils.checkpoint` keeps a copy of the CPU generator's state per random region: on a CPU
#: target it is device memory (`torch.get_rng_state().numel()` bytes); on a CUDA target it sits in
#: host memory, as does the CUDA generator's state (`torch.cuda.get_rng_state()` is a CPU tensor).
CPU_RNG_STATE_BYTES = 5056

CPU = Target("cpu", rng_state_bytes=CPU_RNG_STATE_BYTES)


#: The first torch whose softmax autograd keeps only the output.
SOFTMAX_KEPT_INPUT_BEFORE = (1, 11)


def cuda(
    capability: tuple[int, int] = (9, 0),
    attention: str | tuple[str, ...] = "auto",
    torch_version: tuple[int, int] | None = None,
    multiprocessors: int = 132,
) -> Target:
    """A CUDA target: a GPU of `capability` (default sm90, an H100). `attention`: "auto" (torch's
    default priority, flash first), "cudnn-first" (torch's order when it prefers cuDNN: sm90/sm100
    with cuDNN newer than 9.15), one backend name to force it, or a priority tuple.
    `torch_version`: an older torch the run had, for what its autograd saved differently (only
    softmax's input before 1.11 is modelled); None: torch 2.13. `multiprocessors`: the GPU's SMs
    (default: an H100 SXM's 132)."""
    if attention == "auto":
        order: tuple[str, ...] = DEFAULT_ATTENTION_PRIORITY
    elif attention == "cudnn-first":
        order = CUDNN_FIRST_ATTENTION_PRIORITY
    elif isinstance(attention, str):
        order = (attention,)
    else:
        order = tuple(attention)
    unknown = [b for b in order if b not in ATTENTION_OPS]
    if unknown:
        raise RematError(
            f"unknown attention backend {unknown[0]!r}: choose auto, cudnn-first or one of "
            f"{', '.join(ATTENTION_OPS)}"
        )
    if len(capability) != 2 or not all(isinstance(c, int) for c in capability):
        raise RematError(f"a compute capability is (major, minor), got {capability!r}")
    return Target(
        "cuda",
        tuple(capability),
        order,
        rng_state_bytes=0,
        torch_version=torch_version,
        multiprocessors=multiprocessors,
    )


def runtime_cuda(device: Any = None) -> Target:
    """The target of the CUDA device this process runs on, as torch runs there: its compute
    capability, and the attention backend torch's SDPA picks for a bf16 training call (cuDNN
    first where torch prefers it: sm90/sm100 with a cuDNN newer than 9.15, which the CUDA 13
    wheels ship; an H100 with torch 2.11+cu130 ran `_scaled_dot_product_cudnn_attention`
    where a flash-first trace kept flash's op). Needs a CUDA device."""
    import torch
    from torch.nn.attention import SDPBackend

    device = torch.device(device if device is not None else "cuda")
    capability = torch.cuda.get_device_capability(device)
    q = torch.empty(1, 1, 128, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    chosen = torch._fused_sdp_choice(q, q, q, is_causal=True)
    attention = "cudnn-first" if chosen == int(SDPBackend.CUDNN_ATTENTION) else "auto"
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return cuda(capability, attention, multiprocessors=sms)


def get_target(target: Target | str | None) -> Target:
    """A `Target` from a name: "cpu" (the default), "cuda" (an sm90 GPU), "cuda:sm80"."""
    if target is None or target == "cpu":
        return CPU
    if isinstance(target, Target):
        return target
    name, _, arch = str(target).partition(":")
    if name == "cuda":
        if not arch:
            return cuda()
        digits = arch.removeprefix("sm")
        if digits.isdigit() and len(digits) >= 2:
            return cuda((int(digits[:-1]), int(digits[-1])))
    raise RematError(
        f"unknown target {target!r}: use 'cpu', 'cuda' (an H100-class sm90 GPU) or 'cuda:sm80'"
    )
