"""Two models behind one `qwc serve` (runtime/router.py): with --models-max 1, alternating greedy
requests against each model served alone; with --models-max 2, a stream on the first while the
second loads (a /tokenize naming it), its gaps between tokens then against the whole stream's:

    .venv/bin/python bench/models.py A.qwc B.qwc [--rounds 3] [--tokens 16] [--stream 400] [--loads 1]

The artifacts need tokenizers; their ids are their folders' names without .qwc (they must differ).
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

from qwc.bench.serve import start, stop

PROMPT = "The capital of France is"


class Served:
    """`qwc serve ARTS... OPTIONS` on a free port until closed; its log kept drained."""

    def __init__(self, *args):
        self.proc, line = start([sys.executable, "-m", "qwc", "serve", *map(str, args), "--port", "0",
                                 "--threads", "2", "--ctx", "2048"], r"at http://")
        self.base = re.search(r"at (http://[^ ]+)/v1", line)[1]
        threading.Thread(target=self.proc.stderr.read, daemon=True).start()   # its load / unload lines

    def complete(self, model: str, n: int) -> str:
        r = httpx.post(self.base + "/v1/completions", timeout=600, json={
            "model": model, "prompt": PROMPT, "max_tokens": n, "temperature": 0, "ignore_eos": True})
        if r.status_code != 200:
            raise SystemExit(f"models: {r.status_code} {r.text[:300]}")
        return r.json()["choices"][0]["text"]

    def close(self) -> None:
        stop(self.proc)


def _alone(art: Path, n: int) -> str:
    from qwc.runtime.engine import Engine
    from qwc.runtime.sampling import SamplingParams

    return "".join(Engine(art, ctx=2048, threads=2).generate(PROMPT, max_new_tokens=n, sampling=SamplingParams(),
                                                            stop=set()))


def _stream_while_loading(srv: Served, first: str, second: str, n: int) -> tuple[list[float], float, float]:
    """The stream's token times, and when the second model's load started and ended."""
    times, started = [], threading.Event()

    def stream():
        with httpx.stream("POST", srv.base + "/v1/completions", timeout=600, json={
                "model": first, "prompt": PROMPT, "max_tokens": n, "ignore_eos": True, "stream": True,
                "temperature": 0}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    times.append(time.perf_counter())
                    started.set()

    t = threading.Thread(target=stream)
    t.start()
    started.wait(600)
    time.sleep(1)
    t0 = time.perf_counter()   # the load alone: /tokenize names the model and costs nothing after it
    r = httpx.post(srv.base + "/tokenize", json={"model": second, "content": PROMPT}, timeout=600)
    t1 = time.perf_counter()
    if r.status_code != 200:
        raise SystemExit(f"models: {r.status_code} {r.text[:300]}")
    t.join()
    return times, t0, t1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("first", type=Path)
    ap.add_argument("second", type=Path)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--stream", type=int, default=400)
    ap.add_argument("--loads", type=int, default=1, help="servers started, a load beside a stream in each")
    args = ap.parse_args()
    ids = [p.resolve().name.removesuffix(".qwc") for p in (args.first, args.second)]
    want = {m: _alone(p, args.tokens) for m, p in zip(ids, (args.first, args.second))}
    srv = Served(args.first, args.second, "--models-max", "1")
    try:
        t0 = time.perf_counter()
        same = sum(srv.complete(m, args.tokens) == want[m] for _ in range(args.rounds) for m in ids)
        alternating = time.perf_counter() - t0
    finally:
        srv.close()
    loads, during, gaps = [], [], []
    for _ in range(args.loads):   # a fresh server each: the second model's load beside the stream
        srv = Served(args.first, args.second, "--models-max", "2")
        try:
            times, t0, t1 = _stream_while_loading(srv, ids[0], ids[1], args.stream)
        finally:
            srv.close()
        pairs = [(b, b - a) for a, b in zip(times, times[1:])]
        gaps += pairs
        during += [g for at, g in pairs if t0 <= at <= t1]
        loads.append(t1 - t0)
    during = during or [0.0]
    print(f"{ids[0]} and {ids[1]}, greedy, {args.tokens} tokens a reply\n")
    print("| run | figure |\n| --- | --- |")
    print(f"| --models-max 1, {2 * args.rounds} alternating requests | {same} equal the model served alone; "
          f"{alternating:.1f} s in all (each a load) |")
    print(f"| --models-max 2, {ids[1]} loaded beside a {ids[0]} stream, {args.loads} times | its load "
          f"{statistics.median(loads):.2f} s (median); the stream's gaps during the loads: median "
          f"{1000 * statistics.median(during):.1f} ms, {1000 * max(during):.0f} ms at most; over the streams "
          f"{1000 * statistics.median(g for _, g in gaps):.1f} ms |")


if __name__ == "__main__":
    main()
