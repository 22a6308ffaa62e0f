"""What a published run had that `remat fit` now takes as options, so that every row of
docs/accuracy.md is a CLI command: fp16 autocast (`--precision fp16-mixed`), an older torch's
autograd (`--torch-version`), the CUDA context the run measured (`--cuda-context`)."""

from __future__ import annotations

import argparse
from dataclasses import replace

import pytest
import torch

import remat
from remat import models
from remat.answers.cli.fit import gpu_of
from remat.device.gpus import fixed_memory, get_gpu
from remat.errors import RematError
from remat.prediction.gpu_memory import gpu_memory

MiB = 1024**2


def _args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"gpu": "v100-16gb", "capacity": None, **kw})


def test_cuda_context_moves_nvidia_smi_by_exactly_the_context_given():
    base = gpu_of(_args())
    given = gpu_of(_args(cuda_context="1343MiB"))
    assert fixed_memory(given).context_bytes == 1343 * MiB
    model, inputs = models.build("gpt2", batch=2, seq=64, tiny=True)
    graph = remat.trace(model, *inputs, target=base.target)
    a, b = gpu_memory(graph, base), gpu_memory(graph, given)
    assert b.reserved_bytes == a.reserved_bytes
    assert b.nvidia_smi_bytes - a.nvidia_smi_bytes == 1343 * MiB - fixed_memory(base).context_bytes


class _Scores(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.proj(x) @ x.transpose(-1, -2), dim=-1)


def test_torch_version_traces_that_torchs_autograd():
    """Under torch 1.10 softmax's autograd kept its input as well as its output
    (pytorch/pytorch#64000): its (batch, seq, seq) fp32 input is saved on top."""
    gpu = gpu_of(_args(torch_version="1.10"))
    assert gpu.target.torch_version == (1, 10)
    x = torch.randn(2, 32, 16)
    saved = [
        remat.trace(_Scores(), x, target=g.target).activation_bytes
        for g in (get_gpu("v100-16gb"), gpu)
    ]
    assert saved[1] - saved[0] == 2 * 32 * 32 * 4
    with pytest.raises(RematError, match="major.minor"):
        gpu_of(_args(torch_version="1"))


def test_fp16_mixed_is_bf16_mixed_with_fp16_autocast():
    """The same autocast op lists with a 2-byte dtype: the same bytes, fp16 tensors (on an
    H100, where both dtypes take the same SDPA kernel; a V100 has no bf16 flash attention)."""
    from remat.answers.fit_steps import PRECISIONS

    model, inputs = models.build("gpt2", batch=2, seq=64, tiny=True)
    target = get_gpu("h100").target
    graphs = {
        p: remat.trace(model, *inputs, autocast=PRECISIONS[p].autocast, target=target)
        for p in ("bf16-mixed", "fp16-mixed")
    }
    assert graphs["bf16-mixed"].activation_bytes == graphs["fp16-mixed"].activation_bytes
    assert {t.dtype for t in graphs["fp16-mixed"].tensors.values()} >= {"float16"}
    assert replace(PRECISIONS["bf16-mixed"], autocast=torch.float16) == PRECISIONS["fp16-mixed"]
