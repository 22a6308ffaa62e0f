"""Running an example on two CPU processes under torchrun, for the tests that check real ranks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def torchrun(script: Path, *args: str, timeout: int) -> None:
    """Run `script` on two CPU processes under torchrun; it prints OK when its checks held."""
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "OK" in result.stdout
