"""llama.cpp's Q6_K weights on AVX-512 VNNI, exactly: w = d sc (q - 32), one int8 scale sc a
sub-block of 16 weights and one float d a super-block of 256.

The codes q (0..63) follow the W8A8 row-group order (row_groups.pack_int8: 8 chunks of 64 bytes
a 32-block, chunk c meeting activation bytes 4c..4c+3 of the de-interleaved block) at six bits
(compiler/repack_q6_k.py: six_bit_codes): 6 chunks a block, four of nibbles (chunk c's low four
bits, chunk c + 4's in the high nibble) and two of the top two bits of four chunks each.
`codes` rebuilds a chunk in three or four logic ops; vpdpbusd takes q unsigned, and
dot(q - 32, a) = dot(q, a) - 32 x sum(a). A 32-block holds two sub-blocks: elements 0-15 (A) and
16-31 (B). In the de-interleaved order A is positions 0-7 (its even elements) and 16-23 (its
odd ones), so chunks 0, 1, 4 and 5; B is chunks 2, 3, 6 and 7. Each sub-block is its own chain
of four vpdpbusd, started from -32 x its activations' sum (q6_k_starts: the quantizer gives
only the block's). The two sums (exact integers, at most 16 x 32 x 127 each) are converted and
scaled by their sub-blocks' d sc, then by the activations' scale (`term`).

Scales: sc [G, NB, 32] int8 (A's 16 rows, then B's), d [G, NB/8, 16] float32 per super-block
(models/gguf_blocks.py: q6_k_factors): 6.625 bits a weight against the file's 6.5625. (Codes
as bytes, which vpdpbusd reads with nothing to rebuild, were 8.625: decode reads every weight
from DRAM, so the bytes it saves outweigh the logic ops; docs/history/weight-formats.md.)

One kernel serves prefill and decode. Prefill: a task per row group, tiles of TOKENS tokens
(leftovers one at a time) over all of the group's blocks. One token (decode): STREAMS row
groups a task in lockstep, prefetched PREFETCH blocks ahead, as the Q8_0 decode GEMV reads
(x86/vnni.py); a lone group a task was slower than the Q8_0 GEMV on a 7B's output
(bench/q6_k.py).
"""

from __future__ import annotations

from functools import partial

from .. import SCHEDULED, task_claims
from ..kernel_cache import cached_kernel
from ..row_groups import ROWS, groups
from ..w4a8 import store_rows, token_count

SUB = 16            # Q6_K's sub-block
SUPER_BLOCKS = 8    # 32-blocks a super-block of 256
TOKENS = 8          # a prefill tile: 8 accumulators and 16 integer chains (nearer Q8_0's time than 4: bench/q6_k.py)
PREFETCH = 4        # blocks ahead a decode token's weights are prefetched into L1
STREAMS = 4         # row groups a decode task reads in lockstep (x86/vnni.py's STREAMS)
VPDPBUSD = "llvm.x86.avx512.vpdpbusd.512"
CHUNKS = 6          # 64-byte chunks a block of six-bit codes (compiler/repack_q6_k.py: six_bit_codes)
BYTE_CHUNKS = 8     # ... and of a prefill group's copy rebuilt as bytes (the W8A8 row groups')
ZERO_POINT = 32     # q - 32: each chain starts from -32 x its activations' sum


