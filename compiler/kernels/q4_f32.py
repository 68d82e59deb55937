"""W4A32 matmul for any SIMD CPU: Q4_0 weights dequantized in registers, float32 activations
(`qwc compile --act-bits 32`, the path that matches onnxruntime's MatMulNBits).

A packed Q4_0 block is 16 bytes: the low nibbles are the block's even elements, the high
nibbles its odd ones. So the activations are first de-interleaved per block (even half, odd
half: K floats per token, cheap), and a row's dot product becomes 16 independent lanes

    partial[t] = sum_b  s[b] * (a_even[b, t] * (lo(w[b, t]) - 8) + a_odd[b, t] * (hi(w[b, t]) - 8))

one 16-byte load per block feeding two 16-lane FMAs: a vector loop LLVM emits directly, with
no gathers. The 16 lanes are summed once per output. Rows are split into parallel tasks of
`rows` rows; in prefill each task runs every token over its rows, so a row's weights are read
from memory once and then from L1.
"""

from __future__ import annotations

from tvm import s_tir, te, tirx

from . import hand_scheduled

BLOCK = 32
HALF = BLOCK // 2


def compute(a, w, s, *, k: int, n: int):
    """a [M, K] float32, w [N, NB, 16] uint8, s [N, NB] float32 -> the three TE stages."""
    m, nb = a.shape[0], w.shape[1]
    f32 = "float32"

    def deinterleave(i, b, h, t):
        kk = b * BLOCK + 2 * t + h
        if k % BLOCK == 0:
            return a[i, kk]
        return tirx.if_then_else(kk < k, a[i, tirx.min(kk, k - 1)], tirx.const(0.0, f32))

    ad = te.compute((m, nb, 2, HALF), deinterleave, name="act_deinterleave")
    rb = te.reduce_axis((0, nb), "b")

    def lanes(i, j, t):
        byte = w[j, rb, t]
        lo = (byte & tirx.const(15, "uint8")).astype(f32) - tirx.const(8.0, f32)
        hi = (byte >> tirx.const(4, "uint8")).astype(f32) - tirx.const(8.0, f32)
        return te.sum(s[j, rb] * (ad[i, rb, 0, t] * lo + ad[i, rb, 1, t] * hi), axis=rb)

    part = te.compute((m, n, HALF), lanes, name="lanes")
    rt = te.reduce_axis((0, HALF), "t")
    y = te.compute((m, n), lambda i, j: te.sum(part[i, j, rt], axis=rt), name="matmul_q4_f32")
    return ad, part, y


# The schedule's knobs: `rows` output rows per parallel task, `tokens` tokens per tile in
# prefill (one 16-byte weight load then feeds `tokens` tokens' FMAs). The defaults are the hand
# schedule; `qwc tune` searches CHOICES (compiler/tuning.py), which contain them.
DEFAULTS = {"rows": 8, "tokens": 1}
CHOICES = {"rows": (1, 2, 4, 8, 16, 32), "tokens": (1, 2, 4, 8)}


def prim_func(k: int, n: int, nb: int, one_token: bool, m: int | None = None) -> tirx.PrimFunc:
    """The unscheduled PrimFunc (a [M, K], w, s) -> y [M, N]; M = 1 when `one_token`, else `m`
    (a fixed token count, for tuning) or any."""
    m = 1 if one_token else (m or tirx.Var("m", "int64"))
    a = te.placeholder((m, k), "float32", name="a")
    w = te.placeholder((n, nb, HALF), "uint8", name="w")
    s = te.placeholder((n, nb), "float32", name="s")
    _, _, y = compute(a, w, s, k=k, n=n)
    return te.create_prim_func([a, w, s, y]).without_attr("global_symbol")


def apply_schedule(sch: s_tir.Schedule, n: int, one_token: bool, rows, tokens) -> None:
    """The hand schedule with its knobs: ints, or a tuner's sampled values (ExprRVs), which
    always take the tiled structure (a sampled tile of 1 is a unit loop)."""
    by, bp = sch.get_sblock("matmul_q4_f32"), sch.get_sblock("lanes")
    i, j, _t = sch.get_loops(by)
    if isinstance(rows, int) and n % rows:
        rows = 1
    tiled = not one_token and not (isinstance(tokens, int) and tokens == 1)
    jo, ji = sch.split(j, [None, rows])
    if tiled:
        io, ii = sch.split(i, [None, tokens])
        sch.reorder(jo, io, ji, ii)
    else:
        sch.reorder(jo, i, ji)
    sch.parallel(jo)
    # Unit loops stay (a sampled knob of 1 must not change the loop count a tuning trace replays).
    sch.compute_at(bp, ji, preserve_unit_loops=True)
    sch.set_scope(bp, 0, "local")  # the accumulators: registers, not memory
    loops = sch.get_loops(bp)
    if tiled:
        ii, t, b = loops[-3:]
        sch.reorder(b, ii, t)
        sch.unroll(ii)  # the tile's tokens share each dequantized weight vector
    else:
        t, b = loops[-2:]
        sch.reorder(b, t)
    sch.vectorize(t)
    sch.decompose_reduction(bp, b)
    if not one_token:
        sch.parallel(sch.get_loops(sch.get_sblock("act_deinterleave"))[0])


def kernel(k: int, n: int, nb: int, one_token: bool, knobs: dict | None = None,
           m: int | None = None) -> tirx.PrimFunc:
    """The scheduled PrimFunc, with the hand schedule's knobs unless `knobs` says otherwise."""
    kn = {**DEFAULTS, **(knobs or {})}
    sch = s_tir.Schedule(prim_func(k, n, nb, one_token, m))
    apply_schedule(sch, n, one_token, kn["rows"], kn["tokens"])
    return hand_scheduled(sch.mod["main"]).with_attr("op_pattern", 8)
