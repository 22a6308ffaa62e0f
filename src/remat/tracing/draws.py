"""Random control flow: a step whose ops depend on random draws (LayerDrop, random depth).

LayerDrop skips a layer when a random number falls under a threshold: `if torch.rand([]) <
p: continue`, or `random.uniform(0, 1) < p` in older code. The ops a step runs then differ from
draw to draw, and a trace records one draw. `ForcedDraws` finds such draws and fixes their
outcome: a Python read (`bool`, `.item()`, `float`) of a tensor computed from random numbers alone
(no parameter, input or activation in it), and the draws of Python's and NumPy's `random`, are
answered with the lowest ("low") or highest ("high") value instead. The tracer runs the step
both ways and keeps the longer (`remat.trace`); `verify` measures both ways. The same works on
fake tensors, which have no value to read. Random ops on activations (dropout, stochastic depth's
per-sample masks) change values, not which ops run, and are left alone.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable
from typing import Any, Literal

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils.weak import WeakIdKeyDictionary

from remat.graph import RANDOM_MARKERS

Draws = Literal["low", "high"]
_SCALAR_READS = frozenset({"_local_scalar_dense", "item", "is_nonzero"})
_LOWEST_BELOW_ONE = 1.0 - 2.0**-24
#: Data-free tensors larger than this are not shadowed (a causal mask, say): no draw decides on them.
_SHADOW_NUMEL = 4096


def _is_random(packet: str) -> bool:
    return any(marker in packet for marker in RANDOM_MARKERS)


class ForcedDraws(TorchDispatchMode):
    """Within: random numbers that reach Python take the `draws` extreme; `reads` lists each read
    as (where, what), `where` from `scope()` (the module path).

    Small tensors made without data (factories, constants, random ops on them) are followed, with
    every random op's output set to its extreme: 0 ("low") or just under 1 ("high"; 1 for
    integers and bools). Real ones are set in place; fake ones, which have no values, get a real
    CPU shadow computed by the same ops. A Python read of one that came from a random op reads
    that value, so `torch.rand([]) < p` is False at "low" for any p > 0 and at "high" only for
    p = 1, on real and fake tensors alike."""

    def __init__(self, draws: Draws, scope: Callable[[], str] = lambda: ""):
        super().__init__()
        self.draws = draws
        self.scope = scope
        self.reads: list[tuple[str, str]] = []
        #: data-free tensor -> (its shadow, whether random numbers went into it)
        self.shadows: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._patched: list[tuple[Any, str, Any]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = args[0] if args else None
        if isinstance(first, torch.Tensor) and first not in self.shadows:
            return func(*args, **kwargs)  # data in it: nothing to follow or answer (most ops)
        packet = func._overloadpacket.__name__
        inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if packet in _SCALAR_READS and inputs and self.shadows.get(inputs[0], (None, False))[1]:
            self.reads.append((self.scope(), f"a read of {inputs[0].dtype} from a random op"))
            shadow = self.shadows[inputs[0]][0]
            if shadow is not None:  # fake: the shadow has the value
                with _disable_current_modes():
                    return shadow.item()
        out = func(*args, **kwargs)
        if all(t in self.shadows for t in inputs):
            self._follow(func, packet, args, kwargs, inputs, out)
        return out

    def _follow(self, func, packet: str, args, kwargs, inputs, out) -> None:
        """Record a data-free op's outputs: a real one's random values set to their extreme in
        place (no memory of its own: measurement counts every allocation), a fake one's shadow."""
        outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        if not outs or any(t.numel() > _SHADOW_NUMEL for t in outs):
            for t in outs:  # too big to follow: treated as data from now on
                self.shadows.pop(t, None)
            return
        random_op = _is_random(packet)
        random_in = random_op or any(self.shadows[t][1] for t in inputs)
        fake = any(is_fake(t) for t in outs)
        shadows: list[torch.Tensor | None] = [None] * len(outs)
        with _disable_current_modes():
            if random_op and not fake:
                with torch.no_grad():
                    for t in outs:
                        t.fill_(self._extreme(t))
            elif random_op:
                shadows = [
                    torch.full(tuple(t.shape), self._extreme(t), dtype=t.dtype) for t in outs
                ]
            elif fake:
                real = pytree.tree_map_only(
                    torch.Tensor, lambda t: self.shadows[t][0], (args, kwargs)
                )
                try:
                    result = func(*real[0], **real[1])
                except Exception:  # noqa: BLE001 - an op the shadow cannot run: stop following
                    for t in outs:
                        self.shadows.pop(t, None)
                    return
                shadows = [t for t in pytree.tree_leaves(result) if isinstance(t, torch.Tensor)]
        for t, shadow in zip(outs, shadows, strict=False):
            self.shadows[t] = (shadow, random_in)

    def _extreme(self, like: torch.Tensor) -> float | int:
        high = self.draws == "high"
        if like.dtype.is_floating_point:
            return _LOWEST_BELOW_ONE if high else 0.0
        return int(high)

    # -- Python's and NumPy's draws --------------------------------------------------------------
    def _python_draw(self, label: str, original: Callable[..., Any], bounded: bool) -> Callable:
        """`original(...)`, but a single draw returns an end of its range: `uniform(a, b)`'s a or
        b, `random()`'s 0 or just under 1. Arrays of draws (a size) are values, not control."""

        def draw(*args: Any, **kwargs: Any) -> Any:
            bounds = [*args, *kwargs.values()]
            if kwargs.get("size") is not None or len(args) > 2 or (bounds and not bounded):
                return original(*args, **kwargs)
            self.reads.append((self.scope(), label))
            if self.draws == "low":
                return bounds[0] if bounds else 0.0
            return bounds[1] if len(bounds) > 1 else _LOWEST_BELOW_ONE

        return draw

    def __enter__(self):
        targets = [(random, "random"), (random, "uniform")]
        numpy_random = getattr(sys.modules.get("numpy"), "random", None)
        if numpy_random is not None:
            targets += [(numpy_random, "random"), (numpy_random, "rand"), (numpy_random, "uniform")]
        for owner, name in targets:
            original = getattr(owner, name)
            self._patched.append((owner, name, original))
            label = f"{owner.__name__}.{name}()"
            setattr(owner, name, self._python_draw(label, original, bounded=name == "uniform"))
        return super().__enter__()

    def __exit__(self, *exc: Any):
        for owner, name, original in reversed(self._patched):
            setattr(owner, name, original)
        self._patched = []
        return super().__exit__(*exc)
