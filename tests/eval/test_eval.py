"""`qwc eval`: llama.cpp's perplexity protocol and PMI multiple choice, checked on scorers with
known answers, and the same model scored through torch, onnxruntime and the compiled artifact."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from qwc.cli import main
from qwc.eval import metrics
from qwc.eval.choices import build_items, sentences
from qwc.eval.scorers import Scorer


class _Tok:
    """Characters as token ids: 'a' -> 0 ... (enough to drive the metrics)."""

    class _Enc:
        def __init__(self, ids):
            self.ids = ids

    def encode(self, text, add_special_tokens=False):
        return self._Enc([ord(c) % 32 for c in text])


class TableScorer(Scorer):
    """Logits depend only on the current token: log p(next | cur) = table[cur]."""

    backend = "table"
    max_ctx = 4096

    def __init__(self, table):
        super().__init__("table")
        self.tokenizer, self.table, self.calls = _Tok(), table, []

    def logits(self, ids):
        self.calls.append(len(ids))
        return self.table[np.asarray(ids)]


def test_perplexity_follows_llama_cpp_protocol():
    rng = np.random.default_rng(0)
    table = rng.standard_normal((32, 32))
    lp = table - np.log(np.exp(table).sum(1, keepdims=True))
    text = "".join(chr(97 + int(x)) for x in rng.integers(0, 26, 1000))
    s = TableScorer(table)
    r = metrics.perplexity(s, text, ctx=64, chunks=5)
    ids = [ord(c) % 32 for c in text]
    nll = [-lp[ids[c * 64 + j], ids[c * 64 + j + 1]] for c in range(5) for j in range(32, 63)]
    assert s.calls == [64] * 5                       # fresh, non-overlapping chunks
    assert r.scored_tokens == 5 * 31
    assert r.ppl == pytest.approx(math.exp(np.mean(nll)), rel=1e-12)
    assert r.ppl_err == pytest.approx(r.ppl * np.std(nll, ddof=1) / math.sqrt(len(nll)), rel=1e-9)
    assert metrics.perplexity(s, text, ctx=64).chunks == 1000 // 64   # default: every whole chunk


def test_perplexity_errors():
    s = TableScorer(np.zeros((32, 32)))
    with pytest.raises(Exception, match="fewer than one chunk"):
        metrics.perplexity(s, "abc", ctx=64)
    with pytest.raises(Exception, match="even number"):
        metrics.perplexity(s, "abc" * 100, ctx=7)
    s.max_ctx = 32
    with pytest.raises(Exception, match="exceeds the model's context"):
        metrics.perplexity(s, "abc" * 100, ctx=64)


def test_multiple_choice_pmi_removes_the_prior():
    # token 'q' (context end) strongly predicts 'x'; after the neutral "\n" 'y' is the likely one
    table = np.zeros((32, 32))
    table[ord("q") % 32, ord("x") % 32] = 3.0
    table[ord("\n") % 32, ord("y") % 32] = 6.0
    table[ord("q") % 32, ord("y") % 32] = 4.0
    s = TableScorer(table)
    items = [{"context": "q", "options": ["x", "y", "z"], "answer": 0}]
    r = metrics.multiple_choice(s, items)
    assert (r.acc_ll, r.acc_pmi) == (0.0, 1.0)   # y is likelier, but x gains most from the context
    assert r.chance == pytest.approx(1 / 3)


def test_read_choices_rejects_bad_lines(tmp_path):
    p = tmp_path / "c.jsonl"
    p.write_text(json.dumps({"context": "a", "options": ["b", "c"], "answer": 0}) + "\n"
                 + json.dumps({"context": "a", "options": ["b"], "answer": 3}) + "\n")
    with pytest.raises(Exception, match=r"c.jsonl:2: expected"):
        metrics.read_choices(p)


def test_choice_builder_is_deterministic_and_sound():
    rng = np.random.default_rng(1)
    words = "the lady walked to the house and saw a letter from her sister in town".split()
    paras = []
    for _ in range(120):
        sents = [" ".join(rng.choice(words, size=rng.integers(6, 20))).capitalize() + "." for _ in range(5)]
        paras.append(" ".join(sents))
    text = "CHAPTER 1\n\n" + "\n\n".join(paras)
    assert all(not s.startswith("CHAPTER") for _, s in sentences(text))
    a = build_items(text, n=40, seed=3)
    assert a == build_items(text, n=40, seed=3) and a != build_items(text, n=40, seed=4)
    flat = [s for _, s in sentences(text)]
    for it in a:
        assert len(it["options"]) == 4 and len(set(it["options"])) == 4
        true = it["options"][it["answer"]].strip()
        i = next(k for k in range(3, len(flat)) if flat[k] == true and " ".join(flat[k - 3:k]) == it["context"])
        assert i >= 3
        lens = [len(o) for o in it["options"]]
        assert max(lens) - min(lens) <= 0.5 * max(lens)   # similar lengths
    assert sorted({it["answer"] for it in a}) == [0, 1, 2, 3]


@pytest.mark.slow
def test_same_model_through_torch_onnxruntime_and_compiled(tmp_path, capsys):
    """A QAT'd tiny model sits on the Q4_0 grid, so the HF dir (torch), its canonical graph
    (onnxruntime) and its artifact (qwc) are the same model: perplexities agree within 0.5%."""
    text = tmp_path / "t.txt"
    rng = np.random.default_rng(0)
    text.write_text(" ".join(rng.choice("the cat sat on a mat and dog ran home .".split(), size=3000)))
    hf, onnx_, q4, art = (tmp_path / n for n in ("hf", "m.onnx", "m.q4.onnx", "m.qwc"))
    assert main(["-q", "qat", "tiny", "--data", str(text), "--steps", "4", "--seq-len", "32", "--batch", "2",
                 "--lr", "1e-3", "--quantize-embedding", "-o", str(hf)]) == 0
    assert main(["-q", "export", str(hf), "-o", str(onnx_)]) == 0
    assert main(["-q", "optimize", str(onnx_), "-o", str(q4)]) == 0
    capsys.readouterr()
    assert main(["-q", "compile", str(q4), "--target", "host", "--act-bits", "32", "-o", str(art)]) == 0
    ppl = {}
    for m in (hf, q4, art):
        assert main(["-q", "eval", str(m), "--ppl", str(text), "--ctx", "128", "--chunks", "6", "--json"]) == 0
        r = json.loads(capsys.readouterr().out)
        ppl[r["backend"]] = r["perplexity"]["ppl"]
    assert set(ppl) == {"torch", "onnxruntime", "qwc"}
    assert math.isfinite(ppl["torch"]) and ppl["torch"] > 1
    for k in ("onnxruntime", "qwc"):
        assert abs(ppl[k] / ppl["torch"] - 1) < 0.005, ppl
    print(ppl)


def test_eval_cli_errors(tmp_path, capsys):
    assert main(["-q", "eval", "tiny"]) == 2
    assert "give --ppl" in capsys.readouterr().err
    assert main(["-q", "eval", "tiny", "--ppl", str(tmp_path / "none.txt")]) == 2
    assert "no such text file" in capsys.readouterr().err
    assert main(["-q", "eval", str(tmp_path / "none.onnx"), "--ppl", __file__]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(["-q", "eval", "tiny", "--ppl", "austen:nonesuch"]) == 2
    assert "unknown novel" in capsys.readouterr().err
