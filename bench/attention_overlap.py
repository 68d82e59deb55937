"""What prefetching the next weights while decode attention runs could save: a stand-in for
attention (register arithmetic for as long as a layer's attention takes, no memory traffic)
followed by the x86 decode GEMV on cold weights, with and without the stand-in issuing
software prefetches (into L2) for the first `--prefetch-mb` of those weights, one line every
few iterations of its arithmetic:

    .venv/bin/python bench/attention_overlap.py [--busy-us 40] [--shapes 896x896,2048x896] [--threads 1]

Issue 90's lever "the next weights prefetched while attention and the norms run", measured
before it is built into decode_attention and the pass that would hand it the o projection's
weights: if the GEMV after a prefetching attention saves little, so does the kernel.

Each shape (N x K, Q4_0: the o projection's 896 x 896 at the 0.5B, a 2048-row one for an o
projection plus the first part of gate / up) gets distinct weight sets that add up to 160 MB,
so every call reads DRAM as a decode step does; a round calls, set after set, the stand-in
alone, the GEMV alone, the two in turn, and the two with the prefetches (the rounds alternate
the four; medians of 7 rounds, the first dropped). The table has microseconds a layer.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def stand_in(target, lines: int, iters: int, prefetch: bool, nc: int, ns: int):
    """The attention stand-in: `iters` rounds of eight independent FMA chains (in registers),
    round r with `prefetch` prefetching the weights' lines r * lines / iters onwards (codes,
    then scales), up to the next round's."""
    import tvm
    from tvm.script import tirx as T

    codes = nc // 64

    @T.prim_func
    def f(wc: T.Buffer((nc,), "uint8"), ws: T.Buffer((ns,), "float16"), xs: T.Buffer((256,), "float32"),
          out: T.Buffer((128,), "float32")):
        T.func_attr({"global_symbol": "main", "tir.noalias": True})
        acc = T.alloc_buffer((128,), "float32", scope="local")
        for j in range(8):
            acc[T.ramp(j * 16, 1, 16)] = T.broadcast(T.float32(1), 16)
        for r in range(iters):
            if prefetch:
                for ln in range(r * lines // iters, (r + 1) * lines // iters):
                    if ln < codes:
                        T.evaluate(T.call_llvm_intrin("void", "llvm.prefetch.p0", T.address_of(wc[ln * 64]),
                                                      T.int32(0), T.int32(2), T.int32(1)))
                    else:
                        T.evaluate(T.call_llvm_intrin("void", "llvm.prefetch.p0", T.address_of(ws[(ln - codes) * 32]),
                                                      T.int32(0), T.int32(2), T.int32(1)))
            for j in T.unroll(8):
                acc[T.ramp(j * 16, 1, 16)] = (acc[T.ramp(j * 16, 1, 16)] * xs[T.ramp((r % 16) * 16, 1, 16)]
                                              + xs[T.ramp(j * 16, 1, 16)])
        for j in range(8):
            out[T.ramp(j * 16, 1, 16)] = acc[T.ramp(j * 16, 1, 16)]
    return tvm.compile(tvm.IRModule({"main": f}), target=target.tvm_target())["main"]


def measure(n: int, k: int, busy_us: float) -> dict[str, float]:
    import numpy as np
    import tvm

    from qwc.compiler.kernels import decode_gemv
    from qwc.compiler.kernels.row_groups import groups
    from qwc.compiler.targets import get_target, kernels_for
    from qwc.runtime.memory import Arena, aligned

    target = get_target("host")
    dots = kernels_for(target.features).int_dots
    nb, g = k // 32, groups(n)
    nc, ns = g * nb * 256, g * nb * 16
    lines = (nc + 2 * ns) // 64
    gemv = decode_gemv(((n, False),), nb, dot=dots.decode, prefetch=dots.decode_prefetch)
    f_gemv = tvm.compile(tvm.IRModule({"main": gemv.with_attr("global_symbol", "main")}), target=target.tvm_target())["main"]
    rng = np.random.default_rng(0)
    act = [tvm.runtime.tensor(rng.integers(-127, 128, (1, nb, 32), dtype=np.int8)),
           tvm.runtime.tensor(rng.random((1, nb), dtype=np.float32)),
           tvm.runtime.tensor(rng.integers(-1000, 1000, (1, nb), dtype=np.int32))]
    y, out = tvm.runtime.tensor(np.zeros((1, n), np.float32)), tvm.runtime.tensor(np.zeros((128,), np.float32))
    xs = tvm.runtime.tensor((1 + 1e-4 * rng.random(256)).astype(np.float32))
    sets = max(8, (160 << 20) // (nc + 2 * ns))
    arena, held = Arena(sets * (aligned(nc) + aligned(2 * ns)) + 4096), []
    for _ in range(sets):
        c = arena.take((nc,), np.uint8)
        c[...] = rng.integers(0, 256, nc, dtype=np.uint8)
        s = arena.take((ns,), np.float16)
        s[...] = (rng.random(ns) * 0.01).astype(np.float16)
        held.append((tvm.runtime.from_dlpack(c), tvm.runtime.from_dlpack(s), tvm.runtime.from_dlpack(c.reshape(g, nb, 4, 64)),
                     tvm.runtime.from_dlpack(s.reshape(g, nb, 16))))
    # the stand-in's length: its rounds scaled until a call takes busy_us
    iters = 4096
    probe = stand_in(target, lines, iters, False, nc, ns)
    t0 = time.perf_counter()
    for _ in range(20):
        probe(held[0][0], held[0][1], xs, out)
    iters = int(iters * busy_us / ((time.perf_counter() - t0) / 20 * 1e6))
    busy = {pf: stand_in(target, lines, iters, pf, nc, ns) for pf in (False, True)}

    def run(mode: str) -> float:
        t0 = time.perf_counter()
        for wc, ws, wc4, ws4 in held:
            if mode != "gemv":
                busy[mode == "both, prefetching"](wc, ws, xs, out)
            if mode != "attention":
                f_gemv(*act, wc4, ws4, y)
        return (time.perf_counter() - t0) / len(held) * 1e6

    modes = ("attention", "gemv", "both", "both, prefetching")
    times = {m: [] for m in modes}
    for r in range(7):
        for m in (modes if r % 2 == 0 else modes[::-1]):
            times[m].append(run(m))
    return {"MB": (nc + 2 * ns) / 1e6, **{m: statistics.median(v[1:]) for m, v in times.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--busy-us", type=float, default=40.0, help="the stand-in's length (a layer's attention)")
    ap.add_argument("--shapes", default="896x896,2048x896")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    os.environ["TVM_NUM_THREADS"] = str(args.threads)
    print(f"{args.threads} thread(s), the stand-in {args.busy_us:.0f} us; microseconds a layer, medians\n")
    print("| N x K | MB | stand-in | GEMV alone (GB/s) | in turn | in turn, prefetching | saved | of the GEMV |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for shape in args.shapes.split(","):
        n, k = (int(x) for x in shape.split("x"))
        m = measure(n, k, args.busy_us)
        saved = m["both"] - m["both, prefetching"]
        print(f"| {n} x {k} | {m['MB']:.2f} | {m['attention']:.1f} | {m['gemv']:.1f} ({m['MB'] * 1e3 / m['gemv']:.1f}) | "
              f"{m['both']:.1f} | {m['both, prefetching']:.1f} | {saved:.1f} | {saved / m['gemv']:.0%} |", flush=True)


if __name__ == "__main__":
    main()
