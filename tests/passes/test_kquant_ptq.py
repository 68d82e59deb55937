"""qwc's own PTQ into llama.cpp's K-quant mix (`qwc optimize --format q4_k_m`): the searched
Q4_K / Q5_0 / Q6_K quantizers (qwc/kquants.py) against the gguf package's decoder, the per-tensor mix
(passes/kquant_mix.py), the importance matrix (passes/imatrix.py) from a llama-imatrix file or
calibration text, and the graph end to end: onnxruntime, then the compiled artifact."""

from __future__ import annotations

import struct

import numpy as np
import onnx
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from gguf.quants import dequantize as gguf_dequantize
from onnx import TensorProto, helper, numpy_helper

import qwc.kquants as kq
from qwc import weight_formats
from qwc.cli import main
from qwc.config import ModelConfig
from qwc.errors import QwcError
from qwc.models import gguf_blocks
from qwc.passes import imatrix, quantize_kquants
from qwc.passes.graph import MS_DOMAIN
from qwc.passes.kquant_mix import linear_format, more_bits
from qwc.passes.options import PassOptions
from qwc.passes.verify import session

from conftest import ort_kv_logits

QUANTIZERS = {"Q4_K": (kq.quantize_q4_k, Q.Q4_K), "Q5_K": (kq.quantize_q5_k, Q.Q5_K), "Q5_0": (kq.quantize_q5_0, Q.Q5_0),
              "Q5_1": (kq.quantize_q5_1, Q.Q5_1), "Q6_K": (kq.quantize_q6_k, Q.Q6_K)}


def _weights(rng, n=48, k=512):
    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    w[0] = 0                                   # an all-zero row
    w[1] = 0.25                                # a constant row (Q4_K: all minimum, scale 0)
    w[2] = np.abs(w[2])                        # all positive (Q4_K's minimum held at 0)
    w[3, 7] = 1.5                              # an outlier the search may clip
    w[4, :32] = -np.abs(w[4, :32])             # an all-negative block
    return w


def _error(a, w, imp=None):
    return float((((a - w) ** 2) * (1 if imp is None else imp)).sum())


@pytest.mark.parametrize("fmt", sorted(QUANTIZERS))
def test_blocks_decode_alike_in_gguf_and_in_the_graph(fmt):
    """The bytes are the format's: the gguf package's decoder (llama.cpp's reference) and the
    canonical graph's blocks (gguf_blocks.from_gguf, what the kernels compute with) give the
    same float weights, bit for bit, and close to w."""
    fn, qt = QUANTIZERS[fmt]
    w = _weights(np.random.default_rng(0))
    raw = fn(w)
    ref = gguf_dequantize(raw, qt).reshape(w.shape)
    ours = gguf_blocks.dequantize(gguf_blocks.from_gguf(raw, fmt, w.shape, "t"))
    assert np.array_equal(ref.view(np.uint32), ours.astype(np.float32).view(np.uint32))
    assert not ref[0].any()                    # zeros stay zeros
    if fmt == "Q5_0":                          # 0.25 = -16 x -1/64: exact
        assert (ref[1] == 0.25).all()
    assert np.abs(ref - w).max() < 0.06 * np.abs(w).max()


@pytest.mark.parametrize("fmt", sorted(QUANTIZERS))
def test_the_search_beats_one_step_and_importance_lowers_the_weighted_error(fmt, monkeypatch):
    fn, qt = QUANTIZERS[fmt]
    rng = np.random.default_rng(1)
    w = _weights(rng)
    imp = rng.gamma(0.5, 1.0, w.shape[1])
    searched = gguf_dequantize(fn(w), qt).reshape(w.shape)
    weighted = gguf_dequantize(fn(w, imp), qt).reshape(w.shape)
    monkeypatch.setattr(kq, "STEP_FACTORS", np.array([1.0]))
    one_step = gguf_dequantize(fn(w), qt).reshape(w.shape)
    assert _error(searched, w) < 0.95 * _error(one_step, w)
    assert _error(weighted, w, imp) < 0.95 * _error(searched, w, imp)


@pytest.mark.parametrize("fmt", ["Q4_K", "Q5_0"])
def test_gptq_in_the_format_with_no_correlation_is_the_weighted_search(fmt):
    """A diagonal Hessian moves no error between channels: GPTQ's groups are the plain search's
    with the (damped) diagonal as the importance, byte for byte."""
    from qwc.passes import gptq

    rng = np.random.default_rng(3)
    w = _weights(rng, 16, 512)
    imp = rng.gamma(0.5, 1.0, 512)
    raw = gptq.quantize_k(w, np.diag(imp), fmt)
    want = QUANTIZERS[fmt][0](w, imp + gptq.DAMP * imp.mean())
    assert np.array_equal(raw, want)


