"""The optimizers people use, sized as their libraries allocate them: bitsandbytes' and torchao's
block-wise quantized AdamW moments (scales per block, a minimum size below which moments stay
unquantized, per FSDP rank's local tensor for torchao), paged moments reported apart from the
allocator's, torchao's CPU-offload optimizer holding nothing on the GPU. The expected bytes are
worked out by hand from each library's rules (remat.prediction.optimizer_state)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import remat
from remat.errors import RematError
from remat.prediction.estimate import estimate
from remat.prediction.gpu_memory import gpu_memory


def _graph(out_features: int = 64):
    """fp32 Linear(64, 64) (weight 4096 elements: quantized; bias 64: not) and
    Linear(64, out_features)."""
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, out_features))
    return remat.trace(model, torch.randn(4, 64), target="cuda:sm90")


# Per parameter, two moments. Weight 4096 elements; bias 64; second layer weight 4096, bias 64.
BNB = 2 * (4096 + 16 * 4) * 2 + 2 * 64 * 4 * 2 + 2 * 256 * 4  # uint8 + absmax; fp32 small; maps
TORCHAO_8 = 2 * (4096 + 16 * 4 + 256 * 4) * 2 + 2 * 64 * 4 * 2  # + its own map; small: fp32 param
TORCHAO_4 = 2 * (2048 + 32 * 4 + 16 * 4) * 2 + 2 * 64 * 4 * 2


@pytest.mark.parametrize(
    ("optimizer", "state"),
    [
        ("adamw-8bit", BNB),
        ("adamw-8bit-torchao", TORCHAO_8),
        ("adamw-4bit", TORCHAO_4),
        ("adamw-cpu-offload", 0),
        ("adamw", 2 * 4 * (2 * 4096 + 2 * 64)),
    ],
)
def test_optimizer_state_is_sized_per_tensor_as_the_library_allocates_it(optimizer, state):
    graph = _graph()
    est = estimate(graph, optimizer)
    assert est.optimizer_state_bytes == state
    # the caching allocator's walk allocates the same state, tensor by tensor
    memory = gpu_memory(graph, "h100", optimizer=optimizer)
    assert memory.requested_bytes - memory.blas_workspace_bytes == est.peak_bytes


def test_torchao_quantizes_a_ranks_local_shard_only_from_4096_elements():
    """Under FSDP2 over 2 ranks a 4096-element weight is 2048 elements a rank: torchao keeps its
    moments in the parameter's dtype (fp32 here), bitsandbytes' rule is not per rank."""
    graph = _graph()
    sharded = estimate(graph, "adamw-8bit-torchao", shard=2).optimizer_state_bytes
    assert sharded == 2 * (2048 * 4) * 2 + 2 * 32 * 4 * 2


def test_paged_moments_are_reported_apart_from_the_allocators():
    """PagedAdamW8bit: a moment of 100,000 elements or more lives in unified memory (Linear(64,
    2048): 131,072 elements), outside the caching allocator and the peak."""
    graph = _graph(out_features=2048)
    plain, paged = estimate(graph, "adamw-8bit"), estimate(graph, "adamw-8bit-paged")
    big = 2 * (131072 + 512 * 4)
    assert paged.paged_optimizer_state_bytes == big
    assert paged.optimizer_state_bytes == plain.optimizer_state_bytes - big
    assert paged.peak_bytes == plain.peak_bytes - big


def test_optimizer_in_backward_frees_each_gradient_after_its_own_step():
    """torchtune's optimizer_in_bwd: a layer's gradients are freed once accumulated (and stepped),
    so at the first layer's backward only its own gradients live, not every layer's. Four fp32
    Linear(256, 256) layers, batch 2, fused AdamW (no step transient): the peak falls by the
    three other layers' gradients, and the allocator's walk agrees with the live bytes."""
    from remat.prediction.loop import optimizer_in_backward

    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])
    graph = remat.trace(model, torch.randn(2, 256), target="cuda:sm90")
    layer_grads = (256 * 256 + 256) * 4
    plain = estimate(graph, "adamw-fused")
    stepped = optimizer_in_backward(graph)
    in_bwd = estimate(stepped, "adamw-fused")
    at = max(dict(plain.timeline), key=dict(plain.timeline).get)  # the first layer's backward
    assert dict(plain.timeline)[at] - dict(in_bwd.timeline)[at] == 3 * layer_grads
    assert in_bwd.peak_bytes < plain.peak_bytes
    assert in_bwd.optimizer_state_bytes == plain.optimizer_state_bytes  # the state stays
    memory = gpu_memory(stepped, "h100", optimizer="adamw-fused")
    assert memory.requested_bytes - memory.blas_workspace_bytes == in_bwd.peak_bytes


def test_fit_takes_the_optimizer_in_backward_on_one_rank(capsys):
    import json

    from remat.answers.cli import main

    argv = ["fit", "--model", "mlp-chain-4", "--batch", "2", "--seq", "8", "--json"]
    assert main([*argv, "--optimizer", "adamw-fused"]) == 0
    plain = json.loads(capsys.readouterr().out)["rows"][0]
    assert main([*argv, "--optimizer", "adamw-fused", "--optimizer-in-backward"]) == 0
    stepped_report = json.loads(capsys.readouterr().out)
    stepped = stepped_report["rows"][0]
    assert stepped_report["loop"] == "optimizer in backward"
    assert stepped["requested_bytes"] < plain["requested_bytes"]
    assert main([*argv, "--optimizer", "adamw-fused", "--grad-accumulation", "4"]) == 0
    kept = json.loads(capsys.readouterr().out)
    assert kept["loop"] == "gradients kept between steps"
    assert kept["rows"][0]["requested_bytes"] > plain["requested_bytes"]
    assert main([*argv, "--optimizer-in-backward", "--shard", "2"]) == 2


def test_kept_gradients_live_through_the_step_as_the_allocator_walk_keeps_them():
    """zero_grad(set_to_none=False) or a later micro-step of gradient accumulation: the kept
    gradients exist from the start, each backward gradient a temporary added into them. The live
    bytes of the loop's graph equal the allocator walk's with its own keep_grads events (what
    benchmarks/published.py uses for Hugging Face's 2022 rows), and exceed the plain step's by
    what the kept gradients add at the plain step's peak."""
    from remat.prediction.loop import Loop

    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])
    graph = remat.trace(model, torch.randn(2, 256), target="cuda:sm90")
    kept = Loop(keep_grads=True).apply(graph)
    walk = gpu_memory(graph, "h100", optimizer="adamw-fused", keep_grads=True)
    est = estimate(kept, "adamw-fused")
    assert est.peak_bytes == walk.requested_bytes - walk.blas_workspace_bytes
    assert est.grad_bytes == graph.grad_bytes  # the kept gradients, counted once
    assert est.peak_bytes > estimate(graph, "adamw-fused").peak_bytes
    with pytest.raises(RematError, match="choose one"):
        Loop(keep_grads=True, optimizer_in_backward=True)
