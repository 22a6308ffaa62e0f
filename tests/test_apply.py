"""Plans applied to real eager models: same gradients as store-all, and the peak they predicted."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import remat
from remat import Planner, models
from remat.answers.bench import gradients

SMALL = {"resnet50": {"batch": 4, "image_size": 64}, "mlp-chain-16": {"batch": 8}}
ZOO = [n for n in models.preset_names() if not n.startswith("mlp-chain")] + ["mlp-chain-16"]
STRATEGIES = [
    "full",
    "sqrt",
    "selective:megatron",
    "selective:save-matmuls",
    "selective:torchtitan",
    "mincut",
]


def _build(name: str):
    kw = {"batch": 2, "seq": 32, **SMALL.get(name, {})}
    return models.build(name, device="cpu", tiny=True, **kw)


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-6, atol=1e-6, msg=name)


@pytest.mark.parametrize("name", [*ZOO, "hf:gpt2", "hf:llama"])
def test_every_strategy_gives_store_alls_gradients(name):
    if name.startswith("hf:"):
        pytest.importorskip("transformers")
    torch.manual_seed(0)
    model, inputs = _build(name)
    graph = remat.trace(model, *inputs)
    planner = Planner(graph)
    reference = gradients(model, inputs)
    for strategy in STRATEGIES:
        plan = planner.plan("1TiB", strategy)
        remat.apply(model, plan)
        _assert_same(gradients(model, inputs), reference)
        remat.remove(model)
    _assert_same(gradients(model, inputs), reference)  # remove() restored the model


@pytest.mark.parametrize("name", ZOO)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_measured_peak_matches_the_plans_prediction(name, strategy):
    torch.manual_seed(0)
    model, inputs = _build(name)
    graph = remat.trace(model, *inputs)
    plan = Planner(graph).plan("1TiB", strategy)
    remat.apply(model, plan)
    measured = remat.measure(model, *inputs)
    remat.remove(model)
    assert plan.predicted_peak_bytes == pytest.approx(measured.peak_bytes, rel=0.05)
    assert plan.held_bytes == pytest.approx(measured.held_bytes, rel=0.02)


#: What `simulate` does not model: the 0-dim tensors a CPU kernel wraps a Python number in (8
#: bytes, then 4 once cast to float32), a few of them live at any time.
SCALAR_WRAPPERS = 64


def test_long_sequence_megatron_peak_is_exact_where_s_by_s_scratch_dominates():
    """At seq 128 the s x s attention tensors (1 MiB each) dwarf the rest, so missing one
    temporary shows: dropout's CPU kernels copy their bool mask to float32, a checkpoint replay
    keeps the RNG state to restore, and a kept op's output dies in the replay like any other."""
    torch.manual_seed(0)
    model, inputs = models.build("megatron-gpt", batch=4, seq=128, device="cpu", tiny=True)
    planner = Planner(remat.trace(model, *inputs))
    strategies = ["store_all", "full", "selective:megatron", "selective:torchtitan"]
    for strategy in [*strategies, "selective:save-matmuls"]:
        plan = planner.plan("1TiB", strategy)
        remat.apply(model, plan)
        measured = remat.measure(model, *inputs)
        remat.remove(model)
        assert plan.predicted_peak_bytes == pytest.approx(
            measured.peak_bytes, abs=SCALAR_WRAPPERS
        ), strategy
        assert plan.held_bytes == pytest.approx(measured.held_bytes, abs=SCALAR_WRAPPERS)


class _MixedDtypes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(64, 256), nn.Linear(256, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        h = h * (h > 0)  # float32 x bool, in the forward and in MulBackward0
        return self.down(h + torch.ones(256, dtype=torch.int64))  # a broadcast int64 operand


def test_cpu_copies_of_an_operand_of_another_dtype_are_in_the_peak():
    torch.manual_seed(0)
    model, x = _MixedDtypes(), torch.randn(512, 64)
    plan = Planner(remat.trace(model, x)).plan("1TiB", "store_all")
    assert plan.predicted_peak_bytes == pytest.approx(
        remat.measure(model, x).peak_bytes, abs=SCALAR_WRAPPERS
    )


def test_dropout_is_recomputed_with_the_same_random_mask():
    torch.manual_seed(0)
    model, inputs = models.build("megatron-gpt", batch=2, seq=32, device="cpu", tiny=True)
    graph = remat.trace(model, *inputs)
    reference = gradients(model, inputs, seed=7)
    remat.apply(model, Planner(graph).plan("1TiB", "full"))
    _assert_same(gradients(model, inputs, seed=7), reference)


def test_batchnorm_running_statistics_move_once_per_step():
    torch.manual_seed(0)
    model, inputs = _build("resnet50")
    graph = remat.trace(model, *inputs)
    plain = {k: v.clone() for k, v in model.state_dict().items()}
    gradients(model, inputs)
    once = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(plain)
    remat.apply(model, Planner(graph).plan("1TiB", "full"))
    gradients(model, inputs)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, once[k], msg=k)


