"""The allocation events of a training step (`remat.prediction.gpu_memory`) and what the GPU reports from them.

The events are checked against `remat.estimate` (their live total is its peak, to the byte) and
the reported figures against the allocator model's own rules (`tests/test_allocator.py`)."""

from __future__ import annotations

import pytest

import remat
from remat import models
from remat.device.allocator import Alloc, AllocatorSettings, Free
from remat.device.gpus import (
    BLAS_HANDLES,
    allocator_limit_bytes,
    blas_workspace_bytes,
    fixed_memory,
)
from remat.planning import strategies
from remat.prediction.estimate import estimate, param_blocks
from remat.prediction.gpu_memory import (
    ALL_GATHER_STREAM,
    REDUCE_SCATTER_STREAM,
    Fsdp,
    FsdpUnit,
    gpu_memory,
    step_events,
)


@pytest.fixture(scope="module")
def gpt2() -> remat.Graph:
    model, inputs = models.build("gpt2", batch=2, seq=32, tiny=True)
    return remat.trace(model, *inputs, target="cuda")


def _replay(events: list) -> tuple[int, int, dict[int, int]]:
    """Independent count: the peak and final live bytes of the events, and the peak per stream;
    every free matches one earlier allocation."""
    live: dict = {}
    current = peak = 0
    stream_live: dict[int, int] = {}
    stream_peak: dict[int, int] = {}
    for e in events:
        if isinstance(e, Alloc):
            assert e.key not in live, f"{e.key} allocated twice"
            live[e.key] = e
            current += e.nbytes
            stream_live[e.stream] = stream_live.get(e.stream, 0) + e.nbytes
            stream_peak[e.stream] = max(stream_peak.get(e.stream, 0), stream_live[e.stream])
            peak = max(peak, current)
        else:
            assert isinstance(e, Free) and e.key in live, f"{e.key} freed but not allocated"
            gone = live.pop(e.key)
            current -= gone.nbytes
            stream_live[gone.stream] -= gone.nbytes
    return peak, current, stream_peak


@pytest.mark.parametrize("optimizer", [None, "sgd-momentum", "adamw-foreach", "adamw-for-loop"])
def test_the_events_live_total_peaks_at_the_estimated_peak_plus_the_workspaces(gpt2, optimizer):
    events = list(step_events(gpt2, (), optimizer, blas_workspaces=[1000, 24]))
    peak, end, _ = _replay(events)
    est = estimate(gpt2, optimizer=optimizer)
    assert peak == est.peak_bytes + 1024
    # after two steps: parameters, buffers, optimizer state and the workspaces
    assert end == est.param_bytes + est.buffer_bytes + est.optimizer_state_bytes + 1024


def test_a_checkpointed_steps_events_peak_at_its_simulated_peak(gpt2):
    planner = remat.Planner(gpt2)
    plan = planner.solve(strategies.get("full"), planner.estimate.peak_bytes)
    peak, _, _ = _replay(step_events(gpt2, plan.regions))
    assert plan.regions and peak == planner.simulate(plan.regions).peak_bytes


def test_fsdp_events_put_the_all_gathers_and_gradient_shards_on_their_own_streams(gpt2):
    n = 2
    events = list(step_events(gpt2, (), "adamw-foreach", fsdp=Fsdp(n)))
    peak, end, streams = _replay(events)
    est = estimate(gpt2, optimizer="adamw-foreach", shard=n)
    # what persists per rank: parameter and state shards (and buffers)
    assert end == est.param_bytes + est.optimizer_state_bytes + est.buffer_bytes
    # the all-gather stream holds one unit's gathered parameters at a time (two in forward, a
    # gathered unit whose copy-out waits for the next one's)
    units = param_blocks(gpt2)
    by_unit: dict[str, int] = {}
    for sid, unit in units.items():
        by_unit[unit] = by_unit.get(unit, 0) + gpt2.storages[sid].nbytes
    largest_two = sum(sorted(by_unit.values())[-2:])
    assert max(by_unit.values()) <= streams[ALL_GATHER_STREAM] <= largest_two
    # the gradient shards: every gradient once, 1/n of it
    assert streams[REDUCE_SCATTER_STREAM] == pytest.approx(
        gpt2.grad_bytes / n, abs=n * len(by_unit)
    )
    assert peak < estimate(gpt2, optimizer="adamw-foreach").peak_bytes


