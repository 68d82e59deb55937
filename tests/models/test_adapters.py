"""LoRA adapters merged at export: against transformers + peft's merge_and_unload on the same
weights, the GGUF adapter llama.cpp's own converter makes of the same directory, QA-LoRA's exact
merge into Q4_1 minimums, and every kind of bad adapter refused in one line with nothing written."""

from __future__ import annotations

import copy
import json

import numpy as np
import onnx
import pytest
import torch
from peft import LoraConfig, PeftModel
from safetensors.torch import save_file

from qwc.adapter_files import LINEARS
from qwc.cli import main
from qwc.config import ModelConfig, sidecar_paths

from conftest import ort_kv_logits, random_peft_adapter, torch_kv_logits

REL_TOL = 1e-3   # the issue's bound: merged float graph in onnxruntime against peft, relative to the logits' range


def _random_adapter(model, folder, r=4, alpha=8, seed=1, target=LINEARS, **config):
    return random_peft_adapter(model, folder, r=r, alpha=alpha, seed=seed, target=target, **config)


@pytest.fixture(scope="module")
def peft_dir(tiny_lm, tmp_path_factory):
    folder = tmp_path_factory.mktemp("adapter") / "lora"
    _random_adapter(tiny_lm.model, folder)
    return folder


def _peft_merged(base_model, folder, scale=1.0):
    pm = PeftModel.from_pretrained(copy.deepcopy(base_model), str(folder))
    if scale != 1.0:
        for m in pm.modules():
            if hasattr(m, "scaling") and isinstance(m.scaling, dict):
                m.scaling = {k: v * scale for k, v in m.scaling.items()}
    return pm.merge_and_unload().eval()


def _check_logits(onnx_path, ref_model, seed=0):
    cfg = ModelConfig.load(sidecar_paths(onnx_path)[0])
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, cfg.vocab_size, (1, 8))
    steps = [rng.integers(0, cfg.vocab_size, (1, 1)) for _ in range(3)]
    for r, g in zip(torch_kv_logits(ref_model, prompt, steps), ort_kv_logits(onnx_path, cfg, prompt, steps)):
        assert np.abs(r - g).max() <= REL_TOL * (r.max() - r.min())
    return cfg


def test_merge_matches_peft_merge_and_unload(tiny_lm, hf_base, peft_dir, tmp_path):
    out = tmp_path / "merged.onnx"
    assert main(["-q", "export", str(hf_base), "--lora", str(peft_dir), "-o", str(out)]) == 0
    ref = _peft_merged(tiny_lm.model, peft_dir)
    _check_logits(out, ref)
    # the adapter matters: the base alone is far from the merged model
    base = tmp_path / "base.onnx"
    assert main(["-q", "export", str(hf_base), "--exporter", "stream", "-o", str(base)]) == 0
    cfg = ModelConfig.load(sidecar_paths(base)[0])
    prompt = np.arange(8)[None] % cfg.vocab_size
    a, b = ort_kv_logits(base, cfg, prompt, [])[0], ort_kv_logits(out, cfg, prompt, [])[0]
    assert np.abs(a - b).max() > 0.05 * (a.max() - a.min())


