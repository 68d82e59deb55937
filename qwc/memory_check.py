"""Refuse a stage, in one line, when its estimated peak memory exceeds what the machine has.

Without it a 3B export was killed by the OOM killer after a minute, with no message. Each
stage estimates its peak from the model's shapes (the figures are measured: docs/history/README.md,
"Model sizes") and compares it with the memory available now: MemAvailable, capped by the
cgroup's limit when the process runs in a container. The error names both figures and the
option that lowers the need; `--no-memory-check` skips the check (swap, an estimate that is
wrong for a model).
"""

from __future__ import annotations

from pathlib import Path

from .errors import QwcError

GiB = 2**30


def available_bytes() -> int | None:
    """Memory this process can still take: MemAvailable, capped by a cgroup v2 / v1 limit
    minus what the cgroup uses. None where neither can be read."""
    avail = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    for limit_f, usage_f in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                             ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                              "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            limit = Path(limit_f).read_text().strip()
            if limit == "max" or int(limit) >= 2**60:
                continue
            room = int(limit) - int(Path(usage_f).read_text().strip())
            avail = room if avail is None else min(avail, room)
            break
        except (OSError, ValueError):
            continue
    return avail


def check(stage: str, need: int, lower: str, skip: bool = False, held: int = 0,
          available: int | None = None) -> None:
    """Raise a one-line QwcError when the stage's `need` (its whole peak, bytes) exceeds what
    is available plus what this process already `held` of it. `lower`: what the user can do
    about it, named in the message."""
    if skip:
        return
    have = available_bytes() if available is None else available
    if have is None:
        return
    have += held
    if need <= have:
        return
    raise QwcError(f"{stage} needs about {need / GiB:.1f} GiB of memory and {have / GiB:.1f} GiB is available; "
                   f"{lower} (or --no-memory-check to try anyway)")
