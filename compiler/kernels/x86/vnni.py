"""W4A8 block dot products with AVX-512 VNNI `vpdpbusd` (256-bit form, AVX512VL).

vpdpbusd multiplies unsigned bytes by signed bytes. The weight nibbles q (0..15) are the
unsigned operand as they are and the int8 activations the signed one, so the activations need
no offset: dot(q - 8, a) = dot(q, a) - 8 * sum(a), with sum(a) computed once per activation
block (`act_quant.block_offsets`) and shared by every row.

Per block and row: one 16-byte weight load split into [low nibbles | high nibbles] = 32
unsigned bytes (even elements, then odd: the de-interleaved activation layout), one vpdpbusd
against the 32-byte activation block, converted to fp32 and accumulated lane-wise with the two
block scales (each of the 8 lanes subtracts sum(a) once: 8 * sum(a) in all). One horizontal add
per row at the end. A task handles ROWS rows so each activation load serves several rows and
the accumulators are independent (measured: 8 rows ~1.4x one row; a 512-bit two-row form was
no faster).
"""

from __future__ import annotations

OFFSET_ZERO_POINT = 1  # block_offsets(zero_point=1): each lane subtracts sum(a)


def rows_per_task(n: int) -> int:
    return next(r for r in (8, 4, 2, 1) if n % r == 0)


def q4_dot(n: int, nb: int):
    from tvm.script import tirx as T

    dpbusd = "llvm.x86.avx512.vpdpbusd.256"
    rows = rows_per_task(n)

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
                acc = T.decl_buffer((rows * 8,), "float32", scope="local")
                for r in T.unroll(rows):
                    acc[T.ramp(r * 8, 1, 8)] = T.broadcast(T.float32(0), 8)
                for b in range(nb):
                    for r in T.unroll(rows):
                        acc[T.ramp(r * 8, 1, 8)] = acc[T.ramp(r * 8, 1, 8)] + (T.Cast("float32x8", T.call_llvm_pure_intrin(
                            "int32x8", dpbusd, T.broadcast(T.int32(0), 8),
                            T.vectorcombine("uint8x32",
                                            w.vload([jo * rows + r, b, 0], "uint8x16") & T.broadcast(T.uint8(15), 16),
                                            w.vload([jo * rows + r, b, 0], "uint8x16") >> T.broadcast(T.uint8(4), 16)),
                            aq.vload([i, b, 0], "int8x32"))) - T.broadcast(off[i, b], 8)) \
                            * T.broadcast(ws[jo * rows + r, b] * ad[i, b], 8)
                for r in T.unroll(rows):
                    y[i, jo * rows + r] = T.call_llvm_pure_intrin(
                        "float32", "llvm.vector.reduce.fadd.v8f32", T.float32(0), acc[T.ramp(r * 8, 1, 8)])

    return kernel


TOKENS = 4  # tokens per GEMM tile: each unpacked weight vector serves this many dpbusd


def q4_gemm(n: int, nb: int):
    """The prefill form: tiles of TOKENS tokens x rows, so each 16-byte weight block is
    unpacked once and used for TOKENS activation blocks; leftover tokens go one at a time."""
    from tvm.script import tirx as T

    dpbusd = "llvm.x86.avx512.vpdpbusd.256"
    rows = next(r for r in (4, 2, 1) if n % r == 0)
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
                acc = T.decl_buffer((rows * tm * 8,), "float32", scope="local")
                for rt in T.unroll(rows * tm):
                    acc[T.ramp(rt * 8, 1, 8)] = T.broadcast(T.float32(0), 8)
                for b in range(nb):
                    for r in T.unroll(rows):
                        for t in T.unroll(tm):
                            acc[T.ramp((r * tm + t) * 8, 1, 8)] = acc[T.ramp((r * tm + t) * 8, 1, 8)] + (
                                T.Cast("float32x8", T.call_llvm_pure_intrin(
                                    "int32x8", dpbusd, T.broadcast(T.int32(0), 8),
                                    T.vectorcombine("uint8x32",
                                                    w.vload([jo * rows + r, b, 0], "uint8x16") & T.broadcast(T.uint8(15), 16),
                                                    w.vload([jo * rows + r, b, 0], "uint8x16") >> T.broadcast(T.uint8(4), 16)),
                                    aq.vload([it * tm + t, b, 0], "int8x32")))
                                - T.broadcast(off[it * tm + t, b], 8)) * T.broadcast(ws[jo * rows + r, b] * ad[it * tm + t, b], 8)
                for r in T.unroll(rows):
                    for t in T.unroll(tm):
                        y[it * tm + t, jo * rows + r] = T.call_llvm_pure_intrin(
                            "float32", "llvm.vector.reduce.fadd.v8f32", T.float32(0), acc[T.ramp((r * tm + t) * 8, 1, 8)])
            for i in range(m // tm * tm, m):
                acc1 = T.decl_buffer((rows * 8,), "float32", scope="local")
                for r in T.unroll(rows):
                    acc1[T.ramp(r * 8, 1, 8)] = T.broadcast(T.float32(0), 8)
                for b in range(nb):
                    for r in T.unroll(rows):
                        acc1[T.ramp(r * 8, 1, 8)] = acc1[T.ramp(r * 8, 1, 8)] + (T.Cast("float32x8", T.call_llvm_pure_intrin(
                            "int32x8", dpbusd, T.broadcast(T.int32(0), 8),
                            T.vectorcombine("uint8x32",
                                            w.vload([jo * rows + r, b, 0], "uint8x16") & T.broadcast(T.uint8(15), 16),
                                            w.vload([jo * rows + r, b, 0], "uint8x16") >> T.broadcast(T.uint8(4), 16)),
                            aq.vload([i, b, 0], "int8x32"))) - T.broadcast(off[i, b], 8)) \
                            * T.broadcast(ws[jo * rows + r, b] * ad[i, b], 8)
                for r in T.unroll(rows):
                    y[i, jo * rows + r] = T.call_llvm_pure_intrin(
                        "float32", "llvm.vector.reduce.fadd.v8f32", T.float32(0), acc1[T.ramp(r * 8, 1, 8)])

    return kernel
