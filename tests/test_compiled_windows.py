"""Issue 38 item 4: the compiled path's budgeted save set caps the bytes held window by window of
the backward (solvers/peak_windows.py), not only in all: a late block's saved values die before
most gradients exist, an early block's live beside all of them, so where the step has room the
plan keeps more and recomputes less than the ladder of single caps, at a peak still predicted to
the byte (aot_eager: the graphs run op by op, as `joint_peak` counts them)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat.answers.bench import gradients
from remat.applying.compiled import RematBackend, plans_of
from remat.device.cost import get_profile
from remat.errors import InfeasibleBudget
from remat.planning.joint import JointContext
from remat.planning.solvers.saveset import candidate_save_sets, describe_save_set

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


class _Block(nn.Module):
    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.fc, self.proj = nn.Linear(d, hidden), nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(F.gelu(self.fc(x), approximate="tanh"))


class _Residual(nn.Module):
    """8 residual MLP blocks: each block's parameter gradients (128 KiB) about what it saves."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(_Block(64, 256) for _ in range(8)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x).square().mean()


def _ladder_pick(context: JointContext, budget: int):
    """What the budgeted save set chose before the windows: the cheapest rung of the ladder of
    single caps (and store-all) whose predicted peak fits."""
    problem = context.problem()
    profile = context.profile
    fitting = []
    for saved, _ in candidate_save_sets(
        context.graph, problem, context.op_seconds, profile.bandwidth
    ):
        chosen = describe_save_set(context.graph, problem, saved, context.op_seconds)
        if chosen.peak_bytes <= budget:
            fitting.append(chosen)
    return min(fitting, key=lambda s: s.recompute_seconds + s.traffic_bytes / profile.bandwidth)


@pytest.mark.slow  # ~10 s of CPU: two ladders of MILP solves
def test_windowed_caps_recompute_less_than_the_ladder_at_the_same_budget():
    torch.manual_seed(0)
    model, x = _Residual(), torch.randn(128, 64)
    store_all = RematBackend(budget=None, compiler="aot_eager")
    torch.compile(model, backend=store_all, dynamic=False)(x).backward()
    context = JointContext(store_all.graphs[0], frozenset(), frozenset(), get_profile("cpu"))
    with pytest.raises(InfeasibleBudget) as lowest:
        context.cheapest_within(1)
    low, high = lowest.value.min_feasible_bytes, context.store_all.peak_bytes
    budget = low + (high - low) // 10  # near the lowest peak, where full checkpointing sits
    before = _ladder_pick(context, budget)

    torch._dynamo.reset()
    compiled = remat.compile(model, budget=budget, compiler="aot_eager")
    measured = remat.measure(compiled, x)
    (plan,) = plans_of(compiled)
    assert measured.peak_bytes == plan.predicted_peak_bytes <= budget
    assert measured.activation_bytes == plan.held_bytes
    # fails before the windows: the plan was the ladder's pick, 257 us of recompute against 173
    assert plan.recompute_seconds < 0.9 * before.recompute_seconds
    reference = gradients(model, (x,))
    for name, got in gradients(compiled, (x,)).items():
        torch.testing.assert_close(got, reference[name])


class _Attention(nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).sum()


def test_the_cpus_flash_attention_is_priced_by_its_flops_in_the_joint_graph():
    """torch's FLOP counter has no formula for `_scaled_dot_product_flash_attention_for_cpu`: the
    compiled path counted 0 FLOPs and priced recomputing it as its traffic alone (0.6 ms for 8 ms
    of work a layer on the harness GPT-2), so budgeted plans recomputed every layer's attention."""
    from torch.utils.flop_counter import sdpa_flop_count

    q, k, v = (torch.randn(2, 4, 64, 16, requires_grad=True) for _ in range(3))
    backend = RematBackend(budget=None, compiler="aot_eager")
    torch.compile(_Attention(), backend=backend, dynamic=False)(q, k, v).backward()
    (attention,) = [
        op for op in backend.graphs[0].forward_ops if "flash_attention_for_cpu" in op.target
    ]
    assert attention.flops == sdpa_flop_count(q.shape, k.shape, v.shape) > 0  # 0 before
