"""The loss compiled on its own (`--compile blocks+loss`, as torchtitan's `--training.compile`
and torchtune's `compile_loss` do), what a compiled unit keeps of its inputs, and the optimizer
stepped in backward under compiled blocks: predicted on fake tensors against the same step
compiled and run on real CPU tensors."""

from __future__ import annotations

import copy

import pytest
import torch
from compiled_support import needs_cxx

import remat
from remat import models
from remat.errors import RematError
from remat.prediction.loop import Loop

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _llama(dtype: str, batch: int = 2, seq: int = 64):
    torch.manual_seed(0)
    return models.build(
        "llama-3.2-1b", batch=batch, seq=seq, tiny=True, vocab_size=512, dtype=dtype, device="cpu"
    )


def _compiled(model, graph, loss: bool):
    """The model as torchtitan compiles it: each block, and the loss module where `loss`."""
    model = copy.deepcopy(model)
    for b in graph.blocks:
        parent, _, name = b.path.rpartition(".")
        holder = model.get_submodule(parent)
        holder.register_module(name, torch.compile(holder.get_submodule(name), fullgraph=True))
    if loss:
        model.loss = torch.compile(model.loss, fullgraph=True)
    torch._dynamo.reset()
    return model


@needs_cxx
@pytest.mark.slow
def test_compiled_block_keeps_its_input_as_measured():
    """A compiled block keeps its input for its backward where the eager step drops it sooner
    (a bf16 block whose norm saves its fp32 upcast, not its input): predicted by blocks, that
    input was freed at the block's end, under the measured peak (2.0 GiB for F1's 32 blocks
    of 8192 x 4096 bf16). Now equal to the real compiled step to the byte."""
    model, inputs = _llama("bf16")
    graph = remat.trace(model, *inputs)
    predicted = remat.estimate_compiled(graph, model, *inputs, compile="blocks")
    assert predicted.peak_bytes == remat.measure(_compiled(model, graph, False), *inputs).peak_bytes


@needs_cxx
@pytest.mark.slow
def test_compiled_loss_peaks_where_measured():
    """A compiled loss saves the logits it is given and per-row statistics; the eager loss saved
    their fp32 log-softmax (and its backward made two more fp32 tensors): F1's peak held 11.99
    GiB of them. blocks+loss equals the real step with each block and the loss module compiled,
    to the byte, below blocks. (fp32 here: in bf16 the CPU's aten kernels under the compiled
    loss allocate scratch of their own, 20-140 KB that varies from run to run, which a GPU's
    generated kernels do not.)"""
    model, inputs = _llama("fp32")
    graph = remat.trace(model, *inputs)
    blocks = remat.estimate_compiled(graph, model, *inputs, compile="blocks")
    loss = remat.estimate_compiled(graph, model, *inputs, compile="blocks+loss")
    assert loss.peak_bytes == remat.measure(_compiled(model, graph, True), *inputs).peak_bytes
    assert loss.peak_bytes < blocks.peak_bytes
    assert loss.graphs_compiled == blocks.graphs_compiled + 1


def test_blocks_and_loss_refuses_a_loss_without_its_own_module():
    """A model that computes its loss inline (Hugging Face's loss_function, a chunked loss that
    runs the output head inside it) has no loss module to compile: refused by name."""
    model, inputs = models.build("gpt2", batch=1, seq=16, tiny=True)
    graph = remat.trace(model, *inputs)
    with pytest.raises(RematError, match=r"blocks\+loss.*loss module.*compile='blocks'"):
        remat.estimate_compiled(graph, model, *inputs, compile="blocks+loss")


@needs_cxx
@pytest.mark.slow
def test_optimizer_in_backward_under_compiled_blocks_peaks_where_measured():
    """torchtune's T5 (optimizer_in_bwd under compile) was refused: the optimizer in backward was
    an eager step's. Each parameter stepped (SGD, stateless) and its gradient dropped by a
    post-accumulate hook, blocks compiled: the prediction of the loop's graph equals the real
    step, and lies under the step that keeps every gradient."""
    model, inputs = _llama("fp32", batch=1, seq=8)  # the gradients outweigh the activations
    graph = remat.trace(model, *inputs)
    stepped = Loop(optimizer_in_backward=True).apply(graph)
    kept = remat.estimate_compiled(graph, model, *inputs, compile="blocks+loss")
    predicted = remat.estimate_compiled(stepped, model, *inputs, compile="blocks+loss")
    real = _compiled(model, graph, loss=True)

    def step_and_drop(p: torch.Tensor) -> None:
        with torch.no_grad():
            p.sub_(p.grad, alpha=1e-3)
        p.grad = None

    for p in real.parameters():
        p.register_post_accumulate_grad_hook(step_and_drop)
    assert predicted.peak_bytes == remat.measure(real, *inputs).peak_bytes
    assert predicted.peak_bytes < kept.peak_bytes


class _HalfSavedLoss(torch.nn.Module):
    """A chunked loss whose backward needs its first chunk only: cross-entropy on the first
    chunk's logits, the mean of the second's (whose gradient is a constant)."""

    def forward(self, logits: list[torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
        first, second = logits
        ce = torch.nn.functional.cross_entropy(
            first.reshape(-1, first.size(-1)), labels.chunk(2, dim=1)[0].reshape(-1)
        )
        return ce + second.mean()


@needs_cxx
@pytest.mark.slow
def test_a_compiled_loss_keeps_only_the_inputs_it_saves_of_several_alike():
    """Two logits chunks of one layout, the compiled loss saving the first only: kept by layout,
    both were held to the loss's backward (torchtune's chunked loss under torch 2.13 saves six
    of its eight bf16 chunks and two fp32 `exp`s: T3-T5 from torchtune 0.49 GiB above the real
    step). Now the unsaved chunk dies with the eager step's last use, as in the real step."""
    model, inputs = models.build(
        "llama-3.2-1b",
        batch=2,
        seq=64,
        tiny=True,
        vocab_size=2048,
        dtype="fp32",
        device="cpu",
        loss_chunks=2,
    )
    model.loss = _HalfSavedLoss()
    graph = remat.trace(model, *inputs)
    predicted = remat.estimate_compiled(graph, model, *inputs, compile="blocks+loss")
    assert predicted.peak_bytes == remat.measure(_compiled(model, graph, True), *inputs).peak_bytes
