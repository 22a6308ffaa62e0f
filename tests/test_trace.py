"""Properties of the tracer: what it records must be what autograd does."""

from __future__ import annotations

import itertools
import resource
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import remat
from remat.errors import TraceError
from remat.graph import Graph


def _autograd_saved_bytes(fn, *args) -> int:
    """Independent count: distinct non-parameter storages autograd packs during the forward."""
    params = set()
    if isinstance(fn, nn.Module):
        params = {p.untyped_storage().data_ptr() for p in fn.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return sum(seen.values())


class ViewsAndInplace(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 64)

    def forward(self, x):
        h = self.fc(x).relu_()  # relu_ saves its (in-place) result: same storage as fc's output
        v = h.view(-1, 8, 8)  # a view: no new storage
        return (v * v).sum(-1) + h.tanh().mean()


def cos_cos(a, b, c, d):
    return torch.cos(torch.cos(a + b + c + d))


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_saved_bytes_equal_what_autograd_saves(device):
    torch.manual_seed(0)
    model = ViewsAndInplace()
    x = torch.randn(16, 32)
    graph = remat.trace(model, x, device=device)
    assert graph.activation_bytes == _autograd_saved_bytes(model, x)


def test_views_and_inplace_share_their_storage():
    graph = remat.trace(ViewsAndInplace(), torch.randn(16, 32))
    relu = next(op for op in graph.ops if op.short == "relu_")
    view = next(op for op in graph.ops if op.short == "view" and op.phase == "forward")
    storage = {graph.tensors[t].storage for t in relu.outputs}
    assert storage == {graph.tensors[t].storage for t in relu.inputs}
    assert storage == {graph.tensors[t].storage for t in view.outputs}
    # fc's output storage is allocated once, by addmm, whatever aliases it
    assert sum(1 for s in graph.storages.values() if s.id in storage) == 1


def test_function_inputs_are_leaves_and_each_saved_tensor_is_read_in_backward():
    xs = [torch.randn(256, requires_grad=True) for _ in range(4)]
    graph = remat.trace(cos_cos, *xs)
    names = [op.name for op in graph.forward_ops]
    assert names[:5] == ["add_0", "add_1", "add_2", "cos_0", "cos_1"]
    saved_producers = sorted(graph.producer_op(sid).name for sid in graph.saved_storages)
    assert saved_producers == ["add_2", "cos_0"]
    for sv in graph.saved:
        readers = [
            op
            for op in graph.backward_ops
            if op.node == sv.node and any(graph.tensors[t].storage == sv.storage for t in op.inputs)
        ]
        assert readers, f"saved storage {sv.storage} is not read by the node that saved it"
    assert graph.bytes_of("grad") == 4 * 256 * 4


def test_backward_ops_are_named_after_their_forward_op():
    graph = remat.trace(nn.Sequential(nn.Linear(8, 8), nn.Tanh()), torch.randn(4, 8))
    bwd = [op.name for op in graph.backward_ops]
    assert "1.tanh_0:bwd.tanh_backward_0" in bwd
    assert any(name.startswith("0.addmm_0:bwd.mm_") for name in bwd)
    assert "0.weight:grad.detach_0" in bwd or any(n.startswith("0.weight:grad") for n in bwd)


def test_names_are_stable_across_traces_and_devices():
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    x = torch.randn(3, 8)
    a = [op.name for op in remat.trace(model, x).ops]
    b = [op.name for op in remat.trace(model, x).ops]
    c = [op.name for op in remat.trace(model, x, device="cpu").ops]
    assert a == b == c
    assert len(set(a)) == len(a)


def test_flops_come_from_the_flop_counter():
    x = torch.randn(16, 64, requires_grad=True)
    graph = remat.trace(nn.Linear(64, 32, bias=False), x)
    mm = next(op for op in graph.forward_ops if op.short == "mm")
    assert mm.flops == 2 * 16 * 64 * 32
    assert sum(op.flops for op in graph.backward_ops) == 2 * mm.flops  # grad of input and weight


def test_meta_trace_allocates_nothing_of_the_models_size():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(40_000, 40_000), nn.ReLU(), nn.Linear(40_000, 10))
    x = torch.empty(64, 40_000, device="meta")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    graph = remat.trace(model, x)
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert graph.param_bytes > 6e9  # 6.4 GB of fp32 weights ...
    assert grown_kib < 200 * 1024  # ... traced in well under 200 MiB
    assert graph.grad_bytes == graph.param_bytes


