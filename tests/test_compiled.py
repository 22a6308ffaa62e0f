"""The compiled path: remat's partitioner inside torch.compile keeps gradients exact, saves exactly
what its plan says, respects user tags and random ops, bounds the peak by the byte budget, and is
never slower (in its model) than torch's own partitioner at the same saved bytes."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from compiled_support import needs_cxx
from hypothesis import given, settings
from oracles import every_save_set
from test_mincut import build, specs
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

import remat
from remat import models
from remat.answers.bench import gradients
from remat.applying.compiled import plans_of
from remat.planning.solvers.mincut import joint_problem
from remat.planning.solvers.saveset import cheapest_save_set, describe_save_set

BANDWIDTH = 1e9

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _build(name: str, batch: int = 2, seq: int = 32, **overrides):
    torch.manual_seed(0)
    return models.build(name, batch=batch, seq=seq, device="cpu", tiny=True, **overrides)


def _assert_close(got: dict, ref: dict) -> None:
    """Inductor's fused kernels sum in another order than eager: equal up to float rounding."""
    assert len(got) == len(ref)
    for g, r in zip(got.values(), ref.values(), strict=True):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5 * float(r.abs().max()) + 1e-7)


# -- the min-cut article's example, under inductor ---------------------------------------------------
def _article(a, b, c, d):
    return torch.cos(torch.cos(a + b + c + d))


@needs_cxx
def test_article_example_compiled_backward_saves_only_the_last_add():
    leaves = [torch.randn(1024, requires_grad=True) for _ in range(4)]
    chosen = remat.backend(strategy="mincut")
    compiled = torch.compile(_article, backend=chosen, dynamic=False)
    saved: list[torch.Tensor] = []

    def pack(t):
        saved.append(t.detach().clone())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = compiled(*leaves)
    out.sum().backward()
    got = [leaf.grad.clone() for leaf in leaves]
    for leaf in leaves:
        leaf.grad = None
    _article(*leaves).sum().backward()
    for g, leaf in zip(got, leaves, strict=True):
        torch.testing.assert_close(g, leaf.grad)
    (plan,) = chosen.plans
    assert len(saved) == 1  # z = a + b + c + d, the article's cut at add_2 (cost 2B)
    torch.testing.assert_close(saved[0], sum(leaves).detach())
    assert [s.bytes for s in plan.saved] == [4096]
    assert plan.details["traffic_bytes"] == 2 * 4096
    assert plan.held_bytes == 4096


class _Article(nn.Module):
    def forward(self, a, b, c, d):
        return _article(a, b, c, d)


@needs_cxx
def test_the_articles_cut_fits_a_budget_of_store_alls_peak():
    """At "100%" (store-all's predicted peak) the min-cut is feasible and saves exactly add_2: the
    cut that saves memory traffic costs no memory under inductor, predicted (from inductor's own
    plan) and measured (256x256, issue 11). Both peak at the step's end, when AccumulateGrad has
    copied the one gradient buffer inductor returns for a, b, c and d into four `.grad`s."""
    leaves = [torch.randn(256, 256, requires_grad=True) for _ in range(4)]
    for strategy in ("mincut", "auto"):
        torch._dynamo.reset()
        compiled = remat.compile(_Article(), budget="100%", strategy=strategy)
        measured = remat.measure(compiled, *leaves)
        (plan,) = plans_of(compiled)
        assert [s.name for s in plan.saved] == ["add_2"]
        assert plan.predicted_peak_bytes <= plan.details["store_all_peak_bytes"]
        assert plan.budget_bytes == plan.details["store_all_peak_bytes"]
        assert measured.peak_bytes == plan.predicted_peak_bytes


