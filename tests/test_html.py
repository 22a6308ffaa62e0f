"""The HTML report (`remat.answers.html.write_report`): one self-contained file (inline SVG, inline data,
nothing fetched), every section there, the numbers in its JSON block those of the planner; and,
where Chromium is installed, that a browser renders it without a console message."""

from __future__ import annotations

import html
import json
import re
import shutil
import struct
import subprocess
from html.parser import HTMLParser
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import remat
from remat import models
from remat.answers.html import SECTIONS, TOP_DECISIONS, write_report
from remat.units import format_bytes

TITLE = "gpt2 (tiny) batch 2 seq 64"


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    model, inputs = models.build("gpt2", batch=2, seq=64, tiny=True)
    planner = remat.Planner(remat.trace(model, *inputs))
    chosen = planner.plan("+10%")
    budget = planner.budget_bytes("+10%")
    fit_rows = [
        {"model": "gpt2", "predicted_peak_bytes": 2_500_000, "measured_peak_bytes": 2_450_000,
         "error": 0.02, "ok": True},
        {"model": "llama", "predicted_peak_bytes": 3_000_000, "measured_peak_bytes": None,
         "error": None, "ok": False},
    ]  # fmt: skip
    bench_rows = [
        SimpleNamespace(
            to_dict=lambda: {
                "strategy": "store_all",
                "peak_bytes": 2_600_000,
                "step_seconds": 0.012,
                "time_ratio": 1.0,
                "note": "",
            }
        )
    ]
    path = tmp_path_factory.mktemp("html") / "report.html"
    out = write_report(
        str(path),
        planner,
        title=TITLE,
        budget_bytes=budget,
        chosen=chosen,
        fit_rows=fit_rows,
        bench_rows=bench_rows,
    )
    assert out == str(path)
    return SimpleNamespace(
        path=path, text=path.read_text(encoding="utf-8"), planner=planner, chosen=chosen,
        budget=budget,
    )  # fmt: skip


class Attributes(HTMLParser):
    """Every (tag, attribute, value) of a page, and the ids."""

    def __init__(self) -> None:
        super().__init__()
        self.attrs: list[tuple[str, str, str]] = []

    def handle_starttag(self, tag, attrs):
        self.attrs += [(tag, k, v or "") for k, v in attrs]

    handle_startendtag = handle_starttag


def data_block(text: str) -> dict:
    m = re.search(r'<script type="application/json" id="remat-data">(.*?)</script>', text, re.S)
    assert m, "no JSON data block"
    return json.loads(m.group(1))


def test_one_self_contained_file(report):
    assert [p.name for p in report.path.parent.iterdir()] == ["report.html"]
    parser = Attributes()
    parser.feed(report.text)
    refs = [
        (tag, k, v)
        for tag, k, v in parser.attrs
        if k in ("src", "href", "xlink:href", "action", "srcset", "poster", "data")
    ]
    # Only in-page anchors: no file, no network.
    assert refs and all(v.startswith("#") for _, _, v in refs), refs
    assert not re.search(r"(?:url\(|@import)\s*['\"]?(?:https?:)?//", report.text)
    assert not [a for a in parser.attrs if re.match(r"\s*(?:https?:)?//", a[2])]
    assert "<script src" not in report.text and "<link" not in report.text
    ids = [v for _, k, v in parser.attrs if k == "id"]
    assert len(ids) == len(set(ids)), "several figures share an SVG id"


def test_sections_figures_and_chosen_plan(report):
    text = report.text
    for key, heading in SECTIONS.items():
        assert f'<section id="{key}"><h2>{html.escape(heading)}</h2>' in text
    assert text.count("<svg") >= 3
    assert text.count("</svg>") == text.count("<svg")
    assert "<?xml" not in text and "<!DOCTYPE svg" not in text
    chosen, planner = report.chosen, report.planner
    assert f"Chosen: {chosen.strategy}" in text
    assert format_bytes(chosen.predicted_peak_bytes) in text
    assert f"{chosen.recompute_seconds / planner.step_seconds:+.1%}" in text
    assert f"budget {format_bytes(report.budget)}" in text  # the legends of the figures
    # the figure texts are text, so that a reader can search them
    assert "live memory over one training step" in text
    assert "inside one block: h.0 (of 2)" in text
    assert f"{planner.graph.info['param_count']:,}" in text
    assert '<div class="fact budget fits">' in text  # green: the chosen plan fits


