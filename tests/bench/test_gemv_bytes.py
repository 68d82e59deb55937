"""bench/gemv.py's bytes a decode step reads: every parameter but the tables it gathers one row
of, so that an untied model's share of the read bandwidth is not inflated by its embedding; and
the huge-page memory its readers read, as decode reads its weights."""

from __future__ import annotations

from types import SimpleNamespace

from qwc.bench import gemv
from qwc.manifest import Param


def _manifest(tied: bool) -> SimpleNamespace:
    params = [Param("model_embed_tokens_qweight", "uint8", (1000, 64), 0, 64000),
              Param("model_embed_tokens_scales", "float16", (1000, 4), 64000, 8000),
              Param("rotary_cos_cache", "float32", (512, 32), 72000, 65536),
              Param("rotary_sin_cache", "float32", (512, 32), 137536, 65536),
              Param("layers_0_q_proj_qweight", "uint8", (64, 32), 203072, 2048)]
    return SimpleNamespace(params=params, model=SimpleNamespace(tie_word_embeddings=tied))


def test_an_untied_embedding_and_the_rotary_tables_are_not_counted_whole():
    assert gemv.read_per_step(_manifest(False)) == 2048


def test_a_tied_embedding_is_the_lm_head_and_counts_whole():
    assert gemv.read_per_step(_manifest(True)) == 64000 + 8000 + 2048


def test_the_readers_memory_holds_the_arrays_given_aligned_for_tvm():
    import numpy as np

    arrays = [np.arange(1000, dtype=np.int32).reshape(10, 100), np.full((3, 7), 0.5, np.float16)]
    held = gemv.huge_page_tensors(arrays)
    for a, t in zip(arrays, held):
        np.testing.assert_array_equal(t.numpy(), a)
        assert np.from_dlpack(t).ctypes.data % 64 == 0


def test_the_stream_column_runs_each_launch_decode_makes():
    # q, k and v in one launch; gate and up with silu: the kernel takes each output's weights
    # and scales in turn, and a wrong argument list fails the call
    for name, outputs, k, silu in (shape for shape in gemv.SHAPES if len(shape[1]) > 1):
        got = gemv.qwc_stream(tuple(o // 8 for o in outputs), k, silu, total=2e5, rounds=1)
        assert got is None or got > 0, name
