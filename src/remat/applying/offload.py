"""Offload in eager PyTorch: remat's own saved-tensor hooks move the activations a plan's offloaded
blocks save to host memory during the forward and bring them back for their backward ops.

Why remat's own hooks: torch 2.13's eager selective checkpointing caches only the SAVE policies,
so `CheckpointPolicy.MUST_CPU_OFFLOAD` silently becomes recompute there. Here a pack hook, pushed
while an offloaded block's forward runs (`torch.autograd.graph.saved_tensors_hooks`), copies each
saved storage of at least `min_bytes` (parameters, buffers and the model's inputs excepted) to a
host buffer once a step, and returns a handle instead of the tensor, so autograd holds no device
copy: the storage dies when the forward drops it. The unpack hook copies it back to a new device
storage (one copy shared while alive by every node that saved it) and rebuilds the saved view,
bit for bit, so gradients are those of the unplanned model. A selective region's kept outputs are
held by checkpoint's policy cache, not by hooks: `OffloadingCache` (the cache remat gives such a
region in an offloaded block) holds host copies made by the same `Offloader` instead.

Host buffers are reused across steps (a pool by size, refilled when autograd lets go of a handle).
On CUDA they are pinned, the copies run on a side stream ordered by events (the device storage is
kept from reuse until its copy is done, `record_stream`), and the first unpack of a block's
tensors prefetches the block before it. On CPU the buffers come from numpy, outside c10's
allocator that `remat.measure` reads, so a CPU step shows the device-side drop the plan predicts
(`remat.prediction.schedule.Offload` with its default windows: copies synchronous, reload at the
node's first backward op).
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from remat.errors import RematError

_StorageKey = tuple[torch.device, int]


class HostPool:
    """Host buffers by size, reused across steps: pinned on CUDA, numpy-backed on CPU (not c10's
    allocator). `host_bytes` is what the buffers in use hold, `peak_host_bytes` its highest."""

    def __init__(self, pinned: bool) -> None:
        self.pinned = pinned
        self.free: dict[int, list[torch.Tensor]] = defaultdict(list)
        self.host_bytes = 0
        self.peak_host_bytes = 0
        self.allocated_bytes = 0  # every buffer the pool owns, free or in use

    def take(self, nbytes: int) -> torch.Tensor:
        free = self.free[nbytes]
        if free:
            buffer = free.pop()
        elif self.pinned:
            buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            self.allocated_bytes += nbytes
        else:
            buffer = torch.from_numpy(np.empty(nbytes, dtype=np.uint8))
            self.allocated_bytes += nbytes
        self.host_bytes += nbytes
        self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)
        return buffer

    def give(self, buffer: torch.Tensor) -> None:
        self.host_bytes -= buffer.numel()
        self.free[buffer.numel()].append(buffer)


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over the whole storage (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class _HostCopy:
    """One offloaded storage: its host buffer, and the device copy brought back (weakly held, so
    it lives only while a node uses it or a prefetch waits for its node)."""

    def __init__(self, offloader: Offloader, storage: torch.UntypedStorage, group: int) -> None:
        self.device = storage.device
        self.nbytes = storage.nbytes()
        self.group = group
        self.host = offloader.pool.take(self.nbytes)
        self.ready: Any = None  # a CUDA event: the device-to-host or host-to-device copy is done
        self.prefetched: torch.UntypedStorage | None = None
        self.back: weakref.ref[torch.UntypedStorage] | None = None
        source = _bytes_of(storage)
        stream = offloader.stream
        if stream is None:
            self.host.copy_(source)
        else:
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                self.host.copy_(source, non_blocking=True)
                source.record_stream(stream)  # the allocator keeps it until the copy is done
                self.ready = torch.cuda.Event()
                self.ready.record(stream)
        weakref.finalize(self, offloader.pool.give, self.host)

    def fetch(self, stream: Any) -> torch.UntypedStorage:
        """Start bringing the storage back (on `stream` when there is one); return its device copy."""
        alive = self.back() if self.back is not None else None
        if alive is not None:
            return alive
        back = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
        if stream is None:
            back.copy_(self.host)
        else:
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                if self.ready is not None:
                    stream.wait_event(self.ready)
                back.copy_(self.host, non_blocking=True)
                back.record_stream(stream)
                self.ready = torch.cuda.Event()
                self.ready.record(stream)
        storage = back.untyped_storage()
        self.back = weakref.ref(storage)
        return storage


@dataclass(frozen=True)
class _Saved:
    """What the pack hook returns: the host copy and the view of its storage autograd saved."""

    copy: _HostCopy
    dtype: torch.dtype
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


@dataclass
class Offloader:
    """The hooks of one model: which blocks offload, the pool, and the step's copies."""

    blocks: tuple[str, ...]
    min_bytes: int
    pool: HostPool
    stream: Any = None
    excluded: set[_StorageKey] = field(default_factory=set)
    copies: dict[_StorageKey, tuple[weakref.ref[torch.UntypedStorage], _HostCopy]] = field(
        default_factory=dict
    )
    groups: dict[int, list[weakref.ref[_HostCopy]]] = field(
        default_factory=lambda: defaultdict(list)
    )
    group: int = 0
    #: a block that offloads only some of its storages (group -> their places in the order its
    #: forward first saves them, as `remat.planning.offload.block_storages` numbers them)
    chosen: dict[int, frozenset[int]] = field(default_factory=dict)
    places: dict[int, dict[_StorageKey, tuple[Any, int]]] = field(
        default_factory=lambda: defaultdict(dict)
    )
    #: how many storages each group has numbered: not len(places[group]), which stays put when a
    #: new storage comes at the address of a freed one and takes over its key
    numbered: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    offloaded_bytes: int = 0  # the storages the latest forward copied, each once
    enabled: bool = True  # off: every save stays on the device (`remat.verify` measures both)
    active: int = 0  # how many offloaded blocks' forwards are running (the cache offloads there)

    def __getstate__(self) -> dict[str, Any]:
        """A copy (`copy.deepcopy`, `pickle`, `torch.save` of the planned model) starts with no
        step under way, an empty pool and, on CUDA, its own side stream."""
        skip = ("copies", "groups", "places", "numbered", "stream")
        state = {k: v for k, v in vars(self).items() if k not in skip}
        state["pool"] = HostPool(self.pool.pinned)
        state["excluded"] = set()
        state["cuda_stream"] = self.stream is not None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        cuda = state.pop("cuda_stream")
        vars(self).update(
            state,
            copies={},
            groups=defaultdict(list),
            places=defaultdict(dict),
            numbered=defaultdict(int),
        )
        self.stream = torch.cuda.Stream() if cuda else None

    def pack(self, t: torch.Tensor) -> Any:
        if not self.enabled:
            return t.detach()
        storage = t.untyped_storage()
        key = (storage.device, storage.data_ptr())
        if key in self.excluded or storage.nbytes() < self.min_bytes or type(t) is not torch.Tensor:
            return t.detach()  # parameters (and other subclasses), inputs, small tensors stay
        if self.group in self.chosen and not self._chosen(key, storage):
            return t.detach()
        known = self.copies.get(key)
        if known is not None and known[0]() is storage:
            copy = known[1]
        else:
            copy = _HostCopy(self, storage, self.group)
            self.copies[key] = (weakref.ref(storage), copy)
            self.groups[self.group].append(weakref.ref(copy))
            self.offloaded_bytes += copy.nbytes
        return _Saved(copy, t.dtype, t.size(), t.stride(), t.storage_offset())

    def _chosen(self, key: _StorageKey, storage: torch.UntypedStorage) -> bool:
        """Whether the plan offloads this storage of the running block: its place in the order
        the block's forward first saves its storages is among the chosen ones."""
        places = self.places[self.group]
        known = places.get(key)
        if known is None or known[0]() is not storage:
            known = places[key] = (weakref.ref(storage), self.numbered[self.group])
            self.numbered[self.group] += 1
        return known[1] in self.chosen[self.group]

    def unpack(self, saved: Any) -> torch.Tensor:
        if isinstance(saved, torch.Tensor):
            return saved
        copy = saved.copy
        storage = copy.fetch(self.stream)
        if self.stream is not None:
            for earlier in self.groups.get(copy.group - 1, ()):  # prefetch the block before
                other = earlier()
                if other is not None and other.prefetched is None:
                    other.prefetched = other.fetch(self.stream)
            copy.prefetched = None  # the node holds it from here
            torch.cuda.current_stream(copy.device).wait_event(copy.ready)
        out = torch.empty(0, dtype=saved.dtype, device=copy.device)
        return out.set_(storage, saved.offset, saved.size, saved.stride)

    # -- scope: the hooks are pushed while an offloaded block's forward runs ---------------------
    def start_step(self, model: nn.Module, args: Any, kwargs: Any) -> None:
        """Root pre-hook: forget the last step's copies; parameters, buffers and inputs stay."""
        self.copies.clear()
        self.groups.clear()
        self.places.clear()
        self.numbered.clear()
        self.group = 0
        self.offloaded_bytes = 0
        self.excluded = {
            (t.untyped_storage().device, t.untyped_storage().data_ptr())
            for t in [*model.parameters(), *model.buffers(), *_tensors((args, kwargs))]
        }


