"""The prefill attention kernel alone (kernels/prefill_attention.py: attention), one query at a time
against the host's query groups, on the Qwen2.5-0.5B shape (14 heads, 2 kv heads, head dim 64):

    .venv/bin/python bench/prefill_attention.py [--chunk 512] [--depths 0,3584,15872]
        [--threads 1,2] [--kv f16,f32,q8_0] [--rounds 3]

A chunk of `--chunk` prompt tokens after `depth` cached ones (one layer's call). Variants:
- one query: the kernel AVX2 and NEON build (registers 16 x 32 B: span_queries = 1);
- host: the kernel `--target host` builds here (targets.vector_registers; on AVX-512, groups of
  span_queries = 3 queries, the span widened to float32 once a block).
Per KV type, thread count and depth: each variant's best milliseconds, the variants alternated
round by round (this machine is shared), the ratio, and whether both gave the same output
(float16 and float32: bit for bit; q8_0: to rounding).
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from qwc.bench.decode_attention import _ints, child_rows

HEADS, KV_HEADS, HEAD_DIM = 14, 2, 64
KINDS = {"f16": "float16", "f32": "float32", "q8_0": "q8_0"}


def variants() -> dict[str, tuple[int, int]]:
    from qwc.compiler.targets import get_target, vector_registers

    regs = vector_registers(get_target("host").features)
    return {"one query": (16, 32), f"host ({regs[0]} x {regs[1]} B)": regs}


def caches(dtype: str, n: int, rng):
    """K (key tiles) and V caches holding n random tokens, through the kernels' own writers."""
    import tvm

    from qwc.compiler.kernels import kv_cache
    from qwc.compiler.targets import get_target

    target = get_target("host").tvm_target()
    cap = -(-n // 16) * 16
    shape = (1, KV_HEADS, cap, kv_cache.cache_width(dtype, HEAD_DIM))
    kc, vc = (tvm.runtime.tensor(np.zeros(shape, kv_cache.cache_element(dtype))) for _ in range(2))
    for cache, tiles in ((kc, True), (vc, False)):
        f = kv_cache.kv_cache_write(tiles, dtype=dtype, head_dim=HEAD_DIM)
        write = tvm.compile(tvm.IRModule({"main": f.with_attr("global_symbol", "main")}), target=target)
        x = rng.standard_normal((1, n, KV_HEADS * HEAD_DIM), dtype=np.float32)
        write(cache, tvm.runtime.tensor(x), tvm.runtime.tensor(np.array([n - 1], np.int32)))
    return kc, vc


def measure(depth: int, chunk: int, dtype: str, rounds: int) -> list[tuple[str, float, float]]:
    """[(variant, best ms, max |difference| from the first variant's output)]."""
    import tvm

    from qwc.compiler.kernels import prefill_attention
    from qwc.compiler.targets import get_target

    target = get_target("host").tvm_target()
    fns = {}
    for name, regs in variants().items():
        f = prefill_attention.attention(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM ** -0.5, kv_dtype=dtype, registers=regs)
        fns[name] = tvm.compile(tvm.IRModule({"main": f.with_attr("global_symbol", "main")}), target=target)
    rng = np.random.default_rng(0)
    kc, vc = caches(dtype, depth + chunk, rng)
    q = tvm.runtime.tensor(rng.standard_normal((1, chunk, HEADS * HEAD_DIM), dtype=np.float32))
    seqlens = tvm.runtime.tensor(np.array([depth + chunk - 1], np.int32))
    outs = {n: tvm.runtime.tensor(np.zeros((1, chunk, HEADS * HEAD_DIM), np.float32)) for n in fns}
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, f in fns.items():
            t = time.perf_counter()
            f(q, kc, vc, seqlens, outs[name])
            best[name] = min(best[name], (time.perf_counter() - t) * 1e3)
    first = outs[next(iter(fns))].numpy()
    return [(n, best[n], float(np.abs(outs[n].numpy() - first).max())) for n in fns]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--depths", type=lambda t: _ints(t, 0), default=[0, 3584, 15872])
    ap.add_argument("--threads", type=_ints, default=[1, 2])
    ap.add_argument("--kv", default="f16,f32,q8_0", help="comma-separated: f16, f32, q8_0")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--one", nargs=4, metavar=("DEPTH", "CHUNK", "DTYPE", "ROUNDS"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:   # a child process: TVM's pool takes its thread count once
        for name, ms, diff in measure(int(a.one[0]), int(a.one[1]), a.one[2], int(a.one[3])):
            print(f"{name}\t{ms}\t{diff}")
        return
    bad = [x for x in a.kv.split(",") if x not in KINDS]
    if bad or a.chunk < 1 or a.rounds < 1:
        sys.exit(f"prefill_attention: --kv {a.kv!r} (f16, f32, q8_0), --chunk and --rounds >= 1")
    print("| KV | threads | chunk @ depth | variant | ms (one layer) | time / host's | max difference from one query |")
    print("| --- | ---: | --- | --- | ---: | ---: | ---: |")
    for kv in a.kv.split(","):
        for threads in a.threads:
            for depth in a.depths:
                rows = child_rows(__file__, [str(depth), str(a.chunk), KINDS[kv], str(a.rounds)], threads)
                host = float(rows[-1][1])
                for name, ms, diff in rows:
                    print(f"| {kv} | {threads} | {a.chunk} @ d{depth} | {name} | {float(ms):.2f} | "
                          f"{float(ms) / host:.2f}x | {float(diff):.1e} |", flush=True)


if __name__ == "__main__":
    main()
