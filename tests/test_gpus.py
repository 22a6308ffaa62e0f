"""The GPU catalogue: capacities are the `total_memory` the cited sources print, every figure has a
source, names resolve loosely (torch's own names included), and the fixed memory of a process adds
up to what `usable_bytes` leaves."""

from __future__ import annotations

import math

import pytest

from remat.device.cost import PROFILES
from remat.device.gpus import (
    ARCHITECTURES,
    BLAS_HANDLES,
    DEFAULT_CUSTOM_PROFILE,
    FRAGMENTATION,
    GPUS,
    NCCL_DP_BYTES,
    Gpu,
    Reserve,
    allocator_limit_bytes,
    blas_workspace_bytes,
    custom_gpu,
    fixed_memory,
    get_gpu,
    gpu_names,
    nccl_bytes,
    reserve_bytes,
    usable_bytes,
)
from remat.errors import BudgetError, UnknownProfileError

GB, GiB, MiB = 10**9, 2**30, 2**20

#: What each source prints: deviceQuery's "N MBytes (B bytes)" (N is B / 2**20 rounded), or
#: torch's "total_memory=N MB" (N is B // 2**20), with the exact bytes where the source has them.
PRINTED = {
    "h100-80gb": ("deviceQuery", 81106, 85_045_477_376),
    "h100-96gb": ("torch", 97320, None),  # torchtitan's logs: 95.0396 GiB
    "h100-pcie-80gb": ("torch", 81008, None),
    "h200-141gb": ("torch", 143156, None),
    "a100-40gb": ("deviceQuery", 40339, 42_298_834_944),
    "a100-80gb": ("deviceQuery", 81158, 85_100_068_864),
    "l4-24gb": ("deviceQuery", 22478, 23_570_219_008),
    "rtx4090-24gb": ("deviceQuery", 24210, 25_386_352_640),
    "mi300x-192gb": ("torch", 196592, None),
    "v100-16gb": ("torch", 16160, None),
    "v100-32gb": ("torch", 32510, None),
    "b200-180gb": ("torch", 182642, None),
    "a10g-24gb": ("torch", 22587, None),
    "rtx3090-24gb": ("torch", 24268, None),
    "rtx4080-16gb": ("torch", 16049, None),
    "rtx4070-ti-super-16gb": ("torch", 15974, None),
    "t4-16gb": ("torch", 15109, None),
}

PROFILE_AND_CAPABILITY = {
    "h100-80gb": ("h100", (9, 0)),
    "h100-96gb": ("h100", (9, 0)),
    "h100-pcie-80gb": ("h100-pcie", (9, 0)),
    "h200-141gb": ("h200", (9, 0)),
    "a100-40gb": ("a100-40gb", (8, 0)),
    "a100-80gb": ("a100", (8, 0)),
    "l4-24gb": ("l4", (8, 9)),
    "rtx4090-24gb": ("rtx4090", (8, 9)),
    "mi300x-192gb": ("mi300x", (9, 4)),  # gfx942, as HIP and torch on ROCm report it
    "v100-16gb": ("v100", (7, 0)),
    "v100-32gb": ("v100", (7, 0)),
    "b200-180gb": ("b200", (10, 0)),
    "a10g-24gb": ("a10g", (8, 6)),
    "rtx3090-24gb": ("rtx3090", (8, 6)),
    "rtx4080-16gb": ("rtx4080", (8, 9)),
    "rtx4070-ti-super-16gb": ("rtx4070-ti-super", (8, 9)),
    "t4-16gb": ("t4", (7, 5)),
}


def test_the_catalogue_holds_every_card_with_its_profile_and_compute_capability():
    assert gpu_names() == sorted(PRINTED) == sorted(PROFILE_AND_CAPABILITY)
    assert {n: (g.profile, g.compute_capability) for n, g in GPUS.items()} == PROFILE_AND_CAPABILITY
    assert all(g.profile in PROFILES and g.arch in ARCHITECTURES for g in GPUS.values())


@pytest.mark.parametrize("name", sorted(PRINTED))
def test_capacities_are_the_total_memory_their_source_prints(name):
    g, (printer, mib, exact) = GPUS[name], PRINTED[name]
    if exact is not None:
        assert g.capacity_bytes == exact and round(exact / MiB) == mib
        assert str(exact) in g.source and f"{mib} MBytes" in g.source
    else:
        assert g.capacity_bytes == mib * MiB  # torch floors to whole MiB: at most 1 MiB under
        assert (
            f"total_memory={mib}MB" in g.source
            or f"{mib / 1024:.2f} GiB" in g.source
            or f"{mib} MiB taken" in g.source
        )
    assert printer == "torch" or "deviceQuery" in g.source