# -- the peak under inductor comes from inductor's own buffer plan -----------------------------------
@needs_cxx
@pytest.mark.parametrize(
    ("name", "budgets"),
    [("gpt2", ["100%", "60%"]), ("llama-3.2-1b", ["100%", "45%"])],
)
def test_inductor_predicted_peak_is_the_measured_one_and_never_above_the_budget(name, budgets):
    """Issue 11 item 1: the plan's peak is read from inductor's generated code (fusion, buffer
    reuse, its own kernel order), so it is what inductor allocates: the measured step's peak to
    the byte at every budget (issue 11 asked for 3%; the op-by-op count was 16-18% low on llama),
    within the budget, and never growing as the budget shrinks. Each compile is also checked for
    eager's gradients and for saving exactly the plan's bytes (one inductor compile, all checks)."""
    # a vocabulary of 64: the blocks, not the loss's fp32 logits (outside every plan), decide
    # the peak, so that a smaller budget has something to recompute
    model, inputs = _build(name, batch=4, seq=64, vocab_size=64)
    reference = gradients(model, inputs, seed=1)
    measured_peaks = []
    for budget in budgets:
        torch._dynamo.reset()
        compiled = remat.compile(model, budget=budget, strategy="auto")
        measured = remat.measure(compiled, *inputs)
        (plan,) = plans_of(compiled)
        assert plan.details["peak_model"] == "inductor"
        assert measured.peak_bytes == plan.predicted_peak_bytes
        assert measured.peak_bytes <= plan.budget_bytes
        assert measured.activation_bytes == plan.held_bytes
        _assert_close(gradients(compiled, inputs, seed=1), reference)
        measured_peaks.append(measured.peak_bytes)
    assert measured_peaks == sorted(measured_peaks, reverse=True)
    assert measured_peaks[-1] < measured_peaks[0]


@needs_cxx
def test_a_tied_embeddings_weight_gradient_does_not_hold_the_logits_gradient_through_backward():
    """Inductor fuses the tied weight's gradient, `mm(logits_grad^T, head_input) + embedding_grad`,
    into one addmm that can run only at the end of backward, which kept the logits' gradient alive
    throughout: remat.compile's lowest peak on gpt2 tiny was 1.98 MiB (eager full checkpointing:
    1.80). Under remat's plans the product runs where it is written: a budget of 1.9 MiB fits, as
    predicted, with the gradients of eager."""
    model, inputs = models.build("gpt2", tiny=True, device="cpu", batch=2, seq=64)
    assert model.lm_head.weight is model.wte.weight
    budget = int(1.9 * 2**20)
    compiled = remat.compile(model, budget=budget, strategy="auto")
    measured = remat.measure(compiled, *inputs)
    (plan,) = plans_of(compiled)
    assert plan.details["peak_model"] == "inductor"
    assert measured.peak_bytes <= budget
    assert measured.peak_bytes == plan.predicted_peak_bytes
    reference = gradients(model, inputs)
    got = gradients(compiled, inputs)
    for name in reference:
        torch.testing.assert_close(got[name], reference[name], rtol=1e-4, atol=1e-5)


def test_the_addmm_rule_runs_a_users_post_grad_pre_pass_after_it_as_one_pass():
    """torch < 2.13 takes one post-grad pre-pass, not a tuple (torch 2.11 on an H100 failed
    with an ImportError of 2.13's `get_custom_graph_passes`): remat's pass is one pass that marks
    the graph, then runs the user's; its uuid is None (no caching) where a user's pass has none."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    from remat.applying.compiled import _IN_ORDER_GRAPHS, _addmm_in_order_pass

    seen = []

    class UserPass(CustomGraphPass):
        def __call__(self, graph):
            seen.append(graph in _IN_ORDER_GRAPHS)

        def uuid(self):
            return "user"

    for then, uuid in (
        (UserPass(), ("remat-addmm-in-order", "user")),
        (None, ("remat-addmm-in-order",)),
    ):
        combined = _addmm_in_order_pass(then)
        assert isinstance(combined, CustomGraphPass)
        graph = torch.fx.Graph()
        combined(graph)
        assert graph in _IN_ORDER_GRAPHS
        assert combined.uuid() == uuid
    assert seen == [True]  # the user's pass ran once, after the graph was marked
    assert _addmm_in_order_pass(seen.append).uuid() is None  # a plain callable: not cached


_WRAPPER = """
import torch
from torch._inductor.async_compile import AsyncCompile
empty_strided_cpu = torch._C._dynamo.guards._empty_strided_cpu
reinterpret_tensor = torch._C._dynamo.guards._reinterpret_tensor
async_compile = AsyncCompile()
kernel = async_compile.cpp_pybinding(["float*"], "never compiled")
async_compile.wait(globals())
def call(args):
    x, = args
    args.clear()
    buf0 = empty_strided_cpu((256,), (1,), torch.float32)
    kernel(x, buf0)
    buf1 = buf0; del buf0  # reuse
    buf2 = empty_strided_cpu((512,), (1,), torch.float32)
    del x
    buf3 = reinterpret_tensor(buf2, (256,), (1,), 256)
    del buf2
    return (buf1, buf3)
