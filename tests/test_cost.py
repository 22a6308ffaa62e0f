"""The roofline cost model: views are free, matmuls are compute-bound, pointwise ops memory-bound."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import nn

import remat
from remat import models
from remat.device.cost import (
    ATTENTION_PREFIXES,
    PROFILES,
    DeviceProfile,
    fused_op_seconds_all,
    get_profile,
    is_matmul,
    op_bytes_moved,
    op_seconds,
    op_seconds_all,
)
from remat.errors import UnknownProfileError
from remat.measuring.calibrate import calibrate_profile


@pytest.fixture(scope="module")
def mlp_graph() -> remat.Graph:
    """Linear(4096, 4096) + GELU in bf16 on 8192 tokens, as half a transformer MLP runs it (traced
    on fake tensors: nothing of that size is allocated)."""
    meta = {"device": "meta", "dtype": torch.bfloat16}
    model = nn.Sequential(nn.Linear(4096, 4096, **meta), nn.GELU())
    return remat.trace(model, torch.empty(8192, 4096, **meta))


def _op(graph: remat.Graph, short: str):
    return next(op for op in graph.forward_ops if op.short == short)


def test_view_ops_cost_nothing(mlp_graph):
    t = _op(mlp_graph, "t")  # the weight's transpose
    assert op_bytes_moved(mlp_graph, t) == 0
    assert op_seconds(mlp_graph, t, "h100") == 0.0


def test_matmul_is_compute_bound_and_pointwise_memory_bound_on_h100(mlp_graph):
    h100 = PROFILES["h100"]
    mm = _op(mlp_graph, "addmm")
    gelu = _op(mlp_graph, "gelu")
    assert is_matmul(mm) and not is_matmul(gelu)
    assert mm.flops == 2 * 8192 * 4096 * 4096
    assert op_seconds(mlp_graph, mm, h100) == pytest.approx(mm.flops / h100.peak_flops)
    assert op_seconds(mlp_graph, mm, h100) > op_bytes_moved(mlp_graph, mm) / h100.bandwidth
    # GELU reads its 64 MiB input and writes its 64 MiB output
    gelu_bytes = 2 * 8192 * 4096 * 2
    assert op_bytes_moved(mlp_graph, gelu) == gelu_bytes
    assert op_seconds(mlp_graph, gelu, h100) == pytest.approx(gelu_bytes / h100.bandwidth)


def test_an_eager_transcendental_or_random_op_costs_its_arithmetic_where_that_is_dearer():
    """FLOP counters count nothing for GELU or dropout, so the roofline priced them by their
    traffic alone: on a CPU, tanh-GELU of 3.1M floats ran 6.3 ms against 1.26 ms priced, and the
    planner took recomputing them (and dropout's masks, the encoder of issue 38) for cheap. Their
    eager price is now at least `transcendental_ops` vector operations an element; on an H100
    their traffic still decides (fp32: 8 bytes an element against 4 operations). Failed before:
    GELU's price on the cpu profile was its 25 MiB of traffic, 1.26 ms."""
    meta = {"device": "meta"}
    model = nn.Sequential(nn.Linear(768, 3072, **meta), nn.GELU("tanh"), nn.Dropout(0.1))
    graph = remat.trace(model, torch.empty(1024, 768, **meta))
    elements = 1024 * 3072
    for short in ("gelu", "bernoulli_"):
        op = _op(graph, short)
        cpu, h100 = PROFILES["cpu"], PROFILES["h100"]
        arithmetic = elements * cpu.transcendental_ops / cpu.vector_flops
        assert arithmetic > op_bytes_moved(graph, op) / cpu.bandwidth
        assert op_seconds(graph, op, cpu) == pytest.approx(arithmetic)
        assert op_seconds(graph, op, h100) == pytest.approx(
            op_bytes_moved(graph, op) / h100.bandwidth
        )
        assert op_seconds_all(graph, cpu)[op.index] == op_seconds(graph, op, cpu)
    mm = _op(graph, "addmm")
    assert op_seconds(graph, mm, "cpu") == pytest.approx(mm.flops / PROFILES["cpu"].peak_flops)


def test_fused_recompute_costs_arithmetic_not_traffic(mlp_graph):
    """Inside a fused kernel (the compiled path) a pointwise op costs its arithmetic: one vector
    operation an element, `transcendental_ops` for GELU and the like; no memory round trip. A
    matmul keeps its roofline; a view stays free."""
    h100 = PROFILES["h100"]
    fused = fused_op_seconds_all(mlp_graph, h100)
    roofline = op_seconds_all(mlp_graph, h100)
    mm, gelu, t = (_op(mlp_graph, name) for name in ("addmm", "gelu", "t"))
    assert fused[mm.index] == roofline[mm.index]
    assert fused[t.index] == 0.0
    elements = 8192 * 4096
    assert fused[gelu.index] == pytest.approx(
        elements * h100.transcendental_ops / h100.vector_flops
    )
    assert fused[gelu.index] < roofline[gelu.index]  # cheaper than GELU's 128 MiB round trip
    cpu = PROFILES["cpu"]
    assert fused_op_seconds_all(mlp_graph, cpu)[gelu.index] == pytest.approx(
        elements * cpu.transcendental_ops / cpu.vector_flops
    )


def test_op_seconds_all_matches_op_seconds(mlp_graph):
    times = op_seconds_all(mlp_graph, "a100")
    assert len(times) == len(mlp_graph.ops)
    for op in mlp_graph.ops:
        assert times[op.index] == pytest.approx(op_seconds(mlp_graph, op, "a100"))


def test_get_profile():
    assert get_profile("h200") is PROFILES["h200"]
    custom = DeviceProfile("mine", 1.0, 1.0, 1.0)
    assert get_profile(custom) is custom
    with pytest.raises(
        UnknownProfileError,
        match="a100, a100-40gb, a10g, b200, cpu, h100, h100-pcie, h200, l4, mi300x, rtx3090, "
        "rtx4070-ti-super, rtx4080, rtx4090, t4, v100",
    ):
        get_profile("tpu")


@pytest.mark.parametrize("name", ["a100-40gb", "h100-pcie", "l4", "rtx4090", "mi300x"])
def test_gpu_profiles_are_dense_bf16_matrix_over_vector_over_bandwidth(name):
    p = get_profile(name)
    assert p.name == name
    # matrix units outrun the vector units; both are far above one flop per byte of traffic
    assert p.peak_flops > p.vector_flops
    assert 40 < p.peak_flops / p.bandwidth < 500
    assert 5 < p.vector_flops / p.bandwidth < 200


def test_the_a100_40gb_differs_from_the_80gb_only_in_bandwidth():
    a40, a80 = PROFILES["a100-40gb"], PROFILES["a100"]
    assert (a40.peak_flops, a40.vector_flops) == (a80.peak_flops, a80.vector_flops)
    assert a40.bandwidth < a80.bandwidth


def test_calibrate_profile_measures_plausible_rates():
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    p = calibrate_profile()
    assert torch.equal(torch.rand(3), expected)  # the script's random stream did not move
    rates = (p.peak_flops, p.vector_flops, p.bandwidth, p.attention_flops)
    assert all(math.isfinite(r) and r > 0 for r in rates)
    assert p.peak_flops > p.vector_flops
    assert p.transcendental_ops > 1.5  # sin/exp/tanh cost more than an add, on any machine
    measured = dict(p.element_ops)
    assert set(measured) == {
        "gelu",
        "silu",
        "_softmax",
        "_log_softmax",
        "_safe_softmax",
        "bernoulli_",
    }
    assert all(math.isfinite(v) and v >= 1.0 for v in measured.values())


def _attention_graph() -> remat.Graph:
    class Attention(nn.Module):
        def forward(self, q, k, v):
            return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    q = torch.empty(2, 4, 128, 32, device="meta", requires_grad=True)
    return remat.trace(Attention(), q, q.clone(), q.clone())


def test_attention_is_priced_at_the_profiles_measured_attention_rate():
    """SDPA ran at ~0.45 of the CPU's matmul rate by torch's FLOP count (causal: the kernel
    skips the masked half the count includes, and its softmax is no matmul); priced at the
    matmul rate it looked 2x cheaper to recompute than it was. A profile's `attention_flops`
    prices the attention kernels; 0 keeps `peak_flops` (the shipped profiles)."""
    graph = _attention_graph()
    sdpa = next(op for op in graph.forward_ops if op.short.startswith(ATTENTION_PREFIXES))
    cpu = PROFILES["cpu"]
    assert cpu.attention_flops == 0 and cpu.attention_rate == cpu.peak_flops
    slow = dataclasses.replace(cpu, attention_flops=cpu.peak_flops / 8)
    assert op_seconds(graph, sdpa, cpu) == pytest.approx(sdpa.flops / cpu.peak_flops)
    assert op_seconds(graph, sdpa, slow) == pytest.approx(8 * sdpa.flops / cpu.peak_flops)
    assert op_seconds_all(graph, slow)[sdpa.index] == op_seconds(graph, sdpa, slow)


def test_a_measured_element_cost_prices_its_op_kind():
    """GELU costs ~20 vector operations an element on this project's CPU where sin, exp and tanh
    cost ~4.5, and softmax counted no arithmetic at all: `element_ops` (measured by
    `calibrate_profile`) prices the kinds it names; the others keep `transcendental_ops`."""
    meta = {"device": "meta"}
    model = nn.Sequential(nn.Linear(64, 256, **meta), nn.GELU(), nn.Softmax(-1), nn.SiLU())
    graph = remat.trace(model, torch.empty(512, 64, **meta))
    elements = 512 * 256
    cpu = dataclasses.replace(PROFILES["cpu"], element_ops=(("gelu", 30.0), ("_softmax", 12.0)))
    gelu, softmax, silu = (_op(graph, name) for name in ("gelu", "_softmax", "silu"))
    assert op_seconds(graph, gelu, cpu) == pytest.approx(elements * 30 / cpu.vector_flops)
    assert op_seconds(graph, softmax, cpu) == pytest.approx(elements * 12 / cpu.vector_flops)
    assert op_seconds(graph, silu, cpu) == pytest.approx(
        elements * cpu.transcendental_ops / cpu.vector_flops
    )
    assert op_seconds(graph, softmax, PROFILES["cpu"]) < op_seconds(graph, softmax, cpu)
    every = op_seconds_all(graph, cpu)
    assert [every[op.index] for op in (gelu, softmax, silu)] == [
        op_seconds(graph, op, cpu) for op in (gelu, softmax, silu)
    ]


def test_the_price_of_attention_decides_whether_auto_recomputes_it():
    """The ranking the measured attention rate changes: at torch full checkpointing's peak of a
    small GPT-2, auto keeps SDPA's output in every block where attention is dear, and recomputes
    it in most where it is cheap."""
    from remat.planning.planner import Planner
    from remat.planning.strategies import get

    model, inputs = models.build(
        "gpt2", device="meta", batch=2, seq=64, n_layer=4, n_embd=64, n_head=4, vocab_size=256
    )
    graph = remat.trace(model, *inputs)
    cpu = PROFILES["cpu"]
    peak = Planner(graph, cpu).solve(get("full"), 0).predicted_peak_bytes

    def regions_keeping_attention(attention_flops: float) -> int:
        plan = Planner(graph, dataclasses.replace(cpu, attention_flops=attention_flops)).plan(
            peak, "auto"
        )
        assert plan.predicted_peak_bytes <= peak
        return sum(any("attention" in k for k in r.keep) for r in plan.regions)

    dear, cheap = cpu.peak_flops / 30, cpu.peak_flops * 100
    assert regions_keeping_attention(dear) == 4
    assert regions_keeping_attention(cheap) < 4
