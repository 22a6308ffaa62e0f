"""Depth replication (`remat.tracing.depth`): a few repeated blocks traced, the full depth laid out,
the graph equal to the full trace's to the byte (every id, op, save and module call), so that
every answer drawn from it is too; and the full trace, said why, where blocks do not repeat."""

from __future__ import annotations

import json
import types
import warnings

import pytest
import torch
from torch import nn

from remat.models import build
from remat.tracing.depth import block_kinds, find_period
from remat.tracing.replicate import UNITS
from remat.tracing.trace import trace


def _both(model: nn.Module, *args, **kwargs):
    """(replicated, full) traces of one step, `depth` left out of the replicated graph's info."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # HF's use_cache note
        full = trace(model, *args, **kwargs)
        replicated = trace(model, *args, replicate_depth=True, **kwargs)
    depth = replicated.info.pop("depth")
    return replicated, full, depth


def _assert_same_graph(model: nn.Module, *args, **kwargs) -> dict:
    replicated, full, depth = _both(model, *args, **kwargs)
    assert depth["traced"] == "replicated", depth
    assert json.loads(replicated.to_json()) == json.loads(full.to_json())
    return depth


@pytest.mark.slow
def test_estimate_plans_and_allocator_equal_on_replicated_and_full_traces():
    """The planner's estimate, each fixed strategy's plan and the caching allocator's requested,
    allocated and reserved bytes under it, on both graphs."""
    from remat.device.gpus import get_gpu
    from remat.planning import strategies
    from remat.planning.planner import Planner
    from remat.prediction.gpu_memory import gpu_memory

    gpu = get_gpu("h100")
    model, inputs = build("llama-3.1-8b", tiny=True, batch=2, seq=32, n_layers=8)
    replicated, full, _ = _both(model, *inputs, target=gpu.target)
    answers = []
    for graph in (replicated, full):
        planner = Planner(graph, gpu.profile, "adamw")
        plans = [
            planner.solve(s, planner.estimate.peak_bytes)
            for s in strategies.available("eager")
            if s.appliable and not s.budgeted
        ]
        memories = [gpu_memory(graph, gpu, p.regions, "adamw") for p in plans]
        answers.append(
            (
                planner.estimate,
                [
                    (p.strategy, p.predicted_peak_bytes, p.recompute_seconds, p.regions)
                    for p in plans
                ],
                [(m.requested_bytes, m.allocated_bytes, m.reserved_bytes) for m in memories],
            )
        )
    assert answers[0] == answers[1]
    assert len(answers[0][1]) >= 3


@pytest.mark.parametrize(
    ("name", "layers"),
    [
        ("llama-3.1-8b", {"n_layers": 7}),
        ("llama-3.1-8b", {"n_layers": 10}),
        ("gpt2", {"n_layer": 9}),
    ],
)
def test_zoo_graph_replicated_from_six_blocks_equals_full_trace(name, layers):
    model, inputs = build(name, tiny=True, batch=2, seq=16, **layers)
    depth = _assert_same_graph(model, *inputs)
    (stack,) = depth["stacks"].values()
    assert stack["traced"] == UNITS and stack["period"] == 1


@pytest.mark.slow
def test_mixtral_style_moe_replicated_equals_full_trace():
    pytest.importorskip("transformers")
    model, inputs = build("hf:mixtral", tiny=True, batch=2, seq=16, num_hidden_layers=8)
    _assert_same_graph(model, *inputs)


@pytest.mark.slow
def test_alternating_local_global_layers_replicated_by_period_of_two():
    pytest.importorskip("transformers")
    model, inputs = build("hf:gemma2", tiny=True, batch=1, seq=16, num_hidden_layers=14)
    depth = _assert_same_graph(model, *inputs)
    (stack,) = depth["stacks"].values()
    assert stack["period"] == 2 and stack["traced"] == 2 * UNITS


@pytest.mark.slow
def test_t5_encoder_and_decoder_stacks_replicated_equal_full_trace():
    transformers = pytest.importorskip("transformers")
    config = transformers.T5Config(
        vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=9, num_decoder_layers=10,
        num_heads=4, dropout_rate=0.0, decoder_start_token_id=0, use_cache=False,
    )  # fmt: skip
    with torch.device("meta"):
        model = transformers.T5ForConditionalGeneration(config)
    ids, labels = torch.zeros(2, 16, dtype=torch.long), torch.zeros(2, 12, dtype=torch.long)
    depth = _assert_same_graph(model, input_ids=ids, labels=labels, loss_fn=lambda out: out.loss)
    # block 0 holds the relative position bias every other block reads: outside the period
    assert {p: s["start"] for p, s in depth["stacks"].items()} == {
        "encoder.block": 1,
        "decoder.block": 1,
    }


class _Block(nn.Module):
    def __init__(self, width: int, extra: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.options = types.SimpleNamespace(extra=extra)  # compared by type, not by value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.linear(x))
        return y * 2 if self.options.extra else y


class _Stack(nn.Module):
    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_blocks_from_the_first_op_on_replicated_equal_full_trace():
    """No op before the first block: the model's own call starts in the first unit."""
    _assert_same_graph(_Stack([_Block(8, extra=False) for _ in range(9)]), torch.randn(2, 8))


