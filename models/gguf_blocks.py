"""A GGUF tensor's quantized blocks as the canonical graph holds them, bit for bit.

llama.cpp's Q4_0, Q4_1, Q8_0, Q5_0 and Q5_1 are blocks of 32 weights along a row with float16
scales:

- Q4_0: d, then 16 bytes of codes q (0..15); w = d * (q - 8);
- Q4_1: d, m, then 16 bytes of codes; w = d * q + m;
- Q8_0: d, then 32 signed bytes q; w = d * q;
- Q5_0: d, 4 bytes of fifth bits, 16 bytes of low nibbles; w = d * (q - 16), q in 0..31;
- Q5_1: d, m, 4 bytes of fifth bits, 16 bytes of low nibbles; w = d * q + m.

Q4_K is super-blocks of 256: an fp16 d and dmin, 12 bytes holding 8 six-bit scales sc and mins
mn (one pair per sub-block of 32), then 128 bytes of codes; w = d sc q - dmin mn. Each sub-block
is a Q4_1 block with scale d sc and minimum -dmin mn, both exact in float32 (an fp16 times a
6-bit integer has at most 17 significant bits).

Q5_K is Q4_K with a fifth bit: d, dmin, the same 12 bytes of scales and mins, 32 bytes of fifth
bits (bit j of byte l: weight l of sub-block j), then 128 bytes of low nibbles; codes 0..31.

Q6_K is super-blocks of 256 too: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8
sub-block scales sc (one a sub-block of 16) and an fp16 d last; w = d sc (q - 32), q in 0..63.
Each sub-block of 16 is an 8-bit block with scale d sc (exact in float32: 11 x 8 bits) and
codes q - 32 + 128 = q + 96, which onnxruntime's MatMulNBits takes as bits 8, block_size 16.
`q6_k_factors` takes (d, sc) back from those scales for the kernels, which store them apart,
as the file does (compiler/repack_q6_k.py).

onnxruntime's MatMulNBits / GatherBlockQuantized hold the same numbers in their own layout:
codes packed low-first along the row (llama.cpp packs element j with element j + 16, so
the nibbles are reordered, not changed), float32 scales (each the fp16 d exactly), 8-bit
codes as uint8 with the default zero point 128 (q + 128; Q5_0's q - 16 + 128, so it runs as
Q8_0 does), and Q4_1 / Q4_K as float32 zero points, w = d * (q - zp) with zp = -m / d.
`block_mins` takes m back from (d, zp): for Q4_1 the fp16 nearest -zp * d, for Q4_K -zp * d
rounded to 17 significant bits (the node's format says which: qwc/weight_formats.py); `from_gguf`
checks that for every block of the file before anything is written. A block with d = 0 (all
its weights m) is written as d = 1, zp = -m, codes 0: Q4_1's quantizer writes codes 0 there,
and a Q4_K sub-block's codes of scale 0 weigh nothing.

Q5_1 and Q5_K cannot take Q4_1's form: onnxruntime refuses float zero points on 8-bit codes. They
are 8-bit codes q + 128 (q in 0..31, so u - 128 = q) with scales d (Q5_1) or d sc (Q5_K), and
each block's minimum m (Q5_1's fp16 m, Q5_K's -dmin mn: exact in float32) apart, in `minimums`:
w = d (u - 128) + m. The graph adds m times each block's sum of the activations beside the
MatMulNBits (models/stream_export.py), which compile time folds into the kernels' block offsets
(compiler/block_minimums.py); the MatMul of that term is marked MINIMUMS_KEY.

IQ4_NL (blocks of 32: an fp16 d, 4-bit indices into a fixed int8 code book) and IQ4_XS (the
book in super-blocks of 256 with 6-bit sub-block scales) are 8-bit codes book[q] + 128 with
scales d (d (ls - 32)): Q8_0's form, exact.

Other GGUF types (other IQ, Q2_K, Q3_K) have no kernel here: they are dequantized and quantized
again to the format the user names (`--requant`, Q8_0 by default: the one that loses least).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from qwc import weight_formats
from qwc.errors import QwcError
from qwc.q4 import pack_nibbles, quantize_q4_0, quantize_q8_0

BLOCK = 32
SUPER = 256
# GGUF type name -> (weights, bytes) a block (a super-block for the K-quants): qwc/weight_formats.py's
KEPT = {f.name: (f.block, f.block_bytes) for f in weight_formats.FORMATS.values()}
WITH_MINIMUMS = weight_formats.with_offsets("minimums")   # 8-bit codes with block minimums apart (Blocks.minimums)
Q6_K_BLOCK = weight_formats.get("Q6_K").graph_block   # Q6_K's sub-block: the MatMulNBits block_size of its nodes
REQUANT_CHOICES = ("q8_0", "q4_0")
K_MIN_BITS = 17   # significant bits of a Q4_K minimum dmin * mn: an fp16 times a 6-bit integer


@dataclass
class Blocks:
    """One [N, K] weight as MatMulNBits takes it: codes [N, K/block, 16 or 32] uint8 (4-bit
    codes packed, 8-bit ones as bytes), scales [N, K/block] float32, zero points [N, K/block]
    float32 (Q4_1, Q4_K), or block minimums [N, K/block] float32 added to the 8-bit codes'
    d (u - 128) (Q5_1, Q5_K). The block is 32 but for Q6_K's 16."""
    fmt: str                       # a KEPT type
    codes: np.ndarray
    scales: np.ndarray
    zero_points: np.ndarray | None = None
    minimums: np.ndarray | None = None

    @property
    def bits(self) -> int:
        return weight_formats.get(self.fmt).graph_bits

    @property
    def block(self) -> int:
        return weight_formats.get(self.fmt).graph_block

    @property
    def mins(self) -> str:
        """How m comes back from (d, zp): "fp16" (Q4_1) or "q4_k" (block_mins)."""
        return weight_formats.get(self.fmt).mins


