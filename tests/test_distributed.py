"""Plans compose with the engines that scale past one process: DDP and FSDP2, two CPU processes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "distributed.py"


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
@pytest.mark.parametrize("strategy", ["full", "selective:torchtitan"])
def test_gradients_under_torchrun_equal_the_single_process_run(mode, strategy):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(EXAMPLE),
            "--mode",
            mode,
            "--strategy",
            strategy,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "OK" in result.stdout


TENSOR_PARALLEL = EXAMPLE.with_name("tensor_parallel.py")


@pytest.mark.distributed
@pytest.mark.parametrize(
    "args",
    [[], ["--sequence-parallel", "--strategy", "auto"], ["--strategy", "full"]],
    ids=["tp-selective", "tp-sp-auto", "tp-full"],
)
def test_tensor_parallel_ranks_peak_as_predicted_and_gradients_equal_the_single_process(args):
    """Each of two gloo ranks of a tensor-parallel Llama: its measured peak within 2% of its own
    fake-tensor trace's prediction, before and after a plan, and gradients equal to one process."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(TENSOR_PARALLEL),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "OK" in result.stdout
