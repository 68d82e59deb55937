"""The gaps between a stream's tokens from `qwc serve`, on a quiet machine and beside another
busy program (`yes`, one core's worth), per `--poll` level: how long the engine's idle workers
spin on sched_yield before they sleep (runtime/engine.py: pool_spin_count), which an EEVDF
kernel charges a spinning thread for once the busy program shares its core:

    .venv/bin/python bench/stalls.py ART.qwc [--poll 50,0] [--tokens 1500] [--rounds 2] [--threads N]

Each (level, machine) pair is one server, a greedy stream of --tokens tokens per round; the
levels alternate round by round. Reported: the gaps' median, 99th percentile and largest, in ms.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from qwc.bench.serve import start, stop


def stream_gaps(art: Path, poll: int, tokens: int, threads: int | None) -> list[float]:
    """One server at `poll`, one stream: the seconds between its SSE events."""
    more = ["--threads", str(threads)] if threads else []
    proc, line = start([sys.executable, "-m", "qwc", "serve", str(art), "--port", "0", "--poll", str(poll), *more],
                       r"at http://")
    base = re.search(r"at (http://[^ ]+)/v1", line)[1]
    try:
        times = []
        with httpx.stream("POST", base + "/v1/completions", timeout=900,
                          json={"prompt": "The capital of France is", "max_tokens": tokens, "ignore_eos": True,
                                "stream": True, "temperature": 0}) as r:
            for event in r.iter_lines():
                if event.startswith("data: {"):
                    times.append(time.perf_counter())
        return [b - a for a, b in zip(times, times[1:])]
    finally:
        stop(proc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("art", type=Path)
    ap.add_argument("--poll", default="50,0")
    ap.add_argument("--tokens", type=int, default=1500)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    levels = [int(x) for x in a.poll.split(",")]
    gaps: dict[tuple[int, str], list[float]] = {}
    for _ in range(a.rounds):
        for busy in (False, True):
            hog = subprocess.Popen(["yes"], stdout=subprocess.DEVNULL) if busy else None
            try:
                for level in levels:
                    gaps.setdefault((level, "beside yes" if busy else "quiet"), []).extend(
                        stream_gaps(a.art, level, a.tokens, a.threads))
            finally:
                if hog is not None:
                    hog.kill()
                    hog.wait()
    print(f"{a.art.name}, {a.tokens} greedy tokens a stream, {a.rounds} rounds; gaps between tokens in ms\n")
    print("| --poll | machine | median | p99 | largest |\n| ---: | --- | ---: | ---: | ---: |")
    for (level, machine), g in sorted(gaps.items(), key=lambda kv: (-kv[0][0], kv[0][1] != "quiet")):
        g = sorted(g)
        print(f"| {level} | {machine} | {1000 * statistics.median(g):.1f} | {1000 * g[int(0.99 * len(g))]:.1f} "
              f"| {1000 * g[-1]:.1f} |")


if __name__ == "__main__":
    main()
