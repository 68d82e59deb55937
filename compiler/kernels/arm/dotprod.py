"""W4A8 Q4_0 matmul with NEON `sdot` (Armv8.2 dotprod; Neoverse-N2 has it), one 32-bit lane
per output row.

The weights come in the row-group layout (kernels/row_groups.py): each 64-byte chunk holds 4
bytes of each of 16 rows, i.e. four 128-bit vectors of 4 rows each. With one 4-byte
activation group broadcast to every lane, one sdot advances 4 rows by 4 weights; a block is 8
sdot per 4 rows and token, whose int32 lanes are then the 4 rows' block dots: one convert and
one FMA with the 4 rows' scales, no horizontal sums (the form this replaced spent an `addv`
and scalar scale arithmetic per row and block).

The nibbles q (0..15) are valid signed bytes, so as on x86 the dot is taken with q itself and
the quantizer's -8 x sum(a) per block starts the accumulation: no per-vector subtraction.
Each task is one group; its four 4-row slices run one after another so a tile's accumulators
and unpacked weights fit the 32 vector registers.
"""

from __future__ import annotations

import functools

from tvm import tirx

from ..row_groups import ROWS, groups

ZERO_POINT = -8
LANES = 4          # int32 lanes of a 128-bit vector: rows per slice
DEFAULTS = {"tokens": 4}


def _slice_dot(T, w, aq, off, g, b, q, t):
    """int32x4: rows 16g+4q .. +3, block b, token t (one expression: named temporaries would
    become per-thread allocations inside the parallel loop); two chains halve the latency."""
    sdot = "llvm.aarch64.neon.sdot.v4i32.v16i8"

    def act(j):   # activation bytes 4j..4j+3 in every lane
        return T.reinterpret("int8x16", T.broadcast(T.reinterpret("int32", aq.vload([t, b, 4 * j], "int8x4")), 4))

    def nib(i, high):
        v = w.vload([g, b, i, 16 * q], "uint8x16")
        return T.reinterpret("int8x16", (v >> T.broadcast(T.uint8(4), 16)) if high else (v & T.broadcast(T.uint8(15), 16)))

    lo = T.broadcast(T.Cast("int32", off[t, b]), 4)
    hi = T.broadcast(T.int32(0), 4)
    for i in range(4):
        lo = T.call_llvm_pure_intrin("int32x4", sdot, lo, nib(i, False), act(i))
        hi = T.call_llvm_pure_intrin("int32x4", sdot, hi, nib(i, True), act(4 + i))
    return lo + hi


@functools.cache   # a model asks for the same kernel per layer; TVMScript parsing is slow
def q4_dot(n: int, nb: int, decode: bool, scale_dtype: str = "float16", tokens: int | None = None,
           m: int | None = None):
    """y [M, N] from the de-interleaved int8 activations (aq, their scales ad, the -8 x sum
    offsets) and the row-group weights; M any, or `m` (tuning measures at fixed M)."""
    from tvm.script import tirx as T

    ng = groups(n)
    tm = 1 if decode else (tokens or DEFAULTS["tokens"])
    ragged = n % ROWS != 0
    rows_in = tirx.Var("m", "int64") if m is None else m

    def scales(ws, g, b, q):
        if scale_dtype == "float16":
            return T.Cast("float32x4", ws.vload([g, b, LANES * q], "float16x4"))
        return ws.vload([g, b, LANES * q], "float32x4")

    @T.macro
    def tile(w, aq, off, ws, ad, y, g, q, first, count):
        """Rows 16g+4q .. +3 of tokens first .. first+count-1."""
        acc = T.decl_buffer((count * LANES,), "float32", scope="global")  # a stack slot: see kernels/x86/vnni.py
        for t in T.unroll(count):
            acc[T.ramp(t * LANES, 1, LANES)] = T.broadcast(T.float32(0), LANES)
        for b in range(nb):
            for t in T.unroll(count):
                acc[T.ramp(t * LANES, 1, LANES)] = acc[T.ramp(t * LANES, 1, LANES)] + T.Cast(
                    "float32x4", _slice_dot(T, w, aq, off, g, b, q, first + t)) * (
                    scales(ws, g, b, q) * T.broadcast(ad[first + t, b], LANES))
        for t in T.unroll(count):
            if not ragged or g * ROWS + LANES * q + LANES <= n:
                y[first + t, T.ramp(g * ROWS + LANES * q, 1, LANES)] = acc[T.ramp(t * LANES, 1, LANES)]
            else:
                for r in range(LANES):
                    if g * ROWS + LANES * q + r < n:
                        y[first + t, g * ROWS + LANES * q + r] = acc[t * LANES + r]

    @T.prim_func(private=True, check_well_formed=False)   # the named root block (as in act_quant)
    def kernel(var_aq: T.handle, var_ad: T.handle, var_off: T.handle, w: T.Buffer((ng, nb, 4, 4 * ROWS), "uint8"),
               ws: T.Buffer((ng, nb, ROWS), scale_dtype), var_y: T.handle):
        T.func_attr({"tir.noalias": True, "op_pattern": 8})  # opaque: FuseOps leaves it whole
        aq = T.match_buffer(var_aq, (rows_in, nb, 32), "int8")
        ad = T.match_buffer(var_ad, (rows_in, nb), "float32")
        off = T.match_buffer(var_off, (rows_in, nb), "float32")
        y = T.match_buffer(var_y, (rows_in, n), "float32")
        with T.sblock("root"):   # named, so a tuning trace can annotate it (compiler/tuning.py)
            for g in T.parallel(ng):
                for q in range(ROWS // LANES):
                    for it in range(rows_in // tm):
                        tile(w, aq, off, ws, ad, y, g, q, it * tm, tm)
                    if tm > 1:  # decided when the kernel is built: decode has no leftover tokens
                        for i in range(rows_in // tm * tm, rows_in):
                            tile(w, aq, off, ws, ad, y, g, q, i, 1)

    return kernel
