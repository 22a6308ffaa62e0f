"""What the trace reads of a tensor, real or fake: its storage's identity (`storage_key`, shared by
its views) and size, its dtype's name, and, for a wrapper subclass (a DTensor's local shard, a
pending collective's result), the tensor inside whose storage this rank holds (`local_tensor`) and
how to rebuild the wrapper around another (`rewrapper`). The tracer keys storages and tensors by
these; `remat.applying.compiled` and `remat.prediction.inductor_plan` key the compiled step's
storages the same way."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import is_traceable_wrapper_subclass


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def storage_nbytes(t: torch.Tensor) -> int:
    return int(t.untyped_storage().nbytes())


def storage_key(t: torch.Tensor) -> int:
    """The identity of a tensor's storage (shared by its views), for real and fake tensors."""
    return StorageWeakRef(t.untyped_storage()).cdata


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage this rank holds: the one tensor inside a wrapper subclass that
    holds one (a DTensor's local shard, a pending collective's result), else `t` itself."""
    if is_traceable_wrapper_subclass(t):
        attrs, _ = t.__tensor_flatten__()
        inner = [getattr(t, a) for a in attrs if isinstance(getattr(t, a), torch.Tensor)]
        if len(inner) == 1:
            return local_tensor(inner[0])
    return t


def wrapped_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The tensors a wrapper around several holds (torchao's float8 tensor: its float8 data and
    its scale), each its local one; none for a plain tensor or a wrapper around one."""
    if not is_traceable_wrapper_subclass(t) or local_tensor(t) is not t:
        return []
    attrs, _ = t.__tensor_flatten__()
    inner = [getattr(t, a) for a in attrs]
    return [local_tensor(x) for x in inner if isinstance(x, torch.Tensor)]


#: Tensor types that wrap nothing: the common case, decided without a lookup (every op asks).
_PLAIN_TENSORS = frozenset({torch.Tensor, torch.nn.Parameter, FakeTensor})


def _is_wrapper(t: Any) -> bool:
    """A wrapper subclass, around one tensor (a DTensor) or several (torchao's float8 tensor:
    its float8 data and its scale): its own dispatch runs the ops on what it wraps."""
    return (
        type(t) not in _PLAIN_TENSORS
        and isinstance(t, torch.Tensor)
        and is_traceable_wrapper_subclass(t)
    )


def is_wrapper_op(args: tuple, kwargs: dict) -> bool:
    """Whether an op takes a wrapper tensor (a DTensor): an aten op's tensors are its arguments
    or the items of a list argument."""
    for a in (*args, *kwargs.values()):
        if any(_is_wrapper(t) for t in a) if type(a) in (list, tuple) else _is_wrapper(a):
            return True
    return False


def rewrapper(t: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """For a wrapper subclass around one tensor (`local_tensor`), a function that rebuilds `t`'s
    wrapper around another inner tensor, holding none of `t`'s tensors; None for a plain tensor."""
    if local_tensor(t) is t:
        return None
    attrs, context = t.__tensor_flatten__()
    (name,) = [a for a in attrs if isinstance(getattr(t, a), torch.Tensor)]
    others = {a: getattr(t, a) for a in attrs if a != name}
    inner = rewrapper(getattr(t, name))
    cls, size, stride = type(t), t.size(), t.stride()

    def rewrap(stand_in: torch.Tensor) -> torch.Tensor:
        held = stand_in if inner is None else inner(stand_in)
        return cls.__tensor_unflatten__({**others, name: held}, context, size, stride)

    return rewrap


def accumulates_in_place(old: Any, new: Any) -> bool:
    """Whether autograd's engine, run without a dispatch mode, would add the gradient `new` into
    `old` in place where two reach one input (`InputBuffer::accumulate`: `old.add_(new)` when
    grad mode is off, neither is a subclass and the buffer holds the last reference to `old` and
    to its storage, which is non-overlapping and dense). Under any dispatch mode (the tracer's)
    the engine never does: the mode's references to `old` count, and fake tensors are a
    subclass. Read here, inside the mode: `old`'s storage held by no other tensor (the count
    less this probe's own reference), and `old` held no more than `new`, the gradient the engine
    hands over (one reference, plus what the mode's call adds to each alike)."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if (
        use_count is None
        or not hasattr(old, "_use_count")
        or torch.is_grad_enabled()
        or type(old) not in _PLAIN_TENSORS
        or type(new) not in _PLAIN_TENSORS
        or old is new
        or old.layout != torch.strided
        or old.dtype != new.dtype
        or old.shape != new.shape
        or not _non_overlapping_and_dense(old)
    ):
        return False
    storage = old.untyped_storage()
    return use_count(storage._cdata) - 1 == 1 and old._use_count() <= new._use_count()


def _non_overlapping_and_dense(t: torch.Tensor) -> bool:
    """Whether `t`'s elements fill a block of its storage, each once, in some order of its dims."""
    expected = 1
    for stride, size in sorted((s, n) for n, s in zip(t.shape, t.stride(), strict=True) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True
