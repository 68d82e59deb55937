"""Soak test of `qwc serve`: many streaming clients for minutes, with random prompt lengths,
budgets and cancellations; no request may be lost or fail, and the server's memory must not
grow once warm:

    .venv/bin/python bench/soak.py [--minutes 10] [--warmup 2] [--clients 16] [--cancel 0.2]
                                   [--shared 0.5] [--structured 0.3]

Each client loops until time is up: a completion of 16-400 random prompt tokens (seeded) and
8-128 new tokens, streamed; with probability --structured a chat completion instead, half of
them with a json_schema `response_format`, half with `tools` and `tool_choice: required`
(up to 256 tokens); with probability --cancel it hangs up after a few tokens. A structured
reply that ends by itself must hold JSON valid against its schema (the message's content, or
every tool call's arguments), else it counts as failed; one cut by its token budget counts as
cut (the random-weight model writes JSON's optional whitespace at length). With
probability --shared the prompt begins with one of three fixed "system prompts" (32, 96 and
200 tokens), so the server's prefix reuse (cache hits, slots swapped down, partial matches)
runs all along; the prompt tokens it served from cache are reported. A request
that was not cancelled must end with a finish_reason and [DONE]; anything else (an HTTP error,
a broken stream, a missing finish) counts as failed. The server's RSS is read from /proc every
2 s. Memory is judged over --minutes after --warmup minutes (arenas, pools and caches fill
while the load ramps up): the peak of that span's second half against its first half's
(peaks, because RSS moves with the batch of the moment; a single sample as the baseline made
any later high look like growth), and the least-squares slope in MiB a minute. At the end
/metrics must show no request in flight and no sequence running (no slot leaked). Uses the
artifact bench/serve.py uses (~/.cache/qwc/bench, compiled with --max-batch).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


SYSTEM_PROMPTS = [[random.Random(1000 + n).randrange(100, 4000) for _ in range(n)] for n in (32, 96, 200)]
# the structured requests' schema: a tool's parameters, or the reply itself
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 14}},
          "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the forecast for a city",
                                           "parameters": SCHEMA}}]


def structured_body(rng: random.Random) -> dict:
    """A streamed chat completion asking for JSON of SCHEMA: as its reply, or as a tool call."""
    body = {"model": "m", "messages": [{"role": "user", "content": f"What is the weather in city {rng.randrange(999)}?"}],
            "max_tokens": 256, "temperature": 0.7, "stream": True}
    if rng.random() < 0.5:
        return body | {"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA,
                                                                                  "strict": True}}}
    return body | {"tools": TOOLS, "tool_choice": "required"}


def structured_problem(body: dict, content: str, calls: dict, finish: str) -> str | None:
    """What is wrong with a structured reply that ended by itself (None: valid)."""
    import jsonschema

    try:
        if "tools" in body:
            if finish != "tool_calls" or not calls:
                return f"tool_choice required, finished {finish!r} with {len(calls)} tool calls"
            for c in calls.values():
                if c["name"] != "get_weather":
                    return f"tool call of {c['name']!r}"
                jsonschema.validate(json.loads(c["arguments"]), SCHEMA)
        else:
            jsonschema.validate(json.loads(content), SCHEMA)
    except (ValueError, jsonschema.ValidationError) as e:
        return f"invalid JSON: {str(e).splitlines()[0][:120]}"
    return None


async def client(http, base: str, rng: random.Random, deadline: float, a, tally: dict) -> None:
    while time.monotonic() < deadline:
        structured = rng.random() < a.structured
        if structured:
            body, url = structured_body(rng), base + "/v1/chat/completions"
        else:
            prompt = [rng.randrange(100, 4000) for _ in range(rng.randint(16, 400))]
            if rng.random() < a.shared:
                prompt = rng.choice(SYSTEM_PROMPTS) + prompt[:200]
            body = {"model": "m", "prompt": prompt, "max_tokens": rng.randint(8, 128), "temperature": 0.7,
                    "stream": True}
            url = base + "/v1/completions"
        hang_up = rng.random() < a.cancel and rng.randint(1, 6)
        pieces, finish, done = 0, None, False
        content, calls = "", {}
        try:
            async with http.stream("POST", url, json=body) as r:
                if r.status_code != 200:
                    tally["failed"] += 1
                    tally["errors"].append(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
                    continue
                async for line in r.aiter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: "):
                        choice = json.loads(line[6:])["choices"][0]
                        finish = choice.get("finish_reason") or finish
                        delta = choice.get("delta") or {}
                        content += delta.get("content") or ""
                        for c in delta.get("tool_calls") or []:
                            call = calls.setdefault(c["index"], {"name": "", "arguments": ""})
                            call["name"] += c.get("function", {}).get("name") or ""
                            call["arguments"] += c.get("function", {}).get("arguments") or ""
                        pieces += 1
                        if hang_up and pieces >= hang_up:
                            break
        except Exception as e:   # a refused or broken connection
            tally["failed"] += 1
            tally["errors"].append(f"{type(e).__name__}: {e}")
            continue
        if hang_up and pieces >= hang_up and not done:
            tally["cancelled"] += 1
        elif done and finish and structured and finish == "length":
            tally["structured_cut"] += 1
        elif done and finish and structured and (problem := structured_problem(body, content, calls, finish)):
            tally["failed"] += 1
            tally["errors"].append(problem)
        elif done and finish:
            tally["completed"] += 1
            tally["structured_valid"] += structured
        else:
            tally["failed"] += 1
            tally["errors"].append(f"stream ended without finish ({pieces} pieces, done={done})")


async def watch(pid: int, deadline: float, samples: list) -> None:
    t0 = time.monotonic()
    while time.monotonic() < deadline:
        samples.append((time.monotonic() - t0, rss_mib(pid)))
        await asyncio.sleep(2)


def rss_growth(samples: list, warmup_s: float) -> dict:
    """The RSS samples (seconds, MiB) after the warm-up, halved: the second half's peak against
    the first's, and the slope of a least-squares line through them all (MiB a minute)."""
    import numpy as np

    warm = [(t, r) for t, r in samples if t >= warmup_s] or samples[-2:]
    half = warm[0][0] + (warm[-1][0] - warm[0][0]) / 2
    first = max(r for t, r in warm if t <= half)
    second = max((r for t, r in warm if t > half), default=first)
    t, r = np.array(warm).T
    slope = float(np.polyfit(t / 60, r, 1)[0]) if len(warm) > 1 else 0.0
    return {"rss_at_start_mib": samples[0][1], "rss_after_warmup_mib": warm[0][1], "rss_peak_first_half_mib": first,
            "rss_peak_second_half_mib": second, "rss_at_end_mib": samples[-1][1], "rss_growth": second / first - 1,
            "rss_slope_mib_per_min": slope, "rss_samples": samples}


