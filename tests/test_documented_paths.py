"""Every `remat...` name the README, docs/ and examples/ point a user at resolves, and so does every
one remat 0.4 documented before its modules moved into stage folders (remat/_moved.py)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

import remat
from remat import _moved

ROOT = Path(__file__).resolve().parents[1]

#: What remat 0.4's README and docs told users to import ("module:name" for `from module import
#: name`), from the flat layout; each must still resolve.
DOCUMENTED_IN_0_4 = (
    "remat.bench.gradients",
    "remat.compiled.plans_of",
    "remat.cost.fused_op_seconds_all",
    "remat.estimate.shard_step",
    "remat.gpus.fixed_memory",
    "remat.gpus.get_gpu",
    "remat.gpus.usable_bytes",
    "remat.kernel_scratch.gloo_collective_scratch_bytes",
    "remat.measure.calibrate_profile",
    "remat.measure.cpu_peak_bytes",
    "remat.measure:cpu_peak_bytes",
    "remat.parallel.fake_ranks",
    "remat.parallel.fsdp_sharded_as_bare",
    "remat.parallel:fake_ranks",
    "remat.parallel:tensor_parallel",
    "remat.pipeline.Sharding",
    "remat.pipeline.predict",
    "remat.pipeline.rank_events",
    "remat.pipeline.split",
    "remat.schedule.simulate",
    "remat.sizes.SizeModel",
    "remat.strategies.available",
    "remat.strategies:Strategy",
    "remat.strategies:register",
    "remat.targets.cuda",
    "remat.cli:main",
    "remat.eager:apply",
    "remat.solvers.mincut:mincut",
)


def documented_references(root: Path = ROOT) -> set[str]:
    """`from remat.x import a` as "remat.x:a", `import remat.x`, and every dotted `remat.a.b` in the
    README, docs/*.md and examples/*.py."""
    found = set()
    for path in [
        root / "README.md",
        *(root / "docs").glob("*.md"),
        *(root / "examples").glob("*.py"),
    ]:
        text = path.read_text()
        for m in re.finditer(r"^\s*from (remat(?:\.\w+)*) import (\([^)]*\)|[^\n#]+)", text, re.M):
            names = re.sub(r"#[^\n]*", "", m.group(2)).strip("()").replace("\n", " ").split(",")
            found |= {f"{m.group(1)}:{n.split(' as ')[0].strip()}" for n in names if n.strip()}
        found |= set(re.findall(r"\bimport (remat(?:\.\w+)+)", text))
        found |= set(re.findall(r"(?<![\w/.])(remat(?:\.[A-Za-z_]\w*)+)", text))
    return found


def resolve(reference: str) -> object:
    """The object a reference names: the longest importable module prefix, then attributes."""
    if ":" in reference:  # `from module import name`: an attribute, else a submodule
        module, name = reference.split(":")
        found = importlib.import_module(module)
        if not hasattr(found, name):
            importlib.import_module(f"{module}.{name}")
        return getattr(found, name)
    parts = reference.split(".")
    for i in range(len(parts), 0, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[i:]:
            found = getattr(found, attribute)
        return found
    raise ModuleNotFoundError(reference)


DOCUMENTED = sorted(documented_references())


def test_the_docs_are_read():
    assert len(DOCUMENTED) > 60
    assert "remat.integrations.hf:RematCallback" in DOCUMENTED


@pytest.mark.parametrize("reference", DOCUMENTED)
def test_a_documented_name_resolves(reference):
    resolve(reference)


@pytest.mark.parametrize("reference", DOCUMENTED_IN_0_4)
def test_a_name_documented_by_0_4_still_resolves(reference):
    resolve(reference)


@pytest.mark.parametrize("old", sorted(_moved.STAGE_OF))
def test_an_old_module_path_is_the_moved_module(old):
    new = importlib.import_module(_moved.new_path(f"remat.{old}"))
    assert importlib.import_module(f"remat.{old}") is new


def test_old_paths_leave_remat_s_functions_alone():
    import remat.estimate
    import remat.measure
    import remat.trace  # noqa: F401

    assert callable(remat.trace) and callable(remat.estimate) and callable(remat.measure)
    assert remat.strategies is importlib.import_module("remat.planning.strategies")


def test_a_moved_package_s_submodule_loads_once():
    import remat.solvers.mincut as old

    import remat.planning.solvers.mincut as new

    assert old is new


@pytest.mark.parametrize("name", remat.__all__)
def test_the_public_api_resolves(name):
    assert getattr(remat, name) is not None


def test_a_plan_pickled_under_0_4_s_module_path_loads():
    """A 0.4 pickle names `remat.plans.Plan`; it loads as the moved class, equal to the original."""
    import pickle

    from remat import models

    model, inputs = models.build("mlp-chain-4", tiny=True)
    plan = remat.plan(remat.trace(model, *inputs), budget="100%", strategy="full")
    as_0_4 = pickle.dumps(plan, protocol=2).replace(b"cremat.planning.plans\n", b"cremat.plans\n")
    assert b"cremat.plans\n" in as_0_4
    assert pickle.loads(as_0_4) == plan
