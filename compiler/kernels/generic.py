"""Target-independent kernels, written as TE computations and lowered by TVM.

They define the semantics every specialised kernel must match: int4/int8 block-dequantized
matmul (the weight is dequantized inside the reduction, never materialised), block-quantized
gather, rotary embedding, and attention over the KV-cache buffer.
"""

from __future__ import annotations

from tvm import te, tirx

from . import hand_scheduled
from .kernel_cache import cached_kernel


def _q4(byte, k):
    """q - 8 of element k from the packed byte holding it (even k: low nibble, odd: high)."""
    nib = tirx.if_then_else(k % 2 == 0, byte & tirx.const(15, "uint8"), byte >> tirx.const(4, "uint8"))
    return nib.astype("float32") - tirx.const(8.0, "float32")


def q4_1_min(d, zp):
    """Q4_1's block minimum m from MatMulNBits' (scale d, float zero point zp): the fp16
    nearest -zp * d (models/gguf_blocks.py: q4_1_mins), exactly the file's m."""
    return (-(zp * d)).astype("float16").astype("float32")


def _dequant(w, s, n, k, block: int, bits: int, scale_3d: bool = False, zp=None):
    """Weight element (n, k) of a block-quantized [N, blocks, bytes] uint8 tensor; with float
    zero points `zp` (Q4_1) d * q + m."""
    b = k // block
    d = (s[n, b, 0] if scale_3d else s[n, b]).astype("float32")   # fp16 scales: repack.half_gather_scales
    if zp is not None:
        byte = w[n, b, (k % block) // 2]
        nib = tirx.if_then_else(k % 2 == 0, byte & tirx.const(15, "uint8"), byte >> tirx.const(4, "uint8"))
        return nib.astype("float32") * d + q4_1_min(d, zp[n, b])
    if bits == 4:
        q = _q4(w[n, b, (k % block) // 2], k)
    else:
        q = w[n, b, k % block].astype("float32") - tirx.const(128.0, "float32")
    return q * d


def matmul_nbits(a, w, s, zp=None, *, k: int, n: int, block: int, bits: int):
    """a [..., K] float32 x block-quantized W [N, K] (float zero points `zp`: Q4_1) -> [..., N]."""
    lead = list(a.shape[:-1])
    r = te.reduce_axis((0, k), "k")

    def body(*idx):
        *pre, j = idx
        return te.sum(a[(*pre, r)] * _dequant(w, s, j, r, block, bits, zp=zp), axis=r)

    return te.compute((*lead, n), body, name="matmul_nbits")


def gather_block_quantized(w, idx, s, *, block: int, bits: int):
    """Rows `idx` [...] of block-quantized W [V, blocks, bytes] -> [..., blocks, block]."""
    nb = w.shape[1]

    def body(*i):
        *pre, b, e = i
        row = idx[tuple(pre)].astype("int64")
        return _dequant(w, s, row, b * block + e, block, bits, scale_3d=True)

    return te.compute((*idx.shape, nb, block), body, name="gather_block_quantized")


def gather_q4_row_groups(w, idx, s):
    """Rows `idx` [...] of a Q4_0 weight stored in the W4A8 kernels' row-group layout
    (kernels/row_groups.py; w [G, nb, 4, 4 x ROWS], s [G, nb, ROWS]) -> [..., nb, 32]:
    a tied embedding reads the lm_head's repacked bytes rather than keep a second copy."""
    from .row_groups import ROWS

    nb = w.shape[1]

    def body(*i):
        *pre, b, e = i
        row = idx[tuple(pre)].astype("int64")
        g, r, t = row // ROWS, row % ROWS, e // 2   # byte t of the row's block holds elements 2t, 2t+1
        return _q4(w[g, b, t // 4, r * 4 + t % 4], e) * s[g, b, r].astype("float32")

    return te.compute((*idx.shape, nb, 32), body, name="gather_q4_row_groups")


def gather_q4_k_compact(w, idx, ws, wc):
    """Rows `idx` [...] of an untied Q4_K table (compiler/repack_q4_k.py: q4_k_gather): its
    codes as GatherBlockQuantized holds them (w [V, nb, 16], byte t elements 2t and 2t + 1),
    its factors in kernels/q4_k_scales.py's compact form (x86's bytes or ARM's six-bit pairs,
    in row groups) -> [..., nb, 32]: d sc q - dmin mn, the file's weights."""
    from . import q4_k_scales
    from .row_groups import ROWS

    nb = w.shape[1]

    def body(*i):
        *pre, b, e = i
        row = idx[tuple(pre)].astype("int64")
        byte = w[row, b, e // 2]
        q = tirx.if_then_else(e % 2 == 0, byte & tirx.const(15, "uint8"), byte >> tirx.const(4, "uint8"))
        scale, minimum = q4_k_scales.element_factors(ws, wc, row // ROWS, b, row % ROWS)
        return scale * q.astype("float32") - minimum

    return te.compute((*idx.shape, nb, 32), body, name="gather_q4_k_compact")


def _int8_row_group_gather(w, idx, scale, *, signed: bool, name: str, six_bit: bool = False):
    """Rows `idx` [...] of 8-bit codes in the W8A8 kernels' row groups (row_groups.pack_int8;
    w [G, nb, 8, 4 x ROWS] in de-interleaved order, q (`signed`, ARM) or q + 128 (x86); with
    `six_bit`, Q6_K's six-bit forms [G, nb, 6, 4 x ROWS]: x86's of q + 32, six_bit_codes, or
    with `signed` ARM's of 4 q, arm_six_bit_codes (repack_q6_k.py)) -> [..., nb, 32], element e
    of block b of row r in group g times scale(g, b, r, e)."""
    from .row_groups import ROWS

    nb = w.shape[1]

    def body(*i):
        *pre, b, e = i
        row = idx[tuple(pre)].astype("int64")
        g, r, p = row // ROWS, row % ROWS, e // 2 + 16 * (e % 2)   # evens first, then odds
        c, at = p // 4, r * 4 + p % 4
        if six_bit and signed:   # chunk 4h + j of chunks 3h .. 3h + 2: 4 q in bytes
            h, j = c // 4, c % 4

            def part(i, shift):
                return (w[g, b, 3 * h + i, at].astype("int32") % 4) << shift

            four_q = tirx.if_then_else(j < 3, w[g, b, 3 * h + tirx.min(j, 2), at].astype("int32") // 4 * 4,
                                       part(0, 6) + part(1, 4) + part(2, 2))
            return (four_q - tirx.if_then_else(four_q > 127, 256, 0)).astype("float32") * scale(g, b, r, e)
        if six_bit:
            nib = w[g, b, c % 4, at].astype("int32")
            top = w[g, b, 4 + c // 4, at].astype("int32")
            q = tirx.if_then_else(c < 4, nib % 16, nib // 16) + (top >> (2 * (c % 4)).astype("int32")) % 4 * 16
            return (q - 32).astype("float32") * scale(g, b, r, e)
        byte = w[g, b, c, at]
        code = tirx.reinterpret("int8", byte).astype("float32") if signed else \
            byte.astype("float32") - tirx.const(128.0, "float32")
        return code * scale(g, b, r, e)

    return te.compute((*idx.shape, nb, 32), body, name=name)


def gather_q8_row_groups(w, idx, s, *, signed: bool):
    """Rows `idx` [...] of a Q8_0 weight stored in the W8A8 kernels' row groups (s [G, nb,
    ROWS]) -> [..., nb, 32]: the tied embedding of a Q8_0 output."""
    return _int8_row_group_gather(w, idx, lambda g, b, r, e: s[g, b, r].astype("float32"), signed=signed,
                                  name="gather_q8_row_groups")


def gather_q6_k_row_groups(w, idx, sc, d, *, isa: str):
    """Rows `idx` [...] of a Q6_K weight stored for its `isa`'s kernel (compiler/repack_q6_k.py:
    the codes in Q8_0's order at six bits, each ISA's arrangement; int8 sub-block scales sc
    [G, nb, 32], A's 16 rows then B's; d [G, nb / 8, ROWS], on ARM scaled by 1/4 for its codes
    4 (q - 32), exactly) -> [..., nb, 32]: the tied embedding of a Q6_K output, each weight
    (d sc) (q - 32) as the file's."""
    from .row_groups import ROWS

    def super_scale(g, b, r):
        dv = d[g, b // 8, r].astype("float32")
        return dv * 0.25 if isa == "arm" else dv

    return _int8_row_group_gather(
        w, idx, lambda g, b, r, e: sc[g, b, (e // 16) * ROWS + r].astype("float32") * super_scale(g, b, r),
        signed=isa == "arm", six_bit=True, name="gather_q6_k_row_groups")


def rotary(x, pos, cos, sin, *, heads: int):
    """Rotate-half rotary on x [b, s, heads*head_dim] at positions pos [b, s]."""
    width = x.shape[2]
    d = width // heads
    half = d // 2

    def body(b, i, c):
        dd = c % d
        base = c - dd
        p = pos[b, i]
        lo = dd < half
        j = tirx.if_then_else(lo, dd, dd - half)
        partner = tirx.if_then_else(lo, x[b, i, base + dd + half], x[b, i, base + dd - half])
        sign = tirx.if_then_else(lo, tirx.const(-1.0, "float32"), tirx.const(1.0, "float32"))
        return x[b, i, c] * cos[p, j] + sign * partner * sin[p, j]

    return te.compute(x.shape, body, name="rotary")


def attention(q, kc, vc, seqlens, *, heads: int, kv_heads: int, head_dim: int, scale: float):
    """Causal attention of q [1, s, heads*head_dim] over the cache buffers [1, kv_heads, C,
    head_dim]. Query i sits at position past + i, past = seqlens[0] + 1 - s; it sees cache
    slots 0 .. past + i. The caches may be float16 (kernels/kv_cache.py: KV_DTYPES)."""
    s = q.shape[1]
    cap = kc.shape[2]
    group = heads // kv_heads
    past = seqlens[0].astype("int64") + 1 - s
    r = te.reduce_axis((0, head_dim), "d")
    dot = te.compute(
        (heads, s, cap),
        lambda h, i, j: te.sum(q[0, i, h * head_dim + r] * kc[0, h // group, j, r].astype("float32"), axis=r),
        name="attn_dot")
    score = te.compute(
        (heads, s, cap),
        lambda h, i, j: tirx.if_then_else(j <= past + i, dot[h, i, j] * tirx.const(scale, "float32"),
                                          tirx.const(-3.0e38, "float32")),
        name="attn_score")
    jm = te.reduce_axis((0, cap), "jm")
    mx = te.compute((heads, s), lambda h, i: te.max(score[h, i, jm], axis=jm), name="attn_max")
    ex = te.compute((heads, s, cap), lambda h, i, j: te.exp(score[h, i, j] - mx[h, i]), name="attn_exp")
    js = te.reduce_axis((0, cap), "js")
    den = te.compute((heads, s), lambda h, i: te.sum(ex[h, i, js], axis=js), name="attn_den")
    jv = te.reduce_axis((0, cap), "jv")
    num = te.compute(
        (1, s, heads * head_dim),
        lambda b, i, c: te.sum(ex[c // head_dim, i, jv]
                               * vc[0, (c // head_dim) // group, jv, c % head_dim].astype("float32"), axis=jv),
        name="attn_num")
    out = te.compute((1, s, heads * head_dim), lambda b, i, c: num[b, i, c] / den[c // head_dim, i],
                     name="attn_out")
    return out


def _act_q8(a, lead, k: int, block: int):
    """Activations [..., K] as llama.cpp's Q8_0 blocks: (scales [..., nb], int8 [..., nb * block])."""
    nb = (k + block - 1) // block
    e = te.reduce_axis((0, block), "e")

    def a_at(pre, kk):
        return tirx.if_then_else(kk < k, a[(*pre, tirx.min(kk, k - 1))], tirx.const(0.0, "float32"))

    amax = te.compute((*lead, nb), lambda *i: te.max(tirx.abs(a_at(i[:-1], i[-1] * block + e)), axis=e),
                      name="act_amax")
    dscale = te.compute((*lead, nb), lambda *i: amax[i] / tirx.const(127.0, "float32"), name="act_scale")

    def quant(*i):
        *pre, kk = i
        d = dscale[(*pre, kk // block)]
        v = tirx.if_then_else(d > tirx.const(0.0, "float32"), a_at(pre, kk) / d, tirx.const(0.0, "float32"))
        return tirx.round(v).astype("int8")

    return dscale, te.compute((*lead, nb * block), quant, name="act_q8")


def block_sums(a, *, k: int, act_bits: int, block: int = 32):
    """The block sums [..., K/32] of a [..., K] a Q4_1 matmul's offsets multiply (compiler/repack.py:
    q4_1_block_offsets): at 8-bit activations the Q8_0 blocks' (scale x sum of the codes, as
    llama.cpp's Q8_1 carries it), at 32 the float ones. A kernel of its own, so the linears that
    read the same activations (q, k, v; gate, up) share one."""
    lead = list(a.shape[:-1])
    nb = (k + block - 1) // block
    e = te.reduce_axis((0, block), "e")
    if act_bits == 8:
        dscale, aq = _act_q8(a, lead, k, block)
        isum = te.compute((*lead, nb), lambda *i: te.sum(aq[(*i[:-1], i[-1] * block + e)].astype("int32"), axis=e),
                          name="act_code_sum")
        return te.compute((*lead, nb), lambda *i: dscale[i] * isum[i].astype("float32"), name="act_block_sum")
    return te.compute((*lead, nb), lambda *i: te.sum(tirx.if_then_else(
        i[-1] * block + e < k, a[(*i[:-1], tirx.min(i[-1] * block + e, k - 1))], tirx.const(0.0, "float32")),
        axis=e), name="act_block_sum")


def block_offsets_term(bsum, c):
    """y [..., N] = sum over blocks b of c [N, b] x bsum [..., b] (block_sums)."""
    b = te.reduce_axis((0, c.shape[1]), "b")
    return te.compute((*bsum.shape[:-1], c.shape[0]), lambda *i: te.sum(bsum[(*i[:-1], b)] * c[i[-1], b], axis=b),
                      name="block_offsets_term")


def matmul_nbits_a8(a, w, s, zp=None, *, k: int, n: int, block: int, bits: int):
    """W4A8: activations quantized per block to int8 on the fly (llama.cpp's Q8_0: scale =
    amax / 127), integer dot products per block (int8 x int8 -> int32, which LLVM lowers to
    sdot / vpdpbusd where the target has them), block scales applied in fp32. With float zero
    points `zp` (Q4_1) the codes are unsigned and each block adds m * scale * sum(a), as
    llama.cpp's Q4_1 x Q8_1 dot does."""
    lead = list(a.shape[:-1])
    nb = (k + block - 1) // block
    dscale, aq = _act_q8(a, lead, k, block)

    i32 = "int32"
    if bits == 4:   # a byte's two codes at once: no select between nibbles, so LLVM vectorizes it
        e2 = te.reduce_axis((0, block // 2), "e2")
        centre = tirx.const(0 if zp is not None else 8, i32)

        def block_dot(*i):
            byte, at = w[i[-2], i[-1], e2], (*i[:-2], i[-1] * block + 2 * e2)
            lo = (byte & tirx.const(15, "uint8")).astype(i32) - centre
            hi = (byte >> tirx.const(4, "uint8")).astype(i32) - centre
            return te.sum(aq[at].astype(i32) * lo + aq[(*at[:-1], at[-1] + 1)].astype(i32) * hi, axis=e2)
    else:
        e2 = te.reduce_axis((0, block), "e2")

        def block_dot(*i):
            q = w[i[-2], i[-1], e2].astype(i32) - tirx.const(128, i32)
            return te.sum(aq[(*i[:-2], i[-1] * block + e2)].astype(i32) * q, axis=e2)

    acc = te.compute((*lead, n, nb), block_dot, name="block_dot")
    b = te.reduce_axis((0, nb), "b")
    if zp is None:
        return te.compute(
            (*lead, n),
            lambda *i: te.sum(acc[(*i, b)].astype("float32") * s[i[-1], b] * dscale[(*i[:-1], b)], axis=b),
            name="matmul_nbits_a8")
    e3 = te.reduce_axis((0, block), "e3")
    asum = te.compute((*lead, nb), lambda *i: te.sum(aq[(*i[:-1], i[-1] * block + e3)].astype("int32"), axis=e3),
                      name="act_sum")

    def q4_1(*i):
        d, da = s[i[-1], b].astype("float32"), dscale[(*i[:-1], b)]
        return te.sum(acc[(*i, b)].astype("float32") * d * da
                      + q4_1_min(d, zp[i[-1], b]) * (da * asum[(*i[:-1], b)].astype("float32")), axis=b)

    return te.compute((*lead, n), q4_1, name="matmul_nbits_a8")


ROTARY_LANES = 4   # fp32 lanes of the narrowest vector (NEON); wider targets widen in LLVM


@cached_kernel   # the same kernel every layer and every compile (kernel_cache.py)
def rotary_halves(width: int, heads: int, pos_dtype: str, head_norm: float | None = None):
    """`rotary` as TIR over the two halves of each head: one vector load of the low half, the
    high half and cos / sin each, two vector FMAs, two stores. The TE form indexes every
    element through `c % head_dim` and a select, which TVM scalarises (~12 instructions an
    element on aarch64; this takes ~1.5). Same expressions as `rotary`, so the same bits:
    lo * cos + (-hi) * sin and hi * cos + lo * sin. None where a half is not whole vectors.

    x, y [b, s, width], pos [b, s], cos / sin [P, head_dim / 2]. With `head_norm` (an epsilon:
    Qwen3's QK-norm, kernels/head_norm.py) each head is normed first, and a gain [head_dim]
    comes after x. Rows run on the calling thread below schedule.MIN_PARALLEL elements (a
    decode step), in parallel above."""
    from tvm.script import tirx as T

    from ..schedule import MIN_PARALLEL
    from .head_norm import inv_rms

    d = width // heads
    half = d // 2
    if width % heads or d % 2 or half % ROTARY_LANES:
        return None
    vecs = half // ROTARY_LANES
    L = ROTARY_LANES
    norm = head_norm is not None
    rms = inv_rms(T, d, head_norm if norm else 0.0)

    @T.macro
    def row(x, g, pos, cos, sin, y, r, s):
        bi = r // s
        si = r % s
        p = T.bind(pos[bi, si])
        # the row's x, y, cos and sin through pointers to their first: indexed from the
        # buffers, every store to y reloaded the shape and position it was addressed by
        xr = T.decl_buffer((width,), "float32", data=T.bind(T.address_of(x[bi, si, 0])))
        yr = T.decl_buffer((width,), "float32", data=T.bind(T.address_of(y[bi, si, 0])))
        cr = T.decl_buffer((half,), "float32", data=T.bind(T.address_of(cos[p, 0])))
        sr = T.decl_buffer((half,), "float32", data=T.bind(T.address_of(sin[p, 0])))
        for h in range(heads):
            if norm:
                sq = T.decl_buffer((d + 1,), "float32", scope="global")   # a stack slot
                rms(x, bi, si, h * d, sq)
                for c in range(vecs):
                    lo = T.bind(xr[T.ramp(h * d + c * L, 1, L)] * T.broadcast(sq[d], L) * g[T.ramp(c * L, 1, L)])
                    hi = T.bind(xr[T.ramp(h * d + half + c * L, 1, L)] * T.broadcast(sq[d], L)
                                * g[T.ramp(half + c * L, 1, L)])
                    cs = T.bind(cr[T.ramp(c * L, 1, L)])
                    sn = T.bind(sr[T.ramp(c * L, 1, L)])
                    yr[T.ramp(h * d + c * L, 1, L)] = lo * cs + (-hi) * sn
                    yr[T.ramp(h * d + half + c * L, 1, L)] = hi * cs + lo * sn
            else:
                for c in range(vecs):
                    lo = T.bind(xr[T.ramp(h * d + c * L, 1, L)])
                    hi = T.bind(xr[T.ramp(h * d + half + c * L, 1, L)])
                    cs = T.bind(cr[T.ramp(c * L, 1, L)])
                    sn = T.bind(sr[T.ramp(c * L, 1, L)])
                    yr[T.ramp(h * d + c * L, 1, L)] = lo * cs + (-hi) * sn
                    yr[T.ramp(h * d + half + c * L, 1, L)] = hi * cs + lo * sn

    @T.macro
    def rows(var_x, g, var_pos, var_cos, var_sin, var_y):
        """Every row of x (one call's tokens), g: the norm's gain or None."""
        T.func_attr({"tir.noalias": True})
        b, s_, npos = T.int64(), T.int64(), T.int64()
        x = T.match_buffer(var_x, (b, s_, width), "float32")
        pos = T.match_buffer(var_pos, (b, s_), pos_dtype)
        cos = T.match_buffer(var_cos, (npos, half), "float32")
        sin = T.match_buffer(var_sin, (npos, half), "float32")
        y = T.match_buffer(var_y, (b, s_, width), "float32")
        if b * s_ * width >= MIN_PARALLEL:
            for r in T.parallel(b * s_):
                row(x, g, pos, cos, sin, y, r, s_)
        else:
            for r in range(b * s_):
                row(x, g, pos, cos, sin, y, r, s_)

    if norm:
        @T.prim_func(private=True)
        def kernel(var_x: T.handle, g: T.Buffer((d,), "float32"), var_pos: T.handle, var_cos: T.handle,
                   var_sin: T.handle, var_y: T.handle):
            rows(var_x, g, var_pos, var_cos, var_sin, var_y)
        return hand_scheduled(kernel)

    @T.prim_func(private=True)
    def kernel(var_x: T.handle, var_pos: T.handle, var_cos: T.handle, var_sin: T.handle, var_y: T.handle):
        rows(var_x, None, var_pos, var_cos, var_sin, var_y)

    return hand_scheduled(kernel)
