"""What the roofline cost model (`remat.device.cost`, which imports no torch) needs to know of
the machine at hand, timed on it: a `DeviceProfile`'s rates (`calibrate_rates`), checkpointing's
own host cost (`checkpoint_overheads`), both (`calibrate_profile`). `remat.measuring.measure`
re-exports them. Nothing here draws from torch's global random generators: `remat.auto` runs this
inside training scripts, whose random stream (dropout masks, shuffling) must not move."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from remat.device.cost import DeviceProfile

__all__ = ["calibrate_profile", "calibrate_rates", "checkpoint_overheads"]


def calibrate_profile(device: str = "cpu") -> DeviceProfile:
    """Measure `device` instead of trusting `remat.device.cost.PROFILES`: the roofline's rates
    (`calibrate_rates`) and what checkpointing itself costs on the host
    (`checkpoint_overheads`: a checkpointed chain of tiny ops). Takes well under 3 s on a 2-core
    CPU and draws no random numbers from torch's global generators."""
    # Imported here, not at the top: the measurement of a training step shares no code with the
    # graph side of remat, and only this function needs the profile type.
    from remat.device.cost import PROFILES, DeviceProfile

    dev = torch.device(device)
    region, per_op = checkpoint_overheads(dev)
    return DeviceProfile(
        f"{device} (calibrated)",
        **calibrate_rates(dev),
        region_seconds=region,
        policy_op_seconds=per_op,
        # the interconnect is not timed here (no process group): the shipped CPU profile's gloo
        # figure on CPU, NVLink 4's on a GPU
        link_bandwidth=PROFILES["cpu"].link_bandwidth if dev.type == "cpu" else 450e9,
    )


