"""benchmarks/published.py: remat's predictions of published GPU measurements, pinned in CI for two
points that need no framework beyond transformers (the whole table: docs/accuracy.md)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "published.py"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("published", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "point, source",
    [
        ("P1", "remat preset"),  # torchtitan FSDP2 x 8, full AC: peak active 22.73 GiB
        ("P1r", "remat preset"),  # the same run's peak reserved, 31.02 GiB
        ("H3", "transformers"),  # HF BERT-large with gradient checkpointing: nvidia-smi 6775 MiB
    ],
)
def test_a_published_measurement_is_predicted_within_its_tolerance(tmp_path, point, source):
    if source == "transformers":
        pytest.importorskip("transformers")
    script = _script()
    md = tmp_path / "accuracy.md"
    assert script.main(["--points", point, "--sources", source, "--md", str(md)]) == 0
    (row,) = [line for line in md.read_text().splitlines() if line.startswith(f"| {point} |")]
    ratio = float(row.split("|")[8])
    statistic = next(p.statistic for p in script.POINTS if p.id == point)
    assert abs(ratio - 1) <= script.TOLERANCE[statistic]
