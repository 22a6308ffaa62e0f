"""The GPUs people train on: how much memory each has, how much of it a step may use, and the cost
profile (`remat.cost.PROFILES`) its recomputation is priced with.

`get_gpu("h100")` finds a catalogue entry (names are case-insensitive, with or without the vendor,
spaces or dashes: "H100", "h100-80gb", "NVIDIA H100 80GB"); `get_gpu("70GiB")` is a device of any
other capacity, priced with `DEFAULT_CUSTOM_PROFILE`. `usable_bytes(gpu)` is what a training step
may allocate on it: its capacity less `DEFAULT_RESERVE`, the CUDA context and the allocator's
fragmentation, which `remat.estimate` does not count (it counts the bytes of tensor storages).

Nothing here imports torch.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace

from remat.cost import PROFILES
from remat.errors import BudgetError, UnknownProfileError
from remat.units import format_bytes, parse_bytes


@dataclass(frozen=True)
class Gpu:
    """A device: its memory as the runtime reports it (`torch.cuda.get_device_properties(i)
    .total_memory`), in bytes, and the name of its cost profile in `remat.cost.PROFILES`."""

    name: str
    capacity_bytes: int
    profile: str
    description: str = ""
    aliases: tuple[str, ...] = ()

    def usable_bytes(self, reserve: Reserve | int | str | None = None) -> int:
        """`usable_bytes(self, reserve)`."""
        return usable_bytes(self, reserve)


@dataclass(frozen=True)
class Reserve:
    """Memory a training step cannot have: `context_bytes` outside PyTorch's caching allocator
    (the CUDA/ROCm context, library workspaces, communication buffers) plus `fragmentation`, a
    share of the capacity that the allocator holds in segments it cannot hand out whole."""

    context_bytes: int
    fragmentation: float

    def bytes_for(self, capacity_bytes: int) -> int:
        return self.context_bytes + math.ceil(self.fragmentation * capacity_bytes)


#: The default reserve: 1 GiB + 5% of the capacity.
#:
#: - 1 GiB outside the allocator: the CUDA context with PyTorch's kernels loaded takes about
#:   0.3-0.6 GiB on a data-center GPU (`nvidia-smi` shows it next to a process that allocated
#:   nothing), cuBLAS/cuDNN workspaces tens of MiB more, and NCCL's buffers a few hundred MiB once
#:   a process group is up, none of which `torch.cuda.memory_allocated` (nor `remat.estimate`)
#:   counts.
#: - 5% for fragmentation: the caching allocator rounds every block up (to 512 B, and large ones
#:   to 2 MiB segments) and cannot merge free blocks across segments, so the memory it reserves at
#:   the peak runs a few percent above the bytes allocated; 5% is the usual rule of thumb
#:   (`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` lowers it).
DEFAULT_RESERVE = Reserve(context_bytes=2**30, fragmentation=0.05)

#: The cost profile of a device known only by its capacity (`get_gpu("70GiB")`).
DEFAULT_CUSTOM_PROFILE = "h100"

GB = 10**9

#: The catalogue, by canonical name. Capacities are the vendor's "GB" figure x 1e9: the exact
#: `total_memory` of each was not measured for this table. The runtime reports the HBM/GDDR the
#: driver leaves to applications, which on these parts is expected to be somewhat above the
#: marketing figure in decimal GB (80 GB of HBM3 is 80 GiB of chips less the driver's share), so
#: these capacities are meant as a slight underestimate, not an exact total_memory.
GPUS: dict[str, Gpu] = {
    g.name: g
    for g in (
        Gpu("h100-80gb", 80 * GB, "h100", "NVIDIA H100 80GB (SXM5 / PCIe)", ("h100",)),
        Gpu("h200-141gb", 141 * GB, "h200", "NVIDIA H200 141GB", ("h200",)),
        Gpu("a100-40gb", 40 * GB, "a100-40gb", "NVIDIA A100 40GB"),
        Gpu("a100-80gb", 80 * GB, "a100", "NVIDIA A100 80GB", ("a100",)),
        Gpu("l4-24gb", 24 * GB, "l4", "NVIDIA L4 24GB", ("l4",)),
        Gpu(
            "rtx4090-24gb", 24 * GB, "rtx4090", "NVIDIA GeForce RTX 4090 24GB", ("rtx4090", "4090")
        ),
        Gpu("mi300x-192gb", 192 * GB, "mi300x", "AMD Instinct MI300X 192GB", ("mi300x",)),
    )
}

_VENDOR_WORDS = ("nvidia", "amd", "geforce", "instinct", "radeon")


def _key(name: str) -> str:
    """A name folded for lookup: lower case, letters and digits only, vendor words dropped."""
    key = re.sub(r"[^a-z0-9]", "", name.lower())
    for word in _VENDOR_WORDS:
        key = key.removeprefix(word)
    return key


_BY_KEY: dict[str, Gpu] = {_key(alias): g for g in GPUS.values() for alias in (g.name, *g.aliases)}


def gpu_names() -> list[str]:
    """The catalogue's canonical names, sorted."""
    return sorted(GPUS)


