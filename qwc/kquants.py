"""qwc's own quantizers for llama.cpp's Q4_K, Q5_K, Q5_0, Q5_1 and Q6_K (`qwc optimize --format
q4_k_m` and the other K mixes): float
weights [N, K] -> the GGUF bytes of those formats, bit for bit what llama.cpp reads
(models/gguf_blocks.py turns them into the canonical graph's blocks, as it does a
downloaded file's).

Round-to-nearest from a block's extremes wastes codes: one outlier sets the step for all 32
weights. Both quantizers search instead, per block of 32, for the scale (and Q4_K's minimum)
that leaves the smallest error weighted by each input channel's importance: the importance
matrix, the mean square of that channel's activations on calibration text, so the error
minimised is the expected error of the linear's output (each weight's error times its
input). Without one every channel weighs the same (the weights' own squared error).

- Q4_K: per sub-block of 32, a grid of steps around (max - min) / 15, each with codes rounded
  and then scale and minimum refitted by weighted least squares (the minimum held at or below
  zero, as the format stores it); the 8 sub-block scales and minimums then take 6-bit codes
  under one fp16 d and dmin per super-block of 256, and the weights are rounded again against
  the values the file will hold.
- Q5_K: Q4_K's search with codes 0..31; Q5_1 (Q5_K's fallback for rows that are not whole
  super-blocks): the same sub-block search a block of 32, its d and minimum as fp16.
- Q5_0: per block, a grid of steps around max / -16 (Q5_0's own rule: the largest magnitude
  maps to -16), each refitted by weighted least squares, the best kept as fp16.
- Q6_K: per sub-block of 16, Q5_0's search with 6-bit codes (around max / -32); the 16
  sub-block scales then take int8 codes under one fp16 d per super-block (the largest maps to
  -128, as llama.cpp writes it), and the weights are rounded again against the scales the file
  will hold.
"""

from __future__ import annotations

import numpy as np

BLOCK = 32
SUPER = 256
# Steps searched, as multiples of the round-to-nearest step: a grid wide enough to let an
# outlier clip when that lowers the weighted error.
STEP_FACTORS = np.linspace(0.8, 1.15, 15)
# Weights a chunk of rows: the search holds about ten float64 temporaries of a chunk (8 MB each
# at 2^20 weights), one chunk a thread.
CHUNK_ELEMENTS = 1 << 20


