"""remat 0.4's module paths: its modules sat side by side in `src/remat/` until 0.5 put them in stage
folders. Importing an old path (`remat.eager`, `remat.solvers.mincut`, ...) gives the module at its
new home, the same object, so users' scripts and plans pickled by 0.4 keep working."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from types import ModuleType

#: Old top-level module (or package) -> its stage folder.
STAGE_OF = {
    "allocator": "device",
    "cost": "device",
    "emulate": "device",
    "gpus": "device",
    "kernel_scratch": "device",
    "targets": "device",
    "caches": "tracing",
    "draws": "tracing",
    "hfcompat": "tracing",
    "trace": "tracing",
    "compiled_estimate": "prediction",
    "estimate": "prediction",
    "gpu_memory": "prediction",
    "inductor_plan": "prediction",
    "schedule": "prediction",
    "sizes": "prediction",
    "planner": "planning",
    "plans": "planning",
    "solvers": "planning",
    "strategies": "planning",
    "measure": "measuring",
    "compiled": "applying",
    "eager": "applying",
    "tune": "applying",
    "fit_pipeline": "layouts",
    "parallel": "layouts",
    "pipeline": "layouts",
    "bench": "answers",
    "cli": "answers",
    "fit": "answers",
    "html": "answers",
    "report": "answers",
}


def new_path(old: str) -> str | None:
    """Where the module `old` (e.g. "remat.solvers.mincut") lives now; None if it did not move."""
    parts = old.split(".")
    if len(parts) < 2 or parts[0] != "remat" or parts[1] not in STAGE_OF:
        return None
    return ".".join(["remat", STAGE_OF[parts[1]], *parts[1:]])


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):  # type: ignore[no-untyped-def]
        new = new_path(fullname)
        return None if new is None else importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec) -> ModuleType:  # type: ignore[no-untyped-def]
        return importlib.import_module(new_path(spec.name))  # type: ignore[arg-type]

    def exec_module(self, module: ModuleType) -> None:
        """The module ran at its new path already."""


def install() -> None:
    """Answer old paths first: a moved package's submodules must not load a second time."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _MovedFinder())
