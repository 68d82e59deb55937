"""On-the-fly activation quantization shared by the W4A8 kernels (llama.cpp's Q8_0: one fp32
scale per 32-block, d = amax / 127, q = round(x / d), halves away from zero).

Each block is stored de-interleaved — its 16 even elements, then its 16 odd ones — because a
16-byte load of packed Q4_0 weights splits into low nibbles (even elements) and high nibbles
(odd elements): the two halves line up with the two halves of the activation block.

The "arm_rows" and "arm_rows_flat" layouts are the other activation format (design.md, "Two
activation formats"): one scale and one zero point per row (token), KleidiAI's qai8dx, for the
ARM GEMMs that then multiply each block by the weight scale only (kernels/arm/i8mm.py: q4_gemm
and kernels/arm/dotprod.py: q4_dot, `per_row`).

On the ARM layouts "arm" and "arm_pairs" the quantizer can also scale by super-blocks of 256
(`super_blocks`: llama.cpp's Q8_K, which its K-quant dots take): d = amax / 127 over the
super-block, written at each of its 8 blocks' places, the codes and block sums as before. So
the layout is unchanged and every kernel reading blocks reads these too, while the K-quant
kernels (kernels/arm/dotprod.py: the compact Q4_K GEMV) read one scale a super-block and apply
the sub-block scales to integer sums.

The quantizer can also take the MLP's gate and up projections and quantize silu(gate) * up
(the down projection's input): SiLU·mul then costs neither a kernel of its own, nor a pass
over 4864 floats a token, nor a libm exp per element (kernels/vector_math.py).
"""

from __future__ import annotations

from tvm import tirx

from . import quantizer_schedule, vector_math
from .kernel_cache import cached_kernel

# The ISA folders' schedule constants for the layouts they own (kernels/__init__.py: the registry):
# ARM's for "arm" / "arm_pairs" / "arm_rows*", x86's for "plain"
_ARM, _X86 = quantizer_schedule("arm"), quantizer_schedule("plain")
PARALLEL_BLOCKS, RMS_TASKS = _ARM["PARALLEL_BLOCKS"], _ARM["RMS_TASKS"]
ROW_GROUP, SILU_STAGE = _X86["ROW_GROUP"], _X86["SILU_STAGE"]

BLOCK = 32
HALF = BLOCK // 2
SUPER = 256   # a super-block's elements (super_blocks)
SUPER_LAYOUTS = ("arm", "arm_pairs")   # the layouts that take super-block scales
LANES = 16   # fp32 lanes of the squares (rms_eps)
LAYOUTS = ("plain", "arm", "arm_pairs", "arm_rows", "arm_rows_flat")   # see fused_quantizer
ROW_LAYOUTS = ("arm_rows", "arm_rows_flat")   # a scale and zero point a row: ad [M, 2]
# The attribute that marks fused_quantizer's kernels, with what built them ("kind": "plain",
# "silu_mul" or "rms"; "layout"; "zero_point"; "eps" of an RMSNorm; "super_blocks" where it
# scales by super-blocks), for the import-time fusion passes
QUANTIZER = "qwc.act_quantizer"
EVENS = [2 * i for i in range(HALF)]
ODDS = [2 * i + 1 for i in range(HALF)]


def _round(T, v, lanes):
    """Round half away from zero, as llama.cpp's roundf."""
    half, zero = vector_math.const(T, 0.5, lanes), vector_math.const(T, 0.0, lanes)
    return T.Select(v < zero, T.ceil(v - half), T.floor(v + half))


def _let(T, name, value):
    """T.bind under a readable name (the printed kernel reads as the quantizer's own)."""
    return T.bind(value, var=tirx.Var(name, value.ty))


