"""remat.auto on Hugging Face models built from their default config, measured on this CPU.

For each model and three budgets (store-all's peak, halfway, the lowest feasible), plan with
`auto`, apply, run real steps and report: the strategy auto chose, kept ops matched / planned,
bytes held for the backward and the peak, measured / predicted, and the largest gradient
difference against the model without remat (same seed, dropout on). Writes a markdown table.

    python benchmarks/hf_models.py [--batch 2] [--seq 64] [--out docs/models-table.md] [MODEL ...]
"""

from __future__ import annotations

import argparse
import time
import warnings
from collections.abc import Callable
from typing import Any

import remat
from remat.answers.bench import gradients
from remat.models.hf import build_for_training
from remat.units import format_bytes

MODELS = ("gpt2", "llama", "mistral", "t5", "bart", "whisper", "bert", "vit", "mixtral")


def _loss(out):
    return out.loss


def rows_for(model_type: str, batch: int, seq: int) -> list[str]:
    model, inputs = build_for_training(model_type, batch=batch, seq=seq)
    return rows(model_type, model, inputs, _loss)


def rows(name: str, model: Any, inputs: dict[str, Any], loss_fn: Callable[[Any], Any]) -> list[str]:
    """The table's rows of one model: `auto` at store-all's peak, halfway and the lowest feasible
    budget, each applied, stepped, verified and its gradients compared with the bare model's."""
    reference = gradients(model, (), loss_fn=loss_fn, **inputs)
    try:
        graph = remat.trace(model, loss_fn=loss_fn, **inputs)
    except remat.TraceError as e:  # an op fake tensors cannot run: trace on the real tensors
        if not e.fake_tensor_failure:
            raise
        graph = remat.trace(model, loss_fn=loss_fn, device="cpu", **inputs)
    try:
        remat.plan(graph, budget=1)
    except remat.InfeasibleBudget as e:
        lowest = e.min_feasible_bytes
    full = remat.plan(graph, budget="100%", strategy="store_all").predicted_peak_bytes
    out = []
    for label, budget in (("100%", full), ("halfway", (lowest + full) // 2), ("lowest", lowest)):
        plan = remat.plan(graph, budget=budget, strategy="auto")
        remat.apply(model, plan)
        got = gradients(model, (), loss_fn=loss_fn, **inputs)
        diff = max((got[k] - reference[k]).abs().max().item() for k in reference)
        v = remat.verify(model, loss_fn=loss_fn, **inputs)
        remat.remove(model)
        out.append(
            f"| {name} | {label} ({format_bytes(budget)}) | {plan.strategy} | "
            f"{v.kept_ops_matched}/{v.kept_ops_expected} | "
            f"{format_bytes(v.held_bytes_measured)} / {format_bytes(v.held_bytes_predicted)} "
            f"({v.held_ratio:.4f}) | {format_bytes(v.peak_bytes_measured)} / "
            f"{format_bytes(v.peak_bytes_predicted)} ({v.peak_ratio:.4f}) | {diff:.1e} |"
        )
    return out


def sweep(names: list[str], rows_of: Callable[[str], list[str]], out: str | None) -> None:
    """Print the table of `rows_of(name)` for each name (a failure is that model's row), and
    write it to `out` when given."""
    warnings.simplefilter("ignore")
    lines = [
        "| model | budget | auto chose | kept ops matched | held measured / predicted "
        "| peak measured / predicted | max grad diff |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in names:
        start = time.perf_counter()
        try:
            rows = rows_of(name)
        except Exception as e:  # noqa: BLE001 - one architecture's failure is a row of the sweep
            first = (str(e).strip().splitlines() or [""])[0][:200]
            rows = [f"| {name} | failed: {type(e).__name__}: {first} | | | | | |"]
        lines += rows
        print(f"{name}: {time.perf_counter() - start:.1f} s", *rows, sep="\n", flush=True)
    table = "\n".join(lines)
    print(table)
    if out:
        with open(out, "w") as f:
            f.write(table + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=MODELS)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--out", help="also write the table to this markdown file")
    args = parser.parse_args()
    sweep(args.models, lambda name: rows_for(name, args.batch, args.seq), args.out)


if __name__ == "__main__":
    main()