def _chunk(i, sub_b: bool):
    """The i-th (0..3) 64-byte chunk of sub-block A (0, 1, 4, 5) or B (2, 3, 6, 7)."""
    return i % 2 + (i // 2) * 4 + (2 if sub_b else 0)


def codes(T, w, g, b, c):
    """uint8x64: chunk c (0..7, a loop variable the loops unroll) of block b's codes q for the
    16 rows of group g. From the six-bit form: the low four bits from nibble chunk c % 4 (its
    low nibble for c < 4, else its high one), the top two from bits 2 (c % 4) .. of chunk
    4 + c // 4, moved to bits 4-5; once c is a constant LLVM folds the shifts and masks into
    one shift and one mask each (byte shifts: it shifts 16-bit lanes and masks what crosses
    a byte). From a prefill group's copy rebuilt as bytes (BYTE_CHUNKS a block): as it is."""
    if int(w.shape[2]) == BYTE_CHUNKS:
        return w.vload([g, b, c, 0], "uint8x64")

    def shifted(v, right, mask):
        return (v >> T.broadcast(T.Cast("uint8", right), 64)) & T.broadcast(T.uint8(mask), 64)

    low = shifted(w.vload([g, b, c % 4, 0], "uint8x64"), 4 * (c // 4), 15)
    top = shifted(w.vload([g, b, 4 + c // 4, 0], "uint8x64"), 2 * (c % 4), 3)
    return low | (top << T.broadcast(T.uint8(4), 64))


@cached_kernel   # the same kernel every layer and every compile (kernel_cache.py)
def q6_k_starts(nb: int, one_row: bool):
    """(aq [M, NB, 32] int8, off [M, NB] int32: the quantizer's -8 x block sum) -> st [M, NB, 2]
    int32: where sub-block A's and B's vpdpbusd chains start, -32 x the sum of each one's
    activation codes (A: de-interleaved positions 0-7 and 16-23). `one_row` (decode) runs
    serially: a launch of the thread pool would cost more than the 16 adds a block."""
    from tvm.script import tirx as T

    rows = T.int64()

    @T.macro
    def row(aq, off, st, i):
        for b in range(nb):
            a = T.call_llvm_pure_intrin("int32", "llvm.vector.reduce.add.v8i32",
                                        T.Cast("int32x8", aq.vload([i, b, 0], "int8x8"))
                                        + T.Cast("int32x8", aq.vload([i, b, 16], "int8x8")))
            st[i, b, 0] = a * T.int32(-ZERO_POINT)
            st[i, b, 1] = off[i, b] * T.int32(ZERO_POINT // 8) + a * T.int32(ZERO_POINT)   # off: -8 x the block's sum

    @T.prim_func(private=True)
    def kernel(var_aq: T.handle, var_off: T.handle, var_st: T.handle):
        T.func_attr({"tir.noalias": True, "op_pattern": 8, SCHEDULED: True})
        aq = T.match_buffer(var_aq, (rows, nb, 32), "int8")
        off = T.match_buffer(var_off, (rows, nb), "int32")
        st = T.match_buffer(var_st, (rows, nb, 2), "int32")
        if one_row:   # decided when the kernel is built
            for i in T.serial(rows):
                row(aq, off, st, i)
        else:
            for i in T.parallel(rows):
                row(aq, off, st, i)

    return kernel


def _term(T, lo, hi, sc, d, ad, g, b, t):
    """float32x16: block b's term of rows 16g .. from its sub-blocks' integer sums lo (A) and
    hi (B), (lo sc_A d + hi sc_B d) x the activations' scale. In float: two `vpmulld` a token
    and block (sc in the integer domain) took longer than this form against the Q8_0 GEMM, on
    the port `vpdpbusd` uses (bench/q6_k.py). sc d is the file's d sc
    (exact); the sums' products are rounded, as any float kernel's. Decode and prefill share
    it, so a token's logits are the same in either (design.md, "One arithmetic for a token")."""
    dv = d.vload([g, b // SUPER_BLOCKS, 0], "float32x16")
    return (T.Cast("float32x16", lo) * (T.Cast("float32x16", sc.vload([g, b, 0], "int8x16")) * dv)
            + T.Cast("float32x16", hi) * (T.Cast("float32x16", sc.vload([g, b, SUB], "int8x16")) * dv)
            ) * T.broadcast(ad[t, b], ROWS)


def _act(T, aq, t, b, c):
    """int8x64: activation bytes 4c..4c+3 of token t, block b, in every 32-bit lane."""
    return T.reinterpret("int8x64", T.broadcast(T.reinterpret("int32", aq.vload([t, b, 4 * c], "int8x4")), ROWS))


def _streamed(T, n: int, nb: int, prefetched: bool, tile):
    """q6_k_matmul's one-token form, a macro of (w, aq, st, ad, sc, d, y, bias_buf), with the
    arithmetic of that kernel's tiles (_term, _act: the same bits); `tile` its tile macro,
    which takes the groups left over; `prefetched`: decode's weights PREFETCH
    blocks ahead into L1, or left to the hardware (IntDots.decode_prefetch)."""
    ng = groups(n)
    tasks = ng // STREAMS + (1 if ng % STREAMS else 0)

    def chain(w, aq, st, g, b, t, sub_b: bool):
        """int32x16: sub-block A's (or B's) four vpdpbusd from its start, as one expression built
        here in Python: a variable reassigned in a TIR loop becomes a buffer in memory, and each
        vpdpbusd then waits on a store and a load."""
        v = T.broadcast(st[t, b, int(sub_b)], ROWS)
        for i in range(4):
            v = T.call_llvm_pure_intrin("int32x16", VPDPBUSD, v, codes(T, w, g, b, _chunk(i, sub_b)),
                                        _act(T, aq, t, b, _chunk(i, sub_b)))
        return v

    @T.macro
    def block_term(w, aq, st, ad, sc, d, acc, at, g, b, t):
        """acc[16 at ..] += block b's term for rows 16g .. 16g+15 and token t: one stream, its
        two chains in one expression (no buffers inside the parallel loop)."""
        acc[T.ramp(at * ROWS, 1, ROWS)] = acc[T.ramp(at * ROWS, 1, ROWS)] + _term(
            T, chain(w, aq, st, g, b, t, False), chain(w, aq, st, g, b, t, True), sc, d, ad, g, b, t)

    @T.macro
    def stream_task(w, aq, st, ad, sc, d, y, bias_buf, task):
        """streamed's task `task`."""
        if task < ng // STREAMS:
            acc = T.decl_buffer((STREAMS * ROWS,), "float32", scope="global")
            for h in T.unroll(STREAMS):
                acc[T.ramp(h * ROWS, 1, ROWS)] = T.broadcast(T.float32(0), ROWS)
            for b in range(nb):
                if prefetched:
                    for h in T.unroll(STREAMS):
                        for c in T.unroll(CHUNKS):
                            T.evaluate(T.call_llvm_intrin(
                                "void", "llvm.prefetch.p0", T.address_of(w[h * (ng // STREAMS) + task, b + PREFETCH, c, 0]),
                                T.int32(0), T.int32(3), T.int32(1)))
                for h in T.unroll(STREAMS):
                    block_term(w, aq, st, ad, sc, d, acc, h, h * (ng // STREAMS) + task, b, 0)
            for h in T.unroll(STREAMS):
                store_rows(y, 0, (h * (ng // STREAMS) + task) * ROWS, ROWS, n, acc, h * ROWS, None, bias_buf)
        else:
            for g in range(ng // STREAMS * STREAMS, ng):
                tile(w, aq, st, ad, sc, d, y, bias_buf, g, 0, 1)

    @T.macro
    def streamed(w, aq, st, ad, sc, d, y, bias_buf):
        """Task p reads groups p, per + p, 2 per + p, 3 per + p in lockstep, block by block,
        each prefetched ahead (STREAMS streams whose DRAM page crossings fall at different
        times, as the Q8_0 decode GEMV reads: x86/vnni.py); the groups left over are one more task.
        The tasks go to the threads as they come for them (task_claims.py)."""
        flags = T.decl_buffer((tasks + 1,), "int32", scope="global")
        for i in range(tasks + 1):
            flags[i] = 0
        with T.attr(0, task_claims.PRAGMA, task_claims.IR):
            for slot in T.parallel(tasks):
                if task_claims.seen(T, flags, tasks) == 0:
                    for k in range(tasks):
                        # (an expression, not a variable: one assigned in a loop becomes a buffer)
                        if task_claims.take(T, flags, task_claims.nth(slot, k, tasks)) == 1:
                            stream_task(w, aq, st, ad, sc, d, y, bias_buf, task_claims.nth(slot, k, tasks))
                    T.evaluate(task_claims.set_done(T, flags, tasks))

    return streamed


@cached_kernel   # the same kernel every layer and every compile (kernel_cache.py)
def q6_k_matmul(n: int, nb: int, bias: bool = False, m: int | None = None, amx: bool = False,
                prefetch: str = "software"):
    """y [M, N] = the quantized activations (aq [M, NB, 32], their scales ad [M, NB] and the
    chains' starts st [M, NB, 2]: q6_k_starts) times the Q6_K weights w [G, NB, 6, 64] with
    sc [G, NB, 32] and d [G, NB/8, 16] (the module's docstring); `bias`: a bias [N] added as
    the rows are stored. M any number of tokens, or `m` fixed. `amx`: prefill's whole 16-token
    tiles on AMX (x86/amx.py: q6_k_macros), the tokens left on VNNI's tiles. `prefetch`: as
    the decode GEMVs' (targets.IntDots.decode_prefetch); "hardware": one token prefetches nothing."""
    from tvm.script import tirx as T

    from . import amx as amx_tiles

    if nb % SUPER_BLOCKS:
        raise ValueError(f"Q6_K rows are whole super-blocks of 256, got {nb} blocks of 32")
    ng = groups(n)
    rows_in = token_count(m)
    prefetched = prefetch == "software"   # decode's weights PREFETCH blocks ahead, or left to the hardware

    term, act = partial(_term, T), partial(_act, T)

    @T.macro
    def tile(w, aq, st, ad, sc, d, y, bias_buf, g, first, count):
        """Rows 16g .. 16g+15 of tokens first .. first + count - 1, over every block."""
        # "global": small constant-size buffers go on the stack, into registers (x86/vnni.py)
        acc = T.decl_buffer((count * ROWS,), "float32", scope="global")
        lo = T.decl_buffer((count * ROWS,), "int32", scope="global")
        hi = T.decl_buffer((count * ROWS,), "int32", scope="global")
        for t in T.unroll(count):
            acc[T.ramp(t * ROWS, 1, ROWS)] = T.broadcast(T.float32(0), ROWS)
        for b in range(nb):
            if count == 1 and prefetched:   # decided when the kernel is built: decode reads its weights from DRAM
                for c in T.unroll(CHUNKS):
                    T.evaluate(T.call_llvm_intrin("void", "llvm.prefetch.p0", T.address_of(w[g, b + PREFETCH, c, 0]),
                                                  T.int32(0), T.int32(3), T.int32(1)))
            for t in T.unroll(count):
                lo[T.ramp(t * ROWS, 1, ROWS)] = T.broadcast(st[first + t, b, 0], ROWS)
                hi[T.ramp(t * ROWS, 1, ROWS)] = T.broadcast(st[first + t, b, 1], ROWS)
            for i in T.unroll(4):
                for t in T.unroll(count):
                    lo[T.ramp(t * ROWS, 1, ROWS)] = T.call_llvm_pure_intrin(
                        "int32x16", VPDPBUSD, lo[T.ramp(t * ROWS, 1, ROWS)],
                        codes(T, w, g, b, _chunk(i, False)), act(aq, first + t, b, _chunk(i, False)))
                    hi[T.ramp(t * ROWS, 1, ROWS)] = T.call_llvm_pure_intrin(
                        "int32x16", VPDPBUSD, hi[T.ramp(t * ROWS, 1, ROWS)],
                        codes(T, w, g, b, _chunk(i, True)), act(aq, first + t, b, _chunk(i, True)))
            for t in T.unroll(count):
                acc[T.ramp(t * ROWS, 1, ROWS)] = acc[T.ramp(t * ROWS, 1, ROWS)] + term(
                    lo[T.ramp(t * ROWS, 1, ROWS)], hi[T.ramp(t * ROWS, 1, ROWS)], sc, d, ad, g, b, first + t)
        for t in T.unroll(count):
            store_rows(y, first + t, g * ROWS, ROWS, n, acc, t * ROWS, None, bias_buf)

    streamed = _streamed(T, n, nb, prefetched, tile)

    configure, sub_block_order, make_amx_b, amx_blocks = amx_tiles.q6_k_macros(
        T, nb, term, lambda w, g, b, i, sub_b: codes(T, w, g, b, _chunk(i, sub_b)))

    @T.macro
    def amx_tile(ar, ad, sc, d, y, bias_buf, bt, cs, g, first):
        """Rows 16g .. 16g+15 of tokens first .. first + 15 on AMX."""
        lo = T.decl_buffer((8 * ROWS,), "float32", scope="global")   # a stack slot each (x86/vnni.py)
        hi = T.decl_buffer((8 * ROWS,), "float32", scope="global")
        for t in T.unroll(8):
            lo[T.ramp(t * ROWS, 1, ROWS)] = T.broadcast(T.float32(0), ROWS)
            hi[T.ramp(t * ROWS, 1, ROWS)] = T.broadcast(T.float32(0), ROWS)
        amx_blocks(ar, ad, sc, d, lo, hi, bt, cs, g, first)
        for t in T.unroll(8):
            store_rows(y, first + t, g * ROWS, ROWS, n, lo, t * ROWS, None, bias_buf)
            store_rows(y, first + 8 + t, g * ROWS, ROWS, n, hi, t * ROWS, None, bias_buf)

    # the first token the VNNI tiles take: with AMX, what its whole 16-token tiles leave
    vnni_from = rows_in // amx_tiles.TOKENS * amx_tiles.TOKENS if amx else 0

    @T.macro
    def prefill_groups(w, aq, st, ad, sc, d, y, bias_buf, ar):
        """A task a row group: its codes rebuilt once as bytes, which every tile then reads
        (rebuilt in each tile they cost the GEMM more than the Q8_0 one: bench/q6_k.py),
        then with AMX (`ar`: the activations in sub-block order) its whole 16-token tiles on
        AMX, and the tokens left in tiles of TOKENS and of one."""
        for g in T.parallel(ng):
            # a view shaped as the weights' groups, offset so that group g is this copy
            made = T.decl_buffer((nb * BYTE_CHUNKS * 4 * ROWS,), "uint8", scope="global")
            wb = T.decl_buffer((ng, nb, BYTE_CHUNKS, 4 * ROWS), "uint8", data=made.data,
                               elem_offset=-g * (nb * BYTE_CHUNKS * 4 * ROWS))
            for b in range(nb):
                for c in T.unroll(BYTE_CHUNKS):
                    wb[g, b, c, T.ramp(0, 1, 4 * ROWS)] = codes(T, w, g, b, c)
            if ar is not None:   # decided when the kernel is built
                if rows_in >= amx_tiles.TOKENS:
                    cfg = T.decl_buffer((64,), "uint8", scope="global")
                    bt = T.decl_buffer((nb, BYTE_CHUNKS * 4 * ROWS), "uint8", scope="global")
                    cs = T.decl_buffer((amx_tiles.SLOTS, 2, amx_tiles.TOKENS * ROWS), "int32", scope="global")
                    configure(cfg)
                    make_amx_b(wb, bt, g)
                    for it in range(rows_in // amx_tiles.TOKENS):
                        amx_tile(ar, ad, sc, d, y, bias_buf, bt, cs, g, it * amx_tiles.TOKENS)
                    T.evaluate(T.call_llvm_intrin("void", "llvm.x86.tilerelease"))
            for it in range(vnni_from // TOKENS, rows_in // TOKENS):
                tile(wb, aq, st, ad, sc, d, y, bias_buf, g, it * TOKENS, TOKENS)
            for i in range(rows_in // TOKENS * TOKENS, rows_in):
                tile(wb, aq, st, ad, sc, d, y, bias_buf, g, i, 1)

    @T.macro
    def body(w, aq, st, ad, sc, d, y, bias_buf):
        T.func_attr({"tir.noalias": True, "op_pattern": 8, SCHEDULED: True})   # opaque: FuseOps leaves it whole
        if rows_in == 1:
            streamed(w, aq, st, ad, sc, d, y, bias_buf)
        else:
            if amx:   # decided when the kernel is built
                ar = T.decl_buffer((rows_in, nb, 32), "int8")
                if rows_in >= amx_tiles.TOKENS:
                    for t in T.parallel(rows_in):
                        sub_block_order(aq, ar, t)
                prefill_groups(w, aq, st, ad, sc, d, y, bias_buf, ar)
            else:
                prefill_groups(w, aq, st, ad, sc, d, y, bias_buf, None)

    if bias:
        @T.prim_func(private=True)
        def kernel_b(var_aq: T.handle, var_ad: T.handle, var_st: T.handle,
                     w: T.Buffer((ng, nb, CHUNKS, 4 * ROWS), "uint8"), sc: T.Buffer((ng, nb, 2 * SUB), "int8"),
                     d: T.Buffer((ng, nb // SUPER_BLOCKS, ROWS), "float32"), bias_buf: T.Buffer((n,), "float32"),
                     var_y: T.handle):
            aq = T.match_buffer(var_aq, (rows_in, nb, 32), "int8")
            ad = T.match_buffer(var_ad, (rows_in, nb), "float32")
            st = T.match_buffer(var_st, (rows_in, nb, 2), "int32")
            y = T.match_buffer(var_y, (rows_in, n), "float32")
            body(w, aq, st, ad, sc, d, y, bias_buf)
        return kernel_b

    @T.prim_func(private=True)
    def kernel(var_aq: T.handle, var_ad: T.handle, var_st: T.handle,
               w: T.Buffer((ng, nb, CHUNKS, 4 * ROWS), "uint8"), sc: T.Buffer((ng, nb, 2 * SUB), "int8"),
               d: T.Buffer((ng, nb // SUPER_BLOCKS, ROWS), "float32"), var_y: T.handle):
        aq = T.match_buffer(var_aq, (rows_in, nb, 32), "int8")
        ad = T.match_buffer(var_ad, (rows_in, nb), "float32")
        st = T.match_buffer(var_st, (rows_in, nb, 2), "int32")
        y = T.match_buffer(var_y, (rows_in, n), "float32")
        body(w, aq, st, ad, sc, d, y, None)
    return kernel
