"""Compiled offload: remat.compile tags the saved values its plan offloads for torch's compile
offload pass, the partitioned graphs copy exactly those to host and back, gradients do not move,
and the predicted drop of the peak is the measured one where the host copies leave the allocator."""

from __future__ import annotations

import itertools
import re
import sys
import warnings

import numpy as np
import pytest
import torch
from compiled_support import needs_cxx
from hypothesis import given, settings
from hypothesis import strategies as st
from oracles import every_save_set
from test_mincut import build, specs
from torch import nn

import remat
from remat import models
from remat.answers.bench import gradients
from remat.applying.compiled import plans_of
from remat.planning.solvers.mincut import joint_problem
from remat.planning.solvers.saveset import (
    Offloadable,
    cheapest_choice,
    describe_save_set,
    joint_peak,
)

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _chain(layers: int = 6, batch: int = 2048, width: int = 128) -> tuple[nn.Module, tuple]:
    """An MLP whose activations (1 MiB each) outweigh its weights, so that the peak is theirs."""
    torch.manual_seed(0)
    body = [m for _ in range(layers) for m in (nn.Linear(width, width), nn.GELU())]
    return nn.Sequential(*body, nn.Linear(width, 1)), (torch.randn(batch, width),)


class _HostOutsideTheAllocator:
    """The CPU stand-in for a GPU's host link: torch's pass emits `prims.device_put(x, cpu)`,
    which on the CPU returns `x` itself; inside this context the copy out goes to numpy memory,
    which c10's allocator (what `remat.measure` reads on the CPU) does not see, and the copy back
    returns to the allocator. (prims.device_put dispatches at BackendSelect, so the kernel is
    replaced there, and restored on exit.)"""

    def __init__(self) -> None:
        self.host: dict[int, torch.Tensor] = {}
        self.copied_out = 0

    def put(self, x: torch.Tensor, device: torch.device, non_blocking: bool = False):
        if x.data_ptr() in self.host:
            del self.host[x.data_ptr()]
            return x.clone()
        out = torch.from_numpy(np.empty(tuple(x.shape), dtype=np.float32))
        out.copy_(x)
        self.host[out.data_ptr()] = out
        self.copied_out += x.untyped_storage().nbytes()
        return out

    def __enter__(self) -> _HostOutsideTheAllocator:
        self.library = torch.library.Library("prims", "IMPL")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "overriding a previously registered kernel"
            self.library.impl("device_put", self.put, "BackendSelect")
        return self

    def __exit__(self, *exc: object) -> None:
        self.library._destroy()


def _compiled(offload, compiler: str = "aot_eager"):
    model, inputs = _chain()
    return (
        model,
        inputs,
        remat.compile(
            model, strategy="mincut", compiler=compiler, offload=offload, peak_model="op-by-op"
        ),
    )


def test_compiled_offload_moves_the_tagged_values_and_drops_the_peak_as_predicted():
    """aot_eager (where the op-by-op peak is the measured one): the forward graph copies to host
    exactly the values the plan names, backward reloads each, their bytes are the plan's host
    bytes, gradients are bit-identical to the same compile without offload, and with the copies
    outside the allocator the measured peak and its drop are the predicted ones."""
    model, inputs, plain = _compiled(False)
    reference = gradients(plain, inputs, seed=1)
    (without,) = plans_of(plain)
    measured_without = remat.measure(plain, *inputs)
    assert measured_without.peak_bytes == without.predicted_peak_bytes

    torch._dynamo.reset()
    _, _, compiled = _compiled(True)
    assert gradients(compiled, inputs, seed=1).keys() == reference.keys()
    for got, ref in zip(
        gradients(compiled, inputs, seed=1).values(), reference.values(), strict=True
    ):
        assert torch.equal(got, ref)
    (plan,) = plans_of(compiled)
    assert [s.name for s in plan.saved] == [s.name for s in without.saved]
    in_graph = plan.details["offloaded_in_graph"]
    assert len(plan.offload) == 6  # each hidden layer's output before its GELU, 1 MiB
    assert sorted(in_graph) == sorted(plan.offload) == plan.details["reloaded_in_graph"]
    assert sum(in_graph.values()) == plan.host_bytes == 6 * 2**20
    assert plan.offload_drop_bytes == without.predicted_peak_bytes - plan.predicted_peak_bytes
    assert plan.offload_drop_bytes > 0

    host = _HostOutsideTheAllocator()
    with host:
        measured = remat.measure(compiled, *inputs, warmup=0, steps=1)
    assert host.copied_out == 2 * plan.host_bytes and not host.host  # the measured and timed step
    assert measured.peak_bytes == plan.predicted_peak_bytes
    assert measured_without.peak_bytes - measured.peak_bytes == plan.offload_drop_bytes


