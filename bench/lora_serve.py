"""LoRA adapters served unmerged: what the adapter slots cost, per step and in a server.

    .venv/bin/python bench/lora_serve.py [--ranks 8,16,64] [--clients 8] [--requests 2] [--max-tokens 64]
                                         [--rounds 2] [--threads N]

Model: the Qwen2.5-0.5B shape, random weights, Q4_0 (bench/peers.py's work dir), compiled twice
for this machine with --max-batch 8: plain, and with adapter slots (--max-lora-rank 64).
Adapters: random PEFT adapters on all seven linears of every layer (their values do not change
the work).

1. Per step (the Engine, no server), for each rank: a decode step of one sequence, a batched
   decode step of 8 sequences and a 128-token prefill, on the plain artifact, on the slots
   artifact with the base (slot 0), and with every sequence on an adapter of that rank; the
   median of 9, the three alternating.
2. Served (`qwc serve`, streaming clients as bench/serve.py's): `--clients` clients on the
   plain artifact's base, and on the slots artifact with two rank-16 adapters loaded and the
   clients spread over the base and both adapters (client i asks for model i mod 3); `--rounds`
   alternating rounds. The ratio is the issue's criterion (>= 0.8).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def artifacts(workdir: Path, threads: int) -> dict[str, Path]:
    """The plain and the slots artifact of the canonical graph (both rebuilt: this checkout's kernels)."""
    from qwc.bench.peers import prepare

    paths = prepare(workdir, max_batch=8)
    slots = workdir / "q-b8-lora64.qwc"
    shutil.rmtree(slots, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "qwc", "compile", str(paths["q4"]), "--target", "host", "--act-bits", "8",
                    "--max-batch", "8", "--max-lora-rank", "64", "-o", str(slots)], check=True)
    return {"plain": paths["qwc"], "slots": slots}


def random_adapter(folder: Path, cfg, rank: int, seed: int) -> Path:
    """A PEFT directory (peft's config and safetensors names) with A and B of N(0, 0.02)."""
    from safetensors.numpy import save_file

    from qwc.adapter_files import linear_shapes

    if (folder / "adapter_model.safetensors").is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, (out, k) in linear_shapes(cfg).items():
        module = "base_model.model." + name.removesuffix(".weight")
        tensors[f"{module}.lora_A.weight"] = rng.normal(0, 0.02, (rank, k)).astype(np.float32)
        tensors[f"{module}.lora_B.weight"] = rng.normal(0, 0.02, (out, rank)).astype(np.float32)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
        "target_modules": list(LINEARS), "lora_dropout": 0.0, "bias": "none"}))
    return folder


def timed(fn, n: int = 9) -> float:
    ts = []
    for _ in range(n + 1):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts[1:])) * 1000


def step_costs(eng, slot: int) -> tuple[float, float, float]:
    """(one-sequence decode ms, 8-sequence decode step ms, 128-token prefill ms), every sequence
    on adapter slot `slot` (0: the base), after a 64-token prompt."""
    prompt = [100 + i % 1000 for i in range(64)]
    seqs = eng.pool(8).seqs
    for s in seqs:
        s.adapter = slot
        eng.reset(s)
        eng.prefill(prompt, s)
    one = seqs[0]

    def decode1():
        eng.decode(5, one)
        one.pos -= 1

    def decode8():
        eng.decode_many([5] * 8, list(seqs))
        for s in seqs:
            s.pos -= 1

    def prefill():
        one.pos = 0
        eng.prefill([100 + i % 1000 for i in range(128)], one)
        one.pos = 64
    return timed(decode1), timed(decode8), timed(prefill, 5)


def per_step(paths: dict, ranks: list[int], threads: int, workdir: Path) -> list[tuple]:
    os.environ.setdefault("TVM_USE_RUNTIME_LIB", "1")
    from qwc.runtime.adapters import load_adapters
    from qwc.runtime.engine import Engine

    plain = Engine(paths["plain"], ctx=512, threads=threads)
    slots = Engine(paths["slots"], ctx=512, threads=threads)
    rows = []
    for r in ranks:
        folder = random_adapter(workdir / f"lora-r{r}", slots.model, r, seed=r)
        slots.load_adapters(load_adapters([("a", str(folder))], slots.model))
        got = {"plain": [], "base": [], "adapter": []}
        for _ in range(3):   # alternating: the machine's speed drifts
            got["plain"].append(step_costs(plain, 0))
            got["base"].append(step_costs(slots, 0))
            got["adapter"].append(step_costs(slots, 1))
        med = {k: np.median(np.array(v), axis=0) for k, v in got.items()}
        rows.append((r, med))
        print(f"[lora] rank {r}: {json.dumps({k: [round(float(x), 2) for x in v] for k, v in med.items()})}",
              file=sys.stderr, flush=True)
    return rows


