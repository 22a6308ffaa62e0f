"""The scratch CUDA kernels allocate and free inside one op, measured: the caching allocator's peak
during the op less what is allocated after it (its outputs stay). For the kernels whose scratch
`remat.device.targets.CUDA_SCRATCH` models or should: reductions over the outer dimension (a
bias's gradient), softmax's backward.

    python benchmarks/gpu_kernel_scratch.py [--out DIR]

Writes DIR/kernel-scratch-<device>.json (every case: op, shape, dtype, the scratch measured and
the scratch remat predicts for this device, `targets.runtime_cuda()`) and prints a table.
Needs a CUDA device.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch

import remat
from remat.device import targets

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


def predicted(fn, shape: list[int], dtype: torch.dtype, short: str, target) -> int:
    """remat's scratch for the first op `short` of `fn` traced on a meta tensor for `target`."""
    x = torch.empty(*shape, dtype=dtype, device="meta", requires_grad=True)
    graph = remat.trace(fn, x, target=target)
    return targets.scratch_bytes(graph, next(op for op in graph.ops if op.short == short))


def cases(target) -> list[dict]:
    """Each case measured on the device and predicted by remat for `target`."""
    runs = [
        ("sum.dim_IntList [0]", [n, c], dtype, lambda t: t.sum(0))
        for dtype in (torch.bfloat16, torch.float32)
        for n in ROWS
        for c in COLUMNS
    ]
    runs.append(
        ("sum.dim_IntList [0, 1]", [4, 1024, 3072], torch.bfloat16, lambda t: t.sum((0, 1)))
    )
    rows = []
    for op, shape, dtype, fn in runs:
        x = torch.randn(*shape, device="cuda", dtype=dtype)
        measured = scratch(fn, x)
        del x
        rows.append({"op": op, "shape": shape, "dtype": str(dtype), "scratch": measured})
    for shape, dtype in (([32, 2048, 2048], torch.float32), ([16, 1024, 1024], torch.bfloat16)):
        grad = torch.randn(shape, device="cuda", dtype=dtype)
        out = torch.softmax(torch.randn(shape, device="cuda", dtype=dtype), -1)
        measured = scratch(
            lambda g, o: torch.ops.aten._softmax_backward_data(g, o, -1, g.dtype), grad, out
        )
        del grad, out
        rows.append(
            {
                "op": "_softmax_backward_data",
                "shape": shape,
                "dtype": str(dtype),
                "scratch": measured,
            }
        )
    softmax = lambda t: torch.softmax(t, -1)  # noqa: E731
    for row in rows:
        dtype = getattr(torch, row["dtype"].removeprefix("torch."))
        if row["op"].startswith("sum"):
            dims = (0,) if row["op"].endswith("[0]") else (0, 1)
            row["predicted"] = predicted(
                lambda t, d=dims: t.sum(d), row["shape"], dtype, "sum", target
            )
        else:
            row["predicted"] = predicted(
                softmax, row["shape"], dtype, "_softmax_backward_data", target
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_kernel_scratch: needs a CUDA device", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name()
    from remat.device.targets import runtime_cuda

    rows = cases(runtime_cuda())
    args.out.mkdir(parents=True, exist_ok=True)
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    result = {"device": name, "torch": torch.__version__, "cases": rows}
    (args.out / f"kernel-scratch-{slug}.json").write_text(json.dumps(result, indent=1))
    print("| op | shape | dtype | measured | predicted |\n| --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['op']} | {r['shape']} | {r['dtype']} | {r['scratch']} | {r['predicted']} |")
    differ = sum(r["scratch"] != r["predicted"] for r in rows)
    print(f"{differ} of {len(rows)} cases differ from remat's prediction")
    return 0


if __name__ == "__main__":
    sys.exit(main())
