"""passes/awq.py: activation-aware scales change no float output, find every group, never do
worse than plain Q4_0 on the calibration data, leave on-grid (QAT) weights alone, and run
end to end from `qwc optimize --awq`."""

from __future__ import annotations

import copy

import numpy as np
import onnx
import pytest

from qwc.cli import main
from qwc.passes import awq, canonicalize, fuse_attention, fuse_rmsnorm, fuse_rotary
from qwc.passes.graph import Graph
from qwc.passes.options import PassOptions
from qwc.passes.verify import compare, random_steps
from qwc.q4 import dequantize_q4_0, fake_quantize_q4_0, quantize_q4_0, unpack_nibbles


@pytest.fixture(scope="module")
def fused(tiny_onnx, tiny_lm):
    """The tiny export through the fusions: the float graph AWQ runs on."""
    m = onnx.load(str(tiny_onnx))
    for p in (canonicalize, fuse_rmsnorm, fuse_rotary, fuse_attention):
        m = p.run(m, PassOptions(config=tiny_lm.config))
    return m


def _calibration(seed=0, n=1024):
    return np.random.default_rng(seed).integers(0, 259, n)


def _weights(m):
    return {t.name: onnx.numpy_helper.to_array(t) for t in m.graph.initializer}


def test_groups_are_qkv_gate_up_and_down_per_layer(fused):
    gs = awq.groups(Graph(copy.deepcopy(fused)))
    assert [len(g.linears) for g in gs] == [3, 2, 1] * 2
    assert [g.producer[0] for g in gs] == ["gain", "gain", "columns"] * 2


def test_scales_leave_the_float_model_unchanged(fused, tiny_lm):
    cfg = tiny_lm.config
    scaled = awq.run(copy.deepcopy(fused), PassOptions(config=cfg, awq_calibration=_calibration()))
    changed = set(_weights(scaled)) - set(_weights(fused))
    assert any("_awq" in n for n in changed), "no group was scaled"
    r = compare(fused, scaled, cfg, random_steps(cfg, prompt=8, decode=4, seed=5))
    assert r.max_rel < 1e-5 and r.greedy_equal, str(r)


def test_search_never_does_worse_than_plain_q4_0():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((256, 64)).astype(np.float32)
    x[:, 3] *= 40   # an outlier channel, as LLM activations have
    w = rng.standard_normal((64, 48)).astype(np.float32) * 0.05
    alpha, s, errors = awq.search(x, np.abs(x).mean(0), [w], 32)
    assert errors[awq.ALPHAS.index(alpha)] == min(errors) and min(errors) < errors[0]
    assert alpha > 0 and s[3] == s.max()


def test_weights_on_the_q4_0_grid_are_left_alone(fused, tiny_lm):
    """A QAT checkpoint's linears are already Q4_0 values: AWQ must not move them."""
    m = copy.deepcopy(fused)
    g = Graph(m)
    for grp in awq.groups(g):
        for n in grp.linears:
            w = g.const(n.input[1])
            n.input[1] = g.add_init(fake_quantize_q4_0(w.T, 32).T.astype(np.float32), n.input[1] + "_qat")
    g.commit()
    before = _weights(m)
    after = _weights(awq.run(m, PassOptions(config=tiny_lm.config, awq_calibration=_calibration())))
    assert before.keys() == after.keys() and all(np.array_equal(before[k], after[k]) for k in before)


def test_cli_optimize_awq(tiny_onnx, tmp_path, capsys, calib_text):
    text = calib_text
    out = tmp_path / "awq.q4.onnx"
    code = main(["optimize", str(tiny_onnx), "-o", str(out), "--awq", "--calib", str(text), "--calib-tokens", "1024"])
    cap = capsys.readouterr()
    assert code in (0, None), cap.err
    assert "AWQ: 6 groups scaled" in cap.err
    onnx.checker.check_model(str(out))
    # still Q4_0: every packed weight decodes to a matrix that llama.cpp's quantizer (qwc.q4,
    # bit-identical to it) maps back to the same nibbles and fp16 scales
    m = onnx.load(str(out))
    init = _weights(m)
    matmuls = [n for n in m.graph.node if n.op_type == "MatMulNBits"]
    assert len(matmuls) >= 7 * 2
    for node in matmuls:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        if attrs["bits"] != 4:
            continue
        q = unpack_nibbles(init[node.input[1]])                    # [N, nb, 32]
        d = init[node.input[2]].astype(np.float32).reshape(q.shape[:2])
        assert np.array_equal(d.astype(np.float16).astype(np.float32), d), node.name
        w = dequantize_q4_0(q, d)
        q2, d2 = quantize_q4_0(w)
        assert np.array_equal(d2, d), node.name
        nonzero = d != 0
        assert np.array_equal(q2[nonzero], q[nonzero]), node.name
    code = main(["optimize", str(tiny_onnx), "-o", str(tmp_path / "bad.onnx"), "--awq", "--calib", str(text),
                 "--calib-tokens", "8192"])
    cap = capsys.readouterr()
    assert code == 2 and "fewer than the 8192 calibration needs" in cap.err
    assert not (tmp_path / "bad.onnx").exists()