@pytest.mark.parametrize("odd", [2, 3])
def test_blocks_alike_as_built_but_not_as_traced_are_traced_in_full(odd):
    model = _Stack([_Block(8, extra=i == odd) for i in range(9)])
    replicated, full, depth = _both(model, torch.randn(2, 8))
    assert depth["traced"] == "full" and "differ" in depth["reason"]
    assert replicated.to_json() == full.to_json()


def test_a_block_built_differently_is_outside_the_period_or_traced_in_full():
    model = _Stack([_Block(8, extra=False) for _ in range(9)])
    model.layers[7].linear = nn.Linear(8, 8, bias=False)
    replicated, full, depth = _both(model, torch.randn(2, 8))
    assert depth["traced"] == "full" and "do not repeat" in depth["reason"]
    assert replicated.to_json() == full.to_json()


def test_period_found_after_differing_first_blocks_and_in_alternation():
    assert find_period([0, 1, 1, 1, 1, 1, 1, 1, 1]) == (1, 1)
    assert find_period([0, 1] * 7) == (0, 2)
    assert find_period([0] * UNITS) is None  # no fewer blocks to trace
    assert find_period([0, 1, 2, 3, 4, 5, 6, 7, 8]) is None


def test_index_like_attributes_do_not_make_blocks_differ():
    blocks = [nn.Linear(4, 4) for _ in range(3)]
    for i, b in enumerate(blocks):
        b.layer_idx = i
    blocks[2].window = 7
    assert block_kinds(blocks[:2]) == [0, 0]
    assert block_kinds(blocks) == [0, 0, 1]


@pytest.mark.slow
def test_fit_rows_equal_on_replicated_and_full_traces():
    """Every answer `fit` gives (each strategy's peak, plan, allocator bytes, max batch and
    sequence, advice) is the same whether its steps were replicated or traced in full."""
    from remat.answers.fit import fit
    from remat.device.gpus import custom_gpu

    def build_llama(batch: int, seq: int):
        return build("llama-3.1-8b", tiny=True, n_layers=7, batch=batch, seq=seq)

    reports = [
        fit(
            build_llama,
            model="llama",
            batch=2,
            seq=64,
            gpu=custom_gpu(1 << 30, "h100"),
            precision="fp32",
            optimizer="adamw",
            max_batch=16,
            max_seq=256,
            full_trace=full,
        )  # fmt: skip
        for full in (False, True)
    ]
    replicated, full = (r.to_dict() for r in reports)
    for d in (replicated, full):
        d.pop("seconds")
    assert replicated["extra"].pop("depth")["traced"] == "replicated"
    assert "depth" not in full["extra"]
    assert replicated == full
    assert any(row["max_batch"] for row in full["rows"])  # the searches ran


@pytest.mark.slow
def test_pipeline_stages_replicated_equal_their_full_traces():
    """A stage's blocks are an nn.ModuleDict named by their indices in the model (`layers.8`..):
    each stage's graph, and so every rank's walk, is the full trace's."""
    from remat.layouts.pipeline_traced import TracedPipeline

    def build_llama(batch: int, seq: int):
        return build("llama-3.1-8b", tiny=True, n_layers=16, batch=batch, seq=seq)

    replicated, full = (
        TracedPipeline.of(build_llama, 2, 32, stages=2, microbatches=2, replicate_depth=r)
        for r in (True, False)
    )
    for a, b in zip(replicated.traced, full.traced, strict=True):
        assert a.graph.info.pop("depth")["traced"] == "replicated"
        assert a.graph.to_json() == b.graph.to_json()


class _ByConfiguredDepth(_Stack):
    """Loops over the depth it was built with, not over its list: a cut list cannot run."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(9):
            x = self.layers[i](x)
        return x


def test_a_model_that_cannot_run_cut_is_traced_in_full():
    model = _ByConfiguredDepth([_Block(8, extra=False) for _ in range(9)])
    replicated, full, depth = _both(model, torch.randn(2, 8))
    assert depth["traced"] == "full" and "does not run" in depth["reason"]
    assert replicated.to_json() == full.to_json()


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [{"tp": 2}, {"cp": 2}])
def test_tensor_and_context_parallel_ranks_replicated_equal_full_trace(ranks):
    """One rank's step under tensor parallelism (DTensor shards, collectives) or context
    parallelism (torch's ring attention on a CUDA target)."""
    from remat.device.gpus import get_gpu
    from remat.layouts.parallel import Layout

    def build_llama(batch: int, seq: int):
        return build("llama-3.1-8b", tiny=True, n_layers=8, batch=batch, seq=seq)

    layout, target = Layout(**ranks), get_gpu("h100").target
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        replicated = layout.trace(build_llama, 2, 32, target=target, replicate_depth=True)
        full = layout.trace(build_llama, 2, 32, target=target)
    assert replicated.info.pop("depth")["traced"] == "replicated"
    assert replicated.to_json() == full.to_json()
