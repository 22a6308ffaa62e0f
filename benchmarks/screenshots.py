"""The pages README and docs show, as a reader sees them: the report and a sharded fit page at 360
and 1280 px, in headless Chromium (`apt-get install chromium`), written to docs/img.

    python benchmarks/screenshots.py            # ~1 min on a 2-core CPU

tests/test_html.py checks the same pages' layout at these widths (nothing cut, figures within
the page); this script only keeps the pictures."""

from __future__ import annotations

import html
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from PIL import Image

from remat.answers.cli import main

IMG = Path(__file__).resolve().parent.parent / "docs" / "img"
PAGES = {
    "report": ["report", "--model", "gpt2", "--tiny"],
    "fit-sharded": ["fit", "--model", "gpt2", "--seq", "1024", "--batch", "8", "--gpu", "h100",
                    "--shard", "8", "--precision", "bf16-mixed", "--optimizer", "adamw"],
}  # fmt: skip
WIDTHS = (360, 1280)


def screenshot(page: Path, width: int, png: Path) -> None:
    """`page` laid out `width` px wide (in an iframe: headless Chromium's window is at least
    500 px), its whole height."""
    frame = page.with_name(f"{page.stem}-{width}.html")
    frame.write_text(
        '<!DOCTYPE html><html><body style="margin:0">'
        f'<iframe style="border:0;width:{width}px;height:6000px" '
        f'srcdoc="{html.escape(page.read_text(encoding="utf-8"), quote=True)}"></iframe>'
        "</body></html>",
        encoding="utf-8",
    )
    run = subprocess.run(
        [shutil.which("chromium") or "chromium", "--headless", "--no-sandbox", "--disable-gpu",
         "--hide-scrollbars", f"--window-size={max(width, 500)},2400",
         "--virtual-time-budget=5000", f"--screenshot={png}", frame.as_uri()],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    if run.returncode != 0:
        raise SystemExit(f"chromium failed on {page.name}: {run.stderr[-1000:]}")
    with Image.open(png) as shot:  # the window's width past the iframe's is blank
        shot.crop((0, 0, width, shot.height)).save(png)


def main_() -> int:
    if shutil.which("chromium") is None:
        print("chromium is not installed (apt-get install chromium)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        for name, argv in PAGES.items():
            page = Path(tmp) / f"{name}.html"
            if main([*argv, "--html", str(page)]) != 0:
                return 1
            for width in WIDTHS:
                png = IMG / f"{name}-{width}.png"
                screenshot(page, width, png)
                print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main_())
