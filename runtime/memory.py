"""Host memory for the parameters and the KV cache, backed by transparent huge pages.

A decode step streams every weight once (~290 MB for Qwen2.5-0.5B). In 4 KiB pages that is
~70,000 TLB misses a step, and the GEMVs' prefetches run into page walks; one anonymous
mapping advised MADV_HUGEPAGE is served in 2 MiB pages wherever the kernel's THP setting is
"always" or "madvise" (Debian's default): a faster decode (docs/history/x86-speed.md).
Where huge pages are unavailable the mapping is plain memory and everything works the same.

Each array is a 64-byte aligned slice of the mapping (TVM takes foreign memory only so
aligned) and is handed to TVM without a copy; the TVM tensors keep the mapping alive.

The parameters are instead mapped from params.bin itself (MappedFile), as llama.cpp maps its
GGUF: no copy at load, pages shared with every other process that maps the file and kept in
the page cache across restarts. The mapping is private (copy-on-write), so no write through it
could reach the file, and writable, so numpy hands it to TVM by DLPack as any array; nothing
writes a parameter, so its pages stay the page cache's.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import mmap
import os
import re

import numpy as np

from qwc.cache_folders import file_record

ALIGN = 64                 # TVM's required data alignment
HUGE_PAGE = 2 << 20        # x86_64 and aarch64 (4 KiB base pages) transparent huge page size


def aligned(n: int, a: int = ALIGN) -> int:
    return -(-n // a) * a


class Arena:
    """`size` bytes of zeroed anonymous memory, sliced into arrays by `take`."""

    def __init__(self, size: int):
        self._map = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        advice = getattr(mmap, "MADV_HUGEPAGE", None)   # Linux only
        if advice is not None:
            try:
                self._map.madvise(advice)
            except OSError:   # THP compiled out of the kernel: 4 KiB pages
                pass
        whole = np.frombuffer(self._map, np.uint8)
        start = (-whole.ctypes.data) % HUGE_PAGE      # start on a huge page boundary
        self._bytes = whole[start:start + size]
        self._used = 0

    def commit(self) -> None:
        """Write every page taken so far, so the memory is the process's now rather than as
        it is first touched (one call: numpy fills without the GIL)."""
        self._bytes[:self._used].fill(0)

    def take(self, shape, dtype) -> np.ndarray:
        """The next 64-byte aligned array of `shape` and `dtype` (zeros)."""
        dtype = np.dtype(dtype)
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        start = aligned(self._used)
        if start + n > len(self._bytes):
            raise ValueError(f"arena of {len(self._bytes)} bytes cannot hold {n} more at {start}")
        self._used = start + n
        return self._bytes[start:start + n].view(dtype).reshape(shape)


class MappedFile:
    """The file at `path` mapped copy-on-write, its pages read in ahead (MADV_POPULATE_READ:
    page-cache pages mapped without a fault each, never copied) where the kernel has it.

    A mapping maps the page cache's folios as they are: those a fault advised MADV_HUGEPAGE
    read in are 2 MiB, but those that read(2) or a copy's writes left are partly or wholly
    smaller, and map 4 KiB a page (a slower decode, docs/history/x86-speed.md). Where a file's
    mapping comes out mostly small and the file system does keep 2 MiB folios
    (`_folios_can_be_huge`), the file's cached pages that no process maps are dropped and read
    again through the mapping (`reread`): one read from disk, after which every later load maps
    2 MiB pages from the page cache. A reread that stays small is not tried again on that file
    (`_remember_futile`)."""

    POPULATE_READ = 22   # Linux 5.14's MADV_POPULATE_READ (Python 3.11's mmap does not name it)

    def __init__(self, path):
        self.reread = False
        self._map = self._mapped(path)
        # (size first: a file under two huge pages is never probed, nor its mapping's smaps read)
        share = pmd_mapped_share(self._map) if len(self._map) >= 2 * HUGE_PAGE else None
        if share is not None and share < HUGE_SHARE and not _futile_before(path):
            self._map.close()   # (its pages mapped here would not be dropped)
            if _folios_can_be_huge(path):
                drop_cached(path)
                self.reread = True
            self._map = self._mapped(path)
            if self.reread and (pmd_mapped_share(self._map) or 0.0) < HUGE_SHARE:
                _remember_futile(path)   # (memory too fragmented for 2 MiB folios, say)
        self.bytes = np.frombuffer(self._map, np.uint8)

    @classmethod
    def _mapped(cls, path, length: int = 0, access=mmap.ACCESS_COPY) -> mmap.mmap:
        with open(path, "rb") as f:
            m = mmap.mmap(f.fileno(), length, access=access)
        for advice in (getattr(mmap, "MADV_HUGEPAGE", None), cls.POPULATE_READ):
            try:   # (file pages are huge only where the file system keeps large folios)
                if advice is not None:
                    m.madvise(advice)
            except OSError:   # an older kernel: pages fault in on first use instead
                pass
        return m

    def view(self, offset: int, shape, dtype) -> np.ndarray:
        """The array of `shape` and `dtype` stored at `offset` (64-byte aligned), not copied."""
        dtype = np.dtype(dtype)
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        return self.bytes[offset:offset + n].view(dtype).reshape(shape)


HUGE_SHARE = 0.95   # a mapping with fewer of its pages in 2 MiB ones is read again (MappedFile)


def _address(m: mmap.mmap) -> int:
    a = np.frombuffer(m, np.uint8)
    address = a.ctypes.data
    del a   # (an exported buffer would keep the mapping from being closed)
    return address


def pmd_mapped_share(m: mmap.mmap) -> float | None:
    """The share of mapping `m`'s whole 2 MiB spans mapped as 2 MiB pages (its FilePmdMapped in
    /proc/self/smaps; a tail shorter than 2 MiB is in small pages whatever the cache holds);
    None where that is not to be read (not Linux) or `m` holds no such span."""
    spans = len(m) // HUGE_PAGE * HUGE_PAGE
    if not spans:   # (before reading smaps: a small file's load does no more than it did)
        return None
    try:
        with open("/proc/self/smaps") as f:
            text = f.read()
    except OSError:
        return None
    block = re.search(rf"^{_address(m):x}-.*?\n(.*?)(?=^[0-9a-f]+-|\Z)", text, re.M | re.S)
    if block is None:
        return None
    pmd = re.search(r"^FilePmdMapped:\s+(\d+) kB", block.group(1), re.M)
    return int(pmd.group(1)) * 1024 / spans if pmd else 0.0


def drop_cached(path, length: int = 0) -> None:
    """Drop the first `length` bytes (0: all) of the file's page-cache pages that no process
    maps, written out first if a write (a copy just made) left them dirty: the kernel drops only
    clean pages. The file's bytes do not change."""
    if hasattr(os, "posix_fadvise"):
        fd = os.open(path, os.O_RDONLY)
        try:
            with contextlib.suppress(OSError):   # (a file system that cannot sync: clean already)
                os.fdatasync(fd)
            os.posix_fadvise(fd, 0, length, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# A reread that left the file mostly in small pages all the same is not tried again for that
# file (its identity: device, inode, size, modification time), so that no later load pays a
# disk read for nothing. The records are small files in $QWC_REREAD_CACHE (`off`: none), else
# $XDG_CACHE_HOME/qwc/rereads.
FUTILE_ENV = "QWC_REREAD_CACHE"


def _futile_before(path) -> bool:
    record, identity = file_record(FUTILE_ENV, "rereads", path)
    try:
        return record is not None and json.loads(record.read_text()) == identity
    except (OSError, ValueError):
        return False


def _remember_futile(path) -> None:
    record, identity = file_record(FUTILE_ENV, "rereads", path)
    if record is not None:
        with contextlib.suppress(OSError):   # a read-only cache: the next load may try again
            record.parent.mkdir(parents=True, exist_ok=True)
            record.write_text(json.dumps(identity))


def _folios_can_be_huge(path) -> bool:
    """Whether the file system holds this file's pages in 2 MiB folios when a mapping advised
    MADV_HUGEPAGE reads them in: its first 4 MiB are dropped (those no one maps) and mapped again.
    False on kernels whose file systems keep only small folios, where a reread would gain nothing."""
    drop_cached(path, 2 * HUGE_PAGE)
    probe = MappedFile._mapped(path, 2 * HUGE_PAGE, mmap.ACCESS_READ)
    try:
        return bool(pmd_mapped_share(probe))
    finally:
        probe.close()


def cached_bytes(path) -> int | None:
    """How many of the file's bytes are in the page cache now (mincore(2) on a read-only mapping
    of it, which reads nothing in), or None where mincore is not to be had. A load whose
    params.bin is not cached waits on the disk, and says so (runtime/engine.py)."""
    size = os.path.getsize(path)
    if not size:
        return 0
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype, libc.mmap.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                                                ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    except (OSError, AttributeError):
        return None
    with open(path, "rb") as f:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, f.fileno(), 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        return None
    try:
        pages = np.zeros(-(-size // mmap.PAGESIZE), np.uint8)
        if libc.mincore(addr, size, pages.ctypes.data) != 0:
            return None
    finally:
        libc.munmap(addr, size)
    return min(size, int(np.count_nonzero(pages & 1)) * mmap.PAGESIZE)


def uncached_bytes(path) -> int | None:
    """The bytes of the file at `path` not in the page cache (None: unknown, or no such file)."""
    if not os.path.isfile(path):
        return None
    cached = cached_bytes(path)
    return None if cached is None else os.path.getsize(path) - cached


def arena_for(arrays) -> Arena:
    """An arena that holds arrays of these (shape, dtype), each 64-byte aligned."""
    return Arena(sum(aligned(int(np.prod(s, dtype=np.int64)) * np.dtype(d).itemsize) for s, d in arrays))
