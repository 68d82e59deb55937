"""Progress reporting for long-running work: timed stages on stderr, and tqdm bars."""

from __future__ import annotations

import contextlib
import sys
import time

from tqdm import tqdm

_quiet = False


def set_quiet(quiet: bool) -> None:
    global _quiet
    _quiet = quiet


def info(msg: str) -> None:
    if not _quiet:
        print(msg, file=sys.stderr, flush=True)


@contextlib.contextmanager
def stage(name: str):
    """Print `name ...` when work starts and its wall time when it ends."""
    info(f"[qwc] {name} ...")
    t0 = time.perf_counter()
    yield
    info(f"[qwc] {name} done in {time.perf_counter() - t0:.1f}s")


def bar(iterable=None, *, total=None, desc=None, unit="it"):
    """A tqdm bar on stderr that disappears in quiet mode."""
    return tqdm(iterable, total=total, desc=desc, unit=unit, disable=_quiet,
                file=sys.stderr, leave=False, dynamic_ncols=True)
