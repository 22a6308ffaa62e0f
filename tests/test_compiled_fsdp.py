"""A compiled step on one rank of FSDP2, as torchtitan runs its published float8 table: each
block compiled (after per-op SAC there), then `fully_shard` on each block
(`estimate_compiled(fsdp=...)`, `remat.prediction.compiled_events.blocks_step_events`)."""

from __future__ import annotations

import pytest
import torch
from compiled_support import needs_cxx

import remat
from remat import models
from remat.device.allocator import Alloc
from remat.device.gpus import get_gpu
from remat.models.float8 import convert_to_float8
from remat.prediction import compiled_estimate
from remat.prediction.gpu_memory import Fsdp

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


@needs_cxx
@pytest.mark.slow
def test_a_compiled_float8_step_under_fsdp_holds_its_shards_and_frees_what_it_gathers(
    monkeypatch,
):
    """Before, the float8 stand-in did not compile (inductor's wrapper calls `_scaled_mm.out`,
    which has no meta kernel) and a compiled step took no FSDP. Now one rank of FSDP2 x 2 over
    fp32 shards (bf16-fsdp) with float8 all-gather holds exactly its shards between steps (half
    of the fp32 parameters: the bf16 parameters' bytes), and every all-gather, unsharded
    parameter, reduce-scatter buffer and gradient shard it makes is freed."""
    torch.manual_seed(0)
    model, inputs = models.build("llama-3.2-1b", batch=1, seq=32, dtype="bf16", tiny=True)
    convert_to_float8(model, "tensorwise-all-gather")
    graph = remat.trace(model, *inputs, target=get_gpu("h100").target)
    made: list = []
    lay_out = compiled_estimate.blocks_step_events
    monkeypatch.setattr(
        compiled_estimate,
        "blocks_step_events",
        lambda *a, **k: made.extend(lay_out(*a, **k)) or made,
    )
    est = remat.estimate_compiled(
        graph,
        model,
        *inputs,
        compile="blocks",
        optimizer="adamw",
        gpu="h100",
        fsdp=Fsdp(2, master_scale=2),
    )
    assert est.gpu_memory and not est.gpu_memory[0]["out_of_memory"]
    live: dict = {}
    for e in made:
        if isinstance(e, Alloc):
            assert e.key not in live, e.key
            live[e.key] = e.nbytes
        else:
            assert live.pop(e.key, None) is not None, f"free of {e.key} before its allocation"
    params = {s.id: s.nbytes for s in graph.storages.values() if s.kind == "param"}
    held = {k for k in live if k[0] == "persistent" and k[1] in params}
    assert sum(live[k] for k in held) == sum(-(-n * 2 // 2) for n in params.values())
    left = {k[0] for k in live}
    assert left <= {"persistent", "state", "blas"}, left


@needs_cxx
@pytest.mark.slow
def test_estimate_takes_shard_with_compiled_blocks_as_fit_does(capsys):
    """`remat estimate --compile blocks --shard N` was refused (estimate had no --shard, nor
    fit's --precision) while fit's compiled row took it. Now estimate's step on one rank of
    FSDP2 x 4 over fp32 shards (bf16-fsdp) is fit's, byte for byte under both allocator
    settings: the compiled step as fit's compiled row, the eager one as its store_all row."""
    import json

    from remat.answers.cli import main
    from remat.answers.fit import fit

    setup = {"model": "llama-3.2-1b", "batch": 1, "seq": 32, "precision": "bf16-fsdp"}
    argv = ["--tiny", "--gpu", "h100", "--optimizer", "adamw", "--shard", "4"]
    argv += ["--compile", "blocks", "--ac", "selective:torchtitan", "--json"]
    for key in ("model", "batch", "seq", "precision"):
        argv += [f"--{key}", str(setup[key])]
    assert main(["estimate", *argv]) == 0
    estimated = json.loads(capsys.readouterr().out)

    def build(batch: int, seq: int):
        return models.build("llama-3.2-1b", batch=batch, seq=seq, dtype="bf16", tiny=True)

    rows = fit(
        build, **setup, gpu=get_gpu("h100"), shard=4, strategies_to_fit=("store_all",), max_batch=1, max_seq=32,
        compile="blocks", ac="selective:torchtitan", optimizer="adamw",
    ).rows  # fmt: skip
    assert estimated["shard"] == 4
    assert estimated["compiled"]["gpu_memory"] == list(rows[-1].gpu_memory)
    assert estimated["gpu_memory"] == list(rows[0].gpu_memory)
