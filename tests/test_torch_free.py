"""The graph side of remat (IR, cost model, estimator, schedules, plans, solvers, strategies) imports
no torch: a saved graph can be estimated and planned on a machine without it.

`import remat` itself imports torch (the tracer and `apply` live in `remat/__init__.py`), so the
child process registers a bare `remat` package, with `__path__` pointing at the source directory,
before it imports any submodule: `remat/__init__.py` never runs there.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import remat

REMAT_DIR = Path(remat.__file__).parent

CORE_MODULES = [
    "remat.graph",
    "remat.device.gpus",
    "remat.prediction.sizes",
    "remat.device.cost",
    "remat.prediction.estimate",
    "remat.prediction.schedule",
    "remat.device.targets",
    "remat.device.allocator",
    "remat.prediction.gpu_memory",
    "remat.units",
    "remat.errors",
]

# Runs in the child. Torch is made unimportable twice over: `sys.modules["torch"] = None` makes
# `import torch` (and `import torch.x`) raise, and the finder refuses any `torch*` name that a
# module might import after deleting that entry. Prints one JSON object on its last line.
_PRELUDE = textwrap.dedent(
    """
    import importlib, importlib.abc, json, pkgutil, sys, traceback, types

    class _NoTorch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("torch", "functorch", "torchvision", "torchaudio"):
                raise ImportError(f"torch is not importable in this test ({name})")
            return None

    sys.meta_path.insert(0, _NoTorch())
    sys.modules["torch"] = None

    remat = types.ModuleType("remat")
    remat.__path__ = [REMAT_DIR]
    remat.__file__ = None
    sys.modules["remat"] = remat

    def try_import(name):
        try:
            importlib.import_module(name)
            return None
        except BaseException:
            return traceback.format_exc()
    """
)


def _run_torch_free(body: str, **values: object) -> dict:
    """Run `body` after the prelude in a fresh interpreter without torch; `values` are bound as
    globals (by repr). Returns the JSON object the child prints last."""
    assigns = "".join(f"{k} = {v!r}\n" for k, v in {"REMAT_DIR": str(REMAT_DIR), **values}.items())
    code = assigns + _PRELUDE + textwrap.dedent(body)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"child failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _planning_modules() -> list[str]:
    """Every module of the planning stage (`remat/planning/`, strategies and solvers included),
    which is torch-free as a whole."""
    folder = REMAT_DIR / "planning"
    names = []
    for path in sorted(folder.rglob("*.py")):
        parts = list(path.relative_to(REMAT_DIR.parent).with_suffix("").parts)
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def test_core_modules_import_without_torch():
    modules = CORE_MODULES + _planning_modules()
    result = _run_torch_free(
        """
        failures = {name: try_import(name) for name in MODULES}
        failures = {k: v for k, v in failures.items() if v is not None}
        print(json.dumps({
            "failures": failures,
            "torch_loaded": sys.modules.get("torch") is not None,
            "init_ran": hasattr(sys.modules["remat"], "trace"),
        }))
        """,
        MODULES=modules,
    )
    assert not result["failures"], "\n\n".join(
        f"{name} needs torch:\n{tb}" for name, tb in result["failures"].items()
    )
    assert not result["torch_loaded"]
    assert not result["init_ran"]


def test_the_planning_stage_is_checked_whole():
    """Guards the test above: the planner, the registry, every strategy and solver are in it."""
    found = _planning_modules()
    for name in ("planner", "joint", "strategies", "strategies.milp", "solvers.mincut"):
        assert f"remat.planning.{name}" in found
    assert len(found) > 15


def test_saved_graph_estimates_and_prices_the_same_without_torch(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)
    )
    graph = remat.trace(model, torch.randn(16, 32))
    path = tmp_path / "graph.json"
    path.write_text(graph.to_json())
    est = remat.estimate(graph, "adamw")
    from remat.device.cost import op_seconds_all

    seconds = op_seconds_all(graph, "h100")

    result = _run_torch_free(
        """
        from remat.device.cost import op_seconds_all
        from remat.prediction.estimate import estimate
        from remat.graph import Graph

        with open(GRAPH_PATH) as f:
            graph = Graph.from_json(f.read())
        est = estimate(graph, "adamw")
        print(json.dumps({
            "ops": len(graph.ops),
            "peak_bytes": est.peak_bytes,
            "activation_bytes": est.activation_bytes,
            "seconds": op_seconds_all(graph, "h100"),
            "torch_loaded": sys.modules.get("torch") is not None,
        }))
        """,
        GRAPH_PATH=str(path),
    )
    assert not result["torch_loaded"]
    assert result["ops"] == len(graph.ops)
    assert result["peak_bytes"] == est.peak_bytes > 0
    assert result["activation_bytes"] == est.activation_bytes > 0
    assert result["seconds"] == pytest.approx(seconds)
