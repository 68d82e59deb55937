"""LoRA adapters served unmerged from an artifact's adapter slots (`qwc compile
--max-lora-rank`): against onnxruntime on the canonical graph with each linear's LoRA product
written as plain MatMuls; batched steps that mix adapters against each sequence run alone;
prefix reuse kept per adapter; bad adapters and options refused in one line."""

import shutil

import numpy as np
import onnx
import pytest
import torch
from onnx import helper, numpy_helper
from peft import LoraConfig
from safetensors.torch import load_file, save_file

from qwc.adapter_files import LINEARS, linear_shapes
from qwc.cli import main
from qwc.compiler.compile import compile_file
from qwc.compiler.lora_slots import adapted_linears
from qwc.config import ModelConfig, sidecar_paths
from qwc.errors import QwcError
from qwc.passes.verify import run_steps, session
from qwc.runtime.adapters import load_adapters
from qwc.runtime.engine import Engine
from qwc.runtime.sampling import SamplingParams

from conftest import one_line, random_peft_adapter

REL_TOL = 1e-4   # float activations and cache: the slots' sums against onnxruntime's MatMuls


def _peft(model, folder, r, target=LINEARS, seed=1):
    random_peft_adapter(model, folder, r=r, seed=seed, target=target)
    return folder


@pytest.fixture(scope="module")
def adapters(tiny_lm, tmp_path_factory):
    d = tmp_path_factory.mktemp("adapters")
    return {"a": _peft(tiny_lm.model, d / "a", 4), "b": _peft(tiny_lm.model, d / "b", 12, ("q_proj", "down_proj"), 2)}


@pytest.fixture(scope="module")
def slots_art(tiny_q4, tmp_path_factory):
    out = tmp_path_factory.mktemp("slots") / "tiny.qwc"
    # onnxruntime's arithmetic (float activations and cache), batched steps
    compile_file(tiny_q4, "host", out, act_bits=32, kv_type="f32", max_batch=4, max_lora_rank=16)
    return out


def _reference_graph(q4, adapter, out):
    """The canonical graph with y + (x·Aᵀ)·(s·B)ᵀ after every adapted linear, in plain ONNX."""
    cfg = ModelConfig.load(sidecar_paths(q4)[0])
    m = onnx.load(str(q4))
    g = m.graph
    for node, name in adapted_linears(list(g.node), linear_shapes(cfg)):
        p = adapter.pairs.get(name)
        if p is None:
            continue
        y = node.output[0]
        node.output[0] = f"{y}_base"
        a = numpy_helper.from_array(np.ascontiguousarray(p.a.T, np.float32), f"{name}.lora_a")
        b = numpy_helper.from_array(np.ascontiguousarray((p.b * p.scale).T, np.float32), f"{name}.lora_b")
        g.initializer.extend([a, b])
        at = list(g.node).index(node) + 1
        for j, n in enumerate([helper.make_node("MatMul", [node.input[0], a.name], [f"{y}_t"]),
                               helper.make_node("MatMul", [f"{y}_t", b.name], [f"{y}_d"]),
                               helper.make_node("Add", [f"{y}_base", f"{y}_d"], [y])]):
            g.node.insert(at + j, n)
    onnx.save(m, str(out))
    for src, dst in zip(sidecar_paths(q4), sidecar_paths(out)):
        if src.is_file():
            shutil.copy(src, dst)
    return out


def _steps(cfg, seed=0):
    """A 200-token prompt (enough work that the LoRA kernels run in parallel: kernels/lora.py
    SERIAL_WORK) and three decode steps (little enough that they run serially)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, cfg.vocab_size, (1, 200))] + [rng.integers(0, cfg.vocab_size, (1, 1)) for _ in range(3)]


def _engine_logits(eng, steps, slot):
    eng.reset()
    eng.seq.adapter = slot
    return [eng.prefill(steps[0][0]).copy()] + [eng.decode(int(s[0, 0])).copy() for s in steps[1:]]


def test_adapter_slots_match_onnxruntime(slots_art, tiny_q4, adapters, tmp_path):
    """Each slot's prefill and decode logits are onnxruntime's on the canonical graph with that
    adapter's product added after each linear; slot 0 is the base, and an adapter changes them."""
    eng = Engine(slots_art, ctx=256)
    cfg = eng.model
    loaded = load_adapters([("a", str(adapters["a"])), ("b", f"{adapters['b']}:0.5")], cfg)
    eng.load_adapters(loaded)
    steps = _steps(cfg)
    base = [r[0, -1] for r in run_steps(session(str(tiny_q4)), cfg, steps, ctx=256)]
    for slot, (_, ad) in enumerate([(None, None), *loaded]):
        ref = base if ad is None else [r[0, -1] for r in run_steps(
            session(str(_reference_graph(tiny_q4, ad, tmp_path / f"ref{slot}.onnx"))), cfg, steps, ctx=256)]
        got = _engine_logits(eng, steps, slot)
        for r, x in zip(ref, got):
            assert np.abs(r - x).max() <= REL_TOL * np.abs(r).max()
        if ad is not None:
            assert np.abs(ref[0] - base[0]).max() > 100 * REL_TOL * np.abs(base[0]).max()   # the adapter matters


