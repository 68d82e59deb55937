"""qwc's folders under the user's cache, each movable or turned off by an environment variable."""

from __future__ import annotations

import os
from pathlib import Path


def cache_folder(env: str, name: str) -> Path | None:
    """`$env` where it is set (`off`: None), else `$XDG_CACHE_HOME/qwc/NAME` (`~/.cache/qwc/NAME`)."""
    where = os.environ.get(env)
    if where == "off":
        return None
    if where:
        return Path(where)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "qwc" / name
