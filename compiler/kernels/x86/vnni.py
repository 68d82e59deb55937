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


TOKENS = 4  # tokens per prefill tile: each combined weight vector serves this many tokens


def q4_matmul(n: int, nb: int, decode: bool):
    """y [M, N] from the de-interleaved int8 activations and Q4_0 weights. Two rows share one
    256-bit vector, [row r's 16 bytes | row r+1's]: its low nibbles dot the duplicated even
    activation half, its high nibbles the duplicated odd half, both into one int32x8 (lanes 0-3
    row r, 4-7 row r+1): two vpdpbusd, one convert, one fused scale per row pair and block. Each
    lane subtracts OFFSET x sum(a).

    decode (one token): 4 row pairs per task (measured ~1.3x the one-row-per-vector form from
    cache; DRAM-bound shapes the same). prefill: tiles of 2 row pairs x TOKENS tokens, so each
    weight vector is split once and used for TOKENS tokens; leftover tokens one at a time."""
    from tvm.script import tirx as T

    pairs = next(p for p in ((4, 2, 1) if decode else (2, 1)) if n % (2 * p) == 0)
    rows = 2 * pairs
    tm = 1 if decode else TOKENS

    @T.macro
    def tile(w, aq, off, ws, ad, y, jo, first, tokens):
        """Rows jo*rows .. +rows of tokens first .. first+tokens-1."""
        acc = T.decl_buffer((pairs * tokens * 8,), "float32", scope="local")
        for pt in T.unroll(pairs * tokens):
            acc[T.ramp(pt * 8, 1, 8)] = T.broadcast(T.float32(0), 8)
        for b in range(nb):
            for p in T.unroll(pairs):
                for t in T.unroll(tokens):
                    acc[T.ramp((p * tokens + t) * 8, 1, 8)] = acc[T.ramp((p * tokens + t) * 8, 1, 8)] + _pair_dot(
                        T, w, aq, off, ws, ad, jo * rows + 2 * p, b, first + t)
        for p in T.unroll(pairs):
            for t in T.unroll(tokens):
                y[first + t, jo * rows + 2 * p] = T.call_llvm_pure_intrin(
                    "float32", "llvm.vector.reduce.fadd.v4f32", T.float32(0), acc[T.ramp((p * tokens + t) * 8, 1, 4)])
                y[first + t, jo * rows + 2 * p + 1] = T.call_llvm_pure_intrin(
                    "float32", "llvm.vector.reduce.fadd.v4f32", T.float32(0),
                    acc[T.ramp((p * tokens + t) * 8 + 4, 1, 4)])

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
                tile(w, aq, off, ws, ad, y, jo, it * tm, tm)
            if tm > 1:  # decided when the kernel is built: decode has no leftover tokens
                for i in range(m // tm * tm, m):
                    tile(w, aq, off, ws, ad, y, jo, i, 1)

    return kernel