def test_capacities_are_under_the_vendor_gigabytes_of_the_nvidia_smi_total():
    """total_memory leaves out the driver's share: nvidia-smi's total for an H100 SXM is 81559 MiB
    (modal-labs/modal-client#2797), for an H200 143771 MiB (kvcache-ai/Mooncake#2307)."""
    assert GPUS["h100-80gb"].capacity_bytes < 81559 * MiB
    assert GPUS["h200-141gb"].capacity_bytes < 143771 * MiB
    # and above the old "80 GB = 80e9" catalogue on every 80 GB card
    assert all(GPUS[n].capacity_bytes > 80 * GB for n in ("h100-80gb", "a100-80gb"))


def test_every_figure_has_a_source_and_estimates_say_so():
    assert all(g.source for g in GPUS.values())
    assert all(a.context_source for a in ARCHITECTURES.values())
    estimated = {a.name for a in ARCHITECTURES.values() if a.context_source.startswith("estimate")}
    assert estimated == {
        "volta",
        "turing",
        "hopper",
        "cdna3",
    }  # no measurement found: marked, with why
    lines = fixed_memory("h100", ranks=8)
    assert "CublasHandlePool.cpp" in lines.cublas_workspace_source
    assert "NCCL_BUFFSIZE" in lines.nccl_source


@pytest.mark.parametrize(
    ("spelling", "name"),
    [
        ("h100", "h100-80gb"),
        ("H100", "h100-80gb"),
        ("h100-80gb", "h100-80gb"),
        ("H100 80GB", "h100-80gb"),
        ("NVIDIA H100 80GB", "h100-80gb"),
        ("NVIDIA H100 80GB HBM3", "h100-80gb"),  # torch.cuda.get_device_name()
        ("NVIDIA H100 PCIe", "h100-pcie-80gb"),
        ("h200", "h200-141gb"),
        ("NVIDIA H200", "h200-141gb"),
        ("a100", "a100-80gb"),
        ("A100-40GB", "a100-40gb"),
        ("a100_80gb", "a100-80gb"),
        ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
        ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
        ("L4", "l4-24gb"),
        ("NVIDIA L4", "l4-24gb"),
        ("rtx4090", "rtx4090-24gb"),
        ("RTX 4090", "rtx4090-24gb"),
        ("NVIDIA GeForce RTX 4090", "rtx4090-24gb"),
        ("4090", "rtx4090-24gb"),
        ("MI300X", "mi300x-192gb"),
        ("AMD Instinct MI300X", "mi300x-192gb"),
        ("v100-16gb", "v100-16gb"),
        ("Tesla V100-SXM2-16GB", "v100-16gb"),
        ("Tesla V100-SXM2-32GB", "v100-32gb"),
        ("NVIDIA B200", "b200-180gb"),  # the names torch reports, from the sources
        ("NVIDIA A10G", "a10g-24gb"),
        ("GeForce RTX 3090", "rtx3090-24gb"),
        ("NVIDIA GeForce RTX 3090", "rtx3090-24gb"),
        ("NVIDIA GeForce RTX 4080", "rtx4080-16gb"),
        ("NVIDIA GeForce RTX 4070 Ti SUPER", "rtx4070-ti-super-16gb"),
        ("Tesla T4", "t4-16gb"),
        ("t4", "t4-16gb"),
    ],
)
def test_names_resolve_case_insensitively(spelling, name):
    assert get_gpu(spelling) is GPUS[name]


def test_a_gpu_is_returned_as_given_and_its_profile_can_be_replaced():
    g = GPUS["h100-80gb"]
    assert get_gpu(g) is g
    swapped = get_gpu("h100", profile="h200")
    assert swapped.profile == "h200" and swapped.capacity_bytes == g.capacity_bytes
    with pytest.raises(UnknownProfileError, match="a100, a100-40gb, a10g, b200, cpu"):
        get_gpu("h100", profile="tpu")


def test_unknown_names_raise_listing_the_catalogue():
    with pytest.raises(UnknownProfileError) as err:
        get_gpu("tpu-v5")
    message = str(err.value)
    assert "'tpu-v5'" in message and "70GiB" in message
    assert ", ".join(gpu_names()) in message
    with pytest.raises(UnknownProfileError, match="h100-80gb"):
        get_gpu("40")  # a size without a unit is bytes: too small to be a GPU


def test_any_capacity_with_the_default_profile():
    g = get_gpu("70GiB")
    assert g.capacity_bytes == 70 * GiB and g.profile == DEFAULT_CUSTOM_PROFILE == "h100"
    assert get_gpu("70GiB", profile="a100").profile == "a100"
    assert custom_gpu(80 * GB, "mi300x") == Gpu(
        "custom-80000000000", 80 * GB, "mi300x", "a 74.5 GiB GPU"
    )
    with pytest.raises(BudgetError, match="unit"):
        custom_gpu("40")  # a text without a unit is bytes: surely a mistake
    with pytest.raises(UnknownProfileError):
        custom_gpu("70GiB", "tpu")


