"""W4A8 block dot products with NEON `sdot` (Armv8.2 dotprod; Neoverse-N2 has it).

Activations arrive quantized per 32-block to int8, de-interleaved within each block
(`kernels/act_quant.py: fused_quantizer`), so one 16-byte load of packed Q4_0 weights splits
into two int8x16 vectors (low nibbles = even elements, high nibbles = odd ones) that line up
with two 16-byte activation loads: two `sdot`s per block and row, one horizontal add, the two
fp32 block scales.
"""

from __future__ import annotations


def q4_dot(n: int, nb: int):
    """y [M, N] = sum over blocks of sdot(w_q4 - 8, a_q8) * w_scale * a_scale."""
    from tvm.script import tirx as T

    sdot = "llvm.aarch64.neon.sdot.v4i32.v16i8"

    @T.prim_func(private=True)
    def kernel(var_aq: T.handle, var_ad: T.handle, w: T.Buffer((n, nb, 16), "uint8"),
               ws: T.Buffer((n, nb), "float32"), var_y: T.handle):
        T.func_attr({"tir.noalias": True, "op_pattern": 8})  # opaque: FuseOps leaves it whole
        m = T.int64()
        aq = T.match_buffer(var_aq, (m, nb, 32), "int8")
        ad = T.match_buffer(var_ad, (m, nb), "float32")
        y = T.match_buffer(var_y, (m, n), "float32")
        for j in T.parallel(n):
            for i in range(m):
                y[i, j] = T.float32(0)
                for b in range(nb):
                    # One expression: named temporaries would become per-thread allocations.
                    y[i, j] = y[i, j] + T.Cast("float32", T.call_llvm_pure_intrin(
                        "int32", "llvm.vector.reduce.add.v4i32",
                        T.call_llvm_pure_intrin(
                            "int32x4", sdot,
                            T.call_llvm_pure_intrin(
                                "int32x4", sdot, T.broadcast(T.int32(0), 4),
                                T.reinterpret("int8x16", w.vload([j, b, 0], "uint8x16") & T.broadcast(T.uint8(15), 16))
                                - T.broadcast(T.int8(8), 16),
                                aq.vload([i, b, 0], "int8x16")),
                            T.reinterpret("int8x16", w.vload([j, b, 0], "uint8x16") >> T.broadcast(T.uint8(4), 16))
                            - T.broadcast(T.int8(8), 16),
                            aq.vload([i, b, 16], "int8x16")))) * ws[j, b] * ad[i, b]

    return kernel
