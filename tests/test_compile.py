"""`qwc compile` + the runtime on the host: the compiled module against onnxruntime on the
same canonical graph, and the artifact's self-checks."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from unittest import mock

import numpy as np
import onnx
import pytest

from qwc.cli import main
from qwc.compiler import targets
from qwc.compiler.compile import compile_file
from qwc.config import sidecar_paths
from qwc.passes.verify import run_steps, session
from qwc.runtime.engine import Engine


@pytest.fixture(scope="session")
def tiny_host_artifact(tiny_q4, tmp_path_factory):
    out = tmp_path_factory.mktemp("art") / "tiny.qwc"
    compile_file(tiny_q4, "host", out, act_bits=32)   # float activations: onnxruntime's arithmetic
    return out


def _greedy_against_onnxruntime(art, q4, cfg, prompt, n_steps: int, ctx: int):
    """Greedy generation on the compiled module; onnxruntime on the canonical graph `q4` is fed
    the same tokens, and every step's logits agree within 1e-3 of their range. Returns the
    engine, the references and the compiled module's logits."""
    eng = Engine(art, ctx=ctx)
    logits = [eng.prefill(prompt[0])]
    steps = [prompt]
    for _ in range(n_steps):
        tok = int(logits[-1].argmax())
        steps.append(np.array([[tok]]))
        logits.append(eng.decode(tok))
    ref = [r[0, -1] for r in run_steps(session(str(q4)), cfg, steps, ctx=ctx)]
    for r, g in zip(ref, logits):
        assert np.abs(r - g).max() / np.abs(r).max() < 1e-3
    return eng, ref, logits


def test_host_matches_onnxruntime_prefill_and_16_decode_steps(tiny_q4, tiny_host_artifact, tiny_lm):
    """Greedy generation on the compiled module against onnxruntime on the canonical graph."""
    prompt = np.random.default_rng(11).integers(0, 259, (1, 9))
    eng, ref, logits = _greedy_against_onnxruntime(tiny_host_artifact, tiny_q4, tiny_lm.config, prompt, 16, 64)
    assert [int(r.argmax()) for r in ref] == [int(g.argmax()) for g in logits]
    eng.reset()
    assert np.array_equal(eng.prefill(prompt[0]), logits[0])


def test_chunked_prefill_equals_one_shot(tiny_host_artifact, monkeypatch):
    import qwc.runtime.engine as E

    ids = list(np.random.default_rng(3).integers(0, 259, 40))
    a = Engine(tiny_host_artifact, ctx=64).prefill(ids)
    monkeypatch.setattr(E, "PREFILL_CHUNK", 16)
    b = Engine(tiny_host_artifact, ctx=64).prefill(ids)
    assert np.abs(a - b).max() < 1e-4


def test_generate_streams_text_and_stops(tiny_host_artifact):
    eng = Engine(tiny_host_artifact, ctx=64)
    pieces = list(eng.generate("Hi", max_new_tokens=8))
    assert eng.pos <= 2 + 8
    assert all(isinstance(p, str) for p in pieces)
    eng.reset()
    first = list(eng.generate([72, 105], max_new_tokens=5))
    eng.reset()
    assert list(eng.generate([72, 105], max_new_tokens=5)) == first   # greedy is deterministic


