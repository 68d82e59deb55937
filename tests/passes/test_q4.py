"""qwc's Q4_0 / Q8_0 arithmetic against llama.cpp's reference algorithm and the gguf package."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize

import qwc.q4 as q4mod
from qwc.q4 import dequantize_q4_0, fake_quantize_q4_0, pack_nibbles, quantize_q4_0, quantize_q8_0, unpack_nibbles


def llama_quantize_row_q4_0_ref(x: np.ndarray):
    """A scalar port of llama.cpp's quantize_row_q4_0_ref (ggml-quants.c), one block at a time.
    Returns (d as float16, qs as 16 bytes in llama.cpp's nibble order)."""
    qk = 32
    assert x.size % qk == 0
    out = []
    for i in range(x.size // qk):
        blk = x[i * qk:(i + 1) * qk].astype(np.float32)
        amax, mx = np.float32(0), np.float32(0)
        for v in blk:
            if amax < abs(v):
                amax, mx = np.float32(abs(v)), v
        d = np.float32(mx / np.float32(-8))
        idd = np.float32(1) / d if d else np.float32(0)
        qs = np.zeros(16, np.uint8)
        for j in range(16):
            x0 = np.float32(blk[j] * idd)
            x1 = np.float32(blk[16 + j] * idd)
            xi0 = min(15, int(np.int8(np.trunc(np.float32(x0 + np.float32(8.5))))))
            xi1 = min(15, int(np.int8(np.trunc(np.float32(x1 + np.float32(8.5))))))
            qs[j] = xi0 | (xi1 << 4)
        out.append((np.float16(d), qs))
    return out


def _edge_rows():
    rng = np.random.default_rng(0)
    rows = [
        rng.standard_normal(64),                       # plain
        np.zeros(64),                                  # all zeros
        np.r_[rng.standard_normal(31) * 1e-3, 1e4, rng.standard_normal(32)],  # one huge value
        np.r_[-5.0, rng.uniform(-1, 1, 63)],           # negative absmax
        np.r_[rng.uniform(-1, 1, 40), 3.0, rng.uniform(-1, 1, 23)],  # positive absmax
        np.full(64, 0.37),                             # constant block
        np.r_[2.0, -2.0, rng.uniform(-1, 1, 62)],      # tie in magnitude: first one wins
        rng.standard_normal(64) * 1e-6,                # tiny values (fp16 subnormal scales)
    ]
    return np.stack(rows).astype(np.float32)


def _our_llama_layout(x):
    q, d = quantize_q4_0(x[None], 32)
    q, d = q[0], d[0]
    return [(np.float16(d[b]), (q[b, :16] | (q[b, 16:] << 4)).astype(np.uint8)) for b in range(q.shape[0])]


@pytest.mark.parametrize("row", range(len(_edge_rows())))
def test_q4_0_equals_llama_reference(row):
    x = _edge_rows()[row]
    ref = llama_quantize_row_q4_0_ref(x)
    ours = _our_llama_layout(x)
    for (dr, qr), (do, qo) in zip(ref, ours):
        assert dr.view(np.uint16) == do.view(np.uint16)
        assert np.array_equal(qr, qo)


def test_q4_0_random_blocks_equal_gguf_bytes():
    """The gguf package reproduces llama.cpp's bytes exactly: a second, independent reference."""
    w = (np.random.default_rng(1).standard_normal((64, 256)) * np.logspace(-3, 1, 64)[:, None]).astype(np.float32)
    w = np.concatenate([w, _edge_rows()[:, :64].repeat(4, axis=1)], axis=0)
    raw = gguf_quantize(w, GGMLQuantizationType.Q4_0).reshape(w.shape[0], -1, 18)
    d_ref = raw[..., :2].copy().view(np.float16)[..., 0]
    qs = raw[..., 2:]
    q_ref = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)   # llama order: j, then j + 16
    q, d = quantize_q4_0(w, 32)
    assert np.array_equal(d.astype(np.float16).view(np.uint16), d_ref.view(np.uint16))
    assert np.array_equal(q, q_ref)


def test_q8_0_equals_gguf_bytes():
    w = (np.random.default_rng(2).standard_normal((16, 128)) * 3).astype(np.float32)
    w[3] = 0
    raw = gguf_quantize(w, GGMLQuantizationType.Q8_0).reshape(16, -1, 34)
    d_ref = raw[..., :2].copy().view(np.float16)[..., 0]
    q_ref = raw[..., 2:].view(np.int8)
    q, d = quantize_q8_0(w, 32)
    assert np.array_equal(d.astype(np.float16), d_ref)
    assert np.array_equal(q, q_ref)


def test_k_not_a_multiple_of_the_block_pads_with_zeros():
    w = np.random.default_rng(3).standard_normal((5, 70)).astype(np.float32)
    q, d = quantize_q4_0(w, 32)
    assert q.shape == (5, 3, 32)
    padded = np.concatenate([w, np.zeros((5, 26), np.float32)], axis=1)
    q2, d2 = quantize_q4_0(padded, 32)
    assert np.array_equal(q, q2) and np.array_equal(d, d2)
    assert np.all(q[:, 2, 6:] == 8)  # the padding quantizes to zero
    assert fake_quantize_q4_0(w).shape == (5, 70)


@pytest.mark.parametrize("block", [32, 128])
def test_weight_on_the_grid_round_trips_exactly(block):
    rng = np.random.default_rng(4)
    w = rng.standard_normal((32, 256)).astype(np.float32)
    once = fake_quantize_q4_0(w, block)
    assert not np.array_equal(once, w)
    assert np.array_equal(fake_quantize_q4_0(once, block), once)
    q1, d1 = quantize_q4_0(w, block)
    q2, d2 = quantize_q4_0(once, block)
    assert np.array_equal(q1, q2) and np.array_equal(d1, d2)


def test_nibble_packing_is_onnxruntime_order():
    q = np.arange(16, dtype=np.uint8).reshape(1, 16) % 16
    b = pack_nibbles(q)
    assert b[0, 0] == (0 | (1 << 4)) and b[0, 7] == (14 | (15 << 4))
    assert np.array_equal(unpack_nibbles(b), q)
    qq, d = quantize_q4_0(np.random.default_rng(5).standard_normal((3, 64)))
    assert np.array_equal(dequantize_q4_0(unpack_nibbles(pack_nibbles(qq)), d), dequantize_q4_0(qq, d))


def test_chunked_rows_give_the_same_bits(monkeypatch):
    """Large weights are quantized a few rows at a time (bounded temporaries): the chunking
    must not change a bit, including a last chunk shorter than the others."""
    w = (np.random.default_rng(5).standard_normal((37, 96)) * 0.05).astype(np.float32)
    q4, d4 = quantize_q4_0(w, 32)
    q8, d8 = quantize_q8_0(w, 32)
    monkeypatch.setattr(q4mod, "CHUNK_ELEMENTS", 5 * 96)   # 5 rows a chunk: 8 chunks, the last of 2
    assert len(list(q4mod.row_chunks(w))) == 8
    q4c, d4c = quantize_q4_0(w, 32)
    q8c, d8c = quantize_q8_0(w, 32)
    assert np.array_equal(q4, q4c) and np.array_equal(d4, d4c)
    assert np.array_equal(q8, q8c) and np.array_equal(d8, d8c)
