"""What `qwc serve --replicas N --ray` holds in memory on one machine, against one `qwc serve`:

    .venv/bin/python bench/replica_memory.py ART.qwc [--replicas 2] [--rounds 2] [--ctx 2048] [--no-mmap]

Each replica maps the artifact's params.bin (runtime/memory.py: MappedFile), so N replicas
should cost one copy of the weights plus N of everything else. Per server, after each engine
has answered a request: the plain server's resident set and its anonymous part; for the
replicas, each replica process's (found by the `x-qwc-replica` header its replies carry)
resident set, anonymous part and proportional set size (a page shared by k processes counts
1/k to each), from /proc/PID/smaps_rollup. The figure the design is judged by: the replicas'
PSS summed over the plain server's RSS (1.0 would be perfect sharing with nothing of its own;
2.0 is two copies). The two servers alternate round by round (this machine is shared).
Ray's own processes (controller, proxy, raylet) are outside the sum: they hold no weights and
do not grow with the model. Every engine gets the same `--ctx` (without it `qwc serve` sizes
its KV caches to half the memory free at start, split between the replicas), so what differs
is the weights.
"""

from __future__ import annotations

import argparse
import statistics
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from qwc.bench.mapped_weights import rollup
from qwc.bench.replicas import start, stop
from qwc.runtime.replicas import REPLICA_HEADER

GIB = 2**30


def ask(base: str, token: int = 5, n: int = 4) -> httpx.Response:
    """A greedy completion of 16 copies of `token`, `n` tokens long."""
    r = httpx.post(base + "/v1/completions", timeout=600, json={
        "model": "m", "prompt": [token] * 16, "max_tokens": n, "temperature": 0, "ignore_eos": True})
    r.raise_for_status()
    return r


def replica_pids(base: str, n: int, tries: int = 8) -> list[int]:
    """The process ids of the `n` replicas behind `base`, each having answered a request: 2n
    requests at once, so that the router (the least loaded replica for a new prompt) spreads
    them, until every replica has answered."""
    seen: set[int] = set()

    def one(i: int) -> int:
        return int(ask(base, 5 + i, 8).headers[REPLICA_HEADER])

    with ThreadPoolExecutor(2 * n) as pool:
        for t in range(tries):
            seen.update(pool.map(one, range(2 * n * t, 2 * n * (t + 1))))
            if len(seen) == n:
                return sorted(seen)
    raise SystemExit(f"replica_memory: {2 * n * tries} requests reached {len(seen)} of {n} replicas")


def plain_round(art: Path, flags: list[str]) -> dict[str, float]:
    proc, base = start(art, 1, 0, 4, flags)
    try:
        ask(base)
        r = rollup(proc.pid)
    finally:
        stop(proc)
    return {"rss": r["Rss"] / GIB, "anon": r["Anonymous"] / GIB}


def replicas_round(art: Path, n: int, flags: list[str]) -> dict[str, float]:
    proc, base = start(art, 1, n, 4, flags)
    try:
        rs = [rollup(pid) for pid in replica_pids(base, n)]
    finally:
        stop(proc)
    return {"rss": max(r["Rss"] for r in rs) / GIB, "anon": max(r["Anonymous"] for r in rs) / GIB,
            "pss": sum(r["Pss"] for r in rs) / GIB}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=2048, help="context of every sequence (default 2048)")
    ap.add_argument("--no-mmap", action="store_true", help="the engines copy params.bin (for contrast)")
    a = ap.parse_args()
    flags = ["--ctx", str(a.ctx)] + (["--no-mmap"] if a.no_mmap else [])
    plain, reps = [], []
    for r in range(a.rounds):
        order = ("plain", "replicas") if r % 2 == 0 else ("replicas", "plain")
        for which in order:
            if which == "plain":
                plain.append(plain_round(a.artifact, flags))
            else:
                reps.append(replicas_round(a.artifact, a.replicas, flags))
            print(f"round {r + 1} {which}: {(plain if which == 'plain' else reps)[-1]}", flush=True)
    med = {k: statistics.median(x[k] for x in plain) for k in plain[0]}
    rmed = {k: statistics.median(x[k] for x in reps) for k in reps[0]}
    print(f"\n{a.artifact.name}, {'copied (--no-mmap)' if a.no_mmap else 'mapped'}, --ctx {a.ctx}, "
          f"medians of {a.rounds} rounds\n")
    print("| server | one engine's RSS (GiB) | of it anonymous | PSS of all replicas (GiB) | PSS / plain RSS |")
    print("| --- | ---: | ---: | ---: | ---: |")
    print(f"| qwc serve | {med['rss']:.2f} | {med['anon']:.2f} | | |")
    print(f"| {a.replicas} replicas on Ray | {rmed['rss']:.2f} | {rmed['anon']:.2f} | {rmed['pss']:.2f} | "
          f"{rmed['pss'] / med['rss']:.3f}x |")


if __name__ == "__main__":
    main()
