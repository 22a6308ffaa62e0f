"""Bytes as users write them ("40GiB", "1.5e9", 123) and as we print them."""

from __future__ import annotations

import re

from remat.errors import BudgetError

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_BYTES = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_bytes(text: str | int) -> int:
    """`"40GiB"`, `"512 MB"`, `"1e9"` or an int -> bytes. Raises `BudgetError` naming the input
    and showing sizes that parse."""
    if isinstance(text, int):
        return text
    m = _BYTES.match(str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise BudgetError(
            f"cannot read {text!r} as a size: write e.g. 40GiB, 512MiB, 2.5GB or a number of bytes"
        )
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_bytes(n: float) -> str:
    """Binary units, 3 significant digits: 1536 -> '1.5 KiB', 1010 MiB -> '1010 MiB'."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            # 3 significant digits, but never "1e+03": 999.5 up to 1024 prints as "1000"..."1023".
            whole = unit == "B" or n >= 999.5
            return f"{sign}{n:.0f} {unit}" if whole else f"{sign}{n:.3g} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_ms(seconds: float) -> str:
    """Seconds as milliseconds, 3 significant digits, without an exponent (`2,420 ms`, not
    `2.42e+03 ms`)."""
    ms = seconds * 1e3
    return f"{ms:,.0f} ms" if ms >= 100 else f"{ms:.3g} ms"