def custom_gpu(capacity: int | str, profile: str = DEFAULT_CUSTOM_PROFILE) -> Gpu:
    """A device with `capacity` bytes ("70GiB", "80e9", an int) priced with cost profile `profile`.
    Raises `UnknownProfileError` for an unknown profile, `BudgetError` for an unreadable size or a
    text under 1 GiB (a number without a unit is bytes: "40" is 40 bytes, write "40GB"); an int is
    taken as given (small devices in tests)."""
    capacity_bytes = parse_bytes(capacity)
    if capacity_bytes < 1 or (isinstance(capacity, str) and capacity_bytes < 2**30):
        raise BudgetError(
            f"a GPU of {format_bytes(capacity_bytes)} ({capacity!r})? Give its memory with a unit, "
            "e.g. 70GiB or 80GB"
        )
    _check_profile(profile)
    return Gpu(
        f"custom-{capacity}", capacity_bytes, profile, f"a {format_bytes(capacity_bytes)} GPU"
    )


def get_gpu(gpu: Gpu | str, profile: str | None = None) -> Gpu:
    """A catalogue entry by name (case-insensitive; "h100", "H100-80GB", "nvidia h100 80gb", "4090"),
    a device of any capacity given as a size ("70GiB": `custom_gpu`), or the `Gpu` given. `profile`
    replaces the entry's cost profile. Raises `UnknownProfileError` listing the known names."""
    if isinstance(gpu, Gpu):
        found = gpu
    else:
        found = _BY_KEY.get(_key(str(gpu)))
        if found is None:
            try:
                return custom_gpu(gpu, profile or DEFAULT_CUSTOM_PROFILE)
            except BudgetError:
                raise UnknownProfileError(
                    f"unknown GPU {gpu!r}: choose one of {', '.join(gpu_names())}, or give its "
                    "memory as a size (e.g. 70GiB)"
                ) from None
    if profile is not None and profile != found.profile:
        _check_profile(profile)
        found = replace(found, profile=profile)
    return found


def reserve_bytes(gpu: Gpu | str, reserve: Reserve | int | str | None = None) -> int:
    """The bytes `reserve` takes on `gpu`: `DEFAULT_RESERVE` when None, a `Reserve`, or a fixed size
    (bytes, "2GiB")."""
    g = get_gpu(gpu)
    if reserve is None:
        reserve = DEFAULT_RESERVE
    if isinstance(reserve, Reserve):
        return reserve.bytes_for(g.capacity_bytes)
    return parse_bytes(reserve)


def usable_bytes(gpu: Gpu | str, reserve: Reserve | int | str | None = None) -> int:
    """The memory a training step may allocate on `gpu` (a `Gpu` or anything `get_gpu` takes): its
    capacity less `reserve` (`reserve_bytes`; `DEFAULT_RESERVE`, 1 GiB + 5%, when None). This is
    the figure to compare with `remat.estimate(...).peak_bytes` or to plan under as a budget.
    Raises `BudgetError` when the reserve leaves nothing."""
    g = get_gpu(gpu)
    left = g.capacity_bytes - reserve_bytes(g, reserve)
    if left <= 0:
        raise BudgetError(
            f"the reserve takes all of {g.name}'s {format_bytes(g.capacity_bytes)}: give a smaller one"
        )
    return left


def _check_profile(profile: str) -> None:
    if profile not in PROFILES:
        raise UnknownProfileError(
            f"unknown device profile {profile!r}: choose one of {', '.join(sorted(PROFILES))}"
        )
