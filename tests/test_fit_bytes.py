"""What a fit row's bytes are, as a user compares them with torch's statistics: each present in the
JSON with the statistic it stands for, and rows that cannot contradict themselves (a row that fits
has a batch that fits), on any --gpu sized by --capacity."""

from __future__ import annotations

import json

import pytest

from remat import models
from remat.answers.fit import fit
from remat.device.gpus import fixed_memory, get_gpu, with_capacity


def _build(batch: int, seq: int):
    return models.build("llama-3.2-1b", batch=batch, seq=seq, tiny=True, dtype="bf16")


FIT = dict(
    model="llama-3.2-1b",
    batch=1,
    seq=64,
    precision="bf16-mixed",
    shard=2,
    strategies_to_fit=["store_all"],
    max_batch=8,
    max_seq=256,
)


@pytest.mark.slow
def test_a_row_that_fits_has_a_batch_that_fits_under_shard():
    """Under --shard the row's `peak_bytes` (estimate's closed form: two blocks' gathered
    parameters at every point) is above the allocator walk's requested bytes; with the limit
    between the reserved bytes and reserved + that gap, the row fits and the batch search, which
    compared `peak_bytes` with a limit counted from requested bytes, found no batch that fits."""
    row = fit(_build, gpu=get_gpu("h100"), **FIT).to_dict()["rows"][0]
    judged = row["gpu_memory"][0]
    gap = row["peak_bytes"] - (row["requested_bytes"] - judged["blas_workspace_bytes"])
    assert gap > 0
    outside = fixed_memory(get_gpu("h100"), 2).outside_allocator_bytes
    tight = with_capacity("h100", row["reserved_bytes"] + gap // 2 + outside)
    row = fit(_build, gpu=tight, **FIT).to_dict()["rows"][0]
    assert row["fits"] and row["max_batch"] is not None and row["max_batch"] >= 1


def test_capacity_composes_with_any_gpu():
    """`--gpu a100-80gb --capacity 22GiB`: the A100's architecture (its context, its BLAS
    workspaces) and cost profile with 22 GiB; it said 'unknown device profile' before."""
    from remat.answers.cli import main

    sized = with_capacity("a100-80gb", "22GiB")
    assert sized.capacity_bytes == 22 * 2**30 and sized.profile == get_gpu("a100-80gb").profile
    assert fixed_memory(sized).context_bytes == fixed_memory("a100-80gb").context_bytes
    argv = ["fit", "--model", "mlp-chain-2", "--tiny", "--gpu", "a100-80gb", "--capacity", "22GiB"]
    assert main([*argv, "--batch", "2", "--seq", "8"]) == 0


def test_fit_json_names_the_torch_statistic_of_each_byte_figure(capsys):
    from remat.answers.cli import main

    argv = ["fit", "--model", "mlp-chain-2", "--tiny", "--batch", "2", "--seq", "8", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    legend = out["bytes_legend"]
    for row in out["rows"]:
        figures = {k for k, v in row.items() if k.endswith("_bytes") and not isinstance(v, dict)}
        assert figures <= set(legend), figures - set(legend)
        assert row["active_bytes"] == row["allocated_bytes"] > 0
        assert row["requested_bytes"] <= row["allocated_bytes"] <= row["reserved_bytes"]
        assert row["nvidia_smi_bytes"] > row["reserved_bytes"]
    assert "active_bytes.all.peak" in legend["active_bytes"]


def test_context_parallel_ranks_share_fsdp_shards_as_torchtitan_meshes_them():
    """torchtitan applies fully_shard over its dp_shard_cp mesh: with --shard 2 --cp 2 each rank
    holds a quarter of the parameters, gradients and optimizer state (it held a half)."""
    from remat.layouts.parallel import Layout
    from remat.prediction.estimate import estimate

    kw = {**FIT, "shard": 2, "batch": 2, "max_batch": 2, "max_seq": 64}
    report = fit(_build, gpu=get_gpu("h100"), layout=Layout(cp=2), **kw)
    graph = report.planner.graph  # one CP rank's step: seq / 2 tokens
    row = report.rows[0]

    def peak(ranks: int) -> int:
        return estimate(graph, optimizer="adamw", shard=ranks, master_scale=1).peak_bytes

    assert row.peak_bytes == peak(4) < peak(2)


def test_fsdp_units_on_the_command_line_are_the_units_the_allocator_walks(capsys):
    """`--fsdp-unit embed_tokens --fsdp-unit norm,lm_head:keep` (torchtitan's wrapping): the row's
    requested bytes are the allocator walk of the traced step with those units, not the one
    with the embedding and the head in the root unit; a path that names no module is refused."""
    from remat.answers.cli import main
    from remat.answers.fit_steps import FitSteps
    from remat.prediction.gpu_memory import Fsdp, FsdpUnit, gpu_memories

    gpu = get_gpu("h100")
    units = (FsdpUnit(("embed_tokens",)), FsdpUnit(("norm", "lm_head"), False))

    def build(batch: int, seq: int):
        return models.build("llama-3.1-8b", batch=batch, seq=seq, tiny=True, dtype="bf16")

    steps = FitSteps(build, gpu, "bf16-fsdp", "adamw", 2, None)
    graph = steps.trace(1, 64)
    walked = {
        name: gpu_memories(graph, gpu, [], "adamw", Fsdp(2, 2, given))[0].requested_bytes
        for name, given in (("units", units), ("root", ()))
    }
    assert walked["units"] != walked["root"]
    argv = ["fit", "--model", "llama-3.1-8b", "--tiny", "--batch", "1", "--seq", "64"]
    argv += ["--gpu", "h100", "--precision", "bf16-fsdp", "--shard", "2", "--json"]
    for name, extra in (
        ("units", ["--fsdp-unit", "embed_tokens", "--fsdp-unit", "norm,lm_head:keep"]),
        ("root", []),
    ):
        assert main([*argv, *extra]) == 0
        row = next(
            r for r in json.loads(capsys.readouterr().out)["rows"] if r["strategy"] == "store_all"
        )
        assert row["requested_bytes"] == walked[name], name
    assert main([*argv, "--fsdp-unit", "output"]) == 2
    assert "'output' holds no parameter" in capsys.readouterr().err
