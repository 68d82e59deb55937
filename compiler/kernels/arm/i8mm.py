"""W4A8 prefill GEMM with the Armv8.6 I8MM `smmla` (arm-yitian), on the same row-group
weights as the sdot kernels (kernels/row_groups.py).

smmla multiplies a 2x8 int8 matrix by an 8x2 one into a 2x2 int32 tile: lane 2i + j gets
sum_k A[i, k] * B[j, k]. A holds two tokens' activations (8 bytes each), B two rows' weights:
one instruction does 32 multiply-adds, twice an sdot's, and covers two tokens at once. TVM
ships no smmla intrinsic; the kernel calls LLVM's `llvm.aarch64.neon.smmla` directly.

The row-group chunk i holds 4 bytes of each of 4 rows per 128-bit vector; zipping the 32-bit
lanes of chunks i and i+1 gives rows r, r+1 with 8 consecutive bytes each, which meet the
activation bytes 8i'..8i'+7 (i' = i / 2) of the de-interleaved block, low nibbles against the
even half and high nibbles against the odd half. A block is then 4 smmla per row pair and token
pair, with the -8 x sum(a) offsets starting the accumulation as in the sdot kernel. Decode (one
token) stays on sdot: smmla would waste half its work.
"""

from __future__ import annotations

import functools

from tvm import tirx

from ..row_groups import ROWS, groups

ZERO_POINT = -8
LANES = 4          # rows per 128-bit slice of a chunk
DEFAULTS = {"tokens": 4}   # tokens per tile (pairs of two): the tile's unpacked weights serve them all


def _pair_dot(T, w, aq, off, g, b, q, t0, t1, half):
    """int32x4 [t0·ra, t0·rb, t1·ra, t1·rb] for rows (ra, rb) = 16g + 4q + 2·half + (0, 1),
    block b (one expression: named temporaries would become per-thread allocations)."""
    mmla = "llvm.aarch64.neon.smmla.v4i32.v16i8"

    def nib(i, high):
        v = w.vload([g, b, i, 16 * q], "uint8x16")
        return T.reinterpret("int32x4", (v >> T.broadcast(T.uint8(4), 16)) if high else (v & T.broadcast(T.uint8(15), 16)))

    assert half in (0, 1)   # a Python int: it picks the zip pattern

    def rows(i, high):   # zip the 32-bit lanes of chunks i, i+1: rows 2·half, 2·half+1, 8 bytes each
        idx = [0, 4, 1, 5] if half == 0 else [2, 6, 3, 7]
        return T.reinterpret("int8x16", T.Shuffle([nib(i, high), nib(i + 1, high)], idx))

    def act(k):          # two tokens' activation bytes 8k .. 8k+7
        return T.vectorcombine("int8x16", aq.vload([t0, b, 8 * k], "int8x8"), aq.vload([t1, b, 8 * k], "int8x8"))

    x = T.vectorcombine("int32x4", T.broadcast(T.Cast("int32", off[t0, b]), 2), T.broadcast(T.Cast("int32", off[t1, b]), 2))
    for k, (i, high) in enumerate(((0, False), (2, False), (0, True), (2, True))):
        x = T.call_llvm_pure_intrin("int32x4", mmla, x, act(k), rows(i, high))
    return x


def _pair_update(T, w, aq, off, ws, ad, g, b, q, t0, t1, half):
    """float32x4: block b's contribution to [t0·ra, t0·rb, t1·ra, t1·rb]: the pair dot times
    [ws ra·ad t0, ws rb·ad t0, ws ra·ad t1, ws rb·ad t1]."""
    r = LANES * q + 2 * half
    if ws.dtype == "float16":
        pair = T.Cast("float32x2", ws.vload([g, b, r], "float16x2"))
    else:
        pair = ws.vload([g, b, r], "float32x2")
    scale = T.vectorcombine("float32x4", pair, pair) * T.vectorcombine(
        "float32x4", T.broadcast(ad[t0, b], 2), T.broadcast(ad[t1, b], 2))
    return T.Cast("float32x4", _pair_dot(T, w, aq, off, g, b, q, t0, t1, half)) * scale


@functools.cache   # a model asks for the same kernel per layer; TVMScript parsing is slow
def q4_gemm(n: int, nb: int, scale_dtype: str = "float16", tokens: int | None = None, m: int | None = None):
    """y [M, N] (M >= 1, any, or `m` for tuning) from the de-interleaved int8 activations and
    the row-group weights, in tiles of `tokens` (even) tokens."""
    from tvm.script import tirx as T

    ng = groups(n)
    ragged = n % ROWS != 0
    pairs_per_tile = max(1, (tokens or DEFAULTS["tokens"]) // 2)
    rows_in = tirx.Var("m", "int64") if m is None else m

    @T.macro
    def tile(w, aq, off, ws, ad, y, g, q, first, pairs, single):
        """Rows 16g+4q .. +3 of `pairs` token pairs from `first` (single: one token, computed
        as a pair with itself, stored once)."""
        acc = T.decl_buffer((pairs * 8,), "float32", scope="global")  # a stack slot: see kernels/x86/vnni.py
        for p in T.unroll(pairs * 2):
            acc[T.ramp(p * 4, 1, 4)] = T.broadcast(T.float32(0), 4)
        for b in range(nb):
            for p in T.unroll(pairs):
                # The two row pairs written out: the zip pattern must be a Python constant (a
                # loop variable's `h == 0` would not be).
                acc[T.ramp(8 * p, 1, 4)] = acc[T.ramp(8 * p, 1, 4)] + _pair_update(
                    T, w, aq, off, ws, ad, g, b, q, first + 2 * p, first + 2 * p + (0 if single else 1), 0)
                acc[T.ramp(8 * p + 4, 1, 4)] = acc[T.ramp(8 * p + 4, 1, 4)] + _pair_update(
                    T, w, aq, off, ws, ad, g, b, q, first + 2 * p, first + 2 * p + (0 if single else 1), 1)
        for p in T.unroll(pairs):
            for tt in T.unroll(1 if single else 2):
                for h in T.unroll(2):
                    for j in T.unroll(2):
                        if not ragged or g * ROWS + LANES * q + 2 * h + j < n:
                            y[first + 2 * p + tt, g * ROWS + LANES * q + 2 * h + j] = acc[(2 * p + h) * 4 + 2 * tt + j]

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
                    for it in range(rows_in // (2 * pairs_per_tile)):
                        tile(w, aq, off, ws, ad, y, g, q, it * 2 * pairs_per_tile, pairs_per_tile, False)
                    for ip in range(rows_in // (2 * pairs_per_tile) * pairs_per_tile, rows_in // 2):
                        tile(w, aq, off, ws, ad, y, g, q, ip * 2, 1, False)
                    if rows_in % 2 == 1:
                        tile(w, aq, off, ws, ad, y, g, q, rows_in - 1, 1, True)

    return kernel
