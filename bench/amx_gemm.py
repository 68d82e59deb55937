"""The x86 prefill GEMMs with AMX's 16-token tiles (kernels/x86/amx.py) against the same GEMMs
on VNNI alone, per weight form, on Qwen2.5's linear shapes, as GMAC/s:

    .venv/bin/python bench/amx_gemm.py [--sizes 1.5b] [--tokens 512] [--forms q4_0,q4_k,q8_0,q5_k,q6_k]
                                       [--threads 2] [--rounds 5]

Forms: q4_0 (fp16 scales), q4_k (the file's compact factors and minimums), q8_0 (bytes), q5_k
(five-bit codes with the file's factors), q6_k (its own kernel, x86/q6_k.py). Random codes and
activations (the quantizer's offsets as it writes them). The two builds of a form are timed in
turn, `--rounds` times, each keeping its best call: the machine is shared. Needs a CPU with
AMX-INT8 (x86-amx's features).
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

from qwc.bench.prefill_gemm import best_time, shapes

FORMS = ("q4_0", "q4_k", "q8_0", "q5_k", "q6_k")


def _q4_family(form: str, n: int, nb: int, m: int, amx: bool, rng):
    """(kernel, args) of x86/vnni.py's GEMM for a Q4_0 / Q4_K / Q8_0 / Q5_K form."""
    import tvm

    from qwc.compiler.kernels import dot_bits, q4_k_scales, w4a8_gemm
    from qwc.compiler.kernels.row_groups import chunks, groups

    dot, sdt, offsets = {"q4_0": ("vnni", "float16", False), "q4_k": ("vnni", q4_k_scales.SCALE_DTYPE, True),
                         "q8_0": ("vnni8", "float16", False), "q5_k": ("vnni5", q4_k_scales.SCALE_DTYPE, True)}[form]
    ng = groups(n)
    ws_shape, ws_dtype, wc_shape, wc_dtype = q4_k_scales.buffers(sdt, ng, nb)
    compact = sdt == q4_k_scales.SCALE_DTYPE
    weights = [rng.integers(0, 256, (ng, nb, chunks(dot_bits(dot)), 64)).astype("uint8"),
               rng.integers(0, 64, ws_shape).astype(ws_dtype) if compact else rng.random(ws_shape).astype(ws_dtype)]
    if offsets:
        weights.append(rng.uniform(1e-4, 1e-3, wc_shape).astype(wc_dtype))
    a = rng.integers(-127, 128, (m, nb, 32)).astype("int8")
    acts = [a, rng.random((m, nb)).astype("float32"), (-8 * a.astype(np.int64).sum(-1)).astype("int32")]
    f = w4a8_gemm(dot, n, nb, sdt, offsets=offsets, amx=amx)
    return f, [tvm.runtime.tensor(x) for x in (*acts, *weights, np.zeros((m, n), np.float32))]


def _q6_k(n: int, nb: int, m: int, amx: bool, rng):
    """(kernel, args) of x86/q6_k.py's GEMM."""
    import tvm

    from qwc.compiler.kernels.row_groups import groups
    from qwc.compiler.kernels.x86.q6_k import q6_k_matmul

    ng = groups(n)
    a = rng.integers(-127, 128, (m, nb, 32)).astype("int8")
    starts = np.zeros((m, nb, 2), np.int32)   # (their values do not change the time)
    args = [a, rng.random((m, nb)).astype("float32"), starts, rng.integers(0, 256, (ng, nb, 6, 64)).astype("uint8"),
            rng.integers(-128, 128, (ng, nb, 32)).astype("int8"), rng.uniform(1e-3, 1e-2, (ng, nb // 8, 16)).astype("float32"),
            np.zeros((m, n), np.float32)]
    return q6_k_matmul(n, nb, amx=amx), [tvm.runtime.tensor(x) for x in args]


def timed(form: str, n: int, k: int, m: int, rounds: int) -> dict[str, float]:
    """GMAC/s of the AMX and the VNNI build, their best calls over alternating rounds."""
    import tvm

    from qwc.compiler.targets import get_target

    target = get_target("x86-amx").tvm_target()
    rng = np.random.default_rng(0)
    runs = {}
    for name, amx in (("amx", True), ("vnni", False)):
        f, args = _q6_k(n, k // 32, m, amx, rng) if form == "q6_k" else _q4_family(form, n, k // 32, m, amx, rng)
        fn = tvm.compile(tvm.IRModule({"main": f.with_attr("global_symbol", "main")}), target=target)["main"]
        runs[name] = (fn, args)
    best = {name: float("inf") for name in runs}
    for _ in range(rounds):
        for name, (fn, args) in runs.items():
            fn(*args)
            best[name] = min(best[name], best_time(lambda fn=fn, args=args: fn(*args), calls=3))
    return {name: m * n * k / t / 1e9 for name, t in best.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1.5b")
    ap.add_argument("--tokens", default="512")
    ap.add_argument("--forms", default=",".join(FORMS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    os.environ["TVM_NUM_THREADS"] = str(a.threads)
    from qwc import cpu

    if not cpu.has("amx_int8"):
        sys.exit("bench/amx_gemm.py: this CPU has no AMX-INT8")
    cpu.enable_amx()
    forms = [f.strip() for f in a.forms.split(",") if f.strip()]
    unknown = [f for f in forms if f not in FORMS]
    if unknown:
        sys.exit(f"--forms: unknown form {unknown[0]!r} ({', '.join(FORMS)})")
    print(f"\n{a.threads} threads, GMAC/s, best call of {a.rounds} alternating rounds\n")
    print("| form | size | linear | N x K | M | AMX tiles | VNNI | AMX / VNNI |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for form in forms:
        for size in a.sizes.split(","):
            for name, n, k in shapes(size):
                for m in (int(t) for t in a.tokens.split(",")):
                    g = timed(form, n, k, m, a.rounds)
                    print(f"| {form} | {size} | {name} | {n} x {k} | {m} | {g['amx']:.1f} | {g['vnni']:.1f} | "
                          f"{g['amx'] / g['vnni']:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
