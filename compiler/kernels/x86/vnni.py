"""W4A8 block dot products with AVX-512 VNNI `vpdpbusd` (256-bit form, AVX512VL).

vpdpbusd multiplies unsigned bytes by signed bytes. The weight nibbles q (0..15) are the
unsigned operand as they are and the int8 activations the signed one, so the activations need
no offset: dot(q - 8, a) = dot(q, a) - 8 * sum(a), with sum(a) computed once per activation
block (`act_quant.fused_quantizer`) and shared by every row.

Accumulation is in fp32 lanes with the two block scales, one horizontal add per row at the
end; the overcount is subtracted lane-wise (a lane multiple of sum(a) that adds up to 8 x sum(a)
per row). Tasks cover several rows so each activation load serves them all and the accumulators
are independent. A 512-bit form (two rows per vpdpbusd) measured no faster than these.
"""

from __future__ import annotations

GEMV_ROWS = 8     # rows per task: four row pairs
OFFSET = 2        # per-lane multiple of sum(a) to subtract (4 lanes per row: 8 x sum(a) in all)


def _pair_dot(T, w, aq, off, ws, ad, j, b, tok):
    """Rows j and j+1, block b, token tok: the float32x8 contribution (lanes 0-3 row j, 4-7
    row j+1), written as one expression (named temporaries would become per-thread
    allocations inside the parallel loop)."""
    dpbusd = "llvm.x86.avx512.vpdpbusd.256"
    return (T.Cast("float32x8", T.call_llvm_pure_intrin(
        "int32x8", dpbusd,
        T.call_llvm_pure_intrin(
            "int32x8", dpbusd, T.broadcast(T.int32(0), 8),
            T.vectorcombine("uint8x32", w.vload([j, b, 0], "uint8x16"), w.vload([j + 1, b, 0], "uint8x16"))
            & T.broadcast(T.uint8(15), 32),
            T.vectorcombine("int8x32", aq.vload([tok, b, 0], "int8x16"), aq.vload([tok, b, 0], "int8x16"))),
        T.vectorcombine("uint8x32", w.vload([j, b, 0], "uint8x16"), w.vload([j + 1, b, 0], "uint8x16"))
        >> T.broadcast(T.uint8(4), 32),
        T.vectorcombine("int8x32", aq.vload([tok, b, 16], "int8x16"), aq.vload([tok, b, 16], "int8x16"))))
        - T.broadcast(off[tok, b], 8)) * T.vectorcombine(
            "float32x8", T.broadcast(ws[j, b] * ad[tok, b], 4), T.broadcast(ws[j + 1, b] * ad[tok, b], 4))