def test_blas_workspaces_are_torchs_defaults_by_architecture():
    """CublasHandlePool.cpp: 32 MiB on sm_9x/10x/12x, ':4096:2:16:8' = 8,519,680 B before; on ROCm
    128 MiB of hipBLAS on gfx94x plus 76 MiB of hipBLASLt."""
    assert 4096 * 1024 * 2 + 16 * 1024 * 8 == 8_519_680
    expected = {
        "h100-80gb": 32 * MiB,
        "h100-96gb": 32 * MiB,
        "h100-pcie-80gb": 32 * MiB,
        "h200-141gb": 32 * MiB,
        "a100-40gb": 8_519_680,
        "a100-80gb": 8_519_680,
        "l4-24gb": 8_519_680,
        "rtx4090-24gb": 8_519_680,
        "b200-180gb": 32 * MiB,  # sm_100
        "a10g-24gb": 8_519_680,
        "rtx3090-24gb": 8_519_680,
        "rtx4080-16gb": 8_519_680,
        "rtx4070-ti-super-16gb": 8_519_680,
        "t4-16gb": 8_519_680,
        "v100-16gb": 8_519_680,
        "v100-32gb": 8_519_680,
        "mi300x-192gb": 128 * MiB + 76 * MiB,
    }
    assert {n: blas_workspace_bytes(n) for n in GPUS} == expected
    assert blas_workspace_bytes("70GiB") == 32 * MiB  # unknown capability: the largest CUDA size


def test_the_fixed_lines_are_the_architectures_context_two_workspaces_and_nccl_on_many_ranks():
    h100 = fixed_memory("h100")
    assert (h100.context_bytes, h100.cublas_workspace_bytes, h100.nccl_bytes) == (
        612 * MiB,
        BLAS_HANDLES * 32 * MiB,
        0,
    )
    assert fixed_memory("a100").context_bytes == 256 * MiB
    assert fixed_memory("l4").context_bytes == fixed_memory("4090").context_bytes == 426 * MiB
    assert fixed_memory("70GiB").context_bytes == max(
        a.context_bytes for a in ARCHITECTURES.values()
    )
    eight = fixed_memory("h100", ranks=8)
    assert eight.nccl_bytes == NCCL_DP_BYTES == GiB == fixed_memory("h100", ranks=1024).nccl_bytes
    assert eight.outside_allocator_bytes == 612 * MiB + GiB
    assert eight.total_bytes == eight.outside_allocator_bytes + 64 * MiB
    assert nccl_bytes(1) == 0
    with pytest.raises(BudgetError, match="ranks=0"):
        nccl_bytes(0)
    assert "NCCL buffers: 1 GiB (outside the allocator)" in eight.explain()
    assert "BLAS workspaces: 64 MiB (inside the allocator)" in eight.explain()


@pytest.mark.parametrize("name", sorted(GPUS))
@pytest.mark.parametrize("ranks", [1, 8])
def test_usable_is_the_allocator_limit_less_workspaces_and_fragmentation(name, ranks):
    g, fixed = GPUS[name], fixed_memory(name, ranks)
    limit = allocator_limit_bytes(g, ranks)
    assert limit == g.capacity_bytes - fixed.context_bytes - fixed.nccl_bytes
    usable = usable_bytes(g, ranks=ranks)
    assert usable == limit - fixed.cublas_workspace_bytes - math.ceil(FRAGMENTATION * limit)
    assert usable + reserve_bytes(g, ranks=ranks) == g.capacity_bytes
    assert g.usable_bytes(ranks=ranks) == usable


def test_an_h100_leaves_74_6_gib_on_one_rank_and_a_gib_less_on_eight():
    """85,045,477,376 B - 612 MiB - 2 x 32 MiB - 5% of the 78.6 GiB the allocator may reserve."""
    limit = 85_045_477_376 - 612 * MiB
    assert usable_bytes("h100") == limit - 64 * MiB - math.ceil(0.05 * limit)
    assert round(usable_bytes("h100") / GiB, 1) == 74.6
    limit8 = limit - GiB  # NCCL's buffers, outside the allocator
    assert usable_bytes("h100", ranks=8) == limit8 - 64 * MiB - math.ceil(0.05 * limit8)


def test_a_reserve_given_replaces_the_fixed_lines():
    a40 = GPUS["a100-40gb"].capacity_bytes
    assert usable_bytes("a100-40gb", reserve=0) == a40
    assert usable_bytes("a100-40gb", reserve="2GiB") == a40 - 2 * GiB
    assert usable_bytes("a100-40gb", reserve=3 * GB, ranks=8) == a40 - 3 * GB
    assert usable_bytes("70GiB", reserve=Reserve(0, 0.1)) == 63 * GiB
    with pytest.raises(BudgetError, match="reserve"):
        usable_bytes("l4", reserve="24GB")
