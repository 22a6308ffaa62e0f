"""Properties of the liveness simulation, on hand-made graphs where the answer is known, and the
estimate as the no-regions case of the planner's judge on model-zoo graphs."""

from __future__ import annotations

import pytest
from oracles import store_all_timeline

import remat
from remat import models
from remat.estimate import estimate, live_bytes_timeline, storage_deaths
from remat.graph import Graph, Node, Op, Saved, Storage, Tensor
from remat.schedule import simulate


def _graph() -> Graph:
    """x (10 B input) -> op0 -> a (100 B, saved by node 7) -> op1 -> b (50 B, the output);
    backward: op2 makes g (30 B, dropped after op3) and runs node 7, which releases `a` after op3;
    op3 makes the weight grad w.grad (8 B). The program drops `a` right after op1."""
    storages = {
        0: Storage(0, 10, "input"),
        1: Storage(1, 100, "activation", allocated_at=0, released_after=1),
        2: Storage(2, 50, "activation", allocated_at=1, released_after=None),
        3: Storage(3, 30, "activation", allocated_at=2, released_after=3),
        4: Storage(4, 8, "grad", allocated_at=3, released_after=None),
        5: Storage(5, 8, "param"),
    }
    tensors = {sid: Tensor(sid, sid, (s.nbytes,), "uint8", s.nbytes) for sid, s in storages.items()}
    ops = [
        Op(0, "f_0", "aten.f.default", "", "forward", (0, 5), (1,), node=7),
        Op(1, "g_0", "aten.g.default", "", "forward", (1,), (2,)),
        Op(2, "g_0:bwd.h_0", "aten.h.default", "", "backward", (2,), (3,), node=8),
        Op(3, "f_0:bwd.k_0", "aten.k.default", "", "backward", (1, 3), (4,), node=7),
    ]
    return Graph(
        ops=ops,
        tensors=tensors,
        storages=storages,
        saved=[Saved(storage=1, tensor=1, node=7), Saved(storage=5, tensor=5, node=7)],
        nodes={7: Node(7, "FBackward0", 0, released_after=3), 8: Node(8, "GBackward0", 1, 2)},
        modules=[],
    )


def test_a_saved_storage_lives_until_the_node_that_saved_it_has_run():
    deaths = storage_deaths(_graph())
    assert deaths[1] == 3  # the program let go after op1, autograd after op3
    assert deaths[3] == 3
    assert deaths[2] == 4  # never released: live to the end


def test_timeline_counts_each_storage_from_allocation_to_release():
    timeline = live_bytes_timeline(_graph(), base_bytes=18)
    assert timeline == [18 + 100, 18 + 150, 18 + 180, 18 + 188]


def test_peak_and_activation_bytes_of_a_known_graph():
    est = estimate(_graph())
    assert est.activation_bytes == 100  # the parameter autograd also saved is not an activation
    assert est.peak_bytes == 18 + 188
    assert est.peak_op == "f_0:bwd.k_0"
    assert est.param_bytes == 8 and est.input_bytes == 10 and est.grad_bytes == 8


def test_adamw_keeps_two_states_per_parameter_byte_and_a_step_temporary():
    base = estimate(_graph())
    adamw = estimate(_graph(), optimizer="adamw")
    assert adamw.optimizer_state_bytes == 2 * 8
    assert adamw.peak_bytes == base.peak_bytes + 16


def test_unknown_optimizer_is_refused():
    with pytest.raises(ValueError, match="adamw"):
        estimate(_graph(), optimizer="lion")


@pytest.mark.parametrize("name", ["gpt2", "resnet50"])
def test_the_estimate_is_the_judge_without_regions(name):
    """The estimate's timeline is `simulate` with no regions, and both agree with the store-all
    liveness written out directly (tests/oracles.py), op for op."""
    model, inputs = models.build(name, batch=2, seq=32, tiny=True)
    graph = remat.trace(model, *inputs)
    est = estimate(graph, optimizer="adamw")
    base = sum(s.nbytes for s in graph.storages.values() if s.allocated_at is None)
    base += est.optimizer_state_bytes
    sim = simulate(graph, (), base_bytes=base)
    assert sim.schedule == tuple(("op", i) for i in range(len(graph.ops)))
    assert sim.recompute_ops == ()
    assert [bytes_ for _, bytes_ in est.timeline] == list(sim.timeline)
    assert live_bytes_timeline(graph, base) == store_all_timeline(graph, base)
    assert storage_deaths(graph) == sim.deaths
    assert est.peak_bytes >= sim.peak_bytes  # the optimizer step may be the peak
