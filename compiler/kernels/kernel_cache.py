"""The hand-written kernels, kept on disk once built: parsing their TVMScript is most of an
import's time (each builder parses its macros once per shape), and the same kernels come back
in every compile of a model and of its siblings in size.

`cached_kernel` wraps a kernel builder: within a process it memoizes as functools.cache did;
across processes it keeps each PrimFunc as TVM's JSON under a key made of the builder's name,
its arguments, and a hash of every compiler source file and TVM's version, so an edited kernel,
schedule or TVM never reads an old entry. The folder is `$QWC_KERNEL_CACHE` (`off`: no disk
cache), else `$XDG_CACHE_HOME/qwc/kernels` (`~/.cache/qwc/kernels`). Entries are written
atomically; an unreadable one is rebuilt; a folder that cannot be written only costs the time.
Each compile ends with `prune`, which keeps the folder (with kernel_objects.py's object files)
under CACHE_LIMIT by dropping the least recently used entries.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import re
import tempfile
import time
from pathlib import Path

from qwc.cache_folders import cache_folder

CACHE_ENV = "QWC_KERNEL_CACHE"
_COMPILER = Path(__file__).resolve().parent.parent   # compiler/: every file a kernel's TIR may depend on


def cache_dir() -> Path | None:
    """The cache's folder, or None where it is off."""
    return cache_folder(CACHE_ENV, "kernels")


@functools.cache
def _sources_digest() -> str:
    import tvm

    h = hashlib.sha256(tvm.__version__.encode())
    for f in sorted(_COMPILER.rglob("*.py")):
        h.update(str(f.relative_to(_COMPILER)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def _plain(value) -> bool:
    """Whether `value`'s repr names it exactly (the arguments a key may hold)."""
    if isinstance(value, tuple):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str))


def _entry(builder, args: tuple, kwargs: dict) -> Path | None:
    where = cache_dir()
    if where is None or not _plain(args) or not _plain(tuple(kwargs.values())):
        return None
    key = repr((_sources_digest(), builder.__module__, builder.__qualname__, args, sorted(kwargs.items())))
    return where / f"{builder.__name__}-{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"


def _load(path: Path):
    # Not tvm.ir.load_json: its upgrade from older TVMs' schemas re-encodes the whole graph in
    # Python, and an entry's key already names the TVM that wrote it.
    from tvm.ir.base import from_json_graph_str

    try:
        func = from_json_graph_str(path.read_text())
    except Exception:  # absent, or unreadable (a partial copy, another TVM's format): rebuild it
        return None
    with contextlib.suppress(OSError):
        os.utime(path)   # recently used: what `prune` keeps
    return func


def _store(path: Path, func) -> None:
    import tvm

    if not isinstance(func, tvm.tirx.PrimFunc):
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(tvm.ir.save_json(func))
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:   # a read-only or full cache folder: the kernel is built again next time
        pass


def cached_kernel(builder):
    """`builder`, memoized per process and kept on disk (see the module's docstring). Its
    un-cached form stays reachable as `__wrapped__`."""
    memo = {}

    @functools.wraps(builder)
    def build(*args, **kwargs):
        key = (args, tuple(kwargs.items()))
        if key in memo:
            return memo[key]
        path = _entry(builder, args, kwargs)
        func = _load(path) if path is not None else None
        if func is None:
            func = builder(*args, **kwargs)
            if path is not None:
                _store(path, func)
        memo[key] = func
        return func

    build.cache_clear = memo.clear
    return build


# The most the folder holds before a compile drops its least recently used entries (ccache's
# default is 5 GB): entries of an older qwc or TVM are never read again, and every edit of the
# compiler makes a new set.
CACHE_LIMIT = 4 << 30
_ENTRY = re.compile(r"^[\w.]+-[0-9a-f]{32}\.(json|o|o\.json)$")
_STALE_TEMP = 24 * 3600   # a temp file this old was left by a process that died while writing


def prune(limit: int = CACHE_LIMIT) -> int:
    """Delete the folder's least recently used entries (by modification time: a read touches
    its entry) until it holds at most `limit` bytes, and temp files a dead writer left; only
    files named as this module and kernel_objects.py name theirs. Returns the bytes freed."""
    where = cache_dir()
    if where is None or not where.is_dir():
        return 0
    entries, now, freed = [], time.time(), 0
    for f in os.scandir(where):
        try:
            st = f.stat(follow_symlinks=False)
        except OSError:
            continue
        if not f.is_file(follow_symlinks=False):
            continue
        if f.name.startswith(".tmp-") and now - st.st_mtime > _STALE_TEMP:
            entries.append((0.0, st.st_size, f.path))   # first to go
        elif _ENTRY.match(f.name):
            entries.append((st.st_mtime, st.st_size, f.path))
    total = sum(size for _, size, _ in entries)
    for mtime, size, path in sorted(entries):
        if total <= limit and mtime:
            break
        try:
            os.unlink(path)
        except OSError:
            continue
        total -= size
        freed += size
    return freed
