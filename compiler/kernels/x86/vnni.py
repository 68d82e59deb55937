"""W4A8 Q4_0 matmul with AVX-512 VNNI `vpdpbusd`, one 32-bit lane per output row.

The weights come in the row-group layout (kernels/row_groups.py), so a 512-bit chunk holds 4
bytes of each of 16 rows: with one 4-byte activation group broadcast to every lane (an
embedded-broadcast memory operand), one vpdpbusd advances the 16 rows by 4 weights. A block is
8 vpdpbusd per token and group; its int32 lanes are then the 16 rows' block dots: one convert
and one FMA with the 16 rows' scales, no horizontal sums, and a contiguous 16-float store.

vpdpbusd multiplies unsigned by signed bytes: the nibbles q (0..15) are the unsigned operand as
they are, and dot(q - 8, a) = dot(q, a) - 8 * sum(a); the quantizer supplies -8 * sum(a) per
block, which starts the accumulation.

Prefill runs tiles of `tokens` tokens over a group, so each unpacked weight vector serves all
of them and the group's weights (nb x 256 bytes: 39 KiB at K = 4864) stay in L1/L2. This
replaced a two-rows-per-vector form with a horizontal sum per row: 1.75x on pp512 and 1.5x
on decode for the 0.5B shape (docs/design.md).
"""

from __future__ import annotations

import functools

from tvm import tirx

from ..row_groups import ROWS, groups

ZERO_POINT = -8    # the quantizer's per-block offset factor: the accumulation starts at -8 x sum(a)

# The schedule's knob: tokens per prefill tile (the hand value; decode is always 1).
DEFAULTS = {"tokens": 4}

# Decode prefetches the weights twice: 8 blocks (2 KiB) ahead into L1 and 32 blocks (8 KiB)
# ahead into L2 (prefetcht1). A GEMV's weights always come from DRAM, and the hardware
# streamer stops at every 4 KiB page and restarts slowly; the far L2 prefetch keeps enough
# misses in flight across those restarts. Decode step, 0.5B shape: L1 only (6 blocks) 62-69
# tok/s, L2 only (32) 72-89, both 83-90 (docs/design.md). Non-temporal was 40% worse;
# prefetching the scale stream too cost 10%.
PREFETCH = ((8, 3), (32, 2))   # (blocks ahead, LLVM locality: 3 = L1, 2 = L2)
# Decode reads STREAMS far-apart row groups in lockstep, block by block: each thread then has
# STREAMS sequential streams in flight whose page crossings fall at different times, so one
# restarting stream no longer idles the memory pipe. Weight GB/s in a decode-like stream of
# distinct weights: 4864x896 28 -> 31, 896x4864 27 -> 30, lm_head 32 -> 35; 8 streams were
# slower (docs/design.md). A plain read of memory gains the same way (bench/gemv.py).
STREAMS = 4


def _block_dot(T, w, aq, off, g, b, t):
    """int32x16: the 16 rows' dot(q - 8, a) for block b and token t, as one expression (named
    temporaries would become per-thread allocations inside the parallel loop). Two chains
    (low and high nibbles) halve the dependent vpdpbusd latency."""
    dp = "llvm.x86.avx512.vpdpbusd.512"

    def act(j):   # activation bytes 4j..4j+3 in every lane
        return T.reinterpret("int8x64", T.broadcast(T.reinterpret("int32", aq.vload([t, b, 4 * j], "int8x4")), 16))

    lo = T.broadcast(T.Cast("int32", off[t, b]), 16)
    hi = T.broadcast(T.int32(0), 16)
    for i in range(4):
        lo = T.call_llvm_pure_intrin("int32x16", dp, lo, w.vload([g, b, i, 0], "uint8x64") & T.broadcast(T.uint8(15), 64), act(i))
        hi = T.call_llvm_pure_intrin("int32x16", dp, hi, w.vload([g, b, i, 0], "uint8x64") >> T.broadcast(T.uint8(4), 64), act(4 + i))
    return lo + hi


