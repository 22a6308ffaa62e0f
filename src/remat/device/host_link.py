"""The link between a GPU and its host's memory, as data: what an activation copied to pinned host
memory and back costs, per direction, and how much host memory a rank may pin for it.

Offload (docs/offload.md) moves a saved activation to host memory during the forward and back
before its backward op; the copy is free where compute hides it. Pricing it needs three figures
per device, each with its source here: the effective bandwidth of each direction (a pinned
`cudaMemcpyAsync` of a large tensor, not the link's signalling rate), how many GPUs share one
host link, and the host memory a rank may pin. Nothing here imports torch.

The effective rates are about 80% of the signalling rate on PCIe (packet headers, flow control:
a x16 Gen4 link signals 31.5 GB/s per direction and pinned copies measure 24-26 GB/s) and the
figure measured on the NVLink-C2C systems, where it is well under the nominal 450 GB/s.
"""

from __future__ import annotations

from dataclasses import dataclass

from remat.errors import RematError

GB = 10**9
GiB = 2**30


@dataclass(frozen=True)
class HostLink:
    """One kind of GPU-to-host link: effective bytes per second host to device and device to host
    for one GPU alone on it, how many GPUs share it (`gpus_per_link`: their copies divide it), and
    where the figures come from."""

    name: str
    host_to_device_bytes_per_s: float
    device_to_host_bytes_per_s: float
    gpus_per_link: int
    source: str

    def per_rank(self, ranks_on_link: int | None = None) -> tuple[float, float]:
        """(host-to-device, device-to-host) bytes per second one rank gets when `ranks_on_link`
        ranks copy at once (default: every GPU the link serves). Split evenly: a link carries
        its bytes whoever sends them, and offloading ranks copy in the same phases of the step
        (torchtitan's ILP PR #4636 divides by log2 of the ranks instead, a guess that a host's
        links are partly separate; the even split is the conservative figure)."""
        share = self.gpus_per_link if ranks_on_link is None else ranks_on_link
        if share < 1:
            raise RematError(f"host link {self.name}: ranks_on_link must be >= 1, got {share}")
        return self.host_to_device_bytes_per_s / share, self.device_to_host_bytes_per_s / share


LINKS: dict[str, HostLink] = {
    link.name: link
    for link in (
        HostLink(
            "pcie3-x16",
            12 * GB,
            12 * GB,
            1,
            "PCIe 3.0 x16 signals 15.75 GB/s per direction; CUDA's bandwidthTest on V100 hosts "
            "reports 12-13 GB/s pinned each way (NVIDIA cuda-samples bandwidthTest output in "
            "public V100 benchmarks)",
        ),
        HostLink(
            "pcie4-x16",
            25 * GB,
            25 * GB,
            1,
            "PCIe 4.0 x16 signals 31.5 GB/s per direction; bandwidthTest on A100 / L4 / RTX 4090 "
            "hosts reports 24-26 GB/s pinned each way. Each GPU of a DGX A100 / HGX board has its "
            "own x16 link to a PCIe switch",
        ),
        HostLink(
            "pcie5-x16",
            50 * GB,
            50 * GB,
            1,
            "PCIe 5.0 x16 signals 63 GB/s per direction (128 GB/s both together); pinned copies "
            "measure ~50 GB/s each way on H100 hosts, and torch's compile offload passes take 50 "
            "GB/s as their one constant (activation_offload_cpu_gpu_bw, PRs #167880, #168316). "
            "Each GPU of an HGX H100/H200 board has its own x16 link to a PCIe switch",
        ),
        HostLink(
            "nvlink-c2c-gh200",
            342 * GB,
            295 * GB,
            1,
            "NVLink-C2C on GH200: 450 GB/s per direction nominal (900 GB/s total, NVIDIA Grace "
            "Hopper datasheet); measured 342 GB/s host to device and 295 GB/s device to host "
            "(vllm-project/vllm#6496). One Hopper per Grace",
        ),
        HostLink(
            "nvlink-c2c-gb200",
            176 * GB,
            176 * GB,
            2,
            "NVLink-C2C on GB200: one Grace serves two Blackwell GPUs over one 900 GB/s C2C link "
            "(NVIDIA GB200 NVL72 datasheet); measured 176 GB/s host-device for a GPU while both "
            "copy (NVIDIA/Megatron-LM#6491), i.e. ~352 GB/s for the link, split by two",
        ),
    )
}

#: Each catalogued GPU's link (`remat.device.gpus.GPUS` names and GPUs named only by their link).
GPU_LINKS: dict[str, str] = {
    "v100-16gb": "pcie3-x16",
    "v100-32gb": "pcie3-x16",
    "a100-40gb": "pcie4-x16",
    "a100-80gb": "pcie4-x16",
    "l4-24gb": "pcie4-x16",
    "rtx4090-24gb": "pcie4-x16",
    "h100-80gb": "pcie5-x16",
    "h100-96gb": "pcie5-x16",
    "h100-pcie-80gb": "pcie5-x16",
    "h200-141gb": "pcie5-x16",
    "mi300x-192gb": "pcie5-x16",
    "gh200": "nvlink-c2c-gh200",
    "gb200": "nvlink-c2c-gb200",
}

#: A GPU the catalogue does not know: PCIe Gen5, the link of every current data-centre board
#: remat prices by default (`remat.device.gpus.DEFAULT_CUSTOM_PROFILE` is the H100's).
DEFAULT_LINK = "pcie5-x16"

#: Smallest tensor worth offloading. A copy costs a launch and an event (~5-10 us) whatever its
#: size; at 50 GB/s 1 MiB moves in 21 us, so below it the fixed cost is a large share of the
#: copy while the bytes barely move the peak. torchtitan's ILP PR #4636 uses the same 1 MiB
#: (torchtune offloads from 1 KiB, graph_trainer from 4 KB: cheaper to decide, dearer to run).
MIN_OFFLOAD_BYTES = 2**20

#: Pinned host memory a rank may use when none is given: its GPU's own memory. Why: an 8-GPU
#: node (DGX H100: 2 TiB) then pins 640 GiB, about 30% of its RAM, under the 60% at which
#: torchtune warns that pinned memory starves the host (`OffloadActivations`); and a GPU's worth
#: of copies a step (80 GiB at 50 GB/s: 1.7 s each way) is more than any step hides.
HOST_MEMORY_SOURCE = (
    "default: the GPU's memory per rank (8 ranks of 80 GiB pin 640 GiB, ~30% of a 2 TiB DGX "
    "H100 node, under the 60% at which torchtune warns); give --host-memory to change it"
)


def host_link(gpu_name: str) -> HostLink:
    """The link of a catalogued GPU (its canonical name, `remat.device.gpus.Gpu.name`), or
    `DEFAULT_LINK` for one the catalogue does not know."""
    return LINKS[GPU_LINKS.get(gpu_name.lower(), DEFAULT_LINK)]


def transfer_seconds(nbytes: int, bytes_per_s: float) -> float:
    """The time one copy of `nbytes` takes at `bytes_per_s`."""
    return nbytes / bytes_per_s if nbytes else 0.0