def test_json_block_matches_the_planner(report):
    d = data_block(report.text)
    planner, chosen = report.planner, report.chosen
    assert d["title"] == TITLE
    assert d["budget_bytes"] == report.budget
    assert d["chosen"]["strategy"] == chosen.strategy
    assert d["chosen"]["predicted_peak_bytes"] == chosen.predicted_peak_bytes
    labels = [t["label"] for t in d["timelines"]]
    assert labels[0] == "store_all" and labels[-1] == f"chosen: {chosen.strategy}"
    assert any(label.startswith("full") for label in labels)
    # the drawn timelines are the simulations the plans were judged by
    assert d["timelines"][0]["peak_bytes"] == planner.estimate.peak_bytes
    assert d["timelines"][-1]["peak_bytes"] == chosen.predicted_peak_bytes
    for t in d["timelines"]:
        assert t["positions"] >= len(planner.graph.ops)
        assert len(t["live_bytes"]) == -(-t["positions"] // t["stride"]) <= 400
        assert max(t["live_bytes"]) == t["peak_bytes"]  # max-pooled: the peak survives
    assert sum(m["activation_bytes"] for m in d["by_module"]) == planner.estimate.activation_bytes
    assert [c["strategy"] for c in d["comparison"]] == [
        c.strategy for c in planner.compare(report.budget)
    ]
    explained = chosen.explain(planner.graph)
    assert d["decisions_total"]["tensors"] == len(explained)
    assert len(d["decisions"]) <= TOP_DECISIONS
    shown = [r["bytes"] for r in d["decisions"]]
    assert shown == sorted(shown, reverse=True) and shown[0] >= max(r["bytes"] for r in explained)
    assert d["fit"][0]["model"] == "gpt2" and d["bench"][0]["strategy"] == "store_all"


def test_tables(report):
    text = report.text
    chosen = report.chosen
    rows = chosen.explain(report.planner.graph)
    biggest = max(rows, key=lambda r: r["bytes"])
    assert f'<td class="name">{biggest["name"]}' in text
    assert text.count('<span class="tag recompute">') >= 1
    assert text.count('<span class="tag keep">') >= 1
    assert text.count('<tr><td class="name">') <= TOP_DECISIONS
    picked = chosen.strategy.removeprefix("auto (").removesuffix(")")
    assert f'<tr class="pick"><td>{picked} (chosen)</td>' in text
    # numbers right-aligned, bytes formatted, None as "-"
    assert f'<td class="num">{format_bytes(2_450_000)}</td>' in text
    assert '<th class="num">predicted peak</th>' in text  # a reader's header, not a key
    assert '<td class="num">-</td>' in text
    assert '<td class="num">12 ms</td>' in text and '<td class="num">1.00x</td>' in text


def test_no_blocks_and_nothing_fits(tmp_path):
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 4)

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))

    planner = remat.Planner(remat.trace(Net(), torch.randn(8, 16)))
    assert not planner.blocks
    path = write_report(str(tmp_path / "r.html"), planner, title="net", budget_bytes=100)
    text = (tmp_path / "r.html").read_text(encoding="utf-8")
    assert path == str(tmp_path / "r.html")
    d = data_block(text)
    assert d["chosen"] is None and "smallest feasible budget" in d["nothing_fits"]
    assert "No plan fits the budget of 100 B." in text
    assert '<div class="fact budget over">' in text  # crimson only when nothing fits
    assert [t["label"] for t in d["timelines"]] == ["store_all"]
    assert text.count("<svg") >= 3
    assert 'id="fit"' not in text and 'id="bench"' not in text


