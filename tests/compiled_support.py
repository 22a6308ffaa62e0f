"""What every test of the compiled path shares."""

from __future__ import annotations

import shutil

import pytest

#: Inductor compiles C++ kernels on CPU; without a compiler only the aot_eager tests can run.
needs_cxx = pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("c++") is None,
    reason="inductor needs a C++ compiler on CPU",
)
