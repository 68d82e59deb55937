"""Load test: N concurrent streaming clients against `qwc serve` and llama.cpp's `llama-server`,
same model shape and format (Qwen2.5-0.5B, random weights, Q4_0 with a 4-bit tied embedding),
same threads, one run:

    .venv/bin/python bench/serve.py [--clients 1,4,8,16] [--requests 2] [--max-tokens 64] [--prompt-tokens 16,256]
                                    [--shared-prefix 0] [--ray-replicas N] [--compare-mixed] [--png serve.png]

`--ray-replicas N` adds `qwc serve --replicas N --ray` (a local Ray; each replica with the
same --threads) and its ratios to the plain server: what the ingress and the router cost.
`--compare-mixed` adds `qwc serve --no-mixed-steps` (each prompt chunk in a call of its own) and
the default's ratios to it: what mixed steps are worth.

Each client sends `--requests` completions one after another (prompts of 16-256 random tokens by
default (`--prompt-tokens LO,HI`), seeded, after `--shared-prefix` tokens that every prompt begins with: a system prompt; `ignore_eos`,
so every request generates exactly `--max-tokens`), streaming. With a shared prefix both servers
reuse it from their slots' caches (llama-server's `cache_prompt` is on by default) and qwc also
runs with `--reuse-prefix 0` (the row "qwc, no reuse") to show what reuse is worth. Reported per
server and client count: aggregate generated tok/s (all tokens / wall time), time to first token
p50/p99, inter-token latency p50/p99 (each request's mean over its tokens), failed requests. Both servers get as many slots as clients
(`--max-batch N` / `-np N`, llama-server's continuous batching on). The servers run one at a
time, alternating per client count. Last, the rate the Engine's calls alone would give (a
prefill of the mean prompt and the decode steps of N sequences per request, back to back; a
shared prefix left out): on a machine where one prefill keeps every core busy, the batching
gain a server can reach in the prompt-heavy mix. Artifacts come from bench/peers.py's work dir
(~/.cache/qwc/bench); llama-server from bench/llamacpp.sh x86.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from qwc.bench.llamacpp import VERSION

HERE = Path(__file__).parent
SEPARATE = "qwc, --no-mixed-steps"


# The CPUs this bench may use, taken before its own Engine runs: TVM pins a 1-thread pool's
# caller to CPU 0, and a server started after that would inherit CPU 0 alone (two Ray replicas
# and Ray's own processes on one core: slower a token, first read as Ray's cost).
CPUS = os.sched_getaffinity(0)


def start(cmd: list[str], ready: str, env=None) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=lambda: os.sched_setaffinity(0, CPUS))
    t0 = time.time()
    for line in proc.stderr:
        if re.search(ready, line):
            return proc, line
        if time.time() - t0 > 300:
            break
    proc.kill()
    sys.exit(f"serve: {cmd[0]} did not start")


def wait_ready(base: str, proc: subprocess.Popen) -> None:
    """Until GET /health answers 200: llama-server listens before its model is loaded (and
    answers 503 meanwhile)."""
    import httpx

    t0 = time.time()
    while time.time() - t0 < 300 and proc.poll() is None:
        try:
            if httpx.get(base + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    sys.exit(f"serve: the server at {base} never became ready")


def warm(base: str) -> None:
    """One short request before the measured ones, for every server alike: a server's first
    request pays for its start (a fresh Ray replica's first 64 tokens ran at 24 ms a token
    where its second ran at 19.9, the plain server's at 19.1)."""
    import httpx

    httpx.post(base + "/v1/completions", json={"model": "m", "prompt": [5] * 16, "max_tokens": 16,
                                               "temperature": 0, "ignore_eos": True}, timeout=300)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(60)   # `qwc serve --ray` stops its Ray too
    except subprocess.TimeoutExpired:
        proc.kill()


async def client(http, url: str, model: str, prompts: list[list[int]], max_tokens: int, out: list) -> None:
    for prompt in prompts:
        t0 = time.perf_counter()
        times = []
        try:
            async with http.stream("POST", url, json={"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                                      "temperature": 0, "ignore_eos": True, "stream": True}) as r:
                if r.status_code != 200:
                    out.append({"ok": False})
                    continue
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("choices") and chunk["choices"][0].get("finish_reason") is None:
                        times.append(time.perf_counter())
            out.append({"ok": len(times) > 1, "t0": t0, "times": times, "tokens": max_tokens})
        except Exception:   # a refused or broken connection is a failed request
            out.append({"ok": False})


def plans_for(clients: int, requests: int, seed: int, shared: int = 0,
              lengths: tuple[int, int] = (16, 256)) -> list[list[list[int]]]:
    """Each client's prompts: `shared` token ids every prompt begins with (the same for every
    seed), then lengths[0]..lengths[1] random ones."""
    prefix = [int(t) for t in np.random.default_rng(12345).integers(100, 4000, shared)]
    rng = np.random.default_rng(seed)
    lo, hi = lengths
    return [[prefix + [int(t) for t in rng.integers(100, 4000, int(rng.integers(lo, hi + 1)))] for _ in range(requests)]
            for _ in range(clients)]


def engine_itl(eng, prompts: list[list[int]], max_tokens: int) -> float:
    """The one client's requests through the Engine with no server: the median time a token
    (ms), from each request's first token to its last as the clients measure it (the same
    prompts, so the same context lengths): the one-client ITL's baseline."""
    itl = []
    for prompt in prompts:
        eng.reset()
        logits, times = eng.prefill(prompt), []
        for _ in range(max_tokens):
            tok = int(logits.argmax())
            times.append(time.perf_counter())
            logits = eng.decode(tok)
        itl.append((times[-1] - times[0]) / (max_tokens - 1))
    return float(np.median(itl)) * 1000


def decode_steps(eng, counts: list[int], depth: int = 64) -> dict:
    """One decode step of B sequences (decode_many on pool rows after a `depth`-token prompt
    each), the median of 10, per client count: what batching gives before prompts and HTTP."""
    seqs = eng.pool(max(counts)).seqs
    steps = {}
    for b in counts:
        for s in seqs[:b]:
            eng.reset(s)
            eng.prefill([100 + i % 1000 for i in range(depth)], s)
        ts = []
        for _ in range(11):
            t0 = time.perf_counter()
            eng.decode_many([5] * b, seqs[:b])
            ts.append(time.perf_counter() - t0)
        steps[b] = float(np.median(ts[1:])) * 1000
    return steps


def calls_alone(eng, steps: dict, lengths: tuple[int, int], max_tokens: int) -> dict:
    """Generated tok/s per client count if the Engine's calls ran back to back with nothing
    else: each request a prefill of the mix's mean prompt (the median of 3) and `max_tokens`
    decode steps of as many sequences as clients (`steps`). Where one call already keeps every
    thread busy (a prompt's prefill on 2 cores), that is about what a server can reach; its
    ratio between client counts bounds the batching gain."""
    mean = (lengths[0] + lengths[1]) // 2
    ts = []
    for _ in range(3):
        eng.reset()
        t0 = time.perf_counter()
        eng.prefill([100 + i % 1000 for i in range(mean)])
        ts.append(time.perf_counter() - t0)
    prefill = float(np.median(ts))
    return {b: b * max_tokens / (b * prefill + max_tokens * ms / 1000) for b, ms in steps.items()} | {"prefill_s": prefill}


async def load(base: str, model: str, clients: int, requests: int, max_tokens: int, seed: int, shared: int,
               lengths: tuple[int, int]) -> dict:
    import httpx

    plans = plans_for(clients, requests, seed, shared, lengths)
    out: list = []
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=clients + 4)) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(http, base + "/v1/completions", model, p, max_tokens, out) for p in plans))
        wall = time.perf_counter() - t0
    ok = [r for r in out if r["ok"]]
    ttft = [r["times"][0] - r["t0"] for r in ok]
    # a streamed piece may carry more than one token (text held back at a partial UTF-8
    # character), so the inter-token latency is each request's mean: first to last piece over
    # its tokens
    itl = [(r["times"][-1] - r["times"][0]) / (r["tokens"] - 1) for r in ok]
    pct = (lambda xs, q: float(np.percentile(xs, q)) * 1000 if xs else float("nan"))
    return {"tok_s": sum(r["tokens"] for r in ok) / wall, "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99),
            "itl_p50": pct(itl, 50), "itl_p99": pct(itl, 99), "failed": len(out) - len(ok), "wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", default="1,4,8,16")
    ap.add_argument("--requests", type=int, default=2, help="requests per client")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--workdir", type=Path, default=Path.home() / ".cache" / "qwc" / "bench")
    ap.add_argument("--ctx", type=int, help="context per sequence (default: 512, or what the longest request needs)")
    ap.add_argument("--prompt-tokens", default="16,256", help="LO,HI: each prompt's random tokens (default 16,256)")
    ap.add_argument("--shared-prefix", type=int, default=0, help="tokens every prompt begins with")
    ap.add_argument("--ray-replicas", type=int, default=0, metavar="N",
                    help="also `qwc serve --replicas N --ray` (a local Ray), each replica with --threads threads")
    ap.add_argument("--compare-mixed", action="store_true",
                    help="also qwc with --no-mixed-steps (prompt chunks in calls of their own), and the ratios")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--png", type=Path)
    a = ap.parse_args()
    try:
        lengths = tuple(int(x) for x in a.prompt_tokens.split(","))
        if len(lengths) != 2 or not 1 <= lengths[0] <= lengths[1]:
            raise ValueError
    except ValueError:
        ap.error(f"--prompt-tokens {a.prompt_tokens!r}: expected LO,HI with 1 <= LO <= HI")
    a.ctx = a.ctx or max(512, a.shared_prefix + lengths[1] + a.max_tokens)
    counts = [int(c) for c in a.clients.split(",")]
    from qwc.bench.llamacpp import tools as llamacpp_tools
    from qwc.bench.peers import prepare

    paths = prepare(a.workdir, max_batch=max(max(counts), 2))
    server = llamacpp_tools("x86") / f"llama-server-{VERSION}"
    ray = f"qwc, {a.ray_replicas} replicas on Ray" if a.ray_replicas else None
    results: dict = {"qwc": {}, "llama-server": {}, **({"qwc, no reuse": {}} if a.shared_prefix else {}),
                     **({ray: {}} if ray else {}), **({SEPARATE: {}} if a.compare_mixed else {})}
    r = subprocess.run([sys.executable, "-m", "qwc", "bench", str(paths["qwc"]), "-p", "0", "-n", str(a.max_tokens),
                        "--threads", str(a.threads), "--json"], capture_output=True, text=True, check=True)
    tg = json.loads(r.stdout)["results"][0]["tps"]
    os.environ.setdefault("TVM_USE_RUNTIME_LIB", "1")
    from qwc.runtime.engine import Engine

    # In this process, idle while the servers run. The machine's speed moves a lot from
    # one minute to the next, so the one client's baseline is taken just before and just after
    # its server run.
    eng = Engine(paths["qwc"], ctx=a.ctx, threads=a.threads)
    one_prompts = plans_for(1, a.requests, 1, a.shared_prefix, lengths)[0]
    around = []
    for n in counts:
        for name in results:
            print(f"[serve] {name}, {n} clients ...", file=sys.stderr, flush=True)
            if name == "qwc" and n == 1:
                around.append(engine_itl(eng, one_prompts, a.max_tokens))
            if name.startswith("qwc"):
                env = dict(os.environ, TVM_NUM_THREADS=str(a.threads))
                proc, line = start([sys.executable, "-m", "qwc", "serve", str(paths["qwc"]), "--port", "0",
                                    "--max-batch", str(n), "--ctx", str(a.ctx), "--threads", str(a.threads),
                                    "--model-name", "m", *(["--reuse-prefix", "0"] if "no reuse" in name else []),
                                    *(["--no-mixed-steps"] if name == SEPARATE else []),
                                    *(["--replicas", str(a.ray_replicas), "--ray"] if name == ray else [])],
                                   r"serving .* at http://", env)
                base = re.search(r"(http://[^ ]+)/v1", line)[1]
            else:
                port = 18000 + n
                proc, _ = start([str(server), "-m", str(paths["gguf"]), "--port", str(port), "-np", str(n),
                                 "-c", str(a.ctx * n), "-t", str(a.threads), "-tb", str(a.threads), "-cb",
                                 "--alias", "m"], r"listening on http")
                base = f"http://127.0.0.1:{port}"
            wait_ready(base, proc)
            warm(base)
            try:
                results[name][n] = asyncio.run(load(base, "m", n, a.requests, a.max_tokens, n, a.shared_prefix, lengths))
            finally:
                stop(proc)
            if name == "qwc" and n == 1:
                around.append(engine_itl(eng, one_prompts, a.max_tokens))

    print(f"\nQwen2.5-0.5B shape, random weights, Q4_0 (4-bit output), {a.threads} threads; each client "
          f"{a.requests} streaming requests of {a.shared_prefix} shared + {lengths[0]}-{lengths[1]} random prompt tokens and "
          f"{a.max_tokens} generated\n")
    print("| server | clients | gen tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | failed |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, rows in results.items():
        for n, r in rows.items():
            print(f"| {name} | {n} | {r['tok_s']:.1f} | {r['ttft_p50']:.0f} | {r['ttft_p99']:.0f} | "
                  f"{r['itl_p50']:.1f} | {r['itl_p99']:.1f} | {r['failed']} |")
    reuse = "qwc, no reuse" in results
    # qwc at 1 client pays for its prompts as the others do; `qwc bench`'s tg is decode alone
    print("\n| clients | qwc / llama-server (gen tok/s) | qwc / qwc at 1 client | qwc / qwc bench tg (one stream's decode) |"
          + (" qwc / qwc, no reuse |" if reuse else ""))
    print("| ---: | ---: | ---: | ---: |" + (" ---: |" if reuse else ""))
    one = results["qwc"].get(1, {}).get("tok_s")
    for n in counts:
        q = results["qwc"][n]["tok_s"]
        print(f"| {n} | {q / results['llama-server'][n]['tok_s']:.2f} | {q / one if one else float('nan'):.2f} | {q / tg:.2f} |"
              + (f" {q / results['qwc, no reuse'][n]['tok_s']:.2f} |" if reuse else ""))
    if ray:
        print(f"\n| clients | {ray} / qwc: gen tok/s | ITL p50 | TTFT p50 |\n| ---: | ---: | ---: | ---: |")
        for n in counts:
            q, r = results["qwc"][n], results[ray][n]
            print(f"| {n} | {r['tok_s'] / q['tok_s']:.3f} | {r['itl_p50'] / q['itl_p50']:.3f} | "
                  f"{r['ttft_p50'] / q['ttft_p50']:.3f} |")
    if a.compare_mixed:
        print("\n| clients | qwc / qwc with --no-mixed-steps: gen tok/s | ITL p50 | TTFT p50 |\n| ---: | ---: | ---: | ---: |")
        for n in counts:
            q, r = results["qwc"][n], results[SEPARATE][n]
            print(f"| {n} | {q['tok_s'] / r['tok_s']:.3f} | {q['itl_p50'] / r['itl_p50']:.3f} | "
                  f"{q['ttft_p50'] / r['ttft_p50']:.3f} |")
    steps = decode_steps(eng, counts)
    print("\n| sequences | decode step ms (Engine, no server) | tok/s | x one sequence |\n| ---: | ---: | ---: | ---: |")
    for b, ms in steps.items():
        print(f"| {b} | {ms:.2f} | {1000 * b / ms:.1f} | {b * steps[min(steps)] / ms / min(steps):.2f} |")
    alone = calls_alone(eng, steps, lengths, a.max_tokens)
    first = min(steps)
    print(f"\nThe Engine's calls alone, back to back (a prefill of {sum(lengths) // 2} tokens, "
          f"{alone['prefill_s'] * 1000:.0f} ms, and {a.max_tokens} decode steps a request):\n\n"
          "| clients | gen tok/s | x at 1 client | qwc serve / this |\n| ---: | ---: | ---: | ---: |")
    for b in steps:
        served = results["qwc"].get(b, {}).get("tok_s", float("nan"))
        print(f"| {b} | {alone[b]:.1f} | {alone[b] / alone[first]:.2f} | {served / alone[b]:.2f} |")
    base_ms = float(np.mean(around)) if around else float("nan")
    if 1 in results["qwc"]:
        itl = results["qwc"][1]["itl_p50"]
        print(f"\n`qwc bench -n {a.max_tokens}` on the same artifact: {tg:.1f} tok/s ({1000 / tg:.2f} ms a token, from "
              f"an empty cache); the one client's requests through the Engine with no server, just before and just "
              f"after its server run: {around[0]:.2f} and {around[1]:.2f} ms a token; `qwc serve` with one client: "
              f"ITL p50 {itl:.2f} ms, {itl * tg / 1000:.3f}x qwc bench's, {itl / base_ms:.3f}x the Engine's (mean)")
    if a.json:
        a.json.write_text(json.dumps({"qwc_bench_tg": tg, "qwc_alone_ms": base_ms, "qwc_alone_around_ms": around,
                                      "decode_step_ms": steps, "calls_alone": alone, **results},
                                     indent=1))
    if a.png:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(1, 2, figsize=(10, 4))
        for name, rows in results.items():
            ax[0].plot(list(rows), [r["tok_s"] for r in rows.values()], marker="o", label=name)
            ax[1].plot(list(rows), [r["itl_p50"] for r in rows.values()], marker="o", label=name)
        ax[0].set(xlabel="concurrent clients", ylabel="generated tok/s (all clients)")
        ax[1].set(xlabel="concurrent clients", ylabel="inter-token latency p50 (ms)")
        ax[0].legend()
        fig.tight_layout()
        fig.savefig(a.png, dpi=100)


if __name__ == "__main__":
    main()
