"""A GGUF's Q5_K (and Q5_0 / Q5_1) as five-bit codes (compiler/repack_five_bit.py: "vnni5") against
the 8-bit codes of the W8A8 kernels it would otherwise run as, both with the block minimums as
block offsets, on this host's kernels, at the Q5_K tensors of llama.cpp's Q5_K_M at the 1.5B
and 7B shapes, decode (one token) and prefill (512 tokens), each a linear as the importer emits
it (the activation quantizer included). Random codes 0..31, scales and minimums:

    .venv/bin/python bench/five_bit.py [--sizes 1.5b,7b] [--tokens 1,512] [--rounds 5]

Decode reads distinct copies of the weights in turn (about 1.5 GB of them), as a model's decode
reads each weight once from DRAM; prefill calls one copy. Times are each form's best pass of a
round, medians over rounds, the two alternating (the machine is shared); GB/s counts the weight
bytes each reads (five-bit codes 7 bits a weight with their float32 scales and offsets, bytes 10).
"""

from __future__ import annotations

import sys

import numpy as np

from qwc.bench.q4_k import two_forms_table


def _weights(k: int, n: int, seed: int, five_bit: bool) -> list[np.ndarray]:
    from qwc.compiler.kernels import row_groups

    rng = np.random.default_rng(seed)
    q = rng.integers(0, 32, (n, k // 32, 32), dtype=np.uint8)
    scales = rng.uniform(1e-3, 2e-2, (n, k // 32)).astype(np.float32)
    mins = -rng.uniform(0, 0.1, (n, k // 32)).astype(np.float32)
    w, s = row_groups.pack_five_bit(q, scales) if five_bit else row_groups.pack_int8(q + np.uint8(128), scales,
                                                                                       signed=False)
    return [w, s, row_groups.pack_offsets(mins)]


def _function(k: int, n: int, m: int, five_bit: bool, copies: int):
    import tvm
    from tvm import relax

    from qwc.compiler.build import build
    from qwc.compiler.frontend import MatMulNBits
    from qwc.compiler.targets import get_target

    t = get_target("host")
    sets = [_weights(k, n, i, five_bit) for i in range(copies)]
    av = relax.Var("a", relax.TensorType([m, k], "float32"))
    vs = [relax.Var(f"w{i}", relax.TensorType(list(w.shape), str(w.dtype))) for i, w in enumerate(sets[0])]
    bb = relax.BlockBuilder()
    with bb.function("main", [av, *vs]):
        with bb.dataflow():
            out = MatMulNBits.q4_0_matmul(bb, av, vs[0], vs[1], k, n, "x86", t.features, offsets=vs[2],
                                          bits=5 if five_bit else 8)
            gv = bb.emit_output(out)
        bb.emit_func_output(gv)
    vm = relax.VirtualMachine(build(bb.get(), t), tvm.cpu())
    a = tvm.runtime.tensor(np.random.default_rng(1).standard_normal((m, k)).astype(np.float32))
    return vm["main"], [[a] + [tvm.runtime.tensor(w) for w in ws] for ws in sets], sum(w.nbytes for w in sets[0])


def main() -> None:
    from qwc.bench.q6_k import arguments
    from qwc.compiler.targets import five_bit_path, get_target

    args = arguments(__doc__).parse_args()
    if five_bit_path(32, 8, 8, get_target("host").features) is None:
        sys.exit("five_bit: this host has no five-bit kernel (targets.IntDots.q5: x86 AVX-512 VNNI)")
    two_forms_table(args, ("five-bit", "bytes"), _function, 0.875)


if __name__ == "__main__":
    main()
