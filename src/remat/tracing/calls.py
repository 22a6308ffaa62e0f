"""How a module was called, as far as one checkpoint region running several blocks needs to know.

A region over blocks b0, b1, ... is entered through b0's call and runs the later blocks itself, so
it must call them the way the model does: with b0's arguments but the one that carries the previous
block's output, which it takes from where in that output the model took it. The tracer records,
for every module call, the argument each tensor input was (`arguments`: a positional index as a
digit string or a keyword name; "" for a tensor nested inside an argument), where its one output
tensor sits in what it returned (`output_path`), and whether it was called like the call that
returned just before it (`repeats`): the same positional count and keyword names, the same
structure, and the same non-tensor values, in what it took and in what it returned. The tensors
themselves are compared by the planner, from the ids in `ModuleCall.inputs`.

Non-tensor values compare by value when immutable (numbers, strings, dtypes, ...) and otherwise by
identity, through a weak reference, so an object that died cannot pass for one made later at its
address; an object that takes no weak reference never compares equal. An unknown difference only
ever loses a multi-block region, never makes a wrong one.
"""

from __future__ import annotations

import dataclasses
import enum
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

#: One step into a module's output: an index (tuple, list) or a key (mapping) or attribute name.
PathKey = int | str

_BY_VALUE = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    slice,
    range,
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
    enum.Enum,
)


#: How deep into nested containers and dataclasses a call's structure is followed.
_DEPTH = 8


class _Same:
    """A non-tensor object compared by identity: equal to another token of the same object while
    that object lives; one that takes no weak reference is equal to nothing, itself included."""

    def __init__(self, value: Any):
        try:
            self.ref: Any = weakref.ref(value)
        except TypeError:
            self.ref = None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Same) or self.ref is None or other.ref is None:
            return False
        value = self.ref()
        return value is not None and value is other.ref()

    __hash__ = None  # type: ignore[assignment]


def _fields(obj: Any) -> dict[str, Any] | None:
    """The fields of a dataclass instance (pytree sees one it was not told about as a leaf), or
    None for anything else."""
    if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
        return None
    return {f.name: getattr(obj, f.name, None) for f in dataclasses.fields(obj)}


def _token(value: Any, depth: int) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.Tensor
    if isinstance(value, _BY_VALUE):
        return (type(value), value)
    fields = _fields(value) if depth < _DEPTH else None
    if fields is not None:
        return (type(value), call_shape(fields, depth + 1))
    return _Same(value)


@dataclass(frozen=True)
class CallShape:
    """A call's structure with its tensors left out: comparable with `==` to another call's."""

    spec: Any
    tokens: tuple[Any, ...]


def call_shape(obj: Any, depth: int = 0) -> CallShape:
    leaves, spec = pytree.tree_flatten(obj)
    return CallShape(spec, tuple(_token(v, depth) for v in leaves))


def argument_names(args: tuple, kwargs: dict[str, Any]) -> tuple[str, ...]:
    """The argument each tensor leaf of `(args, kwargs)` was, in the order of its pytree leaves
    (the order of `ModuleCall.inputs`): "2" for the third positional, the keyword's name, or "" for
    a tensor nested inside an argument (a tuple, a dict), which a region cannot replace."""
    named = [*((str(i), a) for i, a in enumerate(args)), *kwargs.items()]
    out = []
    for name, value in named:
        direct = isinstance(value, torch.Tensor)
        for leaf in pytree.tree_leaves(value):
            if isinstance(leaf, torch.Tensor):
                out.append(name if direct else "")
    return tuple(out)


def _tensor_paths(obj: Any, path: tuple[PathKey, ...] = ()) -> Iterator[tuple[Any, tuple]]:
    if len(path) > _DEPTH:
        return
    if isinstance(obj, torch.Tensor):
        yield obj, path
    elif isinstance(obj, Mapping):  # dicts, and Hugging Face's ModelOutput / diffusers' BaseOutput
        for k, v in obj.items():
            if isinstance(k, PathKey):
                yield from _tensor_paths(v, (*path, k))
    elif isinstance(obj, (tuple, list)):
        for i, v in enumerate(obj):
            yield from _tensor_paths(v, (*path, i))
    elif (fields := _fields(obj)) is not None:
        for name, v in fields.items():
            yield from _tensor_paths(v, (*path, name))


def output_tensors(output: Any) -> list[torch.Tensor]:
    """The tensors a module returned: its pytree leaves, and the fields of the dataclasses among
    them (pytree sees a dataclass it was not told about as one leaf, and its tensors not at all)."""
    out = []
    for leaf in pytree.tree_leaves(output):
        if isinstance(leaf, torch.Tensor):
            out.append(leaf)
        elif _fields(leaf) is not None:
            out += [t for t, _ in _tensor_paths(leaf)]
    return out


def output_path(output: Any) -> tuple[PathKey, ...] | None:
    """Where the one tensor of `output` sits in it (`()`: it is the output), for `pick`; None when
    the output holds other than exactly one tensor or holds it where `pick` cannot reach."""
    tensors = output_tensors(output)
    if len(tensors) != 1:
        return None
    return next((p for t, p in _tensor_paths(output) if t is tensors[0]), None)


def pick(output: Any, path: tuple[PathKey, ...]) -> Any:
    """The value at `path` in a module's output (the inverse of `output_path`)."""
    for key in path:
        is_item = isinstance(key, int) or isinstance(output, Mapping)
        output = output[key] if is_item else getattr(output, key)
    return output


def with_argument(
    args: tuple, kwargs: dict[str, Any], name: str, value: Any
) -> tuple[tuple, dict[str, Any]]:
    """`(args, kwargs)` with argument `name` (a positional index as digits, or a keyword) set to
    `value`. KeyError when the call has no such argument."""
    if name.isdigit():
        i = int(name)
        if i >= len(args):
            raise KeyError(name)
        return (*args[:i], value, *args[i + 1 :]), kwargs
    if name not in kwargs:
        raise KeyError(name)
    return args, {**kwargs, name: value}


def argument(args: tuple, kwargs: dict[str, Any], name: str) -> Any:
    """Argument `name` of a call (see `with_argument`). KeyError when it has none."""
    if name.isdigit():
        i = int(name)
        if i >= len(args):
            raise KeyError(name)
        return args[i]
    return kwargs[name]
