"""The examples run at tiny size and train exactly as without remat: the same loss at every step."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load(name: str):
    """Import examples/<name>.py (the folder is not a package)."""
    spec = importlib.util.spec_from_file_location(f"remat_example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def check(result: dict, steps: int) -> None:
    baseline, with_remat = result["baseline"], result["remat"]
    assert len(baseline) == len(with_remat) == steps
    assert all(math.isfinite(x) for x in baseline + with_remat)
    # Recomputation replays the same ops on the same inputs with the same RNG state.
    assert with_remat == pytest.approx(baseline, rel=1e-6, abs=0)
    assert result["equal"]
    assert result["plan"].regions, "the plan checkpoints nothing: the remat run tested nothing"


def test_hf_trainer():
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    result = load("hf_trainer").main(["--steps", "3", "--seq", "32"])
    check(result, 3)
    assert result["grad_norm"]["remat"] == pytest.approx(result["grad_norm"]["baseline"], rel=1e-6)


@pytest.mark.parametrize(
    "model, budget",
    [
        ("gpt2", "70%"),  # dropout on by default: the recomputation must replay the same masks
        ("llama", "0%"),  # below the floor: the example plans at the smallest feasible budget
        ("remat:gpt2", "50%"),
    ],
)
def test_train_loop(model, budget, capsys):
    if not model.startswith("remat:"):
        pytest.importorskip("transformers")
    result = load("train_loop").main(["--model", model, "--budget", budget, "--steps", "3"])
    check(result, 3)
    assert result["params_equal"], f"final parameters differ by {result['max_param_diff']:.2e}"
    if budget == "0%":
        assert "smallest feasible budget" in capsys.readouterr().out