def test_batched_steps_mix_adapters(slots_art, adapters):
    """One decode_batch or step call whose rows run the base and two adapters gives each row the
    logits it gets alone (rows grouped by nothing: each token gathers its own adapter)."""
    eng = Engine(slots_art, ctx=128)
    eng.load_adapters(load_adapters([("a", str(adapters["a"])), ("b", str(adapters["b"]))], eng.model))
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, eng.vocab_size, 40 + 10 * i) for i in range(3)]   # one step: parallel kernels
    nxt = [rng.integers(0, eng.vocab_size, 3) for _ in range(3)]
    alone = []
    for slot, p, t in zip((0, 1, 2), prompts, nxt):
        eng.reset()
        eng.seq.adapter = slot
        alone.append([eng.prefill(p).copy()] + [eng.decode(int(x)).copy() for x in t])
    seqs = list(eng.pool(4).seqs[:3])
    order = [1, 2, 0]   # row r runs sequence order[r] of `alone`: its prompt and its slot
    for s, o in zip(seqs, order):
        s.adapter = o
    got = [[x.copy()] for x in eng.step([(s, prompts[o]) for s, o in zip(seqs, order)])]
    for j in range(3):
        toks = [int(nxt[o][j]) for o in order]
        outs = (eng.decode_many(toks, seqs) if j % 2 == 0
                else eng.step([(s, np.array([t])) for s, t in zip(seqs, toks)]))
        for g, o in zip(got, outs):
            g.append(o.copy())
    for r, o in enumerate(order):
        for a, b in zip(alone[o], got[r]):
            assert np.abs(a - b).max() <= 1e-5 * np.abs(a).max()


def test_prefix_reuse_is_kept_per_adapter(slots_art, adapters):
    """A prompt's cache computed with one adapter is reused by the same adapter only: the base
    after it prefills the whole prompt and says what a fresh engine says."""
    eng = Engine(slots_art, ctx=128)
    eng.load_adapters(load_adapters([("a", str(adapters["a"]))], eng.model))
    prompt = list(range(3, 40))
    greedy = SamplingParams()
    with_a = "".join(eng.generate(prompt, 6, greedy, adapter="a"))
    again = "".join(eng.generate(prompt, 6, greedy, adapter="a"))
    assert again == with_a and eng.stats["cached_tokens"] > 0
    base = "".join(eng.generate(prompt, 6, greedy))
    assert eng.stats["cached_tokens"] == 0
    fresh = Engine(slots_art, ctx=128)
    assert base == "".join(fresh.generate(prompt, 6, greedy)) != with_a
    with pytest.raises(QwcError, match="no adapter named 'zz'"):
        list(eng.generate(prompt, 2, greedy, adapter="zz"))


def test_qwc_run_with_an_adapter(slots_art, adapters, capsys):
    """`qwc run --lora PATH:SCALE` prints what Engine.generate gives with that adapter."""
    eng = Engine(slots_art, ctx=512)
    eng.load_adapters(load_adapters([("x", f"{adapters['b']}:0.5")], eng.model))
    want = "".join(eng.generate("Hello", 8, SamplingParams(), adapter="x"))
    capsys.readouterr()
    assert main(["-q", "run", str(slots_art), "--prompt", "Hello", "--max-new-tokens", "8",
                 "--lora", f"{adapters['b']}:0.5"]) == 0
    assert capsys.readouterr().out == "Hello" + want + "\n"


def test_refused_adapters_and_options(slots_art, tiny_host_artifact, adapters, tiny_lm, capsys, tmp_path):
    run = ["-q", "run", str(slots_art), "--prompt", "Hi", "--max-new-tokens", "1"]
    one_line(capsys, main(["-q", "run", str(tiny_host_artifact), "--prompt", "Hi", "--lora", str(adapters["a"])]),
             "has no adapter slots")
    one_line(capsys, main(run + ["--lora", str(adapters["b"]), "--max-lora-rank", "8"]),
             "has rank 12, above --max-lora-rank 8")
    one_line(capsys, main(run + ["--lora", str(adapters["a"]), "--max-lora-rank", "32"]),
             "adapter slots take ranks up to 16")
    big = _peft(tiny_lm.model, tmp_path / "big", 20, ("q_proj",))
    one_line(capsys, main(run + ["--lora", str(big)]), "has rank 20, above --max-lora-rank 16")
    one_line(capsys, main(run + ["--max-lora-rank", "8"]), "give --lora")
    one_line(capsys, main(run + ["--lora", str(tmp_path / "missing")]), "no such adapter")
    other = _peft(tiny_lm.model, tmp_path / "other", 4, ("q_proj",))   # one B too tall: another model's
    t = load_file(str(other / "adapter_model.safetensors"))
    key = next(k for k in t if k.endswith("lora_B.weight"))
    t[key] = torch.ones(t[key].shape[0] + 2, t[key].shape[1])
    save_file(t, str(other / "adapter_model.safetensors"))
    one_line(capsys, main(run + ["--lora", str(other)]), "do not fit the base's")
    serve = ["-q", "serve", str(slots_art), "--port", "0"]
    one_line(capsys, main(serve + ["--lora", str(adapters["a"])]), "expected NAME=PATH")
    one_line(capsys, main(serve + ["--lora", f"tiny={adapters['a']}"]), "is the base model's name")
    one_line(capsys, main(serve + ["--lora", f"a={adapters['a']}", "--lora", f"a={adapters['b']}"]),
             "the name is given twice")
    with pytest.raises(SystemExit):
        main(["compile", "x.onnx", "-o", str(tmp_path / "o.qwc"), "--max-lora-rank", "0"])


