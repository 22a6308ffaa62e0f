"""The GPU catalogue: names resolve loosely, capacities are the vendors' GB, the reserve is taken."""

from __future__ import annotations

import pytest

from remat.cost import PROFILES
from remat.errors import BudgetError, UnknownProfileError
from remat.gpus import (
    DEFAULT_CUSTOM_PROFILE,
    DEFAULT_RESERVE,
    GPUS,
    Gpu,
    Reserve,
    custom_gpu,
    get_gpu,
    gpu_names,
    reserve_bytes,
    usable_bytes,
)

GB, GiB = 10**9, 2**30

CATALOGUE = {
    "h100-80gb": (80 * GB, "h100"),
    "h200-141gb": (141 * GB, "h200"),
    "a100-40gb": (40 * GB, "a100-40gb"),
    "a100-80gb": (80 * GB, "a100"),
    "l4-24gb": (24 * GB, "l4"),
    "rtx4090-24gb": (24 * GB, "rtx4090"),
    "mi300x-192gb": (192 * GB, "mi300x"),
}


def test_the_catalogue_holds_the_documented_capacities_and_known_profiles():
    assert {n: (g.capacity_bytes, g.profile) for n, g in GPUS.items()} == CATALOGUE
    assert all(g.profile in PROFILES for g in GPUS.values())
    assert gpu_names() == sorted(CATALOGUE)


@pytest.mark.parametrize(
    ("spelling", "name"),
    [
        ("h100", "h100-80gb"),
        ("H100", "h100-80gb"),
        ("h100-80gb", "h100-80gb"),
        ("H100 80GB", "h100-80gb"),
        ("NVIDIA H100 80GB", "h100-80gb"),
        ("h200", "h200-141gb"),
        ("a100", "a100-80gb"),
        ("A100-40GB", "a100-40gb"),
        ("a100_80gb", "a100-80gb"),
        ("L4", "l4-24gb"),
        ("rtx4090", "rtx4090-24gb"),
        ("RTX 4090", "rtx4090-24gb"),
        ("NVIDIA GeForce RTX 4090", "rtx4090-24gb"),
        ("4090", "rtx4090-24gb"),
        ("MI300X", "mi300x-192gb"),
        ("AMD Instinct MI300X", "mi300x-192gb"),
    ],
)
def test_names_resolve_case_insensitively(spelling, name):
    assert get_gpu(spelling) is GPUS[name]


def test_a_gpu_is_returned_as_given_and_its_profile_can_be_replaced():
    g = GPUS["h100-80gb"]
    assert get_gpu(g) is g
    swapped = get_gpu("h100", profile="h200")
    assert swapped.profile == "h200" and swapped.capacity_bytes == g.capacity_bytes
    with pytest.raises(UnknownProfileError, match="a100, a100-40gb, cpu"):
        get_gpu("h100", profile="tpu")


def test_unknown_names_raise_listing_the_catalogue():
    with pytest.raises(UnknownProfileError) as err:
        get_gpu("tpu-v5")
    message = str(err.value)
    assert "'tpu-v5'" in message and "70GiB" in message
    assert ", ".join(sorted(CATALOGUE)) in message
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


def test_the_default_reserve_is_a_gib_and_five_percent():
    assert (DEFAULT_RESERVE.context_bytes, DEFAULT_RESERVE.fragmentation) == (GiB, 0.05)
    assert reserve_bytes("h100") == GiB + 4 * GB
    assert usable_bytes("h100") == 80 * GB - GiB - 4 * GB
    assert usable_bytes(GPUS["mi300x-192gb"]) == 192 * GB - GiB - int(9.6 * GB)
    assert GPUS["l4-24gb"].usable_bytes() == usable_bytes("l4")


def test_usable_bytes_subtracts_the_reserve_given():
    assert usable_bytes("a100-40gb", reserve=0) == 40 * GB
    assert usable_bytes("a100-40gb", reserve="2GiB") == 40 * GB - 2 * GiB
    assert usable_bytes("a100-40gb", reserve=3 * GB) == 37 * GB
    assert usable_bytes("70GiB", reserve=Reserve(0, 0.1)) == 63 * GiB
    with pytest.raises(BudgetError, match="reserve"):
        usable_bytes("l4", reserve="24GB")