def _row_chunks(n: int, k: int):
    rows = max(1, CHUNK_ELEMENTS // k)
    for r in range(0, n, rows):
        yield slice(r, min(r + rows, n))


def _by_chunks(w: np.ndarray, out: np.ndarray, rows_fn, imp: np.ndarray) -> np.ndarray:
    """out[rows] = rows_fn(w[rows], imp) over chunks of rows, on a thread per core: numpy's
    array arithmetic releases the GIL, so the chunks' searches overlap."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    def one(rows):
        out[rows] = rows_fn(w[rows], imp)

    chunks = list(_row_chunks(*w.shape))
    workers = min(len(chunks), len(os.sched_getaffinity(0)))
    if workers <= 1:
        for rows in chunks:
            one(rows)
        return out
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(one, chunks))
    return out


def _fp16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float32)


Q4_TOP, Q5_TOP = 15, 31   # the largest code of Q4_K's sub-blocks and of Q5_K's (and Q5_1's blocks)


def _k_sub_blocks(x: np.ndarray, imp: np.ndarray, top: int = Q4_TOP) -> tuple[np.ndarray, np.ndarray]:
    """Each sub-block's scale s >= 0 and minimum m >= 0 (x ~ s q - m, q in 0..top), searched:
    x, imp [B, 32] float64."""
    lo = np.minimum(x.min(axis=1), 0)
    span = x.max(axis=1) - lo
    flat = span <= 0
    span = np.where(flat, 1, span)
    best_s, best_m = span / top, -lo
    best_err = np.full(len(x), np.inf)
    sw = imp.sum(axis=1)
    swx = (imp * x).sum(axis=1)
    for f in STEP_FACTORS:
        step = span / top * f
        q = np.clip(np.rint((x - lo[:, None]) / step[:, None]), 0, top)
        swq, swqq, swqx = (imp * q).sum(axis=1), (imp * q * q).sum(axis=1), (imp * q * x).sum(axis=1)
        det = sw * swqq - swq * swq
        ok = det > 0
        det = np.where(ok, det, 1)
        s = np.where(ok, (sw * swqx - swq * swx) / det, step)
        b = np.where(ok, (swqq * swx - swq * swqx) / det, lo)   # x ~ s q + b
        pos = b > 0                                              # the format's minimum is <= 0
        s = np.where(pos, swqx / np.where(swqq > 0, swqq, 1), s)
        b = np.where(pos, 0, b)
        s = np.maximum(s, 0)
        err = (imp * (x - s[:, None] * q - b[:, None]) ** 2).sum(axis=1)
        better = err < best_err
        best_s, best_m, best_err = np.where(better, s, best_s), np.where(better, -b, best_m), np.where(better, err, best_err)
    best_s = np.where(flat, 0, best_s)
    best_m = np.where(flat, -lo, best_m)
    return best_s, best_m


def _six_bit(v: np.ndarray, weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[S, 8] non-negative values -> fp16 super-block factor [S] and 6-bit codes [S, 8]: the
    factor searched, as the sub-blocks' steps are, for the smallest error of the values
    weighted by `weight` [S, 8] (how much an error in each value costs the weights: a scale's
    sum of importance x q^2, a minimum's sum of importance), then refitted by least squares."""
    top = v.max(axis=1)
    best_d, best_err = _fp16(top / 63), np.full(len(v), np.inf)
    for f in STEP_FACTORS:
        d = top / 63 * f
        codes = np.clip(np.rint(v / np.where(d > 0, d, 1)[:, None]), 0, 63)
        scc = (weight * codes * codes).sum(axis=1)
        d = _fp16(np.where(scc > 0, (weight * codes * v).sum(axis=1) / np.where(scc > 0, scc, 1), d))
        codes = np.clip(np.rint(v / np.where(d > 0, d, 1)[:, None]), 0, 63)
        err = (weight * (v - d[:, None] * codes) ** 2).sum(axis=1)
        better = err < best_err
        best_d, best_err = np.where(better, d, best_d), np.where(better, err, best_err)
    codes = np.clip(np.rint(v / np.where(best_d > 0, best_d, 1)[:, None]), 0, 63)
    return best_d, np.where(best_d[:, None] > 0, codes, 0).astype(np.uint8)


def _k_codes(x: np.ndarray, d: np.ndarray, sc: np.ndarray, dmin: np.ndarray, mn: np.ndarray,
             top: int = Q4_TOP) -> np.ndarray:
    """Codes [B, 32] (0..top) nearest x against what the file holds: steps d sc, minimums dmin mn."""
    step = (d[:, None] * sc).reshape(-1)
    low = (dmin[:, None] * mn).reshape(-1)
    q = np.clip(np.rint((x + low[:, None]) / np.where(step > 0, step, 1)[:, None]), 0, top)
    return np.where(step[:, None] > 0, q, 0)


def _refit_super(x, imp, q, d, sc, dmin, mn) -> tuple[np.ndarray, np.ndarray]:
    """d and dmin of each super-block refitted by weighted least squares to its codes (x ~
    d (sc q) - dmin mn over 256 weights), as fp16; kept where the fit does not lower the error."""
    a = (sc[:, :, None] * q.reshape(-1, 8, BLOCK)).reshape(len(d), -1)        # d's column
    c = -np.repeat(mn, BLOCK, axis=1).astype(np.float64)                     # dmin's column
    xs, ws = x.reshape(len(d), -1), imp.reshape(len(d), -1)
    saa, scc, sac = (ws * a * a).sum(1), (ws * c * c).sum(1), (ws * a * c).sum(1)
    sax, scx = (ws * a * xs).sum(1), (ws * c * xs).sum(1)
    det = saa * scc - sac * sac
    ok = det > 0
    det = np.where(ok, det, 1)
    nd = _fp16(np.where(ok, (scc * sax - sac * scx) / det, d))
    ndmin = _fp16(np.where(ok, (saa * scx - sac * sax) / det, dmin))
    ok &= (nd >= 0) & (ndmin >= 0)

    def err(dd, mm):
        return (ws * (xs - dd[:, None] * a - mm[:, None] * c) ** 2).sum(1)

    keep = ~ok | (err(nd, ndmin) >= err(d, dmin))
    return np.where(keep, d, nd), np.where(keep, dmin, ndmin)


def q4_k_params(w: np.ndarray, imp: np.ndarray, top: int = Q4_TOP) -> tuple[np.ndarray, ...]:
    """The searched super-block parameters of rows w [N, 256 S] (importance [256 S]): d, dmin
    [N S] (fp16 values) and the 6-bit sc, mn [N S, 8]; `top` Q5_TOP: Q5_K's, whose codes go to 31."""
    n, k = w.shape
    x = w.astype(np.float64).reshape(-1, BLOCK)
    im = np.broadcast_to(imp.reshape(1, k // BLOCK, BLOCK), (n, k // BLOCK, BLOCK)).reshape(-1, BLOCK)
    s, m = _k_sub_blocks(x, im, top)
    q = np.clip(np.rint((x + m[:, None]) / np.where(s > 0, s, 1)[:, None]), 0, top)
    d, sc = _six_bit(s.reshape(-1, 8), (im * q * q).sum(axis=1).reshape(-1, 8))
    dmin, mn = _six_bit(m.reshape(-1, 8), im.sum(axis=1).reshape(-1, 8))
    q = _k_codes(x, d, sc, dmin, mn, top)
    d, dmin = _refit_super(x, im, q, d, sc, dmin, mn)
    return d, dmin, sc, mn


def q4_k_steps(d, dmin, sc, mn) -> tuple[np.ndarray, np.ndarray]:
    """Each sub-block's step d sc and minimum dmin mn [N S, 8], as the file's values give them."""
    return d[:, None] * sc, dmin[:, None] * mn


def _k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """The 12 bytes [S', 12] holding a super-block's 6-bit sc and mn [S', 8] (Q4_K's and Q5_K's):
    sub-blocks 0-3 six bits each in bytes 0-3 (scales) and 4-7 (minimums); 4-7 their low
    nibbles in bytes 8-11 (scale low, minimum high), their top two bits above bytes 0-7's."""
    out = np.empty((len(sc), 12), np.uint8)
    out[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
    return out


def _low_nibbles(q: np.ndarray) -> np.ndarray:
    """[S', 128] bytes of codes q [S', 256] (sub-block by sub-block): a byte holds sub-block 2p's
    low four bits low and 2p + 1's high."""
    q = (q.astype(np.uint8) & 15).reshape(len(q), 4, 2, BLOCK)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(len(q), 128)


def pack_q4_k(d, dmin, sc, mn, q: np.ndarray) -> np.ndarray:
    """Q4_K super-blocks [S', 144] from their fp16 d, dmin [S'], 6-bit sc, mn [S', 8] and codes
    q [S', 256] (0..15, sub-block by sub-block)."""
    nsup = len(d)
    raw = np.zeros((nsup, 144), np.uint8)
    raw[:, 0:2] = d.astype(np.float16).view(np.uint8).reshape(nsup, 2)
    raw[:, 2:4] = dmin.astype(np.float16).view(np.uint8).reshape(nsup, 2)
    raw[:, 4:16] = _k_scales(sc, mn)
    raw[:, 16:] = _low_nibbles(q.reshape(nsup, -1))
    return raw


def pack_q5_k(d, dmin, sc, mn, q: np.ndarray) -> np.ndarray:
    """Q5_K super-blocks [S', 176]: Q4_K's fields and the fifth bits of codes q [S', 256]
    (0..31), bit j of byte l for weight l of sub-block j, before the low nibbles."""
    nsup = len(d)
    q = q.astype(np.uint8).reshape(nsup, 8, BLOCK)
    raw = np.zeros((nsup, 176), np.uint8)
    raw[:, 0:2] = d.astype(np.float16).view(np.uint8).reshape(nsup, 2)
    raw[:, 2:4] = dmin.astype(np.float16).view(np.uint8).reshape(nsup, 2)
    raw[:, 4:16] = _k_scales(sc, mn)
    raw[:, 16:48] = ((q >> 4) << np.arange(8, dtype=np.uint8)[:, None]).sum(axis=1, dtype=np.uint8)
    raw[:, 48:] = _low_nibbles(q.reshape(nsup, -1))
    return raw


def _q4_k_rows(w: np.ndarray, imp: np.ndarray) -> np.ndarray:
    n, k = w.shape
    d, dmin, sc, mn = q4_k_params(w, imp)
    q = _k_codes(w.astype(np.float64).reshape(-1, BLOCK), d, sc, dmin, mn)
    return pack_q4_k(d, dmin, sc, mn, q).reshape(n, -1)


def quantize_q4_k(w: np.ndarray, importance: np.ndarray | None = None) -> np.ndarray:
    """w [N, K] (K a multiple of 256) -> Q4_K bytes [N, K/256 * 144]; `importance` [K] >= 0."""
    return _quantize(w, importance, SUPER, 144, _q4_k_rows, "Q4_K rows hold whole super-blocks")


def _q5_k_rows(w: np.ndarray, imp: np.ndarray) -> np.ndarray:
    n, k = w.shape
    d, dmin, sc, mn = q4_k_params(w, imp, Q5_TOP)
    q = _k_codes(w.astype(np.float64).reshape(-1, BLOCK), d, sc, dmin, mn, Q5_TOP)
    return pack_q5_k(d, dmin, sc, mn, q).reshape(n, -1)


def quantize_q5_k(w: np.ndarray, importance: np.ndarray | None = None) -> np.ndarray:
    """w [N, K] (K a multiple of 256) -> Q5_K bytes [N, K/256 * 176]; `importance` [K] >= 0."""
    return _quantize(w, importance, SUPER, 176, _q5_k_rows, "Q5_K rows hold whole super-blocks")


def _q5_1_rows(w: np.ndarray, imp: np.ndarray) -> np.ndarray:
    """Q5_1 blocks (w = d q + m, q in 0..31): Q5_K's sub-block search a block, d and m as fp16,
    the codes rounded again against them."""
    n, k = w.shape
    x = w.astype(np.float64).reshape(-1, BLOCK)
    im = np.broadcast_to(imp.reshape(1, k // BLOCK, BLOCK), (n, k // BLOCK, BLOCK)).reshape(-1, BLOCK)
    s, low = _k_sub_blocks(x, im, Q5_TOP)
    d, m = _fp16(s), _fp16(-low)
    u = np.clip(np.rint((x - m[:, None]) / np.where(d > 0, d, 1)[:, None]), 0, Q5_TOP)
    u = np.where(d[:, None] > 0, u, 0).astype(np.uint8)
    raw = np.zeros((len(d), 24), np.uint8)
    raw[:, 0:2] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
    raw[:, 2:4] = m.astype(np.float16).view(np.uint8).reshape(-1, 2)
    raw[:, 4:8] = np.packbits(u >> 4, axis=1, bitorder="little")   # bit j: element j's fifth
    raw[:, 8:] = (u[:, :16] & 15) | ((u[:, 16:] & 15) << 4)
    return raw.reshape(n, -1)


def quantize_q5_1(w: np.ndarray, importance: np.ndarray | None = None) -> np.ndarray:
    """w [N, K] (K a multiple of 32) -> Q5_1 bytes [N, K/32 * 24]; `importance` [K] >= 0."""
    return _quantize(w, importance, BLOCK, 24, _q5_1_rows, "Q5_1 rows hold whole blocks")


def _quantize(w: np.ndarray, importance, per: int, size: int, rows_fn, what: str) -> np.ndarray:
    """w [N, K] in blocks of `per` weights, `size` bytes each, by `rows_fn` a chunk at a time."""
    n, k = w.shape
    if k % per:
        raise ValueError(f"{what} of {per}, not {k}")
    return _by_chunks(w, np.empty((n, k // per * size), np.uint8), rows_fn, _importance(importance, k))


def _searched_scales(w: np.ndarray, imp: np.ndarray, per: int, half: int) -> np.ndarray:
    """The searched float64 scale of each block of `per` weights of rows w [N, K] (importance
    [K]), for signed codes -half .. half - 1: steps around the largest magnitude over -half,
    each refitted by weighted least squares; [N K / per], 0 for a block of zeros."""
    n, k = w.shape
    x = w.astype(np.float64).reshape(-1, per)
    im = np.broadcast_to(imp.reshape(1, k // per, per), (n, k // per, per)).reshape(-1, per)
    peak = np.take_along_axis(x, np.abs(x).argmax(axis=1)[:, None], axis=1)[:, 0]   # signed
    base = np.where(peak != 0, peak / -half, 1)
    best_d, best_err = base, np.full(len(x), np.inf)
    for f in STEP_FACTORS:
        q = np.clip(np.rint(x / (base * f)[:, None]), -half, half - 1)
        sqq = (im * q * q).sum(axis=1)
        d = np.where(sqq > 0, (im * q * x).sum(axis=1) / np.where(sqq > 0, sqq, 1), base * f)
        err = (im * (x - d[:, None] * q) ** 2).sum(axis=1)
        better = err < best_err
        best_d, best_err = np.where(better, d, best_d), np.where(better, err, best_err)
    return np.where(peak != 0, best_d, 0)


def q5_0_scales(w: np.ndarray, imp: np.ndarray) -> np.ndarray:
    """The searched fp16 scale of each block of rows w [N, 32 B] (importance [32 B]): [N B]."""
    return _fp16(_searched_scales(w, imp, BLOCK, 16))


def q5_0_codes(x: np.ndarray, d: np.ndarray) -> np.ndarray:
    """Codes q - 16 in -16..15 of blocks x [B, 32] with scales d [B] (0: all zero)."""
    q = np.clip(np.rint(x / np.where(d != 0, d, 1)[:, None]), -16, 15)
    return np.where(d[:, None] != 0, q, 0)


def pack_q5_0(d: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Q5_0 blocks [B, 22] from fp16 scales d [B] and codes q [B, 32] (-16..15)."""
    u = (q + 16).astype(np.uint8)   # 0..31
    nb = len(d)
    raw = np.zeros((nb, 22), np.uint8)
    raw[:, 0:2] = d.astype(np.float16).view(np.uint8).reshape(nb, 2)
    raw[:, 2:6] = np.packbits((u >> 4).astype(np.uint8), axis=1, bitorder="little")   # bit j: element j's fifth
    raw[:, 6:] = (u[:, :16] & 15) | ((u[:, 16:] & 15) << 4)
    return raw


def _q5_0_rows(w: np.ndarray, imp: np.ndarray) -> np.ndarray:
    n, _ = w.shape
    d = q5_0_scales(w, imp)
    return pack_q5_0(d, q5_0_codes(w.astype(np.float64).reshape(-1, BLOCK), d)).reshape(n, -1)


def quantize_q5_0(w: np.ndarray, importance: np.ndarray | None = None) -> np.ndarray:
    """w [N, K] (K a multiple of 32) -> Q5_0 bytes [N, K/32 * 22]; `importance` [K] >= 0."""
    return _quantize(w, importance, BLOCK, 22, _q5_0_rows, "Q5_0 rows hold whole blocks")


Q6_K_SUB = 16


def q6_k_params(w: np.ndarray, imp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(d [N K/256] fp16-exact float32, sc [N K/16] int8) of rows w [N, K]: each sub-block's
    searched scale as an int8 multiple of its super-block's d, the largest at -128."""
    s = _searched_scales(w, imp, Q6_K_SUB, 32).reshape(-1, SUPER // Q6_K_SUB)
    top = np.take_along_axis(s, np.abs(s).argmax(axis=1)[:, None], axis=1)[:, 0]
    d = _fp16(top / -128)
    sc = np.clip(np.rint(s / np.where(d != 0, d, 1)[:, None]), -128, 127)
    return d, np.where(d[:, None] != 0, sc, 0).astype(np.int8).reshape(-1)


def q6_k_codes(x: np.ndarray, d: np.ndarray, sc: np.ndarray) -> np.ndarray:
    """Codes q - 32 in -32..31 of sub-blocks x [S, 16] under scales d sc (d [S / 16], sc [S])."""
    step = np.repeat(d.astype(np.float64), SUPER // Q6_K_SUB) * sc
    q = np.clip(np.rint(x / np.where(step != 0, step, 1)[:, None]), -32, 31)
    return np.where(step[:, None] != 0, q, 0)


def pack_q6_k(d: np.ndarray, sc: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Q6_K super-blocks [B, 210] from d [B], sc [B 16] and codes q [B 256] (-32..31, in order):
    per half of 128 weights, weight 32 j + l's low nibble in nibble j // 2 of ql[32 (j % 2) +
    l] and its top two bits in bit pair j of qh[l] (models/gguf_blocks.py reads them back)."""
    nb = len(d)
    u = (q.reshape(nb, 2, 4, 32) + 32).astype(np.uint8)        # [B, half, j, l]
    low, high = u & 15, u >> 4
    ql = (low[:, :, 0:2] | (low[:, :, 2:4] << 4)).reshape(nb, 128)   # [half, j % 2, l] bytes
    qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)).reshape(nb, 64)
    raw = np.zeros((nb, 210), np.uint8)
    raw[:, :128], raw[:, 128:192] = ql, qh
    raw[:, 192:208] = sc.reshape(nb, 16).view(np.uint8)
    raw[:, 208:210] = d.astype(np.float16).view(np.uint8).reshape(nb, 2)
    return raw


def _q6_k_rows(w: np.ndarray, imp: np.ndarray) -> np.ndarray:
    n, _ = w.shape
    d, sc = q6_k_params(w, imp)
    q = q6_k_codes(w.astype(np.float64).reshape(-1, Q6_K_SUB), d, sc)
    return pack_q6_k(d, sc, q).reshape(n, -1)


def quantize_q6_k(w: np.ndarray, importance: np.ndarray | None = None) -> np.ndarray:
    """w [N, K] (K a multiple of 256) -> Q6_K bytes [N, K/256 * 210]; `importance` [K] >= 0."""
    return _quantize(w, importance, SUPER, 210, _q6_k_rows, "Q6_K rows hold whole super-blocks")


def _importance(importance: np.ndarray | None, k: int) -> np.ndarray:
    """Per-channel weights of the error, [K] float64: all ones without an importance matrix. A
    channel the calibration never saw (0) keeps a small weight, so its weights are still
    rounded sensibly rather than left to whatever the other channels prefer."""
    if importance is None:
        return np.ones(k)
    imp = np.asarray(importance, np.float64).reshape(-1)
    if imp.shape != (k,) or not np.isfinite(imp).all() or (imp < 0).any():
        raise ValueError(f"an importance vector must hold {k} finite non-negative values")
    floor = imp.mean() * 1e-3 if imp.any() else 1.0
    return np.maximum(imp, floor)
