"""Atomic outputs: write into a temp directory beside the destination, then rename.

A crash or an error leaves either the old files or the complete new ones, never a
half-written file under the destination name.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import tempfile
from pathlib import Path

from . import interrupts
from .errors import QwcError


def check_destination(dest: Path, folder: bool = False, foreign=None) -> None:
    """Fail early, before any expensive work, if `dest` cannot be written. Creates nothing.
    `folder`: the output is a directory (replaced whole), not a file; `foreign(dest)` says
    what in an existing one qwc did not write (None: nothing), see check_replaceable."""
    dest = Path(dest)
    if folder and dest.exists() and not dest.is_dir():
        raise QwcError(f"cannot write {dest}: a file is in the way")
    if not folder and dest.is_dir():
        raise QwcError(f"cannot write {dest}: it is a directory")
    if foreign is not None:
        check_replaceable(dest, foreign)
    ancestor = dest.parent
    while not ancestor.exists():  # the folders that staging will create
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise QwcError(f"cannot write {dest}: {ancestor} is not a directory")
    if not os.access(ancestor, os.W_OK):
        raise QwcError(f"cannot write {dest}: {ancestor} is not writable")


def check_replaceable(dest: Path, foreign) -> None:
    """An output replaces an existing `dest` (a file, or a folder that is not empty) only if qwc
    wrote it: `foreign(dest)` names what there qwc did not write (None: nothing), and that is
    refused, so no command ever deletes or overwrites a user's files. Checked before the work
    and again just before the swap."""
    dest = Path(dest)
    if dest.is_dir() and not any(dest.iterdir()):
        return
    what = foreign(dest)
    if what is not None:
        raise QwcError(f"cannot write {dest}: {what}; qwc replaces only what it wrote "
                       "(remove it or choose another output)")


def replace_dir(src: Path, dst: Path, foreign) -> None:
    """Move the finished folder `src` onto `dst`, which check_replaceable allows to replace."""
    check_replaceable(dst, foreign)
    with interrupts.placing(dst):   # a Ctrl-C between the two renames would leave neither
        if not dst.exists():
            os.replace(src, dst)
            return
        old = _make_temp(dst, ".old")
        os.replace(dst, old / dst.name)
        try:
            os.replace(src, dst)
        except BaseException:
            os.replace(old / dst.name, dst)
            shutil.rmtree(old, ignore_errors=True)
            raise
    shutil.rmtree(old, ignore_errors=True)


OWNER = ".qwc-owner"   # in every temp folder qwc makes beside an output: the pid that made it


def _make_temp(dest: Path, suffix: str) -> Path:
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=suffix, dir=dest.parent))
    (tmp / OWNER).write_text(f"{os.getpid()}\n")
    return tmp


def remove_stale(dest: Path) -> None:
    """Remove the temp folders an earlier qwc left beside `dest` when it was killed (SIGKILL,
    power loss): named after `dest`, holding qwc's owner file, made by a process that is gone."""
    for tmp in Path(dest).parent.glob(f".{glob.escape(Path(dest).name)}.*"):
        if not (tmp.suffix in (".tmp", ".old") and tmp.is_dir()):
            continue
        try:
            pid = int((tmp / OWNER).read_text())
        except (OSError, ValueError):
            continue   # not ours: leave it
        if pid != os.getpid() and not _alive(pid):
            shutil.rmtree(tmp, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass   # alive, another user's
    return True


@contextlib.contextmanager
def staging_dir(dest: Path, folder: bool = False, foreign=None):
    """Yield a fresh temp directory on the same filesystem as `dest`; removed on exit.
    Temp folders of killed earlier runs for the same `dest` are removed first."""
    dest = Path(dest)
    check_destination(dest, folder, foreign)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        remove_stale(dest)
        tmp = _make_temp(dest, ".tmp")
    except OSError as e:
        raise QwcError(f"cannot write {dest}: {e.strerror}") from None
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def temp_files_in(folder: Path):
    """Send the temp files of this process (Python's tempfile, as TVM's export uses) and of
    the compilers it starts (TMPDIR) into `folder`, so a killed run leaves them where
    remove_stale finds them instead of in the system temp directory."""
    saved_dir, saved_env = tempfile.tempdir, os.environ.get("TMPDIR")
    tempfile.tempdir = os.environ["TMPDIR"] = str(folder)
    try:
        yield
    finally:
        tempfile.tempdir = saved_dir
        if saved_env is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = saved_env


def publish(files: list[tuple[Path, Path]], foreign=None) -> None:
    """Rename staged files onto their destinations, in order.

    Put the primary file (the one later stages open first) last, so its presence
    implies its companions are complete. `foreign(primary)`: as for check_replaceable.
    """
    if foreign is not None:
        check_replaceable(files[-1][1], foreign)
    for _, dst in files:
        if Path(dst).is_dir():
            raise QwcError(f"cannot write {dst}: it is a directory")
    with interrupts.placing(files[-1][1]):
        for src, dst in files:
            os.replace(src, dst)
