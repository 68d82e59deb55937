"""Bad input to `qwc export`: one line on stderr, exit code 2, nothing left behind."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from test_load import _make_gguf

from qwc.cli import main
from qwc.models.presets import PRESET_NAMES


def _run(args, capsys):
    capsys.readouterr()  # drop what the test's own setup printed
    code = main(["-q", *args])
    err = capsys.readouterr().err
    return code, err


def _assert_clean_failure(code, err, out_dir, expect):
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("qwc: error: "), err
    assert expect in lines[0], lines[0]
    assert not out_dir.exists(), "output folder created or partial output left behind"


def test_unknown_preset(tmp_path, capsys):
    out = tmp_path / "out"
    code, err = _run(["export", "tiniest", "-o", str(out / "m.onnx")], capsys)
    _assert_clean_failure(code, err, out, f"'tiniest' is neither a preset ({', '.join(PRESET_NAMES)})")


def test_missing_gguf(tmp_path, capsys):
    out = tmp_path / "out"
    code, err = _run(["export", str(tmp_path / "nope.gguf"), "-o", str(out / "m.onnx")], capsys)
    _assert_clean_failure(code, err, out, "no such file")


def _hf_dir(tiny_lm, tmp_path, weights: bool = True, **config):
    """The tiny model as a Hugging Face directory (config only without `weights`), its
    config.json's fields overridden by `config`."""
    src = tmp_path / "hf"
    (tiny_lm.model if weights else tiny_lm.model.config).save_pretrained(src)
    tiny_lm.tokenizer.save(str(src / "tokenizer.json"))
    if config:
        cfg = json.loads((src / "config.json").read_text())
        (src / "config.json").write_text(json.dumps({**cfg, **config}))
    return src


def _export_fails(src, tmp_path, capsys, expect):
    out = tmp_path / "out"
    code, err = _run(["export", str(src), "-o", str(out / "m.onnx")], capsys)
    _assert_clean_failure(code, err, out, expect)


def test_hf_dir_without_weights(tiny_lm, tmp_path, capsys):
    _export_fails(_hf_dir(tiny_lm, tmp_path, weights=False), tmp_path, capsys, "no *.safetensors weights")


def test_truncated_safetensors(tiny_lm, tmp_path, capsys):
    f = _hf_dir(tiny_lm, tmp_path) / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    _export_fails(f.parent, tmp_path, capsys, "corrupt safetensors file")


def test_hf_checkpoint_with_wrong_shapes(tiny_lm, tmp_path, capsys):
    _export_fails(_hf_dir(tiny_lm, tmp_path, intermediate_size=64), tmp_path, capsys,
                  "intermediate_size 64 does not fit the tensors (model.layers.0.mlp.gate_proj.weight is [320, 128])")


@pytest.mark.parametrize("keep", [0.3, 0.9])
def test_truncated_gguf(tmp_path, capsys, keep):
    path, _, _ = _make_gguf(tmp_path, "qwen2")
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    out = tmp_path / "out"
    code, err = _run(["export", str(path), "-o", str(out / "m.onnx")], capsys)
    _assert_clean_failure(code, err, out, "corrupt or unsupported GGUF file")


def test_not_a_gguf(tmp_path, capsys):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"this is not a gguf file at all" * 10)
    out = tmp_path / "out"
    code, err = _run(["export", str(path), "-o", str(out / "m.onnx")], capsys)
    _assert_clean_failure(code, err, out, "corrupt or unsupported GGUF file")


def test_unsupported_hf_architecture(tiny_lm, tmp_path, capsys):
    _export_fails(_hf_dir(tiny_lm, tmp_path, model_type="gpt2"), tmp_path, capsys, "unsupported architecture 'gpt2'")


def test_unsupported_gguf_architecture(tmp_path, capsys):
    import numpy as np
    from gguf import GGUFWriter

    path = tmp_path / "falcon.gguf"
    w = GGUFWriter(str(path), "falcon")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    out = tmp_path / "out"
    code, err = _run(["export", str(path), "-o", str(out / "m.onnx")], capsys)
    _assert_clean_failure(code, err, out, "unsupported architecture 'falcon'")


def test_output_parent_is_a_file(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    code, err = _run(["export", "tiny", "-o", str(blocker / "m.onnx")], capsys)
    _assert_clean_failure(code, err, tmp_path / "nothing", "is not a directory")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_output_is_a_directory(tmp_path, capsys):
    (tmp_path / "m.onnx").mkdir()
    code, err = _run(["export", "tiny", "-o", str(tmp_path / "m.onnx")], capsys)
    assert code == 2 and "is a directory" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]
    assert list((tmp_path / "m.onnx").iterdir()) == []


@pytest.mark.slow
def test_failed_export_keeps_the_previous_output(tmp_path, capsys):
    out = tmp_path / "m.onnx"
    assert main(["-q", "export", "tiny", "-o", str(out)]) == 0
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    code, err = _run(["export", str(tmp_path / "gone.gguf"), "-o", str(out)], capsys)
    assert code == 2
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_cli_process_exit_code_and_no_traceback(tmp_path):
    r = subprocess.run([sys.executable, "-m", "qwc", "export", "nope", "-o", str(tmp_path / "m.onnx")],
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [
        f"qwc: error: 'nope' is neither a preset ({', '.join(PRESET_NAMES)}) nor an existing path"]