@functools.cache   # a model asks for the same kernel per layer; TVMScript parsing is slow
def q4_matmul(n: int, nb: int, decode: bool, scale_dtype: str = "float16", tokens: int | None = None,
              m: int | None = None):
    """y [M, N] from the de-interleaved int8 activations (aq, their scales ad, the -8 x sum
    offsets) and the packed weights. decode: one token; prefill: tiles of `tokens` tokens,
    leftovers one at a time. M is any number of tokens, or `m` (tuning measures at fixed M)."""
    from tvm.script import tirx as T

    ng = groups(n)
    tm = 1 if decode else (tokens or DEFAULTS["tokens"])
    rows_in = tirx.Var("m", "int64") if m is None else m   # tokens: any, or fixed for tuning
    ragged = n % ROWS != 0

    def scales(ws, g, b):
        if scale_dtype == "float16":
            return T.Cast("float32x16", ws.vload([g, b, 0], "float16x16"))
        return ws.vload([g, b, 0], "float32x16")

    def prefetch(T, w, g, b):
        """Prefetch block b + ahead of group g for each PREFETCH distance: past the group's
        last block this is the next groups' data, which this thread reads next (past the
        buffer, a prefetch does not fault)."""
        for ahead, locality in PREFETCH:
            for i in range(4):
                T.evaluate(T.call_llvm_intrin("void", "llvm.prefetch.p0", T.address_of(w[g, b + ahead, i, 0]),
                                              T.int32(0), T.int32(locality), T.int32(1)))   # read, data

    @T.macro
    def tile(w, aq, off, ws, ad, y, g, first, count):
        """Rows 16g .. 16g+15 of tokens first .. first+count-1."""
        # "global", not "local": TVM places small constant-size global allocations on the stack
        # (LLVM then keeps them in registers) but serves every "local" one with a
        # TVMBackendAllocWorkspace call, here once per 16-row group.
        acc = T.decl_buffer((count * ROWS,), "float32", scope="global")
        for t in T.unroll(count):
            acc[T.ramp(t * ROWS, 1, ROWS)] = T.broadcast(T.float32(0), ROWS)
        for b in range(nb):
            if decode:   # prefill re-reads a group's weights per tile: they are in cache
                prefetch(T, w, g, b)
            for t in T.unroll(count):
                acc[T.ramp(t * ROWS, 1, ROWS)] = acc[T.ramp(t * ROWS, 1, ROWS)] + T.Cast(
                    "float32x16", _block_dot(T, w, aq, off, g, b, first + t)) * (
                    scales(ws, g, b) * T.broadcast(ad[first + t, b], ROWS))
        for t in T.unroll(count):
            if not ragged or g * ROWS + ROWS <= n:
                y[first + t, T.ramp(g * ROWS, 1, ROWS)] = acc[T.ramp(t * ROWS, 1, ROWS)]
            else:
                for r in range(ROWS):
                    if g * ROWS + r < n:
                        y[first + t, g * ROWS + r] = acc[t * ROWS + r]

    full = n // ROWS                 # groups without padding rows
    per = full // STREAMS if decode else 0   # decode: groups per stream (task p reads p, per + p, ...)

    @T.macro
    def streams(w, aq, off, ws, ad, y, p):
        """Decode rows of the STREAMS groups p, per + p, 2 per + p, ... (each a stream: past
        a group's last block, the prefetch reaches the same stream's next group, p + 1)."""
        acc = T.decl_buffer((STREAMS * ROWS,), "float32", scope="global")
        for h in T.unroll(STREAMS):
            acc[T.ramp(h * ROWS, 1, ROWS)] = T.broadcast(T.float32(0), ROWS)
        for b in range(nb):
            for h in T.unroll(STREAMS):
                prefetch(T, w, h * per + p, b)
            for h in T.unroll(STREAMS):
                acc[T.ramp(h * ROWS, 1, ROWS)] = acc[T.ramp(h * ROWS, 1, ROWS)] + T.Cast(
                    "float32x16", _block_dot(T, w, aq, off, h * per + p, b, 0)) * (
                    scales(ws, h * per + p, b) * T.broadcast(ad[0, b], ROWS))
        for h in T.unroll(STREAMS):
            y[0, T.ramp((h * per + p) * ROWS, 1, ROWS)] = acc[T.ramp(h * ROWS, 1, ROWS)]

    @T.prim_func(private=True, check_well_formed=False)   # the named root block (as in act_quant)
    def kernel(var_aq: T.handle, var_ad: T.handle, var_off: T.handle, w: T.Buffer((ng, nb, 4, 4 * ROWS), "uint8"),
               ws: T.Buffer((ng, nb, ROWS), scale_dtype), var_y: T.handle):
        T.func_attr({"tir.noalias": True, "op_pattern": 8})  # opaque: FuseOps leaves it whole
        aq = T.match_buffer(var_aq, (rows_in, nb, 32), "int8")
        ad = T.match_buffer(var_ad, (rows_in, nb), "float32")
        off = T.match_buffer(var_off, (rows_in, nb), "float32")
        y = T.match_buffer(var_y, (rows_in, n), "float32")
        with T.sblock("root"):   # named, so a tuning trace can annotate it (compiler/tuning.py)
            # Decode: tasks 0 .. per-1 read STREAMS groups each; the last task takes the groups
            # left over (fewer than STREAMS, and a ragged last one) one at a time. Prefill:
            # one task per group.
            for task in T.parallel(per + (ng - per * STREAMS > 0) if decode else ng):
                if decode and task < per:
                    streams(w, aq, off, ws, ad, y, task)
                elif decode:
                    for g in range(per * STREAMS, ng):
                        tile(w, aq, off, ws, ad, y, g, 0, 1)
                else:
                    for it in range(rows_in // tm):
                        tile(w, aq, off, ws, ad, y, task, it * tm, tm)
                    if tm > 1:  # decided when the kernel is built
                        for i in range(rows_in // tm * tm, rows_in):
                            tile(w, aq, off, ws, ad, y, task, i, 1)

    return kernel
