"""qwc's folders under the user's cache, each movable or turned off by an environment variable."""

from __future__ import annotations

import hashlib
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


def file_record(env: str, name: str, path) -> tuple[Path | None, list[int]]:
    """(The JSON file in cache folder NAME that holds what qwc learned of the file at `path`,
    None where that cache is off; the file's identity: device, inode, size and modification
    time in nanoseconds, which any write, copy or replacement changes.)"""
    path = Path(path).resolve()
    st = path.stat()
    folder = cache_folder(env, name)
    record = folder / f"{hashlib.sha256(str(path).encode()).hexdigest()[:32]}.json" if folder else None
    return record, [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]