async def soak(base: str, pid: int, a) -> dict:
    import httpx

    tally = {"completed": 0, "cancelled": 0, "failed": 0, "structured_valid": 0, "structured_cut": 0, "errors": []}
    samples: list = []
    deadline = time.monotonic() + (a.warmup + a.minutes) * 60
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=a.clients + 4)) as http:
        await asyncio.gather(watch(pid, deadline, samples),
                             *(client(http, base, random.Random(i), deadline, a, tally) for i in range(a.clients)))
        await asyncio.sleep(1.5)   # the server notices the last hang-ups at its next step
        metrics = (await http.get(base + "/metrics")).text
    gauge = (lambda name: float(re.search(rf"^{name} (\S+)$", metrics, re.M)[1]))
    return {**tally, **rss_growth(samples, a.warmup * 60), "in_flight": gauge("qwc_requests_in_flight"),
            "running": gauge("qwc_running_sequences"), "prompt_tokens": gauge("qwc_prompt_tokens_total"),
            "prompt_tokens_cached": gauge("qwc_prompt_tokens_cached_total")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10, help="minutes judged, after the warm-up")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--cancel", type=float, default=0.2, help="share of requests hung up mid-stream")
    ap.add_argument("--shared", type=float, default=0.5, help="share of prompts that begin with a system prompt")
    ap.add_argument("--structured", type=float, default=0.3,
                    help="share of requests that are chat completions with a json_schema or required tool call")
    ap.add_argument("--warmup", type=float, default=2, help="minutes of load before those judged for memory growth")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--workdir", type=Path, default=Path.home() / ".cache" / "qwc" / "bench")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    from qwc.bench.peers import prepare
    from qwc.bench.serve import start, stop, wait_ready

    paths = prepare(a.workdir, max_batch=a.clients)
    proc, line = start([sys.executable, "-m", "qwc", "serve", str(paths["qwc"]), "--port", "0",
                        "--max-batch", str(a.clients), "--ctx", str(a.ctx), "--threads", str(a.threads),
                        "--model-name", "m"], r"serving .* at http://")
    base = re.search(r"(http://[^ ]+)/v1", line)[1]
    wait_ready(base, proc)
    try:
        r = asyncio.run(soak(base, proc.pid, a))
    finally:
        stop(proc)
    print(f"\nqwc serve soak: {a.minutes:g} min after {a.warmup:g} of warm-up, {a.clients} clients, {a.cancel:.0%} hung up mid-stream, "
          f"{a.shared:.0%} with a system prompt, {a.structured:.0%} structured (json_schema or a required tool "
          f"call), Qwen2.5-0.5B shape, {a.threads} threads\n")
    print("| completed | of them structured, valid | structured, cut by max_tokens | cancelled by the client | failed | "
          f"prompt tokens from cache | RSS at the start | after {a.warmup:g} min | peak, first half after | "
          "peak, second half | at the end | growth (peak to peak) | slope | in flight at the end | running at the end |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    print(f"| {r['completed']} | {r['structured_valid']} | {r['structured_cut']} | {r['cancelled']} | {r['failed']} | "
          f"{r['prompt_tokens_cached']:.0f} of {r['prompt_tokens']:.0f} | {r['rss_at_start_mib']:.0f} MiB | "
          f"{r['rss_after_warmup_mib']:.0f} MiB | {r['rss_peak_first_half_mib']:.0f} MiB | "
          f"{r['rss_peak_second_half_mib']:.0f} MiB | {r['rss_at_end_mib']:.0f} MiB | {r['rss_growth']:+.1%} | "
          f"{r['rss_slope_mib_per_min']:+.2f} MiB/min | {r['in_flight']:.0f} | {r['running']:.0f} |")
    for e in r["errors"][:10]:
        print("failed:", e)
    if a.json:
        a.json.write_text(json.dumps(r, indent=1))
    ok = r["failed"] == 0 and r["rss_growth"] <= 0.05 and r["in_flight"] == 0 and r["running"] == 0
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
