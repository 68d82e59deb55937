"""An adapter_config.json whose fields peft would take on trust: every field qwc computes with,
of the wrong type or out of range, is refused in one line naming the field, by every command
that reads adapters (`export --lora`, `run --lora`, `serve --lora`), with exit 2, no traceback
and nothing written; a served adapter is not disturbed by a bad one read after it."""

from __future__ import annotations

import json
import math

import pytest

from qwc.adapter_files import read_adapter
from qwc.cli import main
from qwc.errors import QwcError
from qwc.models.presets import preset_config

from conftest import random_peft_adapter


@pytest.fixture(scope="module")
def good_adapter(tiny_lm, tmp_path_factory):
    folder = tmp_path_factory.mktemp("adapter") / "lora"
    random_peft_adapter(tiny_lm.model, folder, r=4, alpha=8, seed=1, target=["q_proj", "v_proj"])
    return folder


def _with_config(good, folder, **fields):
    """A copy of the good adapter with its adapter_config.json's `fields` set."""
    folder.mkdir()
    for f in good.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    c = json.loads((folder / "adapter_config.json").read_text())
    c.update(fields)
    (folder / "adapter_config.json").write_text(json.dumps(c))
    return folder


def _one_line(capsys, code, words):
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("qwc: error: "), err
    assert "Traceback" not in err[0] and all(w in err[0] for w in words), err[0]


def _export_refuses(capsys, tmp_path, base, adapter, words):
    out = tmp_path / "x.onnx"
    capsys.readouterr()
    _one_line(capsys, main(["-q", "export", str(base), "--lora", str(adapter), "-o", str(out)]), words)
    assert not any(p.name.startswith("x.") for p in tmp_path.iterdir()), "something was written"


# The five adapters, then every numeric field as a string, null, negative, zero and NaN.
_CASES = [
    ({"lora_alpha": "sixteen"}, ["lora_alpha \"sixteen\"", "positive finite number"]),
    ({"lora_alpha": None}, ["lora_alpha null"]),
    ({"rank_pattern": ["q_proj"]}, ["rank_pattern [\"q_proj\"]", "must be a mapping"]),
    ({"alpha_pattern": {"q_proj": "x"}}, ["alpha_pattern['q_proj'] \"x\""]),
    *[({field: value}, [f"{field} {shown}"])
      for field in ("r", "lora_alpha")
      for value, shown in (("8", '"8"'), (None, "null"), (-4, "-4"), (0, "0"), (math.nan, "NaN"))],
    ({"r": 4.5}, ["r 4.5 must be an integer"]),
    ({"lora_alpha": math.inf}, ["lora_alpha Infinity"]),
    ({"rank_pattern": {"q_proj": 0}}, ["rank_pattern['q_proj'] 0 must be an integer >= 1"]),
    ({"rank_pattern": {"q_proj": None}}, ["rank_pattern['q_proj'] null"]),
    ({"rank_pattern": {"(q_proj": 4}}, ["rank_pattern key \"(q_proj\"", "regular expression"]),
    ({"alpha_pattern": {"q_proj": -1}}, ["alpha_pattern['q_proj'] -1"]),
    ({"alpha_pattern": {"q_proj": math.nan}}, ["alpha_pattern['q_proj'] NaN"]),
    ({"alpha_pattern": "q_proj"}, ["alpha_pattern \"q_proj\"", "must be a mapping"]),
    ({"target_modules": 7}, ["target_modules 7"]),
    ({"target_modules": ["q_proj", 3]}, ["target_modules [\"q_proj\", 3]"]),
    ({"use_rslora": "yes"}, ["use_rslora \"yes\" must be true or false"]),
    ({"use_rslora": None}, ["use_rslora null must be true or false"]),
    ({"fan_in_fan_out": 1}, ["fan_in_fan_out 1 must be true or false"]),
    ({"peft_type": 3}, ["peft_type 3 must be a string"]),
    ({"peft_type": "PREFIX_TUNING"}, ["a \"PREFIX_TUNING\" adapter; qwc takes LoRA"]),
    ({"use_qalora": True, "qalora_group_size": "32"}, ["qalora_group_size \"32\""]),
]


