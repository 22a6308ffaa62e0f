"""The stage folders' rules, read from the source tree: a stage imports only the stages below it
(type-checking and function-level imports included), modules import each other in no circle, a
name one module imports from another is public (no leading underscore), and no module grows past
~800 lines (docs/architecture.md)."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
from scipy.sparse import coo_matrix
from scipy.sparse.csgraph import connected_components

SRC = Path(__file__).resolve().parents[1] / "src"

#: The stages in the order data flows; a module may import its own stage and those before it.
STAGES = (
    "base",  # remat.graph, errors, units, quiet, _moved
    "models",
    "device",
    "tracing",
    "prediction",
    "planning",
    "measuring",
    "applying",
    "layouts",
    "answers",
    "integrations",
    "api",  # remat/__init__.py, remat/__main__.py (`python -m remat`)
)
MAX_LINES = 800


def _modules() -> dict[str, Path]:
    found = {}
    for path in (SRC / "remat").rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def stage_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1 or module == "remat.__main__":
        return "api"
    return parts[1] if parts[1] in STAGES else "base"


def _resolve(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str) -> set[str]:
    """Every remat module `module` imports, wherever the import statement stands."""
    path = MODULES[module]
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + [base] * bool(base))
            names = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names
            ]
        else:
            continue
        found |= {r for n in names if n.startswith("remat") and (r := _resolve(n)) != module}
    found.discard(None)  # type: ignore[arg-type]
    return found


GRAPH = {m: imports_of(m) for m in MODULES}


def test_the_source_tree_is_read():
    # the checks below would pass on an empty tree: make sure they read the real one
    assert len(MODULES) > 50
    assert "remat.planning.planner" in GRAPH["remat.applying.eager"] | GRAPH["remat.applying.tune"]
    assert {stage_of(m) for m in MODULES} == set(STAGES)
    assert private_names_imported("remat") == []  # `from remat import _moved` is the one allowed


@pytest.mark.parametrize("module", sorted(MODULES))
def test_a_stage_imports_only_the_stages_below_it(module):
    rank = STAGES.index(stage_of(module))
    upward = sorted(m for m in GRAPH[module] if STAGES.index(stage_of(m)) > rank)
    assert not upward, f"{module} ({stage_of(module)}) imports a later stage: {upward}"


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (scipy's, on the import graph)."""
    names = sorted(set(graph) | {m for targets in graph.values() for m in targets})
    index = {name: i for i, name in enumerate(names)}
    edges = [(index[a], index[b]) for a, targets in graph.items() for b in targets]
    rows, cols = zip(*edges, strict=True) if edges else ((), ())
    matrix = coo_matrix((np.ones(len(edges)), (rows, cols)), shape=(len(names),) * 2)
    _, labels = connected_components(matrix, directed=True, connection="strong")
    members = [[n for n in names if labels[index[n]] == label] for label in set(labels)]
    return sorted(m for m in members if len(m) > 1)


def test_circles_finds_a_planted_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_itself_back():
    assert circles(GRAPH) == []


def private_names_imported(module: str) -> list[str]:
    """`_name`s that `module` imports from another remat module."""
    found = []
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("remat"):
            found += [
                f"{node.module}.{a.name}"
                for a in node.names
                if a.name.startswith("_") and not a.name.startswith("__") and a.name != "_moved"
            ]
    return found


@pytest.mark.parametrize("module", sorted(MODULES))
def test_a_name_used_by_another_module_is_public(module):
    assert not private_names_imported(module), f"{module} imports private names; make them public"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_is_over_800_lines(module):
    lines = len(MODULES[module].read_text().splitlines())
    assert lines <= MAX_LINES, f"{module}: {lines} lines; split it by what it does"