@pytest.mark.parametrize("fmt", ["Q4_K", "Q5_0"])
def test_gptq_in_the_format_lowers_the_output_error_of_correlated_activations(fmt):
    from qwc.passes import gptq

    rng = np.random.default_rng(4)
    w = _weights(rng, 32, 512)
    x = rng.standard_normal((4096, 512)) @ rng.standard_normal((512, 512)) / 20   # channels correlated
    h = x.T @ x / len(x)
    fn, qt = QUANTIZERS[fmt]
    g = gguf_dequantize(gptq.quantize_k(w, h, fmt), qt).reshape(w.shape)
    plain = gguf_dequantize(fn(w, np.diag(h)), qt).reshape(w.shape)

    def err(a):
        return float(np.mean((x @ (a - w).T) ** 2))

    assert err(g) < 0.8 * err(plain)


def test_quantizers_refuse_rows_they_cannot_hold_and_bad_importance():
    w = np.zeros((2, 288), np.float32)
    with pytest.raises(ValueError, match="super-blocks of 256"):
        kq.quantize_q4_k(w)
    with pytest.raises(ValueError, match="288 finite non-negative"):
        kq.quantize_q5_0(w, np.full(288, -1.0))


def test_more_bits_layers_and_the_head_are_llama_cpps():
    assert [i for i in range(30) if more_bits(i, 30)] == [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29]
    assert linear_format("lm_head", 1536, 28) == "Q6_K" and linear_format("lm_head", 576, 30) == "Q8_0"
    assert linear_format("model.layers.3.self_attn.q_proj", 1536, 28) == "Q4_K"


# llama-quantize 0.3.36's types for SmolLM2-135M's 210 linears (30 layers, rows of 576 and 1536),
# each file made from the shipped Q4_1 with --allow-requantize (Q4_K_M: attn_v falls back to
# Q8_0, ffn_down keeps Q6_K)
LLAMA_CPP_MIXES = {"q4_k_m": {"Q5_0": 166, "Q4_K": 16, "Q6_K": 14, "Q8_0": 14},
                   "q4_k_s": {"Q5_0": 176, "Q5_1": 4, "Q5_K": 3, "Q4_K": 27},
                   "q5_k_m": {"Q5_1": 166, "Q8_0": 14, "Q6_K": 14, "Q5_K": 16},
                   "q6_k": {"Q8_0": 180, "Q6_K": 30}}


@pytest.mark.parametrize("mix", sorted(LLAMA_CPP_MIXES))
def test_the_mixes_are_llama_cpps(mix):
    """Q4_K_M: Q6_K for attn_v and ffn_down of the `more_bits` layers; Q4_K_S: attn_v of layers 0-3 and ffn_down of the first eighth Q5_K (Q5_1 where rows are
    576); Q5_K_M: Q4_K_M's places with Q5_K (fallback Q5_1); Q6_K: everything (fallback Q8_0)."""
    ks = {"q_proj": 576, "k_proj": 576, "v_proj": 576, "o_proj": 576, "gate_proj": 576, "up_proj": 576,
          "down_proj": 1536}
    counts = {}
    for layer in range(30):
        for name, k in ks.items():
            part = "self_attn" if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            f = linear_format(f"model.layers.{layer}.{part}.{name}", k, 30, mix)
            counts[f] = counts.get(f, 0) + 1
    assert counts == LLAMA_CPP_MIXES[mix]
    assert linear_format("lm_head", 1536, 28, mix) == "Q6_K" and linear_format("lm_head", 576, 30, mix) == "Q8_0"


def _imatrix_gguf(path, entries):
    wr = GGUFWriter(str(path), "imatrix")
    wr.add_string("general.type", "imatrix")
    for name, (sums, count) in entries.items():
        wr.add_tensor(f"{name}.in_sum2", np.asarray(sums, np.float32))
        wr.add_tensor(f"{name}.counts", np.array([count], np.float32))
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()


def _imatrix_legacy(path, entries):
    out = struct.pack("<i", len(entries))
    for name, values in entries.items():
        out += struct.pack("<i", len(name)) + name.encode() + struct.pack("<ii", 1, len(values))
        out += np.asarray(values, "<f4").tobytes()
    path.write_bytes(out + struct.pack("<i", 8) + struct.pack("<i", 4) + b"emma")


