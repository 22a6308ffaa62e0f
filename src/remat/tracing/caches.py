"""Run a training step with key/value caching off, as Hugging Face's own gradient checkpointing does.

A decoder called with `use_cache=True` (the default of every Hugging Face causal LM) appends each
layer's keys and values to a cache object. Recomputing a layer appends them again, so the replayed
op stream differs from the forward's and torch's selective checkpoint fails in backward ("aten.slice
... encountered during backward but not found in storage"); without a policy the cache silently
grows. A cache is useless in training, so while a module trains with grad enabled remat passes
`use_cache=False` to every forward that takes that argument and drops a cache object handed to a
layer (`past_key_values`, `past_key_value`, `layer_past`), saying so once. The tracer installs the
same hooks, so the traced step is the step that runs.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any

import torch
from torch import nn

from remat.errors import warn

CACHE_ARGUMENTS = ("past_key_values", "past_key_value", "layer_past")


def _parameters(module: nn.Module) -> frozenset[str]:
    try:
        return frozenset(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):  # a builtin or C forward: no keyword to set
        return frozenset()


_warned: weakref.WeakSet[nn.Module] = weakref.WeakSet()


class CachesOff:
    """Forward pre-hooks on every module of `model` whose forward takes `use_cache` or a cache
    argument; `remove()` takes them off. The message is given once per model. The hooks are
    `_CacheHook` objects, so that a model carrying them can be deep-copied and pickled."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.handles = []
        for path, module in model.named_modules():
            names = _parameters(module)
            touched = tuple(n for n in ("use_cache", *CACHE_ARGUMENTS) if n in names)
            if touched:
                hook = _CacheHook(self, path or type(module).__name__, touched)
                self.handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


class _CacheHook:
    """Turn caching off in one module's training forward (`names`: its cache arguments)."""

    def __init__(self, owner: CachesOff, path: str, names: tuple[str, ...]):
        self.owner, self.path, self.names = owner, path, names

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]):
        if not (module.training and torch.is_grad_enabled()):
            return None
        changed = []
        if "use_cache" in self.names:
            default = getattr(getattr(module, "config", None), "use_cache", True)
            if kwargs.get("use_cache", default):
                changed.append("use_cache=False")
            kwargs["use_cache"] = False
        for name in self.names:
            if name != "use_cache" and kwargs.get(name) is not None:
                kwargs[name] = None
                changed.append(f"{name}=None")
        model = self.owner.model
        if changed and model not in _warned:
            _warned.add(model)
            warn(
                "remat: a cache is useless in training and would be written again by "
                f"recomputation; the step runs with {', '.join(changed)} (first in {self.path}), "
                "as Hugging Face's gradient checkpointing does"
            )
        return args, kwargs