def calibrate_rates(dev: torch.device) -> dict[str, Any]:
    """The roofline's rates on `dev`, as `DeviceProfile` fields: the median of a few runs of a
    square matmul (fp32 1024^3 on CPU, bf16 4096^3 on a GPU: `peak_flops`), of a cache-resident
    `addcmul` (2 FLOPs an element: `vector_flops`), of `sin`, `exp` and `tanh` on the same data
    (what a transcendental element costs in vector operations: `transcendental_ops`), of GELU,
    SiLU, softmax and log-softmax on it (`element_ops`, the same unit), of a 64 MiB
    copy (bytes read + written: `bandwidth`) and of a causal SDPA forward (GPT-2's attention on
    CPU, batch 4, 12 heads, seq 256, head dim 64; a GPU's bf16 at seq 2048, head dim 128),
    counted as torch's FLOP counter counts it (`attention_flops`). On the CPU with one intra-op
    thread, the thread's CPU time, as `checkpoint_overheads` reads it: a machine other processes
    share slows every kind of op alike on the wall clock, but not the Python the overheads are,
    and the two must be read on one clock to be added. Random inputs come from a generator of
    their own: this runs inside training scripts (`remat.auto`), whose random stream must not
    move."""
    from torch.utils.flop_counter import sdpa_flop_count

    gen = torch.Generator().manual_seed(0)
    draws = torch.Generator(device=dev).manual_seed(0)  # bernoulli_ draws on `dev`'s generator

    def rand(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.rand(*shape, generator=gen).to(device=dev, dtype=dtype)

    one_thread = dev.type == "cpu" and torch.get_num_threads() == 1
    clock = time.thread_time if one_thread else time.perf_counter

    def seconds(fn: Callable[[], object]) -> float:
        return _median_seconds(fn, dev, reps=5, clock=clock)

    n, dtype = (4096, torch.bfloat16) if dev.type == "cuda" else (1024, torch.float32)
    a, b, c = rand(n, n, dtype=dtype), rand(n, n, dtype=dtype), rand(n, n, dtype=dtype)
    peak = 2 * n**3 / seconds(lambda: torch.mm(a, b, out=c))

    m = 1 << 16  # 3 x 256 KiB: stays in cache, so arithmetic rather than memory bounds it
    x, y, z, w = (rand(m) for _ in range(4))
    loops = 50

    def pointwise() -> None:
        for _ in range(loops):
            torch.addcmul(x, y, z, out=w)

    vector = 2 * m * loops / seconds(pointwise)

    def transcendental() -> None:
        for _ in range(loops):
            torch.sin(x, out=w)
            torch.exp(x, out=w)
            torch.tanh(x, out=w)

    transcendental_ops = vector * seconds(transcendental) / (3 * m * loops)

    # the pointwise kinds a transformer's replay recomputes most, by their own kernels, written
    # into `w` as the rest are: GELU (the mean of erf's and tanh's, nn.GELU's and GPT-2's), SiLU,
    # softmax and log-softmax over rows of 256 (the SDPA math path's, which zeroes masked rows,
    # too), and dropout's mask (`bernoulli_`, drawn from the
    # generator of its own)
    aten = torch.ops.aten
    rows, out_rows = x.view(-1, 256), w.view(-1, 256)
    kinds: dict[str, Callable[[], object]] = {
        "gelu": lambda: (aten.gelu.out(x, out=w), aten.gelu.out(x, approximate="tanh", out=w)),
        "silu": lambda: aten.silu.out(x, out=w),
        "_softmax": lambda: aten._softmax.out(rows, -1, False, out=out_rows),
        "_log_softmax": lambda: aten._log_softmax.out(rows, -1, False, out=out_rows),
        "_safe_softmax": lambda: aten._safe_softmax(rows, -1),  # the math path's (allocates)
        "bernoulli_": lambda: w.bernoulli_(0.9, generator=draws),
    }
    calls = {"gelu": 2}

    def element_cost(fn: Callable[[], object], name: str) -> float:
        def run() -> None:
            for _ in range(loops):
                fn()

        return vector * seconds(run) / (calls.get(name, 1) * m * loops)

    element_ops = tuple((name, max(element_cost(fn, name), 1.0)) for name, fn in kinds.items())

    src = rand(1 << 24)
    dst = torch.empty_like(src)
    moved = 2 * src.numel() * src.element_size()
    bandwidth = moved / seconds(lambda: dst.copy_(src))

    shape = (4, 16, 2048, 128) if dev.type == "cuda" else (4, 12, 256, 64)
    q, k, v = (rand(*shape, dtype=dtype) for _ in range(3))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    with torch.no_grad():
        attention = sdpa_flop_count(shape, shape, shape) / seconds(
            lambda: sdpa(q, k, v, is_causal=True)
        )
    return {
        "peak_flops": peak,
        "vector_flops": vector,
        "bandwidth": bandwidth,
        "transcendental_ops": max(transcendental_ops, 1.0),
        "attention_flops": attention,
        "element_ops": element_ops,
    }


class _Sin(nn.Module):
    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return torch.sin(t)


def checkpoint_overheads(dev: torch.device, ops: int = 48, reps: int = 15) -> tuple[float, float]:
    """Host seconds that non-reentrant `checkpoint` adds per region, and that a selective policy
    as `remat.applying.eager` runs it adds per op, beyond the ops' own work: a chain of `ops`
    modules each running one `sin` on 16 elements (each saves its input, as a transformer block's
    ops do; their arithmetic is negligible) is timed forward and backward plain, forward alone,
    under `checkpoint`, and under `checkpoint` with what a selective region adds: a policy that
    finds each op by (module, op, occurrence) in a set and recomputes it, and the module-scope
    hooks that tell it the module (a forward pre-hook and hook on every module, run in the
    forward and again in the replay). The region costs what checkpointing adds beyond one more
    forward; the policy, per op it sees (every op in the forward and again in the replay), what it
    adds beyond plain checkpointing: measured so, not with a bare policy, because the hooks and
    the lookup cost as much again as torch's policy mode (39 us an op against 22 on this project's
    2-core VM). Rounds are interleaved; each figure is a median, at least 0; on the CPU, of the
    thread's CPU time (below)."""
    from torch.utils.checkpoint import (
        CheckpointPolicy,
        checkpoint,
        create_selective_checkpoint_contexts,
    )

    # no random numbers: this runs inside training scripts (remat.auto), whose random stream
    # (dropout masks, shuffling) must not move
    x = torch.linspace(0.1, 1.0, 16, device=dev, requires_grad=True)
    plain_chain = nn.Sequential(*(_Sin() for _ in range(ops)))
    scoped_chain = nn.Sequential(*(_Sin() for _ in range(ops)))
    scope = [""]

    def enter(module: nn.Module, args: Any) -> None:
        scope.append(paths[module])

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        scope.pop()

    paths = {module: path for path, module in scoped_chain.named_modules()}
    for module in paths:
        module.register_forward_pre_hook(enter)
        module.register_forward_hook(leave, always_call=True)
    keep = frozenset({("no such module", "aten.sin.default", 0)})

    def contexts():
        counts: tuple[dict, dict] = ({}, {})

        def policy(ctx, func, *args, **kwargs):  # remat.applying.eager's: a key, a count, a set
            at = (scope[-1], str(func))
            seen = counts[ctx.is_recompute]
            n = seen.get(at, 0)
            seen[at] = n + 1
            if (*at, n) in keep:
                return CheckpointPolicy.MUST_SAVE
            return CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(policy)

    runs: dict[str, Callable[[], object]] = {
        "plain": lambda: plain_chain(x).sum().backward(),
        "forward": lambda: plain_chain(x),
        "checkpoint": lambda: (
            checkpoint(plain_chain, x, use_reentrant=False, preserve_rng_state=False)
            .sum()
            .backward()
        ),
        "policy": lambda: (
            checkpoint(
                scoped_chain, x, use_reentrant=False, preserve_rng_state=False, context_fn=contexts
            )
            .sum()
            .backward()
        ),
    }
    # On the CPU, this thread's CPU time: what the Python costs, as the profile's roofline prices
    # the ops' work, whatever else the machine runs. Wall time on a CPU that other processes
    # share counts their turns too: at load 13 on 2 cores it read 67 us an op of torch's policy
    # mode where the thread worked 12, and the planner, its ops priced unloaded, ranked
    # selective regions 5x too dear (full checkpointing over them). A GPU's host overhead is
    # wall time: the kernels it waits for are not the thread's.
    clock = time.thread_time if dev.type == "cpu" else time.perf_counter
    times: dict[str, list[float]] = {name: [] for name in runs}
    with torch.enable_grad():
        for _ in range(reps):
            for name, fn in runs.items():
                times[name].append(_median_seconds(fn, dev, reps=3, clock=clock))
    med = {name: statistics.median(t) for name, t in times.items()}
    region = med["checkpoint"] - med["plain"] - med["forward"]
    per_op = (med["policy"] - med["checkpoint"]) / (2 * ops)
    return max(region, 0.0), max(per_op, 0.0)


def _median_seconds(
    fn: Callable[[], object],
    device: torch.device,
    reps: int,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    fn()  # warm-up: first-call dispatch, allocator, thread pool
    _synchronize(device)
    times = []
    for _ in range(reps):
        start = clock()
        fn()
        _synchronize(device)
        times.append(clock() - start)
    return statistics.median(times)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
