"""Numbers and flags read from files qwc did not write (GGUF metadata, a Hugging Face
config.json, a PEFT adapter_config.json), checked by type and range before any arithmetic
uses them.

Each bad value is one `QwcError` line that names the file, the key as the file spells it and
the value as the file holds it, so a hand-edited or damaged file never reaches a division by
zero, a `float("sixteen")` or a loop over a billion layers.
"""

from __future__ import annotations

import json
import math
import re

from .errors import QwcError

_SHOWN = 60   # characters of a bad value quoted in a message: a message stays one short line


def shown(value) -> str:
    """`value` as the file spells it (JSON where it can be: null, "sixteen", NaN), cut short."""
    try:
        text = json.dumps(value, allow_nan=True)
    except (TypeError, ValueError):
        text = repr(value)
    text = " ".join(text.split())
    return text if len(text) <= _SHOWN else text[:_SHOWN - 3] + "..."


def integer(where, key: str, value, lo: int = 1, hi: int | None = None) -> int:
    """`value` as an int in [lo, hi]; bools, floats (8.0 included), strings and null refused."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise QwcError(f"{where}: {key} {shown(value)} must be an integer >= {lo}")
    if value < lo or (hi is not None and value > hi):
        bound = f"from {lo} to {hi}" if hi is not None else f">= {lo}"
        raise QwcError(f"{where}: {key} {value} must be an integer {bound}")
    return value


def positive_number(where, key: str, value, allow_zero: bool = False) -> float:
    """`value` as a finite float > 0 (>= 0 with `allow_zero`)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or (
            value < 0 or (value == 0 and not allow_zero)):
        what = "a finite number >= 0" if allow_zero else "a positive finite number"
        raise QwcError(f"{where}: {key} {shown(value)} must be {what}")
    return float(value)


def flag(where, key: str, value) -> bool:
    if not isinstance(value, bool):
        raise QwcError(f"{where}: {key} {shown(value)} must be true or false")
    return value


def string(where, key: str, value) -> str:
    if not isinstance(value, str):
        raise QwcError(f"{where}: {key} {shown(value)} must be a string")
    return value


def pattern(where, key: str, value) -> str:
    """A regular expression a file names modules by (peft's rank_pattern keys, target_modules)."""
    string(where, key, value)
    try:
        re.compile(value)
    except re.error as e:
        raise QwcError(f"{where}: {key} {shown(value)} is not a valid regular expression ({e})") from None
    return value


def multiple(where, key: str, value: int, of_key: str, of: int) -> None:
    """`value` (of `key`) a whole multiple of `of` (of `of_key`)."""
    if value % of:
        raise QwcError(f"{where}: {key} {value} is not a multiple of {of_key} {of}")