"""


def test_replay_counts_inductors_allocations_reuses_and_frees():
    """The replay runs inductor's wrapper as written, kernels doing nothing: a buffer reused in
    place costs nothing new, an input the wrapper deletes (and nothing else holds) dies there."""
    from remat.prediction.inductor_plan import replay

    args = [torch.empty(1024, device="meta")]
    result = replay(_WRAPPER, args)
    assert result.peak_bytes == 1024 + 2048  # buf0, then buf2 while x is still alive
    assert result.end_bytes == 1024 + 2048 - 4096  # x freed; buf1 and buf2's storage returned


@needs_cxx
def test_an_unreadable_inductor_plan_falls_back_to_the_op_by_op_count(monkeypatch):
    from remat.prediction import inductor_plan

    def moved(*args, **kwargs):
        raise RuntimeError("a torch internal moved")

    monkeypatch.setattr(inductor_plan, "step_peak", moved)
    leaves = [torch.randn(64, 64, requires_grad=True) for _ in range(4)]
    compiled = remat.compile(_Article(), budget="100%", strategy="mincut")
    with pytest.warns(UserWarning, match="could not read inductor's buffer plan"):
        compiled(*leaves).sum().backward()
    (plan,) = plans_of(compiled)
    assert plan.details["peak_model"] == "op-by-op"
    assert [s.name for s in plan.saved] == ["add_2"]


@needs_cxx
def test_a_save_sets_inductor_plan_is_read_once_a_process_for_the_same_graphs(monkeypatch):
    """Each reading is a code generation: the store-all set every compile prices and a choice
    made again (another row of bench --compile, another budget) are read once for the process;
    the same model at another size is read anew, its peak still the measured one."""
    from remat.prediction import inductor_plan

    monkeypatch.setattr(inductor_plan, "_READINGS", {})
    generated = []
    original = inductor_plan.wrapper_source
    monkeypatch.setattr(
        inductor_plan, "wrapper_source", lambda *a, **k: generated.append(1) or original(*a, **k)
    )
    counts, peaks = [], []
    for size in (48, 48, 40):
        torch._dynamo.reset()
        leaves = [torch.randn(size, size, requires_grad=True) for _ in range(4)]
        before = len(generated)
        compiled = remat.compile(_Article(), budget="100%", strategy="mincut")
        measured = remat.measure(compiled, *leaves)
        (plan,) = plans_of(compiled)
        assert plan.details["peak_model"] == "inductor"
        assert measured.peak_bytes == plan.predicted_peak_bytes
        counts.append(len(generated) - before)
        peaks.append(plan.predicted_peak_bytes)
    assert counts[0] > 0 and counts[1] == 0 and counts[2] == counts[0]
    assert peaks[0] == peaks[1] > peaks[2]


# -- the same decisions, op by op (aot_eager): fast, and the peak model is exact there --------------
@pytest.mark.parametrize("name", ["gpt2", "llama-3.2-1b", "megatron-gpt", "mlp-chain-16"])
@pytest.mark.parametrize("strategy", ["mincut", "milp", "auto"])
def test_saved_and_peak_bytes_equal_the_plans_prediction(name, strategy):
    model, inputs = _build(name)
    reference = gradients(model, inputs, seed=3)
    compiled = remat.compile(model, strategy=strategy, compiler="aot_eager")
    got = gradients(compiled, inputs, seed=3)
    for g, r in zip(got.values(), reference.values(), strict=True):
        torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-6)
    (plan,) = plans_of(compiled)
    measured = remat.measure(compiled, *inputs)
    assert measured.activation_bytes == plan.held_bytes
    assert plan.predicted_peak_bytes == measured.peak_bytes


def test_random_ops_are_never_recomputed():
    model, inputs = _build("megatron-gpt")
    compiled = remat.compile(model, strategy="milp", budget="70%", compiler="aot_eager")
    gradients(compiled, inputs)
    (plan,) = plans_of(compiled)
    assert plan.recomputed  # the budget forces recomputation...
    assert not [op for op in plan.recomputed if "dropout" in op]  # ...but never of dropout


# -- budgets ------------------------------------------------------------------------------------------
def test_measured_peak_never_grows_as_the_budget_shrinks():
    model, inputs = _build("llama-3.2-1b", batch=8, seq=128)
    peaks, predicted, saved = [], [], []
    for budget in ["100%", "70%", "55%"]:
        compiled = remat.compile(model, budget=budget, strategy="milp", compiler="aot_eager")
        measured = remat.measure(compiled, *inputs)
        (plan,) = plans_of(compiled)
        assert plan.predicted_peak_bytes <= plan.budget_bytes
        peaks.append(measured.peak_bytes)
        predicted.append(plan.predicted_peak_bytes)
        saved.append(plan.held_bytes)
    assert peaks == sorted(peaks, reverse=True)
    assert peaks[0] > peaks[-1]
    assert predicted == pytest.approx(peaks, rel=0.01)
    with pytest.raises(Exception, match="no save set fits"):
        compiled = remat.compile(model, budget="10%", strategy="milp", compiler="aot_eager")
        compiled(*inputs)


def test_mincut_refuses_a_budget_it_cannot_meet():
    model, inputs = _build("llama-3.2-1b", batch=8, seq=128)
    compiled = remat.compile(model, budget="50%", strategy="mincut", compiler="aot_eager")
    with pytest.raises(Exception, match="use strategy='milp' or 'auto'"):
        compiled(*inputs)


@pytest.mark.parametrize("torch_budget", [1.0, 0.5, 0.0])
def test_remat_needs_no_more_recompute_than_torch_at_its_saved_bytes(torch_budget):
    from torch._functorch import config as functorch_config

    model, inputs = _build("gpt2", batch=4, seq=64)
    watcher = remat.backend(strategy="torch", compiler="aot_eager")
    with functorch_config.patch(activation_memory_budget=torch_budget):
        compiled = torch.compile(model, backend=watcher, dynamic=False)
        gradients(compiled, inputs)
    (theirs,) = watcher.plans
    graph = watcher.graphs[0]
    problem = joint_problem(graph, None)
    from remat.device.cost import fused_op_seconds_all, get_profile

    op_seconds = fused_op_seconds_all(graph, get_profile("cpu"))
    ours = cheapest_save_set(
        graph,
        problem,
        op_seconds,
        BANDWIDTH,
        theirs.details["held_activation_bytes"],
        traffic_weight=0.0,
    )
    mine = describe_save_set(graph, problem, ours, op_seconds)
    assert mine.held_activation_bytes <= theirs.details["held_activation_bytes"]
    assert mine.recompute_seconds <= theirs.recompute_seconds * (1 + 1e-9)


# -- user intent: selective-checkpoint tags --------------------------------------------------------
def _save_matmuls_only(ctx, op, *args, **kwargs):
    if op == torch.ops.aten.mm.default:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.MUST_RECOMPUTE


class _Tagged(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(64, 64) / 8)
        self.w2 = nn.Parameter(torch.randn(64, 64) / 8)

    def body(self, x):
        return torch.sin(torch.relu(x @ self.w1) @ self.w2).cos()

    def forward(self, x):
        return checkpoint(
            self.body,
            x,
            use_reentrant=False,
            context_fn=functools.partial(create_selective_checkpoint_contexts, _save_matmuls_only),
        )


@pytest.mark.parametrize("strategy", ["mincut", "milp"])
def test_selective_checkpoint_tags_win(strategy):
    """The ops the policy ran in the forward (relu, sin, cos: MUST_RECOMPUTE) are never saved and
    the matmuls (MUST_SAVE) never recomputed. The ops the derivatives add to the joint forward
    (`cos(mm_1)` for sin's, `-sin(sin)` for cos's) carry no tag: they are priced like any other,
    and saving them can beat recomputing two transcendental ops."""
    torch.manual_seed(0)
    model, x = _Tagged(), torch.randn(32, 64)
    reference = gradients(model, (x,))
    compiled = remat.compile(model, strategy=strategy, compiler="aot_eager")
    got = gradients(compiled, (x,))
    for g, r in zip(got.values(), reference.values(), strict=True):
        torch.testing.assert_close(g, r)
    (plan,) = plans_of(compiled)
    saved = {s.name for s in plan.saved}
    assert not saved & {"relu", "sin", "cos"}  # tagged MUST_RECOMPUTE
    assert not {"mm", "mm_1"} & set(plan.recomputed)  # tagged MUST_SAVE
    assert sum(s.op == "aten.mm.default" for s in plan.saved) >= 1


# -- the budgeted save set is optimal: brute force over every subset --------------------------------
@settings(max_examples=60, deadline=None)
@given(specs(max_values=10))
def test_cheapest_save_set_matches_brute_force(spec):
    graph, _ = build(spec)
    problem = joint_problem(graph, None)
    values = problem.values
    rng = np.random.default_rng(len(spec.ops))
    op_seconds = list(rng.uniform(0, 1e-3, size=len(graph.ops)))
    held = sorted({v.storage for v in values if graph.storages[v.storage].kind == "activation"})
    total_held = sum(graph.storages[m].nbytes for m in held)
    for cap in (None, total_held // 2, 0):
        best = None
        for chosen, recomputed in every_save_set(problem):
            storages = {values[v].storage for v in chosen} & set(held)
            if cap is not None and sum(graph.storages[m].nbytes for m in storages) > cap:
                continue
            ops = {graph.op_by_name[values[v].op].index for v in recomputed}
            cost = sum(op_seconds[i] for i in ops) + sum(values[v].cost for v in chosen) / BANDWIDTH
            best = cost if best is None else min(best, cost)
        found = cheapest_save_set(graph, problem, op_seconds, BANDWIDTH, cap)
        if best is None:
            assert found is None
            continue
        assert found is not None
        got = describe_save_set(graph, problem, found, op_seconds)
        assert got.recompute_seconds + got.traffic_bytes / BANDWIDTH == pytest.approx(
            best, rel=1e-6, abs=1e-12
        )


def test_unknown_strategy_and_compiler_are_named():
    with pytest.raises(remat.RematError, match="strategy 'fastest' is unknown"):
        remat.backend(strategy="fastest")
    with pytest.raises(remat.RematError, match="compiler 'tvm' is unknown"):
        remat.backend(compiler="tvm")
    with pytest.raises(remat.RematError, match="peak_model 'inductor' does not fit compiler"):
        remat.backend(compiler="aot_eager", peak_model="inductor")
    with pytest.raises(remat.RematError, match="peak_model 'exact' does not fit"):
        remat.backend(peak_model="exact")
    assert remat.backend().peak_model == "inductor"
    assert remat.backend(compiler="aot_eager").peak_model == "op-by-op"


def test_compiled_plan_explains_itself_and_round_trips_json():
    model, inputs = _build("gpt2")
    compiled = remat.compile(model, strategy="mincut", compiler="aot_eager")
    gradients(compiled, inputs)
    (plan,) = plans_of(compiled)
    graph = compiled.remat_backend.graphs[0]
    rows = plan.explain(graph)
    assert {r["decision"] for r in rows} == {"keep", "recompute"}
    assert sum(r["bytes"] for r in rows if r["decision"] == "keep") >= plan.held_bytes
    assert len(rows) == len(plan.saved) + len(plan.recomputed)
    assert remat.Plan.from_json(plan.to_json()) == plan


# -- errors: remat.compile raises remat's own error, not dynamo's wrapper --------------------------
class _ArticleModule(nn.Module):
    """The article's example with a to-be-learned first input, as a module."""

    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.randn(64))

    def forward(self, b, c, d):
        return _article(self.a, b, c, d)


