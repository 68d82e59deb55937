"""QAT: the torch fake quantizer equals the numpy one bit for bit; a short run leaves every
quantized weight on the Q4_0 grid, resumes after an interruption, and optimizes losslessly."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F

from qwc.cli import main
from qwc.config import sidecar_paths
from qwc.models import qat
from qwc.models.export import export_onnx
from qwc.models.hf import load_hf_dir
from qwc.models.presets import load_preset
from qwc.passes.options import PassOptions
from qwc.passes.pipeline import optimize, save_graph
from qwc.passes.verify import random_steps, run_steps, session
from qwc.q4 import fake_quantize_q4_0, quantize_q4_0


def _edge_blocks() -> np.ndarray:
    rows = [
        np.zeros(32),                                   # all zero: d = 0
        np.full(32, 0.5), np.full(32, -0.5),            # all equal, both signs
        np.r_[1.0, -1.0, np.zeros(30)],                 # tie in magnitude: the first wins
        np.r_[-1.0, 1.0, np.zeros(30)],
        np.linspace(-1, 1, 32), np.linspace(1, -1, 32),
        np.r_[1e-30, np.zeros(31)],                     # a denormal-ish scale after fp16 rounding
        np.r_[7e4, -3e4, np.ones(30)],                  # beyond fp16 range: d rounds to inf
        (np.arange(32) - 16) / 16 * 0.0625,             # exact grid values
    ]
    return np.array(rows, np.float32)


@pytest.mark.parametrize("shape", [(7, 32), (5, 96), (3, 50), (16, 320)])
def test_torch_fake_quant_equals_numpy_bitwise(shape):
    rng = np.random.default_rng(sum(shape))
    for w in (rng.standard_normal(shape).astype(np.float32),
              (rng.standard_normal(shape) * 1e-3).astype(np.float32),
              rng.laplace(size=shape).astype(np.float32)):
        got = qat.fake_quantize_q4_0(torch.from_numpy(w)).numpy()
        np.testing.assert_array_equal(got.view(np.uint32), fake_quantize_q4_0(w).view(np.uint32))


def test_torch_fake_quant_edge_blocks():
    w = _edge_blocks()
    with np.errstate(over="ignore", invalid="ignore"):
        ref = fake_quantize_q4_0(w)
    got = qat.fake_quantize_q4_0(torch.from_numpy(w)).numpy()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
    np.testing.assert_array_equal(got[~np.isnan(got)], ref[~np.isnan(ref)])


def test_straight_through_gradient():
    w = torch.randn(4, 64, requires_grad=True)
    y = qat.ste_q4_0(w)
    assert torch.equal(y.detach(), qat.fake_quantize_q4_0(w.detach()))
    (y * torch.arange(64.0)).sum().backward()
    assert torch.equal(w.grad, torch.arange(64.0).expand(4, 64))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    p = tmp_path_factory.mktemp("corpus") / "text.txt"
    rng = np.random.default_rng(0)
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "home", "."]
    p.write_text(" ".join(rng.choice(words, size=4000)))
    return p


def _qat(corpus, out, *extra):
    return main(["-q", "qat", "tiny", "--data", str(corpus), "--steps", "6", "--seq-len", "32", "--batch", "2",
                 "--lr", "1e-3", "--fake-quant-after", "2", "--quantize-embedding", *extra, "-o", str(out)])


@pytest.fixture(scope="module")
def qat_dir(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("qat") / "tiny-qat"
    assert _qat(corpus, out) == 0
    return out


def test_qat_leaves_weights_on_the_grid(qat_dir):
    lm = load_hf_dir(qat_dir)
    state = lm.model.state_dict()
    quantized = [k for k in state if k.endswith("proj.weight")] + ["model.embed_tokens.weight"]
    assert len(quantized) == 2 * 7 + 1
    for k in quantized:
        w = state[k].numpy()
        np.testing.assert_array_equal(fake_quantize_q4_0(w), w, err_msg=k)
        q, d = quantize_q4_0(w)
        assert len(np.unique(q)) > 8, k  # really trained values, not a degenerate grid
    for k in state:
        if k.endswith(("input_layernorm.weight", "post_attention_layernorm.weight")):
            assert torch.all(state[k] == 1), k  # gains folded into the linears
    rec = json.loads((qat_dir / "qwc_qat.json").read_text())
    assert len(rec["losses"]) == 6 and rec["final_loss"] < rec["losses"][0]
    assert not (qat_dir.parent / "tiny-qat.ckpt").exists()


def test_fake_quant_after_all_steps_is_a_float_fine_tune(corpus, tmp_path):
    """--fake-quant-after = --steps (bench/accuracy.py's float control): trained, but neither
    snapped to the grid nor with its norm gains folded, so it scores as a float model. The
    tiny preset's gains are random (std ~0.3): folding would scale the linears' columns by
    0.5-1.5, where 4 Adam steps at lr 1e-3 move any parameter by at most ~4e-3."""
    out = tmp_path / "ft"
    assert main(["-q", "qat", "tiny", "--data", str(corpus), "--steps", "4", "--seq-len", "32", "--batch", "2",
                 "--lr", "1e-3", "--fake-quant-after", "4", "-o", str(out)]) == 0
    state = load_hf_dir(out).model.state_dict()
    base = load_preset("tiny").model.state_dict()
    linears = [k for k in state if k.endswith("proj.weight")]
    assert len(linears) == 2 * 7
    for k in linears:
        w = state[k].numpy()
        assert not np.array_equal(fake_quantize_q4_0(w), w), k        # off the grid
        assert 0 < (state[k] - base[k]).abs().max() < 0.01, k         # trained, not folded
    for k in (k for k in state if k.endswith(("input_layernorm.weight", "post_attention_layernorm.weight"))):
        assert (state[k] - base[k]).abs().max() < 0.01, k              # the gains stay in the norms


@pytest.mark.slow
def test_optimize_after_qat_matches_the_torch_model(qat_dir, tmp_path):
    lm = load_hf_dir(qat_dir)
    src = export_onnx(lm, tmp_path / "m.onnx")
    q4 = optimize(onnx.load(str(src)), PassOptions(config=lm.config))
    assert sum(n.op_type == "MatMulNBits" for n in q4.graph.node) == 2 * 7 + 1
    save_graph(q4, tmp_path / "m.q4.onnx", lm.config, sidecar_paths(src)[1])
    steps = random_steps(lm.config, prompt=9, decode=4)
    ref = run_steps(session(src), lm.config, steps)
    got = run_steps(session(tmp_path / "m.q4.onnx"), lm.config, steps)
    for a, b in zip(ref, got):
        np.testing.assert_allclose(b, a, atol=1e-4, rtol=0)


def test_qat_resumes_where_it_stopped(corpus, tmp_path, monkeypatch, capsys):
    whole = tmp_path / "whole"
    assert _qat(corpus, whole, "--save-every", "2") == 0

    real = qat._batch

    def interrupt_at_step_5(tokens, s, step):
        if step == 4:
            raise KeyboardInterrupt
        return real(tokens, s, step)

    cut = tmp_path / "cut"
    monkeypatch.setattr(qat, "_batch", interrupt_at_step_5)
    assert _qat(corpus, cut, "--save-every", "2") == 130
    assert not cut.exists() and (tmp_path / "cut.ckpt" / "state.pt").is_file()
    monkeypatch.setattr(qat, "_batch", real)
    progress_lines = []
    monkeypatch.setattr("qwc.progress.info", progress_lines.append)
    assert _qat(corpus, cut, "--save-every", "2") == 0
    assert any("resuming from step 4" in line for line in progress_lines)
    a, b = load_hf_dir(whole).model.state_dict(), load_hf_dir(cut).model.state_dict()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-6, msg=k)

    # a different setting must not silently continue someone else's run
    assert _qat(corpus, cut, "--save-every", "2") == 0  # finished runs leave no checkpoint
    (tmp_path / "other.ckpt").mkdir()
    torch.save({"fingerprint": "x"}, tmp_path / "other.ckpt" / "state.pt")
    assert _qat(corpus, tmp_path / "other") == 2
    assert "holds a run with other settings" in capsys.readouterr().err


def test_distillation_loss_is_scaled_kl():
    torch.manual_seed(0)
    s, t = torch.randn(2, 5, 11), torch.randn(2, 5, 11)
    assert qat.distillation_loss(t, t, 2.0).abs() < 1e-6
    ref = F.kl_div(F.log_softmax(s / 2, -1), F.log_softmax(t / 2, -1), log_target=True, reduction="none").sum(-1).mean()
    torch.testing.assert_close(qat.distillation_loss(s, t, 2.0), 4 * ref)


def test_distillation_from_the_float_model_lowers_the_kd_loss(corpus, tmp_path):
    out = tmp_path / "kd"
    assert main(["-q", "qat", "tiny", "--data", str(corpus), "--data", str(corpus), "--steps", "16",
                 "--seq-len", "32", "--batch", "2", "--lr", "3e-4", "--fake-quant-after", "0",
                 "--quantize-embedding", "--teacher", "--kd-weight", "1", "-o", str(out)]) == 0
    rec = json.loads((out / "qwc_qat.json").read_text())
    assert rec["settings"]["teacher"] == "tiny" and rec["settings"]["kd_weight"] == 1.0
    assert len(rec["data"]) == 2

    # on held windows of the text: the KL from the float teacher to the distilled student is
    # well below the KL to the same model quantized without training (plain PTQ)
    teacher = load_preset("tiny")
    ptq = load_preset("tiny").model
    qat.fold_norm_gains(ptq)
    qat.FakeQuant(qat.quantized_modules(ptq, embedding=True), 32).snap()
    student = load_hf_dir(out).model
    ids = torch.tensor(teacher.tokenizer.encode(corpus.read_text()).ids[:8 * 64]).reshape(8, 64)
    with torch.no_grad():
        t = teacher.model(ids).logits
        kl_ptq = qat.distillation_loss(ptq(ids).logits, t, 1.0)
        kl_kd = qat.distillation_loss(student(ids).logits, t, 1.0)
    assert kl_ptq > 0.05 and kl_kd < 0.7 * kl_ptq, (kl_ptq, kl_kd)


@pytest.mark.parametrize("args, message", [
    (["--steps", "2", "--kd-weight", "0.5"], "need --teacher"),
    (["--steps", "2", "--teacher", "--kd-weight", "1.5"], "--kd-weight 1.5: must be between 0 and 1"),
    (["--steps", "2", "--teacher", "--kd-temperature", "0"], "--kd-temperature 0.0: must be a positive"),
    (["--steps", "2", "--teacher", "no-such-model"], "neither a preset"),
    (["--steps", "0"], "--steps must be at least 1"),
    (["--steps", "2", "--group-size", "64"], "only 32"),
    (["--steps", "2", "--seq-len", "100000"], "fewer than one sequence"),
])
def test_qat_bad_settings(corpus, tmp_path, capsys, args, message):
    assert main(["-q", "qat", "tiny", "--data", str(corpus), *args, "-o", str(tmp_path / "o")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_qat_never_replaces_a_folder_it_did_not_write(corpus, qat_dir, tmp_path, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    assert _qat(corpus, mine) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "qwc replaces only what it wrote" in err[0]
    assert (mine / "notes.txt").read_text() == "mine"
    own = tmp_path / "own"
    shutil.copytree(qat_dir, own)
    assert qat.foreign_files(own) is None            # its own output: replaceable
    (own / "notes.txt").write_text("mine")
    assert "notes.txt" in qat.foreign_files(own)     # with a user's file in it: not
