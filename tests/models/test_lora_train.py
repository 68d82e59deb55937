"""`qwc lora`: a LoRA that transformers + peft load unchanged and that lowers the training loss,
resume that continues where a run stopped, chat data with loss on the assistant turns only, and
QA-LoRA whose merge keeps the base's 4-bit codes and scales byte for byte."""

from __future__ import annotations

import copy
import json

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper
from peft import PeftModel
from safetensors.torch import load_file

from qwc.adapter_files import LINEARS, MARKER
from qwc.cli import main
from qwc.config import ModelConfig, sidecar_paths
from qwc.models import lora_train
from qwc.passes.verify import run_steps, session

QUICK = ["--steps", "12", "--seq-len", "48", "--batch", "2", "--rank", "4"]
FOUR_BIT_TOL = 1e-2   # the project's 4-bit tolerance: logits within 1% of their range


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    """A text with structure the tiny byte-level model can learn quickly: a repeated alphabet."""
    p = tmp_path_factory.mktemp("text") / "t.txt"
    p.write_text("".join(f"{c}{c.upper()} " for c in "abcdefghijklmnopqrstuvwxyz") * 60)
    return p


@pytest.fixture(scope="module")
def trained(text, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora") / "ad"
    assert main(["-q", "lora", "tiny", "--data", str(text), "-o", str(out), *QUICK, "--lr", "5e-3"]) == 0
    return out


def test_adapter_is_a_peft_directory_that_lowers_the_loss(trained, tiny_lm, text):
    rec = json.loads((trained / MARKER).read_text())
    assert rec["command"] == "qwc lora" and len(rec["losses"]) == 12
    assert np.mean(rec["losses"][-3:]) < 0.85 * np.mean(rec["losses"][:3])
    cfg = json.loads((trained / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and cfg["lora_alpha"] == 8 and set(cfg["target_modules"]) == set(LINEARS)
    assert cfg["base_model_name_or_path"] == "tiny"
    # transformers + peft load it as it is, and it changes the model
    pm = PeftModel.from_pretrained(copy.deepcopy(tiny_lm.model), str(trained)).eval()
    ids = torch.tensor([[97, 65, 32, 98, 66, 32, 99]])
    with torch.no_grad():
        a, b = tiny_lm.model(ids).logits, pm(ids).logits
    assert (a - b).abs().max() > 0.1
    n_pairs = len(load_file(trained / "adapter_model.safetensors"))
    assert n_pairs == 2 * 7 * tiny_lm.config.num_hidden_layers


def test_merged_export_of_the_trained_adapter_is_peft_merge(trained, tiny_lm, tmp_path):
    out = tmp_path / "m.onnx"
    assert main(["-q", "export", "tiny", "--lora", str(trained), "-o", str(out)]) == 0
    ref = PeftModel.from_pretrained(copy.deepcopy(tiny_lm.model), str(trained)).merge_and_unload().eval()
    ids = np.arange(20, 44)[None]
    with torch.no_grad():
        want = ref(torch.from_numpy(ids)).logits.numpy()
    got = run_steps(session(out), ModelConfig.load(sidecar_paths(out)[0]), [ids])[0]
    assert np.abs(want - got).max() <= 1e-3 * (want.max() - want.min())


def test_resume_continues_an_interrupted_run(text, tmp_path, monkeypatch, capsys):
    """A run stopped after its step-4 checkpoint, resumed, ends where an uninterrupted one does."""
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    args = ["-q", "lora", "tiny", "--data", str(text), *QUICK, "--steps", "8", "--save-every", "4", "--lr", "1e-3"]
    assert main([*args, "-o", str(whole)]) == 0

    real_step, calls = torch.optim.AdamW.step, {"n": 0}

    def stop_at_six(self, *a, **k):
        calls["n"] += 1
        if calls["n"] == 6:
            raise KeyboardInterrupt
        return real_step(self, *a, **k)

    monkeypatch.setattr(torch.optim.AdamW, "step", stop_at_six)
    assert main([*args, "-o", str(cut)]) != 0
    monkeypatch.setattr(torch.optim.AdamW, "step", real_step)
    assert (tmp_path / "cut.ckpt" / "state.pt").is_file() and not cut.exists()
    capsys.readouterr()
    assert main([*args, "-o", str(cut)]) == 2   # a checkpoint is there: --resume or remove it
    assert "--resume" in capsys.readouterr().err
    state = tmp_path / "cut.ckpt" / "state.pt"
    good = state.read_bytes()
    for damaged, words in ((good[: len(good) // 2], "corrupt or truncated"), (b"\x80\x04junk", "corrupt or truncated")):
        state.write_bytes(damaged)   # a damaged checkpoint: one line, the checkpoint kept as it is
        assert main([*args, "-o", str(cut), "--resume"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and words in err[0] and "state.pt" in err[0], err
        assert state.read_bytes() == damaged and not cut.exists()
    state.write_bytes(good)
    assert main([*args, "-o", str(cut), "--resume"]) == 0
    assert not (tmp_path / "cut.ckpt").exists()
    a, b = load_file(whole / "adapter_model.safetensors"), load_file(cut / "adapter_model.safetensors")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)


def test_chat_jsonl_learns_only_the_assistant_turns(tiny_lm, tmp_path):
    from qwc.models.lora_data import read_stream

    convo = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"},
                          {"role": "assistant", "content": "hi there"}, {"role": "user", "content": "again"},
                          {"role": "assistant", "content": "HELLO"}]}
    p = tmp_path / "chat.jsonl"
    p.write_text(json.dumps(convo) + "\n\n" + json.dumps(convo) + "\n")
    ids, mask, _ = read_stream([p], tiny_lm.tokenizer, tiny_lm.config.chat_template)
    learned = tiny_lm.tokenizer.decode([int(t) for t in ids[mask]])
    assert "hi there" in learned and "HELLO" in learned
    assert "Say hi" not in learned and "Be brief" not in learned and "again" not in learned
    assert 0 < mask.mean() < 0.5
    assert main(["-q", "lora", "tiny", "--data", str(p), "-o", str(tmp_path / "ad"), *QUICK, "--seq-len", "16"]) == 0


@pytest.mark.parametrize("extra, words", [
    (["--rank", "0"], ["--rank", "at least 1"]),
    (["--target", "q_proj,c_attn"], ["c_attn", "q_proj"]),
    (["--lr", "-1"], ["--lr"]),
    (["--seq-len", "5000"], ["tokens, fewer than one sequence"]),
    (["--seq-len", "200000"], ["LoRA training needs about", "--seq-len"]),
])
def test_bad_options_are_one_line(text, tmp_path, capsys, extra, words):
    out = tmp_path / "ad"
    args = ["-q", "lora", "tiny", "--data", str(text), "-o", str(out), "--steps", "2"]
    try:
        code = main(args + extra)
    except SystemExit as e:   # argparse's own refusals
        code = e.code
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and all(w in err[0] for w in words), err
    assert not out.exists() and not (tmp_path / "ad.ckpt").exists()


def test_bad_chat_data(tmp_path, capsys):
    p = tmp_path / "c.jsonl"
    p.write_text('{"messages": [{"role": "user", "content": "x"}]}\n{"messages": 3}\n')
    assert main(["lora", "tiny", "--data", str(p), "-o", str(tmp_path / "ad"), "--steps", "1"]) == 2
    assert "c.jsonl:2" in capsys.readouterr().err


def test_output_folder_of_a_user_is_not_replaced(text, tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep")
    assert main(["lora", "tiny", "--data", str(text), "-o", str(out), "--steps", "1"]) == 2
    assert "not an adapter qwc lora wrote" in capsys.readouterr().err and (out / "notes.txt").read_text() == "keep"


# --- QA-LoRA ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def qa_trained(text, tmp_path_factory):
    out = tmp_path_factory.mktemp("qa") / "qa"
    assert main(["-q", "lora", "tiny", "--qa", "--data", str(text), "-o", str(out), *QUICK, "--lr", "5e-3"]) == 0
    return out


def _qa_torch_model(tiny_lm, folder):
    """The unmerged QA-LoRA model in torch: the 4-bit base and the adapter's pooled products."""
    from qwc.models.lora_merge import checkpoint_of

    cfg = json.loads((folder / "adapter_config.json").read_text())
    s = lora_train.LoraSettings(steps=1, rank=cfg["r"], alpha=cfg["lora_alpha"], qa=True)
    model = copy.deepcopy(tiny_lm.model)
    layers = lora_train.attach_qalora(model, checkpoint_of(tiny_lm, "tiny"), s)
    t = load_file(folder / "adapter_model.safetensors")
    with torch.no_grad():
        for p, m in layers.items():
            m.lora_A.copy_(t[f"base_model.model.{p}.lora_A.weight"])
            m.lora_B.copy_(t[f"base_model.model.{p}.lora_B.weight"])
    return model.eval()


def test_qalora_merge_keeps_codes_and_scales_and_the_models_logits(qa_trained, tiny_lm, tmp_path):
    from qwc.models.lora_merge import checkpoint_of, qa_base_blocks

    cfg = json.loads((qa_trained / "adapter_config.json").read_text())
    assert cfg["use_qalora"] and cfg["qalora_group_size"] == 32
    assert load_file(qa_trained / "adapter_model.safetensors")[
        "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"].shape == (4, 320 // 32)
    out = tmp_path / "qa.onnx"
    assert main(["-q", "export", "tiny", "--lora", str(qa_trained), "-o", str(out)]) == 0
    g = onnx.load(str(out))
    inits = {i.name: numpy_helper.to_array(i) for i in g.graph.initializer}
    ckpt = checkpoint_of(tiny_lm, "tiny")
    linears = [n for n in g.graph.node if n.op_type == "MatMulNBits" and "/layers/" in n.name]
    assert len(linears) == 7 * tiny_lm.config.num_hidden_layers
    for n in linears:
        hf = "model." + ".".join(n.name.strip("/").split("/")[1:5]) + ".weight"
        base = qa_base_blocks(ckpt, hf)
        assert np.array_equal(inits[n.input[1]].reshape(base.codes.shape), base.codes), hf
        assert np.array_equal(inits[n.input[2]].reshape(base.scales.shape).view(np.uint32), base.scales.view(np.uint32))
        assert n.input[3] and inits[n.input[3]].dtype == np.float32   # Q4_1's float zero points
    ids = np.arange(3, 40)[None]
    with torch.no_grad():
        want = _qa_torch_model(tiny_lm, qa_trained)(torch.from_numpy(ids)).logits.numpy()
        base_logits = tiny_lm.model(torch.from_numpy(ids)).logits.numpy()
    got = run_steps(session(out), ModelConfig.load(sidecar_paths(out)[0]), [ids])[0]
    span = want.max() - want.min()
    assert np.abs(want - got).max() <= FOUR_BIT_TOL * span
    assert np.abs(want - base_logits).max() > 10 * FOUR_BIT_TOL * span   # the adapter is not a no-op


def test_qalora_merge_is_exact_but_for_the_minimums_float16(tiny_lm):
    """The merged block is the base's codes and scale with m moved by the adapter's block sum,
    rounded once to float16: each dequantized weight is within half a float16 ulp of m of the
    unmerged weight plus the adapter's per-weight term."""
    from qwc.adapter_files import LoraPair
    from qwc.models.gguf_blocks import dequantize
    from qwc.models.lora_merge import block_minimums, checkpoint_of, qa_base_blocks, qa_per_weight, shift_minimums

    ckpt = checkpoint_of(tiny_lm, "tiny")
    name = "model.layers.1.mlp.down_proj.weight"
    base = qa_base_blocks(ckpt, name)
    rng = np.random.default_rng(0)
    pair = LoraPair(rng.standard_normal((4, 10)).astype(np.float32), rng.standard_normal((128, 4)).astype(np.float32), 0.05)
    add = qa_per_weight([pair], 320)
    merged = shift_minimums(base, add, name)
    assert np.array_equal(merged.codes, base.codes) and np.array_equal(merged.scales, base.scales)
    exact = dequantize(base) + np.repeat(add, 32, axis=1)
    m = block_minimums(merged)
    ulp = np.abs(np.spacing(m.astype(np.float16)).astype(np.float32))
    assert (np.abs(dequantize(merged) - exact) <= np.repeat(ulp, 32, axis=1) / 2 + 1e-6).all()


def test_qalora_on_another_base_is_refused(qa_trained, tmp_path, capsys):
    """The same shapes, other weights: the adapter's recorded 4-bit base does not match."""
    from qwc.models.presets import load_preset

    other = load_preset("tiny", seed=1)
    src = tmp_path / "hf"
    other.model.save_pretrained(src)
    other.tokenizer.save(str(src / "tokenizer.json"))
    assert main(["export", str(src), "--lora", str(qa_trained), "-o", str(tmp_path / "x.onnx")]) == 2
    assert "trained on other 4-bit blocks" in capsys.readouterr().err
    assert not (tmp_path / "x.onnx").exists()


def test_qalora_group_other_than_the_block_is_refused(qa_trained, tmp_path, capsys):
    bad = tmp_path / "g64"
    bad.mkdir()
    for f in qa_trained.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    c = json.loads((bad / "adapter_config.json").read_text())
    c["qalora_group_size"] = 64
    (bad / "adapter_config.json").write_text(json.dumps(c))
    assert main(["export", "tiny", "--lora", str(bad), "-o", str(tmp_path / "x.onnx")]) == 2
    err = capsys.readouterr().err
    assert "qalora_group_size must be 32" in err and not (tmp_path / "x.onnx").exists()
