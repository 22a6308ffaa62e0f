"""Reversible layers: a custom `autograd.Function` that keeps only its output and whose backward
re-runs its modules under `enable_grad` and calls `torch.autograd.backward` itself (RevNets,
Reformer). The tracer records that nested autograd as it runs (its ops, saves, frees and the
parameter gradients it accumulates), so the fake trace, the real-CPU trace and `remat.measure`
agree; the planner offers no region over a reversible block (it recomputes itself already); and
nothing of one trace leaks into the next or into the caller's tensors."""

from __future__ import annotations

import copy
import gc
import warnings

import pytest
import torch
from planned_steps import sweep_three_budgets
from torch import nn

import remat
from remat.answers.bench import gradients
from remat.prediction.schedule import simulate
from remat.tracing.recorder import Tracer


class _Reversible(torch.autograd.Function):
    """y1 = x1 + f(x2), y2 = x2 + g(y1), keeping only y; backward inverts the block from y and
    runs f and g again under `enable_grad` to backpropagate through them."""

    @staticmethod
    def forward(ctx, x, f, g, *params):
        x1, x2 = x.chunk(2, dim=-1)
        y1 = x1 + f(x2)
        y = torch.cat([y1, x2 + g(y1)], dim=-1)
        ctx.f, ctx.g = f, g
        ctx.save_for_backward(y.detach())
        return y

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        y1, y2 = y.chunk(2, dim=-1)
        dy1, dy2 = dy.chunk(2, dim=-1)
        with torch.enable_grad():
            y1 = y1.detach().requires_grad_()
            gy1 = ctx.g(y1)
            torch.autograd.backward(gy1, dy2)
        with torch.no_grad():
            x2 = y2 - gy1
            dx1 = dy1 + y1.grad
        with torch.enable_grad():
            x2 = x2.detach().requires_grad_()
            fx2 = ctx.f(x2)
            torch.autograd.backward(fx2, dx1)
        with torch.no_grad():
            dx2 = dy2 + x2.grad
        return (torch.cat([dx1, dx2], dim=-1), None, None) + (None,) * (
            len(ctx.needs_input_grad) - 3
        )


def _mlp(d: int) -> nn.Module:
    return nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))


class RevBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.f, self.g = _mlp(d), _mlp(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Reversible.apply(x, self.f, self.g, *self.parameters())


class Plain(nn.Module):
    """An irreversible block (as a RevNet's downsampling ones): autograd keeps what it saves."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.mlp = _mlp(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x)


class RevNet(nn.Module):
    def __init__(self, d: int = 16, plain: int = 2, reversible: int = 2) -> None:
        super().__init__()
        self.inp = nn.Linear(2 * d, 2 * d)
        self.layers = nn.ModuleList(
            [RevBlock(d) for _ in range(reversible)] + [Plain(2 * d) for _ in range(plain)]
        )
        self.out = nn.Linear(2 * d, 2 * d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.out(h)


def _revnet(d: int = 16, batch: int = 16, **kw) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return RevNet(d, **kw), torch.randn(batch, 2 * d)


def test_gradients_accumulated_inside_a_functions_backward_are_the_traced_parameters():
    model, x = _revnet(plain=0)
    graph = remat.trace(model, x)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert remat.estimate(graph).grad_bytes == params  # was 2 x 2,112: the two Linear's only
    assert all(p.grad is None for p in model.parameters())  # was fake gradients on the model's


def test_reversible_net_fake_and_real_traces_agree_with_the_measured_step():
    model, x = _revnet(plain=0)
    fake, real = remat.trace(model, x), remat.trace(model, x, device="cpu")
    measured = remat.measure(model, x)
    for graph in (fake, real):
        sim = simulate(graph)
        assert graph.activation_bytes == measured.activation_bytes  # the Function's saves only
        assert sim.held_bytes == measured.held_bytes
        assert sim.peak_bytes == pytest.approx(measured.peak_bytes, rel=0.02)
    assert simulate(fake).peak_bytes == simulate(real).peak_bytes


def test_a_leaf_outside_the_parameters_keeps_nothing_of_a_trace():
    """A persistent AccumulateGrad (a hook on a tensor attribute, as Megatron keeps them) carried
    the previous trace's node id: the next trace raised KeyError from `finish_node`."""

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.scale = torch.ones(8, requires_grad=True)
            self.accumulator = self.scale.view_as(self.scale).grad_fn.next_functions[0][0]

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) * self.scale

    model, x = Scaled(), torch.randn(4, 8)
    graphs = [remat.trace(model, x, device=d) for d in ("meta", "cpu", "meta")]
    assert graphs[0].grad_bytes == graphs[2].grad_bytes
    assert model.scale.grad is None  # the trace leaves the caller's tensors as they were