def test_inference_under_no_grad_runs_the_plain_forward():
    torch.manual_seed(0)
    model, inputs = _build("gpt2")
    graph = remat.trace(model, *inputs)
    with torch.no_grad():
        expected = model(*inputs)
    remat.apply(model, Planner(graph).plan("1TiB", "full"))
    calls = []
    checkpoint = torch.utils.checkpoint.checkpoint
    try:
        torch.utils.checkpoint.checkpoint = lambda *a, **k: calls.append(1) or checkpoint(*a, **k)
        with torch.no_grad():
            got = model(*inputs)
    finally:
        torch.utils.checkpoint.checkpoint = checkpoint
    assert calls == []
    torch.testing.assert_close(got, expected)


def test_a_second_backward_through_a_recomputed_region_raises_clearly():
    torch.manual_seed(0)
    model, inputs = _build("gpt2")
    graph = remat.trace(model, *inputs)
    remat.apply(model, Planner(graph).plan("1TiB", "full"))
    loss = model(*inputs).sum()
    loss.backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()


def test_autocast_bf16_on_cpu_keeps_gradients_equal():
    torch.manual_seed(0)
    model, inputs = _build("llama-3.2-1b")
    graph = remat.trace(model, *inputs)

    def grads():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return gradients(model, inputs)

    reference = grads()
    remat.apply(model, Planner(graph).plan("1TiB", "full"))
    _assert_same(grads(), reference)


def test_plan_from_json_applies_to_a_fresh_model():
    torch.manual_seed(0)
    model, inputs = _build("gpt2")
    graph = remat.trace(model, *inputs)
    plan = Planner(graph).plan("1TiB", "selective:torchtitan")
    fresh, _ = _build("gpt2")
    fresh.load_state_dict(model.state_dict())
    reference = gradients(model, inputs)
    remat.apply(fresh, remat.Plan.from_json(plan.to_json()))
    _assert_same(gradients(fresh, inputs), reference)


def test_auto_traces_plans_and_applies_in_one_call():
    torch.manual_seed(0)
    model, inputs = models.build("gpt2", batch=8, seq=128, device="cpu", tiny=True, n_layer=4)
    reference = gradients(model, inputs)
    plan = remat.auto(model, *inputs, budget="90%")
    assert plan.predicted_peak_bytes <= plan.budget_bytes
    _assert_same(gradients(model, inputs), reference)


class KeywordBlock(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x, *, shift: torch.Tensor):
        return torch.tanh(self.fc(x) + shift)


class TwoOutputs(nn.Module):
    """Blocks that take a keyword tensor input, and a model with several outputs."""

    def __init__(self, d: int = 16, n: int = 4):
        super().__init__()
        self.blocks = nn.ModuleList(KeywordBlock(d) for _ in range(n))

    def forward(self, x, *, shift):
        for block in self.blocks:
            x = block(x, shift=shift)
        return x, x.pow(2).mean(dim=0)


def test_keyword_inputs_and_several_outputs_keep_store_alls_gradients():
    torch.manual_seed(0)
    model, x, shift = TwoOutputs(), torch.randn(8, 16), torch.randn(16, requires_grad=True)

    def grads():
        model.zero_grad(set_to_none=True)
        shift.grad = None
        a, b = model(x, shift=shift)
        (a.sum() + 3 * b.sum()).backward()
        out = {n: p.grad.clone() for n, p in model.named_parameters()}
        out["shift"] = shift.grad.clone()
        return out

    reference = grads()
    graph = remat.trace(model, x, shift=shift)
    for strategy in ["full", "sqrt", "selective:save-matmuls"]:
        remat.apply(model, Planner(graph).plan("1TiB", strategy))
        _assert_same(grads(), reference)
        remat.remove(model)


