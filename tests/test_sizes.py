"""`SizeModel`: the graph at another batch or sequence, interpolated through traced graphs, is the
graph a trace at that size gives (every op, tensor, storage and number), and the model says when it
does not hold rather than guess."""

from __future__ import annotations

import pytest
import torch

import remat
from remat import models
from remat.prediction.sizes import SizeModel, same_graph


def _graph(name: str, batch: int, seq: int, **overrides) -> remat.Graph:
    model, inputs = models.build(name, batch=batch, seq=seq, tiny=True, device="meta", **overrides)
    return remat.trace(model, *inputs, autocast=torch.bfloat16)


@pytest.mark.parametrize("name", ["gpt2", "hf:llama", "hf:bert"])
def test_the_batch_line_and_the_sequence_parabola_give_the_traced_graph(name):
    line = SizeModel.of({b: _graph(name, b, 64) for b in (2, 3)})
    assert line is not None and same_graph(line.at(7), _graph(name, 7, 64))
    parabola = SizeModel.of({s: _graph(name, 2, s) for s in (128, 192, 256)})
    assert parabola is not None and same_graph(parabola.at(448), _graph(name, 2, 448))
    assert parabola.at(192) is not None and same_graph(parabola.at(192), _graph(name, 2, 192))


def test_a_structure_that_changes_with_the_size_has_no_model():
    # Hugging Face Llama at batch 1 reshapes without copies that batch 2 needs
    assert SizeModel.of({1: _graph("hf:llama", 1, 64), 2: _graph("hf:llama", 2, 64)}) is None


def test_a_number_that_is_not_polynomial_in_the_size_is_caught():
    # the zoo Llama's rotary table given max_seq_len=128 is max(seq, 128) long: no parabola
    # through 64, 128, 192 holds (left out, the table is seq long: polynomial)
    model = SizeModel.of({s: _graph("llama-3.2-1b", 2, s, max_seq_len=128) for s in (64, 128, 192)})
    assert model is not None
    at = model.at(320)
    assert at is None or not same_graph(at, _graph("llama-3.2-1b", 2, 320, max_seq_len=128))


def test_records_equal_at_every_traced_size_are_shared_and_the_rest_made_anew():
    traced = {s: _graph("gpt2", 2, s) for s in (128, 192, 256)}
    model = SizeModel.of(traced)
    assert model is not None
    at = model.at(448)
    template = model.template
    shared = [op is old for op, old in zip(at.ops, template.ops, strict=True)]
    # an op whose FLOPs grow with the sequence is made anew; one with none is the template's
    assert any(shared) and not all(shared)
    for op, old, is_shared in zip(at.ops, template.ops, shared, strict=True):
        same = all(t.ops[op.index].flops == old.flops for t in traced.values())
        assert is_shared == same
    for s in template.storages.values():
        same = all(t.storages[s.id].nbytes == s.nbytes for t in traced.values())
        assert (at.storages[s.id] is s) == same
        assert same or s.kind not in ("param", "grad")  # parameters have no size
    assert same_graph(at, _graph("gpt2", 2, 448))
    assert same_graph(model.at(192), traced[192])  # an anchor's own numbers