def pair_index(i, b, e, m, paired):
    """Flat index of byte e of row i, block b in the layout the ARM i8mm GEMM reads
    (kernels/arm/i8mm.py): block-major ([NB, M, 32], so a tile's tokens are adjacent), and
    within a block rows 2p and 2p + 1 (below `paired`, M rounded down to even) alternate
    their 8-byte pieces, so one 16-byte load is a smmla operand of two tokens. An odd last
    row keeps its 32 bytes in order."""
    return b * m * BLOCK + tirx.Select(i < paired, (i - i % 2) * BLOCK + (e // 8) * 16 + (i % 2) * 8 + e % 8,
                                       i * BLOCK + e)


def quantize_block(T, lo, hi, aq, ad, off, i, b, zero_point: int, flat=None, amax=None):
    """Emit block b of row i (aq [., NB, 32], ad and off [., NB]) from its elements 0..15 and
    16..31 (two float32x16 values): the whole blocks' code, shared by the quantizer and by
    the decode GEMV that quantizes its own output (kernels/x86/vnni.py). T: TVMScript's or the
    IR builder's tirx module. The offset is an int32. With `flat` (the ARM quantizers), aq, ad
    and off are flat int8, float32 and int32 buffers and flat = (aq_at, scale_at): byte e of
    the block goes to aq[aq_at(e)], the scale and the offset to each index of scale_at.
    `amax`: the largest |x| the scale is made from (a super-block's), else the block's own."""
    ev = _let(T, "ev", tirx.Shuffle([lo, hi], EVENS))
    od = _let(T, "od", tirx.Shuffle([lo, hi], ODDS))
    if amax is None:
        amax = _let(T, "amax", abs_max(T, T.max(T.fabs(ev), T.fabs(od))))
    d = _let(T, "d", amax / T.float32(127))
    for at in [(i, b)] if flat is None else [(at,) for at in flat[1]]:
        T.buffer_store(ad, d, list(at))
    # x / d as the generic kernel computes it (two vector divisions a block), so the two agree
    dv = _let(T, "dv", T.broadcast(T.Select(d > T.float32(0), d, T.float32(1)), HALF))
    # ARM (the flat layouts): llvm.round is roundf itself, one `frinta` a vector where the
    # select of floor and ceil takes six instructions (it differs only where x + 0.5 itself
    # rounds up, as for the largest float below 0.5: roundf gives 0, it gave 1)
    rnd = ((lambda v: _round(T, v, HALF)) if flat is None else
           (lambda v: T.call_llvm_pure_intrin(f"float32x{HALF}", f"llvm.round.v{HALF}f32", v)))
    qe = _let(T, "qe", T.Cast(f"int32x{HALF}", rnd(ev / dv)))
    qo = _let(T, "qo", T.Cast(f"int32x{HALF}", rnd(od / dv)))
    total = T.call_llvm_pure_intrin("int32", f"llvm.vector.reduce.add.v{HALF}i32", qe + qo)
    if flat is None:
        T.buffer_store(aq, T.Cast(f"int8x{HALF}", qe), [i, b, T.ramp(0, 1, HALF)])
        T.buffer_store(aq, T.Cast(f"int8x{HALF}", qo), [i, b, T.ramp(HALF, 1, HALF)])
        T.buffer_store(off, total * T.int32(zero_point), [i, b])
        return
    aq_at, scale_at = flat
    for half, q in ((0, qe), (1, qo)):
        for piece in range(2):   # 8-byte pieces: where they go depends on the layout
            e = HALF * half + 8 * piece
            T.buffer_store(aq, T.Cast("int8x8", tirx.Shuffle([q], list(range(8 * piece, 8 * piece + 8)))),
                           [T.ramp(aq_at(e), 1, 8)])
    for at in scale_at:
        T.buffer_store(off, total * T.int32(zero_point), [at])


def abs_max(T, v):
    """The largest lane of v (float32 x HALF, every lane >= 0). |x| >= 0 orders like its bit
    pattern: an integer max reduces as a tree, where llvm.vector.reduce.fmax (NaN-aware) is a
    chain of 16 scalar steps."""
    return T.reinterpret("float32", T.call_llvm_pure_intrin("int32", f"llvm.vector.reduce.smax.v{HALF}i32",
                                                             T.reinterpret(f"int32x{HALF}", v)))


def quantize_row_block(T, lo, hi, sv, zv, aq, off, flat, zero_point: int):
    """Emit one block of a row in the per-row format from its elements 0..15 and 16..31 (two
    float32x16): q = clamp(round(x / s) + zp, -128, 127) with the row's scale and zero point
    broadcast (sv, zv: float32x16), the codes de-interleaved as quantize_block's, at the flat
    places `flat` = (aq_at, scale_at) gives; the block's offset zero_point x sum(q) (the GEMM
    starts its dots from it, as in the block format)."""
    ev = _let(T, "ev", tirx.Shuffle([lo, hi], EVENS))
    od = _let(T, "od", tirx.Shuffle([lo, hi], ODDS))
    low, high = vector_math.const(T, -128.0, HALF), vector_math.const(T, 127.0, HALF)

    def code(v):
        r = T.call_llvm_pure_intrin(f"float32x{HALF}", f"llvm.round.v{HALF}f32", v / sv) + zv
        return T.Cast(f"int32x{HALF}", T.min(T.max(r, low), high))

    qe = _let(T, "qe", code(ev))
    qo = _let(T, "qo", code(od))
    total = T.call_llvm_pure_intrin("int32", f"llvm.vector.reduce.add.v{HALF}i32", qe + qo)
    aq_at, scale_at = flat
    for half, q in ((0, qe), (1, qo)):
        for piece in range(2):
            e = HALF * half + 8 * piece
            T.buffer_store(aq, T.Cast("int8x8", tirx.Shuffle([q], list(range(8 * piece, 8 * piece + 8)))),
                           [T.ramp(aq_at(e), 1, 8)])
    for at in scale_at:
        T.buffer_store(off, total * T.int32(zero_point), [at])


def row_scale_and_zero_point(T, lo, hi):
    """(s, zp) of a row whose values span [lo, hi] (lo <= 0 <= hi): s = (hi - lo) / 255, zp =
    round(-lo / s) - 128, so lo -> -128 and 0 is exact (x = s (q - zp)). A row of zeros takes
    s = 1 and zp = 0: its codes are 0, so the GEMM's sums are 0, where codes of -128 made them
    large terms that cancel (to the running tiles' fixed-point unit, kernels/arm/i8mm.py)."""
    span = hi - lo
    s = T.Select(span > T.float32(0), span / T.float32(255), T.float32(1))
    return s, T.Select(span > T.float32(0), T.call_llvm_pure_intrin("float32", "llvm.round.f32", T.float32(0) - lo / s)
                       - T.float32(128), T.float32(0))


def quantizer_name(k: int, zero_point: int, one_row: bool, kind: str = "plain", layout: str = "plain",
                   super_blocks: bool = False) -> str:
    """The kernel name fused_quantizer's kernel goes by in a module (without the entry point's prefix)."""
    stem = {"plain": "", "silu_mul": "silu_", "rms": "rms_"}[kind]
    return (f"act_q8_{stem}{k}_{int(one_row)}_sum{-zero_point}" + ("" if layout == "plain" else f"_{layout}")
            + ("_k" if super_blocks else ""))


def marked_super_blocks(mark) -> bool:
    """Whether the quantizer whose QUANTIZER attribute is `mark` scales by super-blocks."""
    return bool(int(mark.get("super_blocks", 0)))


def takes_super_blocks(k: int, layout: str) -> bool:
    """Whether a quantizer of rows of K in `layout` can scale by super-blocks (super_blocks)."""
    return k % SUPER == 0 and layout in SUPER_LAYOUTS


@cached_kernel   # the same kernel every layer and every compile (kernel_cache.py)
def fused_quantizer(k: int, zero_point: int, one_row: bool, silu_mul: bool = False, rms_eps: float | None = None,
                    layout: str = "plain", parts: int = 1, super_blocks: bool = False):
    """a [M, K] float32 -> (aq [M, NB, 32] int8 de-interleaved per block, scale [M, NB],
    zero_point x block sum [M, NB]), in one pass and one kernel: separate stages would cost a
    parallel launch each, which dominates a decode step's activation work (K = 896: 28 blocks).
    With `silu_mul` the kernel takes (gate, up) [M, K] and quantizes silu(gate) * up; with
    `rms_eps` it takes (x [M, K], gamma [K]) and quantizes RMSNorm(x) * gamma itself (a first
    pass over the row for its sum of squares; the normalized row is never stored).
    `one_row` (decode) runs serially, or by blocks in parallel (split_blocks, split_rms). The
    block sum is what a dot of raw nibbles q with a overcounts against (q - 8) (vpdpbusd);
    sdot, which takes q - 8 signed, ignores it.
    `parts` > 1 (an ARM decode RMSNorm): x comes as [parts, K], the parts of a decode GEMV
    that split its blocks (arm/dotprod.py), and the kernel also writes their sum h [1, K],
    the residual stream, as a fourth output.
    The offsets are int32: every W4A8 kernel starts its integer accumulators from them.
    `layout`: "plain" (x86), "arm" (the flat layout of the sdot kernels), "arm_pairs" (everything
    block-major and rows pair-interleaved for the i8mm GEMM: pair_index; scales and offsets
    [M, NB, 2], each written twice: see flat), "arm_rows" (the codes and offsets as in
    "arm_pairs", with one scale and zero point a row: ad [M, 2] holds (s, s zp); prefill only),
    "arm_rows_flat" (the same scales, the codes and offsets as in "arm": the sdot GEMM's).
    `super_blocks` ("arm" and "arm_pairs", K a multiple of 256): one scale a super-block, at
    each of its blocks' places (llama.cpp's Q8_K; the module's docstring).

    Whole blocks are 16-lane vectors (loaded contiguously, de-interleaved by a shuffle); a
    last partial block (K not a multiple of 32) runs one element at a time."""
    from tvm.script import tirx as T

    if layout not in LAYOUTS:
        raise ValueError(f"unknown activation layout {layout!r}")
    if parts != 1 and (rms_eps is None or not one_row or layout == "plain" or k < 2 * BLOCK):
        raise ValueError("only an ARM decode RMSNorm quantizer sums parts")
    row_scale = layout in ROW_LAYOUTS
    if row_scale and (one_row or parts != 1 or k % BLOCK):
        raise ValueError("the per-row layout is prefill's, on whole blocks")
    if super_blocks and not takes_super_blocks(k, layout):
        raise ValueError(f"super-block scales need K a multiple of {SUPER} in layout {'/'.join(SUPER_LAYOUTS)}, "
                         f"got K {k} in {layout!r}")
    nb = (k + BLOCK - 1) // BLOCK
    full = k // BLOCK
    sub = SUPER // BLOCK if super_blocks else 1   # the blocks one scale covers
    # One row over the threads by blocks, on the ARM targets (64-128-core servers), where a
    # serial kernel keeps every other thread waiting: worth a launch from PARALLEL_BLOCKS
    # blocks on (the MLP's silu(gate) * up; a 7B's hidden size). The RMSNorm quantizer needs
    # its row's sum of squares before any block: RMS_TASKS tasks each take the sum (in the
    # same order, so the same bits) and a quarter of the blocks. The sum is serial in TOPI's
    # order, so more tasks would add more repeated sums than they take blocks off the slowest.
    split_blocks = one_row and layout != "plain" and rms_eps is None and full >= PARALLEL_BLOCKS
    split_rms = one_row and layout != "plain" and rms_eps is not None and full >= 2
    chunk = -(-full // (RMS_TASKS * sub)) * sub if split_rms else 0   # whole super-blocks a task
    row_groups = rms_eps is not None and not one_row and layout == "plain"   # rms_row_group
    staged = silu_mul and layout == "plain"   # blocks: SILU_STAGE
    rms_tasks = -(-full // chunk) if split_rms else 0
    rows = T.int64()
    copies = 2 if layout in ("arm_pairs", "arm_rows") else 1
    off_shape = (rows, nb, 2) if copies == 2 else (rows, nb)
    scale_shape = (rows, 2) if row_scale else off_shape   # arm_rows: (s, s zp) a row

    def row(a, i, idx):
        """Row i of the input at columns idx: the sum of the parts, in order, with `parts`."""
        if parts == 1:
            return a[i, idx]
        total = a[0, idx]
        for p in range(1, parts):
            total = total + a[p, idx]
        return total

    def x_at(a, g, u, i, idx, lanes):
        """The quantizer's input at row i, columns idx (a ramp of `lanes`, or a scalar). g, u:
        the gate and up rows (silu_mul), or gamma and the row's 1 / rms (rms_eps)."""
        if silu_mul:
            return vector_math.silu(T, g[i, idx], lanes) * u[i, idx]
        if rms_eps is not None:   # as TOPI's rms_norm: x * (1 / rms) * gamma
            return row(a, i, idx) * (T.broadcast(u[0], lanes) if lanes > 1 else u[0]) * g[idx]
        return a[i, idx]

    def flat(i, b):
        """(aq_at, scale_at) of row i, block b for quantize_block: where the ARM layouts put
        the block's bytes and its scale and offset (None: the plain 3-D and 2-D buffers).
        "arm_pairs" writes each scale and offset twice, [NB, M, 2] block-major as
        [x t0, x t1, x t0, x t1] per pair (an odd last row [x, x]): one 16-byte load is then
        what a smmla tile of two tokens multiplies and starts from."""
        if layout == "plain":
            return None
        if layout in ("arm", "arm_rows_flat"):
            return (lambda e: (i * nb + b) * BLOCK + e), (i * nb + b,)
        # arm_pairs and arm_rows: the codes and offsets in the same places
        first = b * rows * 2 + tirx.Select(i < rows - rows % 2, i - i % 2, i) * 2
        paired = i < rows - rows % 2
        return ((lambda e: pair_index(i, b, e, rows, rows - rows % 2)),
                (first + tirx.Select(paired, i % 2, T.int64(0)), first + tirx.Select(paired, i % 2 + 2, T.int64(1))))

    @T.macro
    def block_vec(a, g, u, aq, ad, off, i, b):
        lo = T.bind(x_at(a, g, u, i, T.ramp(b * BLOCK, 1, HALF), HALF))
        hi = T.bind(x_at(a, g, u, i, T.ramp(b * BLOCK + HALF, 1, HALF), HALF))
        quantize_block(T, lo, hi, aq, ad, off, i, b, zero_point, flat(i, b))

    @T.macro
    def super_block(a, g, u, aq, ad, off, i, s):
        """Super-block s of row i (blocks 8s .. 8s + 7): its values staged once (the norm or
        silu(gate) * up evaluated once), their largest |x|, then the blocks at that scale."""
        xs = T.decl_buffer((SUPER + HALF,), "float32", scope="global")   # the values, then 16 running maxima
        xs[T.ramp(SUPER, 1, HALF)] = T.broadcast(T.float32(0), HALF)
        for v in range(SUPER // HALF):
            xs[T.ramp(v * HALF, 1, HALF)] = x_at(a, g, u, i, T.ramp(s * SUPER + v * HALF, 1, HALF), HALF)
            xs[T.ramp(SUPER, 1, HALF)] = T.max(xs[T.ramp(SUPER, 1, HALF)], T.fabs(xs[T.ramp(v * HALF, 1, HALF)]))
        top = T.bind(abs_max(T, xs[T.ramp(SUPER, 1, HALF)]))
        for j in range(sub):
            quantize_block(T, xs[T.ramp(j * BLOCK, 1, HALF)], xs[T.ramp(j * BLOCK + HALF, 1, HALF)], aq, ad, off, i,
                           s * sub + j, zero_point, flat(i, s * sub + j), amax=top)

    @T.macro
    def block_tail(a, g, u, aq, ad, off, i, b):
        st = T.decl_buffer((2,), "float32", scope="global")   # amax, then the block sum
        st[0] = T.float32(0)
        for e in range(BLOCK):
            if b * BLOCK + e < k:
                st[0] = T.max(st[0], T.fabs(x_at(a, g, u, i, b * BLOCK + e, 1)))
        if layout == "plain":
            ad[i, b] = st[0] / T.float32(127)
            st[1] = T.float32(0)
            for t in range(BLOCK):
                col = b * BLOCK + T.if_then_else(t < HALF, 2 * t, 2 * (t - HALF) + 1)
                aq[i, b, t] = T.Cast("int8", _round(T, T.if_then_else(
                    st[0] > T.float32(0) and col < k,
                    x_at(a, g, u, i, T.min(col, k - 1), 1) / ad[i, b], T.float32(0)), 1))
                st[1] = st[1] + T.Cast("float32", aq[i, b, t])
            off[i, b] = T.Cast("int32", st[1]) * T.int32(zero_point)
        else:   # the same at the ARM layouts' flat places (flat), the offset an int32
            ad[flat(i, b)[1][0]] = st[0] / T.float32(127)
            if copies == 2:
                ad[flat(i, b)[1][1]] = st[0] / T.float32(127)
            st[1] = T.float32(0)
            for t in range(BLOCK):
                col = b * BLOCK + T.if_then_else(t < HALF, 2 * t, 2 * (t - HALF) + 1)
                aq[flat(i, b)[0](t)] = T.Cast("int8", _round(T, T.if_then_else(
                    st[0] > T.float32(0) and col < k,
                    x_at(a, g, u, i, T.min(col, k - 1), 1) / ad[flat(i, b)[1][0]], T.float32(0)), 1))
                st[1] = st[1] + T.Cast("float32", aq[flat(i, b)[0](t)])
            off[flat(i, b)[1][0]] = T.Cast("int32", st[1]) * T.int32(zero_point)
            if copies == 2:
                off[flat(i, b)[1][1]] = T.Cast("int32", st[1]) * T.int32(zero_point)

    @T.macro
    def row_asym(a, g, u, aq, ad, off, i, st):
        """Row i in the per-row format: its values staged once in st[LANES:] (the norm or
        silu(gate) * up evaluated once), their range in 16-lane running extremes (the first
        16 of mm: minima, the next: maxima; both start at 0, so lo <= 0 <= hi), the scale s
        and zero point zp, then the blocks. ad gets (s, s zp): the GEMM's epilogue."""
        mm = T.decl_buffer((2 * LANES + 2,), "float32", scope="global")   # a stack slot: see inv_rms
        mm[T.ramp(0, 1, 2 * LANES)] = T.broadcast(T.float32(0), 2 * LANES)
        for c in range(k // LANES):
            v = T.bind(x_at(a, g, u, i, T.ramp(c * LANES, 1, LANES), LANES))
            st[T.ramp(LANES + c * LANES, 1, LANES)] = v
            # minnum / maxnum: one `fminnm` / `fmaxnm` a vector, where T.min / T.max's compare
            # and select took two (the same extremes: the values are not NaN)
            mm[T.ramp(0, 1, LANES)] = T.call_llvm_pure_intrin(f"float32x{LANES}", f"llvm.minnum.v{LANES}f32",
                                                              mm[T.ramp(0, 1, LANES)], v)
            mm[T.ramp(LANES, 1, LANES)] = T.call_llvm_pure_intrin(f"float32x{LANES}", f"llvm.maxnum.v{LANES}f32",
                                                                  mm[T.ramp(LANES, 1, LANES)], v)
        lo = T.bind(T.call_llvm_pure_intrin("float32", f"llvm.vector.reduce.fmin.v{LANES}f32", mm[T.ramp(0, 1, LANES)]))
        hi = T.bind(T.call_llvm_pure_intrin("float32", f"llvm.vector.reduce.fmax.v{LANES}f32",
                                            mm[T.ramp(LANES, 1, LANES)]))
        sc, zp = row_scale_and_zero_point(T, lo, hi)
        mm[2 * LANES] = sc
        mm[2 * LANES + 1] = zp
        ad[i * 2] = mm[2 * LANES]
        ad[i * 2 + 1] = mm[2 * LANES] * mm[2 * LANES + 1]
        for b in range(nb):
            quantize_row_block(T, st[T.ramp(LANES + b * BLOCK, 1, HALF)], st[T.ramp(LANES + b * BLOCK + HALF, 1, HALF)],
                               T.broadcast(mm[2 * LANES], HALF), T.broadcast(mm[2 * LANES + 1], HALF), aq, off,
                               flat(i, b), zero_point)

    @T.macro
    def squares(a, inv, i):
        """inv[LANES + e] = a[i, e]^2: TOPI's rms_norm's squares, stored (a store between the
        product and the sum keeps LLVM from contracting them into an FMA)."""
        for c in range(k // LANES):
            inv[T.ramp(LANES + c * LANES, 1, LANES)] = row(a, i, T.ramp(c * LANES, 1, LANES)) * row(
                a, i, T.ramp(c * LANES, 1, LANES))
        for e in range(k // LANES * LANES, k):
            inv[LANES + e] = row(a, i, e) * row(a, i, e)

    @T.macro
    def inv_rms(a, inv, i, r):
        """r[0] = 1 / sqrt(mean(a[i]^2) + eps) in TOPI's rms_norm order (the squares, stored
        from inv[LANES] on, then their sum one after another), so the fusion changes no bit: a
        quantized input (the embedding) has exact rounding ties, which a differently rounded
        1 / rms would flip. r is inv, or a stack slot of its own: a running sum stored through
        a view of a shared buffer was written back at every element (three instructions an
        element, against one SVE `fadda` for four)."""
        squares(a, inv, i)
        r[0] = T.float32(0)
        for e in range(k):
            r[0] = r[0] + inv[LANES + e]
        r[0] = T.float32(1) / T.sqrt(r[0] / T.float32(k) + T.float32(rms_eps))

    @T.macro
    def blocks(a, g, u, aq, ad, off, i):
        if super_blocks:   # decided when the kernel is built (K: whole super-blocks)
            for s in range(full // sub):
                super_block(a, g, u, aq, ad, off, i, s)
        elif staged:
            xs = T.decl_buffer((SILU_STAGE * BLOCK,), "float32", scope="global")
            for c in range(full // SILU_STAGE):
                for v in range(SILU_STAGE * 2):
                    xs[T.ramp(v * HALF, 1, HALF)] = x_at(a, g, u, i, T.ramp(c * SILU_STAGE * BLOCK + v * HALF, 1, HALF),
                                                          HALF)
                for b in range(SILU_STAGE):
                    quantize_block(T, xs[T.ramp(b * BLOCK, 1, HALF)], xs[T.ramp(b * BLOCK + HALF, 1, HALF)], aq, ad,
                                   off, i, c * SILU_STAGE + b, zero_point, flat(i, c * SILU_STAGE + b))
            for b in range(full // SILU_STAGE * SILU_STAGE, full):
                block_vec(a, g, u, aq, ad, off, i, b)
        else:
            for b in range(full):
                block_vec(a, g, u, aq, ad, off, i, b)
        for b in range(full, nb):
            block_tail(a, g, u, aq, ad, off, i, b)

    @T.macro
    def rms_row_group(a, g, aq, ad, off, grp):
        """Rows ROW_GROUP grp .. of the many-row RMSNorm quantizer (x86): each row's sum of
        squares is TOPI's serial chain, as inv_rms's, but the group's chains run side by side,
        an add of each row per element. A lone chain waits on the add's latency (K = 896: ~60 us
        of a 100-token step's 63 us RMSNorm quantizer, 2 threads); the same bits."""
        sq = T.decl_buffer((ROW_GROUP * (LANES + k),), "float32", scope="global")
        for r in range(ROW_GROUP):
            own = T.decl_buffer((LANES + k,), "float32", data=sq.data, elem_offset=r * (LANES + k))
            if grp * ROW_GROUP + r < rows:
                squares(a, own, grp * ROW_GROUP + r)
            else:   # past the last row: a sum of zeros, never used
                for e in range(k):
                    own[LANES + e] = T.float32(0)
        s = T.decl_buffer((ROW_GROUP,), "float32", scope="global")   # stack slots: see inv_rms
        for r in T.unroll(ROW_GROUP):
            s[r] = T.float32(0)
        for e in range(k):
            for r in T.unroll(ROW_GROUP):
                s[r] = s[r] + sq[r * (LANES + k) + LANES + e]
        for r in range(ROW_GROUP):
            if grp * ROW_GROUP + r < rows:
                own = T.decl_buffer((LANES + k,), "float32", data=sq.data, elem_offset=r * (LANES + k))
                own[0] = T.float32(1) / T.sqrt(s[r] / T.float32(k) + T.float32(rms_eps))
                blocks(a, g, own, aq, ad, off, grp * ROW_GROUP + r)

    @T.macro
    def blocks_parallel(a, g, u, aq, ad, off, i):
        if super_blocks:
            for s in T.parallel(full // sub):
                super_block(a, g, u, aq, ad, off, i, s)
        else:
            for b in T.parallel(full):
                block_vec(a, g, u, aq, ad, off, i, b)
        for b in range(full, nb):
            block_tail(a, g, u, aq, ad, off, i, b)

    @T.macro
    def rms_blocks_parallel(a, g, aq, ad, off, i, h):
        """RMSNorm(a[i]) * g quantized by RMS_TASKS tasks, each with its own copy of the sum
        of squares in a buffer allocated once (no allocation per task); with `parts`, each
        writes its blocks' part of the sum h."""
        inv = T.decl_buffer((rms_tasks * (LANES + k),), "float32", scope="global")
        for c in T.parallel(rms_tasks):
            own = T.decl_buffer((LANES + k,), "float32", data=inv.data, elem_offset=c * (LANES + k))
            r = T.decl_buffer((1,), "float32", scope="global")   # a stack slot: see inv_rms
            inv_rms(a, own, i, r)
            if nb > full and c == 0:
                inv[0] = r[0]   # for the partial last block
            for j in range(chunk // sub):
                if c * chunk + j * sub < full:
                    if super_blocks:
                        super_block(a, g, r, aq, ad, off, i, c * (chunk // sub) + j)
                    else:
                        block_vec(a, g, r, aq, ad, off, i, c * chunk + j)
                    if parts > 1:
                        h[0, T.ramp((c * chunk + j * sub) * BLOCK, 1, BLOCK * sub)] = row(
                            a, i, T.ramp((c * chunk + j * sub) * BLOCK, 1, BLOCK * sub))
        for b in range(full, nb):   # a partial last block, with the first task's 1 / rms
            block_tail(a, g, inv, aq, ad, off, i, b)
        if parts > 1:
            for e in range(full * BLOCK, k):
                h[0, e] = row(a, i, e)

    @T.macro
    def rows_each(a, g, u, aq, ad, off, h):
        """A row a task (or serially, one_row)."""
        for i in T.serial(rows) if one_row else T.parallel(rows):
            if row_scale:   # decided when the kernel is built
                st = T.decl_buffer((LANES + k,), "float32", scope="global")   # 1 / rms, the row's values
                if rms_eps is not None:
                    inv_rms(a, st, i, st)
                    row_asym(a, g, st, aq, ad, off, i, st)
                else:
                    row_asym(a, g, u, aq, ad, off, i, st)
            elif split_rms:
                rms_blocks_parallel(a, g, aq, ad, off, i, h)
            elif rms_eps is not None:
                inv = T.decl_buffer((LANES + k,), "float32", scope="global")   # 1 / rms, the squares
                inv_rms(a, inv, i, inv)
                blocks(a, g, inv, aq, ad, off, i)
            elif split_blocks:
                blocks_parallel(a, g, u, aq, ad, off, i)
            else:
                blocks(a, g, u, aq, ad, off, i)

    @T.macro
    def quantize_rows(a, g, u, var_aq, var_ad, var_off, h=None):
        """The kernels' body from their inputs and their three output handles."""
        T.func_attr({"tir.noalias": True, "op_pattern": 8})  # opaque: FuseOps leaves it whole
        aq3 = T.match_buffer(var_aq, (rows, nb, BLOCK), "int8")
        ad2 = T.match_buffer(var_ad, scale_shape, "float32")
        off2 = T.match_buffer(var_off, off_shape, "int32")
        with T.sblock("root"):   # relax's reshape-pattern analysis insists on one (single input)
            # the ARM layouts address the outputs flat (pair_index)
            aq = aq3 if layout == "plain" else T.decl_buffer((rows * nb * BLOCK,), "int8", data=aq3.data)
            ad = ad2 if layout == "plain" else T.decl_buffer((rows * 2 if row_scale else rows * nb * copies,), "float32",
                                                             data=ad2.data)
            off = off2 if layout == "plain" else T.decl_buffer((rows * nb * copies,), "int32", data=off2.data)
            if row_groups:   # decided when the kernel is built
                for grp in T.parallel((rows + ROW_GROUP - 1) // ROW_GROUP):
                    rms_row_group(a, g, aq, ad, off, grp)
            else:
                rows_each(a, g, u, aq, ad, off, h)

    def mark(kernel, kind):
        eps = {} if rms_eps is None else {"eps": rms_eps}
        return kernel.with_attr(QUANTIZER, {"kind": kind, "layout": layout, "zero_point": zero_point, **eps,
                                             **({"super_blocks": 1} if super_blocks else {})})

    if silu_mul:
        @T.prim_func(private=True, check_well_formed=False)
        def kernel(var_g: T.handle, var_u: T.handle, var_aq: T.handle, var_ad: T.handle, var_off: T.handle):
            g = T.match_buffer(var_g, (rows, k), "float32")
            u = T.match_buffer(var_u, (rows, k), "float32")
            quantize_rows(None, g, u, var_aq, var_ad, var_off)
        return mark(kernel, "silu_mul")

    if parts > 1:
        @T.prim_func(private=True, check_well_formed=False)
        def kernel(x: T.Buffer((parts, k), "float32"), gamma: T.Buffer((k,), "float32"), var_aq: T.handle,
                   var_ad: T.handle, var_off: T.handle, h: T.Buffer((1, k), "float32")):
            quantize_rows(x, gamma, None, var_aq, var_ad, var_off, h)
        return mark(kernel, "rms")

    if rms_eps is not None:
        @T.prim_func(private=True, check_well_formed=False)
        def kernel(var_a: T.handle, gamma: T.Buffer((k,), "float32"), var_aq: T.handle, var_ad: T.handle,
                   var_off: T.handle):
            a = T.match_buffer(var_a, (rows, k), "float32")
            quantize_rows(a, gamma, None, var_aq, var_ad, var_off)
        return mark(kernel, "rms")

    @T.prim_func(private=True, check_well_formed=False)
    def kernel(var_a: T.handle, var_aq: T.handle, var_ad: T.handle, var_off: T.handle):
        a = T.match_buffer(var_a, (rows, k), "float32")
        quantize_rows(a, None, None, var_aq, var_ad, var_off)

    return mark(kernel, "plain")
