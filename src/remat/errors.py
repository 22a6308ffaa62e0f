"""Errors a user can act on. Each message names the op, module or argument at fault and what to do.

The CLI maps every `RematError` to exit code 2, and `InfeasibleBudget` to exit code 3.
"""

from __future__ import annotations

import sys
import warnings


class RematError(Exception):
    """Base class: bad input or a model remat cannot analyse, with advice in the message."""


class UnknownModelError(RematError):
    """A preset name, `pkg.module:factory` spec or `hf:` model type that cannot be built."""


class TraceError(RematError):
    """The training step could not be traced (an op without a meta kernel, a data-dependent shape,
    ...). `fake_tensor_failure` says the op failed on fake tensors only, so that a trace on real
    tensors may work; `op` and `module` name it."""

    def __init__(
        self,
        message: str,
        *,
        op: str | None = None,
        module: str | None = None,
        fake_tensor_failure: bool = False,
    ):
        super().__init__(message)
        self.op = op
        self.module = module
        self.fake_tensor_failure = fake_tensor_failure


class InfeasibleBudget(RematError):
    """No plan of the asked strategy fits the budget; `min_feasible_bytes` is the smallest that does."""

    def __init__(self, message: str, *, budget_bytes: int, min_feasible_bytes: int | None):
        super().__init__(message)
        self.budget_bytes = budget_bytes
        self.min_feasible_bytes = min_feasible_bytes


class StatefulModuleError(RematError):
    """A module to be recomputed writes tensors into state outside its outputs (a KV cache, an
    attribute): recomputation would write them again. `module` is its path."""

    def __init__(self, message: str, *, module: str):
        super().__init__(message)
        self.module = module


class RematWarning(UserWarning):
    """Something remat changed or could not do as planned, said once: caching turned off for
    training, kept ops of a plan that the real run did not issue, a trace retried on real tensors."""


def warn(message: str) -> None:
    """Issue a `RematWarning` at the user's line: the first caller outside remat, torch and
    transformers (remat warns from inside hooks, where the direct caller is torch's module code)."""
    frame, level = sys._getframe(1), 2
    while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] in _LIBRARIES:
        frame, level = frame.f_back, level + 1
    warnings.warn(message, RematWarning, stacklevel=level)


_LIBRARIES = ("remat", "torch", "transformers", "accelerate")
