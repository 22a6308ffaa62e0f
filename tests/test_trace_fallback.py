"""Ops that cannot run on fake tensors become a `TraceError` that names the op and the module and
says to trace on real tensors; tracing on real tensors works, leaves the caller's random stream
alone, and `fits_in_memory_for_real_trace` tells when that is safe."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import remat
from remat.errors import TraceError
from remat.tracing.trace import fits_in_memory_for_real_trace


class Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        return h[torch.nonzero(h > 0, as_tuple=True)].sum()  # shape depends on the values


class Router(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = Masked()

    def forward(self, x):
        return self.gate(x)


def test_data_dependent_op_names_op_and_module_path_on_meta_and_traces_on_cpu():
    with pytest.raises(TraceError) as err:
        remat.trace(Router(), torch.randn(4, 8))
    msg = str(err.value)
    assert "nonzero" in msg
    assert "module 'gate'" in msg
    assert "device='cpu'" in msg and "trace_device='cpu'" in msg
    assert err.value.fake_tensor_failure is True
    assert err.value.__cause__ is not None

    graph = remat.trace(Router(), torch.randn(4, 8), device="cpu")
    assert any(op.short == "nonzero" for op in graph.ops)
    assert {op.phase for op in graph.ops} >= {"forward", "backward"}


class Experts(nn.Module):
    """Grouped matmul over 2 experts: torch's meta kernel of `_grouped_mm` wants bf16, the CPU
    kernel takes fp32."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(2, 16, 4))
        self.register_buffer("offs", torch.tensor([3, 8], dtype=torch.int32))

    def forward(self, x):
        # square(): the CPU backward of _grouped_mm rejects the stride-0 gradient of a plain sum()
        return torch._grouped_mm(x, self.w, offs=self.offs).square()


