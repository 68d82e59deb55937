"""A GGUF's Q4_0 / Q4_1 / Q8_0 weights kept as the file gives them (models/gguf_blocks.py; Q5_0
and Q4_K: test_gguf_kquants.py):
bit for bit in the exported graph and in the artifact, logits equal to a float reference on
the file's dequantized weights, on the host and on arm-yitian under qemu; other types written
in `--requant`'s format."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import onnx
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import TokenType
from gguf.quants import dequantize, quantize

from qwc.cli import main
from qwc.config import ModelConfig, sidecar_paths
from qwc.errors import QwcError
from qwc.models import gguf_blocks
from qwc.models.gguf_writer import write_gguf
from qwc.models.tokenizer import SPECIAL_TOKENS, byte_level_tokenizer
from qwc.q4 import unpack_nibbles

from conftest import one_line, ort_kv_logits

# Each linear in one of the three formats, so every kernel path and mix is in one model.
FORMATS = {"q_proj": Q.Q4_1, "k_proj": Q.Q8_0, "v_proj": Q.Q4_0, "o_proj": Q.Q4_1,
           "gate_proj": Q.Q4_0, "up_proj": Q.Q4_1, "down_proj": Q.Q8_0}
STEPS = [np.array([[72, 101, 108, 108, 111, 44, 32, 119]]), np.array([[5]]), np.array([[6]]), np.array([[7]])]


def _config(name: str = "tiny-formats", hidden: int = 64, intermediate: int = 96) -> ModelConfig:
    """Two layers of 4 heads (2 KV heads) over the byte-level vocabulary, tied."""
    tok = byte_level_tokenizer()
    return ModelConfig(
        name=name, vocab_size=tok.get_vocab_size(), hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, rope_theta=10000.0,
        rms_norm_eps=1e-5, max_position_embeddings=256, tie_word_embeddings=True, bos_token_id=256,
        eos_token_ids=[258], chat_template="{{ messages }}")


def write_model(path: Path, formats: dict, embedding=Q.Q8_0, seed: int = 0) -> dict[str, tuple[np.ndarray, Q]]:
    """A random tied qwen2 GGUF with each linear in `formats`' type; returns what it holds
    (HF name -> (raw bytes, type))."""
    def matrix(rng, name, shape):
        kind = embedding if "embed" in name else FORMATS[name.split(".")[-2]] if formats is FORMATS else formats[name]
        w = (0.1 * rng.standard_normal(shape)).astype(np.float32)
        w[0, :32] = 0.02      # one block of equal weights (a Q4_1 block of scale 0)
        return quantize(w, kind), kind

    return write_random_model(path, _config(), matrix, seed)


def write_random_model(path: Path, cfg: ModelConfig, matrix, seed: int) -> dict[str, tuple[np.ndarray, Q]]:
    """A random GGUF of `cfg`: norms' gains around 1, small biases, and each matrix as
    `matrix(rng, HF name, shape)` gives it (bytes, type); returns what it holds."""
    from qwc.models.checkpoint import expected_tensors

    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in _draw_order(expected_tensors(cfg)):
        if len(shape) > 1:
            tensors[name] = matrix(rng, name, shape)
            continue
        v = rng.uniform(0.5, 1.5, shape) if name.endswith("norm.weight") else 0.1 * rng.standard_normal(shape)
        tensors[name] = (v.astype(np.float32), None)
    write_byte_level_gguf(path, cfg, tensors)
    return tensors


def _draw_order(shapes: dict[str, tuple[int, ...]]) -> list[tuple[str, tuple[int, ...]]]:
    """The tensors in the order their random values are drawn: each bias right after its weight.
    The tokens recorded from llama.cpp on these files (test_gguf_kquants' LLAMA_CPP_GREEDY*) and
    the tolerances measured on them hold for these draws only, so the order is fixed here rather
    than taken from expected_tensors, whose listing moved the biases to a layer's end (Qwen3)."""
    order = []
    for name, shape in shapes.items():
        if name.endswith(".bias"):
            continue
        order.append((name, shape))
        bias = name.removesuffix("weight") + "bias"
        if bias in shapes:
            order.append((bias, shapes[bias]))
    return order


def write_byte_level_gguf(path: Path, cfg: ModelConfig, tensors: dict) -> None:
    """A qwen2 GGUF of `tensors` (HF name -> (array or raw blocks, type)) with the byte-level
    tokenizer qwc's presets use."""
    tok = byte_level_tokenizer()
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    types = [TokenType.CONTROL if t in SPECIAL_TOKENS else TokenType.NORMAL for t, _ in vocab]
    write_gguf(path, "qwen2", cfg, [t for t, _ in vocab], types, tensors)


@pytest.fixture(scope="module")
def gguf_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("formats")
    held = write_model(d / "m.gguf", FORMATS)
    assert main(["-q", "export", str(d / "m.gguf"), "-o", str(d / "m.onnx")]) == 0
    # the reference: the same file dequantized to float32 (torch's exporter)
    assert main(["-q", "export", str(d / "m.gguf"), "--exporter", "torch", "-o", str(d / "float.onnx")]) == 0
    return d, held


def _to_gguf_bytes(codes: np.ndarray, scales: np.ndarray, zp: np.ndarray | None, bits: int) -> np.ndarray:
    """The canonical graph's blocks written back in llama.cpp's block layout."""
    d = scales.astype(np.float16)[..., None].view(np.uint8)
    if bits == 8:
        q = (codes.astype(np.int16) - 128).astype(np.int8).view(np.uint8)
        return np.concatenate([d, q], axis=-1).reshape(codes.shape[0], -1)
    q = np.stack([codes & 15, codes >> 4], axis=-1).reshape(*codes.shape[:-1], 32)
    qs = (q[..., :16] | (q[..., 16:] << 4)).astype(np.uint8)
    parts = [d] if zp is None else [d, gguf_blocks.q4_1_mins(scales, zp).astype(np.float16)[..., None].view(np.uint8)]
    return np.concatenate(parts + [qs], axis=-1).reshape(codes.shape[0], -1)


def test_blocks_are_the_files_bit_for_bit(gguf_model):
    d, held = gguf_model
    model = onnx.load(str(d / "m.onnx"))
    inits = {t.name: onnx.numpy_helper.to_array(t, base_dir=str(d)) for t in model.graph.initializer}
    seen = set()
    for n in model.graph.node:
        if n.op_type != "MatMulNBits":
            continue
        hf = n.name.removeprefix("/").removesuffix("/MatMulNBits").replace("/", ".") + ".weight"
        hf = "model.embed_tokens.weight" if hf == "lm_head.weight" else hf   # tied: the embedding's bytes
        raw, kind = held[hf]
        bits = next(a.i for a in n.attribute if a.name == "bits")
        zp = inits[n.input[3]] if len(n.input) > 3 and n.input[3] else None
        assert (kind == Q.Q4_1) == (zp is not None) and (bits == 8) == (kind == Q.Q8_0), hf
        back = _to_gguf_bytes(inits[n.input[1]], inits[n.input[2]], zp, bits)
        flat = raw.reshape(back.shape).copy()
        if kind == Q.Q4_1:   # the block of scale 0 (row 0's first) is written as d = 1: m and codes kept
            assert flat[0, :2].view(np.float16)[0] == 0 and back[0, :2].view(np.float16)[0] == 1
            flat[0, :2] = back[0, :2]
        assert np.array_equal(back, flat), hf
        seen.add(hf)
    assert len(seen) == 1 + 7 * 2   # the tied head and every linear of both layers
    gbq = [n for n in model.graph.node if n.op_type == "GatherBlockQuantized"]
    assert len(gbq) == 1 and next(a.i for a in gbq[0].attribute if a.name == "bits") == 8


def test_blocks_dequantize_as_llama_cpp_does():
    rng = np.random.default_rng(1)
    w = (0.1 * rng.standard_normal((8, 128))).astype(np.float32)
    w[3, 32:64] = -0.5   # a constant block
    for kind in (Q.Q4_0, Q.Q4_1, Q.Q8_0):
        raw = quantize(w, kind)
        b = gguf_blocks.from_gguf(raw, kind.name, w.shape, "w")
        assert np.array_equal(gguf_blocks.dequantize(b), dequantize(raw, kind).reshape(w.shape)), kind.name


def test_q4_1_block_of_scale_zero_with_codes_is_refused():
    raw = quantize(np.ones((1, 32), np.float32), Q.Q4_1).copy()
    raw[0, 4] = 0x11   # codes under a zero scale: no llama.cpp quantizer writes this
    with pytest.raises(QwcError, match="scale 0 and non-zero codes"):
        gguf_blocks.from_gguf(raw, "Q4_1", (1, 32), "w")


def test_exported_graph_runs_in_onnxruntime_as_the_float_reference(gguf_model):
    assert_graph_follows_the_float_reference(gguf_model[0])


def assert_graph_follows_the_float_reference(d: Path, tol: float = 1e-5) -> None:
    """d/m.onnx (the file's blocks) in onnxruntime against d/float.onnx (its dequantized weights):
    float rounding apart, which grows with the weights' range (`tol`, relative to the largest logit)."""
    cfg = ModelConfig.load(sidecar_paths(d / "m.onnx")[0])
    ours = ort_kv_logits(d / "m.onnx", cfg, STEPS[0], STEPS[1:])
    ref = ort_kv_logits(d / "float.onnx", cfg, STEPS[0], STEPS[1:])
    for a, r in zip(ours, ref):
        assert np.abs(a - r).max() / np.abs(r).max() < tol


def _compiled_logits(art) -> np.ndarray:
    from qwc.runtime.engine import Engine

    eng = Engine(art, ctx=64)
    return np.stack([eng.prefill(STEPS[0][0])] + [eng.decode(int(t[0, 0])) for t in STEPS[1:]])


def compile_host_builds(d: Path) -> dict[int, Path]:
    """d/m.onnx compiled for the host with float and with Q8_0 activations (an f32 cache)."""
    out = {}
    for act in (32, 8):
        out[act] = d / f"host-a{act}.qwc"
        assert main(["-q", "compile", str(d / "m.onnx"), "--act-bits", str(act), "--kv-dtype", "f32",
                     "-o", str(out[act])]) == 0
    return out


@pytest.fixture(scope="module")
def host_builds(gguf_model):
    return compile_host_builds(gguf_model[0])


def _params(art: Path) -> dict[str, np.ndarray]:
    """The artifact's parameters as the library reads them (those stored at rest unpacked)."""
    from qwc.params_at_rest import unpack

    man = json.loads((art / "manifest.json").read_text())
    data = (art / "params.bin").read_bytes()
    out, rest = {}, []
    for p in man["params"]:
        raw = np.frombuffer(data[p["offset"]:p["offset"] + p["nbytes"]], np.uint8)
        if p.get("at_rest"):
            out[p["name"]] = np.empty(p["shape"], p["dtype"])
            rest.append((p, raw))
        else:
            out[p["name"]] = raw.view(p["dtype"]).reshape(p["shape"])
    for p, raw in sorted(rest, key=lambda x: x[0]["at_rest"]["form"] == "q4_k_offsets"):
        unpack(p["at_rest"]["form"], raw, out[p["name"]], out.get(p["at_rest"].get("scales")))
    return out


@pytest.mark.slow
def test_artifact_keeps_the_blocks_and_matches_the_float_reference(gguf_model, host_builds):
    d, _ = gguf_model
    cfg = ModelConfig.load(sidecar_paths(d / "m.onnx")[0])
    model = onnx.load(str(d / "m.onnx"))
    params = _params(host_builds[32])   # float activations: the weights in their plain layout
    arrays = {t.name: onnx.numpy_helper.to_array(t, base_dir=str(d)) for t in model.graph.initializer}
    kept = [name for name in arrays if name.endswith((".qweight", ".scales"))]
    assert len(kept) == 15 * 2   # codes and scales of 14 linears and the embedding
    for name in kept:
        a = arrays[name]
        if name in params:
            assert params[name].tobytes() == a.tobytes(), name
        elif name == "model.embed_tokens.scales":   # folded into the gather's [V, nb, 1], fp16 (exact)
            assert np.array_equal(params["embed_tokens.scales3"][..., 0], a)
        elif name.endswith(".qweight"):   # Q8_0 codes as nibble halves (repack.q8_0_nibble_halves): u = 16 h + l
            hi, lo = (unpack_nibbles(params[f"{name}.qwc_{h}"]).astype(np.int32) for h in ("hi", "lo"))
            assert np.array_equal(16 * hi + lo, a), name
        else:   # ... and their scales: 16 d and d
            stem = name.removesuffix(".scales") + ".qweight"
            assert np.array_equal(params[f"{stem}.qwc_lo_scales"], a), name
            assert np.array_equal(params[f"{stem}.qwc_hi_scales"], 16 * a), name
    # Q4_1's zero points went into the Q4_0 kernels' block offsets m + 8 d (compiler/repack.py),
    # which give the file's minimums back exactly
    zps = [name for name in arrays if name.endswith(".zero_points")]
    assert len(zps) == 6 and not any(name in params for name in zps)
    for name in zps:
        scales = arrays[name.replace(".zero_points", ".scales")]
        c = params[name + ".qwc_offsets"]
        assert np.array_equal(c - 8 * scales, gguf_blocks.q4_1_mins(scales, arrays[name])), name
    from qwc import cpu
    from qwc.compiler.kernels import row_groups

    if cpu.has("avx512_vnni"):   # act 8: the Q8_0 codes in the W8A8 kernels' row groups, reordered only
        p8 = _params(host_builds[8])
        eight = [name for name in kept if name.endswith(".qweight") and arrays[name].shape[-1] == 32]
        assert len(eight) == 5   # k and down of two layers, and the tied output
        for name in eight:
            scales = arrays[name.removesuffix(".qweight") + ".scales"]
            w = p8.get(name, p8.get(name + ".qwc_packed"))
            assert np.array_equal(w, row_groups.pack_int8(arrays[name], scales, signed=False)[0]), name
    ref = np.stack([r[0, -1] for r in ort_kv_logits(d / "float.onnx", cfg, STEPS[0], STEPS[1:])])
    a32, a8 = _compiled_logits(host_builds[32]), _compiled_logits(host_builds[8])
    span = np.abs(ref).max()
    assert np.abs(a32 - ref).max() / span < 1e-4          # float activations: float rounding
    assert np.abs(a8 - ref).max() / span < 3e-2           # Q8_0 / Q8_1 activations, as llama.cpp's
    assert np.abs(a8 - a32).max() > 0                     # (they are not the float path)


@pytest.mark.arm
@pytest.mark.slow
@pytest.mark.parametrize("act", [32, 8])
def test_formats_on_arm_yitian_match_the_host(gguf_model, host_builds, tmp_path, act):
    from qwc.bench import emulation
    from qwc.compiler.compile import compile_file

    d, _ = gguf_model
    env = emulation.arm64_env()
    art = tmp_path / f"yitian-a{act}.qwc"
    compile_file(d / "m.onnx", "arm-yitian", art, act_bits=act, kv_type="f32")
    symbols = subprocess.run(["aarch64-linux-gnu-nm", "-D", str(art / "lib.so")], capture_output=True, text=True,
                             check=True).stdout
    # act 8: k and down (Q8_0) on the W8A8 kernels, prefill and decode; act 32: as two 4-bit halves
    assert ("q8_gemm_smmla8" in symbols and "q8_gemv_sdot8" in symbols) == (act == 8)
    out = tmp_path / "arm.npy"
    steps = json.dumps([STEPS[0][0].tolist()] + [int(t[0, 0]) for t in STEPS[1:]])
    r = subprocess.run(emulation.engine_command(env, art, out, steps), env=env, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    arm, host = np.load(out), _compiled_logits(host_builds[act])
    # Float activations: float rounding. Q8_0 activations: the host's prefill attention takes a
    # chunk's diagonal in AVX-512 query groups, ARM's one query and tile at a time (another
    # rounding order, ~1e-6), and an activation on a rounding boundary moves by one step of its
    # block's int8 scale (7e-3 of the logits' span here; a wrong kernel is off by O(1))
    assert np.abs(arm - host).max() / np.abs(host).max() < (1e-4 if act == 32 else 2e-2)
    assert np.array_equal(arm.argmax(-1), host.argmax(-1))


def test_other_types_are_requantized_to_the_named_format(tmp_path, capsys):
    cfg = _config()
    from qwc.models.checkpoint import expected_tensors

    formats = {n: Q.MXFP4 if n.endswith("down_proj.weight") else Q.Q5_0 if n.endswith("up_proj.weight") else Q.Q4_0
               for n in expected_tensors(cfg) if n.endswith("proj.weight")}
    write_model(tmp_path / "m.gguf", formats, embedding=Q.Q4_1)
    for to, bits in (("q8_0", 8), ("q4_0", 4)):
        out = tmp_path / f"{to}.onnx"
        assert main(["export", str(tmp_path / "m.gguf"), "--requant", to, "-o", str(out)]) == 0
        err = capsys.readouterr().err
        assert f"2 MXFP4 -> {to.upper()}" in err and f"1 Q4_1 -> {to.upper()}" in err and f"--requant {to}" in err, err
        assert "2 Q5_0 (exact, as 8-bit codes)" in err, err   # kept whatever --requant says
        model = onnx.load(str(out))
        down = [n for n in model.graph.node if n.op_type == "MatMulNBits" and "down_proj" in n.name]
        assert len(down) == 2 and all(next(a.i for a in n.attribute if a.name == "bits") == bits for n in down)
        assert not any(n.op_type == "MatMul" for n in model.graph.node)


@pytest.mark.parametrize("narrow", ["BF16", "F16"])
def test_a_bf16_or_f16_gguf_exports_narrow_and_optimizes_to_the_f32_files_bytes(tmp_path, narrow):
    """A BF16 or F16 GGUF (what convert_hf_to_gguf.py writes) keeps its matrices so in a
    streamed graph, half the disk, and everything after the export is as from the F32 file of
    the same values: the same onnxruntime logits, the same Q4_0 bytes."""
    from qwc.half_floats import KINDS, to_bits, widen

    def matrices(keep: bool):
        def make(rng, name, shape):
            bits = to_bits((0.1 * rng.standard_normal(shape)).astype(np.float32), narrow)
            return (bits, Q[narrow]) if keep else (widen(bits, narrow), None)
        return make

    cfg = _config(hidden=128, intermediate=256)
    for name in ("b", "f"):
        write_random_model(tmp_path / f"{name}.gguf", cfg, matrices(name == "b"), seed=1)
        assert main(["-q", "export", str(tmp_path / f"{name}.gguf"), "-o", str(tmp_path / f"{name}.onnx"),
                     "--exporter", "stream"]) == 0
        assert main(["-q", "optimize", str(tmp_path / f"{name}.onnx"), "-o", str(tmp_path / f"{name}.q4.onnx")]) == 0
    graph = onnx.load(str(tmp_path / "b.onnx"), load_external_data=False).graph
    assert sum(t.data_type == KINDS[narrow][0] for t in graph.initializer) == 2 * 7 + 1   # tied
    size = {n: (tmp_path / f"{n}.onnx.data").stat().st_size for n in "bf"}
    assert 0.45 < size["b"] / size["f"] < 0.55
    cfg = ModelConfig.load(sidecar_paths(tmp_path / "b.onnx")[0])
    for x, y in zip(ort_kv_logits(tmp_path / "b.onnx", cfg, STEPS[0], STEPS[1:]),
                    ort_kv_logits(tmp_path / "f.onnx", cfg, STEPS[0], STEPS[1:])):
        assert np.array_equal(x, y)
    got, want = ({t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(str(tmp_path / f"{n}.q4.onnx")).graph.initializer}
                 for n in "bf")
    assert set(got) == set(want) and all(np.array_equal(got[k], want[k]) for k in got)


def test_awq_on_kept_weights_is_refused_in_one_line(gguf_model, tmp_path, capsys):
    d, _ = gguf_model
    text = tmp_path / "calib.txt"
    text.write_text("It is a truth universally acknowledged. " * 400)
    code = main(["-q", "optimize", str(d / "m.onnx"), "--awq", "--calib", str(text), "--calib-tokens", "512",
                 "-o", str(tmp_path / "a.onnx")])
    one_line(capsys, code, "quantized already")
    assert not (tmp_path / "a.onnx").exists()



@pytest.mark.slow
def test_optimize_bits_8_and_q8_patterns_compile_to_the_canonical_graphs_logits(tiny_onnx, tmp_path):
    """`qwc optimize --bits 8` makes every linear Q8_0, `--q8 PATTERN` the ones it names; the
    compiled W4A32 artifact (the nibble halves, repack.q8_0_nibble_halves) gives onnxruntime's
    logits on the canonical graph, the A8 ones within their activations' rounding: x86-avx2's
    (the halves on the W4A8 kernels) and, where the CPU has VNNI, the host's W8A8 kernels."""
    from qwc import cpu
    from qwc.config import load_for_graph

    cfg = load_for_graph(tiny_onnx)
    for opts, eight in ((["--bits", "8"], 7 * cfg.num_hidden_layers), (["--q8", "*.down_proj"], cfg.num_hidden_layers)):
        q = tmp_path / f"{opts[0][2:]}.onnx"
        assert main(["-q", "optimize", str(tiny_onnx), *opts, "-o", str(q)]) == 0
        nodes = [n for n in onnx.load(str(q)).graph.node if n.op_type == "MatMulNBits"]
        assert sum(next(a.i for a in n.attribute if a.name == "bits") == 8 for n in nodes) == eight, opts
        ref = np.stack([r[0, -1] for r in ort_kv_logits(q, cfg, STEPS[0], STEPS[1:])])
        builds = [(32, "host", 1e-4), (8, "x86-avx2", 6e-2)]   # A8: the tiny model's Q4_0 graph is 3.8% off too
        builds += [(8, "host", 6e-2)] if cpu.has("avx512_vnni") else []
        for act, target, tol in builds:
            art = tmp_path / f"{opts[0][2:]}-a{act}-{target}.qwc"
            assert main(["-q", "compile", str(q), "--act-bits", str(act), "--kv-dtype", "f32", "--target", target,
                         "-o", str(art)]) == 0
            halves = any(".qwc_hi" in name for name in _params(art))
            assert halves == (act == 32 or target == "x86-avx2"), (opts, act, target)
            got = _compiled_logits(art)
            assert np.abs(got - ref).max() / np.abs(ref).max() < tol, (opts, act, target)


def test_bits_8_needs_blocks_of_32(tiny_onnx, tmp_path, capsys):
    code = main(["-q", "optimize", str(tiny_onnx), "--bits", "8", "--block-size", "128", "-o", str(tmp_path / "x.onnx")])
    one_line(capsys, code, "blocks of 32")


def test_arm_w8a8_repacking_keeps_one_copy_of_a_tied_q8_0_embedding(gguf_model):
    """On arm-yitian the Q8_0 matrices take the W8A8 kernels' row groups (row_groups.pack_int8)
    in place of two 4-bit halves, and the tied Q8_0 embedding reads the output's repacked codes
    (generic.gather_q8_row_groups): no initializer is added."""
    from qwc.compiler.kernels import row_groups
    from qwc.compiler.repack import q8_0_nibble_halves, repack_weights
    from qwc.compiler.targets import get_target
    from qwc.passes.graph import tensor_array

    d, _ = gguf_model
    m = onnx.load(str(d / "m.onnx"))
    before = {t.name: tensor_array(t) for t in m.graph.initializer}
    feats = get_target("arm-yitian").features
    assert q8_0_nibble_halves(m, 8, feats) == 0
    gather = next(n for n in m.graph.node if n.op_type == "GatherBlockQuantized")
    head = next(n for n in m.graph.node if n.op_type == "MatMulNBits" and n.input[1] == gather.input[0])
    eight = [n for n in m.graph.node if n.op_type == "MatMulNBits"
             and any(a.name == "bits" and a.i == 8 for a in n.attribute)]
    assert head in eight and len(eight) == 1 + 2 * 2      # the output, k and down of 2 layers
    plain = {n.name: (before[n.input[1]], before[n.input[2]]) for n in eight}
    repack_weights(m, 8, feats)
    after = {t.name: tensor_array(t) for t in m.graph.initializer}
    assert set(after) <= set(before)                       # nothing copied
    for n in eight:
        w, s = row_groups.pack_int8(*plain[n.name])
        assert np.array_equal(after[n.input[1]], w) and np.array_equal(after[n.input[2]], s)
    assert gather.input[0] == head.input[1] and gather.input[2] == head.input[2]
