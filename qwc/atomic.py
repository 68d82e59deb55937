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


def check_destination(dest: Path, folder: bool = False, foreign=None) -> None:
    """Fail early, before any expensive work, if `dest` cannot be written. Creates nothing.
    `folder`: the output is a directory (replaced whole), not a file; `foreign(dest)` says
    what in an existing one qwc did not write (None: nothing), see check_replaceable."""
    dest = Path(dest)
    if folder and dest.exists() and not dest.is_dir():
        raise QwcError(f"cannot write {dest}: a file is in the way")
    if folder and foreign is not None:
        check_replaceable(dest, foreign)
    if not folder and dest.is_dir():
        raise QwcError(f"cannot write {dest}: it is a directory")
    ancestor = dest.parent
    while not ancestor.exists():  # the folders that staging will create
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise QwcError(f"cannot write {dest}: {ancestor} is not a directory")
    if not os.access(ancestor, os.W_OK):
        raise QwcError(f"cannot write {dest}: {ancestor} is not writable")


def check_replaceable(dest: Path, foreign) -> None:
    """A folder output replaces an existing `dest` only if it is empty or qwc wrote it:
    `foreign(dest)` names what in it qwc did not write (None: nothing), and that is refused,
    so no command ever deletes a user's files. Checked before the work and again just
    before the swap."""
    dest = Path(dest)
    if not dest.is_dir() or not any(dest.iterdir()):
        return
    what = foreign(dest)
    if what is not None:
        raise QwcError(f"cannot write {dest}: {what}; qwc replaces only a folder it wrote "
                       "(remove it or choose another output)")


def replace_dir(src: Path, dst: Path, foreign) -> None:
    """Move the finished folder `src` onto `dst`, which check_replaceable allows to replace."""
    check_replaceable(dst, foreign)
    if dst.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".old", dir=dst.parent))
        os.replace(dst, old / dst.name)
        os.replace(src, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(src, dst)


@contextlib.contextmanager
def staging_dir(dest: Path, folder: bool = False, foreign=None):
    """Yield a fresh temp directory on the same filesystem as `dest`; removed on exit."""
    dest = Path(dest)
    check_destination(dest, folder, foreign)
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
