"""Depth as a size axis: trace a few of a model's repeated blocks and know the whole step exactly.

`trace_by_depth` finds the model's stacks of blocks (each outermost `nn.ModuleList` of two or more
blocks with parameters, or `nn.ModuleDict` keyed by consecutive indices: a transformer's layers,
T5's encoder and decoder blocks, a pipeline stage's blocks), and in each the
period of its blocks (`start` blocks that differ, then blocks that repeat every `period`: 1, or 2
where local and global attention alternate) by comparing the blocks as built: their submodules'
types, parameters, buffers, hooks and plain attributes (an integer that grows with the block's
index, as `layer_idx`, is the index, not a difference). It traces the model with each stack cut
to its first `start + 4 x period` blocks, checks that the traced units repeat
(`remat.tracing.replicate`) and lays out the graph of the full depth from them, equal to the graph
a trace of the full depth gives. Where it cannot (no stack, a stack too short to gain, blocks that
differ, random draws that decide ops, units that do not repeat in the trace) it traces the full
depth and says why in `graph.info["depth"]`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

from remat.graph import Graph
from remat.tracing.replicate import UNITS, NotPeriodic, Stack, replicate
from remat.tracing.tensors import local_tensor

_PLAIN = (bool, int, float, str, type(None))


def _plain(value: Any) -> bool:
    if isinstance(value, (tuple, list)):
        return all(_plain(v) for v in value)
    return isinstance(value, _PLAIN)


def _callable(value: Any) -> Any:
    """A callable attribute as what it runs: `functools.partial`s made alike are alike."""
    if isinstance(value, functools.partial):
        args = tuple(a if _plain(a) else _callable(a) for a in value.args)
        keywords = tuple(sorted((k, v) for k, v in value.keywords.items() if _plain(v)))
        return ("partial", _callable(value.func), args, keywords)
    return getattr(value, "__func__", value)


def _describe(block: nn.Module) -> list[tuple[str, Any]]:
    """What a block's step can depend on, as (key, value) pairs in a fixed order."""
    out: list[tuple[str, Any]] = []
    for path, m in block.named_modules():
        out.append((f"{path}:type", type(m)))
        out.append((f"{path}:training", m.training))
        for name, p in m.named_parameters(recurse=False):
            out.append((f"{path}.{name}", (tuple(p.shape), p.stride(), p.dtype, p.requires_grad)))
        for name, b in m.named_buffers(recurse=False):
            out.append((f"{path}.{name}", (tuple(b.shape), b.stride(), b.dtype)))
        for hooks in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
                      "_backward_pre_hooks"):  # fmt: skip
            out.append((f"{path}:{hooks}", len(getattr(m, hooks, {}))))
        for key, value in sorted(vars(m).items()):
            if key.startswith("_"):
                continue
            if _plain(value):
                out.append((f"{path}:{key}", value))
            elif callable(value):
                out.append((f"{path}:{key}", _callable(value)))
            else:
                out.append((f"{path}:{key}", type(value)))
    return out


def block_kinds(blocks: list[nn.Module]) -> list[int]:
    """A number per block, equal for blocks that would trace the same step. An integer attribute
    that is the block's index plus a constant in every block (`layer_idx`) is left out."""
    described = [dict(_describe(b)) for b in blocks]
    index_like = set()
    for key in set().union(*described):
        values = [(i, d[key]) for i, d in enumerate(described) if key in d]
        ints = all(type(v) is int for _, v in values)
        if ints and len({v for _, v in values}) > 1 and len({v - i for i, v in values}) == 1:
            index_like.add(key)
    kinds: dict[tuple, int] = {}
    return [
        kinds.setdefault(tuple(kv for kv in d.items() if kv[0] not in index_like), len(kinds))
        for d in described
    ]


def find_period(kinds: list[int]) -> tuple[int, int] | None:
    """(start, period) of the fewest traced blocks (`start + UNITS x period`, fewer than all)
    under which the blocks from `start` on repeat every `period` in whole periods."""
    n = len(kinds)
    best = None
    for start in range(n):
        for period in range(1, n):
            traced = start + UNITS * period
            if traced >= n or (best is not None and traced >= best[0] + UNITS * best[1]):
                break
            if (n - start) % period:
                continue
            if all(kinds[i] == kinds[i + period] for i in range(start, n - period)):
                best = (start, period)
    return best