def _halves(raw: np.ndarray, at: int) -> np.ndarray:
    """The fp16 at byte `at` of every block, as float32 (exact)."""
    return np.ascontiguousarray(raw[..., at:at + 2]).view(np.float16)[..., 0].astype(np.float32)


def _gguf_nibbles(qs: np.ndarray) -> np.ndarray:
    """llama.cpp's 16 code bytes a block (element j low, j + 16 high) -> the 32 codes in order."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.uint8)


ROWS_AT_ONCE = 4096   # from_gguf's chunk: a 7B's Q6_K output parsed whole took 3.6 GB of temporaries


def from_gguf(raw: np.ndarray, fmt: str, shape: tuple[int, int], name: str) -> Blocks:
    """`raw`: the tensor's bytes, [N, K/32 * bytes-a-block] (GGUFReader's view) or flat. Parsed
    ROWS_AT_ONCE rows at a time into the whole result, so that the temporaries are a chunk's."""
    n, k = shape
    per, size = KEPT[fmt]
    if k % per:
        raise QwcError(f"{name}: {fmt} rows of {k} are not whole blocks of {per}")
    raw = np.asarray(raw, np.uint8)
    if raw.size != n * (k // per) * size:
        raise QwcError(f"{name}: {raw.size} bytes are not {n} rows of {k // per} {fmt} blocks ({size} bytes each)")
    raw = raw.reshape(n, k // per, size)
    first = _rows(raw[:ROWS_AT_ONCE], fmt, name)
    if n <= ROWS_AT_ONCE:
        return first
    fields = ("codes", "scales", "zero_points", "minimums")
    whole = {f: np.empty((n, *a.shape[1:]), a.dtype) for f in fields if (a := getattr(first, f)) is not None}
    for r in range(0, n, ROWS_AT_ONCE):
        b = first if r == 0 else _rows(raw[r:r + ROWS_AT_ONCE], fmt, name)
        for f, out in whole.items():
            a = getattr(b, f)
            out[r:r + len(a)] = a
    return Blocks(fmt, **whole)


def _rows(raw: np.ndarray, fmt: str, name: str) -> Blocks:
    """Rows raw [R, K/per, size] of a `fmt` tensor as Blocks."""
    if fmt == "Q6_K":
        return _q6_k(raw, name)
    if fmt in ("IQ4_NL", "IQ4_XS"):
        return _iq4(raw, fmt, name)
    d = _halves(raw, 0)
    if fmt in ("Q4_K", "Q5_K"):
        return _k_quant(raw, fmt, d, _halves(raw, 2), name)
    _finite(d, fmt, name)
    if fmt == "Q8_0":
        codes = (raw[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return Blocks(fmt, codes, d)
    if fmt == "Q5_0":
        fifth = np.unpackbits(raw[..., 2:6], axis=-1, bitorder="little")   # bit j of the uint32: element j
        return Blocks(fmt, (_gguf_nibbles(raw[..., 6:]) + 16 * fifth + 112).astype(np.uint8), d)   # q - 16 + 128
    if fmt == "Q4_0":
        return Blocks(fmt, pack_nibbles(_gguf_nibbles(raw[..., 2:])), d)
    m = _halves(raw, 2)
    _finite(m, fmt, name)
    if fmt == "Q5_1":
        fifth = np.unpackbits(raw[..., 4:8], axis=-1, bitorder="little")
        return Blocks(fmt, (_gguf_nibbles(raw[..., 8:]) + 16 * fifth + 128).astype(np.uint8), d, minimums=m)
    return _with_zero_points(fmt, _gguf_nibbles(raw[..., 4:]), d, m, name)


def _finite(x: np.ndarray, fmt: str, name: str) -> None:
    if not np.isfinite(x).all():
        raise QwcError(f"{name}: {int((~np.isfinite(x)).sum())} {fmt} scales are NaN or infinite")


def _k_quant(raw: np.ndarray, fmt: str, d: np.ndarray, dmin: np.ndarray, name: str) -> Blocks:
    """Q4_K super-blocks [N, K/256, 144] as Q4_1-like blocks of 32 with float32 d sc and -dmin
    mn; Q5_K ones [N, K/256, 176] as 8-bit codes q + 128 with those scales and minimums."""
    _finite(d, fmt, name)
    _finite(dmin, fmt, name)
    s = raw[..., 4:16]
    sc_bytes, mn_bytes, mixed = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    # sub-blocks 0-3: the low six bits of bytes 0-3 (scales) and 4-7 (mins); 4-7: a nibble of
    # bytes 8-11 (low: scale, high: min) under the top two bits of bytes 0-3 or 4-7
    sc = np.concatenate([sc_bytes & 63, (mixed & 15) | ((sc_bytes >> 6) << 4)], axis=-1)
    mn = np.concatenate([mn_bytes & 63, (mixed >> 4) | ((mn_bytes >> 6) << 4)], axis=-1)
    n, sb = raw.shape[:2]
    qs = raw[..., -128:].reshape(n, sb, 4, 32)           # 32 bytes for each pair of sub-blocks
    q = np.stack([qs & 15, qs >> 4], axis=-2).reshape(n, sb, 8, 32)   # sub-block 2p: pair p's low nibbles
    scales = (d[..., None] * sc).reshape(n, -1).astype(np.float32)      # exact: 11 x 6 bits
    mins = -(dmin[..., None] * mn).reshape(n, -1).astype(np.float32)
    if fmt == "Q4_K":
        return _with_zero_points("Q4_K", q.reshape(n, -1, BLOCK), scales, mins, name)
    fifth = (raw[..., None, 16:48] >> np.arange(8, dtype=np.uint8)[:, None]) & 1   # bit j of byte l: sub-block j
    return Blocks(fmt, (q + 16 * fifth + 128).astype(np.uint8).reshape(n, -1, BLOCK), scales, minimums=mins)


def _iq4(raw: np.ndarray, fmt: str, name: str) -> Blocks:
    """IQ4_NL blocks [N, K/32, 18] (fp16 d, 16 bytes of indices) or IQ4_XS super-blocks
    [N, K/256, 136] (fp16 d, the 6-bit sub-block scales' high bit pairs as a uint16 and low
    nibbles as 4 bytes, then 8 sub-blocks of indices) as 8-bit codes book[q] + 128 in blocks of
    32, with scales d (IQ4_XS: d (ls - 32) a sub-block, exact in float32)."""
    book = np.asarray(weight_formats.get(fmt).code_book, np.int16) + 128
    d = _halves(raw, 0)
    _finite(d, fmt, name)
    n, nb = raw.shape[:2]
    if fmt == "IQ4_NL":
        return Blocks(fmt, book[_gguf_nibbles(raw[..., 2:])].astype(np.uint8), d)
    high = (raw[..., 2:4].copy().view(np.uint16)[..., 0, None] >> (2 * np.arange(8, dtype=np.uint16))) & 3
    low = np.stack([raw[..., 4:8] & 15, raw[..., 4:8] >> 4], axis=-1).reshape(n, nb, 8)   # sub-block 2i: byte i's low nibble
    ls = (low.astype(np.int32) | (high.astype(np.int32) << 4)) - 32
    scales = (d[..., None] * ls).reshape(n, -1).astype(np.float32)
    codes = book[_gguf_nibbles(raw[..., 8:].reshape(n, nb, 8, 16))].astype(np.uint8)
    return Blocks(fmt, codes.reshape(n, nb * 8, BLOCK), scales)


def iq4_xs_factors(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """IQ4_XS's sub-block scales d (ls - 32) [N, K/32] float32 -> (d [N, K/256] float32, each
    exactly an fp16, ls [N, K/32] uint8 in 0..63) with the same products to the bit, or None
    where some super-block has no such pair (not written as IQ4_XS). llama.cpp's quantizer gives
    the sub-block of largest |d (ls - 32)| ls - 32 = -32, so d = its scale / -32 at the first
    try; each other multiplier of that sub-block is tried in turn where that fails (any pair
    found gives the same products). A super-block of zeros takes d = 0, ls = 32."""
    s = scales.astype(np.float32).reshape(scales.shape[0], -1, 8)
    if not np.isfinite(s).all():
        return None
    top = np.take_along_axis(s, np.abs(s).argmax(-1)[..., None], -1)[..., 0]
    d, m = _searched_factors(s, top, (-32, *(x for x in range(31, -32, -1) if x)), -32, 31)
    return None if d is None else (d, (m + 32).astype(np.uint8).reshape(scales.shape[0], -1))


def _q6_k(raw: np.ndarray, name: str) -> Blocks:
    """Q6_K super-blocks [N, K/256, 210] as 8-bit blocks of 16: codes q + 96, scales d sc."""
    d = _halves(raw, 208)
    _finite(d, "Q6_K", name)
    n, sb = raw.shape[:2]
    # each half of 128 weights: 64 bytes of ql, 32 of qh; weight 32 j + l of a half (j 0..3,
    # l 0..31) takes nibble j // 2 of ql[32 (j % 2) + l] and bit pair j of qh[l]
    ql = raw[..., :128].reshape(n, sb, 2, 1, 2, 32)
    qh = raw[..., 128:192].reshape(n, sb, 2, 1, 32)
    low = (ql >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1, 1)) & 15        # [n, sb, 2, 2 (j // 2), 2 (j % 2), 32]
    low = low.reshape(n, sb, 2, 4, 32)
    high = (qh >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 1, 4, 1)) & 3    # [n, sb, 2, 4 (j), 32]
    q = (low | (high << 4)).reshape(n, sb * 16, Q6_K_BLOCK)
    sc = raw[..., 192:208].view(np.int8).astype(np.float32)
    scales = (d[..., None] * sc).reshape(n, -1)    # exact: an fp16 times an int8
    return Blocks("Q6_K", (q + 96).astype(np.uint8), scales.astype(np.float32))


def q6_k_factors(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q6_K's scales d sc [N, K/16] -> (d [N, K/256] float32, sc [N, K/16] int8) with d sc the
    same to the bit. llama.cpp's quantizer gives the sub-block of largest |d sc| sc = -128, so
    d = that scale / -128 gives the file's own pair; where that does not hold (another writer),
    d is the greatest common divisor of the super-block's scales (exact: they are d sc of one
    fp16 d), and sc the quotients."""
    n = scales.shape[0]
    s = scales.astype(np.float32).reshape(n, -1, 16)
    top = np.take_along_axis(s, np.abs(s).argmax(-1)[..., None], -1)[..., 0]
    d = (top / np.float32(-128)).astype(np.float32)   # 0 for a super-block of zeros, as llama.cpp writes it
    with np.errstate(invalid="ignore", divide="ignore"):
        sc = np.where(d[..., None] != 0, s / d[..., None], 0)
        ok = (sc == np.rint(sc)).all(-1) & (sc >= -128).all(-1) & (sc <= 127).all(-1)
        if not ok.all():
            d[~ok] = _scale_gcd(s[~ok])
            sc = np.where(d[..., None] != 0, s / d[..., None], 0)
    if not ((sc == np.rint(sc)) & (np.abs(sc) <= 128) & (sc != 128)).all():
        raise QwcError("Q6_K scales that are not one float32 times int8 sub-block scales a super-block")
    return d, sc.astype(np.int8).reshape(n, -1)


def q4_k_factors(scales: np.ndarray, mins: np.ndarray, free: np.ndarray) -> tuple[np.ndarray, ...] | None:
    """Q4_K's sub-block scales d sc and minimums m = -dmin mn [N, K/32] -> (d, sc, dmin, mn):
    d, dmin [N, K/256] float32, each exactly an fp16, and sc, mn [N, K/32] uint8 in 0..63, with
    the same products to the bit; None where some super-block has no such pair (not written
    as Q4_K). `free` [N, K/32]: blocks whose codes are all 0, so that their weights are m
    whatever the scale (the export writes a scale 1 there): they take sc = 0."""
    n = scales.shape[0]
    d, sc = six_bit_factors(np.where(free, 0, scales).astype(np.float32).reshape(n, -1, 8))
    dmin, mn = six_bit_factors((-mins).astype(np.float32).reshape(n, -1, 8))
    if d is None or dmin is None:
        return None
    return d, sc.reshape(n, -1), dmin, mn.reshape(n, -1)


def six_bit_factors(v: np.ndarray) -> tuple[np.ndarray | None, np.ndarray | None]:
    """v [N, S, 8] float32 -> (f [N, S] float32 exact in fp16, q [N, S, 8] uint8 <= 63) with f q
    = v to the bit, or (None, None). llama.cpp gives the largest sub-block q = 63, so f = its v
    / 63 at the first try; another writer's searched scales may top out lower, so each smaller
    top q is tried in turn where that one fails (any pair found gives the same products)."""
    if (v < 0).any() or not np.isfinite(v).all():
        return None, None
    f, q = _searched_factors(v, v.max(-1), range(63, 0, -1), 0, 63)
    return (None, None) if f is None else (f, q.astype(np.uint8))


def _searched_factors(v: np.ndarray, top: np.ndarray, multipliers, lo: int, hi: int):
    """v [N, S, 8] float32 -> (f [N, S] float32 exact in fp16, m [N, S, 8] int in lo..hi) with
    f m = v to the bit, trying f = top / j for each j of `multipliers` in turn where the earlier
    ones failed (top [N, S]: the super-block's value of largest magnitude); a super-block whose
    top is 0 takes f = 0, m = 0. (None, None) where some super-block has no such pair."""
    f, m = np.zeros(top.shape, np.float32), np.zeros(v.shape, np.int32)
    todo = top != 0
    for j in multipliers:
        if not todo.any():
            break
        at = np.flatnonzero(todo)
        vv = v.reshape(-1, 8)[at]
        cand = (top.reshape(-1)[at] / np.float32(j)).astype(np.float32)
        r = np.rint(vv / cand[:, None])
        ok = ((cand.astype(np.float16).astype(np.float32) == cand) & (r >= lo).all(-1) & (r <= hi).all(-1)
              & ((cand[:, None] * r.astype(np.float32)) == vv).all(-1))
        f.reshape(-1)[at[ok]] = cand[ok]
        m.reshape(-1, 8)[at[ok]] = r[ok].astype(np.int32)
        todo.reshape(-1)[at[ok]] = False
    return (None, None) if todo.any() else (f, m)


def _scale_gcd(s: np.ndarray) -> np.ndarray:
    """[R, 16] float32 -> [R]: the largest float32 g with every s / g an integer (never all zeros)."""
    mant, exp = np.frexp(s.astype(np.float64))
    nz = s != 0
    t = np.where(nz, exp, 1 << 20).min(-1, keepdims=True) - 24     # every s = integer x 2^t
    ints = np.where(nz, np.rint(np.ldexp(mant, exp - t)), 0).astype(np.int64)
    g = np.gcd.reduce(np.abs(ints), axis=-1)
    return np.where(g > 0, np.ldexp(g.astype(np.float64), t[..., 0]), 1.0).astype(np.float32)


def _with_zero_points(fmt: str, q: np.ndarray, d: np.ndarray, m: np.ndarray, name: str) -> Blocks:
    """Codes q [N, K/32, 32] (0..15) with w = d q + m, as MatMulNBits' (codes, d, zp)."""
    flat = d == 0
    if flat.any():
        if fmt == "Q4_1" and q[flat].any():
            raise QwcError(f"{name}: a Q4_1 block has scale 0 and non-zero codes (not written by llama.cpp)")
        q = np.where(flat[..., None], np.uint8(0), q)       # the codes of a scale 0 weigh nothing
        d = np.where(flat, np.float32(1), d)                 # every weight m: 1 * (0 - (-m))
    zp = (-m / d).astype(np.float32)
    b = Blocks(fmt, pack_nibbles(q.astype(np.uint8)), d, zp)
    back = block_mins(d, zp, b.mins)
    if not np.array_equal(back.view(np.uint32), m.view(np.uint32)):
        bad = int((back.view(np.uint32) != m.view(np.uint32)).sum())
        raise QwcError(f"{name}: {bad} {fmt} block minimums do not survive as float zero points")
    return b


def q4_1_mins(d: np.ndarray, zp: np.ndarray) -> np.ndarray:
    """m of Q4_1 blocks held as (d, zp): the fp16 nearest -zp * d, as float32."""
    return (-(zp.astype(np.float32) * d.astype(np.float32))).astype(np.float16).astype(np.float32)


def block_mins(d: np.ndarray, zp: np.ndarray, kind: str = "fp16") -> np.ndarray:
    """m of blocks held as (d, zp), float32: Q4_1's (`kind` "fp16": q4_1_mins) or Q4_K's
    ("q4_k": -zp * d, exact in float64, rounded to K_MIN_BITS significant bits, where a
    float32 zp's relative error of 2^-24 is far inside half a step of the minimum's grid)."""
    if kind == "fp16":
        return q4_1_mins(d, zp)
    if kind != "q4_k":
        raise QwcError(f"unknown block minimum form {kind!r}")
    p = -(zp.astype(np.float64) * d.astype(np.float64))
    mant, exp = np.frexp(p)
    return np.ldexp(np.rint(np.ldexp(mant, K_MIN_BITS)), exp - K_MIN_BITS).astype(np.float32)


# Node metadata of the MatMul that adds a Q5_1 / Q5_K linear's block minimums beside it ("term"):
# compiler/block_minimums.py folds it into the linear, and passes/quantize_linears.py leaves its
# float MatMul alone. (Graphs written before the formats' markers carried the linear's format
# under the same key: weight_formats.format_of reads it there.)
MINIMUMS_KEY = weight_formats.LEGACY_MINIMUMS_KEY


def minimums_form(node) -> str | None:
    """The format a node's MINIMUMS_KEY names, or None."""
    return next((p.value for p in node.metadata_props if p.key == MINIMUMS_KEY), None)


def set_minimums_form(node, form: str) -> None:
    p = node.metadata_props.add()
    p.key, p.value = MINIMUMS_KEY, form


def minimums_term(x: str, product: str, minimums_t: str, block_shape: str, last_axis: str, out: str, at: str) -> list:
    """The nodes that make `out` = `product` (a Q5_1 / Q5_K MatMulNBits' output on x [B, S, K])
    plus each block's minimum times the block's sum of x: Reshape(x, block_shape [0, 0, K/32,
    32]) -> ReduceSum(last_axis [-1]) -> MatMul by minimums_t [K/32, N] (marked "term") -> Add.
    Names: `at` + "/..." for the nodes, `out` + "..." for the tensors between."""
    from onnx import helper

    nodes = [helper.make_node("Reshape", [x, block_shape], [out + ".x_blocks"], name=at + "/Reshape"),
             helper.make_node("ReduceSum", [out + ".x_blocks", last_axis], [out + ".x_block_sums"],
                              name=at + "/ReduceSum", keepdims=0),
             helper.make_node("MatMul", [out + ".x_block_sums", minimums_t], [out + ".minimums_term"], name=at + "/MatMul"),
             helper.make_node("Add", [product, out + ".minimums_term"], [out], name=at + "/Add")]
    set_minimums_form(nodes[2], "term")
    return nodes


def minimums_constants(k: int) -> dict[str, np.ndarray]:
    """minimums_term's two constants for K inputs, by the names the graph writers give them."""
    return {f"block_shape_{k}": np.array([0, 0, k // BLOCK, BLOCK], np.int64), "last_axis": np.array([-1], np.int64)}


def requantize(w: np.ndarray, to: str) -> Blocks:
    """A float [N, K] weight (a dequantized K-quant, say) in Q8_0 or Q4_0."""
    if to == "q8_0":
        q8, d = quantize_q8_0(w, BLOCK)
        return Blocks("Q8_0", (q8.astype(np.int16) + 128).astype(np.uint8), d)
    if to == "q4_0":
        q, d = quantize_q4_0(w, BLOCK)
        return Blocks("Q4_0", pack_nibbles(q), d)
    raise QwcError(f"--requant {to!r} is not one of {', '.join(REQUANT_CHOICES)}")


def dequantize(b: Blocks) -> np.ndarray:
    """The float32 [N, K] weight `b` holds (what the kernels must compute with)."""
    if b.bits == 8:   # Q8_0, Q5_0, Q5_1, Q5_K (blocks of 32) and Q6_K (of 16)
        q = b.codes.astype(np.float32) - 128
    else:
        lo, hi = b.codes & 15, b.codes >> 4
        q = np.stack([lo, hi], axis=-1).reshape(*b.codes.shape[:-1], -1).astype(np.float32)
        if b.fmt == "Q4_0":
            q -= 8
    w = q * b.scales[..., None]
    if b.zero_points is not None:
        w += block_mins(b.scales, b.zero_points, b.mins)[..., None]
    if b.minimums is not None:
        w += b.minimums[..., None]
    return w.reshape(w.shape[0], -1)
