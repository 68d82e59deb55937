"""llama.cpp's Q6_K weights with NEON `sdot`, exactly: w = d sc (q - 32), one int8 scale sc a
sub-block of 16 weights and one float d a super-block of 256 (x86's form: kernels/x86/q6_k.py).

The codes are kept at six bits, as the file has them: a decode step at many threads reads
memory more than it computes, so the bytes a weight take its time. Each code is t = (q - 32)
mod 64, a six-bit two's complement, and the kernel reads 4t as a signed byte (so d is scaled by
1/4 as it is read, exactly). d is the file's fp16 where every d of the weight is one (as
llama.cpp's are), else float32 (d_dtype). In the W8A8 row groups' order (row_groups.pack_int8,
as ARM's Q8_0) each 64-byte chunk c of a block holds 4 bytes of each of 16 rows, i.e. four
16-byte slices of 4 rows, meeting activation bytes 4c..4c+3 of the de-interleaved block (32-bit
lane c % 4 of its half c // 4: an indexed `sdot`, as arm/dotprod.py takes them). Chunks 4h ..
4h + 3 are stored in three, A B C (compiler/repack_q6_k.py: arm_six_bit_codes): A = 4 t0 plus
t3's top two bits, B = 4 t1 plus its middle two, C = 4 t2 plus its low two. So chunks 4h .. 4h
+ 2 are A, B, C with their low two bits cleared (one `and` each) and chunk 4h + 3 is C << 2
with B, then A, shifted in above (`shl` and two `sli`): six instructions for four vectors of
codes.

A 32-block's sub-blocks are chunks {0, 1, 4, 5} (elements 0-15) and {2, 3, 6, 7} (16-31): each
is its own chain of four `sdot` from 0 (the codes are signed: no offset, so the activation
quantizer's outputs are used as they are). The activations are scaled by super-blocks in
every graph (frontend: llama.cpp's Q8_K, as its Q6_K dot takes them), so the sub-block scales
multiply the integer sums and the float work comes once a super-block: a block's float scale
would cost a convert and two multiplies a sub-block.

A task is one slice (4 rows) of a row group, so a 256-row attn_v is 64 tasks for a 64-128-core
server rather than 16; its tokens in tiles of TOKENS (leftovers, and decode's one token, one
at a time). The activations come in the "arm" layout at any token count, from a quantizer of
their own where the i8mm GEMMs of the same input read "arm_pairs".
"""

from __future__ import annotations

from .. import SCHEDULED
from ..kernel_cache import cached_kernel
from ..row_groups import ROWS, groups
from ..w4a8 import store_rows, token_count

LANES = 4            # rows a slice: int32 lanes of a 128-bit vector
SLICES = ROWS // LANES
SUB = 16             # Q6_K's sub-block
SUPER_BLOCKS = 8     # 32-blocks a super-block of 256
TOKENS = 4           # a tile: 4 x (2 integer chains + 1 float sum) of NEON's 32 registers
SDOT = "llvm.aarch64.neon.sdot.v4i32.v16i8"
SLI = "llvm.aarch64.neon.vsli.v16i8"
CODE_CHUNKS = 6      # stored 64-byte chunks a block: eight chunks of codes at six bits


