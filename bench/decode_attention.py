"""The decode attention kernel alone at depth (kernels/decode_attention.py), in
variants side by side, on this machine: the Qwen2.5-0.5B shape (14 heads, 2 kv heads, head
dim 64), 24 layers' caches, so that the cache is read from DRAM as a decode step reads it
(where they outgrow the last-level cache: 50 MB of float16 at 4,096 keys, 200 MB at 16,384):

    .venv/bin/python bench/decode_attention.py [--depths 512,4096,16384] [--threads 1,2]
        [--kv f16,f32] [--rounds 15]

Variants (the kernel as `--target host` builds it first):
- host: register tiles for this machine's vector registers (targets.vector_registers), the
  keys split as the host's kernel rule says (targets.Kernels.decode_split_keys);
- tiles for 32 x 64 B: the tiles AVX-512's register file takes (on an AVX2 machine they
  spill: what the host's rule avoids);
- split 512: the keys in spans of 512, a task each, merged after (what ARM's rule does);
- K prefetch 16 lines / 4 KiB: the scores pass's prefetch distance the host's rule does not
  take (targets.Kernels.decode_key_prefetch).

Per depth, KV type and thread count: milliseconds for the 24 layers (one token's attention,
rotary, cache writes and Q8_0 of the output included) and the ratio to the host variant; the
variants alternate round by round (this machine is shared) and each keeps its best round.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 14, 2, 64, 24


def _ints(text: str, low: int = 1) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a comma-separated list of integers") from None
    if not vals or min(vals) < low:
        raise argparse.ArgumentTypeError(f"{text!r}: a comma-separated list of integers >= {low}")
    return vals


def variants():
    """{name: (registers, split_keys, key_prefetch)}, the host's kernel first."""
    from qwc.compiler.targets import get_target, kernels_for, vector_registers

    host = get_target("host")
    rule = kernels_for(host.features)
    regs, split, ahead = vector_registers(host.features), rule.decode_split_keys, rule.decode_key_prefetch
    out = {f"host ({regs[0]} x {regs[1]} B, split {split}, K prefetch {ahead or 'lines'})": (regs, split, ahead)}
    if regs != (32, 64):
        out["tiles for 32 x 64 B"] = ((32, 64), split, ahead)
    if split != 512:
        out["split 512"] = (regs, 512, ahead)
    if ahead is not None:
        out["K prefetch 16 lines"] = (regs, split, None)
    if ahead != 4096:
        out["K prefetch 4 KiB"] = (regs, split, 4096)
    return out


def kernels(dtype: str):
    """{name: compiled kernel}."""
    import tvm

    from qwc.compiler.kernels import decode_attention, w4a8
    from qwc.compiler.targets import get_target

    target = get_target("host").tvm_target()
    out = {}
    for name, (regs, split, ahead) in variants().items():
        f = decode_attention.decode_attention(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM ** -0.5, "int64", w4a8.ZERO_POINT,
                                       "plain", None, dtype, regs, split, key_prefetch=ahead)
        out[name] = tvm.compile(tvm.IRModule({"main": f.with_attr("global_symbol", "main")}), target=target)
    return out


def measure(depth: int, dtype: str, rounds: int) -> dict[str, float]:
    """{variant: best ms for LAYERS calls at `depth` cached tokens} (TVM's pool takes its
    thread count, TVM_NUM_THREADS, at its first launch: a process per thread count)."""
    import tvm

    fns = kernels(dtype)
    rng = np.random.default_rng(0)
    cap = -(-(depth + 16) // 16) * 16
    npd = np.float16 if dtype == "float16" else np.float32
    caches = [[tvm.runtime.tensor(rng.standard_normal((1, KV_HEADS, cap, HEAD_DIM)).astype(npd)) for _ in range(2)]
              for _ in range(LAYERS)]
    q = tvm.runtime.tensor(rng.standard_normal((1, 1, HEADS * HEAD_DIM), dtype=np.float32))
    k, v = (tvm.runtime.tensor(rng.standard_normal((1, 1, KV_HEADS * HEAD_DIM), dtype=np.float32)) for _ in range(2))
    angles = np.arange(depth + 8)[:, None] * 10000.0 ** (-np.arange(HEAD_DIM // 2) / (HEAD_DIM // 2))
    cos, sin = (tvm.runtime.tensor(x.astype(np.float32)) for x in (np.cos(angles), np.sin(angles)))
    pos = tvm.runtime.tensor(np.array([[depth]], np.int64))
    seqlens = tvm.runtime.tensor(np.array([depth], np.int32))
    nb = HEADS * HEAD_DIM // 32
    outs = [tvm.runtime.tensor(np.zeros(shape, dt)) for shape, dt in (
        ((1, 1, HEADS * HEAD_DIM), np.float32), ((1, nb, 32), np.int8), ((1, nb), np.float32), ((1, nb), np.int32))]
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, f in fns.items():
            t = time.perf_counter()
            for kc, vc in caches:   # the same slot each call: the cache's contents do not matter
                f(q, k, v, kc, vc, seqlens, pos, cos, sin, *outs)
            best[name] = min(best[name], (time.perf_counter() - t) * 1e3)
    return best


def child_rows(script: str, args: list[str], threads: int) -> list[list[str]]:
    """The tab-separated rows `script --one ARGS` prints in a child process of `threads` TVM
    threads (TVM's pool takes its thread count, TVM_NUM_THREADS, once a process); exits with
    the child's last error line if it fails."""
    import subprocess

    env = dict(os.environ, TVM_NUM_THREADS=str(threads))
    r = subprocess.run([sys.executable, script, "--one", *args], capture_output=True, text=True, env=env)
    if r.returncode:
        sys.exit(f"{Path(script).stem}: {r.stderr.strip().splitlines()[-1:]}")
    return [line.split("\t") for line in r.stdout.strip().splitlines()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depths", type=_ints, default=[512, 4096, 16384])
    ap.add_argument("--threads", type=_ints, default=[1, 2])
    ap.add_argument("--kv", default="f16", help="comma-separated: f16, f32")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--one", nargs=4, metavar=("DEPTH", "DTYPE", "THREADS", "ROUNDS"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:   # a child process: one thread count
        depth, dtype, rounds = int(a.one[0]), a.one[1], int(a.one[3])
        for name, ms in measure(depth, dtype, rounds).items():
            print(f"{name}\t{ms}")
        return
    kinds = {"f16": "float16", "f32": "float32"}
    bad = [x for x in a.kv.split(",") if x not in kinds]
    if bad:
        sys.exit(f"decode_attention: --kv {a.kv!r}: f16 or f32")
    print("| KV | threads | depth | variant | ms (24 layers) | host / variant |")
    print("| --- | ---: | ---: | --- | ---: | ---: |")
    for kv in a.kv.split(","):
        for threads in a.threads:
            for depth in a.depths:
                rows = child_rows(__file__, [str(depth), kinds[kv], str(threads), str(a.rounds)], threads)
                host = float(rows[0][1])
                for name, ms in rows:
                    print(f"| {kv} | {threads} | {depth} | {name} | {float(ms):.2f} | {host / float(ms):.2f}x |",
                          flush=True)


if __name__ == "__main__":
    main()
