"""W4A8 block dot products with AVX-512 VNNI `vpdpbusd` (256-bit form, AVX512VL).

vpdpbusd multiplies unsigned bytes by signed bytes. The weight nibbles q (0..15) are the
unsigned operand as they are, the int8 activations the signed one, so no activation offset is
needed: dot(q - 8, a) = dot(q, a) - 8 * sum(a), and 8 * sum(a) is computed once per activation
block (`act_quant.block_offsets`) and shared by every row.

Per row and block: one 16-byte weight load, split into [low nibbles | high nibbles] as 32
unsigned bytes (even elements, then odd: the de-interleaved activation layout), one 32-byte
activation load, one vpdpbusd, a horizontal add, the offset, the two fp32 scales.
"""

from __future__ import annotations


def q4_dot(n: int, nb: int):
    from tvm.script import tirx as T

    dpbusd = "llvm.x86.avx512.vpdpbusd.256"

    @T.prim_func(private=True)
    def kernel(var_aq: T.handle, var_ad: T.handle, var_off: T.handle, w: T.Buffer((n, nb, 16), "uint8"),
               ws: T.Buffer((n, nb), "float32"), var_y: T.handle):
        T.func_attr({"tir.noalias": True, "op_pattern": 8})  # opaque: FuseOps leaves it whole
        m = T.int64()
        aq = T.match_buffer(var_aq, (m, nb, 32), "int8")
        ad = T.match_buffer(var_ad, (m, nb), "float32")
        off = T.match_buffer(var_off, (m, nb), "float32")
        y = T.match_buffer(var_y, (m, n), "float32")
        for j in T.parallel(n):
            for i in range(m):
                y[i, j] = T.float32(0)
                for b in range(nb):
                    # One expression: named temporaries would become per-thread allocations.
                    y[i, j] = y[i, j] + (T.Cast("float32", T.call_llvm_pure_intrin(
                        "int32", "llvm.vector.reduce.add.v8i32",
                        T.call_llvm_pure_intrin(
                            "int32x8", dpbusd, T.broadcast(T.int32(0), 8),
                            T.vectorcombine("uint8x32", w.vload([j, b, 0], "uint8x16") & T.broadcast(T.uint8(15), 16),
                                            w.vload([j, b, 0], "uint8x16") >> T.broadcast(T.uint8(4), 16)),
                            aq.vload([i, b, 0], "int8x32")))) - off[i, b]) * ws[j, b] * ad[i, b]

    return kernel