def test_with_a_budget_the_compiled_plan_offloads_only_what_the_budget_needs():
    """remat.compile(budget=, offload=): the save set's program keeps, recomputes or offloads each
    tensor; at 9.0 MB it offloads one value and adds less time than recomputing without offload;
    at 8.0 MB, which no save set meets on the device alone, two values; measured = predicted
    (the host copies outside the allocator), within the budget, gradients bit-identical."""
    _, inputs, plain = _compiled(False)
    reference = gradients(plain, inputs, seed=1)
    added = {}
    for budget, offloaded in ((9_000_000, 1), (8_000_000, 2)):
        for offload in (False, True):
            torch._dynamo.reset()
            model, inputs = _chain()
            compiled = remat.compile(
                model, budget, "milp", compiler="aot_eager", offload=offload, check=False
            )
            if budget == 8_000_000 and not offload:
                with pytest.raises(remat.InfeasibleBudget):
                    compiled(*inputs)
                continue
            with _HostOutsideTheAllocator():
                got = gradients(compiled, inputs, seed=1)
                measured = remat.measure(compiled, *inputs, warmup=0)
            assert all(torch.equal(got[k], reference[k]) for k in reference)
            (plan,) = plans_of(compiled)
            assert measured.peak_bytes == plan.predicted_peak_bytes <= budget
            assert len(plan.offload) == (offloaded if offload else 0)
            assert sorted(plan.details.get("offloaded_in_graph", {})) == sorted(plan.offload)
            added[budget, offload] = plan.added_seconds
    assert added[9_000_000, True] < added[9_000_000, False]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "seq"), [("gpt2", 256), ("hf:llama", 128)])
def test_compiled_transformers_offload_drops_the_peak_as_predicted(name, seq):
    """The zoo's GPT-2 and a Hugging Face Llama (tiny), aot_eager, min-cut: the measured drop of
    the peak with the host copies outside the allocator is the predicted one, the host bytes are
    what the graph copies, gradients are bit-identical. (Llama's matmul outputs are saved beside
    their 3-D views; the matmul is the value tagged, on the storage it allocated.)"""
    if name.startswith("hf:"):
        pytest.importorskip("transformers")
    peaks, grads = {}, {}
    for offload in (False, remat.OffloadSettings(min_bytes=64 * 1024)):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model, inputs = models.build(name, batch=2, seq=seq, device="cpu", tiny=True)
        compiled = remat.compile(model, strategy="mincut", compiler="aot_eager", offload=offload)
        with _HostOutsideTheAllocator():
            grads[bool(offload)] = gradients(compiled, inputs, seed=3)
            peaks[bool(offload)] = remat.measure(compiled, *inputs, warmup=0).peak_bytes
        (plan,) = plans_of(compiled)
    assert plan.offload and sum(plan.details["offloaded_in_graph"].values()) == plan.host_bytes
    assert peaks[False] - peaks[True] == plan.offload_drop_bytes > 0
    assert all(torch.equal(grads[True][k], grads[False][k]) for k in grads[False])


@pytest.mark.slow
@needs_cxx
def test_inductor_offloads_the_tagged_values_with_gradients_unchanged():
    model, inputs, plain = _compiled(False, "inductor")
    reference = gradients(plain, inputs, seed=1)
    torch._dynamo.reset()
    _, _, compiled = _compiled(True, "inductor")
    got = gradients(compiled, inputs, seed=1)
    for g, r in zip(got.values(), reference.values(), strict=True):
        assert torch.equal(g, r)
    (plan,) = plans_of(compiled)
    assert plan.offload and sorted(plan.details["offloaded_in_graph"]) == sorted(plan.offload)
    assert plan.details["reloaded_in_graph"] == sorted(plan.offload)
    assert plan.details["peak_model"] == "op-by-op"


def test_the_offload_pass_is_on_only_while_remat_partitions():
    from torch._functorch import config as functorch_config

    model, inputs, compiled = _compiled(True)
    compiled(*inputs).sum().backward()
    assert plans_of(compiled)[0].offload
    assert functorch_config.enable_activation_offloading is False
    torch._dynamo.reset()
    plain = torch.compile(model, backend="aot_eager")
    plain(*inputs).sum().backward()  # torch's own compile of the same model tags nothing