def find_stacks(module: nn.Module) -> tuple[list[tuple[nn.Module, str, Stack]], str]:
    """The stacks of `module` to replicate, each with its parent module and attribute name, and
    why the others (or all) are traced whole."""
    found: list[tuple[nn.Module, str, Stack]] = []
    reasons: list[str] = []
    lists: list[str] = []
    modules = dict(module.named_modules())
    for path, m in modules.items():
        first = _numbered_from(m)
        if first is None or len(m) < 2:
            continue
        if any(path.startswith(p + ".") for p in lists):
            continue  # nested in a stack (a block's experts)
        blocks = list(m.values()) if isinstance(m, nn.ModuleDict) else list(m)
        if not all(any(True for _ in b.parameters()) for b in blocks):
            continue
        lists.append(path)
        parent_path, _, attr = path.rpartition(".")
        period = find_period(block_kinds(blocks))
        if period is None:
            reasons.append(
                f"the {len(m)} blocks of '{path}' do not repeat over enough blocks to trace fewer"
            )
            continue
        found.append((modules[parent_path], attr, Stack(path, len(m), *period, first=first)))
    if not lists:
        reasons.append("the model has no list of blocks (nn.ModuleList, or nn.ModuleDict by index)")
    return found, "; ".join(reasons)


def _numbered_from(m: nn.Module) -> int | None:
    """The index of the first block of a stack: an `nn.ModuleList`, or an `nn.ModuleDict` keyed
    by consecutive block indices (a pipeline stage's blocks); None for any other module."""
    if isinstance(m, nn.ModuleList):
        return 0
    if isinstance(m, nn.ModuleDict) and len(m) and all(k.isdigit() for k in m):
        keys = [int(k) for k in m]
        if keys == list(range(keys[0], keys[0] + len(keys))):
            return keys[0]
    return None


@contextlib.contextmanager
def _cut(found: list[tuple[nn.Module, str, Stack]]) -> Iterator[None]:
    """Each stack cut to the blocks it traces, for the length of the trace."""
    full = [getattr(parent, attr) for parent, attr, _ in found]
    try:
        for (parent, attr, stack), blocks in zip(found, full, strict=True):
            if isinstance(blocks, nn.ModuleDict):
                kept = list(blocks.items())[: stack.traced_layers]
                setattr(parent, attr, nn.ModuleDict(kept))
            else:
                setattr(parent, attr, nn.ModuleList(list(blocks)[: stack.traced_layers]))
        yield
    finally:
        for (parent, attr, _), blocks in zip(found, full, strict=True):
            setattr(parent, attr, blocks)


def _state(module: nn.Module) -> tuple[list[str], int]:
    """The names the tracer registers the model's state under, parameters first, and how many
    of them are parameters (`remat.tracing.trace`: named_parameters, then named_buffers)."""
    params = list(dict(module.named_parameters()))
    buffers = [n for n in dict(module.named_buffers()) if n not in set(params)]
    return params + buffers, len(params)


def _differs(replicated: Graph, traced: Graph) -> str:
    """Where the graph rebuilt from the traced units first differs from the trace."""
    for what in ("ops", "modules", "saved"):
        for a, b in zip(getattr(replicated, what), getattr(traced, what), strict=False):
            if a != b:
                return f"{what}: {getattr(b, 'name', getattr(b, 'path', b))}"
    return "tensors, storages or nodes"


def trace_by_depth(module: nn.Module, run: Callable[[], Graph]) -> Graph:
    """`run()` (a trace of `module` as it stands) on the model cut to a few units of each stack,
    the graph of the full depth laid out from it; the full trace where that cannot be exact."""
    found, reason = find_stacks(module)
    if not found:
        return _full(run, reason)
    stacks = [stack for _, _, stack in found]
    full_state, _ = _state(module)
    try:
        with _cut(found):
            state, params = _state(module)
            small = run()
    except Exception as err:  # the model reads its full depth (range(config.num_layers)): in full
        first = (str(err).strip().splitlines() or [""])[0]
        return _full(run, f"the model cut to fewer blocks does not run ({first})")
    if small.info.get("random_reads") or small.info.get("rerun_in_backward"):
        return _full(run, "random draws decide the step's ops, or a block runs again in backward")
    try:
        again = replicate(small, stacks, state, params, units=[UNITS] * len(stacks))
        if again != small:
            raise NotPeriodic(f"the traced units differ ({_differs(again, small)})")
        graph = replicate(small, stacks, state, params, full_state=full_state)
    except NotPeriodic as err:
        return _full(run, str(err))
    named = dict(module.named_parameters())
    graph.info["param_count"] = sum(local_tensor(p).numel() for p in named.values())
    graph.info["trainable_param_bytes"] = sum(
        graph.storages[2 * i].nbytes for i, p in enumerate(named.values()) if p.requires_grad
    )
    graph.info["depth"] = {
        "traced": "replicated",
        "stacks": {
            s.path: dict(layers=s.layers, traced=s.traced_layers, start=s.start, period=s.period)
            for s in stacks
        },
        "full": reason,
    }
    return graph


def _full(run: Callable[[], Graph], reason: str) -> Graph:
    graph = run()
    graph.info["depth"] = {"traced": "full", "reason": reason}
    return graph
