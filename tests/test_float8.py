"""float8 training by torchao's rules (`remat.models.float8`): what its Float8Linear saves for
backward, and the bytes FSDP's float8 all-gather gathers."""

from __future__ import annotations

import importlib.util
from dataclasses import replace

import pytest
import torch
from torch import nn

import remat
from remat import models
from remat.models.float8 import RECIPES, Float8Linear, convert_to_float8
from remat.prediction.estimate import param_gather_bytes, shard_step
from remat.prediction.gpu_memory import Fsdp
from remat.prediction.schedule import simulate


def _saved(module: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """The tensors autograd saves for one forward of `module`."""
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x)
    return saved


def _activation_saved_bytes(graph) -> int:
    return sum(
        graph.storages[sid].nbytes
        for sid in graph.saved_storages
        if graph.storages[sid].kind not in ("param", "buffer")
    )


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_float8_linear_saves_its_high_precision_input_and_weight(recipe, monkeypatch):
    """torchao's `matmul_with_hp_or_float8_args` saves `input_hp` and `weight_hp_t`, nothing in
    float8: the stand-in's autograd saves those two, and the trace prices the saves of a float8
    block at the bytes of the bf16 block's (memory-neutral: nn.Linear saves the same two). The
    stand-in even where torchao imports (whose tensorwise linears differ: the test below)."""
    import remat.models.float8 as float8

    monkeypatch.setattr(float8, "_torchao_config", lambda recipe: None)
    torch.manual_seed(0)
    linear = nn.Linear(64, 32, bias=False).to(torch.bfloat16)
    x = torch.randn(2, 8, 64, dtype=torch.bfloat16, requires_grad=True)
    saved = _saved(Float8Linear(linear, RECIPES[recipe]), x)
    assert [(t.shape, t.dtype) for t in saved] == [
        (x.shape, torch.bfloat16),
        (torch.Size([64, 32]), torch.bfloat16),
    ]
    assert saved[0] is x and saved[1].untyped_storage().data_ptr() == linear.weight.data_ptr()

    def block() -> nn.Module:
        return nn.Sequential(
            nn.Linear(64, 64, bias=False), nn.SiLU(), nn.Linear(64, 64, bias=False)
        ).to(torch.bfloat16)

    inputs = torch.randn(4, 16, 64, dtype=torch.bfloat16, requires_grad=True)
    plain, f8 = block(), block()
    assert len(convert_to_float8(f8, recipe)) == 2
    traced = [_activation_saved_bytes(remat.trace(m, inputs, target="cuda")) for m in (plain, f8)]
    assert traced[0] == traced[1] == 2 * inputs.nbytes + 4 * 16 * 64 * 2  # x, silu's in and out


def test_float8_gradients_are_the_linears_within_float8_rounding():
    torch.manual_seed(0)
    linear = nn.Linear(64, 32, bias=False)
    x = torch.randn(16, 64, requires_grad=True)
    (x @ linear.weight.t()).pow(2).sum().backward()
    want = x.grad.clone(), linear.weight.grad.clone()
    x.grad = linear.weight.grad = None
    for recipe in ("tensorwise", "rowwise"):
        Float8Linear(linear, RECIPES[recipe])(x).pow(2).sum().backward()
        for got, ref in zip((x.grad, linear.weight.grad), want, strict=True):
            assert (got - ref).norm() / ref.norm() < 0.1
        x.grad = linear.weight.grad = None