def test_llama_imatrix_files_read_in_both_formats(tmp_path):
    v = np.arange(1, 9, dtype=np.float32)
    _imatrix_gguf(tmp_path / "m.gguf", {"blk.0.attn_q.weight": (4 * v, 4), "blk.1.ffn_down.weight": (v, 1)})
    _imatrix_legacy(tmp_path / "m.dat", {"blk.0.attn_q.weight": v, "output.weight": v, "rope_freqs": v})
    g = imatrix.read_llamacpp(tmp_path / "m.gguf")
    d = imatrix.read_llamacpp(tmp_path / "m.dat")
    assert sorted(g) == ["model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"]
    assert sorted(d) == ["lm_head", "model.layers.0.self_attn.q_proj"]
    assert np.array_equal(g["model.layers.0.self_attn.q_proj"], v) and np.array_equal(d["lm_head"], v)


@pytest.mark.parametrize("content, expect", [
    (b"GGUF\x03\x00\x00\x00garbage", "not an importance matrix llama-imatrix wrote"),
    (struct.pack("<i", 1) + struct.pack("<i", 5) + b"abc", "not an importance matrix llama-imatrix wrote"),
    (struct.pack("<i", 1) + struct.pack("<i", 6) + b"blk.0x" + struct.pack("<ii", 1, 2)
     + np.ones(2, "<f4").tobytes(), "no entry names a Qwen2 / Llama linear"),
])
def test_corrupt_imatrix_files_are_refused_in_one_line(tmp_path, content, expect):
    p = tmp_path / "bad.dat"
    p.write_bytes(content)
    with pytest.raises(QwcError, match=expect) as e:
        imatrix.read_llamacpp(p)
    assert "\n" not in str(e.value)