# -- in a browser ---------------------------------------------------------------------------------
def chromium(*args: str, timeout: int = 60) -> subprocess.CompletedProcess:
    exe = shutil.which("chromium")
    if exe is None:
        pytest.skip(
            "chromium is not installed (apt-get install chromium): the report's browser check "
            "needs it"
        )
    return subprocess.run(
        [
            exe,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--host-resolver-rules=MAP * ~NOTFOUND",  # no host resolves: nothing is fetched
            "--enable-logging=stderr",
            "--v=0",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def console_messages(stderr: str) -> list[str]:
    """What the page wrote to the console: uncaught errors, console.* calls. (A failed load
    logs nothing here: the static test checks that the page names nothing to load.)"""
    return [
        line for line in stderr.splitlines() if ":CONSOLE" in line or "Uncaught" in line
    ]  # fmt: skip


def test_console_messages_are_detected(tmp_path):
    """The check below sees what it looks for: a page with a script error logs it."""
    bad = tmp_path / "bad.html"
    bad.write_text("<p>x</p><script>console.error('boom'); missing();</script>")
    run = chromium("--dump-dom", bad.as_uri())
    assert run.returncode == 0, run.stderr[-2000:]
    assert any("Uncaught" in m for m in console_messages(run.stderr)), run.stderr[-2000:]


def test_renders_in_chromium(report, tmp_path):
    run = chromium("--dump-dom", report.path.as_uri())
    assert run.returncode == 0, run.stderr[-2000:]
    assert console_messages(run.stderr) == [], run.stderr[-2000:]
    assert "ERROR:CONSOLE" not in run.stderr and "Uncaught" not in run.stderr
    dom = run.stdout
    for key in SECTIONS:
        assert f'id="{key}"' in dom
    assert dom.count("<svg") >= 3
    assert 'id="remat-data"' in dom and "Chosen: " in dom

    png = tmp_path / "report.png"
    shot = chromium(f"--screenshot={png}", "--window-size=1280,4000", report.path.as_uri())
    assert shot.returncode == 0, shot.stderr[-2000:]
    assert console_messages(shot.stderr) == [], shot.stderr[-2000:]
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (1280, 4000)
    assert len(data) > 100_000  # a blank page compresses to a few KiB


def test_every_figure_scales_to_the_width_of_the_page(report):
    """Without a browser: each chart keeps its viewBox and no fixed size, and nothing in the
    styles holds a figure wider than the page (a min-width cut them at 360 px)."""
    svgs = re.findall(r"<svg\b[^>]*>", report.text)
    assert len(svgs) >= 3
    for tag in svgs:
        assert "viewBox=" in tag and not re.search(r'\s(width|height)="', tag), tag
    style = re.search(r"<style>(.*?)</style>", report.text, re.S).group(1)
    assert "min-width: 900px" not in style and "figure svg { display: block; width: 100%" in style


def test_embedded_data_is_a_minor_part_of_the_page(report):
    """The data block once was 725 KB of a 921 KB page (full timelines with their schedules, every
    plan's regions); the page is for reading."""
    block = re.search(r'id="remat-data">(.*?)</script>', report.text, re.S).group(1)
    assert len(block) < 0.3 * len(report.text), (len(block), len(report.text))


def test_a_fit_page_leads_with_the_advice_the_fit_table_and_its_arithmetic(tmp_path):
    model, inputs = models.build("gpt2", tiny=True)
    planner = remat.Planner(remat.trace(model, *inputs))
    advice = ["nothing fits: the lowest is full.", "run: remat fit --model gpt2 --shard 2"]
    rows = [{"strategy": "full", "peak_bytes": 3 * 2**20, "fits": "no"}]
    write_report(
        str(tmp_path / "fit.html"), planner, title="t", budget_bytes=2**20, fit_rows=rows,
        advice=advice, fit_caption="usable 1 MiB = capacity 2 MiB - reserve 1 MiB",
    )  # fmt: skip
    text = (tmp_path / "fit.html").read_text(encoding="utf-8")
    order = [
        text.index(x) for x in ('class="advice"', 'class="facts"', 'id="fit"', 'id="timeline"')
    ]
    assert order == sorted(order)
    assert "<code>remat fit --model gpt2 --shard 2</code>" in text
    assert "usable 1 MiB = capacity 2 MiB - reserve 1 MiB" in text
    assert '<th class="num">peak</th>' in text
    assert data_block(text)["advice"] == advice


@pytest.mark.parametrize("width", [360, 1280])
def test_the_page_does_not_overflow_a_phone_or_a_desktop(report, tmp_path, width):
    """At 360 px the charts scale to the width (their viewBox; they were cut at the right edge
    inside a scroller) and tables scroll inside their frames: the page itself never scrolls
    sideways. Headless Chromium's window is at least 500 px wide, so the page is laid out in an
    iframe of the width asked."""
    probe = tmp_path / "probe.html"
    probe.write_text(
        '<!DOCTYPE html><html><head><title>probe</title></head><body style="margin:0">'
        f'<iframe id="f" style="border:0;width:{width}px;height:3000px" '
        f'srcdoc="{html.escape(report.text, quote=True)}"></iframe><script>'
        "const f = document.getElementById('f');"
        "f.addEventListener('load', () => { const d = f.contentDocument;"
        "const svgs = [...d.querySelectorAll('figure svg')].map(s => s.getBoundingClientRect().width);"
        "document.title = 'W' + d.documentElement.scrollWidth + 'S' + Math.min(...svgs) + 'L' +"
        " Math.max(...svgs) + 'E'; });"
        "</script></body></html>",
        encoding="utf-8",
    )
    window = f"--window-size={width + 40},900"
    run = chromium(window, "--virtual-time-budget=5000", "--dump-dom", probe.as_uri())
    assert run.returncode == 0, run.stderr[-2000:]
    found = re.search(r"<title>W(\d+)S([\d.]+)L([\d.]+)E</title>", run.stdout)
    assert found, run.stdout[-500:]
    page_width, smallest_svg, widest_svg = (float(g) for g in found.groups())
    assert page_width <= width
    assert widest_svg <= width  # every chart whole within the page
    assert smallest_svg >= min(width - 56, 900)  # and as wide as the page lets it be
    png = tmp_path / f"report-{width}.png"
    shot = chromium(window, "--virtual-time-budget=5000", f"--screenshot={png}", probe.as_uri())
    assert shot.returncode == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_sharded_fit_page_shows_one_ranks_step_everywhere(tmp_path, capsys):
    """`remat fit --shard 4 --html`: the cards, the plots, the frontier, the strategies and the
    chosen plan are the rank's step the fit table judges (they were the unsharded step's:
    store-all 109 GiB on the page, 28.8 GiB in the table), and the header says so."""
    from remat.answers.cli import main

    page = tmp_path / "fit.html"
    asked = ["fit", "--model", "gpt2", "--tiny", "--batch", "2", "--seq", "64"]
    asked += ["--precision", "fp32", "--optimizer", "adamw", "--reserve", "0"]
    # 3 MiB a rank: store-all does not fit, a selective plan does
    assert main([*asked, "--capacity", "3MiB", "--shard", "4", "--html", str(page)]) == 0
    capsys.readouterr()
    text = page.read_text(encoding="utf-8")
    data = data_block(text)
    rows = {r["strategy"]: r for r in data["fit"]}
    assert rows["store_all"]["fits"] == "no" and rows["auto"]["fits"] == "yes"
    assert data["per_rank"]["shard"] == 4
    assert "per rank: FSDP2 over 4 ranks" in re.search(r"<h1>(.*?)</h1>", text).group(1)
    # the cards and the plots are the table's rank
    assert data["estimate"]["peak_bytes"] == rows["store_all"]["peak_bytes"]
    assert data["chosen"]["predicted_peak_bytes"] == rows["auto"]["peak_bytes"]
    timelines = {t["label"]: t["peak_bytes"] for t in data["timelines"]}
    assert timelines["store_all"] <= rows["store_all"]["peak_bytes"]
    assert max(timelines.values()) <= rows["store_all"]["peak_bytes"]
    named = {p["strategy"]: p["predicted_peak_bytes"] for p in data["frontier"]["named"]}
    assert named["store_all"] == rows["store_all"]["peak_bytes"]
    assert named["full"] == rows["full"]["peak_bytes"]
    strategies = {c["strategy"]: c.get("predicted_peak_bytes") for c in data["comparison"]}
    assert strategies["full"] == rows["full"]["peak_bytes"]
    card = re.search(r'store-all peak</div><div class="v">([^<]*)<', text).group(1)
    assert card == format_bytes(rows["store_all"]["peak_bytes"])
    # and not the whole model's, which is larger
    model, inputs = models.build("gpt2", batch=2, seq=64, tiny=True, device="meta")
    whole = remat.estimate(remat.trace(model, *inputs), optimizer="adamw").peak_bytes
    assert whole > rows["store_all"]["peak_bytes"]
    # every figure's title names the rank
    assert text.count("(per rank: FSDP2 over 4 ranks)") >= 4


def test_a_fit_pages_budget_card_follows_the_auto_rows_verdict(tmp_path):
    """On a fit page the card's colour is the fit table's verdict for auto (the allocator's,
    reserved bytes within its limit), not live bytes against the budget: a plan whose live peak
    is within the budget but whose reserved bytes are not was shown green."""
    planner = remat.Planner(remat.trace(nn.Linear(16, 4), torch.randn(8, 16)))
    budget = 10 * planner.estimate.peak_bytes  # the live peak fits with room to spare
    for verdict, colour in (("no", "over"), ("yes", "fits")):
        path = str(tmp_path / f"{verdict}.html")
        rows = [{"strategy": "auto", "plan": "auto (store_all)", "fits": verdict}]
        write_report(path, planner, title="net", budget_bytes=budget, fit_rows=rows)
        text = (tmp_path / f"{verdict}.html").read_text(encoding="utf-8")
        assert f'<div class="fact budget {colour}">' in text
