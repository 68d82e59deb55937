"""The x86 W4A8 prefill GEMM (kernels/x86/vnni.py: q4_matmul) on Qwen2.5's linear shapes, as
GMAC/s, against onnxruntime's MatMulNBits (int8 compute, accuracy_level 4) on the same shape and
threads, and as a share of the machine's vpdpbusd peak measured in the same run:

    .venv/bin/python bench/prefill_gemm.py [--sizes 0.5b,1.5b,7b] [--tokens 136,512] [--tiles 4,8]
                                           [--threads 2] [--rounds 5]

`--tiles`: prefill tile widths to compare (tokens a row group's unpacked weights serve; the
default is the kernel's DEFAULT_TOKENS). The peak is a kernel of independent vpdpbusd chains
on registers (64 multiply-adds each) over the same threads. Every system is timed in turn,
`--rounds` times, each keeping its best call: the machine is shared.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from qwc.bench.gemv import gemv_graph, ort_gemv

# (d_model, d_ff) of the sizes users run
SIZES = {"0.5b": (896, 4864), "1.5b": (1536, 8960), "3b": (2048, 11008), "7b": (3584, 18944)}
CHAINS = 12   # vpdpbusd's latency x throughput on recent x86 cores is ~10 in flight


def shapes(size: str) -> list[tuple[str, int, int]]:
    d, ff = SIZES[size]
    return [("q/o", d, d), ("gate/up", ff, d), ("down", d, ff)]


def best_time(fn, calls: int = 10) -> float:
    best = float("inf")
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def qwc_gemm(n: int, k: int, m: int, tiles: int, dot: str, target):
    """q4_matmul's kernel at `tiles` tokens a tile on random int8 activations and Q4_0 weights."""
    import tvm

    from qwc.compiler.kernels import dot_bits
    from qwc.compiler.kernels.row_groups import chunks, groups
    from qwc.compiler.kernels.x86 import vnni

    nb = k // 32
    f = vnni.q4_matmul(n, nb, "float16", tokens=tiles, dot=dot)
    fn = tvm.compile(tvm.IRModule({"main": f.with_attr("global_symbol", "main")}), target=target.tvm_target())["main"]
    rng = np.random.default_rng(0)
    args = [tvm.runtime.tensor(x) for x in (
        rng.integers(-127, 128, (m, nb, 32), dtype=np.int8), rng.random((m, nb), dtype=np.float32),
        rng.integers(-8000, 8000, (m, nb), dtype=np.int32),
        rng.integers(0, 256, (groups(n), nb, chunks(dot_bits(dot)), 64), dtype=np.uint8),
        (rng.random((groups(n), nb, 16)) * 0.01).astype(np.float16), np.zeros((m, n), np.float32))]
    return lambda: fn(*args)


def ort_gemm(n: int, k: int, m: int, threads: int):
    """onnxruntime's MatMulNBits at int8 compute (accuracy_level 4), without spinning threads:
    they would take the cores from the system timed next (qwc's first shape ran far slower)."""
    return ort_gemv(gemv_graph(n, k, m=m), threads, 4, spin=False)


