"""`qwc optimize --act-scale`: the per-token activation format's quantizer reference, the choice
of linears, and what `qwc compile` makes of it (the ARM kernels themselves:
tests/compiler/test_kernels.py and tests/arm/test_arm.py, under qemu)."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from qwc.cli import main
from qwc.compiler.row_activations import row_sums
from qwc.passes import act_scale
from qwc.passes.graph import ROW_ACTIVATIONS_KEY
from qwc.q4 import (
    fake_quantize_q8_0_activations,
    fake_quantize_rows_asym,
    pack_nibbles,
    quantize_q4_0,
    quantize_q8_0,
    quantize_rows_asym,
)


def test_rows_keep_zero_exact_and_each_value_within_half_a_step():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 96)).astype(np.float32)
    x[1] = 0                      # all zeros: scale 1, zero point 0, every code 0
    x[2] = np.abs(x[2]) + 1       # one sign: the range widened to 0
    x[3, :5] = 0                  # zeros inside a row stay exact
    q, s, zp = quantize_rows_asym(x)
    assert q.dtype == np.int8 and s[1] == 1 and zp[1] == 0 and np.all(q[1] == 0)
    back = fake_quantize_rows_asym(x)
    assert np.all(back[3, :5] == 0)
    assert np.all(np.abs(back - x) <= s[:, None] / 2 * (1 + 1e-6))
    assert zp[2] == -128        # lo = 0 is the lowest code
    # the range [lo, hi] spans the 256 codes: lo -> -128 (the row of zeros apart)
    lo = np.minimum(x.min(-1), 0)
    spans = np.arange(6) != 1
    assert np.all((np.abs((-128 - zp) * s - lo) <= s / 2 * (1 + 1e-6))[spans])


def test_an_outlier_costs_rows_more_than_blocks():
    """Two large channels of opposite signs (in block 0) set a row's step for all 256 values, a
    block's for its 32 only (their weights are zero, so they do not carry the output: a
    norm's outlier channels the next linear barely reads)."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((40, 256)).astype(np.float32)
    w[:, [7, 9]] = 0
    plain = rng.standard_normal((64, 256)).astype(np.float32)
    spiky = plain.copy()
    spiky[:, 7] = 60 * np.abs(spiky[:, 7])
    spiky[:, 9] = -60 * np.abs(spiky[:, 9])
    block, row = act_scale.relative_errors(plain, w)
    assert row < block + act_scale.ROW_MARGIN
    block, row = act_scale.relative_errors(spiky, w)
    assert row > 2 * block and row > block + act_scale.ROW_MARGIN
    assert np.abs(fake_quantize_q8_0_activations(plain) - plain).max() < np.abs(plain).max() / 127


def test_linears_reading_one_input_take_rows_together():
    class Node:
        def __init__(self, x, w):
            self.input = [x, w]

    nodes = [Node("n1", "q"), Node("n1", "k"), Node("n1", "v"), Node("h", "o"), Node("u", "down")]
    errs = {"q": (0.01, 0.015), "k": (0.01, 0.012), "v": (0.01, 0.03), "o": (0.005, 0.01), "down": (0.008, 0.1)}
    assert act_scale.choose(nodes, errs) == {"o"}          # v drags q and k back to blocks
    errs["v"] = (0.01, 0.019)
    assert act_scale.choose(nodes, errs) == {"q", "k", "v", "o"}


@pytest.mark.parametrize("bits", [4, 8])
def test_row_sums_are_the_dequantized_rows_sums(bits):
    w = np.random.default_rng(bits).standard_normal((24, 96)).astype(np.float32)
    if bits == 4:
        q, d = quantize_q4_0(w)
        codes, deq = pack_nibbles(q), (q.astype(np.float64) - 8) * d[..., None]
    else:
        q, d = quantize_q8_0(w)
        codes, deq = (q.astype(np.int16) + 128).astype(np.uint8), q.astype(np.float64) * d[..., None]
    got = row_sums(codes, d.reshape(-1), bits)
    assert got.dtype == np.float32 and got.shape == (24,)
    np.testing.assert_allclose(got, deq.reshape(24, -1).sum(-1), rtol=1e-6, atol=1e-6)


