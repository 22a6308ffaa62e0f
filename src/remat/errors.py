"""Errors a user can act on. Each message names the op, module or argument at fault and what to do.

Every error remat raises on purpose is a `RematError`, which is a `ValueError`, so that code
written against the older `except ValueError` still catches them:

    RematError (ValueError)
    ├── UnknownModelError     a model spec that cannot be built
    ├── TraceError            a training step that cannot be traced
    ├── InfeasibleBudget      no plan fits the budget
    │   └── StrategyRefused   a strategy that cannot plan this step at any budget
    ├── StatefulModuleError   a module to recompute writes state
    ├── PlanFormatError       a plan JSON that cannot be read
    ├── NoBlocksError         a per-block strategy on a model without repeated blocks
    ├── UnknownStrategyError  a strategy name that does not exist
    ├── BudgetError           a budget or byte size that cannot be parsed
    └── UnknownProfileError   a device cost profile name that does not exist

`exit_code` is the one mapping from an error to the CLI's exit status: 3 for `InfeasibleBudget`,
2 for every other `RematError`, 1 for anything else.
"""

from __future__ import annotations

import logging
import sys
import warnings
from collections.abc import Iterable
from typing import Any


class RematError(ValueError):
    """Base class: bad input or a model remat cannot analyse, with advice in the message."""

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled with its fields (`remat fit`'s worker processes send errors to the parent):
        the default calls the class with the message alone, which the keyword-only fields of
        most subclasses refuse."""
        return _rebuilt, (type(self), self.args, vars(self))


def _rebuilt(cls: type[RematError], args: tuple[Any, ...], fields: dict[str, Any]) -> RematError:
    err = cls.__new__(cls, *args)
    vars(err).update(fields)
    return err


class UnknownModelError(RematError):
    """Raised for a preset name, `pkg.module:factory` spec or `hf:` model type that cannot be built."""


class TraceError(RematError):
    """Raised when the training step could not be traced (an op without a meta kernel, a
    data-dependent shape, ...). `fake_tensor_failure` says the op failed on fake tensors only, so
    that a trace on real tensors may work; `op` and `module` name it."""

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
        #: reads of random draws before the failure (`remat.tracing.draws`): the trace tries their other
        #: extreme, as when LayerDrop skipped every layer
        self.random_reads: list[tuple[str, str]] = []


class InfeasibleBudget(RematError):
    """Raised when no plan of the asked strategy fits the budget; `min_feasible_bytes` is the
    smallest budget that does (None when unknown)."""

    def __init__(self, message: str, *, budget_bytes: int, min_feasible_bytes: int | None):
        super().__init__(message)
        self.budget_bytes = budget_bytes
        self.min_feasible_bytes = min_feasible_bytes


class StrategyRefused(InfeasibleBudget):
    """Raised when a strategy cannot plan this step at any budget (sqrt's runs of several blocks
    where LayerDrop skips blocks); `strategy` names it. `auto` leaves such a strategy out, saying
    why, and picks among the rest."""

    def __init__(self, message: str, *, strategy: str, budget_bytes: int):
        super().__init__(message, budget_bytes=budget_bytes, min_feasible_bytes=None)
        self.strategy = strategy


class StatefulModuleError(RematError):
    """Raised when a module to be recomputed writes tensors into state outside its outputs (a KV
    cache, an attribute): recomputation would write them again. `module` is its path."""

    def __init__(self, message: str, *, module: str):
        super().__init__(message)
        self.module = module


class PlanFormatError(RematError):
    """Raised when a plan JSON cannot be read; `field` names the bad or missing field, if one is."""

    def __init__(self, message: str, *, field: str | None = None):
        super().__init__(message)
        self.field = field


class NoBlocksError(RematError):
    """Raised when a strategy that checkpoints repeated blocks meets a model without any;
    `strategy` is its name."""

    def __init__(self, message: str, *, strategy: str):
        super().__init__(message)
        self.strategy = strategy


class UnknownStrategyError(RematError):
    """Raised for a strategy name that does not exist; `name` is it, `choices` the known names."""

    def __init__(self, message: str, *, name: str, choices: Iterable[str]):
        super().__init__(message)
        self.name = name
        self.choices = tuple(choices)


class SequenceLimitError(RematError):
    """Raised for a sequence longer than the model is built for (its learned positions): `limit`
    is the longest it takes, `lever` how to build it longer. `remat fit`'s largest-sequence
    search stops at `limit` and says so."""

    def __init__(self, message: str, *, limit: int, lever: str):
        super().__init__(message)
        self.limit = limit
        self.lever = lever


class BudgetError(RematError):
    """Raised when a budget or byte size cannot be parsed ("40 GB?", "12 parsecs")."""


class UnknownProfileError(RematError):
    """Raised for a device cost profile name that is not in `remat.device.cost.PROFILES`."""


#: CLI exit status of a `RematError` that is not listed in `_EXIT_CODES`.
_INPUT_ERROR_EXIT = 2
_EXIT_CODES: dict[type[RematError], int] = {InfeasibleBudget: 3}


def exit_code(error: BaseException) -> int:
    """The CLI's exit status for `error`: 3 for `InfeasibleBudget`, 2 for any other `RematError`
    (bad input or a model remat cannot analyse), 1 for anything else (a bug, an interrupt)."""
    if not isinstance(error, RematError):
        return 1
    for cls in type(error).__mro__:
        if cls in _EXIT_CODES:
            return _EXIT_CODES[cls]
    return _INPUT_ERROR_EXIT


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

#: What remat did, one line per action (`auto` installing a plan). Shown on stderr by default, in
#: scripts and notebooks alike; silence it with logging.getLogger("remat").setLevel("WARNING"),
#: or route it by adding your own handler (then remat's is removed).
log = logging.getLogger("remat")


class _DefaultHandler(logging.StreamHandler):
    """Writes to the stderr of the moment (pytest and notebooks swap it), only while the user
    has given the logger no handler of their own."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter("%(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        if any(h is not self for h in log.handlers):
            return
        self.stream = sys.stderr
        super().emit(record)


if not log.handlers:
    log.addHandler(_DefaultHandler())
    log.setLevel(logging.INFO)
    log.propagate = False