def test_float8_all_gather_gathers_one_byte_an_element():
    """Under FSDP's float8 all-gather the converted weights are gathered in float8, the rest
    (here the embedding) in their dtype: FSDP's per-rank gathered bytes drop by half of the
    converted weights' bf16 bytes (each child a unit: the largest, a linear, gathered twice,
    computing and prefetched)."""
    sizes = {}
    for recipe in ("tensorwise", "tensorwise-all-gather"):
        model = nn.Sequential(
            nn.Embedding(16, 32), nn.Linear(32, 64, bias=False), nn.Linear(64, 32, bias=False)
        ).to(torch.bfloat16)
        convert_to_float8(model, recipe)
        graph = remat.trace(model, torch.zeros(2, 16, dtype=torch.long), target="cuda")
        gathered = param_gather_bytes(graph)
        whole = {s.id: s.nbytes for s in graph.storages_of(("param",))}
        linears = 2 * 32 * 64 * 2
        assert sum(gathered.values()) == sum(whole.values()) - (
            linears // 2 if RECIPES[recipe].all_gather else 0
        )
        sizes[recipe] = shard_step(graph, simulate(graph), 4, None, 2).gathered_param_bytes
    assert sizes["tensorwise"] - sizes["tensorwise-all-gather"] == 2 * 32 * 64 * 2 // 2


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao not installed")
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_torchaos_float8_linear_saves_what_the_stand_in_saves(recipe):
    """Where torchao imports, `convert_to_float8` swaps in its own Float8Linear: its saves are
    the stand-in's, tensor for tensor."""
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear as TorchaoFloat8Linear

    linear = nn.Linear(64, 32, bias=False).to(torch.bfloat16)
    x = torch.randn(2, 8, 64, dtype=torch.bfloat16, requires_grad=True)
    config = replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)  # no GPU here
    theirs = _saved(TorchaoFloat8Linear.from_float(linear, config=config), x)
    ours = _saved(Float8Linear(linear, RECIPES[recipe]), x)
    assert [(t.shape, t.dtype, t.nbytes) for t in theirs] == [
        (t.shape, t.dtype, t.nbytes) for t in ours
    ]


