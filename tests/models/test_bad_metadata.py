"""Model metadata that cannot describe a model: every size, count and constant a GGUF's keys
or a config.json states, as a string, null, negative, zero, NaN, an array, absurdly large or
not dividing, is refused by `qwc export` in one stderr line naming the key, with exit 2, no
traceback and nothing written."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from test_export_errors import _hf_dir
from test_load import _make_gguf

from qwc.cli import main

U32, I32, F32, STR = GGUFValueType.UINT32, GGUFValueType.INT32, GGUFValueType.FLOAT32, GGUFValueType.STRING


@pytest.fixture(scope="module")
def good_gguf(tmp_path_factory):
    path, _, _ = _make_gguf(tmp_path_factory.mktemp("gguf"), "qwen2")
    return path


def _rewritten(src, dst, values: dict | None = None, drop=()):
    """`src` written again as `dst` with `values` (key -> (value, GGUF type)) set and `drop` left
    out: the same tensors, the metadata edited as a damaged or hand-made file's would be."""
    r = GGUFReader(src)
    w = GGUFWriter(str(dst), r.fields["general.architecture"].contents())
    values = values or {}
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in drop or key in values:
            continue
        vtype = f.types[0]
        w.add_key_value(key, f.contents(), vtype, sub_type=f.types[-1] if vtype == GGUFValueType.ARRAY else None)
    for key, (value, vtype) in values.items():
        w.add_key_value(key, value, vtype, sub_type=I32 if vtype == GGUFValueType.ARRAY else None)
    for t in r.tensors:
        quantized = t.tensor_type not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16)
        w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type if quantized else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def _refused(capsys, src, tmp_path, words):
    out = tmp_path / "out"
    capsys.readouterr()
    code = main(["-q", "export", str(src), "-o", str(out / "m.onnx")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("qwc: error: "), err
    assert all(w in err[0] for w in words), err[0]
    assert "Traceback" not in err[0]
    assert not out.exists()


_GGUF_COUNTS = ["qwen2.embedding_length", "qwen2.attention.head_count", "qwen2.attention.head_count_kv",
                "qwen2.attention.key_length", "qwen2.feed_forward_length", "qwen2.block_count",
                "qwen2.context_length", "qwen2.vocab_size"]
_BAD = {"zero": (0, U32), "negative": (-4, I32), "a string": ("16", STR), "NaN": (math.nan, F32),
        "an array": ([4, 4], GGUFValueType.ARRAY)}


@pytest.mark.parametrize("how", list(_BAD))
@pytest.mark.parametrize("key", _GGUF_COUNTS)
def test_gguf_counts(capsys, tmp_path, good_gguf, key, how):
    bad = _rewritten(good_gguf, tmp_path / "bad.gguf", {key: _BAD[how]})
    _refused(capsys, bad, tmp_path, [key, "must be an integer"])


@pytest.mark.parametrize("value", [(0.0, F32), (-1.0, F32), (math.nan, F32), (math.inf, F32), ("1e-6", STR)])
@pytest.mark.parametrize("key", ["qwen2.rope.freq_base", "qwen2.attention.layer_norm_rms_epsilon"])
def test_gguf_constants(capsys, tmp_path, good_gguf, key, value):
    bad = _rewritten(good_gguf, tmp_path / "bad.gguf", {key: value})
    _refused(capsys, bad, tmp_path, [key, "positive finite number"])


@pytest.mark.parametrize("key, value, words", [
    # the case: hidden // heads was the first arithmetic, a ZeroDivisionError
    ("qwen2.attention.head_count", 0, ["qwen2.attention.head_count 0", "integer >= 1"]),
    ("qwen2.attention.head_count", 5, ["qwen2.embedding_length 64 is not a multiple of qwen2.attention.head_count 5"]),
    ("qwen2.attention.head_count_kv", 3, ["qwen2.attention.head_count 4 is not a multiple of "
                                          "qwen2.attention.head_count_kv 3"]),
    ("qwen2.block_count", 10**9, ["qwen2.block_count 1000000000", "more layers than the tensors hold (2)"]),
    ("qwen2.embedding_length", 4096, ["qwen2.embedding_length 4096 does not fit the tensors"]),
    ("qwen2.feed_forward_length", 10**6, ["qwen2.feed_forward_length 1000000 does not fit the tensors"]),
    ("qwen2.vocab_size", 10**7, ["qwen2.vocab_size 10000000 does not fit the tensors"]),
    ("qwen2.attention.head_count_kv", 4, ["qwen2.attention.head_count_kv 4 x head dim 16 = 64 rows"]),
    ("qwen2.attention.key_length", 32, ["qwen2.attention.head_count 4 x head dim 32 = 128 rows"]),
    ("tokenizer.ggml.eos_token_id", 10**6, ["tokenizer.ggml.eos_token_id 1000000", "from 0 to 258"]),
])
def test_gguf_impossible_sizes(capsys, tmp_path, good_gguf, key, value, words):
    bad = _rewritten(good_gguf, tmp_path / "bad.gguf", {key: (value, U32)})
    _refused(capsys, bad, tmp_path, words)


def test_gguf_without_tokens_says_so(capsys, tmp_path, good_gguf):
    bad = _rewritten(good_gguf, tmp_path / "bad.gguf", drop=("tokenizer.ggml.tokens",))
    _refused(capsys, bad, tmp_path, ["no tokenizer vocabulary (tokenizer.ggml.tokens)"])


def test_gguf_missing_key(capsys, tmp_path, good_gguf):
    bad = _rewritten(good_gguf, tmp_path / "bad.gguf", drop=("qwen2.feed_forward_length",))
    _refused(capsys, bad, tmp_path, ["lacks qwen2.feed_forward_length"])


def test_rewritten_gguf_still_exports(tmp_path, good_gguf):
    """The rewriting above changes only what a case sets: the file as it was exports."""
    same = _rewritten(good_gguf, tmp_path / "same.gguf")
    assert main(["-q", "export", str(same), "-o", str(tmp_path / "m.onnx")]) == 0


# --- a Hugging Face config.json ---------------------------------------------------------------

_HF_COUNTS = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "max_position_embeddings"]
_NULLABLE = {"num_key_value_heads", "head_dim"}   # null: as many as the heads / hidden over heads, transformers' reading


@pytest.mark.parametrize("key, value", [(k, v) for k in _HF_COUNTS for v in ("16", None, -2, 0, math.nan, 8.5, True)
                                        if not (v is None and k in _NULLABLE)])
def test_hf_counts(capsys, tiny_lm, tmp_path, key, value):
    _refused(capsys, _hf_dir(tiny_lm, tmp_path, weights=False, **{key: value}), tmp_path,
             [f"config.json: {key} ", "must be an integer"])


def test_hf_nullable_counts(capsys, tiny_lm, tmp_path):
    """null head_dim is hidden / heads (32 here, the tensors' own); null KV heads are as many
    as the heads (4), which the tensors' 2 refute, naming the key."""
    src = _hf_dir(tiny_lm, tmp_path, head_dim=None)
    assert main(["-q", "export", str(src), "-o", str(tmp_path / "m.onnx")]) == 0
    _refused(capsys, _hf_dir(tiny_lm, tmp_path / "kv", num_key_value_heads=None), tmp_path / "kv",
             ["num_key_value_heads 4 x head dim 32 = 128 rows, but model.layers.0.self_attn.k_proj.weight has 64"])


@pytest.mark.parametrize("value", ["1e-6", None, -1e-6, 0, math.nan, math.inf])
@pytest.mark.parametrize("key", ["rope_theta", "rope_parameters.rope_theta", "rms_norm_eps"])
def test_hf_constants(capsys, tiny_lm, tmp_path, key, value):
    # transformers 5 writes rope_theta inside rope_parameters, 4 at the top level
    fields = ({"rope_parameters": {"rope_type": "default", "rope_theta": value}} if key.startswith("rope_parameters")
              else {"rope_parameters": None, key: value})
    _refused(capsys, _hf_dir(tiny_lm, tmp_path, weights=False, **fields), tmp_path, [f"{key} ", "positive finite number"])


@pytest.mark.parametrize("key, value, words", [
    ("num_attention_heads", 0, ["num_attention_heads 0 must be an integer >= 1"]),
    ("num_attention_heads", 3, ["num_attention_heads 3 is not a multiple of num_key_value_heads 2"]),
    ("num_key_value_heads", 3, ["num_attention_heads 4 is not a multiple of num_key_value_heads 3"]),
    ("num_hidden_layers", 10**9, ["num_hidden_layers 1000000000 is more layers than the tensors hold (2)"]),
    ("intermediate_size", 64, ["intermediate_size 64 does not fit the tensors"]),
    ("vocab_size", 10**6, ["vocab_size 1000000 does not fit the tensors"]),
    ("eos_token_id", 10**6, ["eos_token_id 1000000 must be an integer from 0 to"]),
    ("eos_token_id", [1, "2"], ["eos_token_id \"2\" must be an integer"]),
    ("bos_token_id", -1, ["bos_token_id -1 must be an integer from 0 to"]),
    ("tie_word_embeddings", "yes", ["tie_word_embeddings \"yes\" must be true or false"]),
])
def test_hf_impossible_sizes(capsys, tiny_lm, tmp_path, key, value, words):
    _refused(capsys, _hf_dir(tiny_lm, tmp_path, **{key: value}), tmp_path, words)


def test_hf_heads_not_dividing_hidden(capsys, tiny_lm, tmp_path):
    src = _hf_dir(tiny_lm, tmp_path, weights=False, num_attention_heads=6, num_key_value_heads=3, head_dim=None)
    _refused(capsys, src, tmp_path, ["hidden_size 128 is not a multiple of num_attention_heads 6"])


def test_hf_absurd_depth_without_layer_types(capsys, tiny_lm, tmp_path):
    """transformers' config class builds a list num_hidden_layers long where layer_types is
    absent: the depth is held against the tensors before it is handed one."""
    src = _hf_dir(tiny_lm, tmp_path, num_hidden_layers=10**9, layer_types=None)
    _refused(capsys, src, tmp_path, ["num_hidden_layers 1000000000 is more layers than the tensors hold (2)"])


def test_hf_missing_key(capsys, tiny_lm, tmp_path):
    src = _hf_dir(tiny_lm, tmp_path, weights=False)
    cfg = json.loads((src / "config.json").read_text())
    del cfg["hidden_size"]
    (src / "config.json").write_text(json.dumps(cfg))
    _refused(capsys, src, tmp_path, ["config lacks hidden_size"])