async def _load(base: str, models: list[str], requests: int, max_tokens: int, seed: int) -> dict:
    import httpx

    from qwc.bench.serve import client, plans_for

    plans = plans_for(len(models), requests, seed)
    out: list = []
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=len(models) + 4)) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(http, base + "/v1/completions", m, p, max_tokens, out)
                               for m, p in zip(models, plans)))
        wall = time.perf_counter() - t0
    ok = [r for r in out if r["ok"]]
    return {"tok_s": sum(r["tokens"] for r in ok) / wall, "failed": len(out) - len(ok)}


def served(paths: dict, a: argparse.Namespace, workdir: Path) -> dict:
    from qwc.bench.serve import start, stop, wait_ready, warm
    from qwc.manifest import read_manifest

    cfg = read_manifest(paths["slots"]).model
    ads = [random_adapter(workdir / f"lora-r16-{i}", cfg, 16, seed=100 + i) for i in range(2)]
    setups = {"plain, base only": (paths["plain"], [], ["m"] * a.clients),
              "slots, base only": (paths["slots"], [], ["m"] * a.clients),
              "slots, base + 2 adapters": (paths["slots"], [f"--lora=a={ads[0]}", f"--lora=b={ads[1]}"],
                                           [("m", "a", "b")[i % 3] for i in range(a.clients)])}
    results = {k: [] for k in setups}
    for rnd in range(a.rounds):
        for name, (art, extra, models) in setups.items():
            print(f"[lora] serve: {name}, round {rnd + 1}", file=sys.stderr, flush=True)
            env = dict(os.environ, TVM_NUM_THREADS=str(a.threads))
            proc, line = start([sys.executable, "-m", "qwc", "serve", str(art), "--port", "0", "--max-batch",
                                str(a.clients), "--ctx", "512", "--threads", str(a.threads), "--model-name", "m",
                                *extra], r"serving .* at http://", env)
            base = re.search(r"(http://[^ ]+)/v1", line)[1]
            try:
                wait_ready(base, proc)
                warm(base)
                results[name].append(asyncio.run(_load(base, models, a.requests, a.max_tokens, rnd)))
            finally:
                stop(proc)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="8,16,64")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=2, help="requests per client")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--workdir", type=Path, default=Path.home() / ".cache" / "qwc" / "bench")
    ap.add_argument("--skip-steps", action="store_true")
    ap.add_argument("--skip-serve", action="store_true")
    a = ap.parse_args()
    paths = artifacts(a.workdir, a.threads)
    if not a.skip_steps:
        rows = per_step(paths, [int(r) for r in a.ranks.split(",")], a.threads, a.workdir)
        print(f"\nQwen2.5-0.5B shape, Q4_0, W4A8, {a.threads} threads; an adapter on all 7 linears of every layer; "
              "ms, median of 9 (prefill: 5), 3 alternating rounds\n")
        print("| rank | decode 1 seq: plain / slots base / adapter | x plain | decode 8 seqs: plain / base / adapter "
              "| x plain | prefill 128: plain / base / adapter | x plain |")
        print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for r, m in rows:
            cells = []
            for i in range(3):
                p, b, ad = m["plain"][i], m["base"][i], m["adapter"][i]
                cells += [f"{p:.2f} / {b:.2f} / {ad:.2f}", f"{ad / p:.2f}"]
            print(f"| {r} | " + " | ".join(cells) + " |")
    if not a.skip_serve:
        res = served(paths, a, a.workdir)
        print(f"\n`qwc serve`, {a.clients} streaming clients x {a.requests} requests of 16-256 prompt tokens and "
              f"{a.max_tokens} generated, {a.rounds} alternating rounds (gen tok/s)\n")
        print("| setup | " + " | ".join(f"round {i + 1}" for i in range(a.rounds)) + " | mean | x plain | failed |")
        print("| --- |" + " ---: |" * (a.rounds + 3))
        plain = np.mean([r["tok_s"] for r in res["plain, base only"]])
        for name, rs in res.items():
            mean = np.mean([r["tok_s"] for r in rs])
            print(f"| {name} | " + " | ".join(f"{r['tok_s']:.1f}" for r in rs)
                  + f" | {mean:.1f} | {mean / plain:.2f} | {sum(r['failed'] for r in rs)} |")


if __name__ == "__main__":
    main()
