"""Every `remat` line of a ```bash block in docs/*.md runs as printed and exits 0 with no traceback,
at the presets' tiny sizes (REMAT_QUICK=1, as tests/test_readme.py runs the README) except where
the command lays a model out over --tp / --pp ranks, which a tiny model cannot fill. Inline
`remat ...` spans in prose are fragments (`--tp T`, `--gpu NAME`); a command a user should run
goes in a bash block. Lines needing a package that is not installed are skipped, naming it. The
quick ones run in CI; the rest are marked slow."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
SRC = Path(__file__).resolve().parents[1] / "src"

#: Lines that take seconds at tiny size: run in CI; the rest trace real sizes or search long.
QUICK = ("remat estimate --model list",)
#: Appended to a torchtitan line (given at full size by its --set's): the same flags, a small step.
TORCHTITAN_SMALL = [
    *("--set", "dim=256", "--set", "n_layers=2", "--set", "n_heads=4", "--set", "n_kv_heads=4"),
    *("--set", "vocab_size=512", "--batch", "2", "--seq", "128"),
]


def doc_commands() -> list[tuple[str, str]]:
    """(file name, command) for each `remat` line of the docs' bash blocks, comments dropped."""
    found = []
    for path in sorted(DOCS.glob("*.md")):
        for block in re.findall(r"```bash\n(.*?)```", path.read_text(), flags=re.S):
            for line in block.splitlines():
                line = line.split("  #")[0].strip()
                if line.startswith("remat "):
                    found.append((path.name, line))
    return found


def _params():
    return [
        pytest.param(
            name, line, id=f"{name}:{line[:60]}", marks=() if line in QUICK else pytest.mark.slow
        )
        for name, line in doc_commands()
    ]


def test_the_docs_show_commands():
    assert len(doc_commands()) >= 10
    assert all(line in {c for _, c in doc_commands()} for line in QUICK)


@pytest.mark.parametrize(("name", "line"), _params())
def test_doc_command_runs_as_printed(name, line, tmp_path):
    argv = shlex.split(line)
    model = argv[argv.index("--model") + 1] if "--model" in argv else ""
    package = model.split(":")[0] if model.split(":")[0] in ("torchtune", "torchtitan") else None
    if package and importlib.util.find_spec(package) is None:
        pytest.skip(f"{name}: {package} is not installed")
    # tiny where the command allows it: a tiny model's 4 heads do not split over --tp 8
    quick = not any(flag in argv for flag in ("--tp", "--pp"))
    if quick and model.startswith("torchtitan:"):
        # its sizes are given by --set, which REMAT_QUICK does not shrink: every flag as printed,
        # then a 2-layer model at a short sequence (the later --set and --batch/--seq win)
        argv += TORCHTITAN_SMALL
    env = {**os.environ, "REMAT_QUICK": "1" if quick else "0", "PYTHONPATH": str(SRC)}
    done = subprocess.run(
        [sys.executable, "-m", "remat.answers.cli", *argv[1:]],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{name}: {line}\n{output[-3000:]}"
    assert "Traceback" not in output, output[-3000:]


def _published():
    import importlib.util as util

    script = DOCS.parent / "benchmarks" / "published.py"
    spec = util.spec_from_file_location("published", script)
    assert spec is not None and spec.loader is not None
    module = util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_accuracy_doc_lists_each_rows_command_as_remat_fit_reads_it():
    """docs/accuracy.md gives every row's `remat fit` command; each parses with fit's own
    arguments into the row's batch, sequence, GPU, ranks, optimizer, loop and torch version."""
    from remat.answers.cli import build_parser
    from remat.answers.cli.common import loop_of
    from remat.answers.cli.fit import gpu_of

    published, text = _published(), (DOCS / "accuracy.md").read_text()
    parser = build_parser()
    for point in published.POINTS:
        for source in point.sources:
            command, read = published.cli_command(point, source)
            assert f"`{command}`, {read}." in text, command
            args = parser.parse_args(shlex.split(command)[1:])
            assert (args.command, args.model, args.batch, args.seq) == (
                "fit",
                source.model,
                point.batch,
                point.seq,
            )
            assert (args.gpu, args.shard, args.optimizer) == (
                point.gpu,
                point.shard,
                point.optimizer or "none",
            )
            assert loop_of(args).keep_grads == point.keep_grads
            assert loop_of(args).keep_logits == point.keep_logits
            assert gpu_of(args).torch_version == point.torch_version