@pytest.mark.parametrize("strategy", ["mincut", "auto"])
def test_compile_raises_infeasible_budget_itself(strategy):
    from torch._dynamo.exc import BackendCompilerFailed

    torch.manual_seed(0)
    inputs = [torch.randn(64, requires_grad=True) for _ in range(3)]
    compiled = remat.compile(_ArticleModule(), budget=1, strategy=strategy, compiler="aot_eager")
    with pytest.raises(remat.InfeasibleBudget) as e:
        compiled(*inputs)
    assert e.value.budget_bytes == 1
    assert isinstance(e.value.min_feasible_bytes, int) and e.value.min_feasible_bytes > 0
    assert isinstance(e.value.__cause__, BackendCompilerFailed)  # raised from dynamo's error
    assert e.value.__cause__.inner_exception is e.value  # the very error remat raised


def test_compiled_module_still_behaves_like_torchs():
    torch.manual_seed(0)
    model = _ArticleModule()
    inputs = [torch.randn(64, requires_grad=True) for _ in range(3)]
    compiled = remat.compile(model, strategy="auto", compiler="aot_eager")
    assert isinstance(compiled, torch._dynamo.eval_frame.OptimizedModule)
    assert list(compiled.state_dict()) == list(torch.compile(model).state_dict())
    assert [p for p in compiled.parameters()] == [model.a]
    assert compiled.a is model.a
    compiled.eval()
    assert not model.training
    compiled.train()
    assert model.training
    compiled(*inputs).sum().backward()
    got = [model.a.grad.clone(), *(x.grad.clone() for x in inputs)]
    model.a.grad = None
    for x in inputs:
        x.grad = None
    model(*inputs).sum().backward()
    for g, r in zip(got, [model.a.grad, *(x.grad for x in inputs)], strict=True):
        torch.testing.assert_close(g, r)
    (plan,) = plans_of(compiled)
    assert plan.strategy == "compile:auto"