def test_a_random_read_in_a_reversible_net_traces_twice():
    class Drawing(RevNet):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x * (torch.rand([]).item() + 1))

    torch.manual_seed(0)
    model, x = Drawing(plain=0), torch.randn(16, 32)
    gc.disable()  # the first trace's garbage lives on while the second runs
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", remat.RematWarning)
            graph = remat.trace(model, x)
    finally:
        gc.enable()
    assert graph.info["random_reads"]
    assert remat.estimate(graph).grad_bytes == sum(p.numel() * 4 for p in model.parameters())


def test_a_failure_of_the_tracer_itself_is_a_trace_error_and_auto_traces_on_real_tensors(
    monkeypatch,
):
    record = Tracer.record

    def broken_on_fake(self, func, *args, **kwargs):
        if not self.real and func is torch.ops.aten.gelu.default:
            raise KeyError(12345)
        return record(self, func, *args, **kwargs)

    monkeypatch.setattr(Tracer, "record", broken_on_fake)
    model, x = _revnet()
    with pytest.raises(remat.TraceError) as err:
        remat.trace(model, x)
    assert err.value.module == "layers.0.f.1" and err.value.op == "aten.gelu.default"
    assert "KeyError" in str(err.value)
    with pytest.warns(remat.RematWarning, match="real CPU tensors"):
        remat.auto(model, x, budget="100%")


def test_no_region_holds_a_reversible_block():
    model, x = _revnet()
    graph = remat.trace(model, x)
    assert sorted(graph.info["rerun_in_backward"])[0] == "layers.0.f"
    planner = remat.Planner(graph)
    assert planner.reversible_blocks == ["layers.0", "layers.1"]
    assert [b.path for b in planner.blocks] == ["layers.2", "layers.3"]
    full = remat.plan(graph, budget="100%", strategy="full")
    assert [r.modules for r in full.regions] == [("layers.2",), ("layers.3",)]
    only_reversible = remat.trace(*_revnet(plain=0))
    with pytest.raises(remat.RematError, match="reversible"):
        remat.plan(only_reversible, budget="100%", strategy="full")


def test_auto_on_a_revnet_at_three_budgets():
    model, x = _revnet(16, batch=256)
    plans = sweep_three_budgets(model, (x,))
    # the irreversible blocks can be recomputed; the reversible ones recompute themselves
    assert plans[-1].predicted_peak_bytes < plans[0].predicted_peak_bytes
    assert all(m in ("layers.2", "layers.3") for p in plans for r in p.regions for m in r.modules)


