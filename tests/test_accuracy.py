"""Acceptance: the estimate from a fake-tensor trace agrees with a real CPU step, measured by code
that shares nothing with the estimator (saved-tensor hooks and the CPU allocator's own events)."""

from __future__ import annotations

import pytest
import torch

import remat
from remat import models

# Small real sizes. ResNet needs images of at least ~64 px: below that, oneDNN's fixed ~1.2 MB
# convolution scratchpad (no tensor shows it) dominates the peak of the tiny network.
SMALL = {
    "resnet50": {"batch": 4, "image_size": 96},
    "mlp-chain-16": {"batch": 8},
}
ZOO = [n for n in models.preset_names() if not n.startswith("mlp-chain")] + ["mlp-chain-16"]
HF = ["hf:gpt2", "hf:llama"]


def _compare(name: str):
    torch.manual_seed(0)
    kw = {"batch": 2, "seq": 32, **SMALL.get(name, {})}
    model, inputs = models.build(name, device="cpu", tiny=True, **kw)
    est = remat.estimate(remat.trace(model, *inputs))
    measured = remat.measure(model, *inputs)
    return est, measured


@pytest.mark.parametrize("name", ZOO + HF)
def test_estimate_matches_a_measured_cpu_step(name):
    if name.startswith("hf:"):
        pytest.importorskip("transformers")
    est, measured = _compare(name)
    assert est.activation_bytes == measured.activation_bytes
    assert est.peak_bytes == pytest.approx(measured.peak_bytes, rel=0.05)


def test_adamw_peak_matches_a_measured_cpu_step():
    torch.manual_seed(0)
    model, inputs = models.build("gpt2", batch=2, seq=32, device="cpu", tiny=True)
    est = remat.estimate(remat.trace(model, *inputs), optimizer="adamw")
    measured = remat.measure(model, *inputs, optimizer="adamw")
    assert est.peak_bytes == pytest.approx(measured.peak_bytes, rel=0.05)