def _tensors(obj: Any) -> list[torch.Tensor]:
    leaves, _ = torch.utils._pytree.tree_flatten(obj)
    return [x for x in leaves if isinstance(x, torch.Tensor)]


class _Enter:
    def __init__(self, offloader: Offloader, group: int) -> None:
        self.offloader, self.group = offloader, group
        self.active: list[Any] = []

    def __call__(self, module: nn.Module, args: Any) -> None:
        self.offloader.group = self.group
        self.offloader.active += 1
        hooks = torch.autograd.graph.saved_tensors_hooks(self.offloader.pack, self.offloader.unpack)
        hooks.__enter__()
        self.active.append(hooks)


class _Leave:
    def __init__(self, enter: _Enter) -> None:
        self.enter = enter

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        self.enter.active.pop().__exit__(None, None, None)
        self.enter.offloader.active -= 1


class OffloadingCache(dict):
    """A selective-checkpoint cache (the `storage` torch's `_CachingTorchDispatchMode` fills and
    `_CachedTorchDispatchMode` reads: op key -> {call index -> entry}) whose entries for kept ops
    that are not views, made while an offloaded block's forward runs, hold a host copy instead of
    the output (`Offloader.pack`: parameters, inputs and storages under `min_bytes` stay). The
    cache then keeps no device copy; the replay gets it back (`Offloader.unpack`) when it reaches
    the op. The policy says which call comes next (`next_to_host`), just before torch stores it.
    A host copy is the value at the time of caching, so torch's check that a cached tensor was not
    modified in place has nothing to check for it."""

    def __init__(self, offloader: Offloader) -> None:
        super().__init__()
        self.offloader = offloader
        self.next_to_host = False

    def __missing__(self, key: Any) -> dict[int, Any]:
        entries = self[key] = _CacheEntries(self)
        return entries


