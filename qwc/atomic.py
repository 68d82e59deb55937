"""Atomic outputs: write into a temp directory beside the destination, then rename.

A crash or an error leaves either the old files or the complete new ones, never a
half-written file under the destination name.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

from .errors import QwcError


def check_destination(dest: Path, folder: bool = False) -> None:
    """Fail early, before any expensive work, if `dest` cannot be written. Creates nothing.
    `folder`: the output is a directory (replaced whole), not a file."""
    dest = Path(dest)
    if folder and dest.exists() and not dest.is_dir():
        raise QwcError(f"cannot write {dest}: a file is in the way")
    if not folder and dest.is_dir():
        raise QwcError(f"cannot write {dest}: it is a directory")
    ancestor = dest.parent
    while not ancestor.exists():  # the folders that staging will create
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise QwcError(f"cannot write {dest}: {ancestor} is not a directory")
    if not os.access(ancestor, os.W_OK):
        raise QwcError(f"cannot write {dest}: {ancestor} is not writable")


@contextlib.contextmanager
def staging_dir(dest: Path, folder: bool = False):
    """Yield a fresh temp directory on the same filesystem as `dest`; removed on exit."""
    dest = Path(dest)
    check_destination(dest, folder)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent))
    except OSError as e:
        raise QwcError(f"cannot write {dest}: {e.strerror}") from None
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def publish(files: list[tuple[Path, Path]]) -> None:
    """Rename staged files onto their destinations, in order.

    Put the primary file (the one later stages open first) last, so its presence
    implies its companions are complete.
    """
    for _, dst in files:
        if Path(dst).is_dir():
            raise QwcError(f"cannot write {dst}: it is a directory")
    for src, dst in files:
        os.replace(src, dst)
