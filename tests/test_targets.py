"""A CUDA target traces the kernels a GPU runs, on fake CPU tensors (remat.device.targets, remat.device.emulate).

The CUDA rules are pinned two ways: against torch's own CUDA dispatch on this machine (fake CUDA
tensors run forward without autograd: CUDA autocast's casts and the CUDA meta kernels' outputs
are observable there), and by small cases whose bytes are stated.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import remat
from remat import models
from remat.device import emulate, targets
from remat.device.gpus import get_gpu
from remat.device.targets import AttentionCall, select_attention
from remat.errors import RematError, TraceError
from remat.planning import strategies
from remat.prediction import schedule
from remat.prediction.estimate import estimate


class _Record(TorchDispatchMode):
    """Every aten op that reaches the backend: (op, input dtypes, output dtypes)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple[str, ...], tuple[str, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is not torch.ops.prim.device.default:
            ins = tuple(str(t.dtype) for t in _tensors((args, kwargs)))
            self.ops.append((str(func), ins, tuple(str(t.dtype) for t in _tensors(out))))
        return out


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


# The ops a transformer's forward and loss reach through autocast, one call each. SDPA and
# rms_norm are left out: their CUDA kernels are not in this CPU build (fake CUDA tensors take the
# composite paths), so the reroutes are tested on their own below.
_CALLS = {
    "linear": lambda x, w, i: F.linear(x, w),
    "matmul": lambda x, w, i: x @ w,
    "bmm": lambda x, w, i: torch.bmm(x, x.transpose(1, 2)),
    "softmax": lambda x, w, i: torch.softmax(x, -1),
    "softmax with dtype": lambda x, w, i: torch.softmax(x, -1, dtype=torch.float16),
    "log_softmax": lambda x, w, i: F.log_softmax(x, -1),
    "cross_entropy": lambda x, w, i: F.cross_entropy(x.flatten(0, 1), i),
    "layer_norm": lambda x, w, i: F.layer_norm(x, (8,)),
    "group_norm": lambda x, w, i: F.group_norm(x, 2),
    "sum": lambda x, w, i: x.sum(),
    "sum dim": lambda x, w, i: x.sum(-1),
    "exp": lambda x, w, i: torch.exp(x),
    "pow": lambda x, w, i: x.pow(2),
    "rsqrt": lambda x, w, i: torch.rsqrt(x),
    "cumsum": lambda x, w, i: torch.cumsum(x, -1),
    "norm": lambda x, w, i: torch.norm(x),
    "addcmul (promote)": lambda x, w, i: torch.addcmul(x, x.half(), x),
    "cat (only CPU autocast lists it)": lambda x, w, i: torch.cat([x, x.bfloat16()]),
    "mse_loss": lambda x, w, i: F.mse_loss(x, x),
    "gelu (no policy)": lambda x, w, i: F.gelu(x),
}


def _cuda_autocast_ops(call, dtype: torch.dtype) -> list:
    """The backend ops `call` issues on fake CUDA tensors under CUDA autocast (no autograd)."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        x, w = torch.empty(2, 4, 8, device="cuda"), torch.empty(8, 8, device="cuda")
        i = torch.zeros(8, dtype=torch.long, device="cuda")
        prior = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
        torch.set_autocast_enabled("cuda", True)
        torch.set_autocast_dtype("cuda", dtype)
        torch.autocast_increment_nesting()
        try:
            with _Record() as record:
                call(x, w, i)
        finally:
            torch.autocast_decrement_nesting()
            torch.clear_autocast_cache()
            torch.set_autocast_enabled("cuda", prior[0])
            torch.set_autocast_dtype("cuda", prior[1])
    return record.ops


def _emulated_ops(call, dtype: torch.dtype) -> list:
    """The same on fake CPU tensors with the CUDA target's autocast installed."""
    with (
        emulate.installed(targets.cuda(), dtype) as dispatch,
        FakeTensorMode(allow_non_fake_inputs=True),
    ):
        x, w = torch.empty(2, 4, 8), torch.empty(8, 8)
        i = torch.zeros(8, dtype=torch.long)
        with dispatch.autocast(), _Record() as record:
            call(x, w, i)
    return record.ops


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", list(_CALLS))
def test_cuda_autocast_emulation_casts_as_torchs_cuda_autocast(name, dtype):
    assert _emulated_ops(_CALLS[name], dtype) == _cuda_autocast_ops(_CALLS[name], dtype)


def test_cuda_autocast_table_lists_exactly_the_ops_torch_registers_for_autocast_cuda():
    registered = {
        name.removeprefix("aten::")
        for name in torch._C._dispatch_get_all_op_names()
        if name.startswith("aten::")
        and torch._C._dispatch_has_kernel_for_dispatch_key(name, "AutocastCUDA")
    }
    listed = {n for names in targets.CUDA_AUTOCAST.values() for n in names}
    assert listed | set(targets.CUDA_AUTOCAST_BANNED) == registered


def test_cuda_autocast_casts_a_calls_arguments_last_first_as_the_cpp_wrapper_does():
    """Autocast's C++ wrapper casts a call's arguments in one argument list, which GCC evaluates
    right to left: a linear's bias, weight, then input. On an H100 the real trace's
    `lm_head._to_copy_0` was the weight's copy where the emulation's was the input's: a
    selective policy keyed by `_to_copy_0` named another tensor. CPU autocast runs the same
    wrapper on real tensors: the oracle here."""

    def casts(device: str, target: str) -> list[tuple[int, ...]]:
        layer = nn.Linear(64, 1000, device=device)
        x = torch.zeros(4, 64, device=device, requires_grad=True)
        graph = remat.trace(layer, x, device=device, autocast=torch.bfloat16, target=target)
        return [
            graph.tensors[op.outputs[0]].shape for op in graph.forward_ops if op.short == "_to_copy"
        ]

    assert casts("cpu", "cpu") == casts("meta", "cuda") == [(1000,), (1000, 64), (4, 64)]


def test_the_cpu_autocast_is_restored_after_a_cuda_target_trace():
    """The CUDA policies are installed for one trace only: CPU autocast's own lists come back
    (under CPU autocast, softmax stays bf16 and cat promotes)."""
    model, inputs = models.build("llama-3.2-1b", tiny=True)
    remat.trace(model, *inputs, target="cuda", autocast=torch.bfloat16)
    with FakeTensorMode(), torch.autocast("cpu", dtype=torch.bfloat16):
        x = torch.empty(2, 8, dtype=torch.bfloat16)
        assert torch.softmax(x, -1).dtype == torch.bfloat16
        assert F.linear(torch.empty(2, 8), torch.empty(4, 8)).dtype == torch.bfloat16
        dropout = _Record()
        with dropout:
            F.dropout(torch.empty(4, 8), 0.5, True)
    assert not any("native_dropout" in op for op, _, _ in dropout.ops)


class _Norms(nn.Module):
    def __init__(self, norm: nn.Module):
        super().__init__()
        self.norm = norm

    def forward(self, x):
        return self.norm(x) * 2


def _saved_bytes(model: nn.Module, x: torch.Tensor, target: str) -> int:
    graph = remat.trace(model, x, target=target)
    return sum(graph.storages[s].nbytes for s in graph.saved_storages)


def test_cuda_layer_norm_keeps_fp32_statistics_where_the_cpu_keeps_the_input_dtype():
    """bf16 LayerNorm over (64, 512) rows: the saved mean and rstd are 64 fp32 values each on
    CUDA (512 B), 64 bf16 values on the CPU (256 B); the input (64 KiB) and weight are saved on
    both."""
    model = _Norms(nn.LayerNorm(512)).to(torch.bfloat16)
    x = torch.empty(64, 512, dtype=torch.bfloat16, device="meta")
    assert _saved_bytes(model, x, "cuda") - _saved_bytes(model, x, "cpu") == 2 * 64 * (4 - 2)
    with FakeTensorMode():
        stats = torch.ops.aten.native_layer_norm(
            torch.empty(64, 512, dtype=torch.bfloat16, device="cuda"), [512], None, None, 1e-5
        )
    assert [t.dtype for t in stats[1:]] == [torch.float32] * 2  # torch's CUDA meta agrees


def test_cuda_dropout_saves_a_bool_mask_where_the_cpu_saves_a_float_one():
    """Dropout of 1024 x 1024 fp32 activations: CUDA's fused kernel saves a 1 MiB bool mask, the
    CPU path a 4 MiB float mask."""
    model = _Norms(nn.Dropout(0.1))
    x = torch.empty(1024, 1024, device="meta", requires_grad=True)
    assert _saved_bytes(model, x, "cuda") == 1024 * 1024
    assert _saved_bytes(model, x, "cpu") == 4 * 1024 * 1024


def test_cuda_dropout_at_zero_runs_no_op_as_the_cpu_does():
    """At p = 0 (GPT-2's default here) ATen's dropout returns its input (`_dropout_impl`); the
    Python decomposition the CUDA emulation fell back to cloned it, an op and a tensor the GPU
    never makes. The CPU's real trace is the oracle: no op either."""

    def ops(device: str, target: str) -> list[str]:
        x = torch.zeros(64, 64, device=device, requires_grad=True)
        graph = remat.trace(lambda t: F.dropout(t, 0.0, True) * 2, x, device=device, target=target)
        return [op.short for op in graph.forward_ops]

    assert ops("meta", "cuda") == ops("cpu", "cpu") == ["mul", "sum"]  # the loss: the sum


def test_cuda_rms_norm_runs_the_fused_kernel_saving_its_input_and_an_fp32_rstd():
    """nn.RMSNorm over bf16 (256, 1024): `_fused_rms_norm` saves the input (512 KiB), the weight
    (a parameter: not an activation) and rstd, 256 fp32 values (1 KiB)."""
    model = _Norms(nn.RMSNorm(1024)).to(torch.bfloat16)
    x = torch.empty(256, 1024, dtype=torch.bfloat16, device="meta", requires_grad=True)
    graph = remat.trace(model, x, target="cuda")
    assert [op.short for op in graph.forward_ops if "rms" in op.short] == ["_fused_rms_norm"]
    assert "_fused_rms_norm_backward" in {op.short for op in graph.backward_ops}
    assert graph.activation_bytes == 256 * 1024 * 2 + 256 * 4 + _mul_saves(graph)


def _mul_saves(graph) -> int:
    """Bytes saved by the `* 2` after the norm (a scalar multiply saves nothing)."""
    return sum(
        graph.storages[s].nbytes
        for s in graph.saved_storages
        if graph.producer_op(s) is not None and graph.producer_op(s).short == "mul"
    )


class _Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return y.transpose(1, 2).reshape(b, t, c)


def test_cuda_flash_attention_saves_its_outputs_and_allocates_fp32_accumulators_in_backward():
    """bf16 attention, batch 2, 8 heads of 64, 300 tokens, on an H100: flash saves q, k, v (views
    of the projection), its output and the fp32 log-sum-exp (2 x 8 x 300 x 4 B); its backward
    allocates softmax_d (2 x 8 x 384 x 4 B: 300 rounded to 128) and dq_accum (2 x 384 x 8 x 64
    x 4 B), scratch the simulation adds to the backward op's live bytes."""
    model = _Attention(512, 8).to(torch.bfloat16)
    x = torch.empty(2, 300, 512, dtype=torch.bfloat16, device="meta", requires_grad=True)
    graph = remat.trace(model, x, target="cuda")
    forward = graph.op_by_name["_scaled_dot_product_flash_attention_0"]
    lse = graph.tensors[forward.outputs[1]]
    assert (lse.shape, lse.dtype) == ((2, 8, 300), "float32")
    saved = {graph.tensors[sv.tensor].shape for sv in graph.saved if sv.node is not None}
    assert {(2, 8, 300, 64), (2, 8, 300)} <= saved
    backward = next(
        op
        for op in graph.backward_ops
        if op.short == "_scaled_dot_product_flash_attention_backward"
    )
    assert targets.scratch_bytes(graph, backward) == 4 * 2 * 8 * 384 * (1 + 64)


def test_cuda_softmax_backward_forms_grad_times_output_first():
    """SoftMax.cu's backward computes `tmp = grad * output` before its kernel: on an H100 the
    explicit-softmax attention of megatron-gpt (fp32 scores 32 x 2048 x 2048) peaked 512 MiB
    over its output there, at every layer. The CPU kernel forms no such tensor."""
    scores = torch.empty(4, 64, 64, device="meta", requires_grad=True)
    for target, expected in (("cuda", 4 * 4 * 64 * 64), ("cpu", 0)):
        graph = remat.trace(lambda s: torch.softmax(s, -1), scores, target=target)
        (backward,) = (op for op in graph.backward_ops if op.short == "_softmax_backward_data")
        assert targets.scratch_bytes(graph, backward) == expected


#: `benchmarks/gpu_kernel_scratch.py` on an H100 80GB HBM3 (132 SMs, torch 2.11.0+cu130): the
#: caching allocator's peak in `x.sum(0)` less what it leaves, bf16 and fp32 alike.
H100_SUM_SCRATCH = {
    (256, 3072): 0,
    (1024, 256): 2_097_664,
    (1024, 3072): 25_166_336,
    (4096, 768): 25_166_336,
    (4096, 3072): 100_663_808,
    (4096, 8192): 138_412_544,
    (8192, 256): 16_777_728,
    (32768, 256): 67_109_376,
    (32768, 768): 138_412_544,
}


@pytest.mark.parametrize("shape", sorted(H100_SUM_SCRATCH))
def test_cuda_outer_sums_stage_partial_sums_as_an_h100_measured(shape):
    """A bias's gradient sums the batch away: past 256 values a thread, CUDA splits each column
    across blocks and stages their fp32 partial sums (at 4096 x 3072: 96 MiB, which gpt2's MLP
    bias showed over the prediction at every layer)."""
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.empty(*shape, dtype=dtype, device="meta", requires_grad=True)
        graph = remat.trace(lambda t: t.sum(0), x, target=targets.cuda(multiprocessors=132))
        op = next(op for op in graph.forward_ops if op.short == "sum")
        assert targets.scratch_bytes(graph, op) == H100_SUM_SCRATCH[shape]
    three_d = torch.empty(4, 1024, 3072, dtype=torch.bfloat16, device="meta", requires_grad=True)
    graph = remat.trace(lambda t: t.sum((0, 1)), three_d, target="cuda")
    op = next(op for op in graph.forward_ops if op.short == "sum")
    assert targets.scratch_bytes(graph, op) == 100_663_808  # as 4096 x 3072


def test_a_gpus_multiprocessors_size_its_reductions():
    """An A100 (108 SMs) splits a wide column sum over fewer blocks than an H100 (132)."""
    x = torch.empty(8192, 8192, dtype=torch.bfloat16, device="meta", requires_grad=True)
    found = {}
    for gpu in ("h100", "a100-80gb"):
        graph = remat.trace(lambda t: t.sum(0), x, target=get_gpu(gpu).target)
        op = next(op for op in graph.forward_ops if op.short == "sum")
        found[gpu] = targets.scratch_bytes(graph, op)
    assert found == {"h100": 138_412_544, "a100-80gb": 4 * 8192 * 27 * 128 + 512}


def test_a_kept_attention_op_is_found_whichever_fused_backend_runs():
    """The SDPA backend is picked when the step runs (an H100 with torch 2.11+cu130 ran cuDNN's
    where the plan, traced flash-first, kept flash's: "4 of 5 kept ops matched"). Here a plan
    made for a GPU keeps the GPU's attention op and the CPU runs its own flash kernel: every
    kept op is found, and the held bytes are the plan's."""

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn, self.out = _Attention(64, 4), nn.Linear(64, 64)

        def forward(self, x):
            return self.out(self.attn(x))

    model = nn.Sequential(Block(), Block())
    x = torch.randn(2, 32, 64, requires_grad=True)
    meta = nn.Sequential(Block(), Block()).to("meta")
    fake_x = torch.empty(2, 32, 64, device="meta", requires_grad=True)
    graph = remat.trace(meta, fake_x, target=targets.cuda(attention="efficient"))
    plan = remat.plan(graph, budget="100%", strategy="selective:torchtitan")
    attention = {op.target for op in graph.forward_ops if "dot_product" in op.target}
    assert attention == {"aten._scaled_dot_product_efficient_attention.default"}
    kept = {t for r in plan.regions for _, t, _ in r.keep_keys}
    assert schedule.FUSED_ATTENTION in kept
    remat.apply(model, plan)
    verified = remat.verify(model, x)
    remat.remove(model)
    assert verified.kept_ops_matched == verified.kept_ops_expected > 0


def test_the_attention_backend_follows_torchs_selection_for_the_gpu():
    def call(dtype="bfloat16", mask=False, heads_kv=8, head_dim=128, dropout=0.0):
        return AttentionCall(
            dtype=dtype,
            head_dim_qk=head_dim,
            head_dim_v=head_dim,
            seq_q=4096,
            seq_k=4096,
            heads_q=8,
            heads_kv=heads_kv,
            has_mask=mask,
            dropout=dropout,
            is_causal=not mask,
            requires_grad=True,
        )

    h100, a100, v100 = targets.cuda((9, 0)), targets.cuda((8, 0)), targets.cuda((7, 0))
    assert select_attention(h100, call()) == "flash"
    assert select_attention(a100, call(dropout=0.1)) == "flash"
    assert select_attention(h100, call(dtype="float32")) == "efficient"  # flash: half only
    assert select_attention(h100, call(mask=True)) == "efficient"  # flash takes no mask
    assert select_attention(h100, call(dtype="float32", heads_kv=2)) == "math"  # GQA in fp32
    assert select_attention(h100, call(heads_kv=2)) == "flash"  # flash reads grouped K/V
    assert select_attention(v100, call(dtype="float16")) == "efficient"  # flash needs sm80
    assert select_attention(v100, call()) == "math"  # no bf16 kernels before sm80
    assert select_attention(targets.cuda((8, 9)), call(head_dim=200)) == "efficient"
    assert select_attention(targets.cuda((9, 0), "cudnn-first"), call()) == "cudnn"
    assert select_attention(targets.cuda((9, 0), "math"), call()) == "math"


def test_a_cuda_target_is_traced_on_fake_tensors_only():
    model = nn.Linear(4, 4)
    with pytest.raises(TraceError, match="fake tensors"):
        remat.trace(model, torch.randn(2, 4), device="cpu", target="cuda")
    with pytest.raises(RematError, match="unknown target"):
        remat.trace(model, torch.empty(2, 4, device="meta"), target="tpu")


def test_a_checkpointed_cuda_region_holds_no_device_rng_state():
    """The RNG state checkpoint keeps per random region is host memory on a CUDA target."""
    model, inputs = models.build("gpt2", tiny=True, dropout=0.1)
    for target, rng in (("cpu", targets.CPU_RNG_STATE_BYTES), ("cuda", 0)):
        graph = remat.trace(model, *inputs, target=target)
        planner = remat.Planner(graph)
        full = planner.solve(strategies.get("full"), planner.estimate.peak_bytes)
        overheads = schedule.analyse_regions(graph, full.regions).replays
        assert {rep.overhead_bytes for rep in overheads} == {rng}
        assert graph.info["target"] == target
    assert estimate(graph).peak_bytes > 0


def test_torch_before_1_11_kept_softmaxs_input_too():
    """pytorch/pytorch#64000: until torch 1.11 softmax's and log_softmax's autograd kept their input
    beside their output. A 4 x 16 fp32 softmax of a linear output keeps 256 B more (its input)
    for a torch 1.10 target, and the gradients are torch's own either way."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Softmax(-1))
    x = torch.randn(4, 16)
    now = remat.trace(model, x, target=targets.cuda((7, 0)))
    then = remat.trace(model, x, target=targets.cuda((7, 0), torch_version=(1, 10)))
    assert then.activation_bytes - now.activation_bytes == 4 * 16 * 4
    assert "torch 1.10" in then.info["target_detail"]
    log = nn.Sequential(nn.Linear(16, 16), nn.LogSoftmax(-1))
    assert (
        remat.trace(log, x, target=targets.cuda((7, 0), torch_version=(1, 10))).activation_bytes
        - remat.trace(log, x, target=targets.cuda((7, 0))).activation_bytes
        == 4 * 16 * 4
    )


def test_a_catalogue_gpu_sized_by_capacity_keeps_its_multiprocessors():
    """`--gpu a100-80gb --capacity 22GiB` is still an A100: 108 SMs size its reductions' staging,
    not the 132 of an unknown GPU (the count was looked up by name, which the capacity renames)."""
    from remat.device.gpus import get_gpu, with_capacity

    assert get_gpu("a100-80gb").target.multiprocessors == 108
    assert with_capacity("a100-80gb", "22GiB").target.multiprocessors == 108