def test_float8_all_gather_halves_each_blocks_gathered_buffers():
    """FSDP's float8 all-gather (precision float8) gathers a block's converted weights at one
    byte an element: in the allocator walk of FSDP2 over 4 ranks, every all-gather buffer and
    unsharded weight of a block is that of float8-tensorwise (bf16 all-gather) less half the
    block's linear weights; the root unit's (embedding, norm, the head left in bf16) the same."""
    from remat.answers.fit_steps import PRECISIONS
    from remat.device.allocator import Alloc
    from remat.prediction.gpu_memory import step_events

    gathered = {}
    for precision in ("float8-tensorwise", "float8"):
        model, inputs = models.build("llama-2-7b", batch=2, seq=128, dtype="bf16", tiny=True)
        PRECISIONS[precision].prepare(model)
        graph = remat.trace(model, *inputs, target="cuda")
        events = list(step_events(graph, (), "adamw", steps=1, fsdp=Fsdp(4, 2)))
        gathered[precision] = {
            e.key: e.nbytes for e in events if isinstance(e, Alloc) and e.key[0] == "ag"
        }
    linears = sum(
        m.weight.nbytes
        for m in model.layers[0].modules()
        if isinstance(m, nn.Linear) and not (m.in_features % 16 or m.out_features % 16)
    )
    assert gathered["float8"].keys() == gathered["float8-tensorwise"].keys()
    for key, nbytes in gathered["float8-tensorwise"].items():
        unit = key[-1]
        assert gathered["float8"][key] == nbytes - (linears // 2 if unit else 0), key


def test_fit_refuses_rowwise_scales_over_tensor_parallel_ranks(capsys):
    """The stand-in's per-row scales do not shard over DTensor: said, not a raw traceback."""
    from remat.answers.cli import main

    argv = ["fit", "--model", "llama-2-7b", "--tiny", "--seq", "128", "--shard", "2", "--tp", "2"]
    assert main([*argv, "--precision", "float8-rowwise"]) != 0
    assert "float8-rowwise with --tp" in capsys.readouterr().err


class _Scaled(torch.Tensor):
    """A wrapper around two tensors, its data and its scale, as torchao's Float8TrainingTensor:
    its own dispatch runs an op on what it wraps."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
        return torch.Tensor._make_wrapper_subclass(
            cls, data.shape, strides=data.stride(), dtype=dtype, device=data.device
        )

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> None:
        self._data, self._scale = data, scale

    def __tensor_flatten__(self):
        return ["_data", "_scale"], self.dtype

    @staticmethod
    def __tensor_unflatten__(inner, dtype, size, stride):
        return _Scaled(inner["_data"], inner["_scale"], dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def unwrap(t):
            return t._data.to(t.dtype) / t._scale if isinstance(t, _Scaled) else t

        return func(*torch.utils._pytree.tree_map(unwrap, (args, kwargs or {}))[0])


class _ScaledMatmul(torch.autograd.Function):
    """torchao's matmul_with_hp_or_float8_args in small: saves the high-precision operands,
    multiplies their scaled copies."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        scale = x.abs().amax()
        return torch.mm(_Scaled(x * scale, scale, x.dtype), w)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, w = ctx.saved_tensors
        return grad @ w.t(), x.t() @ grad


class _ScaledLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(16, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ScaledMatmul.apply(x, self.weight).relu()


def test_a_wrapper_around_several_tensors_is_traced_through_its_own_dispatch():
    """An op on a wrapper of two tensors (torchao's float8 tensor: data and scale) runs the
    wrapper's own dispatch, whose ops on the wrapped tensors are recorded: before, the op was
    recorded on the wrapper, whose storage no op made, counted as a constant alive all step
    (torchao 0.10 importable put 143.6 GiB on the B200 float8 rowwise row)."""
    x = torch.randn(8, 16, requires_grad=True)
    graph = remat.trace(_ScaledLinear(), x)
    assert not [s for s in graph.storages.values() if s.kind == "constant"]
    assert "mm" in {op.name.rsplit(".", 1)[-1].rsplit("_", 1)[0] for op in graph.forward_ops}
    module = _ScaledLinear()
    real = [t for t in _saved(module, x) if t is not module.weight]  # x and relu's output
    assert _activation_saved_bytes(graph) == sum(t.untyped_storage().nbytes() for t in real)


class _SavesScaled(torch.autograd.Function):
    """torchao 0.10's tensorwise matmul in small: given the weight already cast, it saves it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        scale = w.abs().amax().float()
        cast = _Scaled((w * scale).to(torch.float16), scale, w.dtype)
        ctx.save_for_backward(cast)
        return torch.mm(x, cast)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (cast,) = ctx.saved_tensors
        return grad @ cast.t(), None


def test_a_saved_wrapper_around_several_tensors_holds_the_tensors_it_wraps():
    """Saving a wrapper of two tensors saves what it wraps (the fp16 data, the fp32 scale), made
    by traced ops: before, one storage of the wrapper's own size (fp32 here) no op made."""

    class Module(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(16, 16))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return _SavesScaled.apply(x, self.weight)

    graph = remat.trace(Module(), torch.randn(8, 16, requires_grad=True))
    assert not [s for s in graph.storages.values() if s.kind == "constant"]
    assert _activation_saved_bytes(graph) == 16 * 16 * 2 + 4


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao not installed")
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_torchaos_float8_linears_trace_to_what_they_hold(recipe, monkeypatch):
    """A tiny Llama with torchao's own Float8Linear traces with no storage no op made: rowwise
    to the stand-in's bytes; tensorwise (torchao 0.10 casts the weight before its matmul's
    Function, which saves the float8 weight it is given) to those plus each converted linear's
    float8 weight and its fp32 scale."""
    import remat.models.float8 as float8

    graphs, converted = {}, {}
    for name in ("torchao", "stand-in"):
        model, inputs = models.build("llama-3.1-8b", batch=1, seq=256, tiny=True, dtype="bf16")
        if name == "stand-in":
            monkeypatch.setattr(float8, "_torchao_config", lambda recipe: None)
        paths = convert_to_float8(model, recipe)
        converted[name] = sum(model.get_submodule(p).weight.numel() + 4 for p in paths)
        graphs[name] = remat.trace(model, *inputs)
    assert not [s for s in graphs["torchao"].storages.values() if s.kind == "constant"]
    extra = converted["torchao"] if recipe == "tensorwise" else 0
    assert graphs["torchao"].activation_bytes == graphs["stand-in"].activation_bytes + extra
