"""Q6_K's own kernel (kernels/x86/q6_k.py) against the Q8_0 kernels it would otherwise run as
(requantized: vnni8), on the Q6_K places of llama.cpp's Q4_K_M (ffn_down, attn_v, a 7B's
output), decode (one token) and prefill (512 tokens), each a linear as the importer emits it
(the activation quantizer included; Q6_K's chain starts too). Random weights and activations:

    .venv/bin/python bench/q6_k.py [--sizes 1.5b,7b] [--tokens 1,512] [--rounds 5]

Times are each system's best call of a round, medians over rounds, the two alternating (the
machine is shared); GB/s counts the weight bytes each reads (Q6_K 6.625 bits a weight, Q8_0 8.5).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

# (name, N, K) of the Q6_K tensors of a Q4_K_M file
SHAPES = {"1.5b": [("ffn_down", 1536, 8960), ("attn_v", 256, 1536)],
          "7b": [("ffn_down", 3584, 18944), ("attn_v", 512, 3584), ("output", 152064, 3584)]}


def _function(kind: str, k: int, n: int, m: int):
    """(vm function, its weight arguments) for one linear: "q6_k" or "q8_0" on random weights."""
    import tvm
    from tvm import relax

    from qwc.compiler.build import build
    from qwc.compiler.frontend import _CONTEXT, ImportContext, MatMulNBits
    from qwc.compiler.kernels import row_groups
    from qwc.compiler.repack_q6_k import pack
    from qwc.compiler.targets import get_target

    rng = np.random.default_rng(0)
    if kind == "q6_k":
        u = rng.integers(96, 160, (n, k // 16, 16), dtype=np.uint8)
        s = (np.float16(1e-3) * rng.integers(-128, 128, (n, k // 16))).astype(np.float32)
        weights = list(pack(u, s))
    else:
        weights = list(row_groups.pack_int8(rng.integers(0, 256, (n, k // 32, 32), dtype=np.uint8),
                                            rng.random((n, k // 32), dtype=np.float32), signed=False))
    av = relax.Var("a", relax.TensorType([m, k], "float32"))
    vs = [relax.Var(f"w{i}", relax.TensorType(list(w.shape), str(w.dtype))) for i, w in enumerate(weights)]
    bb = relax.BlockBuilder()
    features = get_target("host").features
    token = _CONTEXT.set(ImportContext(act_bits=8, features=features))   # the host's kernels, as an import picks them
    try:
        with bb.function("main", [av, *vs]):
            with bb.dataflow():
                if kind == "q6_k":
                    out = MatMulNBits.q6_k_matmul(bb, av, *vs, k, n)
                else:
                    out = MatMulNBits.q4_0_matmul(bb, av, *vs, k, n, "x86", features, bits=8)
                gv = bb.emit_output(out)
            bb.emit_func_output(gv)
    finally:
        _CONTEXT.reset(token)
    vm = relax.VirtualMachine(build(bb.get(), get_target("host")), tvm.cpu())
    a = tvm.runtime.tensor(rng.standard_normal((m, k)).astype(np.float32))
    return vm["main"], [a] + [tvm.runtime.tensor(w) for w in weights], sum(w.nbytes for w in weights)


def best(fn, args, calls: int) -> float:
    out = float("inf")
    for _ in range(calls):
        t0 = time.perf_counter()
        fn(*args)
        out = min(out, time.perf_counter() - t0)
    return out


def arguments(doc: str) -> argparse.ArgumentParser:
    """The kernel benches' options (this one's, bench/q4_k.py's and bench/five_bit.py's)."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--sizes", default="1.5b,7b")
    p.add_argument("--tokens", default="1,512")
    p.add_argument("--rounds", type=int, default=5)
    return p


def main() -> None:
    args = arguments(__doc__).parse_args()
    print("| size | tensor | N x K | tokens | Q6_K ms | Q8_0 ms | Q6_K / Q8_0 time | Q6_K GB/s | Q8_0 GB/s |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for size in args.sizes.split(","):
        for name, n, k in SHAPES[size]:
            for m in (int(t) for t in args.tokens.split(",")):
                if name == "output" and m > 1:
                    continue   # the head reads the last position only
                fns = {kind: _function(kind, k, n, m) for kind in ("q6_k", "q8_0")}
                calls = 20 if m == 1 else 3
                times = {kind: [] for kind in fns}
                for _ in range(args.rounds):
                    for kind, (fn, a, _) in fns.items():
                        times[kind].append(best(fn, a, calls))
                t6, t8 = (statistics.median(times[x]) for x in ("q6_k", "q8_0"))
                gb6, gb8 = fns["q6_k"][2] / t6 / 1e9, fns["q8_0"][2] / t8 / 1e9
                print(f"| {size} | {name} | {n} x {k} | {m} | {t6 * 1e3:.3f} | {t8 * 1e3:.3f} | {t6 / t8:.2f} | "
                      f"{gb6:.1f} | {gb8:.1f} |", flush=True)


if __name__ == "__main__":
    main()