def _chosen(path) -> list[str]:
    m = onnx.load(str(path), load_external_data=False)
    return next((p.value.split(",") for p in m.metadata_props if p.key == ROW_ACTIVATIONS_KEY), [])


def test_cli_act_scale_modes_and_compile(tiny_q4, tmp_path, capsys, calib_text):
    """block records nothing; row every layer linear (not the head); auto a subset measured on
    the --calib text, linears of one input together. Compiling for the host (x86, whose GEMM
    has no per-token form) keeps blocks and says so; a choice naming linears the graph lacks
    is one line."""
    layer_linears = 7 * 2
    outs = {}
    for mode in ("block", "row", "auto"):
        outs[mode] = tmp_path / f"{mode}.q4.onnx"
        args = ["optimize", str(tiny_q4), "-o", str(outs[mode]), "--act-scale", mode]
        if mode == "auto":
            args += ["--calib", str(calib_text), "--calib-tokens", "1024"]
        capsys.readouterr()
        assert main(args) == 0
        err = capsys.readouterr().err
        assert (f"activations a token ({mode})" in err) == (mode != "block")
        onnx.checker.check_model(str(outs[mode]))
    assert _chosen(outs["block"]) == []
    assert len(_chosen(outs["row"])) == layer_linears and not any("lm_head" in w for w in _chosen(outs["row"]))
    auto = set(_chosen(outs["auto"]))
    assert auto <= set(_chosen(outs["row"]))
    m = onnx.load(str(outs["auto"]), load_external_data=False)
    by_input = {}
    for n in m.graph.node:
        if n.input and n.op_type == "MatMulNBits" and len(n.input) > 1:
            by_input.setdefault(n.input[0], set()).add(n.input[1] in auto)
    assert all(len(v) == 1 for v in by_input.values())   # together or not at all
    art = tmp_path / "host.qwc"
    capsys.readouterr()
    assert main(["compile", str(outs["row"]), "--target", "host", "-o", str(art)]) == 0
    assert "prefill activations: 0 linears" in capsys.readouterr().err
    assert "row_activations" not in json.loads((art / "manifest.json").read_text())["quantization"]

    bad = onnx.load(str(outs["row"]))
    next(p for p in bad.metadata_props if p.key == ROW_ACTIVATIONS_KEY).value += ",no.such.weight"
    onnx.save(bad, str(tmp_path / "bad.q4.onnx"))
    for side in ("config.json", "tokenizer.json"):
        (tmp_path / f"bad.q4.{side}").write_bytes((tmp_path / f"row.q4.{side}").read_bytes())
    capsys.readouterr()
    assert main(["-q", "compile", str(tmp_path / "bad.q4.onnx"), "--target", "arm-yitian", "-o",
                 str(tmp_path / "bad.qwc")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "names 1 linear(s) it does not have" in err[0]
    assert not (tmp_path / "bad.qwc").exists()


def test_auto_without_calibration_is_refused(tiny_q4, tmp_path):
    from qwc.errors import QwcError
    from qwc.passes.options import PassOptions

    with pytest.raises(QwcError, match="needs token ids"):
        PassOptions(act_scale="auto").validate()
    with pytest.raises(QwcError, match="is not one of"):
        PassOptions(act_scale="rows").validate()


def test_manifest_reads_the_count_and_refuses_a_bad_one():
    from qwc.errors import QwcError
    from qwc.manifest import Quantization

    def bad(what):
        raise QwcError(what)

    q = {"linears": [{"bits": 4, "block": 32, "format": "q4_0", "count": 14}], "activation_bits": 8,
         "row_activations": 12}
    assert Quantization.from_dict(q, bad).row_activations == 12
    assert Quantization.from_dict(q, bad).to_dict()["row_activations"] == 12
    assert "row_activations" not in Quantization.from_dict({**q, "row_activations": 0}, bad).to_dict()
    with pytest.raises(QwcError, match="row_activations 'x' must be a count"):
        Quantization.from_dict({**q, "row_activations": "x"}, bad)
