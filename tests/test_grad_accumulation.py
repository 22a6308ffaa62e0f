"""Where two gradients reach one input, autograd's engine adds the second into the first in place
when it holds the last reference to the first (`InputBuffer::accumulate`), but never under a
dispatch mode: the tracer's own references and fake tensors' subclass stop it. The tracer runs
those additions as the engine does without it. Found on an H100: Llama-3.2-1B's tied embedding,
whose two gradients meet at the end of the backward, ran 0.96 GiB under the prediction."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import remat
from remat import Planner


class Fork(nn.Module):
    """`h` feeds three products, whose gradients are fresh tensors: the engine adds them in place.
    The additions come last in the backward, where the large layer's weight gradient is live,
    so they make the step's peak."""

    def __init__(self, width: int = 4096) -> None:
        super().__init__()
        self.up, self.big = nn.Linear(64, width), nn.Linear(width, width)
        self.register_buffer("scales", torch.tensor([2.0, 3.0, 5.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        return self.big(h * self.scales[0] + h * self.scales[1] + h * self.scales[2])


class Cat(nn.Module):
    """`h` twice through `cat`: its gradients are two views of one tensor, and the engine adds
    them out of place (the first's storage is held by the second)."""

    def __init__(self, width: int = 1024) -> None:
        super().__init__()
        self.up, self.big = nn.Linear(64, width), nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        return self.big(torch.cat([h, h], dim=1))


def _accumulations(graph) -> list[str]:
    return [op.target for op in graph.ops if op.phase == "backward" and op.short in ("add", "add_")]


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_gradients_added_in_place_as_the_engine_adds_them(device):
    torch.manual_seed(0)
    model, x = Fork(), torch.randn(512, 64)
    graph = remat.trace(model, x, device=device)
    assert _accumulations(graph) == ["aten.add_.Tensor"] * 2
    plan = Planner(graph).plan("1TiB", "store_all")
    measured = remat.measure(model, x)
    # out of place, each addition would allocate one more `h` (512 x 4096 fp32, 8 MiB) at the peak
    assert plan.predicted_peak_bytes == measured.peak_bytes


def test_gradients_that_share_a_storage_are_added_out_of_place():
    torch.manual_seed(0)
    model, x = Cat(), torch.randn(256, 64)
    graph = remat.trace(model, x)
    assert _accumulations(graph) == ["aten.add.Tensor"]
    plan = Planner(graph).plan("1TiB", "store_all")
    assert plan.predicted_peak_bytes == remat.measure(model, x).peak_bytes


def test_the_engine_without_a_mode_adds_in_place_where_the_trace_says():
    """The ground truth the rule stands on: profiled without any mode, the engine runs `add_`
    for Fork's gradients and `add` for Cat's."""
    from torch.profiler import ProfilerActivity, profile

    for model, expected in ((Fork(256), "aten::add_"), (Cat(256), "aten::add")):
        x = torch.randn(8, 64)
        out = model(x)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            out.sum().backward()
        adds = {e.name for e in prof.events() if e.name in ("aten::add", "aten::add_")}
        assert adds == {expected}
