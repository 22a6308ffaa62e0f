"""`pkg.module:factory`: a user's own model, named the way entry points name a function.

The factory is called with whichever of `batch`, `seq`, `dtype` (a torch.dtype) and `device` (a
torch.device) its signature accepts, so a two-line function of no arguments works as well as one
that honours them all. `tiny=True` and config overrides are passed on only to a factory that names
them (or takes **kwargs): silently dropping them would build a different model than asked for.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from remat.errors import UnknownModelError

_FORM = "write 'pkg.module:factory', e.g. 'mypkg.models:build'"


@contextlib.contextmanager
def _cwd_importable() -> Iterator[None]:
    """Let the current folder's modules import, as `python -m` does: the `remat` console script
    puts only its own folder first on sys.path. Appended last, so installed packages win."""
    cwd = os.getcwd()
    added = cwd not in sys.path and "" not in sys.path
    if added:
        sys.path.append(cwd)
    try:
        yield
    finally:
        if added:
            sys.path.remove(cwd)


def resolve(spec: str) -> Callable[..., Any]:
    """Import the module of `spec` and return its factory, or say what is wrong with the spec."""
    module_name, colon, attr = spec.partition(":")
    if not colon:
        problem = "has no ':' between module and factory"
    elif not module_name:
        problem = "names no module before ':'"
    elif not attr:
        problem = "names no factory after ':'"
    elif not all(part.isidentifier() for part in module_name.split(".")):
        problem = f"has {module_name!r} before ':', which is not a dotted module name"
    elif not attr.isidentifier():
        problem = f"has {attr!r} after ':', which is not a function name"
    else:
        problem = None
    if problem:
        raise UnknownModelError(f"model spec {spec!r} {problem}; {_FORM}")
    try:
        with _cwd_importable():
            module = importlib.import_module(module_name)
    except ImportError as err:
        raise UnknownModelError(
            f"model spec {spec!r}: cannot import module {module_name!r} ({err}); "
            "install it, or run from its folder or add that folder to PYTHONPATH"
        ) from err
    if not hasattr(module, attr):
        own = sorted(
            n
            for n, v in vars(module).items()
            if callable(v) and n[0] != "_" and getattr(v, "__module__", None) == module_name
        )
        raise UnknownModelError(
            f"model spec {spec!r}: module {module_name!r} ({module.__file__}) has no attribute "
            f"{attr!r}; the functions and classes it defines: {', '.join(own) or 'none'}"
        )
    factory = getattr(module, attr)
    if not callable(factory):
        raise UnknownModelError(
            f"model spec {spec!r}: {module_name}.{attr} is not callable (its type is "
            f"{type(factory).__name__}); point the spec at a function that returns (model, inputs)"
        )
    return factory


def load(
    spec: str,
    *,
    batch: int,
    seq: int,
    dtype: torch.dtype,
    device: torch.device,
    tiny: bool,
    overrides: dict[str, Any],
) -> tuple[nn.Module, tuple[Any, ...]]:
    """Call the factory of `spec` and check that it returns (nn.Module, tuple of inputs)."""
    factory = resolve(spec)
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a builtin without introspectable signature: pass nothing
        params = {}
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    offered = {"batch": batch, "seq": seq, "dtype": dtype, "device": device}
    kwargs = {k: v for k, v in offered.items() if takes_all or k in params}
    asked = ({"tiny": True} if tiny else {}) | overrides
    for key, value in asked.items():
        if not (takes_all or key in params):
            raise UnknownModelError(
                f"model spec {spec!r}: {key}={value!r} was asked for, but the factory takes no "
                f"{key!r} argument (its parameters: {', '.join(params) or 'none'})"
            )
        kwargs[key] = value
    try:
        result = factory(**kwargs)
    except Exception as err:
        where = traceback.extract_tb(err.__traceback__)[-1]
        raise UnknownModelError(
            f"model spec {spec!r}: the factory raised {type(err).__name__}: {err} "
            f"({where.filename}:{where.lineno}); fix the factory, then try again"
        ) from err
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], nn.Module):
        model, inputs = result
        if isinstance(inputs, torch.Tensor):
            inputs = (inputs,)
        if isinstance(inputs, tuple):
            return model, inputs
    raise UnknownModelError(
        f"model spec {spec!r}: the factory returned {_describe(result)}; it must return "
        "(model, inputs): an nn.Module and a tuple of its positional inputs (or one tensor), "
        "so that model(*inputs) runs"
    )


def _describe(value: Any) -> str:
    if isinstance(value, tuple):
        return f"a tuple of ({', '.join(type(v).__name__ for v in value)})"
    return f"a value of type {type(value).__name__}"
