"""The memory-traffic min-cut: it finds the cheapest valid save set, and never recomputes what must
not be (random ops, inputs) nor saves what no longer exists (values overwritten in place)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import remat
from remat.device.cost import is_matmul
from remat.graph import Graph, Op, Saved, Storage, Tensor
from remat.planning.solvers.mincut import cut_cost, default_save_set, mincut

B = 1024 * 4  # one fp32 vector of 1024 elements


# -- the article's example -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def article_graph() -> Graph:
    """f(a, b, c, d) = cos(cos(a + b + c + d)): forward ops add_0, add_1, add_2, cos_0, cos_1 and the
    loss's sum; autograd saves z = add_2's output and cos(z) = cos_0's output."""
    leaves = [torch.randn(1024, requires_grad=True) for _ in range(4)]
    return remat.trace(lambda a, b, c, d: torch.cos(torch.cos(a + b + c + d)), *leaves)


def test_article_example_saves_only_z(article_graph):
    result = mincut(article_graph)
    assert result.saved == ("add_2",)
    assert result.cut_cost_bytes == 2 * B
    assert result.recomputed == ("cos_0",)  # cos_1 feeds only the loss: backward never needs it
    assert len(result.saved_storages) == 1
    assert result.held_bytes == B
    assert "8 KiB" in result.reason and "16 KiB" in result.reason


def test_article_example_alternatives_cost_4b(article_graph):
    inputs = sorted({f"input:{article_graph.tensors[t].storage}" for t in (1, 3, 5, 7)})
    # what autograd saves, z and cos(z): written and read once each (the article's "cut at cos")
    assert default_save_set(article_graph) == ("add_2", "cos_0")
    assert cut_cost(article_graph, ["add_2", "cos_0"]) == 4 * B
    # the four inputs, each only read again
    assert len(inputs) == 4
    assert cut_cost(article_graph, inputs) == 4 * B
    # cos(z) and cos(cos(z)) do not give back z, which cos_0's backward needs: not a cut
    assert cut_cost(article_graph, ["cos_0", "cos_1"]) is None
    with pytest.raises(ValueError, match="not a forward value"):
        cut_cost(article_graph, ["sin_0"])


# -- hand-built graphs ----------------------------------------------------------------------------
#: target, number of outputs, and how the first output relates to the op's first input
KINDS = {
    "pointwise": ("aten.mul.Tensor", 1),
    "view": ("aten.view.default", 1),  # aliases its first input's storage
    "inplace": ("aten.add_.Tensor", 1),  # overwrites its first input's storage
    "dropout": ("aten.native_dropout.default", 2),  # random: result and mask
    "multi": ("aten.var_mean.correction", 2),
}


@dataclass(frozen=True)
class Spec:
    """Values 0..n_inputs-1 are inputs; each op appends its outputs after them, in order."""

    input_bytes: tuple[int, ...]
    ops: tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...]  # kind, input values, out bytes
    saved: tuple[tuple[int, bool], ...]  # value, whether its backward node ran


def build(spec: Spec) -> tuple[Graph, list[str]]:
    """The Graph of `spec`, and the value names mincut uses, by value index. Tensor and storage ids
    coincide with value indices except where a view or in-place op reuses its input's storage."""
    storages: dict[int, Storage] = {}
    tensors: dict[int, Tensor] = {}
    names: list[str] = []
    for v, nbytes in enumerate(spec.input_bytes):
        storages[v] = Storage(v, nbytes, "input")
        tensors[v] = Tensor(v, v, (nbytes,), "uint8", nbytes)
        names.append(f"input:{v}")
    ops = []
    for index, (kind, inputs, out_bytes) in enumerate(spec.ops):
        target, _ = KINDS[kind]
        outputs = []
        for k, nbytes in enumerate(out_bytes):
            v = len(names)
            sid = v
            if k == 0 and kind in ("view", "inplace"):
                sid = tensors[inputs[0]].storage
            else:
                storages[v] = Storage(v, nbytes, "activation", allocated_at=index)
            tensors[v] = Tensor(v, sid, (nbytes,), "uint8", nbytes, producer=index)
            outputs.append(v)
            names.append(f"{kind}_{index}:{k}" if len(out_bytes) > 1 else f"{kind}_{index}")
        ops.append(
            Op(index, f"{kind}_{index}", target, "", "forward", inputs, tuple(outputs), node=index)
        )
    saved = [Saved(tensors[v].storage, v, 1000 + v if ran else None) for v, ran in spec.saved]
    graph = Graph(ops=ops, tensors=tensors, storages=storages, saved=saved, nodes={}, modules=[])
    return graph, names