def _reformer() -> tuple[nn.Module, dict]:
    """A tiny `ReformerModelWithLMHead` (local and LSH attention), deterministic: its training
    forward reseeds torch from entropy (`torch.seed()`) for its backward to replay, so hashing and
    dropout would differ between any two runs, planned or not."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.ReformerConfig(
        vocab_size=128,
        hidden_size=32,
        num_attention_heads=2,
        attention_head_size=16,
        attn_layers=["local", "lsh"],
        feed_forward_size=64,
        axial_pos_shape=(8, 8),
        axial_pos_embds_dim=(16, 16),
        max_position_embeddings=64,
        local_attn_chunk_length=16,
        lsh_attn_chunk_length=16,
        num_buckets=4,
        is_decoder=True,
        use_cache=False,
        hash_seed=0,
        hidden_dropout_prob=0.0,
        lsh_attention_probs_dropout_prob=0.0,
        local_attention_probs_dropout_prob=0.0,
    )
    ids = torch.randint(0, 128, (2, 64))
    return transformers.ReformerModelWithLMHead(config).train(), {"input_ids": ids, "labels": ids}


def _loss(out):
    return out.loss


def test_reformer_is_predicted_as_measured_and_planned_without_regions_over_its_layers():
    model, inputs = _reformer()
    measured = remat.measure(model, loss_fn=_loss, **inputs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", remat.RematWarning)
        fake = remat.trace(model, loss_fn=_loss, **inputs)  # LSH draws: traced twice
        real = remat.trace(model, loss_fn=_loss, device="cpu", **inputs)
    for graph in (fake, real):
        assert simulate(graph).held_bytes == measured.held_bytes
        assert simulate(graph).peak_bytes == pytest.approx(measured.peak_bytes, rel=0.02)
        assert graph.activation_bytes == measured.activation_bytes
    # the parameters' gradients, accumulated inside _ReversibleFunction's backward (was 51,200)
    trainable = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
    assert remat.estimate(fake).grad_bytes == pytest.approx(trainable, rel=0.01)

    reference = gradients(copy.deepcopy(model), (), loss_fn=_loss, **inputs)
    with pytest.raises(remat.InfeasibleBudget) as infeasible:
        remat.plan(fake, budget=1)
    lowest = infeasible.value.min_feasible_bytes
    top = remat.plan(fake, budget="100%").predicted_peak_bytes
    for budget in ("100%", (lowest + top) // 2, lowest):
        plan = remat.auto(model, budget=budget, loss_fn=_loss, **inputs)
        assert not plan.regions  # its layers are reversible: nothing else to recompute
        got = gradients(model, (), loss_fn=_loss, **inputs)
        assert all(torch.equal(got[k], g) for k, g in reference.items())
        v = remat.verify(model, loss_fn=_loss, **inputs)
        assert v.held_ratio == pytest.approx(1, abs=0.02) and v.ok, v
        assert v.peak_ratio == pytest.approx(1, abs=0.03), v
        remat.remove(model)


def _bogus_node_ids(monkeypatch) -> None:
    """The original bug: an AccumulateGrad node carrying an id the trace does not know."""
    node_id = Tracer.node_id

    def stale(self, node, forward_op=None):
        nid = node_id(self, node, forward_op)
        return nid + 10**9 if "AccumulateGrad" in node.name() else nid

    monkeypatch.setattr(Tracer, "node_id", stale)


def _forgotten_saves(monkeypatch) -> None:
    """Autograd frees a save the trace has no record of (in `_Packed.__del__`)."""
    released = Tracer.released

    def forgetful(self, handle):
        self.saved.clear()
        released(self, handle)

    monkeypatch.setattr(Tracer, "released", forgetful)


def _forgotten_tensors(monkeypatch) -> None:
    """The graph is built from records that lost their tensors."""
    finish = Tracer.finish_backward

    def forgetful(self):
        finish(self)
        self.tensors.clear()

    monkeypatch.setattr(Tracer, "finish_backward", forgetful)


@pytest.mark.parametrize("device", ["meta", "cpu"])
@pytest.mark.parametrize("corrupt", [_bogus_node_ids, _forgotten_saves, _forgotten_tensors])
def test_no_failure_of_the_recorder_escapes_as_a_raw_exception(monkeypatch, device, corrupt):
    corrupt(monkeypatch)
    model, x = _revnet(plain=1)
    with pytest.raises(remat.TraceError, match="remat's tracer failed .*KeyError") as err:
        remat.trace(model, x, device=device)
    assert err.value.module and err.value.fake_tensor_failure == (device == "meta")


@pytest.mark.parametrize("reentrant", [True, False])
def test_a_models_own_checkpoint_is_predicted_with_its_rng_states(reentrant):
    """`torch.utils.checkpoint` in the model (reentrant: a Function whose backward runs autograd)
    keeps a copy of the CPU generator's state per call, made by no op: it was missed (held
    32,772 of 47,940 bytes). Its blocks recompute themselves, so no region is offered over them."""

    class Checkpointed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(Plain(32) for _ in range(3))
            self.head = nn.Linear(32, 32)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=reentrant)
            return self.head(x)

    torch.manual_seed(0)
    model, x = Checkpointed(), torch.randn(64, 32, requires_grad=True)
    measured = remat.measure(model, x)
    for device in ("meta", "cpu"):
        sim = simulate(remat.trace(model, x, device=device))
        assert sim.held_bytes == measured.held_bytes
        assert sim.peak_bytes == measured.peak_bytes
    if reentrant:
        planner = remat.Planner(remat.trace(model, x))
        assert planner.reversible_blocks == ["layers.0", "layers.1", "layers.2"]