class _CacheEntries(dict):
    def __init__(self, cache: OffloadingCache) -> None:
        super().__init__()
        self.cache = cache

    def __setitem__(self, index: int, entry: Any) -> None:
        cache, offloader = self.cache, self.cache.offloader
        if cache.next_to_host and offloader.active and offloader.enabled:
            entry = torch.utils._pytree.tree_map(self._to_host, entry)
        cache.next_to_host = False
        super().__setitem__(index, entry)

    def _to_host(self, wrapped: Any) -> Any:
        value = getattr(wrapped, "val", None)
        if not isinstance(value, torch.Tensor):
            return wrapped
        packed = self.cache.offloader.pack(value)
        return wrapped if isinstance(packed, torch.Tensor) else _CachedOnHost(self.cache, packed)


class _CachedOnHost:
    """A cache entry's value on the host; `get_val` (what the replay calls) brings it back."""

    def __init__(self, cache: OffloadingCache, packed: Any) -> None:
        self.cache, self.packed = cache, packed

    def get_val(self, allow_cache_entry_mutation: bool) -> torch.Tensor:
        return self.cache.offloader.unpack(self.packed)


def install(
    model: nn.Module,
    blocks: tuple[str, ...],
    min_bytes: int,
    chosen: Mapping[str, Collection[int]] | None = None,
) -> tuple[Offloader, list]:
    """Push the offloading hooks around each of `blocks`' forward; returns the offloader and the
    hook handles to remove. A block in `chosen` offloads only the storages at those places in
    the order its forward first saves them (`Plan.offload_saves`). Refused for a block the model
    does not have."""
    named = dict(model.named_modules())
    missing = [p for p in blocks if p not in named]
    if missing:
        raise RematError(
            f"plan offload: the model has no submodule {missing[0]!r}; the plan was made for "
            "another architecture"
        )
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    cuda = device.type == "cuda"
    offloader = Offloader(
        blocks, min_bytes, HostPool(pinned=cuda), torch.cuda.Stream(device) if cuda else None
    )
    handles = [model.register_forward_pre_hook(offloader.start_step, with_kwargs=True)]
    for group, path in enumerate(blocks, start=1):
        if chosen and path in chosen:
            offloader.chosen[group] = frozenset(chosen[path])
        enter = _Enter(offloader, group)
        handles.append(named[path].register_forward_pre_hook(enter))
        handles.append(named[path].register_forward_hook(_Leave(enter), always_call=True))
    return offloader, handles