@st.composite
def specs(draw, max_values: int = 16) -> Spec:
    sizes = st.integers(0, 1 << 20)
    input_bytes = tuple(draw(st.lists(sizes, min_size=1, max_size=3)))
    values = [(nbytes, -1) for nbytes in input_bytes]  # (bytes, producing op)
    ops = []
    for index in range(draw(st.integers(1, 12))):
        kind = draw(st.sampled_from(sorted(KINDS)))
        n_out = KINDS[kind][1]
        if len(values) + n_out > max_values:
            break
        inputs = tuple(
            draw(st.lists(st.integers(0, len(values) - 1), min_size=1, max_size=3, unique=True))
        )
        if kind in ("view", "inplace"):
            out_bytes = (values[inputs[0]][0],)
        else:
            out_bytes = tuple(draw(sizes) for _ in range(n_out))
        ops.append((kind, inputs, out_bytes))
        values += [(nbytes, index) for nbytes in out_bytes]
    saved = draw(
        st.lists(
            st.tuples(st.integers(0, len(values) - 1), st.sampled_from([True, True, False])),
            min_size=1,
            max_size=5,
            unique_by=lambda s: s[0],
        )
    )
    return Spec(input_bytes, tuple(ops), tuple(saved))


def brute_force(spec: Spec) -> tuple[np.ndarray, np.ndarray]:
    """(cost, valid) of every subset of values, as bit masks over value indices, straight from the
    spec: a needed value must be saved or recomputed from saved values, inputs and random ops are
    never recomputed, and a value overwritten in place later cannot be saved unless autograd
    itself saved it."""
    costs, pinned, inputs, storage = [], [], [], []
    for v, nbytes in enumerate(spec.input_bytes):
        costs.append(nbytes)
        pinned.append(True)
        inputs.append(())
        storage.append(v)
    clobbered: set[int] = set()
    for kind, op_inputs, out_bytes in spec.ops:
        if kind == "inplace":
            clobbered |= {u for u in range(len(costs)) if storage[u] == storage[op_inputs[0]]}
        for k, nbytes in enumerate(out_bytes):
            aliases = k == 0 and kind in ("view", "inplace")
            storage.append(storage[op_inputs[0]] if aliases else len(costs))
            costs.append(2 * nbytes)
            pinned.append(kind == "dropout")
            inputs.append(op_inputs)
    needed = {v for v, ran in spec.saved if ran}
    n = len(costs)
    masks = np.arange(1 << n, dtype=np.int64)
    bits = [(masks >> v) & 1 == 1 for v in range(n)]
    total = sum(bits[v] * costs[v] for v in range(n))
    valid = np.ones(1 << n, dtype=bool)
    for v in clobbered - needed:
        valid &= ~bits[v]
    have = []
    for v in range(n):
        recomputable = np.full(1 << n, not pinned[v])
        for u in inputs[v]:
            recomputable &= have[u]
        have.append(bits[v] | recomputable)
    for v in needed:
        valid &= have[v]
    return total, valid


