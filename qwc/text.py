"""Reading a user's text and JSON files: shared by training (models/) and evaluation (eval/), so
neither imports the other."""

from __future__ import annotations

import json
from pathlib import Path

from .errors import QwcError


def read_text(path: Path) -> str:
    """A text file's contents, refusing anything that is not UTF-8 text."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise QwcError(f"{path}: not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise QwcError(f"{path}: cannot read ({e.strerror})") from None
    if "\0" in text:
        raise QwcError(f"{path}: not a text file (it holds NUL bytes)")
    return text


def read_json_object(path: Path) -> dict:
    """A JSON file holding one object (a config), refusing anything else in one line."""
    try:
        d = json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise QwcError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(d, dict):
        raise QwcError(f"{path}: not a JSON object")
    return d
