"""The GPUs people train on: how much memory each has, what a training process holds on it besides
its tensors, and the cost profile (`remat.device.cost.PROFILES`) its recomputation is priced with.

`get_gpu("h100")` finds a catalogue entry (names are case-insensitive, with or without the vendor,
spaces or dashes: "H100", "h100-80gb", and the names torch reports, "NVIDIA H100 80GB HBM3",
"Tesla V100-SXM2-16GB"); `get_gpu("70GiB")` is a device of any other capacity, priced with
`DEFAULT_CUSTOM_PROFILE`.

Every figure carries its source. A GPU's `capacity_bytes` is the `total_memory` torch reports on it
(`torch.cuda.get_device_properties(i)`, the driver's `totalGlobalMem`), not the vendor's "80 GB".
What a process holds besides its tensors is itemised by `fixed_memory(gpu, ranks)`: the CUDA/ROCm
context and NCCL's buffers outside PyTorch's caching allocator, the cuBLAS workspaces inside it.
`usable_bytes(gpu)` is what a training step may allocate: the capacity less those lines and a
share for the allocator's fragmentation (the one figure here that is a rule of thumb), which
`remat.estimate` does not count (it counts the bytes of tensor storages).

Nothing here imports torch.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Literal

from remat.device import targets
from remat.device.cost import PROFILES
from remat.device.targets import Target
from remat.errors import BudgetError, UnknownProfileError
from remat.units import format_bytes, parse_bytes

MiB, GiB = 2**20, 2**30


@dataclass(frozen=True)
class Architecture:
    """A GPU generation as a training process meets it: its runtime (CUDA or ROCm) and the memory
    the runtime's context takes on the device when the process first touches it. The context lives
    outside PyTorch's caching allocator: `nvidia-smi` shows it against the process,
    `torch.cuda.memory_reserved()` does not. Since CUDA 11.7 kernels load lazily
    (`CUDA_MODULE_LOADING=LAZY`, which torch >= 1.13 sets by default: pytorch/pytorch#86509), so
    the context starts small and grows by the kernel images a step first launches; the figures are
    the context measured right after initialisation."""

    name: str
    runtime: Literal["cuda", "rocm"]
    context_bytes: int
    context_source: str


ARCHITECTURES: dict[str, Architecture] = {
    a.name: a
    for a in (
        Architecture(
            "volta",
            "cuda",
            256 * MiB,
            "estimate: no measurement of a lazily loaded context on a V100 was found; the Ampere "
            "figure (InvokeAI#9413, 256 MiB) is used",
        ),
        Architecture(
            "turing",
            "cuda",
            256 * MiB,
            "estimate: no measurement of a lazily loaded context on a T4 was found; the Ampere "
            "figure (InvokeAI#9413, 256 MiB) is used",
        ),
        Architecture(
            "ampere",
            "cuda",
            256 * MiB,
            "invoke-ai/InvokeAI#9413: a bare CUDA context holds 'a flat 256 MiB' in nvidia-smi on "
            "an RTX 3090 (GA102), torch 2.7.1+cu128, driver 610.43; pytorch/pytorch#86509 measured "
            "287,047,680 B total-free with lazy loading after one 6.4 MB tensor (its 20 MiB "
            "allocator segment included), 666,632,192 B with CUDA_MODULE_LOADING=DEFAULT. No A100 "
            "(GA100) measurement was found: the GA102 figure stands for the generation",
        ),
        Architecture(
            "ada",
            "cuda",
            426 * MiB,
            "unslothai/unsloth-zoo#1053: torch.cuda.mem_get_info(0) creates a context of 426 MiB "
            "in nvidia-smi (0 allocated / 0 reserved in torch) on an RTX 6000 Ada, torch "
            "2.10.0+cu130",
        ),
        Architecture(
            "hopper",
            "cuda",
            612 * MiB,
            "estimate: no Hopper measurement was found; the next data-center generation's is used, "
            "unslothai/unsloth#8669: torch.cuda.mem_get_info(0) leaves a 612 MiB context on a B200 "
            "(nvidia-smi --query-compute-apps), still 612 MiB after empty_cache()",
        ),
        Architecture(
            "blackwell",
            "cuda",
            612 * MiB,
            "unslothai/unsloth#8669: torch.cuda.mem_get_info(0) leaves a 612 MiB context on a B200 "
            "(nvidia-smi --query-compute-apps), still 612 MiB after empty_cache()",
        ),
        Architecture(
            "cdna3",
            "rocm",
            612 * MiB,
            "estimate: no measurement of a HIP context on an MI300X was found; the largest CUDA "
            "context measured (B200, unslothai/unsloth#8669, 612 MiB) is used. The allocator is "
            "modelled as CUDA's: torch's ROCm build hipifies c10/cuda/CUDACachingAllocator.cpp, "
            "so its rounding (512 B blocks, 2 MiB small and 20 MiB large-pool segments) and "
            "caching are the same code; PYTORCH_HIP_ALLOC_CONF is read as "
            "PYTORCH_CUDA_ALLOC_CONF. What differs is sized apart: the HIP context, and "
            "hipBLAS's and hipBLASLt's separate workspaces (blas_workspace_bytes)",
        ),
    )
}

#: The architecture of a device known only by its capacity: the largest context measured.
UNKNOWN_ARCHITECTURE = Architecture(
    "unknown",
    "cuda",
    612 * MiB,
    "estimate for a GPU of unknown architecture: the largest CUDA context measured (B200, "
    "unslothai/unsloth#8669, 612 MiB)",
)


@dataclass(frozen=True)
class Gpu:
    """A device: its memory as the runtime reports it (`torch.cuda.get_device_properties(i)
    .total_memory`), in bytes, the name of its cost profile in `remat.device.cost.PROFILES`, its compute
    capability as torch reports it (`major`, `minor`), its architecture (a key of `ARCHITECTURES`)
    and where `capacity_bytes` comes from."""

    name: str
    capacity_bytes: int
    profile: str
    description: str = ""
    aliases: tuple[str, ...] = ()
    compute_capability: tuple[int, int] | None = None
    arch: str = "unknown"
    source: str = ""
    #: the torch a run had, where older than the installed one (`remat.device.targets.cuda`)
    torch_version: tuple[int, int] | None = None
    #: the CUDA context a run measured, instead of its architecture's (`fixed_memory`)
    context_bytes: int | None = None
    #: streaming multiprocessors (the catalogue's: `MULTIPROCESSORS`); kept by `with_capacity`
    multiprocessors: int = 132

    @property
    def architecture(self) -> Architecture:
        return ARCHITECTURES.get(self.arch, UNKNOWN_ARCHITECTURE)

    @property
    def target(self) -> Target:
        """What a step on this GPU is traced for: the CUDA kernels of its compute capability (an
        sm90 GPU's when unknown), under the autograd of `torch_version`. ROCm's kernels are taken
        as CUDA's of the same capability."""
        return targets.cuda(
            self.compute_capability or (9, 0),
            torch_version=self.torch_version,
            multiprocessors=self.multiprocessors,
        )

    def usable_bytes(self, reserve: Reserve | int | str | None = None, ranks: int = 1) -> int:
        """`usable_bytes(self, reserve, ranks)`."""
        return usable_bytes(self, reserve, ranks)


@dataclass(frozen=True)
class Reserve:
    """A reserve of the user's own: `context_bytes` outside PyTorch's caching allocator plus
    `fragmentation`, a share of the capacity that the allocator holds in segments it cannot hand
    out whole. `usable_bytes(gpu, reserve=Reserve(...))` uses it instead of `fixed_memory`."""

    context_bytes: int
    fragmentation: float

    def bytes_for(self, capacity_bytes: int) -> int:
        return self.context_bytes + math.ceil(self.fragmentation * capacity_bytes)


#: The share of what the caching allocator may reserve that it holds in blocks it cannot hand out
#: whole at the peak. A rule of thumb, not a measurement: the allocator rounds every block up (to
#: 512 B; requests of 1-10 MiB take 20 MiB segments, larger ones round to 2 MiB) and cannot merge
#: free blocks across segments, so its reserved peak runs a few percent above the bytes allocated
#: (`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` lowers it).
FRAGMENTATION = 0.05

#: The cost profile of a device known only by its capacity (`get_gpu("70GiB")`).
DEFAULT_CUSTOM_PROFILE = "h100"


def _mib(n: int) -> int:
    """A `total_memory` printed in whole MiB (torch's repr floors total_memory / 2**20) as bytes."""
    return n * MiB


#: Streaming multiprocessors (compute units on AMD) of the catalogue's GPUs, which size how CUDA's
#: reductions split across blocks (`remat.device.targets.Target.multiprocessors`): torch's
#: `multi_processor_count` where the entries' sources print it, else the vendors' data sheets
#: (A100 108, L4 58, RTX 4090 128). A GPU not listed is taken as an H100 SXM (132).
MULTIPROCESSORS: dict[str, int] = {
    "h100-80gb": 132,
    "h100-96gb": 132,
    "h100-pcie-80gb": 114,
    "h200-141gb": 132,
    "a100-40gb": 108,
    "a100-80gb": 108,
    "l4-24gb": 58,
    "rtx4090-24gb": 128,
    "mi300x-192gb": 304,
    "b200-180gb": 148,
    "a10g-24gb": 80,
    "rtx3090-24gb": 82,
    "rtx4080-16gb": 76,
    "rtx4070-ti-super-16gb": 66,
    "t4-16gb": 40,
    "v100-16gb": 80,
    "v100-32gb": 80,
}

#: The catalogue, by canonical name. `capacity_bytes` is `total_memory` as torch (or deviceQuery,
#: which prints the same `cudaDeviceProp.totalGlobalMem`) reported it on that card: exact bytes
#: where the source prints them, else its whole MiB x 2**20 (at most 1 MiB under the truth). It is
#: less than `nvidia-smi`'s total (81559 MiB on an H100 SXM, 143771 MiB on an H200: the driver's
#: share is outside it) and drifts by tens of MiB with the driver version (the sources name theirs).
GPUS: dict[str, Gpu] = {
    g.name: replace(g, multiprocessors=MULTIPROCESSORS.get(g.name, g.multiprocessors))
    for g in (
        Gpu(
            "h100-80gb",
            85_045_477_376,
            "h100",
            "NVIDIA H100 80GB HBM3 (SXM5)",
            ("h100", "h100-sxm", "h100-80gb-hbm3"),
            (9, 0),
            "hopper",
            "github.com/thamada/nvidia-smi nvsim/H100SXMx8_deviceQuery.py: deviceQuery on 8 x "
            "'NVIDIA H100 80GB HBM3', driver CUDA 12.7: 'Total amount of global memory: 81106 "
            "MBytes (85045477376 bytes)', 132 SMs. torch prints the same card as 81082MB (torch "
            "2.0.1+cu118) to 81090MB in other public logs: the driver's share moves by ~25 MiB",
        ),
        Gpu(
            "h100-96gb",
            _mib(97320),
            "h100",
            "NVIDIA H100 96GB HBM3 (the 96 GB H100 of torchtitan's published FSDP2 runs)",
            ("h100-96gb-hbm3",),
            (9, 0),
            "hopper",
            "pytorch/torchtitan commit 83c879f ('Used per-parameter FSDP (#165)'): memory logged "
            "as a share of total_memory, 'can convert against 95.0396 GiB GPU memory' on 8 H100s "
            "(95.0396 GiB = 97320.55 MiB: 97320 MiB taken)",
        ),
        Gpu(
            "h100-pcie-80gb",
            _mib(81008),
            "h100-pcie",
            "NVIDIA H100 PCIe 80GB",
            ("h100-pcie",),
            (9, 0),
            "hopper",
            "a public repro script's output (found by the code index; its repository could not be "
            "identified): torch 2.0.1+cu117 prints _CudaDeviceProperties(name='NVIDIA H100 PCIe', "
            "major=9, minor=0, total_memory=81008MB, multi_processor_count=114)",
        ),
        Gpu(
            "h200-141gb",
            _mib(143156),
            "h200",
            "NVIDIA H200 141GB (SXM)",
            ("h200",),
            (9, 0),
            "hopper",
            "github.com/ai-bot-pro/achatbot deploy/modal/src/llm/vllm/vlm/skywork_r1v.py: torch "
            "2.6 on Modal prints _CudaDeviceProperties(name='NVIDIA H200', major=9, minor=0, "
            "total_memory=143156MB, multi_processor_count=132, L2_cache_size=60MB); nvidia-smi "
            "shows 143771MiB for the card (kvcache-ai/Mooncake#2307)",
        ),
        Gpu(
            "a100-40gb",
            42_298_834_944,
            "a100-40gb",
            "NVIDIA A100-SXM4-40GB",
            ("a100-sxm4-40gb",),
            (8, 0),
            "ampere",
            "bottlerocket-os/bottlerocket#3873: deviceQuery on 'NVIDIA A100-SXM4-40GB', driver "
            "CUDA 12.2: 'Total amount of global memory: 40339 MBytes (42298834944 bytes)'",
        ),
        Gpu(
            "a100-80gb",
            85_100_068_864,
            "a100",
            "NVIDIA A100-SXM4-80GB",
            ("a100", "a100-sxm4-80gb"),
            (8, 0),
            "ampere",
            "github.com/thamada/nvidia-smi gls/A100SXMx4_deviceQuery.py: deviceQuery on 4 x "
            "'NVIDIA A100-SXM4-80GB', driver CUDA 12.5: 'Total amount of global memory: 81158 "
            "MBytes (85100068864 bytes)'",
        ),
        Gpu(
            "l4-24gb",
            23_570_219_008,
            "l4",
            "NVIDIA L4 24GB",
            ("l4",),
            (8, 9),
            "ada",
            "github.com/thamada/nvidia-smi gls/L4_deviceQuery.py: deviceQuery on 'NVIDIA L4', "
            "driver CUDA 12.4: 'Total amount of global memory: 22478 MBytes (23570219008 bytes)'",
        ),
        Gpu(
            "rtx4090-24gb",
            25_386_352_640,
            "rtx4090",
            "NVIDIA GeForce RTX 4090 24GB",
            ("rtx4090", "4090"),
            (8, 9),
            "ada",
            "github.com/thamada/nvidia-smi gls/RTX4090_deviceQuery.py: deviceQuery on 8 x 'NVIDIA "
            "GeForce RTX 4090', driver CUDA 12.4: 'Total amount of global memory: 24210 MBytes "
            "(25386352640 bytes)'; zai-org/CogVideo#36 (another driver) shows '23.68 GiB total "
            "capacity', ~38 MiB more",
        ),
        Gpu(
            "mi300x-192gb",
            _mib(196592),
            "mi300x",
            "AMD Instinct MI300X 192GB",
            ("mi300x",),
            (9, 4),
            "cdna3",
            "ROCm/ROCm#4203: torch 2.6 on ROCm 6.2.4 prints _CudaDeviceProperties(name='AMD "
            "Instinct MI300X', major=9, minor=4, gcnArchName='gfx942:sramecc+:xnack-', "
            "total_memory=196592MB, multi_processor_count=304); rocm-smi's 'VRAM Total Memory (B): "
            "206141652992' (ROCm/legacy-rocm-build#4750) is the same 196592 MiB exactly. HIP "
            "reports gfx942 as compute capability 9.4",
        ),
        Gpu(
            "b200-180gb",
            _mib(182642),
            "b200",
            "NVIDIA B200 180GB HBM3e (HGX/DGX B200)",
            ("b200",),
            (10, 0),
            "blackwell",
            "github.com/ai-bot-pro/achatbot deploy/modal/src/llm/vllm/vlm/skywork_r1v.py: torch "
            "on Modal prints _CudaDeviceProperties(name='NVIDIA B200', major=10, minor=0, "
            "total_memory=182642MB, multi_processor_count=148, L2_cache_size=126MB); a Triton "
            "benchmark's log (torch 2.8.0+cu128, repository not identified by the code index) "
            "prints total_memory=182631MB on another driver",
        ),
        Gpu(
            "a10g-24gb",
            _mib(22587),
            "a10g",
            "NVIDIA A10G 24GB (AWS g5)",
            ("a10g",),
            (8, 6),
            "ampere",
            "pytorch/torchcodec docs, 'Accelerated video decoding on GPUs with CUDA and NVDEC' "
            "(generated with torch 2.15.0.dev20260909+cu130): _CudaDeviceProperties(name='NVIDIA "
            "A10G', major=8, minor=6, total_memory=22587MB, multi_processor_count=80)",
        ),
        Gpu(
            "rtx3090-24gb",
            _mib(24268),
            "rtx3090",
            "NVIDIA GeForce RTX 3090 24GB",
            ("rtx3090", "3090"),
            (8, 6),
            "ampere",
            "huggingface/transformers docs/source/en/deepspeed.md (TORCH_CUDA_ARCH_LIST step): "
            "_CudaDeviceProperties(name='GeForce RTX 3090', major=8, minor=6, "
            "total_memory=24268MB, multi_processor_count=82); a newer driver's log shows 24259MB",
        ),
        Gpu(
            "rtx4080-16gb",
            _mib(16049),
            "rtx4080",
            "NVIDIA GeForce RTX 4080 16GB",
            ("rtx4080", "4080"),
            (8, 9),
            "ada",
            "brainglobe cellfinder docs, 'Speeding up cellfinder' (GPU check): "
            "_CudaDeviceProperties(name='NVIDIA GeForce RTX 4080', major=8, minor=9, "
            "total_memory=16049MB, multi_processor_count=76)",
        ),
        Gpu(
            "rtx4070-ti-super-16gb",
            _mib(15974),
            "rtx4070-ti-super",
            "NVIDIA GeForce RTX 4070 Ti SUPER 16GB",
            ("rtx4070-ti-super", "rtx4070tisuper", "4070-ti-super"),
            (8, 9),
            "ada",
            "a public performance write-up (repository not identified by the code index): torch "
            "2.13.0+cu126, driver 560.35.03, prints _CudaDeviceProperties(name='NVIDIA GeForce "
            "RTX 4070 Ti SUPER', major=8, minor=9, total_memory=15974MB, "
            "multi_processor_count=66); nvidia-smi shows 16376 MiB for the card. Another log "
            "shows 15934MB",
        ),
        Gpu(
            "t4-16gb",
            _mib(15109),
            "t4",
            "NVIDIA Tesla T4 16GB",
            ("t4", "tesla-t4"),
            (7, 5),
            "turing",
            "torch prints _CudaDeviceProperties(name='Tesla T4', major=7, minor=5, "
            "total_memory=15109MB, multi_processor_count=40) in several public logs (Google Colab "
            "and HPC tutorials); other drivers give 15079-15102MB",
        ),
        Gpu(
            "v100-16gb",
            _mib(16160),
            "v100",
            "NVIDIA Tesla V100-SXM2-16GB",
            ("v100-sxm2-16gb",),
            (7, 0),
            "volta",
            "torch prints _CudaDeviceProperties(name='Tesla V100-SXM2-16GB', major=7, minor=0, "
            "total_memory=16160MB, multi_processor_count=80) in the setup logs YOLOv5's docs "
            "reproduce (torch 1.7-1.8); kchengiva/Shift-GCN#34 on a 16 GB V100: '15.78 GiB total "
            "capacity' (16160 MiB = 15.78 GiB)",
        ),
        Gpu(
            "v100-32gb",
            _mib(32510),
            "v100",
            "NVIDIA Tesla V100-SXM2-32GB",
            ("v100-sxm2-32gb",),
            (7, 0),
            "volta",
            "haotian-liu/LLaVA#812 on 8 x V100: '31.74 GiB total capacity' (32510 MiB = 31.75 "
            "GiB); torch prints total_memory=32510MB for a 'Tesla V100-PCIE-32GB', and deviceQuery "
            "'32510 MBytes (34089730048 bytes)' for a V100-SXM2-32GB on drivers 11.2-11.4 in "
            "public HPC tutorials (32494 MiB on driver 12.9)",
        ),
    )
}

#: Words a device name may start with that do not tell GPUs apart.
_VENDOR_WORDS = ("nvidia", "amd", "geforce", "instinct", "radeon", "tesla")


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
    Its architecture is unknown: `fixed_memory` takes the largest figures of the catalogue's.
    Raises `UnknownProfileError` for an unknown profile, `BudgetError` for an unreadable size or a
    text without a unit under 1 GiB (a number without a unit is bytes: "40" is 40 bytes, write
    "40GB"); a size with a unit ("700MiB", "734003200B") and an int are taken as given."""
    capacity_bytes = parse_bytes(capacity)
    unitless = isinstance(capacity, str) and capacity.strip()[-1:].isdigit()
    if capacity_bytes < 1 or (unitless and capacity_bytes < 2**30):
        raise BudgetError(
            f"a GPU of {format_bytes(capacity_bytes)} ({capacity!r})? Give its memory with a unit, "
            "e.g. 70GiB or 80GB"
        )
    _check_profile(profile)
    return Gpu(
        f"custom-{capacity}", capacity_bytes, profile, f"a {format_bytes(capacity_bytes)} GPU"
    )


def with_capacity(gpu: Gpu | str, capacity: int | str) -> Gpu:
    """`gpu` (a catalogue name or a `Gpu`) with `capacity` bytes ("22GiB", an int) instead of its
    own: its architecture, compute capability and cost profile kept, e.g. a MIG slice or a card
    whose driver reports another size. Raises as `custom_gpu` does for an unreadable size."""
    base = get_gpu(gpu)
    sized = custom_gpu(capacity, base.profile)
    return replace(
        base,
        name=f"{base.name}@{capacity}",
        capacity_bytes=sized.capacity_bytes,
        description=f"{base.description or base.name} with {format_bytes(sized.capacity_bytes)}",
        source=f"--capacity {capacity} given by the user",
    )


def get_gpu(gpu: Gpu | str, profile: str | None = None) -> Gpu:
    """A catalogue entry by name (case-insensitive; "h100", "H100-80GB", "nvidia h100 80gb", "4090",
    or the name torch reports), a device of any capacity given as a size ("70GiB": `custom_gpu`),
    or the `Gpu` given. `profile` replaces the entry's cost profile. Raises `UnknownProfileError`
    listing the known names."""
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


#: Threads that hold a BLAS handle in a training step: torch hands each thread its own handle
#: (`DeviceThreadHandlePool`), and autograd runs a CUDA backward on its own device thread, so the
#: forward (and optimizer) on the main thread and the backward each get one workspace per stream.
BLAS_HANDLES = 2

BLAS_WORKSPACE_SOURCE = (
    "torch 2.13 aten/src/ATen/cuda/CublasHandlePool.cpp: parseChosenWorkspaceSize() gives cuBLAS "
    "4096*1024*2 + 16*1024*8 = 8,519,680 B (':4096:2:16:8'), 32 MiB where major is 9, 10 or 12 "
    "(Hopper, Blackwell); on ROCm 128 MiB for gfx94x/gfx95x, else 32 MiB, and "
    "parseCUDABlasLtWorkspaceSize() 76 MiB for hipBLASLt. getNewWorkspace() and "
    "getNewCUDABlasLtWorkspace() take them from c10::cuda::CUDACachingAllocator, so they count in "
    "memory_allocated() and memory_reserved(); they stay cached per (handle, stream) in "
    "cublas_handle_stream_to_workspace() until clearCublasWorkspaces(). On CUDA, cuBLASLt reuses "
    "the cuBLAS workspace of the same (handle, stream) (TORCH_CUBLASLT_UNIFIED_WORKSPACE, on by "
    "default: getCUDABlasLtWorkspace()); on ROCm the hipBLASLt pool is separate. Counted for "
    f"{BLAS_HANDLES} handles: the main thread's and autograd's device thread's"
)


def blas_workspace_bytes(gpu: Gpu | str) -> int:
    """The BLAS workspaces torch 2.13 allocates for one (handle, stream) pair on `gpu`, as
    `CublasHandlePool.cpp` sizes them by default (`BLAS_WORKSPACE_SOURCE`; `CUBLAS_WORKSPACE_CONFIG`
    and `CUBLASLT_WORKSPACE_SIZE` change them): cuBLAS's, which cuBLASLt shares on CUDA, or
    hipBLAS's plus hipBLASLt's on ROCm. A GPU of unknown compute capability gets the largest CUDA
    size."""
    g = get_gpu(gpu)
    if g.architecture.runtime == "rocm":
        major, minor = g.compute_capability or (9, 4)
        gfx94_95 = major == 9 and minor >= 4
        return (128 if gfx94_95 else 32) * MiB + 76 * MiB
    major = g.compute_capability[0] if g.compute_capability else 9
    return 32 * MiB if major in (9, 10, 12) else 4096 * 1024 * 2 + 16 * 1024 * 8


#: NCCL's buffers per rank for data parallelism (one process group, ring/tree all-reduce), with the
#: default settings. A rough figure: NCCL allocates per channel and per peer connection, and the
#: number of channels depends on the topology (up to 32 per GPU pair on H100 NVLink).
NCCL_DP_BYTES = GiB

NCCL_SOURCE = (
    "rough figure. NCCL allocates its FIFOs with cudaMalloc/cuMem, outside PyTorch's allocator: "
    "NCCL_BUFFSIZE (default 4 MiB) per channel for the Simple protocol plus the LL and LL128 "
    "buffers (NVIDIA/nccl#391), each channel its own for collectives (NVIDIA/nccl#1450); memory is "
    "linear in the channels, a ring keeps 2 connections at any scale and beyond 2 nodes it no "
    "longer grows (sjeaugey, NVIDIA/nccl#864, #986). Observed: 1.06 GB of non-PyTorch memory per "
    "GPU on 8 x H100 before the first all-to-all, the CUDA context included (NVIDIA/nccl#1685); "
    "'about 1 GiB for the "
    "initial RCCL/communicator overhead, plus ~0.65 GiB per additional communicator per rank' on "
    "LUMI (Lumi-supercomputer/LUMI-AI-Guide#111). One communicator (plain DDP / FSDP) assumed"
)


def nccl_bytes(ranks: int) -> int:
    """NCCL's buffers per rank in a data-parallel job of `ranks` ranks: none on one rank,
    `NCCL_DP_BYTES` on more (it does not grow with the number of ranks: `NCCL_SOURCE`)."""
    if ranks < 1:
        raise BudgetError(f"ranks={ranks}: a job has at least one rank")
    return 0 if ranks == 1 else NCCL_DP_BYTES


@dataclass(frozen=True)
class FixedMemory:
    """What one training process holds on its GPU besides its tensors, line by line, each with its
    source. `context_bytes` and `nccl_bytes` are outside PyTorch's caching allocator (visible in
    `nvidia-smi`, not in `torch.cuda.memory_reserved()`); `cublas_workspace_bytes` is inside it
    (counted in `memory_allocated()`), but not in `remat.estimate`, which counts tensors."""

    context_bytes: int
    cublas_workspace_bytes: int
    nccl_bytes: int
    context_source: str
    cublas_workspace_source: str
    nccl_source: str

    @property
    def outside_allocator_bytes(self) -> int:
        return self.context_bytes + self.nccl_bytes

    @property
    def total_bytes(self) -> int:
        return self.outside_allocator_bytes + self.cublas_workspace_bytes

    def explain(self) -> str:
        """The lines with their sizes and sources, one a line."""
        return "\n".join(
            f"{label}: {format_bytes(n)} ({where}) - {source}"
            for label, n, where, source in (
                (
                    "CUDA/ROCm context",
                    self.context_bytes,
                    "outside the allocator",
                    self.context_source,
                ),
                (
                    "BLAS workspaces",
                    self.cublas_workspace_bytes,
                    "inside the allocator",
                    self.cublas_workspace_source,
                ),
                ("NCCL buffers", self.nccl_bytes, "outside the allocator", self.nccl_source),
            )
        )


def fixed_memory(gpu: Gpu | str, ranks: int = 1) -> FixedMemory:
    """The memory a training process holds on `gpu` besides its tensors, in a data-parallel job of
    `ranks` ranks: the context of the GPU's architecture, `BLAS_HANDLES` BLAS workspaces, and
    NCCL's buffers when `ranks` > 1."""
    g = get_gpu(gpu)
    arch = g.architecture
    measured = g.context_bytes is not None
    return FixedMemory(
        context_bytes=g.context_bytes if measured else arch.context_bytes,
        cublas_workspace_bytes=BLAS_HANDLES * blas_workspace_bytes(g),
        nccl_bytes=nccl_bytes(ranks),
        context_source="given (--cuda-context)" if measured else arch.context_source,
        cublas_workspace_source=BLAS_WORKSPACE_SOURCE,
        nccl_source=NCCL_SOURCE if ranks > 1 else "one rank: no process group",
    )


def allocator_limit_bytes(gpu: Gpu | str, ranks: int = 1) -> int:
    """The most PyTorch's caching allocator can reserve on `gpu`: its `total_memory` less what sits
    outside the allocator (the context and NCCL's buffers, `fixed_memory`)."""
    g = get_gpu(gpu)
    return g.capacity_bytes - fixed_memory(g, ranks).outside_allocator_bytes


def reserve_bytes(
    gpu: Gpu | str, reserve: Reserve | int | str | None = None, ranks: int = 1
) -> int:
    """The bytes of `gpu` a training step cannot have: with `reserve` None, the fixed lines
    (`fixed_memory(gpu, ranks).total_bytes`) plus `FRAGMENTATION` of `allocator_limit_bytes`; else
    the user's `Reserve`, or a fixed size (bytes, "2GiB")."""
    g = get_gpu(gpu)
    if reserve is None:
        fixed = fixed_memory(g, ranks)
        return fixed.total_bytes + math.ceil(FRAGMENTATION * allocator_limit_bytes(g, ranks))
    if isinstance(reserve, Reserve):
        return reserve.bytes_for(g.capacity_bytes)
    return parse_bytes(reserve)


def usable_bytes(gpu: Gpu | str, reserve: Reserve | int | str | None = None, ranks: int = 1) -> int:
    """The memory a training step may allocate on `gpu` (a `Gpu` or anything `get_gpu` takes) in a
    data-parallel job of `ranks` ranks: the figure to compare with `remat.estimate(...).peak_bytes`
    or to plan under as a budget. By default

        usable = total_memory - context - nccl       (allocator_limit_bytes: what cudaMalloc can get)
                 - blas workspaces                   (in the allocator, not in remat.estimate)
                 - FRAGMENTATION x allocator limit   (blocks the allocator cannot hand out whole)

    e.g. an H100 SXM on one rank: 79.2 GiB - 612 MiB - 2 x 32 MiB - 5% of 78.6 GiB = 74.6 GiB.
    A user's `reserve` (a `Reserve`, bytes or "3GiB") replaces all three lines: usable = capacity -
    reserve. Raises `BudgetError` when the reserve leaves nothing."""
    g = get_gpu(gpu)
    left = g.capacity_bytes - reserve_bytes(g, reserve, ranks)
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
