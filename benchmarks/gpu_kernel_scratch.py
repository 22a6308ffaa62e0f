"""The scratch CUDA kernels allocate and free inside one op, measured: the caching allocator's peak
during the op less what is allocated after it (its outputs stay). For the kernels whose scratch
`remat.device.targets.CUDA_SCRATCH` models or should: reductions over the outer dimension (a
bias's gradient), softmax's backward.

    python benchmarks/gpu_kernel_scratch.py [--out DIR]

Writes DIR/kernel-scratch-<device>.json (every case: op, shape, dtype, scratch bytes) and prints a
table. Needs a CUDA device.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch

ROWS = (256, 1024, 4096, 8192, 32768)
COLUMNS = (256, 768, 3072, 8192)


def scratch(run, *tensors: torch.Tensor) -> int:
    """Peak while `run(*tensors)` runs, less what it leaves allocated."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    out = run(*tensors)
    torch.cuda.synchronize()
    peak, after = torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated()
    del out
    return peak - after


def cases() -> list[dict]:
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for n in ROWS:
            for c in COLUMNS:
                x = torch.randn(n, c, device="cuda", dtype=dtype)
                rows.append(
                    {
                        "op": "sum.dim_IntList [0]",
                        "shape": [n, c],
                        "dtype": str(dtype),
                        "scratch": scratch(lambda t: t.sum(0), x),
                    }
                )
                del x
    x = torch.randn(4, 1024, 3072, device="cuda", dtype=torch.bfloat16)
    rows.append(
        {
            "op": "sum.dim_IntList [0, 1]",
            "shape": list(x.shape),
            "dtype": str(x.dtype),
            "scratch": scratch(lambda t: t.sum((0, 1)), x),
        }
    )
    for shape, dtype in (((32, 2048, 2048), torch.float32), ((16, 1024, 1024), torch.bfloat16)):
        grad = torch.randn(shape, device="cuda", dtype=dtype)
        out = torch.softmax(torch.randn(shape, device="cuda", dtype=dtype), -1)
        rows.append(
            {
                "op": "_softmax_backward_data",
                "shape": list(shape),
                "dtype": str(dtype),
                "scratch": scratch(
                    lambda g, o: torch.ops.aten._softmax_backward_data(g, o, -1, g.dtype),
                    grad,
                    out,
                ),
                "rule": grad.numel() * grad.element_size(),
            }
        )
        del grad, out
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_kernel_scratch: needs a CUDA device", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name()
    rows = cases()
    args.out.mkdir(parents=True, exist_ok=True)
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    result = {"device": name, "torch": torch.__version__, "cases": rows}
    (args.out / f"kernel-scratch-{slug}.json").write_text(json.dumps(result, indent=1))
    print("| op | shape | dtype | scratch | rule |\n| --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['op']} | {r['shape']} | {r['dtype']} | {r['scratch']} | {r.get('rule', '')} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
