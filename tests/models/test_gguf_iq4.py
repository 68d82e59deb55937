"""llama.cpp's IQ4_NL and IQ4_XS kept exactly (a format added through qwc/weight_formats.py's
table: a record each and a parser in models/gguf_blocks.py): the file's blocks read as the gguf
package reads them, every linear marked with its record, the exported graph in onnxruntime as
the float reference on the file's dequantized weights, and the compiled artifact's greedy
tokens onnxruntime's on that graph."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize
from test_gguf_formats import STEPS, _config, assert_graph_follows_the_float_reference, write_random_model
from test_gguf_kquants import _arm_yitian_follows_the_host

from qwc import weight_formats
from qwc.cli import main
from qwc.config import ModelConfig, sidecar_paths
from qwc.models import gguf_blocks

from conftest import greedy_against_onnxruntime, random_iq4


@pytest.mark.parametrize("fmt", ["IQ4_NL", "IQ4_XS"])
def test_blocks_are_what_the_gguf_package_reads(fmt):
    rng = np.random.default_rng(1)
    raw = random_iq4(rng, 40, 512, fmt)
    b = gguf_blocks.from_gguf(raw, fmt, (40, 512), "w")
    assert (b.bits, b.block, b.codes.shape) == (8, 32, (40, 16, 32))
    assert set(np.unique(b.codes.astype(np.int16) - 128)) <= set(weight_formats.IQ4_BOOK)
    assert np.array_equal(gguf_blocks.dequantize(b), dequantize(raw, Q[fmt]).reshape(40, 512))


@pytest.fixture(scope="module")
def iq4_model(tmp_path_factory):
    """A tied qwen2 GGUF (hidden 256, so IQ4_XS's super-blocks fit) whose attention linears are
    IQ4_XS and MLP ones IQ4_NL; exported as the file gives it and dequantized (the reference)."""
    d = tmp_path_factory.mktemp("iq4")
    cfg = _config("tiny-iq4", hidden=256, intermediate=512)

    def matrix(rng, name, shape):
        fmt = "IQ4_XS" if "self_attn" in name else "IQ4_NL" if ".mlp." in name else None
        if fmt is None:   # the tied embedding in Q8_0
            from gguf.quants import quantize
            return quantize((0.1 * rng.standard_normal(shape)).astype(np.float32), Q.Q8_0), Q.Q8_0
        return random_iq4(rng, *shape, fmt, scale=0.03), Q[fmt]   # weights ~0.1: not a chaotic model

    write_random_model(d / "m.gguf", cfg, matrix, seed=3)
    assert main(["-q", "export", str(d / "m.gguf"), "-o", str(d / "m.onnx")]) == 0
    assert main(["-q", "export", str(d / "m.gguf"), "--exporter", "torch", "-o", str(d / "float.onnx")]) == 0
    return d


def test_every_iq4_linear_is_kept_and_marked(iq4_model):
    from gguf import GGUFReader

    file = {t.name: t for t in GGUFReader(iq4_model / "m.gguf").tensors}
    model = onnx.load(str(iq4_model / "m.onnx"))
    inits = {t.name: onnx.numpy_helper.to_array(t, base_dir=str(iq4_model)) for t in model.graph.initializer}
    seen = {"IQ4_NL": 0, "IQ4_XS": 0}
    for n in model.graph.node:
        if n.op_type != "MatMulNBits" or n.name.startswith("/lm_head"):
            continue
        fmt = weight_formats.marked(n).name
        layer, module = n.name.split("/")[3], n.name.split("/")[5]
        t = file[f"blk.{layer}.{gguf_name(module)}.weight"]
        assert fmt == t.tensor_type.name
        want = dequantize(t.data, t.tensor_type).reshape(inits[n.input[1]].shape[0], -1)
        got = (inits[n.input[1]].astype(np.float32) - 128) * inits[n.input[2]][..., None]
        assert np.array_equal(got.reshape(want.shape), want), n.name
        seen[fmt] += 1
    assert seen == {"IQ4_NL": 6, "IQ4_XS": 8}


def gguf_name(module: str) -> str:
    return {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
            "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}[module]


def test_the_graph_is_the_float_reference(iq4_model):
    assert_graph_follows_the_float_reference(iq4_model)


def _compile(d, act_bits: int, target: str = "host"):
    art = d / f"{target}-a{act_bits}.qwc"
    if not art.exists():
        assert main(["-q", "compile", str(d / "m.onnx"), "--target", target, "--act-bits", str(act_bits),
                     "--kv-dtype", "f32", "-o", str(art)]) == 0
    return art


@pytest.mark.parametrize("act_bits", [32, 8])
def test_compiled_greedy_tokens_are_onnxruntimes(iq4_model, act_bits):
    """Float activations: float rounding against onnxruntime on the same graph. Q8_0 activations:
    llama.cpp's arithmetic, held to test_gguf_formats' bound for W8A8 (an activation on a
    rounding boundary moves by a step of its block's scale; a wrong kernel is off by O(1))."""
    import json

    art = _compile(iq4_model, act_bits)
    formats = {f["format"] for f in json.loads((art / "manifest.json").read_text())["quantization"]["linears"]}
    assert {"iq4_nl", "iq4_xs"} <= formats
    cfg = ModelConfig.load(sidecar_paths(iq4_model / "m.onnx")[0])
    greedy_against_onnxruntime(art, iq4_model / "m.onnx", cfg, STEPS[0], 6, 64, tol=1e-3 if act_bits == 32 else 3e-2)


@pytest.mark.arm
@pytest.mark.slow
def test_arm_yitian_follows_the_float_reference(iq4_model, tmp_path):
    """The IQ4 kernels (smmla_iq4 prefill, sdot_iq4 decode) under qemu. Its IQ4_XS linears keep
    the file's factors, which puts its activations in Q8_K (kernels/iq4_xs_scales.py), so the
    ARM build and the host's are each held to the float reference (test_gguf_kquants' rule)."""
    manifest = _arm_yitian_follows_the_host(iq4_model, {8: _compile(iq4_model, 8)}, tmp_path)
    assert manifest["quantization"]["weight_layout"]["iq4_xs_compact_scales"] == 8
