"""`qwc serve --replicas N --ray` against one `qwc serve`, on this machine, one command:

    .venv/bin/python bench/replicas.py ART.qwc [--replicas 2] [--threads 1] [--rounds 3] [--tokens 96]
                                       [--clients 8] [--kill-rounds 0]

- one stream: time per token (median over its tokens, greedy, `ignore_eos`), the two servers
  alternated round by round (this machine is shared and noisy): what the ingress, the router
  and Ray's streaming cost a token;
- `--clients` streams at once: generated tokens a second, both servers;
- prefix affinity: three system prompts, three rounds of a chat turn each, against both:
  the cached prompt tokens replies report (`usage.prompt_tokens_details.cached_tokens`),
  and whether each system prompt stayed on one replica;
- `--kill-rounds K`: K times, 16 requests at once (half streaming), one replica killed a
  second in; a round passes when no request hangs, every whole request completes, every
  stream completes or ends with an error event, and the replica is back within 60 s.

Each engine gets --threads threads (the plain server too, so one stream compares like with
like). Random-weight artifacts work (token-id prompts); the affinity part needs a chat
template (the README's SmolLM2 build has one).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from qwc.runtime.replicas import REPLICA_HEADER

SYSTEMS = ["You answer questions about geography, briefly and correctly. " * 3,
           "You are a pirate; answer every question as a pirate would. " * 3,
           "You are a terse math tutor: the steps, then the answer. " * 3]


def start(art: Path, threads: int, replicas: int, batch: int,
          flags: list[str] = ()) -> tuple[subprocess.Popen, str]:
    """`qwc serve` of `art` (with `replicas` replicas on Ray, if any) on a free port, and its URL."""
    extra = ["--replicas", str(replicas), "--ray"] if replicas else []
    proc = subprocess.Popen([sys.executable, "-m", "qwc", "serve", str(art), "--port", "0", "--threads", str(threads),
                             "--max-batch", str(batch), "--model-name", "m", *extra, *flags],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, TVM_NUM_THREADS=str(threads)))
    for line in proc.stderr:
        if m := re.search(r"serving .* at (http://[^ ]+)/v1", line):
            threading.Thread(target=proc.stderr.read, daemon=True).start()
            return proc, m[1]
    sys.exit(f"replicas: the server did not start (exit {proc.wait()})")


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(90)
    except subprocess.TimeoutExpired:
        proc.kill()


def one_stream(base: str, tokens: int) -> float:
    body = {"model": "m", "prompt": [5] * 32, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    times = []
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                times.append(time.perf_counter())
    return statistics.median(b - a for a, b in zip(times, times[1:])) * 1e3


async def many(base: str, clients: int, tokens: int) -> float:
    async with httpx.AsyncClient(timeout=600) as c:
        async def ask(i):
            body = {"model": "m", "prompt": [5 + i] * 32, "max_tokens": tokens, "temperature": 0,
                    "ignore_eos": True}
            r = await c.post(base + "/v1/completions", json=body)
            return r.json()["usage"]["completion_tokens"]
        t0 = time.perf_counter()
        got = await asyncio.gather(*(ask(i) for i in range(clients)))
        return sum(got) / (time.perf_counter() - t0)


def affinity(base: str) -> tuple[int, bool]:
    homes: dict[int, set] = {i: set() for i in range(len(SYSTEMS))}
    cached = 0
    for r in range(3):
        for i, system in enumerate(SYSTEMS):
            resp = httpx.post(base + "/v1/chat/completions", timeout=120, json={
                "model": "m", "max_tokens": 4, "temperature": 0,
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"question {r}"}]})
            resp.raise_for_status()
            homes[i].add(resp.headers.get(REPLICA_HEADER))
            cached += resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    return cached, all(len(h) == 1 for h in homes.values())


def requests_across_a_kill(base: str, model: str, prompts: list, max_tokens: int, pids: list, timeout: float,
                           wait: float, on_kill=None) -> tuple[list, int, int]:
    """One completion a prompt, all at once (every second one streaming, greedy, `ignore_eos`);
    the replica (one of `pids`) serving the first stream to send a token SIGKILLed then (or
    pids[0] after 60 s: on a loaded machine a fixed delay can fire before any stream is live,
    and the router may send every stream to one replica), then on_kill(the kill's time) if
    given; the requests waited for up to `wait` s after the kill. Each one's outcome, ("whole",
    status, completion tokens), ("stream", its error event's code or None, whether [DONE]
    came) or ("failed", the exception), how many still ran, and the pid killed
    (tests/serve/test_replicas.py shares it)."""
    out: list = [None] * len(prompts)
    live = threading.Event()
    serving: list = []   # the replica of the first stream with a token

    def ask(i):
        body = {"model": model, "prompt": prompts[i], "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        try:
            if i % 2:
                body["stream"] = True
                error, done = None, False
                with httpx.stream("POST", base + "/v1/completions", json=body, timeout=timeout) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: {") and "error" in json.loads(line[6:]):
                            error = json.loads(line[6:])["error"]["code"]
                        elif line.startswith("data: {") and r.headers.get(REPLICA_HEADER) in map(str, pids):
                            serving.append(int(r.headers[REPLICA_HEADER]))
                            live.set()
                        done = done or line == "data: [DONE]"
                out[i] = ("stream", error, done)
            else:
                r = httpx.post(base + "/v1/completions", json=body, timeout=timeout)
                out[i] = ("whole", r.status_code, r.json().get("usage", {}).get("completion_tokens"))
        except Exception as e:   # noqa: BLE001 - an outcome, for the caller to judge
            out[i] = ("failed", repr(e)[:120])

    threads = [threading.Thread(target=ask, args=(i,), daemon=True) for i in range(len(prompts))]
    for t in threads:
        t.start()
    live.wait(60)
    pid = serving[0] if serving else pids[0]
    os.kill(pid, signal.SIGKILL)
    t0 = time.time()
    if on_kill:
        on_kill(t0)
    for t in threads:
        t.join(max(1.0, wait - (time.time() - t0)))
    return out, sum(t.is_alive() for t in threads), pid


def kill_round(base: str) -> tuple[bool, str]:
    pids = httpx.get(base + "/health", timeout=30).json()["pids"]
    back, killed = [], []

    def watch(t0):   # from the kill: when /health has as many replicas again, the dead one replaced
        while time.time() - t0 < 120:
            try:
                h = httpx.get(base + "/health", timeout=30).json()
            except httpx.HTTPError:
                h = {"replicas": 0, "pids": []}
            if h["replicas"] == len(pids) and set(h["pids"]) != set(pids):
                back.append(time.time() - t0)
                return
            time.sleep(0.5)

    watcher = threading.Thread(target=lambda: watch(killed[0]), daemon=True)
    out, hung, _ = requests_across_a_kill(base, "m", [[7 + i] * 16 for i in range(16)], 400, pids, 300, 200,
                                          on_kill=lambda t0: (killed.append(t0), watcher.start()))
    watcher.join(max(1.0, 130 - (time.time() - killed[0])))
    whole_ok = all(o[1:] == (200, 400) for o in out if o and o[0] == "whole")
    streams_ok = all(o[2] and o[1] in (None, "replica_lost") for o in out if o and o[0] == "stream")
    cut = sum(1 for o in out if o and o[0] == "stream" and o[1] == "replica_lost")
    back = back[0] if back else None
    ok = hung == 0 and whole_ok and streams_ok and back is not None and back <= 60
    return ok, (f"hung {hung}, whole requests complete {whole_ok}, streams complete or cleanly ended {streams_ok} "
                f"({cut} cut), replica back in {'never' if back is None else f'{back:.1f} s'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="threads per engine (default 1)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--kill-rounds", type=int, default=0)
    a = ap.parse_args()
    servers = {"qwc serve": 0, f"{a.replicas} replicas on Ray": a.replicas}
    itl: dict = {k: [] for k in servers}
    rate: dict = {k: [] for k in servers}
    cached: dict = {}
    for r in range(a.rounds):
        for name in (list(servers) if r % 2 == 0 else list(servers)[::-1]):
            proc, base = start(a.artifact, a.threads, servers[name], a.clients)
            try:
                one_stream(base, 8)   # warm
                itl[name].append(one_stream(base, a.tokens))
                rate[name].append(asyncio.run(many(base, a.clients, a.tokens)))
                if r == 0:
                    try:
                        cached[name] = affinity(base)
                    except httpx.HTTPStatusError:   # no chat template in this artifact
                        cached[name] = None
                if r == a.rounds - 1 and servers[name] and a.kill_rounds:
                    passed = 0
                    for k in range(a.kill_rounds):
                        ok, what = kill_round(base)
                        passed += ok
                        print(f"kill round {k + 1}: {'pass' if ok else 'FAIL'}: {what}", flush=True)
                    print(f"kill rounds passed: {passed} of {a.kill_rounds}")
            finally:
                stop(proc)
    plain, ray = servers
    print(f"\n{a.artifact.name}, {a.threads} thread(s) an engine, {a.rounds} rounds alternated\n")
    print("| server | time a token, one stream (ms, median of rounds) | the rounds | "
          f"gen tok/s, {a.clients} streams | cached prompt tokens, 3 system prompts x 3 | each on one replica |")
    print("| --- | ---: | --- | ---: | ---: | --- |")
    for name in servers:
        c = cached.get(name)
        print(f"| {name} | {statistics.median(itl[name]):.2f} | {' / '.join(f'{x:.2f}' for x in itl[name])} | "
              f"{statistics.median(rate[name]):.1f} | {'-' if c is None else c[0]} | {'-' if c is None else c[1]} |")
    ratios = [b / a_ for a_, b in zip(itl[plain], itl[ray])]
    print(f"\nRay / plain, time a token: {statistics.median(ratios):.3f} (rounds "
          f"{' / '.join(f'{x:.3f}' for x in ratios)}); gen tok/s at {a.clients} streams: "
          f"{statistics.median(rate[ray]) / statistics.median(rate[plain]):.2f}x")
    if cached.get(plain) and cached.get(ray):
        print(f"cached tokens, Ray / plain: {cached[ray][0] / max(1, cached[plain][0]):.2f}")


if __name__ == "__main__":
    main()