@settings(max_examples=200, deadline=None)
@given(specs())
def test_mincut_matches_brute_force(spec):
    graph, names = build(spec)
    result = mincut(graph)
    total, valid = brute_force(spec)
    best = int(total[valid].min())
    assert result.cut_cost_bytes == best
    assert cut_cost(graph, result.saved) == best
    # inputs that the forward never reads and backward does not need are no values of the graph
    read = {u for _, inputs, _ in spec.ops for u in inputs} | {v for v, ran in spec.saved if ran}
    unknown = sum(1 << v for v in range(len(spec.input_bytes)) if v not in read)
    known = (np.arange(len(total)) & unknown) == 0
    # the brute-force optimum is a valid cut by cut_cost too, at the same price
    mask = int(np.flatnonzero(known & valid & (total == best))[0])
    assert cut_cost(graph, [names[v] for v in range(len(names)) if mask >> v & 1]) == best
    # cut_cost agrees with the brute force on some other subsets
    for mask in np.flatnonzero(known)[:: max(1, int(known.sum()) // 16)]:
        chosen = [names[v] for v in range(len(names)) if mask >> v & 1]
        assert cut_cost(graph, chosen) == (int(total[mask]) if valid[mask] else None)
    # (c) random ops are never recomputed
    assert not any(name.startswith("dropout") for name in result.recomputed)


def test_random_op_is_saved_not_recomputed():
    """x -> mul -> dropout -> cos, autograd saving cos's input and dropout's mask. Recomputing
    everything from x would cost 1 x 100 B; dropout must instead be saved: its mask (2 x 25 B) and
    its result (2 x 100 B)."""
    spec = Spec(
        input_bytes=(100,),
        ops=(
            ("pointwise", (0,), (100,)),
            ("dropout", (1,), (100, 25)),
            ("pointwise", (2,), (100,)),
        ),
        saved=((2, True), (3, True)),  # dropout's result (cos's input) and mask
    )
    graph, _ = build(spec)
    result = mincut(graph)
    assert result.saved == ("dropout_1:0", "dropout_1:1")
    assert result.cut_cost_bytes == 250
    assert result.recomputed == ()
    assert cut_cost(graph, ["input:0"]) is None


def test_value_overwritten_in_place_is_not_saved():
    """a = f(x); y = g(a); a.add_(1); z = h(a). Backward needs y and z. Saving `a` (2 x 10 B) would
    be cheapest, but add_ overwrote it: save y and the updated `a` instead."""
    spec = Spec(
        input_bytes=(1000,),
        ops=(
            ("pointwise", (0,), (10,)),
            ("pointwise", (1,), (100,)),
            ("inplace", (1,), (10,)),
            ("pointwise", (3,), (100,)),
        ),
        saved=((2, True), (4, True)),
    )
    graph, _ = build(spec)
    assert cut_cost(graph, ["pointwise_0"]) is None
    result = mincut(graph)
    assert result.saved == ("pointwise_1", "inplace_2")
    assert result.cut_cost_bytes == 220
    assert result.recomputed == ("pointwise_3",)


def test_unsaved_backward_node_needs_nothing():
    spec = Spec(input_bytes=(100,), ops=(("pointwise", (0,), (100,)),), saved=((1, False),))
    graph, _ = build(spec)
    result = mincut(graph)
    assert result.saved == () and result.recomputed == () and result.cut_cost_bytes == 0


def test_capacities_beyond_int32_are_rounded_but_cost_is_exact():
    """A chain x -> a -> b -> c with terabyte sizes that share no common factor: the flow runs on
    rounded capacities, the reported cost is the exact byte count of the cut chosen."""
    tb = 10**12
    spec = Spec(
        input_bytes=(5 * tb,),
        ops=(
            ("pointwise", (0,), (tb + 1,)),
            ("pointwise", (1,), (3 * tb + 5,)),
            ("pointwise", (2,), (2 * tb + 7,)),
        ),
        saved=((3, True),),
    )
    graph, _ = build(spec)
    result = mincut(graph)
    assert result.saved == ("pointwise_0",)
    assert result.cut_cost_bytes == 2 * (tb + 1)
    assert result.recomputed == ("pointwise_1", "pointwise_2")


def test_traced_mlp_beats_autograd_and_keeps_dropout():
    model = nn.Sequential(
        nn.Linear(64, 256), nn.GELU(), nn.Dropout(0.1), nn.Linear(256, 64), nn.ReLU(inplace=True)
    )
    graph = remat.trace(model, torch.randn(32, 64), device="cpu")
    result = mincut(graph)
    autograd = cut_cost(graph, default_save_set(graph))
    assert autograd is not None and result.cut_cost_bytes < autograd
    assert cut_cost(graph, result.saved) == result.cut_cost_bytes
    random = {op.name for op in graph.forward_ops if "bernoulli" in op.short}
    assert random and not random & set(result.recomputed)
    assert result.held_bytes <= graph.activation_bytes
    # the pure traffic model recomputes the matmuls too; banning that costs more traffic
    assert "3.addmm_0" in result.recomputed
    banned = mincut(graph, never_recompute=is_matmul)
    assert not any(is_matmul(graph.op_by_name[name]) for name in banned.recomputed)
    assert result.cut_cost_bytes < banned.cut_cost_bytes <= autograd
    assert cut_cost(graph, banned.saved, never_recompute=is_matmul) == banned.cut_cost_bytes
    assert cut_cost(graph, result.saved, never_recompute=is_matmul) is None


def large_graph(n: int = 20_000) -> Graph:
    """An `n`-op forward: a chain whose every op also reads the one two back, every 4th value
    saved."""
    ops = tuple(
        ("pointwise", (i,) if i == 0 else (i, i - 1), (4096 + (i * 7919) % 1000,)) for i in range(n)
    )
    spec = Spec(input_bytes=(4096,), ops=ops, saved=tuple((v, True) for v in range(1, n, 4)))
    return build(spec)[0]


def test_a_large_graph_s_cut_costs_what_it_says():
    # its speed (under 5 s at 20k ops) is a target in benchmarks/solver_speed.py, not a test
    graph = large_graph()
    result = mincut(graph)
    assert cut_cost(graph, result.saved) == result.cut_cost_bytes


def test_brute_force_oracle_on_the_article_shape():
    """The oracle itself, on the article's shape built by hand: 4 inputs, 3 adds, 2 cos."""
    spec = Spec(
        input_bytes=(B,) * 4,
        ops=(
            ("pointwise", (0, 1), (B,)),
            ("pointwise", (4, 2), (B,)),
            ("pointwise", (5, 3), (B,)),
            ("pointwise", (6,), (B,)),
            ("pointwise", (7,), (B,)),
        ),
        saved=((6, True), (7, True)),
    )
    total, valid = brute_force(spec)
    assert int(total[valid].min()) == 2 * B
    assert {int(m) for m in itertools.compress(range(len(total)), valid & (total == 2 * B))} == {
        1 << 6
    }


def test_a_value_that_may_be_neither_saved_nor_recomputed_is_named(article_graph):
    def is_add(op):
        return op.short == "add"

    with pytest.raises(ValueError, match="'add_2' may be neither saved nor recomputed"):
        mincut(article_graph, never_recompute=is_add, never_save=is_add)
    # banning only the save of cos(z) is fine: it is recomputed from z
    result = mincut(article_graph, never_save=lambda op: op.short == "cos")
    assert result.saved == ("add_2",)