def test_gpu_memory_reports_what_the_allocator_model_makes_of_the_events(gpt2):
    memory = gpu_memory(gpt2, "h100", optimizer="adamw-foreach")
    est = estimate(gpt2, optimizer="adamw-foreach")
    workspaces = BLAS_HANDLES * blas_workspace_bytes("h100")
    assert memory.requested_bytes == est.peak_bytes + workspaces
    assert memory.requested_bytes <= memory.allocated_bytes <= memory.reserved_bytes
    fixed = fixed_memory("h100")
    assert memory.nvidia_smi_bytes == memory.reserved_bytes + fixed.context_bytes
    assert memory.limit_bytes == allocator_limit_bytes("h100")
    assert memory.fits and not memory.out_of_memory
    expandable = gpu_memory(
        gpt2,
        "h100",
        optimizer="adamw-foreach",
        settings=AllocatorSettings(expandable_segments=True),
    )
    # the same blocks, mapped in 2 MiB (small) and 20 MiB (large) pages: the two 32 MiB BLAS
    # workspaces alone take 40 MiB each there, against exactly 32 MiB cudaMalloc'd by default
    assert expandable.allocated_bytes <= memory.allocated_bytes
    assert expandable.reserved_bytes % (2 << 20) == 0
    assert expandable.reserved_bytes >= 2 * (40 << 20)


def test_a_step_larger_than_the_gpu_is_out_of_memory():
    model, inputs = models.build("gpt2", batch=64, seq=1024, dtype="fp32")
    graph = remat.trace(model, *inputs, target="cuda")
    memory = gpu_memory(graph, "l4", optimizer="adamw")
    assert memory.out_of_memory and not memory.fits


def test_kept_gradients_are_live_from_the_start_of_the_second_step(gpt2):
    events = list(step_events(gpt2, (), None, keep_grads=True))
    peak, end, _ = _replay(events)
    est = estimate(gpt2)
    assert end == est.param_bytes + est.buffer_bytes + gpt2.grad_bytes
    assert peak > est.peak_bytes  # the kept gradients sit under the second step's forward


def test_fsdp_events_of_a_checkpointed_run_of_several_blocks_free_what_they_allocated():
    """One region over both blocks replays them both before the last one's backward, so the
    units' backward spans nest: each unit's post-backward (its reduce-scatter input freed by the
    next unit's) follows the order the backward ends, or a free came before its allocation
    (`remat fit --model gpt2 --shard 8` crashed in its batch search on such a plan)."""
    model, inputs = models.build("gpt2", batch=2, seq=32, tiny=True, n_layer=3)
    graph = remat.trace(model, *inputs, target="cuda")
    planner = remat.Planner(graph)
    regions = planner.block_regions([[0, 1, 2]])
    assert len(regions) == 1 and len(regions[0].modules) == 3
    _, end, _ = _replay(step_events(graph, regions, "adamw-foreach", fsdp=Fsdp(2)))
    plain = _replay(step_events(graph, (), "adamw-foreach", fsdp=Fsdp(2)))[1]
    assert end == plain  # the same shards and state persist


def test_fsdp_units_outside_the_blocks_are_gathered_as_torchtitan_wraps_them():
    """torchtitan (6fc499f6) wraps the embedding in an FSDP unit of its own, resharded after its
    forward, and the final norm with the output head in another, kept gathered from its forward
    to its post-backward; the root unit held both gathered from the forward's start to the
    backward's end. The embedding's gathered weight is now freed before the first block and
    gathered again in backward, the head's gathered at its forward and not again."""
    model, inputs = models.build("llama-3.1-8b", batch=1, seq=32, tiny=True, vocab_size=4096)
    graph = remat.trace(model, *inputs, target="cuda")

    def param_of(module: str) -> int:
        return next(
            graph.tensors[t].storage
            for op in graph.forward_ops
            if op.module == module
            for t in op.inputs
            if graph.storages[graph.tensors[t].storage].kind == "param"
        )

    embedding, head = param_of("embed_tokens"), param_of("lm_head")
    units = (FsdpUnit(("embed_tokens",)), FsdpUnit(("norm", "lm_head"), False))
    root = list(step_events(graph, (), "adamw-foreach", fsdp=Fsdp(2)))
    split = list(step_events(graph, (), "adamw-foreach", fsdp=Fsdp(2, units=units)))
    peak_root, end_root, _ = _replay(root)
    peak_split, end_split, _ = _replay(split)  # every free matches an allocation
    assert end_split == end_root  # the same shards and state persist
    keys = [(type(e).__name__, e.key) for e in split]
    first_block, last_block = graph.blocks[0].path, graph.blocks[-1].path
    assert keys.index(("Free", ("unsharded", 0, "fwd", embedding))) < keys.index(
        ("Alloc", ("ag", 0, "fwd", first_block))
    )
    assert ("Alloc", ("unsharded", 0, "bwd", embedding)) in keys
    assert keys.index(("Alloc", ("unsharded", 0, "fwd", head))) > keys.index(
        ("Alloc", ("ag", 0, "fwd", last_block))
    )
    assert ("Alloc", ("unsharded", 0, "bwd", head)) not in keys
    # the root unit held the embedding's gathered weight through the peak; these units do not
    assert peak_split <= peak_root - graph.storages[embedding].nbytes
