"""GPTQ (passes/gptq.py): round-to-nearest where the Hessian says the channels are independent,
a smaller output error than round-to-nearest where they are not, plain Q4_0 out."""

from __future__ import annotations

import numpy as np
import onnx

from qwc.cli import main
from qwc.passes import gptq
from qwc.q4 import dequantize_q4_0, quantize_q4_0


def _weights(rng, n=48, k=128):
    return (rng.standard_normal((n, k)) * rng.uniform(0.2, 2.0, k)).astype(np.float32)


def test_identity_hessian_is_round_to_nearest_with_searched_scales():
    """No correlation, so no error moves between channels: each block is rounded to nearest,
    on Q4_0's scale or a smaller one that rounds it better (block_scale's search)."""
    w = _weights(np.random.default_rng(0))
    q, d = gptq.quantize(w, np.eye(w.shape[1]))
    q_rtn, d_rtn = quantize_q4_0(w, 32)
    assert ((np.abs(d) <= np.abs(d_rtn)) & (np.abs(d) >= 0.79 * np.abs(d_rtn))).all()
    err, err_rtn = ((w - dequantize_q4_0(a, b)).reshape(len(w), -1, 32) ** 2 for a, b in ((q, d), (q_rtn, d_rtn)))
    assert (err.sum(-1) <= err_rtn.sum(-1) * (1 + 1e-6) + 1e-12).all()
    assert err.sum() < 0.97 * err_rtn.sum()
    # where the scale is Q4_0's own, the codes are round-to-nearest's (llama.cpp rounds by 1 / the
    # float32 scale, GPTQ by the fp16 one it stores: a code a half apart can differ)
    same = d == d_rtn
    assert same.any() and np.mean(q[same] == q_rtn[same]) > 0.995


def test_correlated_activations_give_a_smaller_output_error_than_round_to_nearest():
    rng = np.random.default_rng(1)
    w = _weights(rng)
    mix = rng.standard_normal((128, 128)).astype(np.float32)
    x = rng.standard_normal((2048, 128)).astype(np.float32) @ mix        # channels correlated
    q, d = gptq.quantize(w, (x.T.astype(np.float64) @ x) / len(x))
    q_rtn, d_rtn = quantize_q4_0(w, 32)

    def err(qq, dd):
        return float(np.mean((x @ w.T - x @ dequantize_q4_0(qq, dd).T) ** 2))

    assert err(q, d) < 0.8 * err(q_rtn, d_rtn)
    assert np.array_equal(d.astype(np.float16).astype(np.float32), d)    # fp16 scales, as Q4_0's
    assert q.min() >= 0 and q.max() <= 15


def test_cli_optimize_gptq_writes_q4_0(tiny_onnx, tmp_path, capsys, calib_text):
    text = calib_text
    out = tmp_path / "gptq.onnx"
    code = main(["optimize", str(tiny_onnx), "-o", str(out), "--gptq", "--calib", str(text), "--calib-tokens", "1024"])
    cap = capsys.readouterr()
    assert code in (0, None), cap.err
    assert "GPTQ: 14 linears from 8 Hessians" in cap.err     # 2 layers: q/k/v, o, gate/up, down inputs
    m = onnx.load(str(out))
    onnx.checker.check_model(m)
    nodes = [n for n in m.graph.node if n.op_type == "MatMulNBits"]
    assert len(nodes) == 15 and all(next(a.i for a in n.attribute if a.name == "bits") == 4 for n in nodes)