@pytest.mark.parametrize("fields, words", _CASES, ids=[json.dumps(c[0]) for c in _CASES])
def test_export_lora_refuses(capsys, tmp_path, hf_base, good_adapter, fields, words):
    bad = _with_config(good_adapter, tmp_path / "bad", **fields)
    _export_refuses(capsys, tmp_path, hf_base, bad, ["adapter_config.json", *words])


def test_peft_files_pass(tmp_path, good_adapter, tiny_lm):
    """The checks refuse only what is wrong: peft's own file as saved passes them, and so do
    patterns, rsLoRA and a lone regular expression for target_modules."""
    cfg = preset_config("tiny")
    assert read_adapter(str(good_adapter), cfg).rank == 4
    fancy = _with_config(good_adapter, tmp_path / "fancy", rank_pattern={"q_proj": 4}, alpha_pattern={"v_proj": 2.5},
                         use_rslora=True, target_modules=r".*\.(q_proj|v_proj)")
    ad = read_adapter(str(fancy), cfg)
    assert {round(p.scale, 6) for p in ad.pairs.values()} == {round(8 / 2, 6), round(2.5 / 2, 6)}


def test_run_lora_refuses(capsys, tmp_path, tiny_host_artifact, good_adapter):
    bad = _with_config(good_adapter, tmp_path / "bad", rank_pattern=["q_proj"])   # the case 7
    capsys.readouterr()
    code = main(["-q", "run", str(tiny_host_artifact), "--lora", str(bad), "--max-lora-rank", "8",
                 "--prompt", "hi", "--max-new-tokens", "2"])
    _one_line(capsys, code, ["adapter_config.json", "rank_pattern"])


def test_serve_lora_refuses_at_start(capsys, tmp_path, tiny_host_artifact, good_adapter):
    bad = _with_config(good_adapter, tmp_path / "bad", lora_alpha=None)   # the case 6
    capsys.readouterr()
    code = main(["-q", "serve", str(tiny_host_artifact), "--port", "0", "--max-lora-rank", "8",
                 "--lora", f"good={good_adapter}", "--lora", f"bad={bad}"])
    _one_line(capsys, code, ["adapter_config.json", "lora_alpha null"])


def test_a_bad_adapter_leaves_a_read_one_alone(tmp_path, good_adapter, tiny_lm):
    """Adapters are read whole and checked before they are used: reading a bad one after a
    good one changes nothing of the good one's pairs."""
    cfg = preset_config("tiny")
    good = read_adapter(str(good_adapter), cfg)
    before = {k: (p.a.copy(), p.b.copy(), p.scale) for k, p in good.pairs.items()}
    with pytest.raises(QwcError, match="lora_alpha"):
        read_adapter(str(_with_config(good_adapter, tmp_path / "bad", lora_alpha="x")), cfg)
    for k, (a, b, s) in before.items():
        assert (good.pairs[k].a == a).all() and (good.pairs[k].b == b).all() and good.pairs[k].scale == s


@pytest.mark.parametrize("alpha, vtype, shown", [("8", "STRING", '"8"'), (-1.0, "FLOAT32", "-1.0"),
                                                  (float("nan"), "FLOAT32", "NaN")])
def test_gguf_adapter_alpha(capsys, tmp_path, hf_base, alpha, vtype, shown):
    """llama.cpp's GGUF adapters: adapter.lora.alpha of the wrong type or sign (0 is llama.cpp's
    "scale 1", and passes)."""
    import numpy as np
    from gguf import GGUFValueType, GGUFWriter

    path = tmp_path / "bad-adapter.gguf"
    w = GGUFWriter(str(path), "qwen2")
    w.add_string("general.type", "adapter")
    w.add_string("adapter.type", "lora")
    w.add_key_value("adapter.lora.alpha", alpha, GGUFValueType[vtype])
    rng = np.random.default_rng(0)
    w.add_tensor("blk.0.attn_q.weight.lora_a", rng.standard_normal((2, 128)).astype(np.float32))
    w.add_tensor("blk.0.attn_q.weight.lora_b", rng.standard_normal((128, 2)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _export_refuses(capsys, tmp_path, hf_base, path, ["bad-adapter.gguf", f"adapter.lora.alpha {shown}"])
