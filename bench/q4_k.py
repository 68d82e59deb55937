"""Q4_K's compact scales (kernels/q4_k_scales.py: the file's 6-bit sc and mn a block, fp16 d and
dmin a super-block) against the expanded form (float32 d sc and block offsets a block) on the
same W4A8 kernels of this host, on the Q4_K tensors of llama.cpp's Q4_K_M at the 1.5B and 7B
shapes, decode (one token) and prefill (512 tokens), each a linear as the importer emits it
(the activation quantizer included). Random weights in the Q4_K form, activations random:

    .venv/bin/python bench/q4_k.py [--sizes 1.5b,7b] [--tokens 1,512] [--rounds 5] [--target host]

Decode reads distinct copies of the weights in turn (about 1.5 GB of them), as a model's decode
reads each weight once from DRAM; prefill calls one copy. Times are each form's best pass of a
round, medians over rounds, the two alternating (the machine is shared); GB/s counts the
weight bytes each reads (compact 4.625 bits a weight, expanded 6).
"""

from __future__ import annotations

import statistics
import time

import numpy as np

# (name, N, K) of the Q4_K tensors of a Q4_K_M file (llama.cpp's other ffn_down layers are Q6_K)
SHAPES = {"1.5b": [("attn_q", 1536, 1536), ("ffn_up", 8960, 1536), ("ffn_down", 1536, 8960)],
          "7b": [("attn_q", 3584, 3584), ("ffn_up", 18944, 3584), ("ffn_down", 3584, 18944)]}
DECODE_BYTES = 1.5e9


def _weights(k: int, n: int, seed: int, compact: bool) -> list[np.ndarray]:
    """One random Q4_K weight in the kernels' compact or expanded form."""
    from qwc.compiler.kernels import row_groups
    from qwc.compiler.repack_q4_k import pack

    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 256, (n, k // 32, 16), dtype=np.uint8)
    d = rng.uniform(2e-4, 4e-4, (n, k // 256, 1)).astype(np.float16).astype(np.float32)
    dmin = rng.uniform(1e-4, 3e-4, (n, k // 256, 1)).astype(np.float16).astype(np.float32)
    scales = (d * rng.integers(1, 64, (n, k // 256, 8))).reshape(n, -1).astype(np.float32)
    mins = -(dmin * rng.integers(0, 64, (n, k // 256, 8))).reshape(n, -1).astype(np.float32)
    if compact:
        return list(pack(codes, scales, (-mins / scales).astype(np.float32)))
    w, s = row_groups.pack(codes, scales)
    return [w, s, row_groups.pack_offsets((mins + 8 * scales).astype(np.float32))]


def _function(k: int, n: int, m: int, compact: bool, target: str, copies: int):
    """(vm function, argument lists (one a weight copy), weight bytes a call)."""
    import tvm
    from tvm import relax

    from qwc.compiler.build import build
    from qwc.compiler.frontend import MatMulNBits
    from qwc.compiler.targets import get_target

    t = get_target(target)
    sets = [_weights(k, n, i, compact) for i in range(copies)]
    av = relax.Var("a", relax.TensorType([m, k], "float32"))
    vs = [relax.Var(f"w{i}", relax.TensorType(list(w.shape), str(w.dtype))) for i, w in enumerate(sets[0])]
    bb = relax.BlockBuilder()
    with bb.function("main", [av, *vs]):   # as the importer emits a Q4_K linear
        with bb.dataflow():
            out = MatMulNBits.q4_0_matmul(bb, av, vs[0], vs[1], k, n, "arm" if t.arch == "aarch64" else "x86",
                                          t.features, offsets=vs[2])
            gv = bb.emit_output(out)
        bb.emit_func_output(gv)
    vm = relax.VirtualMachine(build(bb.get(), t), tvm.cpu())
    a = tvm.runtime.tensor(np.random.default_rng(1).standard_normal((m, k)).astype(np.float32))
    return vm["main"], [[a] + [tvm.runtime.tensor(w) for w in ws] for ws in sets], sum(w.nbytes for w in sets[0])


def best_pass(fn, arg_sets, passes: int) -> float:
    """The best time a call over `passes` passes through every argument set."""
    out = float("inf")
    for _ in range(passes):
        t0 = time.perf_counter()
        for args in arg_sets:
            fn(*args)
        out = min(out, (time.perf_counter() - t0) / len(arg_sets))
    return out


def two_forms_table(args, labels: tuple[str, str], function, bytes_a_weight: float) -> None:
    """Print the table of two weight forms (True, False) on the same kernels: `function(k, n, m,
    form, copies)` gives (vm function, argument sets, weight bytes a call); decode reads about
    DECODE_BYTES of distinct copies (`bytes_a_weight`: the larger form's), prefill one."""
    a, b = labels
    print(f"| size | tensor | N x K | tokens | {a} ms | {b} ms | {a} / {b} time | {a} GB/s | {b} GB/s |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for size in args.sizes.split(","):
        for name, n, k in SHAPES[size]:
            for m in (int(t) for t in args.tokens.split(",")):
                copies = max(1, min(200, int(DECODE_BYTES / (n * k * bytes_a_weight)))) if m == 1 else 1
                fns = {f: function(k, n, m, f, copies) for f in (True, False)}
                times = {f: [] for f in fns}
                for _ in range(args.rounds):
                    for f, (fn, sets, _) in fns.items():
                        times[f].append(best_pass(fn, sets, 3))
                ta, tb = (statistics.median(times[f]) for f in (True, False))
                print(f"| {size} | {name} | {n} x {k} | {m} | {ta * 1e3:.3f} | {tb * 1e3:.3f} | {ta / tb:.2f} | "
                      f"{fns[True][2] / ta / 1e9:.1f} | {fns[False][2] / tb / 1e9:.1f} |", flush=True)
                del fns


def main() -> None:
    from qwc.bench.q6_k import arguments

    p = arguments(__doc__)
    p.add_argument("--target", default="host")
    args = p.parse_args()
    two_forms_table(args, ("compact", "expanded"),
                    lambda k, n, m, c, copies: _function(k, n, m, c, args.target, copies), 0.75)


if __name__ == "__main__":
    main()
