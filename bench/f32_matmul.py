"""The float linears' kernel (kernels/f32_matmul.py, `qwc optimize --keep-float`) against
torch's matmul (MKL) on the same shapes, µs a call and GB/s of weights read:

    .venv/bin/python bench/f32_matmul.py [--threads 2] [--rows 1,2,5,8] [--weights 700]

Each shape runs over distinct weights adding up to --weights MB (default 700: out of this
machine's 260 MB L3), as a decode step's linears read theirs from memory; the best of 5
passes. Rows (tokens) 1 is the decode form; more, the form a verify call or prefill takes.
Shapes (N, K): SmolLM2-135M's q/o, gate/up and down, and Qwen2.5-0.5B's gate/up.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

SHAPES = [("smollm2 q/o", 576, 576), ("smollm2 gate/up", 1536, 576), ("smollm2 down", 576, 1536),
          ("0.5b gate/up", 4864, 896)]


def best(call, weights, passes: int = 5) -> float:
    """Seconds a call, the best pass over every weight."""
    out = float("inf")
    for _ in range(passes):
        t = time.perf_counter()
        for w in weights:
            call(w)
        out = min(out, (time.perf_counter() - t) / len(weights))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--rows", default="1,2,5,8")
    p.add_argument("--weights", type=int, default=700, help="MB of distinct weights a shape cycles through")
    a = p.parse_args()
    os.environ["TVM_NUM_THREADS"] = str(a.threads)
    import torch
    import tvm

    from qwc.compiler.kernels import f32_matmul
    from qwc.compiler.targets import get_target, vector_registers

    torch.set_num_threads(a.threads)
    target = get_target("host")
    registers = vector_registers(target.features)
    rows = [int(r) for r in a.rows.split(",")]
    print(f"Float matmul, {a.threads} threads, {target.name} ({target.mcpu}), {a.weights} MB of distinct weights "
          "a shape; µs a call (GB/s of weights)\n")
    print("| shape (N x K) | rows | qwc | torch | qwc / torch (time) |")
    print("| --- | ---: | ---: | ---: | ---: |")
    rng = np.random.default_rng(0)
    for name, n, k in SHAPES:
        cols = f32_matmul.columns(n, registers)
        count = max(1, a.weights * 2**20 // (4 * n * k))
        plain = [rng.standard_normal((k, n), dtype=np.float32) for _ in range(count)]
        packed = [tvm.runtime.tensor(f32_matmul.pack(w, cols)) for w in plain]
        tw = [torch.from_numpy(w) for w in plain]
        for m in rows:
            one = m == 1
            f = f32_matmul.kernel(k, n, cols, one, registers).with_attr("global_symbol", "main")
            fn = tvm.compile(tvm.IRModule({"main": f}), target=target.tvm_target())["main"]
            x = rng.standard_normal((m, k), dtype=np.float32)
            xt, y = tvm.runtime.tensor(x), tvm.runtime.tensor(np.empty((m, n), np.float32))
            fn(xt, packed[0], y)
            np.testing.assert_allclose(y.numpy(), x @ plain[0], rtol=1e-3, atol=1e-3 * np.abs(x @ plain[0]).max())
            tx = torch.from_numpy(x)
            ours = best(lambda w, fn=fn, xt=xt, y=y: fn(xt, w, y), packed)
            theirs = best(lambda w, tx=tx: tx @ w, tw)
            gb = 4 * n * k / 1e9
            print(f"| {name} ({n} x {k}) | {m} | {ours * 1e6:.1f} ({gb / ours:.1f}) | {theirs * 1e6:.1f} "
                  f"({gb / theirs:.1f}) | {ours / theirs:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
