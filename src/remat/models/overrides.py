"""`--set FIELD=VALUE` as a user types it: values read in Python's or JSON's spelling alike, and
refused (naming the field) where a config would silently take a wrong type."""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Sequence
from typing import Any

from remat.errors import RematError

#: The words `--set` reads as Python's and JSON's constants, in either spelling and any case.
_CONSTANTS: dict[str, Any] = {"true": True, "false": False, "none": None, "null": None}

#: A value `--set` keeps as a string without quotes: a name (`loss=CrossEntropyLoss`,
#: `attn_implementation=flash_attention_2`, `task=image-classification`).
_BARE_WORD = re.compile(r"[A-Za-z_][\w.\-/]*")


def parse_value(key: str, text: str) -> Any:
    """One `--set KEY=TEXT` value as Python or JSON would read it: True/False/None and
    true/false/null (any case), numbers (2, 1e-5, .5, 1_000), quoted strings, lists and dicts;
    a bare name stays a string. Anything else is refused, naming the key: a value read as the
    string "False" would be true, and a config would silently take it."""
    stripped = text.strip()
    if stripped.lower() in _CONSTANTS:
        return _CONSTANTS[stripped.lower()]
    try:
        return json.loads(stripped)
    except json.JSONDecodeError:
        pass
    try:
        return ast.literal_eval(stripped)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        pass
    if _BARE_WORD.fullmatch(stripped):
        return stripped
    raise RematError(
        f"--set {key}={text}: cannot read {text!r}; write a number (2, 1e-5), True/False, None, "
        "a name, a quoted string ('\"8B\"') or a JSON/Python list or dict"
    )


def parse_overrides(items: Sequence[str]) -> dict[str, Any]:
    """`build`'s `**overrides` from "FIELD=VALUE" strings (the command line's `--set`), each value
    read by `parse_value`; RematError for an item without a field name or "=", or a value it
    cannot read."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise RematError(f"--set {item!r}: write FIELD=VALUE, e.g. --set n_layers=2")
        out[key] = parse_value(key, value)
    return out


def check_override_types(source: str, overrides: dict[str, Any], defaults: dict[str, Any]) -> None:
    """Refuse an override whose type cannot stand for its field's default: a non-bool for a bool
    field, a string or bool for a numeric one. `source` names the model in the message."""
    for key, value in overrides.items():
        if key not in defaults:
            continue
        default = defaults[key]
        if isinstance(default, bool):
            wrong = not isinstance(value, bool)
            want = "True or False"
        elif isinstance(default, (int, float)):
            wrong = isinstance(value, (bool, str))
            want = "a number"
        else:
            continue
        if wrong:
            raise RematError(
                f"{source}: --set {key}={value!r}: {key} is {type(default).__name__} "
                f"(default {default!r}); give {want}"
            )
