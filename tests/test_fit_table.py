"""`remat fit`'s table in any terminal: at 80, 100 and 120 columns, piped or not, no number,
header or verdict is cut (rich's ellipsis); a table too wide for the terminal is turned on its
side rather than truncated. Rendered from the RTX 4090 answer a user read cut at 80 columns."""

from __future__ import annotations

import io
import re

import pytest
from rich.console import Console

from remat.answers.cli import build_parser
from remat.answers.cli import fit as fit_cli
from remat.answers.fit import FitReport
from remat.answers.fit_rows import FitRow

GIB = 2**30


def _memory(allocated: float | None, reserved: float | None) -> dict:
    oom = allocated is None
    return {
        "settings": "expandable_segments:False",
        "out_of_memory": oom,
        "allocated_bytes": 0 if oom else int(allocated * GIB),
        "reserved_bytes": 0 if oom else int(reserved * GIB),
        "limit_bytes": int(23.2 * GIB),
    }


def _row(name, peak, fits, overhead, max_batch, max_seq, default, expandable) -> FitRow:
    return FitRow(
        name, int(peak * GIB), fits, overhead, max_batch, max_seq, plan=name,
        gpu_memory=(_memory(*default), _memory(expandable, expandable)),
    )  # fmt: skip


#: Llama 3.2 1B at seq 2048 on an RTX 4090, as `remat fit` answered it.
REPORT = FitReport(
    model="llama-3.2-1b", batch=1, seq=2048, gpu="rtx4090-24gb", profile="rtx4090",
    capacity_bytes=int(23.6 * GIB), reserve_bytes=int(0.4 * GIB), usable_bytes=int(23.2 * GIB),
    precision="bf16-mixed", optimizer="adamw", shard=1, traces=14, seconds=323.0,
    allocator="reserved bytes of the caching allocator (expandable_segments:False) within its "
    "limit",
    rows=(
        _row("store_all", 23.2, False, 0.0, None, 1280, (None, None), None),
        _row("full", 23.0, True, 0.218, 2, 2496, (23.0, 23.1), 23.1),
        _row("selective:megatron", 23.1, False, 0.066, None, 1216, (None, None), None),
        _row("selective:torchtitan", 23.0, False, 0.148, None, 896, (None, None), 23.1),
        _row("auto", 23.0, True, 0.098, 2, 3136, (23.0, 23.2), None),
    ),
    advice=("full fits (23.1 GiB reserved of the allocator's 23.2 GiB) at +21.8%",),
)  # fmt: skip


def _printed(console: Console, monkeypatch) -> str:
    monkeypatch.setattr(fit_cli, "fit_report", lambda *a, **k: REPORT)
    args = build_parser().parse_args(
        ["fit", "--model", "llama-3.2-1b", "--seq", "2048", "--gpu", "rtx4090"]
    )
    assert fit_cli.cmd_fit(args, console) == 0
    return console.file.getvalue()


@pytest.mark.parametrize("width", [80, 100, 120])
@pytest.mark.parametrize("terminal", [True, False], ids=["terminal", "piped"])
def test_no_figure_header_or_verdict_is_cut_at_any_width(width, terminal, monkeypatch):
    console = Console(
        width=width, file=io.StringIO(), force_terminal=terminal, color_system=None,
        legacy_windows=False,
    )  # fmt: skip
    out = _printed(console, monkeypatch)
    assert "…" not in out
    assert max(len(line) for line in out.splitlines()) <= width
    headers, rows = fit_cli.fit_cells(REPORT, 1, 2048)
    for row in rows:
        for cell in row:
            text = re.sub(r"\[/?\w+\]", "", cell)
            if ":" in text:  # a name may be broken after its colon when the table is turned
                assert all(part in out for part in text.split(":")), text
            else:
                assert re.search(rf"(?<![\w.+]){re.escape(text)}(?![\w.%])", out), text
    for header in headers:  # every word of every header, whole
        for word in re.split(r"[\s-]+", header):
            assert word in out, word
    lines = out.splitlines()
    verdicts = [line for line in lines if re.search(r"\b(yes|no)\b", line)]
    assert verdicts  # the fits column or row is there, whole


def test_the_table_is_turned_only_where_it_does_not_fit(monkeypatch):
    """At 120 columns the table reads as before, one row per strategy; at 80 one column each."""
    wide = _printed(Console(width=120, file=io.StringIO(), color_system=None), monkeypatch)
    narrow = _printed(Console(width=80, file=io.StringIO(), color_system=None), monkeypatch)
    assert any(line.startswith("selective:torchtitan") for line in wide.splitlines())
    assert any(line.startswith("max seq") for line in narrow.splitlines())
