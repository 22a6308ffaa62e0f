"""Compiled offload: remat.compile tags the saved values its plan offloads for torch's compile
offload pass, the partitioned graphs copy exactly those to host and back, gradients do not move,
and the predicted drop of the peak is the measured one where the host copies leave the allocator."""

from __future__ import annotations

import re
import sys
import warnings

import numpy as np
import pytest
import torch
from compiled_support import needs_cxx
from torch import nn

import remat
from remat.answers.bench import gradients
from remat.applying.compiled import plans_of

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