def test_torch_exporter_route_is_the_same_merge(hf_base, peft_dir, tmp_path, capsys):
    """`--exporter torch` (float32 throughout, what --awq needs) merges the same weights; a
    QA-LoRA adapter, which merges into 4-bit blocks, is refused there."""
    a, b = tmp_path / "s.onnx", tmp_path / "t.onnx"
    assert main(["-q", "export", str(hf_base), "--lora", str(peft_dir), "-o", str(a)]) == 0
    assert main(["-q", "export", str(hf_base), "--exporter", "torch", "--lora", str(peft_dir), "-o", str(b)]) == 0
    c = ModelConfig.load(sidecar_paths(a)[0])
    prompt = np.arange(9)[None]
    x, y = ort_kv_logits(a, c, prompt, [])[0], ort_kv_logits(b, c, prompt, [])[0]
    assert np.abs(x - y).max() <= 1e-4 * (x.max() - x.min())
    qa = _copy_adapter(peft_dir, tmp_path / "qa")
    cfg = json.loads((qa / "adapter_config.json").read_text())
    cfg.update(use_qalora=True, qalora_group_size=32)
    (qa / "adapter_config.json").write_text(json.dumps(cfg))
    from safetensors.torch import load_file
    t = load_file(qa / "adapter_model.safetensors")
    save_file({k: (v[:, : v.shape[1] // 32].contiguous() if "lora_A" in k else v) for k, v in t.items()},
              qa / "adapter_model.safetensors")
    capsys.readouterr()
    assert main(["export", str(hf_base), "--exporter", "torch", "--lora", str(qa), "-o", str(tmp_path / "q.onnx")]) == 2
    assert "drop --exporter torch" in capsys.readouterr().err and not (tmp_path / "q.onnx").exists()


def test_scale_and_two_adapters_and_rslora(tiny_lm, hf_base, peft_dir, tmp_path):
    second = tmp_path / "rs"
    _random_adapter(tiny_lm.model, second, r=8, alpha=4, seed=2, use_rslora=True)
    out = tmp_path / "two.onnx"
    assert main(["-q", "export", "tiny", "--lora", f"{peft_dir}:0.5", "--lora", str(second), "-o", str(out)]) == 0
    pm = PeftModel.from_pretrained(copy.deepcopy(tiny_lm.model), str(peft_dir), adapter_name="a")
    pm.load_adapter(str(second), adapter_name="b")
    pm.add_weighted_adapter(["a", "b"], [0.5, 1.0], "ab", combination_type="cat")
    pm.set_adapter("ab")
    _check_logits(out, pm.merge_and_unload().eval())


def test_merge_into_a_gguf_base_keeps_the_other_blocks(tmp_path):
    """A GGUF base: the adapted linears become float before quantization (the passes quantize
    them), the ones the adapter leaves stay the file's blocks; the merge is W + s·B·A of the
    file's dequantized weights."""
    from gguf import GGMLQuantizationType as Q
    from test_gguf_formats import write_model

    from qwc.models.gguf_loader import load_gguf
    from qwc.models.qwen2 import build_model

    path = tmp_path / "base.gguf"
    write_model(path, {n: Q.Q4_1 for n in _gguf_linears()})
    base = load_gguf(path)
    folder = tmp_path / "lora"
    _random_adapter(base.model, folder, target=("q_proj", "down_proj"))
    out = tmp_path / "m.onnx"
    assert main(["-q", "export", str(path), "--lora", str(folder), "-o", str(out)]) == 0
    g = onnx.load(str(out), load_external_data=False)
    nbits = {n.name for n in g.graph.node if n.op_type == "MatMulNBits"}
    floats = {n.name for n in g.graph.node if n.op_type == "MatMul"}
    assert {f"/model/layers/{i}/self_attn/q_proj/MatMul" for i in range(2)} <= floats
    assert {f"/model/layers/{i}/mlp/down_proj/MatMul" for i in range(2)} <= floats
    assert "/model/layers/1/self_attn/k_proj/MatMulNBits" in nbits and len(nbits) == 2 * 5 + 1   # + tied head
    ref = build_model(base.config)
    ref.load_state_dict(base.model.state_dict())
    _check_logits(out, _peft_merged(ref, folder))


def _gguf_linears():
    from test_gguf_formats import _config

    from qwc.adapter_files import linear_shapes
    return list(linear_shapes(_config()))


# --- bad adapters: one line, exit 2, nothing written -------------------------------------

def _refused(capsys, tmp_path, base, spec, words):
    out = tmp_path / "x.onnx"
    assert main(["export", str(base), "--lora", str(spec), "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and all(w in err[0] for w in words), err
    assert not out.exists() and not any(p.name.endswith(".data") for p in tmp_path.iterdir())


def _copy_adapter(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _hand_made(folder, target, tensors):
    """An adapter directory written by hand: peft's config for `target`, these tensors."""
    folder.mkdir()
    LoraConfig(r=2, lora_alpha=2, target_modules=[target]).save_pretrained(folder)
    save_file({f"base_model.model.{k}": v for k, v in tensors.items()}, folder / "adapter_model.safetensors")
    return folder


def test_adapter_for_another_shape(capsys, tmp_path, hf_base):
    folder = _hand_made(tmp_path / "other", "q_proj", {
        "model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(2, 896),
        "model.layers.0.self_attn.q_proj.lora_B.weight": torch.ones(896, 2)})
    _refused(capsys, tmp_path, hf_base, folder, ["q_proj", "another model"])


def test_adapter_on_a_module_the_base_lacks(capsys, tmp_path, hf_base):
    folder = _hand_made(tmp_path / "gpt2", "c_attn", {
        "transformer.h.0.attn.c_attn.lora_A.weight": torch.ones(2, 128),
        "transformer.h.0.attn.c_attn.lora_B.weight": torch.ones(384, 2)})
    _refused(capsys, tmp_path, hf_base, folder, ["c_attn", "does not have"])


def test_layer_beyond_the_base(capsys, tmp_path, hf_base):
    folder = _hand_made(tmp_path / "deep", "q_proj", {
        "model.layers.7.self_attn.q_proj.lora_A.weight": torch.ones(2, 128),
        "model.layers.7.self_attn.q_proj.lora_B.weight": torch.ones(128, 2)})
    _refused(capsys, tmp_path, hf_base, folder, ["layer 7", "2 layers"])


def test_rank_zero(capsys, tmp_path, hf_base, peft_dir):
    folder = _copy_adapter(peft_dir, tmp_path / "r0")
    c = json.loads((folder / "adapter_config.json").read_text())
    c["r"] = 0
    (folder / "adapter_config.json").write_text(json.dumps(c))
    _refused(capsys, tmp_path, hf_base, folder, ["adapter_config.json", "r"])


def test_nan_in_weights(capsys, tmp_path, hf_base, peft_dir):
    from safetensors.torch import load_file
    folder = _copy_adapter(peft_dir, tmp_path / "nan")
    t = load_file(folder / "adapter_model.safetensors")
    key = next(k for k in t if "down_proj.lora_B" in k)
    t[key][0, 0] = float("nan")
    save_file(t, folder / "adapter_model.safetensors")
    _refused(capsys, tmp_path, hf_base, folder, ["down_proj", "NaN"])


def test_truncated_and_missing_files(capsys, tmp_path, hf_base, peft_dir):
    folder = _copy_adapter(peft_dir, tmp_path / "cut")
    data = (folder / "adapter_model.safetensors").read_bytes()
    (folder / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    _refused(capsys, tmp_path, hf_base, folder, ["adapter_model.safetensors", "truncated"])
    (folder / "adapter_model.safetensors").unlink()
    _refused(capsys, tmp_path, hf_base, folder, ["no adapter_model.safetensors"])
    (folder / "adapter_config.json").write_text("{not json")
    _refused(capsys, tmp_path, hf_base, folder, ["adapter_config.json", "not valid JSON"])
    _refused(capsys, tmp_path, hf_base, tmp_path / "nowhere", ["no such adapter"])


def test_unpaired_tensor(capsys, tmp_path, hf_base, peft_dir):
    from safetensors.torch import load_file
    folder = _copy_adapter(peft_dir, tmp_path / "half")
    t = load_file(folder / "adapter_model.safetensors")
    t.pop(next(k for k in t if "layers.1.mlp.up_proj.lora_B" in k))
    save_file(t, folder / "adapter_model.safetensors")
    _refused(capsys, tmp_path, hf_base, folder, ["up_proj", "no lora_B"])


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_gguf_adapter_from_llama_cpps_converter(llamacpp_scripts, hf_base, peft_dir, tmp_path, arch):
    """llama.cpp's convert_lora_to_gguf.py on the same PEFT directory gives the same model. For a
    `llama` base it permutes the q and k B rows for its rotary layout, which the loader undoes."""
    import subprocess
    import sys

    from gguf import GGUFReader

    base = tmp_path / "base"
    base.mkdir()
    cfg = json.loads((hf_base / "config.json").read_text())
    if arch == "llama":
        cfg.update(model_type="llama", architectures=["LlamaForCausalLM"])
    (base / "config.json").write_text(json.dumps(cfg))
    (base / "tokenizer.json").write_bytes((hf_base / "tokenizer.json").read_bytes())
    adapter = tmp_path / "a.gguf"
    r = subprocess.run([sys.executable, str(llamacpp_scripts / "convert_lora_to_gguf.py"), "--base", str(base),
                        "--outfile", str(adapter), str(peft_dir)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    reader = GGUFReader(adapter)
    assert reader.fields["general.architecture"].contents() == arch
    b_file = next(np.asarray(t.data) for t in reader.tensors if t.name == "blk.0.attn_q.weight.lora_b")
    from safetensors.numpy import load_file
    b_dir = load_file(peft_dir / "adapter_model.safetensors")[
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    assert np.array_equal(b_file, b_dir) == (arch == "qwen2")   # permuted rows in a llama file

    via_dir, via_gguf = tmp_path / "dir.onnx", tmp_path / "gguf.onnx"
    assert main(["-q", "export", str(hf_base), "--lora", str(peft_dir), "-o", str(via_dir)]) == 0
    assert main(["-q", "export", str(hf_base), "--lora", str(adapter), "-o", str(via_gguf)]) == 0
    c = ModelConfig.load(sidecar_paths(via_dir)[0])
    prompt = np.arange(12)[None]
    steps = [np.array([[5]]), np.array([[9]])]
    for a, b in zip(ort_kv_logits(via_dir, c, prompt, steps), ort_kv_logits(via_gguf, c, prompt, steps)):
        assert np.abs(a - b).max() <= 1e-5 * (a.max() - a.min())


def test_gguf_base_model_given_as_an_adapter(capsys, tmp_path, hf_base):
    from test_gguf_formats import write_model
    path = tmp_path / "model.gguf"
    write_model(path, {n: __import__("gguf").GGMLQuantizationType.Q4_0 for n in _gguf_linears()})
    _refused(capsys, tmp_path, hf_base, path, ["not a LoRA adapter"])
