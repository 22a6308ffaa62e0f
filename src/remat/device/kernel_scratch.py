"""Kernel scratch measured on this machine: bytes a kernel allocates and frees inside its op.

oneDNN's convolution on the CPU allocates outside its outputs: a reorder of the weight (and of
the input or output) into a blocked layout in the forward; in the backward a weight-sized buffer
per thread for the weight gradient's reduction and a scratchpad. How much depends on the shapes,
strides, the ISA oneDNN picked and the thread count, so no formula from the shapes holds; the
trace instead runs each such op once on real CPU tensors of the traced shapes (zeros) and reads
its peak from the profiler's allocation events. The scratch is that peak less the op's outputs,
which the timeline already counts (`schedule.live_bytes`), so the op's position in the predicted
timeline equals its measured peak. Results are cached per op and signature for the process.

Collectives on gloo (CPU process groups) allocate too, by a rule measured on gloo:
`gloo_collective_scratch_bytes`. NCCL's buffers live outside torch's allocator (`remat.device.gpus`
counts them as fixed memory), and torch's fake process group allocates nothing.

CUDA kernels' scratch is not measured here (no GPU needed to predict): `remat.device.targets`
models the known cases (attention backwards, BLAS copies); cuDNN's convolution workspace is
not modelled (docs/memory-model.md).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import _disable_current_modes

from remat.quiet import quiet_fd

#: The ops whose CPU kernels allocate scratch through torch's allocator, by aten packet name.
MEASURED_ON_CPU = frozenset({"convolution", "convolution_backward"})

_cache: dict[tuple[Any, ...], int] = {}


def _signature(func: Any, args: tuple, kwargs: dict) -> tuple[Any, ...]:
    def key(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return ("tensor", tuple(x.shape), tuple(x.stride()), x.dtype)
        return x

    return (
        str(func),
        torch.get_num_threads(),
        *pytree.tree_leaves(pytree.tree_map(key, (args, kwargs))),
    )


def _zeros_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype).zero_()


def _available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def cpu_scratch_bytes(func: Any, args: tuple, kwargs: dict, outs: list[torch.Tensor]) -> int | None:
    """The scratch of `func(*args, **kwargs)` on this CPU, measured; None when the op's tensors
    would take more than a quarter of the memory available now (the shape rule applies then)."""
    signature = _signature(func, args, kwargs)
    if signature in _cache:
        return _cache[signature]
    tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    footprint = sum(t.untyped_storage().nbytes() for t in tensors + outs)
    if 4 * footprint > _available_bytes():
        return None
    with _disable_current_modes(), torch.no_grad(), torch.autocast("cpu", enabled=False):
        real_args, real_kwargs = pytree.tree_map_only(torch.Tensor, _zeros_like, (args, kwargs))
        prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        with quiet_fd(2):
            prof.__enter__()
        try:
            out = func(*real_args, **real_kwargs)
        finally:
            with quiet_fd(2):
                prof.__exit__(None, None, None)
        allocation = torch._C._profiler._EventType.Allocation
        events = sorted(
            (
                (e.start_time_ns, e.extra_fields.alloc_size)
                for e in _walk(prof.profiler.kineto_results.experimental_event_tree())
                if e.tag == allocation and e.extra_fields.device.type == "cpu"
            ),
            key=lambda event: event[0],  # stable: equal timestamps keep the tree's order
        )
        live = peak = 0
        for _, size in events:
            live += size
            peak = max(peak, live)
        outputs = {
            t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in pytree.tree_leaves(out)
            if isinstance(t, torch.Tensor)
        }
        del out
    _cache[signature] = max(0, peak - sum(outputs.values()))
    return _cache[signature]


def gloo_collective_scratch_bytes(short: str, args: tuple, outs: list[torch.Tensor]) -> int:
    """Bytes a functional collective on gloo allocates and frees beyond its output, as the
    profiler's allocation events show on torch 2.13 (`docs/parallelism.md`): an all-gather
    stages the gathered tensor once more (one output's bytes), a reduce-scatter copies its input
    (one input's bytes); an all-reduce works in its output."""
    if short == "all_gather_into_tensor":
        return sum(t.nbytes for t in outs)
    if short == "reduce_scatter_tensor":
        return int(args[0].nbytes)
    return 0


def _walk(events: Any) -> Any:
    for event in events:
        yield event
        yield from _walk(event.children)


def process_group_backend() -> str | None:
    """The default process group's backend ("gloo", "nccl", "fake"), None without one: gloo's
    collectives allocate beyond their outputs (`gloo_collective_scratch_bytes`)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None
    return str(dist.get_backend())