def q4_dot(n: int, nb: int):
    """Decode GEMV. Two rows share one 256-bit vector, [row r's 16 bytes | row r+1's]: its low
    nibbles dot the duplicated even activation half, its high nibbles the duplicated odd half,
    both into one int32x8 (lanes 0-3 row r, 4-7 row r+1). Two vpdpbusd, one convert, one fused
    scale per row pair and block; 8 rows per task (measured ~1.3x the one-row-per-vector form
    from cache; DRAM-bound shapes the same). Each lane subtracts 2 x sum(a)."""
    from tvm.script import tirx as T

    rows = next(r for r in (GEMV_ROWS, 4, 2) if n % r == 0)
    pairs = rows // 2

    @T.prim_func(private=True)
    def kernel(var_aq: T.handle, var_ad: T.handle, var_off: T.handle, w: T.Buffer((n, nb, 16), "uint8"),
               ws: T.Buffer((n, nb), "float32"), var_y: T.handle):
        T.func_attr({"tir.noalias": True, "op_pattern": 8})  # opaque: FuseOps leaves it whole
        m = T.int64()
        aq = T.match_buffer(var_aq, (m, nb, 32), "int8")
        ad = T.match_buffer(var_ad, (m, nb), "float32")
        off = T.match_buffer(var_off, (m, nb), "float32")
        y = T.match_buffer(var_y, (m, n), "float32")
        for jo in T.parallel(n // rows):
            for i in range(m):
                acc = T.decl_buffer((pairs * 8,), "float32", scope="local")
                for p in T.unroll(pairs):
                    acc[T.ramp(p * 8, 1, 8)] = T.broadcast(T.float32(0), 8)
                for b in range(nb):
                    for p in T.unroll(pairs):
                        acc[T.ramp(p * 8, 1, 8)] = acc[T.ramp(p * 8, 1, 8)] + _pair_dot(
                            T, w, aq, off, ws, ad, jo * rows + 2 * p, b, i)
                for p in T.unroll(pairs):
                    y[i, jo * rows + 2 * p] = T.call_llvm_pure_intrin(
                        "float32", "llvm.vector.reduce.fadd.v4f32", T.float32(0), acc[T.ramp(p * 8, 1, 4)])
                    y[i, jo * rows + 2 * p + 1] = T.call_llvm_pure_intrin(
                        "float32", "llvm.vector.reduce.fadd.v4f32", T.float32(0), acc[T.ramp(p * 8 + 4, 1, 4)])

    return kernel


TOKENS = 4  # tokens per GEMM tile: each combined weight vector serves this many tokens


def q4_gemm(n: int, nb: int):
    """Prefill GEMM: tiles of 2 row pairs x TOKENS tokens in the q4_dot layout (a row pair per
    256-bit vector), so each weight vector is split once and used for TOKENS tokens; leftover
    tokens go one at a time. Lane offset as in q4_dot."""
    from tvm.script import tirx as T

    pairs = 2 if n % 4 == 0 else 1
    rows = 2 * pairs
    tm = TOKENS

    @T.prim_func(private=True)
    def kernel(var_aq: T.handle, var_ad: T.handle, var_off: T.handle, w: T.Buffer((n, nb, 16), "uint8"),
               ws: T.Buffer((n, nb), "float32"), var_y: T.handle):
        T.func_attr({"tir.noalias": True, "op_pattern": 8})  # opaque: FuseOps leaves it whole
        m = T.int64()
        aq = T.match_buffer(var_aq, (m, nb, 32), "int8")
        ad = T.match_buffer(var_ad, (m, nb), "float32")
        off = T.match_buffer(var_off, (m, nb), "float32")
        y = T.match_buffer(var_y, (m, n), "float32")
        for jo in T.parallel(n // rows):
            for it in range(m // tm):
                acc = T.decl_buffer((pairs * tm * 8,), "float32", scope="local")
                for pt in T.unroll(pairs * tm):
                    acc[T.ramp(pt * 8, 1, 8)] = T.broadcast(T.float32(0), 8)
                for b in range(nb):
                    for p in T.unroll(pairs):
                        for t in T.unroll(tm):
                            acc[T.ramp((p * tm + t) * 8, 1, 8)] = acc[T.ramp((p * tm + t) * 8, 1, 8)] + _pair_dot(
                                T, w, aq, off, ws, ad, jo * rows + 2 * p, b, it * tm + t)
                for p in T.unroll(pairs):
                    for t in T.unroll(tm):
                        y[it * tm + t, jo * rows + 2 * p] = T.call_llvm_pure_intrin(
                            "float32", "llvm.vector.reduce.fadd.v4f32", T.float32(0), acc[T.ramp((p * tm + t) * 8, 1, 4)])
                        y[it * tm + t, jo * rows + 2 * p + 1] = T.call_llvm_pure_intrin(
                            "float32", "llvm.vector.reduce.fadd.v4f32", T.float32(0),
                            acc[T.ramp((p * tm + t) * 8 + 4, 1, 4)])
            for i in range(m // tm * tm, m):
                acc1 = T.decl_buffer((pairs * 8,), "float32", scope="local")
                for p in T.unroll(pairs):
                    acc1[T.ramp(p * 8, 1, 8)] = T.broadcast(T.float32(0), 8)
                for b in range(nb):
                    for p in T.unroll(pairs):
                        acc1[T.ramp(p * 8, 1, 8)] = acc1[T.ramp(p * 8, 1, 8)] + _pair_dot(
                            T, w, aq, off, ws, ad, jo * rows + 2 * p, b, i)
                for p in T.unroll(pairs):
                    y[i, jo * rows + 2 * p] = T.call_llvm_pure_intrin(
                        "float32", "llvm.vector.reduce.fadd.v4f32", T.float32(0), acc1[T.ramp(p * 8, 1, 4)])
                    y[i, jo * rows + 2 * p + 1] = T.call_llvm_pure_intrin(
                        "float32", "llvm.vector.reduce.fadd.v4f32", T.float32(0), acc1[T.ramp(p * 8 + 4, 1, 4)])

    return kernel