class Moe(nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = Experts()

    def forward(self, x):
        return self.experts(x)


def test_fp32_experts_trace_on_fake_tensors_as_on_real_ones():
    """torch's meta `_grouped_mm` wants bf16 (a CUDA kernel's rule); the CPU kernel, and so the
    trace, takes fp32: same ops, FLOPs and saved bytes on fake and on real tensors."""
    x = torch.randn(8, 16)
    with pytest.raises(RuntimeError, match="BF16"):
        torch._grouped_mm(x.to("meta"), torch.randn(2, 16, 4, device="meta"),
                          offs=torch.tensor([3, 8], dtype=torch.int32, device="meta"))  # fmt: skip
    fake, real = (remat.trace(Moe(), x, device=device) for device in ("meta", "cpu"))
    assert [(op.name, op.flops) for op in fake.ops] == [(op.name, op.flops) for op in real.ops]
    assert fake.activation_bytes == real.activation_bytes > 0
    assert next(op for op in fake.ops if op.short == "_grouped_mm").flops == 2 * 8 * 16 * 4


@torch.library.custom_op("remat_tests::picky_scale", mutates_args=())
def picky_scale(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@picky_scale.register_fake
def _(x):
    raise ValueError("picky_scale has no shape rule for these inputs\nsecond line")


picky_scale.register_autograd(lambda ctx, grad: grad * 2)


class Picky(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return picky_scale(self.fc(x))


def test_custom_op_whose_fake_impl_raises_is_a_trace_error():
    holder = nn.Sequential(Picky())
    with pytest.raises(TraceError) as err:
        remat.trace(holder, torch.randn(2, 4))
    msg = str(err.value)
    assert "remat_tests.picky_scale" in msg and "module '0'" in msg
    assert "ValueError: picky_scale has no shape rule for these inputs)" in msg  # first line only
    assert "second line" not in msg
    assert err.value.fake_tensor_failure is True
    graph = remat.trace(holder, torch.randn(2, 4), device="cpu")
    assert any("picky_scale" in op.target for op in graph.ops)


def test_errors_on_real_tensors_say_the_step_is_not_trainable_naming_module_op_and_line():
    """A step that fails on real tensors is the model's own error: a TraceError (one line in the
    CLI, issue 33) naming module, op and line, the original chained, no fallback offered."""

    class Wrong(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(3, 5))

        def forward(self, x):
            return x @ self.w  # (2, 4) @ (3, 5): the user's bug

    with pytest.raises(TraceError) as err:
        remat.trace(nn.Sequential(Wrong()), torch.randn(2, 4), device="cpu")
    message = str(err.value)
    assert "module '0'" in message and "in op aten.mm.default" in message
    assert "`return x @ self.w" in message and "not trainable as written" in message
    assert "mat1 and mat2 shapes cannot be multiplied" in message
    assert isinstance(err.value.__cause__, RuntimeError)
    assert (err.value.module, err.value.op) == ("0", "aten.mm.default")
    assert not err.value.fake_tensor_failure


def test_autograds_own_refusal_on_fake_tensors_offers_no_real_trace(recwarn):
    """An in-place op on a parameter that requires grad is refused by autograd before any kernel:
    real tensors raise it too, so `auto` does not retry on them (issue 33)."""

    class Bumped(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(4))

        def forward(self, x):
            self.w.add_(1)
            return x * self.w

    model = nn.Sequential(nn.Linear(4, 4), Bumped())
    with pytest.raises(TraceError, match="not trainable as written") as err:
        remat.auto(model, torch.randn(2, 4))
    assert "module '1'" in str(err.value) and "`self.w.add_(1)`" in str(err.value)
    assert not err.value.fake_tensor_failure and "device='cpu'" not in str(err.value)
    assert not [w for w in recwarn if "real CPU tensors instead" in str(w.message)]


def _tiny_moe(model_type: str, **fields):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.AutoConfig.for_model(
        model_type,
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        **fields,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).train()


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize(
    "model_type, fields",
    [
        ("mixtral", {"num_local_experts": 4}),
        (
            "qwen2_moe",
            {"num_experts": 4, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64},
        ),
    ],
)
def test_hf_moe_traces_on_fake_tensors_as_on_real_ones(model_type, fields):
    """Hugging Face's experts (one `_grouped_mm` per projection) on fake tensors, so a 47B
    Mixtral is planned without its weights: the bytes autograd saves and the FLOPs, experts'
    included, equal the real trace's."""
    model = _tiny_moe(model_type, **fields)
    ids = torch.randint(0, 500, (2, 16))
    fake, real = (
        remat.trace(model, input_ids=ids, labels=ids, device=device) for device in ("meta", "cpu")
    )
    assert fake.activation_bytes == real.activation_bytes
    assert fake.activation_bytes == remat.measure(model, input_ids=ids, labels=ids).activation_bytes
    experts = [op.flops for op in fake.ops if op.short == "_grouped_mm"]
    assert experts and min(experts) > 0
    assert sum(op.flops for op in fake.ops) == sum(op.flops for op in real.ops)


class Dropper(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(self.fc(x)) + torch.rand_like(x)


def test_real_trace_leaves_the_callers_random_stream_alone():
    model, x = Dropper().train(), torch.randn(4, 8)
    torch.manual_seed(0)
    expected = torch.rand(3)

    torch.manual_seed(0)
    graph = remat.trace(model, x, device="cpu")
    assert any(op.random for op in graph.ops)  # the trace did draw random numbers
    assert torch.equal(torch.rand(3), expected)


def test_fits_in_memory_for_real_trace():
    model, x = nn.Linear(8, 8), torch.randn(2, 8)
    fits, why = fits_in_memory_for_real_trace(model, (x,), {})
    assert fits and "MiB" in why

    with torch.device("meta"):
        meta_model = nn.Linear(8, 8)
    fits, why = fits_in_memory_for_real_trace(meta_model, (x,), {})
    assert not fits and "'weight'" in why and "meta" in why

    fits, why = fits_in_memory_for_real_trace(model, (), {"x": x.to("meta")})
    assert not fits and "input" in why


class SelfCastingRouter(nn.Module):
    """A mixture-of-experts router that casts itself in every forward, as Switch Transformers'
    and NLLB-MoE's do (`self.classifier = self.classifier.to(self.dtype)`)."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.classifier = nn.Linear(8, 4)
        self.dtype = dtype

    def forward(self, x):
        self.classifier = self.classifier.to(self.dtype)
        return self.classifier(x.to(self.dtype)).softmax(-1)


class Routed(nn.Module):
    def __init__(self, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.router = SelfCastingRouter(dtype)

    def forward(self, x):
        return self.router(self.fc(x))


def test_a_router_casting_itself_to_its_own_dtype_traces_on_fake_tensors_as_on_real_ones():
    x = torch.randn(4, 8)
    fake, real = (remat.trace(Routed(), x, device=device) for device in ("meta", "cpu"))
    assert [op.name for op in fake.ops] == [op.name for op in real.ops]
    assert (
        fake.activation_bytes
        == real.activation_bytes
        == remat.measure(Routed(), x).activation_bytes
    )


def test_any_failure_of_the_fake_step_is_a_trace_error_naming_module_line_and_op_and_auto_falls_back():
    """A cast that changes the router's dtype fails on fake tensors outside any op (torch cannot
    swap a fake parameter the trace holds): a TraceError, not torch's raw RuntimeError, naming
    the module and the model's line; `auto` says so and traces on the real tensors."""
    model, x = Routed(torch.float64), torch.randn(4, 8)
    with pytest.raises(TraceError) as err:
        remat.trace(model, x)
    msg = str(err.value)
    assert "module 'router'" in msg
    assert "self.classifier = self.classifier.to(self.dtype)" in msg
    assert "RuntimeError" in msg and "device='cpu'" in msg
    assert err.value.fake_tensor_failure and err.value.module == "router"
    assert err.value.op is not None  # the last op traced before the failure
    with pytest.warns(remat.errors.RematWarning, match="tracing on real CPU tensors instead"):
        plan = remat.auto(Routed(torch.float64), x, budget="100%")
    assert plan.predicted_peak_bytes > 0
