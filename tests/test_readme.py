"""Every shell line of the README runs as written (at the presets' tiny sizes: REMAT_QUICK=1) and
exits 0 with no bench row that could not run. The two setup commands are what CI itself runs."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
FACTORY = """
import torch
from torch import nn


def make_model(batch=8, seq=128):
    model = nn.Sequential(nn.Embedding(100, 32), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 100))
    return model, (torch.randint(0, 100, (batch, seq)),)
"""


def shell_lines() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S)
    lines = [line.split("  #")[0].strip() for block in blocks for line in block.splitlines()]
    return [line for line in lines if line and not line.startswith("python3 -m venv")]


def test_the_readme_shows_commands_and_examples():
    lines = shell_lines()
    assert any(line.startswith("remat bench") for line in lines)
    assert any(":make_model" in line for line in lines)


@pytest.mark.parametrize("line", shell_lines())
def test_readme_line_runs(line, tmp_path):
    package = tmp_path / "mypkg"  # the README's own-factory example, in the folder it runs from
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "models.py").write_text(FACTORY)
    argv = shlex.split(line)
    assert argv[0] == "remat"
    script = shutil.which("remat") or str(Path(sys.executable).with_name("remat"))
    env = {**os.environ, "REMAT_QUICK": "1", "PYTHONPATH": ""}
    done = subprocess.run(
        [script, *argv[1:]], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    assert "could not run" not in output, output[-3000:]
