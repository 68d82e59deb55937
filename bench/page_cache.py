"""Decode on weights mapped in the page cache's small pages against the same weights read again
in 2 MiB ones (runtime/memory.py: MappedFile), as a copied artifact first loads:

    .venv/bin/python bench/page_cache.py model.qwc [--threads 1,2] [--rounds 6] [--steps 64]

For each thread count (a process each), two fresh copies of the artifact are made beside it (`shutil.copytree`:
a copy's writes leave its page cache in small folios). One is loaded as the engine did before it
read such a file again (its threshold set to 0: mapped as cached), the other as it does now;
both in one process, after a 512-token prompt each, called in turn (ABBA) for `--rounds`
windows of `--steps` decode steps. The table has each mapping's share of 2 MiB pages, the
reread's time, and the median milliseconds a step. The copies are deleted at the end.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from qwc.runtime import memory
from qwc.runtime.engine import Engine


def load(art: Path, threads: int, reread: bool) -> tuple[Engine, float, float]:
    """The engine, the share of its params.bin in 2 MiB pages (a mapping of the page cache's
    folios, which the engine's maps too) and its load's seconds."""
    saved = memory.HUGE_SHARE
    memory.HUGE_SHARE = saved if reread else 0.0
    try:
        t = time.perf_counter()
        eng = Engine(art, ctx=1024, threads=threads)
        secs = time.perf_counter() - t
    finally:
        memory.HUGE_SHARE = saved
    probe = memory.MappedFile._mapped(art / "params.bin")
    share = memory.pmd_mapped_share(probe)
    probe.close()
    return eng, share, secs


def step_ms(eng: Engine, steps: int) -> float:
    for _ in range(4):
        eng.decode(5)
    t = time.perf_counter()
    for _ in range(steps):
        eng.decode(5)
    return (time.perf_counter() - t) / steps * 1e3


def row(art: Path, threads: int, rounds: int, steps: int) -> str:
    with tempfile.TemporaryDirectory(dir=art.parent, prefix=".page-cache-bench-") as tmp:
        copies = {m: shutil.copytree(art, Path(tmp) / f"{m}.qwc") for m in ("cached", "reread")}
        loaded = {m: load(copies[m], threads, m == "reread") for m in copies}
        for m in copies:
            loaded[m][0].prefill(np.arange(1, 513) % 1000)
        ms = {m: [] for m in copies}
        for r in range(rounds):
            for m in (("cached", "reread") if r % 2 == 0 else ("reread", "cached")):
                ms[m].append(step_ms(loaded[m][0], steps))
        a, b = (statistics.median(ms[m]) for m in ("cached", "reread"))
        (_, share_a, _), (_, share_b, secs) = loaded["cached"], loaded["reread"]
        return f"| {threads} | {share_a:.1%}, {a:.2f} | {share_b:.1%}, {secs:.2f}, {b:.2f} | {b / a:.3f}x |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--row", action="store_true", help=argparse.SUPPRESS)   # one thread count, in this process
    args = ap.parse_args()
    if args.row:
        print(row(args.artifact, int(args.threads), args.rounds, args.steps))
        return
    print("| threads | as cached: 2 MiB share, ms a step | read again: 2 MiB share, load s, ms a step | ratio |")
    print("| ---: | ---: | ---: | ---: |", flush=True)
    for threads in args.threads.split(","):
        # a process a thread count: TVM's pool keeps the size its first call gave it
        subprocess.run([sys.executable, __file__, str(args.artifact), "--threads", threads, "--rounds",
                        str(args.rounds), "--steps", str(args.steps), "--row"], check=True)


if __name__ == "__main__":
    main()