def test_a_host_cap_and_the_minimum_size_limit_what_the_compiled_plan_offloads():
    capped = remat.OffloadSettings(host_budget_bytes=3 * 2**20)
    _, inputs, compiled = _compiled(capped)
    compiled(*inputs).sum().backward()
    (plan,) = plans_of(compiled)
    assert len(plan.offload) == 3 and plan.host_bytes == 3 * 2**20
    torch._dynamo.reset()
    _, inputs, compiled = _compiled(remat.OffloadSettings(min_bytes=2**20 + 1))
    compiled(*inputs).sum().backward()
    (plan,) = plans_of(compiled)
    assert plan.offload == () and plan.host_bytes == 0
    assert "offloaded_in_graph" in plan.details and not plan.details["offloaded_in_graph"]


def test_compile_refuses_offload_by_name_where_torch_has_no_offload_pass(monkeypatch):
    module = "torch._functorch._activation_offloading.activation_offloading"
    monkeypatch.setitem(sys.modules, module, None)
    named = f"torch {re.escape(torch.__version__)} has no compile offload pass"
    with pytest.raises(remat.RematError, match=named):
        remat.compile(nn.Linear(4, 4), offload=True)


def test_inductors_buffer_plan_is_refused_with_offload_by_name():
    with pytest.raises(remat.RematError, match="peak_model='inductor' does not fit offload"):
        remat.compile(nn.Linear(4, 4), offload=True, peak_model="inductor")


# -- per tensor: keep, recompute or offload under one cap, against brute force ---------------------
@settings(max_examples=40, deadline=None)
@given(specs(max_values=8), st.integers(0, 3))
def test_the_save_sets_program_with_offload_matches_brute_force(spec, seed):
    """The budgeted save set's integer program with per-storage offload: its least recompute +
    traffic + copy seconds within a cap on device-held bytes (and on host bytes) is the least of
    every save set and every subset of offloadable storages (an offloaded storage's one movable
    value saved, no other value on it saved)."""
    graph, _ = build(spec)
    problem = joint_problem(graph, None)
    values = problem.values
    rng = np.random.default_rng(seed)
    op_seconds = list(rng.uniform(0, 1e-3, size=len(graph.ops)))
    held = sorted({v.storage for v in values if graph.storages[v.storage].kind == "activation"})
    movers = {}
    for v in values:
        if v.storage in held and v.storage not in movers and rng.random() < 0.8:
            movers[v.storage] = v.name
    seconds = {m: float(rng.uniform(0, 1e-3)) for m in movers}
    total = sum(graph.storages[m].nbytes for m in held)
    host_cap = [None, total // 3][seed % 2]
    offload = Offloadable(movers, seconds, host_cap)
    index_of = {v.name: i for i, v in enumerate(values)}
    for cap in (None, total // 2, total // 5, 0):
        best = None
        for chosen, recomputed in every_save_set(problem):
            storages = {values[v].storage for v in chosen} & set(held)
            ops = {graph.op_by_name[values[v].op].index for v in recomputed}
            base = sum(op_seconds[i] for i in ops) + sum(values[v].cost for v in chosen) / 1e9
            movable = [
                m
                for m, name in movers.items()
                if index_of[name] in chosen
                and all(u == index_of[name] or values[u].storage != m for u in chosen)
            ]
            for k in range(len(movable) + 1):
                for moved in itertools.combinations(movable, k):
                    out = sum(graph.storages[m].nbytes for m in moved)
                    kept = sum(graph.storages[m].nbytes for m in storages) - out
                    if cap is not None and kept > cap:
                        continue
                    if host_cap is not None and out > host_cap:
                        continue
                    cost = base + sum(seconds[m] for m in moved)
                    best = cost if best is None else min(best, cost)
        found = cheapest_choice(graph, problem, op_seconds, 1e9, cap, offload)
        if best is None:
            assert found is None
            continue
        assert found is not None
        got = describe_save_set(graph, problem, found[0], op_seconds, joint_peak, found[1], offload)
        assert got.recompute_seconds + got.traffic_bytes / 1e9 + got.transfer_seconds == (
            pytest.approx(best, rel=1e-6, abs=1e-12)
        )
        assert set(got.offloaded) == {movers[m] for m in found[1]}
