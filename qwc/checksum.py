"""File hashes recorded in artifacts (compiler) and checked on load (runtime).

Checking a 7B's params.bin reads 4 GB, the larger part of a warm start. A file's digest, once
computed, is remembered under the file's identity (device, inode, size, modification time in
nanoseconds), so that loading an unchanged artifact again reads nothing: any write, copy or
replacement changes that identity and the file is read again (a file younger than two
seconds is not recorded: its next write could keep its time). The records are small JSON files
in `$QWC_VERIFY_CACHE` (`off`: none), else `$XDG_CACHE_HOME/qwc/verified`; a folder that cannot
be written only means every load hashes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import tempfile
import time
from pathlib import Path

from . import progress
from .cache_folders import file_record

CACHE_ENV = "QWC_VERIFY_CACHE"
RACY_NS = 2_000_000_000


# A file this large is hashed as a stage with a bar: at 32B, reading params.bin is a long,
# otherwise silent wait on the first load.
REPORTED_BYTES = 1 << 30
CHUNK = 1 << 22
WINDOW = 64 << 20   # a multiple of 2 MiB: each window's huge pages line up with the file's


def sha256(path: Path) -> str:
    """The file's digest, read through mappings advised for huge pages, a window at a time (the
    process holds no more of the file than a window): what read(2) leaves in the page cache is
    partly in small folios, which the engine's mapping of params.bin would then map 4 KiB a
    page (runtime/memory.py: MappedFile)."""
    h = hashlib.sha256()
    size = os.path.getsize(path)
    with contextlib.ExitStack() as stack:
        f = stack.enter_context(open(path, "rb"))
        done = None
        if size >= REPORTED_BYTES:
            stack.enter_context(progress.stage(f"checking {Path(path).name} against its hash "
                                               f"({size / 2**30:.1f} GiB; once per file)"))
            done = stack.enter_context(progress.bar(total=size, desc="hashing", unit="B", scaled=True)).update
        for start in range(0, size, WINDOW):
            with mmap.mmap(f.fileno(), min(WINDOW, size - start), access=mmap.ACCESS_READ, offset=start) as m:
                if hasattr(mmap, "MADV_HUGEPAGE"):
                    with contextlib.suppress(OSError):
                        m.madvise(mmap.MADV_HUGEPAGE)
                with memoryview(m) as view:
                    for at in range(0, len(m), CHUNK):
                        h.update(view[at:at + CHUNK])
                        if done is not None:
                            done(min(CHUNK, len(m) - at))
    return h.hexdigest()


def remembered_sha256(path: Path) -> str:
    """sha256(path), read from the record of an earlier hash of this very file where there is one."""
    path = Path(path).resolve()
    record, identity = file_record(CACHE_ENV, "verified", path)
    if record is not None:
        try:
            held = json.loads(record.read_text())
            if held.get("identity") == identity and isinstance(held.get("sha256"), str):
                return held["sha256"]
        except (OSError, ValueError):
            pass
    digest = sha256(path)
    # As git's racily clean entries: a file written within the clock's granularity of its hash
    # could be written again with the same time, so only a file older than RACY_NS is recorded.
    if record is not None and time.time_ns() - identity[3] > RACY_NS:
        tmp = None
        try:
            record.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=record.parent, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump({"path": str(path), "identity": identity, "sha256": digest}, f)
            os.replace(tmp, record)
        except OSError:   # a read-only cache: the next load hashes again
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)
    return digest