def test_verify_leaves_the_users_gradients_as_it_found_them():
    """verify between backward() and optimizer.step() must not drop the step's gradients."""
    torch.manual_seed(0)
    model, inputs = _build("gpt2")
    remat.auto(model, *inputs, budget="1TiB", strategy="full")
    model(*inputs).backward()
    before = {n: p.grad.clone() for n, p in model.named_parameters()}
    report = remat.verify(model, *inputs)
    assert report.held_bytes_measured is not None
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, before[n], rtol=0, atol=0, msg=n)
    remat.remove(model)


def test_verify_compares_a_plan_made_with_an_optimizer_without_its_state():
    """A plan made with AdamW predicts a peak that holds the optimizer's state; verify's step runs
    no optimizer, so it compares the peak without it (the state was the whole gap before)."""
    torch.manual_seed(0)
    model, inputs = _build("gpt2")
    plain = Planner(remat.trace(model, *inputs)).plan("1TiB", "full")
    with_state = remat.auto(model, *inputs, budget="1TiB", strategy="full", optimizer="adamw")
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert with_state.optimizer_bytes >= 2 * params  # AdamW: two moments per parameter
    assert (
        with_state.predicted_peak_bytes - with_state.optimizer_bytes == plain.predicted_peak_bytes
    )
    assert plain.optimizer_bytes == 0
    report = remat.verify(model, *inputs)
    assert report.peak_bytes_predicted == plain.predicted_peak_bytes
    assert "without the optimizer's" in repr(report)
    assert report.ok, report
    again = remat.Plan.from_json(with_state.to_json())
    assert again.optimizer_bytes == with_state.optimizer_bytes
    remat.remove(model)


@pytest.mark.parametrize("name", ["gpt2", "hf:llama"])
@pytest.mark.parametrize("first", ["full", "milp"])
def test_auto_on_a_planned_model_replaces_the_plan_as_if_planning_the_bare_model(name, first):
    """The second auto must not trace the first plan's checkpoint regions (a whole-block plan
    read as store-all, a selective one failing on a cache), and its plan carries out exactly."""
    torch.manual_seed(0)
    model, inputs = _build(name)
    bare, _ = _build(name)
    bare.load_state_dict(model.state_dict())
    reference = gradients(bare, inputs)
    graph = remat.trace(bare, *inputs)
    lowest = Planner(graph).lowest_peak().predicted_peak_bytes
    remat.auto(model, *inputs, budget=lowest if first == "milp" else "1TiB", strategy=first)
    again = remat.auto(model, *inputs, budget="100%")
    expected = Planner(graph).plan("100%", "auto")
    assert (again.strategy, again.predicted_peak_bytes) == (
        expected.strategy,
        expected.predicted_peak_bytes,
    )
    _assert_same(gradients(model, inputs), reference)
    report = remat.verify(model, *inputs)
    assert report.ok, report
    remat.remove(model)


def test_auto_that_fails_leaves_the_previous_plan_installed():
    torch.manual_seed(0)
    model, inputs = _build("gpt2")
    first = remat.auto(model, *inputs, budget="1TiB", strategy="full")
    with pytest.raises(remat.InfeasibleBudget):
        remat.auto(model, *inputs, budget=1024)
    assert vars(model)["_remat_applied"].plan is first
    remat.remove(model)


def test_a_backward_inside_the_loops_autocast_gets_the_gradients_of_no_plan():
    # autocast caches its casts of parameters for the whole context: a backward run inside it
    # replayed a region without dispatching them, and a plan that kept them (the keep ladder's
    # longest rung) handed the input's cast the bias's: "shape '[192]' is invalid for input of
    # size 196608"
    from remat.planning.solvers.selective import dearest_first

    torch.manual_seed(0)
    model, inputs = models.build("gpt2", tiny=True, device="cpu", batch=2, seq=32)
    planner = Planner(remat.trace(model, *inputs, autocast=torch.bfloat16))
    block = planner.blocks[0]
    ladder = dearest_first(
        planner.graph, planner.replayed(block.first_op, block.last_op), planner.op_seconds
    )
    assert any(op.short == "_to_copy" for op in ladder)  # casts are rungs of the ladder
    plan = planner.make_plan(
        planner.every_block(f"selective:dearest-{len(ladder) - 1}"), "", None, ""
    )

    def step(m):
        m.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = m(*inputs)
            loss.backward()  # inside the context, as many training loops do
        return {n: p.grad.clone() for n, p in m.named_parameters()}

    reference = step(model)
    remat.apply(model, plan)
    got = step(model)
    assert all(torch.equal(got[n], reference[n]) for n in reference)
