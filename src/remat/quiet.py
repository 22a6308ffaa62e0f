"""Silence a C library's writes to a file descriptor (the profiler's start/stop lines on stderr,
HiGHS's occasional debug line on stdout), which Python-level redirection cannot catch."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def quiet_fd(fd: int) -> Iterator[None]:
    (sys.stdout if fd == 1 else sys.stderr).flush()
    saved = os.dup(fd)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
        yield
    finally:
        os.dup2(saved, fd)
        os.close(devnull)
        os.close(saved)
