"""LoRA on real weights (SmolLM2-135M, a `llama` GGUF): an adapter `qwc lora` trains loads into
transformers' own Llama model of the same file through peft, its merge is peft's, and llama.cpp's
converter makes a GGUF adapter of it (q and k rows permuted) that merges to the same model."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from qwc.cli import main
from qwc.config import ModelConfig, sidecar_paths
from qwc.eval import data
from qwc.passes.verify import run_steps, session

pytestmark = [pytest.mark.realdata, pytest.mark.slow]


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    text = tmp_path_factory.mktemp("text") / "pp.txt"
    text.write_text(data.novel("prideprejudice").read_text()[:60000])
    out = tmp_path_factory.mktemp("lora") / "smol-lora"
    assert main(["-q", "lora", "smollm2", "--data", str(text), "-o", str(out), "--steps", "3", "--seq-len", "64",
                 "--batch", "1", "--rank", "8", "--lr", "5e-3"]) == 0
    return out


@pytest.fixture(scope="module")
def merged(adapter, tmp_path_factory):
    """`qwc export smollm2 --lora` of the directory (the Q8_0 embedding kept as the file has it)."""
    out = tmp_path_factory.mktemp("merged") / "merged.onnx"
    assert main(["-q", "export", "smollm2", "--lora", str(adapter), "-o", str(out)]) == 0
    return out


def _logits(onnx_path, ids):
    return run_steps(session(onnx_path), ModelConfig.load(sidecar_paths(onnx_path)[0]), [ids])[0]


def test_transformers_and_peft_load_it_and_merge_as_qwc_does(adapter, merged):
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    gguf = data.smollm2_path()
    base = LlamaForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, torch_dtype=torch.float32).eval()
    ref = PeftModel.from_pretrained(base, str(adapter)).merge_and_unload().eval()
    ids = np.array([[504, 3458, 282, 4649, 314, 5185, 30, 378, 3458, 282]])
    with torch.no_grad():
        want = ref(torch.from_numpy(ids)).logits.numpy()
    got = _logits(merged, ids)
    assert np.abs(want - got).max() <= 1e-3 * (want.max() - want.min())


def test_llama_cpps_converter_makes_the_same_adapter(adapter, merged, llamacpp_scripts, tmp_path):
    from transformers import AutoConfig

    gguf = data.smollm2_path()
    base = tmp_path / "base"
    cfg = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    cfg.architectures = ["LlamaForCausalLM"]   # what the converter reads the architecture from
    cfg.save_pretrained(base)
    assert json.loads((base / "config.json").read_text())["model_type"] == "llama"
    converted = tmp_path / "smol-lora.gguf"
    r = subprocess.run([sys.executable, str(llamacpp_scripts / "convert_lora_to_gguf.py"), "--base", str(base),
                        "--outfile", str(converted), str(adapter)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    via_gguf = tmp_path / "gguf.onnx"
    assert main(["-q", "export", "smollm2", "--lora", str(converted), "-o", str(via_gguf)]) == 0
    ids = np.array([[504, 3458, 282, 4649, 314, 5185, 30]])
    a, b = _logits(merged, ids), _logits(via_gguf, ids)
    assert np.abs(a - b).max() <= 1e-5 * (a.max() - a.min())
