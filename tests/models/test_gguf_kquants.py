"""A GGUF's Q4_K and Q5_0 weights kept exactly (models/gguf_blocks.py): Q4_K's sub-blocks as
Q4_1-like blocks with float32 scales d sc and minimums -dmin mn, Q5_0 as 8-bit codes; the graph
runs in onnxruntime as the float reference on the file's dequantized weights, and the artifact
computes the same on the host and on arm-yitian."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from test_gguf_formats import (
    STEPS,
    _compiled_logits,
    _config,
    _params,
    assert_graph_follows_the_float_reference,
    compile_host_builds,
    write_random_model,
)

from qwc import weight_formats
from qwc.cli import main
from qwc.config import ModelConfig, sidecar_paths
from qwc.errors import QwcError
from qwc.kquants import quantize_q5_k
from qwc.models import gguf_blocks
from qwc.q4 import unpack_nibbles

from conftest import (
    KEEPS_FILE_CODES,
    compact_k_factors,
    one_line,
    ort_kv_logits,
    random_q4_k,
    random_q6_k,
)

# rows of 256 (hidden) and 512 (intermediate): whole Q4_K super-blocks
FORMATS = {"q_proj": Q.Q4_K, "k_proj": Q.Q4_K, "v_proj": Q.Q5_0, "o_proj": Q.Q4_K,
           "gate_proj": Q.Q4_K, "up_proj": Q.Q4_K, "down_proj": Q.Q5_0}


# llama.cpp's Q4_K_M mix in small: Q6_K for attn_v and ffn_down (its "more bits" layers)
Q4_K_M_FORMATS = {**FORMATS, "v_proj": Q.Q6_K, "down_proj": Q.Q6_K}


def write_model(path, formats=None, embedding=Q.Q8_0, seed: int = 0) -> dict[str, tuple[np.ndarray, Q]]:
    def matrix(rng, name, shape):
        kind = embedding if "embed" in name else (formats or FORMATS)[name.split(".")[-2]]
        if kind == Q.Q4_K:
            return random_q4_k(rng, *shape), kind
        if kind == Q.Q6_K:
            return random_q6_k(rng, *shape), kind
        if kind == Q.Q5_K:   # qwc's own quantizer on normal weights (random codes give a degenerate model)
            return quantize_q5_k((0.1 * rng.standard_normal(shape)).astype(np.float32)), kind
        return quantize((0.1 * rng.standard_normal(shape)).astype(np.float32), kind), kind

    return write_random_model(path, _config("tiny-kquants", hidden=256, intermediate=512), matrix, seed)


@pytest.fixture(scope="module")
def k_model(tmp_path_factory):
    return exported_model(tmp_path_factory.mktemp("kquants"), FORMATS, 0)


def exported_model(d, formats: dict, seed: int):
    """write_model's file in d, exported as it is (m.onnx) and as float32 (float.onnx, the
    reference); (d, what the file holds)."""
    held = write_model(d / "m.gguf", formats, seed=seed)
    assert main(["-q", "export", str(d / "m.gguf"), "-o", str(d / "m.onnx")]) == 0
    assert main(["-q", "export", str(d / "m.gguf"), "--exporter", "torch", "-o", str(d / "float.onnx")]) == 0
    return d, held


def test_q4_k_and_q5_0_blocks_dequantize_as_llama_cpp_does():
    rng = np.random.default_rng(2)
    raw = random_q4_k(rng, 4, 512)
    b = gguf_blocks.from_gguf(raw, "Q4_K", (4, 512), "w")
    assert b.bits == 4 and b.mins == "q4_k" and b.scales.shape == (4, 16)
    assert np.array_equal(gguf_blocks.dequantize(b), dequantize(raw, Q.Q4_K).reshape(4, 512))
    w = (0.1 * rng.standard_normal((4, 128))).astype(np.float32)
    raw = quantize(w, Q.Q5_0)
    b = gguf_blocks.from_gguf(raw, "Q5_0", w.shape, "w")
    assert b.bits == 8 and np.array_equal(gguf_blocks.dequantize(b), dequantize(raw, Q.Q5_0).reshape(w.shape))


@pytest.mark.parametrize("kind", [Q.Q4_K, Q.Q6_K, Q.Q4_1], ids=["q4_k", "q6_k", "q4_1"])
def test_a_tensor_parsed_a_chunk_of_rows_at_a_time_is_the_same(monkeypatch, kind):
    """from_gguf parses ROWS_AT_ONCE rows at a time (a 7B output's temporaries were 3.6 GB):
    ragged chunks of 3 give the whole parse's arrays, zero points included."""
    rng = np.random.default_rng(5)
    n, k = 10, 512
    raw = {Q.Q4_K: lambda: random_q4_k(rng, n, k), Q.Q6_K: lambda: random_q6_k(rng, n, k),
           Q.Q4_1: lambda: quantize(rng.standard_normal((n, k)).astype(np.float32), Q.Q4_1)}[kind]()
    whole = gguf_blocks.from_gguf(raw, kind.name, (n, k), "w")
    monkeypatch.setattr(gguf_blocks, "ROWS_AT_ONCE", 3)
    chunked = gguf_blocks.from_gguf(raw, kind.name, (n, k), "w")
    for a, b in ((whole.codes, chunked.codes), (whole.scales, chunked.scales), (whole.zero_points, chunked.zero_points)):
        assert (a is None and b is None) or (a.dtype == b.dtype and np.array_equal(a, b))


def test_q4_k_minimums_come_back_from_float_zero_points():
    """dmin mn has up to 17 significant bits: the fp16 rounding of Q4_1's rule would lose them."""
    d = np.float16(3.0e-4).astype(np.float32) * np.arange(1, 64, dtype=np.float32)
    m = -(np.float16(2.7e-4).astype(np.float32) * np.arange(63, 0, -1, dtype=np.float32))
    zp = (-m / d).astype(np.float32)
    assert np.array_equal(gguf_blocks.block_mins(d, zp, "q4_k"), m)
    assert not np.array_equal(gguf_blocks.block_mins(d, zp, "fp16"), m)


@pytest.mark.parametrize("damage, message", [
    (lambda raw: raw[:, :-1], "bytes are not 2 rows of 2 Q4_K blocks"),
    (lambda raw: _with_d(raw, np.nan), "Q4_K scales are NaN or infinite"),
    (lambda raw: _with_d(raw, np.inf), "Q4_K scales are NaN or infinite"),
])
def test_bad_q4_k_tensors_are_refused_naming_the_tensor(damage, message):
    raw = random_q4_k(np.random.default_rng(3), 2, 512)
    with pytest.raises(QwcError, match=f"^blk.0.attn_q.weight: .*{message}"):
        gguf_blocks.from_gguf(damage(raw), "Q4_K", (2, 512), "blk.0.attn_q.weight")
    with pytest.raises(QwcError, match="rows of 320 are not whole blocks of 256"):
        gguf_blocks.from_gguf(raw, "Q4_K", (2, 320), "w")


def _with_d(raw: np.ndarray, value) -> np.ndarray:
    raw = raw.copy()
    raw[1, 144 + 2:144 + 4] = np.array([value], np.float16).view(np.uint8)   # row 1, super-block 1's dmin
    return raw


def test_a_nan_scale_in_the_file_fails_the_export_in_one_line(tmp_path, capsys):
    held = write_model(tmp_path / "m.gguf")
    raw, _ = held["model.layers.1.mlp.up_proj.weight"]
    from gguf import GGUFReader

    at = next(t for t in GGUFReader(tmp_path / "m.gguf").tensors if t.name == "blk.1.ffn_up.weight").data_offset
    with open(tmp_path / "m.gguf", "r+b") as f:
        f.seek(at)
        f.write(np.array([np.nan], np.float16).tobytes())
    code = main(["-q", "export", str(tmp_path / "m.gguf"), "-o", str(tmp_path / "m.onnx")])
    one_line(capsys, code, "blk.1.ffn_up.weight: 1 Q4_K scales are NaN or infinite")
    assert not (tmp_path / "m.onnx").exists()


def test_a_q4_k_embedding_is_requantized_and_its_linears_kept(tmp_path, capsys):
    """GatherBlockQuantized has no float zero points: a Q4_K embedding (and the tied head reading
    it) takes --requant's format, as a Q4_1 one does."""
    write_model(tmp_path / "m.gguf", embedding=Q.Q4_K)
    assert main(["export", str(tmp_path / "m.gguf"), "-o", str(tmp_path / "m.onnx")]) == 0
    err = capsys.readouterr().err
    assert "1 Q4_K -> Q8_0" in err and "10 Q4_K," in err and "4 Q5_0 (exact, as 8-bit codes)" in err, err
    model = onnx.load(str(tmp_path / "m.onnx"))
    gbq = next(n for n in model.graph.node if n.op_type == "GatherBlockQuantized")
    assert next(a.i for a in gbq.attribute if a.name == "bits") == 8


@pytest.mark.parametrize("kind", [Q.Q4_K, Q.Q4_1, Q.Q5_K, Q.Q5_1], ids=["q4_k", "q4_1", "q5_k", "q5_1"])
def test_an_untied_embedding_with_minimums_is_the_files(tmp_path, capsys, kind):
    """An untied model's Q4_K, Q4_1, Q5_K or Q5_1 token embedding (a 7B Q4_K_M or Q5_K_M file's)
    keeps the file's codes and scales: GatherBlockQuantized's d (q - 8) plus each block's
    c = m + 8 d (Q5's: d (u - 128) plus m; models/stream_export.py), where it was written as
    Q8_0. The graph follows the float reference in onnxruntime as the kept linears do; the
    compiled artifact (Q4_K, Q5_K) too."""
    import dataclasses

    cfg = dataclasses.replace(_config("tiny-kquants", hidden=256, intermediate=512), tie_word_embeddings=False)

    def matrix(rng, name, shape):
        if "embed" in name:
            w = (0.1 * rng.standard_normal(shape)).astype(np.float32)
            made = {Q.Q4_K: lambda: random_q4_k(rng, *shape), Q.Q5_K: lambda: quantize_q5_k(w)}
            return made.get(kind, lambda: quantize(w, kind))(), kind
        return quantize((0.1 * rng.standard_normal(shape)).astype(np.float32), Q.Q8_0), Q.Q8_0

    write_random_model(tmp_path / "m.gguf", cfg, matrix, 0)
    assert main(["export", str(tmp_path / "m.gguf"), "-o", str(tmp_path / "m.onnx")]) == 0
    said = next(line for line in capsys.readouterr().err.splitlines() if "as the file gives them" in line)
    assert re.search(rf"\b1 {kind.name}\b", said) and "->" not in said, said   # kept: nothing requantized
    model = onnx.load(str(tmp_path / "m.onnx"), load_external_data=False)
    gbq = next(n for n in model.graph.node if n.op_type == "GatherBlockQuantized")
    assert next(a.i for a in gbq.attribute if a.name == "bits") == (8 if kind in (Q.Q5_K, Q.Q5_1) else 4)
    assert main(["-q", "export", str(tmp_path / "m.gguf"), "--exporter", "torch", "-o", str(tmp_path / "float.onnx")]) == 0
    assert_graph_follows_the_float_reference(tmp_path)
    if kind not in (Q.Q4_K, Q.Q5_K):
        return
    art = tmp_path / "host.qwc"
    assert main(["-q", "compile", str(tmp_path / "m.onnx"), "--kv-dtype", "f32", "-o", str(art)]) == 0
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["quantization"]["embedding_bits"] == (4 if kind == Q.Q4_K else 8)
    if kind == Q.Q4_K:   # the table at the file's factors (test_an_untied_q4_k_table_gathers_the_files_weights)
        assert manifest["quantization"]["weight_layout"]["q4_k_compact_embedding"] == 1
        assert not any("embed_tokens" in p["name"] and p["dtype"] == "float32" for p in manifest["params"])
    ref = np.stack([r[0, -1] for r in ort_kv_logits(tmp_path / "float.onnx", cfg, STEPS[0], STEPS[1:])])
    got = _compiled_logits(art)
    # Q8_0 activations, as llama.cpp's (3.1% for this Q5_K model: its kernels are exact against
    # the quantized activations, tests/compiler/test_q5_minimums.py)
    assert np.abs(got - ref).max() / np.abs(ref).max() < (3e-2 if kind == Q.Q4_K else 5e-2)


@pytest.mark.parametrize("target", ["x86-avx512", "arm-yitian"])
def test_an_untied_q4_k_table_gathers_the_files_weights(tmp_path, target):
    """compile time's q4_k_gather takes an untied Q4_K table's factors back from the graph's
    scales and block offsets (compiler/repack_q4_k.py) into the target's compact form (x86's
    bytes, ARM's six-bit pairs): one gather node, no float32 table left, and the gather
    kernel's rows are the file's weights to the bit."""
    import dataclasses

    import tvm

    from qwc.compiler.kernels import generic
    from qwc.compiler.repack_q4_k import q4_k_gather
    from qwc.compiler.targets import get_target
    from qwc.passes.graph import tensor_array

    cfg = dataclasses.replace(_config("tiny-kquants", hidden=256, intermediate=512), tie_word_embeddings=False)

    def matrix(rng, name, shape):
        if "embed" in name:
            return random_q4_k(rng, *shape), Q.Q4_K
        return quantize((0.1 * rng.standard_normal(shape)).astype(np.float32), Q.Q8_0), Q.Q8_0

    raw = write_random_model(tmp_path / "m.gguf", cfg, matrix, 3)["model.embed_tokens.weight"][0]
    assert main(["-q", "export", str(tmp_path / "m.gguf"), "-o", str(tmp_path / "m.onnx")]) == 0
    model = onnx.load(str(tmp_path / "m.onnx"))
    assert q4_k_gather(model, get_target(target).features) == 1
    gbq = [n for n in model.graph.node if n.op_type == "GatherBlockQuantized"]
    assert len(gbq) == 1 and not any(n.op_type in ("Gather", "Add") and "embed" in n.name for n in model.graph.node)
    inits = {t.name: tensor_array(t) for t in model.graph.initializer}
    assert not any("embed_tokens" in name and a.dtype == np.float32 for name, a in inits.items())
    w, ws, wc = (inits[x] for x in (gbq[0].input[0], gbq[0].input[2], gbq[0].input[3]))
    assert ws.shape[-1] == (48 if target.startswith("arm") else 32)
    v = w.shape[0]
    ids = tvm.te.placeholder((v,), "int64", name="ids")
    args = [tvm.te.placeholder(x.shape, str(x.dtype)) for x in (w, ws, wc)]
    out = generic.gather_q4_k_compact(args[0], ids, args[1], args[2])
    f = tvm.compile(tvm.te.create_prim_func([args[0], ids, args[1], args[2], out]), target="llvm")
    got = tvm.runtime.tensor(np.zeros((v, w.shape[1], 32), np.float32))
    f(*(tvm.runtime.tensor(x) for x in (w, np.arange(v, dtype=np.int64), ws, wc)), got)
    want = dequantize(raw, Q.Q4_K).reshape(v, -1)
    assert np.array_equal(got.numpy().reshape(v, -1), want)


def _file_codes(raw: np.ndarray, kind: Q, n: int, k: int) -> tuple[np.ndarray, ...]:
    """What the file holds, in order along each row: Q4_K (codes, d sc, -dmin mn) per sub-block
    of 32; Q5_0 (5-bit codes, d) per block (llama.cpp's layout read independently)."""
    if kind == Q.Q5_0:
        blk = raw.reshape(n, k // 32, 22)
        d = blk[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
        high = np.unpackbits(blk[..., 2:6], axis=-1, bitorder="little")
        low = np.concatenate([blk[..., 6:] & 15, blk[..., 6:] >> 4], axis=-1)
        return low + 16 * high, d
    blk = raw.reshape(n, k // 256, 144)
    d, dmin = (blk[..., a:a + 2].copy().view(np.float16)[..., 0].astype(np.float32) for a in (0, 2))
    s = blk[..., 4:16]
    sc = [s[..., j] & 63 if j < 4 else (s[..., j + 4] & 15) | ((s[..., j - 4] >> 6) << 4) for j in range(8)]
    mn = [s[..., j + 4] & 63 if j < 4 else (s[..., j + 4] >> 4) | ((s[..., j] >> 6) << 4) for j in range(8)]
    qs = blk[..., 16:].reshape(n, k // 256, 4, 32)
    codes = np.stack([qs[..., j // 2, :] >> (4 * (j % 2)) & 15 for j in range(8)], axis=2).reshape(n, -1, 32)
    scales = (d[..., None] * np.stack(sc, -1)).reshape(n, -1)
    mins = -(dmin[..., None] * np.stack(mn, -1)).reshape(n, -1)
    return codes, scales, mins


def _graph_linears(d, held):
    """(node, initializers, HF name, the file's bytes and type, N, K) of each linear in d/m.onnx
    but the head."""
    model = onnx.load(str(d / "m.onnx"))
    inits = {t.name: onnx.numpy_helper.to_array(t, base_dir=str(d)) for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type != "MatMulNBits" or "lm_head" in node.name:
            continue
        hf = node.name.removeprefix("/").removesuffix("/MatMulNBits").replace("/", ".") + ".weight"
        k, n = (next(a.i for a in node.attribute if a.name == x) for x in ("K", "N"))
        yield (node, inits, hf, *held[hf], n, k)


def test_graph_holds_the_files_codes_and_scales(k_model):
    seen = {Q.Q4_K: 0, Q.Q5_0: 0}
    for node, inits, hf, raw, kind, n, k in _graph_linears(*k_model):
        codes, scales = unpack_nibbles(inits[node.input[1]]), inits[node.input[2]]
        if kind == Q.Q5_0:
            q, dd = _file_codes(raw, kind, n, k)
            assert np.array_equal(inits[node.input[1]].astype(np.int32) - 112, q) and np.array_equal(scales, dd), hf
        else:
            q, dd, mins = _file_codes(raw, kind, n, k)
            flat = dd == 0   # row 0's first sub-block: scale 0, written as d = 1 with codes 0
            assert flat[0, 0]
            assert np.array_equal(codes.reshape(q.shape)[~flat], q[~flat]) and not codes.reshape(q.shape)[flat].any()
            assert np.array_equal(scales[~flat], dd[~flat]) and np.all(scales[flat] == 1), hf
            assert weight_formats.format_of(node).name == "Q4_K" and weight_formats.marked(node) is not None
            back = gguf_blocks.block_mins(scales, inits[node.input[3]], "q4_k")
            assert np.array_equal(back, mins), hf
        seen[kind] += 1
    assert seen == {Q.Q4_K: 10, Q.Q5_0: 4}


def test_graph_runs_in_onnxruntime_as_the_float_reference(k_model):
    assert_graph_follows_the_float_reference(k_model[0])


@pytest.fixture(scope="module")
def host_builds(k_model):
    return compile_host_builds(k_model[0])


@pytest.mark.slow
def test_artifact_runs_the_kept_formats_as_the_float_reference(k_model, host_builds):
    """Q4_K on the Q4_0 kernels with a block offset each, made from the file's factors
    (compiler/repack_q4_k.py), Q5_0 on the 8-bit paths; the manifest names them."""
    d, _ = k_model
    cfg = ModelConfig.load(sidecar_paths(d / "m.onnx")[0])
    manifest = json.loads((host_builds[8] / "manifest.json").read_text())
    linears = {f["format"]: f["count"] for f in manifest["quantization"]["linears"]}
    assert linears == {"q4_k": 10, "q5_0": 4, "q8_0": 1}   # Q5_0 by its marker (8-bit codes), the tied Q8_0 head
    assert manifest["quantization"]["weight_layout"]["row_groups_16"] >= 10   # Q4_K in the kernels' layout
    assert manifest["quantization"]["weight_layout"]["q4_k_compact_scales"] == 10   # with the file's factors
    ref = np.stack([r[0, -1] for r in ort_kv_logits(d / "float.onnx", cfg, STEPS[0], STEPS[1:])])
    a32, a8 = _compiled_logits(host_builds[32]), _compiled_logits(host_builds[8])
    span = np.abs(ref).max()
    assert np.abs(a32 - ref).max() / span < 1e-4          # float activations: float rounding
    assert np.abs(a8 - ref).max() / span < 3e-2           # Q8_0 activations, as llama.cpp's
    assert np.abs(a8 - a32).max() > 0


# llama.cpp's greedy tokens after STEPS[0] on write_model()'s weights: llama-server (llama-cpp-python
# 0.3.36's tree, bench/llamacpp.sh x86) at "temperature": 0, "n_predict": 8, "ignore_eos": true,
# "return_tokens": true, the prompt as these ids. Its file was written with one merge ("Ā ā"):
# llama.cpp's loader needs the key, transformers' refuses a merge outside the vocabulary.
LLAMA_CPP_GREEDY = [44, 44, 44, 215, 176, 176, 176, 176]
NEAR_TIE = 0.1   # logits: where two engines' Q8_0 activations may round a tie either way


# The weights llama-server's tokens (LLAMA_CPP_GREEDY, _Q4_K_M, _Q5) were recorded on, as
# digests: a change to how the random files are made (their draw order, a quantizer) makes
# other models, on which the recorded tokens and the measured tolerances no longer hold; this
# names that at once (record the tokens again: bench/kquant_files.py --gguf FILE).
RECORDED_WEIGHTS = {0: "cb4be443cd4fc60e", 4: "51f37d4da77ba9a5", 6: "6a01a57c161aaf1e"}


@pytest.mark.parametrize("seed", [0, 4, 6], ids=["q4_k_q5_0", "q4_k_m", "q5"])
def test_the_files_written_are_those_the_tokens_were_recorded_on(tmp_path, seed):
    formats = {0: FORMATS, 4: Q4_K_M_FORMATS, 6: Q5_FORMATS}[seed]
    held = write_model(tmp_path / "m.gguf", formats, seed=seed)
    h = hashlib.sha256()
    for name in sorted(held):
        a, kind = held[name]
        h.update(f"{name} {kind.name if kind else None} {a.dtype} {a.shape}".encode())
        h.update(a.tobytes())
    assert h.hexdigest()[:16] == RECORDED_WEIGHTS[seed]


@pytest.mark.slow
def test_greedy_tokens_follow_llama_cpp_on_the_same_file(host_builds):
    from qwc.runtime.engine import Engine

    eng = Engine(host_builds[8], ctx=64)
    logits, agree = eng.prefill(STEPS[0][0]), 0
    for t in LLAMA_CPP_GREEDY:
        agree += int(logits.argmax()) == t
        assert logits.max() - logits[t] < NEAR_TIE
        logits = eng.decode(t)
    assert agree >= len(LLAMA_CPP_GREEDY) - 1


@pytest.mark.arm
@pytest.mark.slow
def test_kept_formats_on_arm_yitian_match_the_host(k_model, host_builds, tmp_path):
    manifest = _arm_yitian_follows_the_host(k_model[0], host_builds, tmp_path)
    assert manifest["quantization"]["weight_layout"]["q4_k_compact_scales"] == 10   # the file's factors, as x86


# Where an ARM graph has compact Q4_K, its activations are scaled by super-blocks of 256 (llama.cpp's
# Q8_K), the host's by blocks of 32: a coarser rounding of every activation, so the two builds are
# each held to the float reference, the ARM one at Q8_K's looser bound (its error on the Q4_K_M-like
# file, whose activations have wide super-blocks, measured 0.042 of the largest logit)
Q8_K_TOLERANCE = 6e-2


def _arm_yitian_follows_the_host(d, host_builds, tmp_path, greedy: list[int] | None = None,
                                 host_tolerance: float = 3e-2) -> dict:
    """d/m.onnx compiled for arm-yitian runs STEPS under qemu near the host's Q8_0-activation
    build: an activation on a rounding boundary may move by one step of its block's scale
    between the two ISAs' kernels (see test_gguf_formats' ARM test). With compact Q4_K the ARM
    build's activations are Q8_K's (so with IQ4_XS's own factors): then both builds are held to
    the float reference instead,
    and the ARM build's greedy token is the reference's own or within Q8_K's tolerance of it.
    `greedy`: llama-server's greedy tokens on the same file, which the ARM build's picks
    after STEPS[0] and each of them fed in turn must equal. `host_tolerance`: the host build's
    own test's bound against the float reference. Returns its manifest."""
    from qwc.bench import emulation
    from qwc.compiler.compile import compile_file

    env = emulation.arm64_env()
    art = tmp_path / "yitian.qwc"
    compile_file(d / "m.onnx", "arm-yitian", art, act_bits=8, kv_type="f32")
    out = tmp_path / "arm.npy"
    steps = json.dumps([STEPS[0][0].tolist()] + [int(t[0, 0]) for t in STEPS[1:]])
    r = subprocess.run(emulation.engine_command(env, art, out, steps), env=env, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    if greedy is not None:
        picked = tmp_path / "greedy.npy"
        r = subprocess.run(emulation.engine_command(env, art, picked, json.dumps([STEPS[0][0].tolist()] + greedy[:-1])),
                           env=env, capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stderr[-2000:]
        assert np.load(picked).argmax(-1).tolist() == greedy
    manifest = json.loads((art / "manifest.json").read_text())
    arm, host = np.load(out), _compiled_logits(host_builds[8])
    layout = manifest["quantization"]["weight_layout"]
    # compact K-quant factors (Q4_K's, or Q5_K's in five-bit codes) put ARM's activations in Q8_K
    q5_k = any(f["format"] == "q5_k" for f in manifest["quantization"]["linears"])
    if ("q4_k_compact_scales" not in layout and "iq4_xs_compact_scales" not in layout
            and not (q5_k and "five_bit_codes" in layout)):
        assert np.abs(arm - host).max() / np.abs(host).max() < 2e-2
        assert np.array_equal(arm.argmax(-1), host.argmax(-1))
        return manifest
    cfg = ModelConfig.load(sidecar_paths(d / "m.onnx")[0])
    ref = np.stack([r[0, -1] for r in ort_kv_logits(d / "float.onnx", cfg, STEPS[0], STEPS[1:])])
    span = np.abs(ref).max()
    assert np.abs(host - ref).max() / span < host_tolerance   # Q8_0 activations, as the host test holds
    assert np.abs(arm - ref).max() / span < Q8_K_TOLERANCE
    chosen = ref[np.arange(len(ref)), arm.argmax(-1)]
    assert (ref.max(-1) - chosen <= Q8_K_TOLERANCE * span).all()
    return manifest


def test_an_unknown_type_id_fails_the_export_naming_the_tensor(tmp_path, capsys):
    write_model(tmp_path / "m.gguf")
    data = bytearray((tmp_path / "m.gguf").read_bytes())
    name = b"blk.1.attn_v.weight"   # its tensor info: name, n_dims (u32), dims (u64 each), type (u32)
    at = data.find(name) + len(name)
    at += 4 + 8 * int.from_bytes(data[at:at + 4], "little")
    data[at:at + 4] = (77).to_bytes(4, "little")
    (tmp_path / "m.gguf").write_bytes(bytes(data))
    code = main(["-q", "export", str(tmp_path / "m.gguf"), "-o", str(tmp_path / "m.onnx")])
    one_line(capsys, code, "tensor blk.1.attn_v.weight has type id 77, which is no GGML type")
    assert not (tmp_path / "m.onnx").exists()


# -- Q6_K: a Q4_K_M-like file (Q6_K for attn_v and ffn_down) ---------------------------------

@pytest.fixture(scope="module")
def q4_k_m_model(tmp_path_factory):
    return exported_model(tmp_path_factory.mktemp("q4_k_m"), Q4_K_M_FORMATS, 4)


def _q6_k_file(raw: np.ndarray, n: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A Q6_K tensor's codes q (0..63) [N, K], sub-block scales sc [N, K/16] and d [N, K/256],
    read from its bytes in llama.cpp's layout, apart from models/gguf_blocks.py: each half of
    a super-block, weight 32 j + l takes nibble j // 2 of ql[32 (j % 2) + l], bit pair j of qh[l]."""
    blk = raw.reshape(n, k // 256, 210)
    ql, qh = blk[..., :128].reshape(n, -1, 2, 64), blk[..., 128:192].reshape(n, -1, 2, 32)
    q = np.empty((n, k // 256, 2, 4, 32), np.int32)
    for j in range(4):
        q[..., j, :] = ((ql[..., 32 * (j % 2):32 * (j % 2) + 32] >> (4 * (j // 2))) & 15) | (((qh >> (2 * j)) & 3) << 4)
    d = blk[..., 208:210].copy().view(np.float16)[..., 0].astype(np.float32)
    return q.reshape(n, k), blk[..., 192:208].view(np.int8).reshape(n, -1), d


def test_q6_k_export_keeps_the_files_blocks_and_names_them(tmp_path, capsys):
    write_model(tmp_path / "m.gguf", Q4_K_M_FORMATS, seed=4)
    assert main(["export", str(tmp_path / "m.gguf"), "-o", str(tmp_path / "m.onnx")]) == 0
    err = capsys.readouterr().err
    assert "4 Q6_K (exact, 8-bit blocks of 16)" in err and "10 Q4_K," in err, err
    model = onnx.load(str(tmp_path / "m.onnx"))
    q6 = [n for n in model.graph.node if n.op_type == "MatMulNBits"
          and next(a.i for a in n.attribute if a.name == "block_size") == 16]
    assert len(q6) == 4 and all(next(a.i for a in n.attribute if a.name == "bits") == 8 for n in q6)


def test_q6_k_graph_runs_in_onnxruntime_as_the_float_reference(q4_k_m_model):
    """A MatMulNBits of 8-bit blocks of 16 alone agrees with float64 to ~5e-7 of its largest
    output (with or without a bias, decode and prefill shapes); through two layers of this
    random model, float32 rounding of the two graphs' different sums reached 1.3e-5 to 9e-5 of
    the largest logit as its Q6_K weights' range changed. A code or scale out of place would
    move the logits by whole percents."""
    assert_graph_follows_the_float_reference(q4_k_m_model[0], tol=2e-4)


@pytest.fixture(scope="module")
def q4_k_m_builds(q4_k_m_model):
    return compile_host_builds(q4_k_m_model[0])


@pytest.mark.slow
@KEEPS_FILE_CODES
def test_q6_k_artifact_holds_the_files_codes_and_scales(q4_k_m_model, q4_k_m_builds):
    """The x86 artifact's Q6_K weights are the file's: codes (six-bit, in the W8A8 row groups'
    order), int8 sub-block scales and the super-block d, reordered only."""
    from qwc.compiler.kernels.row_groups import ROWS

    d, held = q4_k_m_model
    params = _params(q4_k_m_builds[8])
    seen = 0
    for hf, (raw, kind) in held.items():
        if kind != Q.Q6_K:
            continue
        n, k = raw.shape[0], raw.shape[1] // 210 * 256
        q, sc, dd = _q6_k_file(raw, n, k)
        stem = hf.removesuffix(".weight") + ".qweight"   # models/stream_export.py's name
        # (a weight some kernels read under TVM's name for it: the dots as underscores)
        w, psc, pd = (params.get(stem + s, params.get((stem + s).replace(".", "_")))
                      for s in (".qwc_q6_k", ".qwc_q6_k_sc", ".qwc_q6_k_d"))
        g, nb = w.shape[:2]
        # six bits: chunk c's low four in nibble chunk c % 4 (high nibble for c >= 4), its top
        # two at bits 2 (c % 4) of chunk 4 + c // 4
        u = np.stack([(w[:, :, c % 4] >> (4 * (c // 4)) & 15) | ((w[:, :, 4 + c // 4] >> (2 * (c % 4)) & 3) << 4)
                      for c in range(8)], axis=2)
        # [g, b, chunk, 4 r + c] -> row 16 g + r, block b, de-interleaved position 4 chunk + c
        u = u.reshape(g, nb, 8, ROWS, 4).transpose(0, 3, 1, 2, 4).reshape(g * ROWS, nb, 32)[:n]
        order = np.concatenate([np.arange(0, 32, 2), np.arange(1, 32, 2)])   # position p holds element order[p]
        codes = np.empty_like(u)
        codes[..., order] = u
        assert np.array_equal(codes.reshape(n, k).astype(np.int32), q), hf
        assert np.array_equal(psc.reshape(g, nb, 2, ROWS).transpose(0, 3, 1, 2).reshape(g * ROWS, -1)[:n], sc), hf
        assert np.array_equal(pd.transpose(0, 2, 1).reshape(g * ROWS, -1)[:n], dd), hf
        seen += 1
    assert seen == 4


@pytest.mark.slow
@KEEPS_FILE_CODES
def test_q6_k_artifact_runs_as_the_float_reference(q4_k_m_model, q4_k_m_builds):
    """Q6_K on its kernel (W6A8) and on the float-activation path (Q8_0 there); the manifest
    names the formats as they run."""
    d, _ = q4_k_m_model
    cfg = ModelConfig.load(sidecar_paths(d / "m.onnx")[0])
    for act, want in ((8, {"q4_k": 10, "q6_k": 4, "q8_0": 1}), (32, {"q4_k": 10, "q8_0": 5})):
        manifest = json.loads((q4_k_m_builds[act] / "manifest.json").read_text())
        assert {f["format"]: f["count"] for f in manifest["quantization"]["linears"]} == want, act
    ref = np.stack([r[0, -1] for r in ort_kv_logits(d / "float.onnx", cfg, STEPS[0], STEPS[1:])])
    a32, a8 = _compiled_logits(q4_k_m_builds[32]), _compiled_logits(q4_k_m_builds[8])
    span = np.abs(ref).max()
    # this random model's third step is its most sensitive one (even onnxruntime's graph on the
    # file's blocks is 10x further from the float one there than at the others)
    assert np.abs(a8 - ref).max() / span < 2e-2           # Q6_K's own kernel, Q8_0 activations: 1.2%
    assert np.abs(a32 - ref).max() / span < 6e-2          # Q6_K as Q8_0: close, not exact (4% there)
    assert np.array_equal(a8.argmax(-1), ref.argmax(-1)) and np.array_equal(a32.argmax(-1), ref.argmax(-1))


# llama-server's greedy tokens after STEPS[0] on the Q4_K_M-like file (write_model(...,
# Q4_K_M_FORMATS, seed=4)), recorded as LLAMA_CPP_GREEDY is (the same build and request, the
# file rewritten with the one merge llama.cpp's loader needs)
LLAMA_CPP_GREEDY_Q4_K_M = [43, 151, 151, 151, 151, 151, 151, 151]


def _greedy_picks(art, tokens: list[int]) -> list[int]:
    """The artifact's greedy pick after STEPS[0] and after each of `tokens` fed in turn."""
    from qwc.runtime.engine import Engine

    eng = Engine(art, ctx=64)
    logits, got = eng.prefill(STEPS[0][0]), []
    for t in tokens:
        got.append(int(logits.argmax()))
        logits = eng.decode(t)
    return got


@pytest.mark.slow
def test_q6_k_greedy_tokens_equal_llama_cpps_on_the_same_file(q4_k_m_builds):
    assert _greedy_picks(q4_k_m_builds[8], LLAMA_CPP_GREEDY_Q4_K_M) == LLAMA_CPP_GREEDY_Q4_K_M


@pytest.mark.parametrize("damage, message", [
    (lambda raw: raw[:, :-1], "bytes are not 2 rows of 2 Q6_K blocks"),
    (lambda raw: _with_q6_k_d(raw, np.nan), "1 Q6_K scales are NaN or infinite"),
    (lambda raw: _with_q6_k_d(raw, -np.inf), "1 Q6_K scales are NaN or infinite"),
])
def test_bad_q6_k_tensors_are_refused_naming_the_tensor(damage, message):
    raw = random_q6_k(np.random.default_rng(5), 2, 512)
    with pytest.raises(QwcError, match=f"^blk.0.ffn_down.weight: .*{message}"):
        gguf_blocks.from_gguf(damage(raw), "Q6_K", (2, 512), "blk.0.ffn_down.weight")
    with pytest.raises(QwcError, match="rows of 320 are not whole blocks of 256"):
        gguf_blocks.from_gguf(raw, "Q6_K", (2, 320), "w")


def _with_q6_k_d(raw: np.ndarray, value) -> np.ndarray:
    raw = raw.copy()
    raw[1, 210 + 208:210 + 210] = np.array([value], np.float16).view(np.uint8)   # row 1, super-block 1's d
    return raw


@pytest.mark.arm
@pytest.mark.slow
@KEEPS_FILE_CODES
def test_q6_k_on_arm_yitian_matches_the_host(q4_k_m_model, q4_k_m_builds, tmp_path):
    """Q6_K on the sdot kernel (kernels/arm/q6_k.py) in the whole model under qemu, against the
    host's VNNI one: Q8_0 activations on both, so a rounding boundary may move one activation
    by a step between the ISAs' quantizers (as in the Q4_K test above); its greedy tokens are
    llama-server's."""
    manifest = _arm_yitian_follows_the_host(q4_k_m_model[0], q4_k_m_builds, tmp_path, LLAMA_CPP_GREEDY_Q4_K_M)
    assert {f["format"]: f["count"] for f in manifest["quantization"]["linears"]} == {"q4_k": 10, "q6_k": 4, "q8_0": 1}


def _at_rest_forms(art: Path) -> dict[str, int]:
    params = json.loads((art / "manifest.json").read_text())["params"]
    return dict(Counter(p["at_rest"]["form"] for p in params if p.get("at_rest")))


def _stored_whole(monkeypatch):
    """compile_file writes every parameter as the library reads it (no at-rest forms)."""
    from qwc.compiler import pack_at_rest

    monkeypatch.setattr(pack_at_rest, "plan", lambda model: {})


@pytest.mark.slow
def test_expanded_q4_k_stored_at_rest_loads_to_the_bit_on_the_host(q4_k_m_model, tmp_path, monkeypatch):
    """The Q4_K linears in the expanded form ARM's kernels read (forced here on the host's VNNI
    kernels, which read it too): params.bin holds their factors at rest, the engine rebuilds
    the float32 scales and offsets as it loads, and the logits are those of the same artifact
    stored whole, to the bit (qwc/params_at_rest.py)."""
    from qwc.compiler import repack_q4_k
    from qwc.compiler.compile import compile_file

    monkeypatch.setattr(repack_q4_k, "q4_k_compact", lambda *a: (0, 0))
    d = q4_k_m_model[0]
    rest, whole = tmp_path / "rest.qwc", tmp_path / "whole.qwc"
    compile_file(d / "m.onnx", "host", rest, act_bits=8, kv_type="f32")
    _stored_whole(monkeypatch)
    compile_file(d / "m.onnx", "host", whole, act_bits=8, kv_type="f32")
    assert _at_rest_forms(rest) == {"q4_k_scales": 10, "q4_k_offsets": 10}
    assert _at_rest_forms(whole) == {}
    assert (rest / "params.bin").stat().st_size < (whole / "params.bin").stat().st_size
    got, want = _compiled_logits(rest), _compiled_logits(whole)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    loaded = _params(rest)
    for name, a in _params(whole).items():
        assert np.array_equal(loaded[name].view(np.uint8), a.view(np.uint8)), name


@pytest.mark.arm
@pytest.mark.slow
def test_arm_yitian_reads_the_files_k_quant_bytes_with_nothing_to_unpack(q4_k_m_model, tmp_path):
    """On arm-yitian the kernels read Q4_K's factors in the file's compact form (sc and mn at
    six bits) and Q6_K's codes at six bits: params.bin holds the kernels' arrays (nothing at
    rest for the runtime to unpack), each Q6_K weight six bits of code plus its int8 scale a 16
    and the file's fp16 d a 256, each Q4_K weight its sc and mn in 12 bytes a 256 as the file.
    Their logits: _arm_yitian_follows_the_host."""
    from qwc.compiler.compile import compile_file

    art = tmp_path / "a.qwc"
    compile_file(q4_k_m_model[0] / "m.onnx", "arm-yitian", art, act_bits=8, kv_type="f32")
    assert _at_rest_forms(art) == {}
    # by the names TVM's importer may have sanitized (compiler/pack_at_rest.py: _names)
    params = {p["name"].replace(".", "_"): p for p in json.loads((art / "manifest.json").read_text())["params"]}
    codes = [(name, p) for name, p in params.items() if name.endswith("qwc_q6_k")]
    assert len(codes) == 4
    for name, p in codes:
        g, nb, chunks, width = p["shape"]
        assert (chunks, width, p["dtype"]) == (6, 64, "uint8")   # 6 bits a weight: 16 rows x 32 in 6 x 64 bytes
        bits = {q: 8 * params[name + q]["nbytes"] / (g * 16 * nb * 32) for q in ("_sc", "_d")}
        assert bits == {"_sc": 0.5, "_d": 0.0625}
    manifest = json.loads((art / "manifest.json").read_text())
    pairs = [p for p in params.values() if p["dtype"] == "uint8" and len(p["shape"]) == 3 and p["shape"][-1] == 48]
    assert len(pairs) == manifest["quantization"]["weight_layout"]["q4_k_compact_scales"] > 0
    for p in pairs:   # [G, NB/2, 48]: 16 rows' sc and mn of two blocks of 32
        g, pairs_, _ = p["shape"]
        assert 8 * p["nbytes"] / (g * 16 * 2 * pairs_ * 32) == 0.375


@pytest.mark.slow
@KEEPS_FILE_CODES
def test_a_tied_q6_k_embedding_and_head_stay_the_files(tmp_path, capsys):
    """A tied Q6_K token_embd (a Q4_K_M file of a model whose hidden size is a multiple of 256):
    the gather and the head read the same blocks of 16 in the graph, and one repacked copy in
    the artifact (generic.gather_q6_k_row_groups for the gather); the logits follow the float
    reference as the untied ones do, on the host and where Q6_K becomes Q8_0 (float activations)."""
    write_model(tmp_path / "m.gguf", Q4_K_M_FORMATS, embedding=Q.Q6_K, seed=4)
    assert main(["export", str(tmp_path / "m.gguf"), "-o", str(tmp_path / "m.onnx")]) == 0
    assert "5 Q6_K (exact, 8-bit blocks of 16)" in capsys.readouterr().err
    assert main(["-q", "export", str(tmp_path / "m.gguf"), "--exporter", "torch", "-o", str(tmp_path / "float.onnx")]) == 0
    model = onnx.load(str(tmp_path / "m.onnx"))
    gbq = next(n for n in model.graph.node if n.op_type == "GatherBlockQuantized")
    head = next(n for n in model.graph.node if n.name.startswith("/lm_head"))
    assert gbq.input[0] == head.input[1] and next(a.i for a in gbq.attribute if a.name == "block_size") == 16
    assert_graph_follows_the_float_reference(tmp_path, tol=2e-4)
    builds = compile_host_builds(tmp_path)
    names = set(_params(builds[8]))
    assert not any(n.startswith("model.embed_tokens") and not n.endswith(("qwc_q6_k", "qwc_q6_k_sc", "qwc_q6_k_d"))
                   for n in names), names   # one copy of the table: the kernel's
    cfg = ModelConfig.load(sidecar_paths(tmp_path / "m.onnx")[0])
    ref = np.stack([r[0, -1] for r in ort_kv_logits(tmp_path / "float.onnx", cfg, STEPS[0], STEPS[1:])])
    a32, a8 = _compiled_logits(builds[32]), _compiled_logits(builds[8])
    span = np.abs(ref).max()
    assert np.abs(a8 - ref).max() / span < 2e-2
    assert np.abs(a32 - ref).max() / span < 6e-2


# -- Q5_K and Q5_1: 8-bit codes with each block's minimum beside them (compiler/block_minimums.py)

Q5_FORMATS = {**{x: Q.Q5_K for x in FORMATS}, "down_proj": Q.Q5_1}


@pytest.fixture(scope="module")
def q5_model(tmp_path_factory):
    return exported_model(tmp_path_factory.mktemp("q5"), Q5_FORMATS, 6)


def _q5_file(raw: np.ndarray, kind: Q, n: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A Q5_K or Q5_1 tensor's codes q (0..31) [N, K], and each block of 32's scale and minimum
    [N, K/32] (w = scale q + minimum), read from llama.cpp's layout apart from gguf_blocks."""
    if kind == Q.Q5_1:
        blk = raw.reshape(n, k // 32, 24)
        d, m = (blk[..., a:a + 2].copy().view(np.float16)[..., 0].astype(np.float32) for a in (0, 2))
        fifth = np.unpackbits(blk[..., 4:8], axis=-1, bitorder="little")
        low = np.concatenate([blk[..., 8:] & 15, blk[..., 8:] >> 4], axis=-1)
        return (low + 16 * fifth).reshape(n, k), d, m
    blk = raw.reshape(n, k // 256, 176)
    q4_k_like = np.concatenate([blk[..., :16], blk[..., 48:]], axis=-1)   # Q4_K's fields and nibbles
    low, scales, mins = _file_codes(q4_k_like.reshape(n, -1), Q.Q4_K, n, k)
    fifth = np.stack([(blk[..., 16:48] >> j) & 1 for j in range(8)], axis=2).reshape(n, -1, 32)
    return (low + 16 * fifth).reshape(n, k), scales, mins


def test_q5_graph_holds_the_files_codes_scales_and_minimums_and_runs_in_onnxruntime(q5_model):
    d, _ = q5_model
    nodes = onnx.load(str(d / "m.onnx"), load_external_data=False).graph.node
    producer = {o: n for n in nodes for o in n.output}
    seen = {Q.Q5_K: 0, Q.Q5_1: 0}
    for node, inits, hf, raw, kind, n, k in _graph_linears(*q5_model):
        q, scales, mins = _q5_file(raw, kind, n, k)
        assert weight_formats.marked(node).name == kind.name
        assert np.array_equal(inits[node.input[1]].reshape(n, k).astype(np.int32) - 128, q), hf
        assert np.array_equal(inits[node.input[2]], scales), hf
        add = next(x for x in nodes if node.output[0] in x.input)
        term = producer[next(i for i in add.input if i != node.output[0])]
        assert gguf_blocks.minimums_form(term) == "term" and np.array_equal(inits[term.input[1]].T, mins), hf
        seen[kind] += 1
    assert seen == {Q.Q5_K: 12, Q.Q5_1: 2}
    # and onnxruntime runs it as the float graph on the dequantized weights (float rounding of
    # the different sums: 1.5e-5 of the largest logit here)
    assert_graph_follows_the_float_reference(d, tol=3e-5)


@pytest.fixture(scope="module")
def q5_builds(q5_model):
    return compile_host_builds(q5_model[0])


@pytest.mark.slow
@KEEPS_FILE_CODES
def test_q5_artifact_holds_the_files_codes_scales_and_minimums(q5_model, q5_builds):
    """With Q8_0 activations (x86 VNNI: five-bit codes, compiler/repack_five_bit.py) the artifact
    holds the file's codes, scales and minimums in the row groups' layout (Q5_K's as the file's
    6-bit and fp16 factors), made here from the file's bytes; the manifest names the formats,
    and the minimums' terms are gone into the kernels."""
    from qwc.compiler.kernels import row_groups

    d, held = q5_model
    manifest = json.loads((q5_builds[8] / "manifest.json").read_text())
    assert {f["format"]: f["count"] for f in manifest["quantization"]["linears"]} == {"q5_k": 12, "q5_1": 2, "q8_0": 1}
    assert manifest["quantization"]["weight_layout"]["five_bit_codes"] == 14
    params = {name.replace("_", "."): a for name, a in _params(q5_builds[8]).items()}
    assert not any("block.minimums.T" in name for name in params)
    for hf, (raw, kind) in held.items():
        if kind not in (Q.Q5_K, Q.Q5_1):
            continue
        n, k = raw.shape[0], raw.shape[1] // (176 if kind == Q.Q5_K else 24) * (256 if kind == Q.Q5_K else 32)
        q, scales, mins = _q5_file(raw, kind, n, k)
        w, s = row_groups.pack_five_bit(q.astype(np.uint8).reshape(n, -1, 32), scales)
        stem = hf.removesuffix(".weight").replace("_", ".") + ".qweight.qwc.five.bit"
        got_s, got_c = params[stem.replace("qweight", "scales")], params[stem + ".offsets"]
        assert np.array_equal(params[stem], w), hf
        if kind == Q.Q5_K:   # the file's factors (kernels/q4_k_scales.py): sc, mn a block; d, dmin a super-block
            got_scales, got_mins = compact_k_factors(got_s, got_c, n)
            assert np.array_equal(got_scales, scales) and np.array_equal(got_mins, mins), hf
        else:   # float32 d and c = m + 8 d (the codes read from 8, as Q4_0's)
            assert np.array_equal(got_s, s.astype(got_s.dtype)), hf
            want = (mins.astype(np.float64) + 8 * scales.astype(np.float64)).astype(np.float32)
            assert np.array_equal(got_c, row_groups.pack_offsets(want)), hf
        # five bits a code: chunk c's low four bits in nibble chunk c % 4, its fifth at bit c of chunk 4
        u = np.stack([(w[:, :, c % 4] >> (4 * (c // 4)) & 15) | (((w[:, :, 4] >> c) & 1) << 4) for c in range(8)], 2)
        assert np.array_equal(u, row_groups.pack_int8(q.astype(np.uint8).reshape(n, -1, 32), scales, signed=False)[0]), hf


@pytest.mark.slow
def test_q5_artifact_runs_as_the_float_reference(q5_model, q5_builds):
    """W8A8 with the minimums as block offsets, and two Q4_0 halves at float activations."""
    d, _ = q5_model
    cfg = ModelConfig.load(sidecar_paths(d / "m.onnx")[0])
    ref = np.stack([r[0, -1] for r in ort_kv_logits(d / "float.onnx", cfg, STEPS[0], STEPS[1:])])
    a32, a8 = _compiled_logits(q5_builds[32]), _compiled_logits(q5_builds[8])
    span = np.abs(ref).max()
    assert np.abs(a32 - ref).max() / span < 1e-4          # float activations: float rounding
    # Q8_0 activations, as llama.cpp's: 3.4% here (the kernels themselves are exact against
    # the quantized activations: tests/compiler/test_q5_minimums.py)
    assert np.abs(a8 - ref).max() / span < 5e-2
    assert np.array_equal(a8.argmax(-1), ref.argmax(-1))


# llama-server's greedy tokens after STEPS[0] on write_model(..., Q5_FORMATS, seed=6)'s file,
# recorded as LLAMA_CPP_GREEDY is (the same build and request, the file rewritten with one merge)
LLAMA_CPP_GREEDY_Q5 = [49, 99, 152, 254, 199, 13, 57, 71]


@pytest.mark.slow
def test_q5_greedy_tokens_equal_llama_cpps_on_the_same_file(q5_builds):
    assert _greedy_picks(q5_builds[8], LLAMA_CPP_GREEDY_Q5) == LLAMA_CPP_GREEDY_Q5


@pytest.mark.parametrize("kind, damage, message", [
    (Q.Q5_K, lambda raw: raw[:, :-1], "702 bytes are not 2 rows of 2 Q5_K blocks"),
    (Q.Q5_K, lambda raw: _with_half(raw, 176, np.inf), "1 Q5_K scales are NaN or infinite"),   # super-block 1's d
    (Q.Q5_1, lambda raw: _with_half(raw, 24 + 2, np.nan), "1 Q5_1 scales are NaN or infinite"),   # block 1's m
])
def test_bad_q5_tensors_are_refused_naming_the_tensor(kind, damage, message):
    w = (0.1 * np.random.default_rng(0).standard_normal((2, 512))).astype(np.float32)
    raw = quantize_q5_k(w) if kind == Q.Q5_K else quantize(w, kind)
    with pytest.raises(QwcError, match=f"blk.0.attn_q.weight: {message}"):
        gguf_blocks.from_gguf(damage(raw), kind.name, (2, 512), "blk.0.attn_q.weight")


def _with_half(raw: np.ndarray, at: int, value) -> np.ndarray:
    """Row 1's bytes at, at + 1 made the fp16 `value`."""
    raw = raw.copy()
    raw[1, at:at + 2] = np.array([value], np.float16).view(np.uint8)
    return raw


@pytest.mark.arm
@pytest.mark.slow
def test_q5_on_arm_yitian_matches_the_host(q5_model, q5_builds, tmp_path):
    """Q5_K (the file's factors, on Q8_K activations) and Q5_1 (block offsets) as five-bit codes
    on the sdot / smmla kernels; the greedy tokens are llama-server's."""
    manifest = _arm_yitian_follows_the_host(q5_model[0], q5_builds, tmp_path, LLAMA_CPP_GREEDY_Q5, host_tolerance=5e-2)
    assert {f["format"]: f["count"] for f in manifest["quantization"]["linears"]} == {"q5_k": 12, "q5_1": 2, "q8_0": 1}
    assert manifest["quantization"]["weight_layout"]["five_bit_codes"] == 14