def test_tied_weights_are_counted_once():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(100, 16)
            self.head = nn.Linear(16, 100, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, ids):
            return self.head(self.emb(ids))

    graph = remat.trace(Tied(), torch.randint(0, 100, (2, 5)))
    assert graph.param_bytes == 100 * 16 * 4
    assert graph.grad_bytes == 100 * 16 * 4


def test_graph_round_trips_through_json():
    graph = remat.trace(ViewsAndInplace(), torch.randn(4, 32))
    again = Graph.from_json(graph.to_json())
    assert again.ops == graph.ops
    assert again.storages == graph.storages
    assert again.activation_bytes == graph.activation_bytes


# -- bad input ---------------------------------------------------------------------------------


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        return h[h > 0].sum()  # boolean mask: output shape depends on values


def test_data_dependent_shape_names_the_op_and_module_and_suggests_cpu():
    with pytest.raises(TraceError) as err:
        remat.trace(DataDependent(), torch.randn(4, 8))
    msg = str(err.value)
    assert "nonzero" in msg or "index" in msg
    assert "device='cpu'" in msg
    # and on real tensors it traces
    graph = remat.trace(DataDependent(), torch.randn(4, 8), device="cpu")
    assert graph.activation_bytes > 0


def test_item_in_forward_is_reported_as_data_dependent():
    class Item(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            h = self.fc(x)
            return h * float(h.detach().max())

    with pytest.raises(TraceError, match="_local_scalar_dense.*module '<root>'"):
        remat.trace(Item(), torch.randn(2, 4))


def test_model_without_trainable_parameters_is_refused():
    model = nn.Linear(4, 4).requires_grad_(False)
    with pytest.raises(TraceError, match="no trainable parameter"):
        remat.trace(model, torch.randn(2, 4))


def test_real_trace_of_a_meta_model_says_how_to_build_it():
    with torch.device("meta"):
        model = nn.Linear(4, 4)
    with pytest.raises(TraceError, match="meta device.*device='cpu'"):
        remat.trace(model, torch.randn(2, 4), device="cpu")


def test_no_grad_forward_is_refused():
    class NoGrad(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            with torch.no_grad():
                return self.fc(x)

    with pytest.raises(TraceError, match="no output of the model requires grad"):
        remat.trace(NoGrad(), torch.randn(2, 4))


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_a_mixed_precision_trace_counts_what_autograd_saves_under_autocast(device):
    """bf16-mixed: fp32 parameters, bf16 compute; autograd saves the bf16 copies of the weights
    autocast makes (activations that a bf16-only count would miss)."""
    from remat import models

    model, inputs = models.build("llama-3.2-1b", batch=2, seq=32, tiny=True, device="cpu")

    def step(*args):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(*args)

    graph = remat.trace(model, *inputs, device=device, autocast=torch.bfloat16)
    params = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    seen: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step(*inputs)
    assert graph.activation_bytes == sum(seen.values())
    assert graph.info["autocast"] == "bfloat16"
    dtypes = {t.dtype for t in graph.tensors.values()}
    assert {"bfloat16", "float32"} <= dtypes
    assert all(s.nbytes % 4 == 0 for s in graph.storages.values() if s.kind == "param")


def test_a_mixed_precision_plan_applies_with_the_gradients_of_no_checkpointing():
    """autocast's cached bf16 copies of the weights outlive a block's call without being state:
    a plan over the blocks is made, and applied under autocast it changes no gradient."""
    from remat import models
    from remat.answers.bench import gradients

    model, inputs = models.build("llama-3.2-1b", batch=2, seq=32, tiny=True, device="cpu")
    graph = remat.trace(model, *inputs, autocast=torch.bfloat16)
    plan = remat.plan(graph, "1TiB", "full")
    assert plan.regions
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reference = gradients(model, inputs)
        remat.apply(model, plan)
        try:
            checkpointed = gradients(model, inputs)
        finally:
            remat.remove(model)
    for name, grad in reference.items():
        torch.testing.assert_close(checkpointed[name], grad, rtol=0, atol=0, msg=name)


_GROUPED = {  # (a shape, b shape, offs): the four layouts of torch._grouped_mm
    "2d x 3d": ((12, 16), (3, 16, 8), (4, 8, 12)),  # tokens sorted by expert x each expert
    "3d x 2d": ((3, 8, 16), (16, 12), (4, 8, 12)),
    "2d x 2d": ((8, 48), (48, 4), (16, 32, 48)),  # an experts' weight gradient: K split by expert
    "3d x 3d": ((3, 8, 16), (3, 16, 4), None),
}


def _groups_matmul(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None) -> torch.Tensor:
    """The same product, one ordinary matmul per group."""
    if offs is None:
        return torch.bmm(a, b)
    bounds = list(itertools.pairwise([0, *offs.tolist()]))
    if a.dim() == 2 and b.dim() == 3:
        return torch.cat([a[s:e] @ b[g] for g, (s, e) in enumerate(bounds)])
    if a.dim() == 3:
        return torch.cat([a[g] @ b[:, s:e] for g, (s, e) in enumerate(bounds)], dim=1)
    return torch.stack([a[:, s:e] @ b[s:e] for s, e in bounds])


@pytest.mark.parametrize("layout", _GROUPED)
def test_a_grouped_matmul_costs_the_flops_of_its_groups_matmuls_and_traces_on_fake_tensors(layout):
    """Mixture-of-experts layers run their experts as one `_grouped_mm`, for which torch's flop
    counter has no formula (it would be free to recompute) and whose meta kernel refuses fp32
    (a fake trace of fp32 experts failed). Both traces must count what the per-group matmuls
    count, and the fake one must save what autograd saves."""
    a_shape, b_shape, ends = _GROUPED[layout]
    offs = None if ends is None else torch.tensor(ends, dtype=torch.int32)
    a = torch.randn(a_shape, requires_grad=True)
    b = torch.randn(b_shape, requires_grad=True)

    def step(a, b):
        return torch._grouped_mm(a, b, offs) * 2

    torch.testing.assert_close(step(a, b), _groups_matmul(a, b, offs) * 2, rtol=1e-5, atol=1e-5)
    with FlopCounterMode(display=False) as counter:
        _groups_matmul(a, b, offs)
    expected = counter.get_total_flops()
    for device in ("meta", "cpu"):
        graph = remat.trace(step, a, b, device=device)
        (op,) = [op for op in graph.forward_ops if op.short == "_grouped_mm"]
        assert op.flops == expected, (device, op.flops, expected)
        (out,) = [graph.tensors[t] for t in op.outputs]
        assert out.dtype == "float32", (device, out.dtype)
        assert graph.activation_bytes == _autograd_saved_bytes(step, a, b), device


_WRITES_VIEWS = '''
import torch, remat
from torch import nn

class Keys(nn.Module):
    """DeepSeek-V2's expand_kv: a fresh tensor filled slice by slice with copy_."""

    def __init__(self):
        super().__init__()
        self.nope, self.rope = nn.Linear(16, 32), nn.Linear(16, 8)

    def forward(self, x):
        nope, rope = self.nope(x), self.rope(x)
        key = nope.new_empty(*nope.shape[:-1], 40)
        key[..., :32].copy_(nope)
        key[..., 32:].copy_(rope)
        key.view(-1)[:4].mul_(2)  # a view of a view, written in place
        return key.square()

x = torch.randn(2, 5, 16)
meta, real = (remat.trace(Keys(), x, device=d) for d in ("meta", "cpu"))
print([op.name for op in meta.forward_ops] == [op.name for op in real.forward_ops])
print(meta.activation_bytes, real.activation_bytes)
print(all(op.node is not None for op in meta.forward_ops if op.short in ("copy_", "mul_")))
'''


def test_writing_views_of_a_fresh_tensor_in_place_traces_on_fake_tensors():
    """On fake tensors autograd replays a view written in place through the tracer's mode, while
    holding the view's lock; reading the view's grad_fn then deadlocked (HF DeepSeek-V2 hung).
    In a subprocess, so that a regression fails instead of hanging the suite."""
    result = subprocess.run(
        [sys.executable, "-c", _WRITES_VIEWS], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    same_names, saved, attributed = result.stdout.split("\n")[:3]
    assert same_names == "True"  # the replays are autograd's, not recorded as the program's ops
    meta_bytes, real_bytes = saved.split()
    assert meta_bytes == real_bytes
    assert attributed == "True"  # each write is attributed to its CopySlices node


class _OwnLoss(nn.Module):
    """Returns its cross-entropy loss, as the presets and Hugging Face models given labels do."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 32)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.proj(x)
        if labels is None:
            return logits
        return nn.functional.cross_entropy(logits.float(), labels)


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_a_model_that_returns_its_loss_is_trained_on_that_loss(device):
    torch.manual_seed(0)
    model, x, labels = _OwnLoss(), torch.randn(4, 8), torch.randint(32, (4,))
    own = remat.trace(model, x, labels, device=device)
    explicit = remat.trace(
        model,
        x,
        device=device,
        loss_fn=lambda out: nn.functional.cross_entropy(out.float(), labels),
    )
    assert own.info["loss"] == "model" and explicit.info["loss"] == "custom"
    assert [op.target for op in own.ops] == [op.target for op in explicit.ops]
    assert own.activation_bytes == explicit.activation_bytes > 0
    assert own.activation_bytes == _autograd_saved_bytes(model, x, labels)


_RESIZED_LOSSES = {
    "mse_loss": lambda out, target: nn.functional.mse_loss(out, target),
    "smooth_l1_loss": lambda out, target: nn.functional.smooth_l1_loss(
        out, target, reduction="sum"
    ),
    "binary_cross_entropy": lambda out, target: nn.functional.binary_cross_entropy(
        out.sigmoid(), target.sigmoid()
    ),
    "soft_margin_loss": lambda out, target: nn.functional.soft_margin_loss(out, target.sign()),
}


@pytest.mark.parametrize("loss", sorted(_RESIZED_LOSSES))
def test_a_reduced_loss_keeps_its_unreduced_buffer_as_the_real_kernel_does(loss):
    """These kernels write the per-element losses and resize the result to 0-d: the loss the step
    holds until backward has the inputs' storage (8 KiB here, not 4 B), on fake tensors too."""
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    x, target = torch.randn(32, 64), torch.randn(32, 64)

    def loss_fn(out):
        return _RESIZED_LOSSES[loss](out, target)

    fake = remat.trace(model, x, loss_fn=loss_fn)
    real = remat.trace(model, x, loss_fn=loss_fn, device="cpu")
    (resized,) = [op for op in fake.ops if op.target.startswith(f"aten.{loss}.")]
    storage = fake.tensors[resized.outputs[0]].storage
    assert fake.storages[storage].nbytes == 32 * 64 * 4
    assert remat.estimate(fake).peak_bytes == remat.estimate(real).peak_bytes
    plan = remat.auto(model, x, loss_fn=loss_fn, budget="100%")
    measured = remat.measure(model, x, loss_fn=loss_fn)
    assert plan.held_bytes == measured.held_bytes


def test_a_loss_target_that_is_the_input_is_one_storage_as_in_the_real_step():
    """An autoencoder's loss reads its input from the loss function's closure: on fake tensors it
    is still the input's storage, not a second copy (a VAE's images were counted twice)."""
    model = nn.Sequential(nn.Linear(64, 16), nn.GELU(), nn.Linear(16, 64))
    images = torch.randn(32, 64)

    def loss_fn(out):
        return nn.functional.mse_loss(out, images)

    fake = remat.trace(model, images, loss_fn=loss_fn)
    real = remat.trace(model, images, loss_fn=loss_fn, device="cpu")
    assert not [s for s in fake.storages.values() if s.kind == "constant"]
    assert remat.estimate(fake).peak_bytes == remat.estimate(real).peak_bytes


class _BroadcastsWrongly(nn.Module):
    def forward(self, x):
        return x + torch.ones(3)


class _CallsAModuleWhileHandlingAnError(nn.Module):
    def __init__(self):
        super().__init__()
        self.fallback = nn.Linear(8, 8)
        self.late = _BroadcastsWrongly()

    def forward(self, x):
        try:
            raise ValueError("a probe the model handles itself")
        except ValueError:
            x = self.fallback(x)  # returns normally while that exception is being handled
        return self.late(x)


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_a_failure_names_the_module_it_left_not_one_called_inside_an_except_block(device):
    """Hugging Face's Swin named its patch embedding for a failure in its attention."""
    with pytest.raises(remat.TraceError) as failure:
        remat.trace(_CallsAModuleWhileHandlingAnError(), torch.randn(4, 8), device=device)
    assert failure.value.module == "late", str(failure.value)


def test_a_call_the_forward_cannot_take_is_refused_naming_the_signature():
    """No example inputs, or a misspelt keyword: said before the step runs, with the forward's
    signature, not as a failure inside the step that tells the user to fix the model."""
    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(TraceError, match=r"Sequential\.forward\(input\) .*missing a required"):
        remat.auto(model)
    with pytest.raises(TraceError, match="unexpected keyword argument 'inputz'"):
        remat.trace(model, torch.randn(2, 4), inputz=1)
    assert remat.trace(model, torch.randn(2, 4)).ops  # the call it takes still traces


def test_a_trace_inside_torch_autocast_is_refused_with_the_argument_to_pass():
    # called inside the caller's autocast, the trace ran its own mixed precision and the
    # caller's on top: remat.auto refused every budget below store-all's by 8% on a CPU step
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
    autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    with autocast, pytest.raises(TraceError, match=r"pass autocast=torch.bfloat16"):
        remat.trace(model, torch.randn(2, 8))
    assert remat.trace(model, torch.randn(2, 8), autocast=torch.bfloat16).ops
