"""`qwc optimize` end to end, and graphs the passes cannot handle."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from qwc.cli import main
from qwc.config import ModelConfig, sidecar_paths


def _run(args, capsys):
    capsys.readouterr()
    code = main(["-q", *args])
    return code, capsys.readouterr()


def test_optimize_writes_graph_sidecars_and_summary(tiny_onnx, tmp_path, capsys):
    out = tmp_path / "m.q4.onnx"
    code, cap = _run(["optimize", str(tiny_onnx), "-o", str(out), "--verify"], capsys)
    assert code == 0, cap.err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.q4.config.json", "m.q4.onnx", "m.q4.tokenizer.json"]
    assert ModelConfig.load(sidecar_paths(out)[0]).name == "tiny"
    lines = cap.out.splitlines()
    row = next(l for l in lines if l.startswith("MatMulNBits"))
    assert row.split()[1:] == ["0", "15"]
    ratio = next(l for l in lines if l.startswith("parameters:"))
    assert "MiB ->" in ratio and "of the input" in ratio
    assert any(l.startswith("verify (onnxruntime") and "max rel diff" in l for l in lines)
    onnx.checker.check_model(str(out))


def _assert_one_line_error(code, cap, expect, out_dir):
    assert code == 2
    lines = cap.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("qwc: error: ") and expect in lines[0], cap.err
    assert not any(p.name.startswith("bad") for p in out_dir.iterdir())


def _edited_copy(src, dst, edit):
    m = onnx.load(str(src))
    edit(m)
    onnx.save(m, str(dst))
    for a, b in zip(sidecar_paths(src), sidecar_paths(dst)):
        b.write_bytes(a.read_bytes())
    return dst


def test_layernorm_instead_of_rmsnorm(tiny_onnx, tmp_path, capsys):
    def edit(m):
        # Replace the first RMSNorm (the ReduceMean chain ending in the gain Mul) by LayerNorm.
        nodes = list(m.graph.node)
        rm = next(n for n in nodes if n.op_type == "ReduceMean")
        x = next(n for n in nodes if n.output[0] == rm.input[0]).input[0]
        gain = next(n for n in nodes if n.op_type == "Mul" and any("input_layernorm" in i for i in n.input))
        hidden = 128
        m.graph.initializer.extend([numpy_helper.from_array(np.ones(hidden, np.float32), "ln_scale"),
                                    numpy_helper.from_array(np.zeros(hidden, np.float32), "ln_bias")])
        ln = helper.make_node("LayerNormalization", [x, "ln_scale", "ln_bias"], [gain.output[0]],
                              name="my_layernorm", axis=-1, epsilon=1e-6)
        idx = nodes.index(gain)
        m.graph.node.remove(gain)
        m.graph.node.insert(idx, ln)
    src = _edited_copy(tiny_onnx, tmp_path / "ln.onnx", edit)
    code, cap = _run(["optimize", str(src), "-o", str(tmp_path / "bad.onnx")], capsys)
    _assert_one_line_error(code, cap, "node my_layernorm (LayerNormalization): qwc handles RMSNorm models", tmp_path)


def test_missing_initializer(tiny_onnx, tmp_path, capsys):
    def edit(m):
        mm = next(n for n in m.graph.node if n.op_type == "MatMul" and n.input[1] in {t.name for t in m.graph.initializer})
        keep = [t for t in m.graph.initializer if t.name != mm.input[1]]
        del m.graph.initializer[:]
        m.graph.initializer.extend(keep)
    src = _edited_copy(tiny_onnx, tmp_path / "noinit.onnx", edit)
    code, cap = _run(["optimize", str(src), "-o", str(tmp_path / "bad.onnx")], capsys)
    _assert_one_line_error(code, cap, "(MatMul) reads", tmp_path)
    assert "missing initializer" in cap.err


def test_unknown_custom_op(tiny_onnx, tmp_path, capsys):
    def edit(m):
        sig = next(n for n in m.graph.node if n.op_type == "Sigmoid")
        sig.op_type, sig.domain, sig.name = "FancySigmoid", "com.example", "fancy"
        m.opset_import.append(helper.make_opsetid("com.example", 1))
    src = _edited_copy(tiny_onnx, tmp_path / "custom.onnx", edit)
    code, cap = _run(["optimize", str(src), "-o", str(tmp_path / "bad.onnx")], capsys)
    _assert_one_line_error(code, cap, "node fancy (com.example::FancySigmoid): unsupported custom op", tmp_path)


def test_not_an_onnx_file(tmp_path, capsys):
    src = tmp_path / "junk.onnx"
    src.write_bytes(b"\x00\xffnot a protobuf" * 50)
    (tmp_path / "junk.config.json").write_text(_tiny_cfg_json())  # the config is read first
    code, cap = _run(["optimize", str(src), "-o", str(tmp_path / "bad.onnx")], capsys)
    _assert_one_line_error(code, cap, "not a valid ONNX model", tmp_path)


def _tiny_cfg_json():
    from qwc.models.presets import preset_config
    return preset_config("tiny").to_json()


def test_missing_model_and_missing_config(tiny_onnx, tmp_path, capsys):
    code, cap = _run(["optimize", str(tmp_path / "none.onnx"), "-o", str(tmp_path / "bad.onnx")], capsys)
    _assert_one_line_error(code, cap, "no model config for", tmp_path)
    lone = tmp_path / "lone.onnx"
    lone.write_bytes(tiny_onnx.read_bytes())
    code, cap = _run(["optimize", str(lone), "-o", str(tmp_path / "bad.onnx")], capsys)
    _assert_one_line_error(code, cap, "expected lone.config.json or config.json", tmp_path)


def test_hf_config_json_beside_a_foreign_graph(tiny_onnx, tiny_lm, tmp_path, capsys):
    """Graphs from optimum / onnxruntime-genai come with a HF config.json, not ours."""
    d = tmp_path / "foreign"
    d.mkdir()
    (d / "model.onnx").write_bytes(tiny_onnx.read_bytes())
    tiny_lm.model.config.save_pretrained(d)
    code, cap = _run(["optimize", str(d / "model.onnx"), "-o", str(tmp_path / "out.onnx")], capsys)
    assert code == 0, cap.err


def test_norm_gains_stay_in_the_norms_unless_folding_is_asked_for(tiny_onnx, tmp_path, capsys):
    """Post-training quantization keeps each RMSNorm gain in its norm (folding it first costs
    accuracy); --fold-norm-gains folds all but the tied final norm's; --untie-lm-head alone is
    refused, since without folding it would change nothing."""
    import numpy as np

    def gains(path):
        m = onnx.load(str(path))
        inits = {t.name: onnx.numpy_helper.to_array(t) for t in m.graph.initializer}
        return [inits[n.input[1 if n.op_type == "SimplifiedLayerNormalization" else 2]] for n in m.graph.node
                if "SimplifiedLayerNormalization" in n.op_type]

    code, cap = _run(["optimize", str(tiny_onnx), "-o", str(tmp_path / "plain.onnx")], capsys)
    assert code == 0, cap.err
    assert len(gains(tmp_path / "plain.onnx")) == 5 and not any(np.all(g == 1) for g in gains(tmp_path / "plain.onnx"))
    code, cap = _run(["optimize", str(tiny_onnx), "-o", str(tmp_path / "folded.onnx"), "--fold-norm-gains"], capsys)
    assert code == 0, cap.err
    assert sum(np.all(g == 1) for g in gains(tmp_path / "folded.onnx")) == 4
    code, cap = _run(["optimize", str(tiny_onnx), "-o", str(tmp_path / "bad.onnx"), "--untie-lm-head"], capsys)
    _assert_one_line_error(code, cap, "--fold-norm-gains", tmp_path)