def vpdpbusd_peak(threads: int, target, iters: int = 20_000):
    """(call, multiply-adds a call): CHAINS independent vpdpbusd accumulators a thread."""
    import tvm
    from tvm.script import tirx as T

    lanes = 16

    @T.prim_func(private=True)
    def peak(a: T.Buffer((64,), "uint8"), b: T.Buffer((64,), "int8"), out: T.Buffer((threads, CHAINS * lanes), "int32")):
        T.func_attr({"tir.noalias": True})
        for t in T.parallel(threads):
            acc = T.decl_buffer((CHAINS * lanes,), "int32", scope="global")   # < 1 KiB: registers
            for j in T.unroll(CHAINS):
                acc[T.ramp(j * lanes, 1, lanes)] = T.broadcast(T.int32(j), lanes)
            for _ in range(iters):
                for j in T.unroll(CHAINS):
                    acc[T.ramp(j * lanes, 1, lanes)] = T.call_llvm_pure_intrin(
                        "int32x16", "llvm.x86.avx512.vpdpbusd.512", acc[T.ramp(j * lanes, 1, lanes)],
                        a.vload([0], "uint8x64"), b.vload([0], "int8x64"))
            for j in T.unroll(CHAINS):
                out[t, T.ramp(j * lanes, 1, lanes)] = acc[T.ramp(j * lanes, 1, lanes)]

    fn = tvm.compile(tvm.IRModule({"main": peak.with_attr("global_symbol", "main")}), target=target.tvm_target())["main"]
    args = [tvm.runtime.tensor(np.ones(64, np.uint8)), tvm.runtime.tensor(np.ones(64, np.int8)),
            tvm.runtime.tensor(np.zeros((threads, CHAINS * lanes), np.int32))]
    return (lambda: fn(*args)), threads * iters * CHAINS * 64


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="0.5b,1.5b,7b")
    ap.add_argument("--tokens", default="136,512")
    ap.add_argument("--tiles", default=None, help="tile widths to compare (default: the kernel's own)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    unknown = [s for s in args.sizes.split(",") if s not in SIZES]
    if unknown:
        ap.error(f"unknown size {unknown[0]!r} (known: {', '.join(SIZES)})")
    os.environ["TVM_NUM_THREADS"] = str(args.threads)   # before TVM's pool starts

    from qwc.compiler.kernels.x86 import vnni
    from qwc.compiler.targets import get_target, kernels_for

    target = get_target("host")
    w4a8 = kernels_for(target.features).int_dots
    if w4a8 is None or w4a8.isa != "x86":
        raise SystemExit("bench/prefill_gemm.py: the host has no x86 W4A8 kernels (AVX2 or AVX-512 VNNI)")
    dot = w4a8.prefill
    tiles = [int(t) for t in args.tiles.split(",")] if args.tiles else [vnni.DEFAULT_TOKENS[dot]]
    peak = vpdpbusd_peak(args.threads, target) if dot.startswith("vnni") else None

    rows = []
    for size in args.sizes.split(","):
        for name, n, k in shapes(size):
            for m in (int(t) for t in args.tokens.split(",")):
                systems = {f"qwc t{t}": qwc_gemm(n, k, m, t, dot, target) for t in tiles}
                systems["onnxruntime"] = ort_gemm(n, k, m, args.threads)
                best = dict.fromkeys(systems, float("inf"))
                peak_best = float("inf")
                for _ in range(args.rounds):
                    for s, fn in systems.items():
                        fn()
                        best[s] = min(best[s], best_time(fn))
                    if peak is not None:
                        peak[0]()
                        peak_best = min(peak_best, best_time(peak[0]))
                macs = m * n * k
                rows.append((size, name, n, k, m, {s: macs / t / 1e9 for s, t in best.items()},
                             peak[1] / peak_best / 1e9 if peak else None))
                print(".", end="", flush=True)
    print()
    names = list(rows[0][5])
    print(f"dot {dot}, {args.threads} threads; GMAC/s (best call of {args.rounds} rounds); "
          "share: of the vpdpbusd peak measured beside each shape")
    head = ["size", "linear", "N x K", "M"] + names + ["best qwc / onnxruntime"] + (
        [f"{names[-2]} / {names[0]}"] if len(tiles) > 1 else []) + (["best qwc, share of peak"] if peak else [])
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join(" --- " if i < 2 else " ---: " for i in range(len(head))) + "|")
    for size, name, n, k, m, g, pk in rows:
        top = max(g[s] for s in names[:-1])
        cells = [size, name, f"{n} x {k}", str(m)] + [f"{g[s]:.1f}" for s in names] + [
            f"{top / g['onnxruntime']:.2f}x"] + ([f"{g[names[-2]] / g[names[0]]:.2f}x"] if len(tiles) > 1 else []) + (
            [f"{top / pk:.0%} of {pk:.0f}"] if pk else [])
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