def _chunk(i, sub_b: bool):
    """The i-th (0..3) 64-byte chunk of sub-block A (0, 1, 4, 5) or B (2, 3, 6, 7)."""
    return i % 2 + (i // 2) * 4 + (2 if sub_b else 0)


def _codes(w, g, b, q, c):
    """int8x16: 4 (q - 32) of chunk c (0..7) of block b, slice q (rows 16g + 4q .. +3), from
    the three stored chunks of its half (module docstring)."""
    from tvm.script import tirx as T

    h, j = divmod(c, 4)

    def stored(i):
        return w.vload([g, b, 3 * h + i, 16 * q], "uint8x16")

    if j < 3:
        v = stored(j) & T.broadcast(T.uint8(0xFC), 16)
    else:
        v = stored(2) << T.broadcast(T.uint8(2), 16)
        v = T.call_llvm_pure_intrin("uint8x16", SLI, v, stored(1), T.int32(4))
        v = T.call_llvm_pure_intrin("uint8x16", SLI, v, stored(0), T.int32(6))
    return T.reinterpret("int8x16", v)


def _quarter_d(d, g, s, q):
    """float32x4: d / 4 of rows 16g + 4q .. + 3, super-block s (exact: a power of two)."""
    from tvm.script import tirx as T

    return T.Cast("float32x4", d.vload([g, s, LANES * q], f"{d.dtype}x4")) * T.broadcast(T.float32(0.25), LANES)


@cached_kernel   # the same kernel every layer and every compile (kernel_cache.py)
def q6_k_matmul(n: int, nb: int, m: int | None = None, d_dtype: str = "float16"):
    """y [M, N] = the quantized activations (aq [M, NB, 32], act_quant layout "arm", with one
    scale a super-block, ad [M, NB]: llama.cpp's Q8_K) times the Q6_K weights w [G, NB, 6, 64]
    (six-bit codes) with sc [G, NB, 32] and d [G, NB/8, 16] `d_dtype`
    (compiler/repack_q6_k.py). M any number of tokens, or `m` fixed. The sub-block scales
    multiply the int32 sums, and a super-block's sum is converted and scaled once, as llama.cpp's
    ggml_vec_dot_q6_K_q8_K does (bounded: 16 sub-blocks of 16 |4 (q - 32)| 127 |sc| 127 < 2^31)."""
    from tvm import tirx
    from tvm.script import tirx as T

    if nb % SUPER_BLOCKS:
        raise ValueError(f"Q6_K rows are whole super-blocks of 256, got {nb} blocks of 32")
    ng = groups(n)
    rows_in = token_count(m)

    def chain(w, aq, g, b, q, t, sub_b: bool):
        """int32x4: rows 16g+4q .. +3, token t, one sub-block's dot: four indexed sdot from 0."""
        acc = T.broadcast(T.int32(0), LANES)
        for i in range(4):
            c = _chunk(i, sub_b)
            v = _codes(w, g, b, q, c)
            lane = T.reinterpret("int8x16", tirx.Shuffle(
                [T.reinterpret("int32x4", aq.vload([t, b, 16 * (c // 4)], "int8x16"))], [c % 4] * 4))
            acc = T.call_llvm_pure_intrin("int32x4", SDOT, acc, v, lane)
        return acc

    def int_term(w, aq, sc, g, b, q, t):
        """int32x4: block b's sum of the slice for token t, A sc_A + B sc_B."""
        return (chain(w, aq, g, b, q, t, False) * T.Cast("int32x4", sc.vload([g, b, LANES * q], "int8x4"))
                + chain(w, aq, g, b, q, t, True) * T.Cast("int32x4", sc.vload([g, b, SUB + LANES * q], "int8x4")))

    @T.macro
    def tiles(w, aq, ad, sc, d, y, g, q, first, count):
        """Rows 16g+4q .. +3 of tokens first .. first + count - 1, over every super-block: the
        float work once a super-block."""
        acc = T.decl_buffer((count * LANES,), "float32", scope="global")
        isum = T.decl_buffer((count * LANES,), "int32", scope="global")
        for t in T.unroll(count):
            acc[T.ramp(t * LANES, 1, LANES)] = T.broadcast(T.float32(0), LANES)
        for s in range(nb // SUPER_BLOCKS):
            for t in T.unroll(count):
                isum[T.ramp(t * LANES, 1, LANES)] = T.broadcast(T.int32(0), LANES)
            for j in range(SUPER_BLOCKS):
                for t in T.unroll(count):
                    isum[T.ramp(t * LANES, 1, LANES)] = isum[T.ramp(t * LANES, 1, LANES)] + int_term(
                        w, aq, sc, g, s * SUPER_BLOCKS + j, q, first + t)
            for t in T.unroll(count):
                acc[T.ramp(t * LANES, 1, LANES)] = acc[T.ramp(t * LANES, 1, LANES)] + T.Cast(
                    "float32x4", isum[T.ramp(t * LANES, 1, LANES)]) * (_quarter_d(d, g, s, q)
                                                                       * T.broadcast(ad[first + t, s * SUPER_BLOCKS], LANES))
        for t in T.unroll(count):
            store_rows(y, first + t, g * ROWS + LANES * q, LANES, n, acc, t * LANES, None)

    @T.prim_func(private=True)
    def kernel(var_aq: T.handle, var_ad: T.handle, w: T.Buffer((ng, nb, CODE_CHUNKS, 4 * ROWS), "uint8"),
               sc: T.Buffer((ng, nb, 2 * SUB), "int8"), d: T.Buffer((ng, nb // SUPER_BLOCKS, ROWS), d_dtype),
               var_y: T.handle):
        T.func_attr({"tir.noalias": True, "op_pattern": 8, SCHEDULED: True})   # opaque: FuseOps leaves it whole
        aq = T.match_buffer(var_aq, (rows_in, nb, 32), "int8")
        ad = T.match_buffer(var_ad, (rows_in, nb), "float32")
        y = T.match_buffer(var_y, (rows_in, n), "float32")
        for task in T.parallel(ng * SLICES):
            for it in range(rows_in // TOKENS):
                tiles(w, aq, ad, sc, d, y, task // SLICES, task % SLICES, it * TOKENS, TOKENS)
            for i in range(rows_in // TOKENS * TOKENS, rows_in):
                tiles(w, aq, ad, sc, d, y, task // SLICES, task % SLICES, i, 1)

    return kernel