def _one_linear_graph(w_kn: np.ndarray, name: str):
    k, n = w_kn.shape
    mm = helper.make_node("MatMul", ["x", "w"], ["y"], name=f"/{name.replace('.', '/')}/MatMul")
    g = helper.make_graph([mm], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, n])],
                          [numpy_helper.from_array(w_kn, "w")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def test_a_q4_k_linear_runs_in_onnxruntime_as_the_file_decodes(tiny_lm):
    """A linear of rows of 512 becomes Q4_K: 4-bit codes, float scales and zero points marked
    with Q4_K's minimum form; onnxruntime's MatMulNBits computes x W with W as gguf decodes it."""
    rng = np.random.default_rng(2)
    w = _weights(rng, 64, 512)
    imp = rng.gamma(0.5, 1.0, 512)
    name = "model.layers.3.self_attn.q_proj"
    model = _one_linear_graph(np.ascontiguousarray(w.T), name)
    opts = PassOptions(config=tiny_lm.config, format="q4_k_m", importance={name: imp})
    model = quantize_kquants.run(model, opts)
    (node,) = model.graph.node
    assert node.op_type == "MatMulNBits" and node.domain == MS_DOMAIN and len(node.input) == 4
    assert weight_formats.marked(node).name == "Q4_K"
    want = gguf_dequantize(kq.quantize_q4_k(w, imp), Q.Q4_K).reshape(w.shape)
    x = rng.standard_normal((5, 512)).astype(np.float32)
    y = session(model).run(None, {"x": x})[0]
    assert np.abs(y - x @ want.T).max() < 1e-4 * np.abs(x @ want.T).max()


def _nearer_float_than_q4_0(out, tiny_onnx, tiny_q4) -> ModelConfig:
    """The graph `out`'s prefill logits are nearer the float export's than the default Q4_0
    graph's (half the mean squared difference or less); returns its config."""
    cfg = ModelConfig.load(str(out).replace(".onnx", ".config.json"))
    prompt = np.array([[1, 5, 9, 2, 7, 3]])
    ref = ort_kv_logits(tiny_onnx, cfg, prompt, [])[0]
    got = ort_kv_logits(out, cfg, prompt, [])[0]
    q4_0 = ort_kv_logits(tiny_q4, cfg, prompt, [])[0]
    assert np.square(got - ref).mean() < 0.5 * np.square(q4_0 - ref).mean()
    return cfg


def test_cli_format_q4_k_m_with_calibrated_importance_end_to_end(tiny_onnx, tiny_q4, tmp_path, capsys, calib_text):
    """`qwc optimize --format q4_k_m --imatrix calib`: the tiny model's rows (128, 320) are all
    Q5_0 and Q8_0 (v and down of its last layer, and the tied lm_head); the graph's logits
    are nearer the float export's than the default Q4_0 graph's, and the compiled artifact
    computes what onnxruntime does."""
    from qwc.compiler.compile import compile_file

    from conftest import greedy_against_onnxruntime

    out = tmp_path / "k.onnx"
    code = main(["optimize", str(tiny_onnx), "-o", str(out), "--format", "q4_k_m", "--imatrix", "calib",
                 "--calib", str(calib_text), "--calib-tokens", "512"])
    assert code == 0, capsys.readouterr().err
    m = onnx.load(str(out), load_external_data=False)
    bits = sorted(next(a.i for a in n.attribute if a.name == "bits") for n in m.graph.node if n.op_type == "MatMulNBits")
    assert bits == [8] * 15   # Q5_0 and Q8_0 are both 8-bit codes in the graph
    cfg = _nearer_float_than_q4_0(out, tiny_onnx, tiny_q4)
    art = tmp_path / "k.qwc"
    compile_file(out, "host", art, act_bits=32, kv_type="f32")
    greedy_against_onnxruntime(art, out, cfg, np.array([[1, 5, 9, 2, 7, 3]]), 3, 64)


@pytest.mark.parametrize("args, expect", [
    (["--format", "q4_k_m", "--gptq", "--imatrix", "calib"], "drop --imatrix"),
    (["--format", "q4_k_m", "--bits", "8"], "does not combine with --bits 8"),
    (["--imatrix", "calib"], "needs a K mix (--format q4_k_m"),
    (["--format", "q4_k_m", "--imatrix", "/nonexistent/x.gguf"], "no such file"),
    (["--format", "q4_k_m", "--imatrix", "/"], "/: a directory, not an importance matrix file"),
])
def test_bad_format_options_get_one_line(tiny_onnx, tmp_path, capsys, args, expect):
    out = tmp_path / "bad.onnx"
    code = main(["-q", "optimize", str(tiny_onnx), "-o", str(out), *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and expect in err[0], err
    assert not list(tmp_path.iterdir())


def test_an_imatrix_of_another_model_or_before_awq_is_refused(tiny_onnx, tmp_path, capsys):
    imat = tmp_path / "other.imatrix.gguf"
    _imatrix_gguf(imat, {"blk.0.ffn_gate.weight": (np.ones(576), 1)})
    for extra, expect in (([], "model.layers.0.mlp.gate_proj has 576 importances for 128 inputs"),
                          (["--awq"], "with --awq use --imatrix calib")):
        code = main(["-q", "optimize", str(tiny_onnx), "-o", str(tmp_path / "bad.onnx"), "--format", "q4_k_m",
                     "--imatrix", str(imat), *extra])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and expect in err[0], err
        assert not list(tmp_path.glob("bad*"))


def test_cli_format_q4_k_m_with_gptq(tiny_onnx, tiny_q4, tmp_path, capsys, calib_text):
    """`--format q4_k_m --gptq`: GPTQ in the mix's formats, logits nearer the float export's
    than the default Q4_0 graph's."""
    from qwc import progress

    out = tmp_path / "g.onnx"
    progress.set_quiet(False)
    try:
        code = main(["optimize", str(tiny_onnx), "-o", str(out), "--format", "q4_k_m", "--gptq",
                     "--calib", str(calib_text), "--calib-tokens", "512"])
    finally:
        progress.set_quiet(True)
    cap = capsys.readouterr()
    assert code == 0, cap.err
    assert "--format q4_k_m: 12 Q5_0, 2 Q8_0;" in cap.err and "(GPTQ)" in cap.err
    _nearer_float_than_q4_0(out, tiny_onnx, tiny_q4)


def _nearer_float_than_q4_0_and_compiled(tmp_path) -> None:
    """k.onnx's logits nearer f.onnx's than the default Q4_0 graph's (this random model
    amplifies every weight error, so the distance itself says little), and k.onnx compiled
    with Q8_0 activations (the K formats' own kernels: float activations would take Q6_K as
    Q8_0) following it greedily."""
    from qwc.compiler.compile import compile_file
    from qwc.config import sidecar_paths

    from conftest import greedy_against_onnxruntime

    assert main(["-q", "optimize", str(tmp_path / "f.onnx"), "-o", str(tmp_path / "q4.onnx")]) == 0
    cfg = ModelConfig.load(sidecar_paths(tmp_path / "k.onnx")[0])
    prompt = np.array([[1, 5, 9, 2, 7, 3]])
    ref, got, q4 = (ort_kv_logits(tmp_path / f, cfg, prompt, [])[0] for f in ("f.onnx", "k.onnx", "q4.onnx"))
    assert np.square(got - ref).mean() < 0.7 * np.square(q4 - ref).mean()
    art = tmp_path / "k.qwc"
    compile_file(tmp_path / "k.onnx", "host", art, act_bits=8, kv_type="f32")
    greedy_against_onnxruntime(art, tmp_path / "k.onnx", cfg, prompt, 3, 64, tol=3e-2)


def _optimized_tiny_gguf(tmp_path, capsys, mix: str, intermediate: int) -> str:
    """A float GGUF of two tied layers (rows of 256 and `intermediate`) exported to f.onnx and
    optimized with `--format mix` to k.onnx; returns what the optimize printed."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent.parent / "models"))
    from test_gguf_formats import _config, write_random_model

    from qwc import progress

    def matrix(rng, name, shape):
        return (0.05 * rng.standard_normal(shape)).astype(np.float32), None

    write_random_model(tmp_path / "f.gguf", _config("tiny-mix", hidden=256, intermediate=intermediate), matrix, 7)
    assert main(["-q", "export", str(tmp_path / "f.gguf"), "-o", str(tmp_path / "f.onnx")]) == 0
    progress.set_quiet(False)
    try:
        code = main(["optimize", str(tmp_path / "f.onnx"), "-o", str(tmp_path / "k.onnx"), "--format", mix])
    finally:
        progress.set_quiet(True)
    err = capsys.readouterr().err
    assert code == 0, err
    return err


@pytest.mark.slow
@pytest.mark.parametrize("mix, says", [("q5_k_m", "1 Q5_1, 11 Q5_K, 1 Q6_K, 1 Q8_0"),
                                       ("q4_k_s", "10 Q4_K, 2 Q5_0, 2 Q5_K"), ("q6_k", "12 Q6_K, 2 Q8_0")])
def test_the_other_mixes_end_to_end(tmp_path, capsys, mix, says):
    """Two layers with rows of 256 and ffn_down's of 480 (not whole super-blocks: Q5_K falls back
    to Q5_1, Q4_K to Q5_0, Q6_K to Q8_0): the graph holds the formats llama.cpp's mix names,
    runs in onnxruntime nearer the float graph than Q4_0 does, and the compiled artifact (Q8_0
    activations: Q5_K / Q5_1 on the W8A8 kernels with their minimums as block offsets) follows
    it."""


    err = _optimized_tiny_gguf(tmp_path, capsys, mix, intermediate=480)
    assert f"--format {mix}: {says};" in err, err
    _nearer_float_than_q4_0_and_compiled(tmp_path)


@pytest.mark.slow
def test_format_q4_k_m_writes_q6_k_where_the_mix_has_it(tmp_path, capsys):
    """Rows of 256 and 512 (a float GGUF of two layers, tied): the mix's Q6_K places (attn_v and
    ffn_down of the last layer, `more_bits`'s pick of two; and the tied output) are Q6_K blocks of 16, the embedding's gather and the head reading the same bytes; the
    graph runs in onnxruntime near the float one, and the compiled artifact follows it."""


    err = _optimized_tiny_gguf(tmp_path, capsys, "q4_k_m", intermediate=512)
    assert "--format q4_k_m: 12 Q4_K, 2 Q6_K;" in err, err
    m = onnx.load(str(tmp_path / "k.onnx"), load_external_data=False)
    blocks = {n.name: next(a.i for a in n.attribute if a.name == "block_size") for n in m.graph.node
              if n.op_type in ("MatMulNBits", "GatherBlockQuantized")}
    assert sorted(blocks.values()).count(16) == 4, blocks   # 2 linears, the head and its gather
    gbq = next(n for n in m.graph.node if n.op_type == "GatherBlockQuantized")
    head = next(n for n in m.graph.node if n.op_type == "MatMulNBits" and n.input[1] == gbq.input[0])
    assert blocks[head.name] == 16
    inits = {t.name: t for t in m.graph.initializer}
    codes, scales = (numpy_helper.to_array(inits[x], base_dir=str(tmp_path)) for x in head.input[1:3])
    head_w = gguf_blocks.dequantize(gguf_blocks.Blocks("Q6_K", codes, scales))
    from gguf import GGUFReader

    emb = next(t for t in GGUFReader(tmp_path / "f.gguf").tensors if t.name == "token_embd.weight")
    emb = np.asarray(emb.data, np.float32).reshape(head_w.shape)
    assert np.sqrt(np.mean((head_w - emb) ** 2)) < 0.03 * emb.std()   # 6 bits: ~1.8% of the weights' spread
    _nearer_float_than_q4_0_and_compiled(tmp_path)
