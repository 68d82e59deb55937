"""Progress reporting for long-running work: timed stages on stderr, and tqdm bars."""

from __future__ import annotations

import contextlib
import sys
import time

from tqdm import tqdm

from . import interrupts

_quiet = False


def set_quiet(quiet: bool) -> None:
    global _quiet
    _quiet = quiet


def info(msg: str) -> None:
    if not _quiet:
        print(msg, file=sys.stderr, flush=True)


@contextlib.contextmanager
def stage(name: str):
    """Print `name ...` when work starts and its wall time when it ends. A Ctrl-C that a
    library swallowed (TVM's importer can), or that was held while an output was put in place
    (qwc.interrupts), takes effect here, before the next stage."""
    interrupts.new_work()
    info(f"[qwc] {name} ...")
    t0 = time.perf_counter()
    yield
    interrupts.check()
    info(f"[qwc] {name} done in {time.perf_counter() - t0:.1f}s")


def bar(iterable=None, *, total=None, desc=None, unit="it", scaled: bool = False):
    """A tqdm bar on stderr that disappears in quiet mode, and when stderr is not a terminal
    (tqdm's disable=None): a log file gets the stage lines, not hundreds of redrawn frames.
    `scaled`: counts shown with binary prefixes (bytes as GiB)."""
    return tqdm(iterable, total=total, desc=desc, unit=unit, disable=True if _quiet else None,
                file=sys.stderr, leave=False, dynamic_ncols=True, unit_scale=scaled, unit_divisor=1024)