def _qa_adapter(cfg, folder, r=4, seed=5):
    """A QA-LoRA adapter in peft's format (use_qalora, A [r, in / 32]), written by hand."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    tensors = {}
    for name, (out, k) in linear_shapes(cfg).items():
        module = "base_model.model." + name.removesuffix(".weight")
        tensors[f"{module}.lora_A.weight"] = rng.normal(0, 0.3, (r, k // 32)).astype(np.float32)
        tensors[f"{module}.lora_B.weight"] = rng.normal(0, 0.3, (out, r)).astype(np.float32)
    folder.mkdir()
    LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(LINEARS), use_qalora=True,
               qalora_group_size=32).save_pretrained(str(folder))
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


def test_qa_lora_adapter_served_unmerged(slots_art, tiny_q4, tmp_path):
    """A QA-LoRA adapter in a slot: onnxruntime's graph pools each block of 32 inputs as peft
    does (the mean times in / 32) before A; the slots spread A over the inputs instead."""
    eng = Engine(slots_art, ctx=256)
    cfg = eng.model
    folder = _qa_adapter(cfg, tmp_path / "qa")
    (ad,) = [a for _, a in load_adapters([("qa", str(folder))], cfg)]
    assert ad.kind == "qalora"
    eng.load_adapters([("qa", ad)])
    m = onnx.load(str(tiny_q4))
    g = m.graph
    for node, name in adapted_linears(list(g.node), linear_shapes(cfg)):
        p, k = ad.pairs[name], ad.pairs[name].a.shape[1] * 32
        y = node.output[0]
        node.output[0] = f"{y}_base"
        g.initializer.extend([numpy_helper.from_array(np.array([0, 0, k // 32, 32], np.int64), f"{name}.grp"),
                              numpy_helper.from_array(np.array([-1], np.int64), f"{name}.axis"),
                              numpy_helper.from_array(np.array([k / 32], np.float32), f"{name}.nb"),
                              numpy_helper.from_array(np.ascontiguousarray(p.a.T, np.float32), f"{name}.a"),
                              numpy_helper.from_array(np.ascontiguousarray((p.b * p.scale).T, np.float32), f"{name}.b")])
        at = list(g.node).index(node) + 1
        for j, n in enumerate([
                helper.make_node("Reshape", [node.input[0], f"{name}.grp"], [f"{y}_g"]),
                helper.make_node("ReduceMean", [f"{y}_g", f"{name}.axis"], [f"{y}_m"], keepdims=0),
                helper.make_node("Mul", [f"{y}_m", f"{name}.nb"], [f"{y}_p"]),
                helper.make_node("MatMul", [f"{y}_p", f"{name}.a"], [f"{y}_t"]),
                helper.make_node("MatMul", [f"{y}_t", f"{name}.b"], [f"{y}_d"]),
                helper.make_node("Add", [f"{y}_base", f"{y}_d"], [y])]):
            g.node.insert(at + j, n)
    ref_path = tmp_path / "qa_ref.onnx"
    onnx.save(m, str(ref_path))
    for src, dst in zip(sidecar_paths(tiny_q4), sidecar_paths(ref_path)):
        if src.is_file():
            shutil.copy(src, dst)
    steps = _steps(cfg, seed=1)
    ref = [r[0, -1] for r in run_steps(session(str(ref_path)), cfg, steps, ctx=256)]
    base = [r[0, -1] for r in run_steps(session(str(tiny_q4)), cfg, steps, ctx=256)]
    for r, x in zip(ref, _engine_logits(eng, steps, 1)):
        assert np.abs(r - x).max() <= REL_TOL * np.abs(r).max()
    assert np.abs(ref[0] - base[0]).max() > 100 * REL_TOL * np.abs(base[0]).max()


def test_slots_refused_on_rescaled_linear_inputs(tiny_onnx, capsys, tmp_path):
    """--fold-norm-gains (and --awq) scale the inputs an adapter's A reads: compiling adapter
    slots on such a graph is refused in one line, with nothing written."""
    graph = tmp_path / "folded.onnx"
    assert main(["-q", "optimize", str(tiny_onnx), "--fold-norm-gains", "-o", str(graph)]) == 0
    capsys.readouterr()
    out = tmp_path / "folded.qwc"
    one_line(capsys, main(["-q", "compile", str(graph), "--max-lora-rank", "16", "-o", str(out)]),
             "optimized with --fold-norm-gains")
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