@pytest.mark.slow
def test_cli_compile_and_run(tiny_onnx, tmp_path, capsys):
    out = tmp_path / "m.qwc"
    assert main(["-q", "compile", str(tiny_onnx), "-o", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["lib.so", "manifest.json", "params.bin", "tokenizer.json"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]   # the scratch weight file is gone
    capsys.readouterr()
    assert main(["-q", "run", str(out), "--prompt", "Hello", "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out.startswith("Hello")


# --- bad input ------------------------------------------------------------------------------

def _one_line(capsys, code, expect):
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and expect in err[0], err


def _copy(art, tmp_path):
    dst = tmp_path / "copy.qwc"
    shutil.copytree(art, dst)
    return dst


def _edit_manifest(art, fn):
    mf = art / "manifest.json"
    m = json.loads(mf.read_text())
    fn(m)
    mf.write_text(json.dumps(m))


def test_prompt_longer_than_ctx(tiny_host_artifact, capsys):
    code = main(["-q", "run", str(tiny_host_artifact), "--prompt", "x" * 40, "--ctx", "16"])
    _one_line(capsys, code, "does not fit the context of 16")


def test_wrong_format_version(tiny_host_artifact, tmp_path, capsys):
    art = _copy(tiny_host_artifact, tmp_path)
    _edit_manifest(art, lambda m: m.update(format_version=99))
    _one_line(capsys, main(["-q", "run", str(art), "--prompt", "a"]), "format version 99 is not supported")


def test_corrupt_manifest(tiny_host_artifact, tmp_path, capsys):
    art = _copy(tiny_host_artifact, tmp_path)
    (art / "manifest.json").write_text("{ not json")
    _one_line(capsys, main(["-q", "run", str(art), "--prompt", "a"]), "corrupt manifest")


@pytest.mark.parametrize("field, value, expect", [
    ("max_batch", "4", "functions.max_batch '4' must be an integer"),
    ("max_batch", 8, "above 1 exactly when there is a decode_batch"),     # this library has none
    ("max_batch", 0, "functions.max_batch 0 must be"),
    ("max_tokens_per_call", -3, "functions.max_tokens_per_call -3 must be"),
    ("max_tokens_per_call", 2.5, "functions.max_tokens_per_call 2.5 must be"),
])
def test_manifest_limits_are_checked(tiny_host_artifact, tmp_path, capsys, field, value, expect):
    art = _copy(tiny_host_artifact, tmp_path)
    _edit_manifest(art, lambda m: m["functions"].update({field: value}))
    _one_line(capsys, main(["-q", "run", str(art), "--prompt", "a"]), expect)


def test_the_manifest_is_typed_and_round_trips(tiny_host_artifact):
    """qwc.manifest.Manifest: the file is what to_dict writes, from_dict(to_dict) is the same
    manifest, and the runtime reads typed fields (no string keys, no defaults at the reader)."""
    from qwc.config import ModelConfig
    from qwc.manifest import Manifest, read_manifest

    raw = json.loads((tiny_host_artifact / "manifest.json").read_text())
    m = read_manifest(tiny_host_artifact)
    assert m.to_dict() == raw and Manifest.from_dict(m.to_dict()) == m
    assert isinstance(m.model, ModelConfig) and m.functions.max_batch == 1
    assert m.functions.cache_capacity_multiple == 16 and m.functions.extra["k_cache_layout"] == "key_tiles_16"
    assert [p.name for p in m.params] == [p["name"] for p in raw["params"]]
    assert m.weight_bytes == sum(p["nbytes"] for p in raw["params"]) and isinstance(m.params[0].shape, tuple)
    eng = Engine(tiny_host_artifact, ctx=16)
    assert eng.manifest == m and eng.model.vocab_size == raw["model"]["vocab_size"]


def test_edited_hash_or_truncated_params(tiny_host_artifact, tmp_path, capsys):
    art = _copy(tiny_host_artifact, tmp_path)
    p = art / "params.bin"
    p.write_bytes(p.read_bytes()[:1000])
    _one_line(capsys, main(["-q", "run", str(art), "--prompt", "a"]), "params.bin does not match its hash")
    with pytest.raises(Exception, match="params.bin is truncated"):
        Engine(art, verify_hashes=False)


def test_params_and_cache_are_aligned_slices_of_zeroed_arenas(tiny_host_artifact):
    """runtime/memory.py: the parameters are params.bin's bytes, in place in one mapping
    (64-byte aligned, in manifest order, no gaps beyond alignment); the cache starts zeroed."""
    from qwc.runtime.memory import ALIGN, Arena

    eng = Engine(tiny_host_artifact, ctx=40)
    manifest = json.loads((tiny_host_artifact / "manifest.json").read_text())
    raw = (tiny_host_artifact / "params.bin").read_bytes()
    ptrs = [t.data_ptr() for t in eng.params]
    assert all(p % ALIGN == 0 for p in ptrs)
    for spec, t, p, nxt in zip(manifest["params"], eng.params, ptrs, ptrs[1:] + [None]):
        got = t.numpy()
        assert got.tobytes() == raw[spec["offset"]:spec["offset"] + spec["nbytes"]]
        if nxt is not None:
            assert p + spec["nbytes"] <= nxt < p + spec["nbytes"] + ALIGN
    assert eng.seq.cache[0].shape[2] == 48   # ctx rounded up to the attention's multiple of 16
    assert eng.seq.capacity == 40
    assert all(not c.numpy().any() for c in eng.seq.cache)
    other = eng.sequence()                    # a second stream: its own cache, the same shape
    assert other.cache[0].data_ptr() != eng.seq.cache[0].data_ptr() and other.cache[0].shape[2] == 48

    arena = Arena(200)
    a, b = arena.take((3,), "float16"), arena.take((5,), "int32")
    assert b.ctypes.data - a.ctypes.data == ALIGN and not b.any()
    with pytest.raises(ValueError, match="cannot hold"):
        arena.take((40,), "float32")


def test_artifact_for_another_architecture(tiny_host_artifact, tmp_path, capsys):
    art = _copy(tiny_host_artifact, tmp_path)
    _edit_manifest(art, lambda m: m["target"].update(name="arm-yitian", arch="aarch64"))
    _one_line(capsys, main(["-q", "run", str(art), "--prompt", "a"]), "compiled for arm-yitian (aarch64)")


def test_unknown_target(tiny_q4, tmp_path, capsys):
    code = main(["-q", "compile", str(tiny_q4), "--target", "riscv", "-o", str(tmp_path / "x.qwc")])
    _one_line(capsys, code, "unknown target 'riscv' (known: host, x86-avx2, x86-avx512, arm-yitian, arm-neon)")
    assert not (tmp_path / "x.qwc").exists()


def test_unsupported_op_names_node(tiny_q4, tmp_path, capsys):
    m = onnx.load(str(tiny_q4))
    sig = next(n for n in m.graph.node if n.op_type == "Sigmoid")
    sig.op_type, sig.name = "HardSigmoid", "odd_activation"
    bad = tmp_path / "bad.onnx"
    onnx.save(m, str(bad))
    for a, b in zip(sidecar_paths(tiny_q4), sidecar_paths(bad)):
        b.write_bytes(a.read_bytes())
    code = main(["-q", "compile", str(bad), "-o", str(tmp_path / "bad.qwc")])
    _one_line(capsys, code, "node odd_activation (HardSigmoid)")
    assert not (tmp_path / "bad.qwc").exists()


def test_chat_loop_reads_turns_until_eof(tiny_host_artifact):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "qwc", "-q", "run", str(tiny_host_artifact), "--chat",
                        "--max-new-tokens", "4", "--ctx", "128"],
                       input="hello\nsecond turn\n", capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("> ") == 3          # two turns answered, then EOF at the third prompt
    assert "Traceback" not in r.stderr


def test_decode_builds_each_planned_view_once(tiny_host_artifact):
    """compiler/view_reuse.py: no two alloc_tensor instructions of the decode function build the
    same view, and the only tuple it builds is the one it returns (the logits agreeing with
    onnxruntime is the test above)."""
    import tvm
    from tvm import relax

    text = relax.VMExecutable(tvm.runtime.load_module(str(tiny_host_artifact / "lib.so"))).as_text()
    decode = text.split("@decode:")[1].split("\n@")[0]
    views = re.findall(r"call\s+vm\.builtin\.alloc_tensor in: (.*) dst:", decode)
    kernels = re.findall(r"call\s+(?!vm\.)(\S+) in:", decode)
    assert views and len(views) == len(set(views)), views
    assert len(views) < len(kernels)
    assert len(re.findall(r"vm\.builtin\.make_tuple", decode)) == 1


def test_engine_loads_tvm_without_torch_and_torch_still_imports_after(tiny_host_artifact):
    """TVM's FFI imports torch when installed (~200 MiB of RSS); the engine hides it while TVM
    first loads. torch must stay importable and the engine must keep working alongside it."""
    import subprocess
    import sys

    code = ("import sys; from qwc.runtime.engine import Engine\n"
            f"e = Engine({str(tiny_host_artifact)!r}, ctx=32); a = e.prefill([1, 2, 3])\n"
            "assert 'torch' not in sys.modules, 'torch was loaded'\n"
            "import torch; e.reset(); b = e.prefill([1, 2, 3])\n"
            "assert torch.ones(2).sum().item() == 2 and (a == b).all()\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("dot, target", [("vnni", "x86-avx512"), ("avx2", "x86-avx2")])
def test_x86_w4a8_kernels_equal_the_generic_w4a8_kernel(tiny_q4, tmp_path, dot, target):
    """The x86 W4A8 kernels (AVX-512 VNNI; AVX2) and the generic TE kernel (a target without
    an integer dot rule) implement the same integer arithmetic, prefill and decode."""
    from qwc import cpu

    need = {"vnni": "avx512_vnni", "avx2": "avx2"}[dot]
    if not cpu.has(need):
        pytest.skip(f"runs {need} code; this CPU has none (the VNNI library's code: "
                    "test_vnni_library_from_any_x86_host)")
    fast, generic = tmp_path / "fast.qwc", tmp_path / "generic.qwc"
    compile_file(tiny_q4, target, fast, act_bits=8)
    syms = subprocess.run(["nm", "-D", str(fast / "lib.so")], capture_output=True, text=True).stdout
    assert f"q4_gemm_{dot}_" in syms and f"q4_gemv_{dot}_" in syms   # the kernels under test ran
    with mock.patch.object(targets, "KERNEL_RULES", ((frozenset(), targets.Kernels(None, "three_pass")),)):
        compile_file(tiny_q4, target, generic, act_bits=8)
    ids = list(np.random.default_rng(5).integers(0, 259, 12))
    ev, eg = Engine(fast, ctx=64), Engine(generic, ctx=64)
    a, b = [ev.prefill(ids)], [eg.prefill(ids)]
    for _ in range(4):
        tok = int(a[-1].argmax())
        a.append(ev.decode(tok))
        b.append(eg.decode(tok))
    for x, y in zip(a, b):
        assert np.abs(x - y).max() <= 1e-5 * np.abs(y).max()


@pytest.mark.slow
def test_vnni_library_from_any_x86_host(tiny_q4, tmp_path, capsys):
    """--target x86-avx512 builds the VNNI library wherever qwc runs; it really uses vpdpbusd,
    and a machine without VNNI refuses to load it in one line."""
    import subprocess

    from qwc import cpu
    from qwc.cli import main

    vnni = tmp_path / "vnni.qwc"
    compile_file(tiny_q4, "x86-avx512", vnni, act_bits=8)
    asm = subprocess.run(["objdump", "-d", str(vnni / "lib.so")], capture_output=True, text=True).stdout
    assert "vpdpbusd" in asm
    # ...and SiLU·mul cost no kernel of its own: prefill's down-projection quantizer computed
    # it, decode's gate/up GEMV, which also quantized it (no decode quantizer of the MLP's 320
    # hidden units); q, k and v decode in one launch (compiler/sibling_gemvs.py)
    syms = subprocess.run(["nm", "-D", str(vnni / "lib.so")], capture_output=True, text=True).stdout
    assert "prefill_act_q8_silu_" in syms and "decode_q4_gemv_vnni_silu_mul_q8_320x" in syms and "sigmoid" not in syms
    assert "decode_act_q8_silu_" not in syms and "decode_act_q8_320_" not in syms
    assert re.search(r"decode_q4_gemv_vnni_\d+_\d+_\d+x", syms)   # three outputs
    # ...and decode attends in three passes (targets.KERNEL_RULES), prefill online
    assert "decode_attention_3pass" in syms and "decode_attention_online" not in syms
    assert "prefill_attention_online" in syms
    # ...which rotates q and k, writes the cache and quantizes its output for the o projection
    # itself (kernels/attention.py: decode_attention): decode has no rotary or cache writer
    assert "decode_attention_3pass_q8" in syms
    assert not re.search(r"decode_(rotary|k_cache_write|kv_cache_write)", syms) and "prefill_rotary" in syms
    # ...and the residual reaches the o and down GEMVs through one reshape (a view), not two
    # (a copy kernel once fused: relax_match.BindingRewriter.unreshaped)
    assert not re.search(r"fused_reshape\d*_reshape", syms)
    if not cpu.has("avx512_vnni"):
        code = main(["-q", "run", str(vnni), "--prompt", "a"])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1
        assert err[0].startswith("qwc: error: artifact for x86-avx512 needs CPU features this machine lacks: ")
        assert "avx512_vnni" in err[0]


def test_bench_prints_pp_and_tg_rows(tiny_host_artifact, capsys):
    import json

    assert main(["-q", "bench", str(tiny_host_artifact), "-p", "32", "-n", "8", "-r", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["test"] for r in out["results"]] == ["pp32", "tg8"]
    assert all(r["tps"] > 0 and r["reps"] == 2 for r in out["results"])
    assert main(["-q", "bench", str(tiny_host_artifact), "-p", "16", "-n", "0", "-r", "1"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert len(table) == 3 and "pp16" in table[2]


def _refused(capsys, code, path):
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert f"cannot write {path}" in err[0] and "qwc replaces only what it wrote" in err[0]


def test_compile_never_replaces_a_folder_it_did_not_write(tiny_q4, tmp_path, capsys):
    """-o naming a user's folder is refused before any work, and the user's file stays."""
    mine = tmp_path / "somedir"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    _refused(capsys, main(["-q", "compile", str(tiny_q4), "-o", str(mine)]), mine)
    assert [p.name for p in mine.iterdir()] == ["notes.txt"] and (mine / "notes.txt").read_text() == "mine"
    assert not list(tmp_path.glob(".somedir.*"))   # no staging left behind


@pytest.mark.slow
def test_compile_replaces_its_own_artifact_but_not_a_file_kept_in_it(tiny_q4, tiny_host_artifact, tmp_path, capsys):
    art = _copy(tiny_host_artifact, tmp_path)
    (art / "my-notes.txt").write_text("mine")
    _refused(capsys, main(["-q", "compile", str(tiny_q4), "-o", str(art)]), art)
    assert (art / "my-notes.txt").read_text() == "mine"
    (art / "my-notes.txt").unlink()
    stamp = (art / "manifest.json").stat().st_mtime_ns
    assert main(["-q", "compile", str(tiny_q4), "-o", str(art)]) == 0   # an artifact qwc wrote: replaced
    assert (art / "manifest.json").stat().st_mtime_ns != stamp and not list(tmp_path.glob(".copy.qwc.*"))
    empty = tmp_path / "empty.qwc"
    empty.mkdir()
    assert main(["-q", "compile", str(tiny_q4), "-o", str(empty)]) == 0   # nothing in it to lose
    assert (empty / "manifest.json").is_file()


@pytest.mark.slow
def test_compile_with_the_runtime_lib_variable_inherited(tiny_q4, tmp_path):
    """`qwc run` / `bench` / `serve` set TVM_USE_RUNTIME_LIB for themselves (TVM's runtime
    alone); a compile that inherits it (a script, or a process that ran qwc in-process first)
    must still get TVM's compiler, not a traceback from deep inside TVM."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, TVM_USE_RUNTIME_LIB="1")
    out = tmp_path / "m.qwc"
    r = subprocess.run([sys.executable, "-m", "qwc", "-q", "compile", str(tiny_q4), "-o", str(out)], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert (out / "manifest.json").is_file()


def test_ids_past_the_tokenizer_are_never_sampled(tiny_host_artifact):
    """tiny pads its 259 tokens to 288 rows, as Qwen2.5 pads 151,665 to 151,936: the padding
    rows' logits are noise and decode to nothing, so the sampler never picks them."""
    from qwc.runtime.sampling import Sampler, SamplingParams
    from qwc.vocab import mismatch, token_span

    eng = Engine(tiny_host_artifact, ctx=64)
    span = token_span(eng.tokenizer)
    assert eng.sample_limit == span < eng.vocab_size
    logits = np.zeros(eng.vocab_size, np.float32)
    logits[span:] = 100.0                       # unmasked, a padding row would win every time
    assert Sampler(SamplingParams(), eng.sample_limit)(logits, []) < span
    hot = Sampler(SamplingParams(temperature=5.0, top_p=0.99, seed=1), eng.sample_limit)
    assert all(hot(logits, [span - 1]) < span for _ in range(200))
    assert mismatch(151936, 151665) is None and mismatch(152064, 151665) is None   # Qwen2.5's own padding
    assert "covers 259 of the model's 151936" in mismatch(151936, 259)
    assert "past the model's vocabulary" in mismatch(100, 259)


@pytest.mark.slow
def test_untied_embedding_reads_fp16_scales_and_matches_onnxruntime(tiny_onnx, tiny_lm, tmp_path):
    """An untied embedding (Qwen2.5-7B's case) keeps its own Q4_0 table; its scales are stored
    as fp16 (exact for Q4_0: a 152k x 3584 table's are 65 MB in float32, as a GGUF's are not)
    and the logits still agree with onnxruntime on the canonical graph."""
    from qwc.passes.options import PassOptions
    from qwc.passes.pipeline import optimize, save_graph

    cfg = tiny_lm.config
    q4 = tmp_path / "untied.q4.onnx"
    m = optimize(onnx.load(str(tiny_onnx)), PassOptions(config=cfg, fold_norm_gains=True, untie_lm_head=True))
    gather = next(n for n in m.graph.node if n.op_type == "GatherBlockQuantized")
    assert not any(n.op_type == "MatMulNBits" and n.input[1] == gather.input[0] for n in m.graph.node)
    save_graph(m, q4, cfg, sidecar_paths(tiny_onnx)[1])
    art = tmp_path / "untied.qwc"
    compile_file(q4, "host", art, act_bits=32)
    params = json.loads((art / "manifest.json").read_text())["params"]
    embed = [p for p in params if "embed_tokens" in p["name"] and "scales" in p["name"]]
    assert [p["dtype"] for p in embed] == ["float16"]
    prompt = np.random.default_rng(5).integers(0, 259, (1, 7))
    _greedy_against_onnxruntime(art, q4, cfg, prompt, 4, 32)
