"""The loop options of `fit` / `estimate` that move the peak (`remat.prediction.loop`): the
logits kept through backward, the chunked loss; each changes the traced step by exactly the
tensor it names."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import remat
from remat import models
from remat.answers.cli import main
from remat.device.gpus import get_gpu
from remat.errors import RematError
from remat.prediction.gpu_memory import Fsdp, gpu_memory
from remat.prediction.loop import Loop


class _Pred(nn.Module):
    """torchtitan's model of March 2024: `output = self.output(h).float()`."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens).float()


def _tiny_llama():
    return models.build("llama-2-7b", batch=2, seq=64, dtype="bf16", tiny=True)


def test_kept_logits_are_the_graph_of_a_loop_that_holds_its_prediction():
    """--keep-logits on the model's own loss gives, byte for byte, the step of a loop that
    computes the loss outside and keeps `pred` referenced through `backward()` (traced as such),
    alone and under FSDP's per-rank allocator walk (the labels aside, which the loop's loss
    holds as a constant)."""
    model, (tokens, labels) = _tiny_llama()
    own = remat.trace(model, tokens, labels, target="cuda")
    target = torch.zeros(labels.shape, dtype=torch.long)
    held = remat.trace(
        _Pred(model),
        tokens,
        loss_fn=lambda p: nn.functional.cross_entropy(p.flatten(0, 1), target.flatten(0, 1)),
        target="cuda",
    )
    kept = Loop(keep_logits=True).apply(own)
    assert kept.info["keep_logits"] and not own.info.get("keep_logits")
    gpu = get_gpu("h100")
    assert gpu_memory(kept, gpu).allocated_bytes > gpu_memory(own, gpu).allocated_bytes
    for fsdp in (None, Fsdp(8, 2)):
        a = gpu_memory(kept, gpu, (), "adamw", fsdp=fsdp)
        b = gpu_memory(held, gpu, (), "adamw", fsdp=fsdp)
        assert (a.allocated_bytes, a.reserved_bytes) == (b.allocated_bytes, b.reserved_bytes)


def _estimate(capsys, *flags: str) -> dict:
    """`remat estimate`'s JSON answer, less its timing."""
    argv = ["estimate", "--model", "llama-2-7b", "--tiny", "--batch", "2", "--seq", "128"]
    assert main([*argv, "--dtype", "bf16", "--json", *flags]) == 0
    answer = json.loads(capsys.readouterr().out)
    answer.pop("trace_seconds")
    return answer


def test_keep_logits_raises_the_peak_by_the_fp32_logits(capsys):
    """The tiny llama's fp32 logits, 2 x 128 x 512 x 4 bytes, live through the backward: the
    peak (at the backward's start, where they were freed before) grows by exactly them."""
    freed, kept = _estimate(capsys), _estimate(capsys, "--keep-logits")
    assert kept["peak_bytes"] - freed["peak_bytes"] == 2 * 128 * 512 * 4


def test_loss_chunks_is_the_models_chunked_loss(capsys):
    """--loss-chunks N is the preset's `loss_chunks=N`, the same step as --set gives."""
    chunked = _estimate(capsys, "--loss-chunks", "4")
    assert chunked["peak_bytes"] < _estimate(capsys)["peak_bytes"]
    assert chunked == _estimate(capsys, "--set", "loss_chunks=4")
    with pytest.raises(RematError, match="computes its own loss"):
        models.loss_chunks_overrides("hf:gpt2", 4)
    with pytest.raises(RematError, match="computes its loss whole"):
        models.loss_chunks_overrides("gpt2", 4)


def test_keep_logits_refuses_a_step_without_a_cross_entropy():
    graph = remat.trace(nn.Linear(4, 4), torch.randn(2, 4))
    with pytest.raises(RematError, match="no log-softmax"):
        Loop(keep_logits=True).apply(graph)