@pytest.mark.parametrize("seq", [64, 256])
def test_kernel_scratch_rule_equals_what_cpu_flash_attention_backward_allocates(seq):
    """The CPU flash-attention backward allocates per-thread tiles after its outputs, which its
    meta kernel does not: the rule the inductor replay adds must equal what the CPU allocator
    sees inside the op beyond the three gradients (measured by the profiler)."""
    from torch.profiler import ProfilerActivity, profile

    from remat.measuring.measure import _walk
    from remat.prediction.inductor_plan import kernel_scratch_bytes

    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    q, k, v = (torch.randn(2, 4, seq, 16, requires_grad=True) for _ in range(3))
    out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    grad = torch.randn_like(out)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out.backward(grad)
    events = list(_walk(prof.profiler.kineto_results.experimental_event_tree()))
    # The op's own `at::empty` calls: its gradients come from `zeros`, a non-contiguous
    # gradient's copy from `contiguous`; what is left is the kernel's scratch.
    scratch = sum(
        e.extra_fields.alloc_size
        for e in events
        if e.tag == torch._C._profiler._EventType.Allocation
        and e.extra_fields.alloc_size > 0
        and e.parent is not None
        and e.parent.name == "aten::empty"
        and e.parent.parent is not None
        and e.parent.parent.name == "aten::_scaled_dot_product_flash_attention_for_cpu_backward"
    )
    assert scratch > 0
    assert scratch == kernel_scratch_bytes(op, (grad, q.detach(), k.detach()))


class _LSTMHead(nn.Module):
    """An LSTM breaks dynamo's graph: the measured first step's hooks run between graphs."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(8, 16, num_layers=2, batch_first=True)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.lstm(x)[0])


@needs_cxx
def test_the_first_steps_check_is_not_compiled_where_the_model_breaks_its_graph(caplog):
    # dynamo compiled remat's pack hook once per saved dtype and shape and warned that it hit
    # its recompile limit on the first call of remat.compile(lstm_model)
    x = torch.randn(2, 6, 8)
    compiled = remat.compile(_LSTMHead(), budget="100%")
    with caplog.at_level("WARNING", logger="torch._dynamo"):
        compiled(x).sum().backward()
    assert not [r for r in caplog.records if "recompile_limit" in r.getMessage()]
