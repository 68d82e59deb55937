"""`qwc compile` on the host: the compiled module against onnxruntime on the same canonical
graph, the x86 integer kernels against the generic ones, and what compile refuses or keeps."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
from unittest import mock

import numpy as np
import onnx
import pytest

from qwc.cli import main
from qwc.compiler import targets
from qwc.compiler.compile import compile_file
from qwc.config import sidecar_paths
from qwc.errors import QwcError
from qwc.runtime.engine import Engine

from conftest import copy_artifact, greedy_against_onnxruntime, one_line


def test_host_matches_onnxruntime_prefill_and_16_decode_steps(tiny_q4, tiny_host_artifact, tiny_lm):
    """Greedy generation on the compiled module against onnxruntime on the canonical graph."""
    prompt = np.random.default_rng(11).integers(0, 259, (1, 9))
    eng, ref, logits = greedy_against_onnxruntime(tiny_host_artifact, tiny_q4, tiny_lm.config, prompt, 16, 64)
    assert [int(r.argmax()) for r in ref] == [int(g.argmax()) for g in logits]
    eng.reset()
    assert np.array_equal(eng.prefill(prompt[0]), logits[0])


def test_f16_kv_cache_halves_the_cache_and_follows_onnxruntime(tiny_q4, tiny_host_artifact, tiny_lm, tmp_path,
                                                               capsys):
    """`--kv-dtype f16`: the manifest records it, a token's cache takes half the bytes of f32's
    (and `qwc run` says so), and greedy generation takes onnxruntime's tokens (float32 cache)
    with every step's logits within 1e-2 of their range (f16 rounds each cached element by up
    to 2^-11 of it; f32 is held to 1e-3 above). An unknown type is refused in one line."""
    art = tmp_path / "f16.qwc"
    assert main(["-q", "compile", str(tiny_q4), "--act-bits", "32", "--kv-dtype", "f16", "-o", str(art)]) == 0
    assert json.loads((art / "manifest.json").read_text())["functions"]["cache_dtype"] == "float16"
    prompt = np.random.default_rng(11).integers(0, 259, (1, 9))
    eng, ref, logits = greedy_against_onnxruntime(art, tiny_q4, tiny_lm.config, prompt, 16, 64, tol=1e-2)
    assert [int(r.argmax()) for r in ref] == [int(g.argmax()) for g in logits]
    assert eng.seq.cache[0].dtype == "float16"
    f32 = Engine(tiny_host_artifact, ctx=64)
    assert 2 * eng.kv_bytes_per_token == f32.kv_bytes_per_token
    cfg = tiny_lm.config
    assert f32.kv_bytes_per_token == 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4
    capsys.readouterr()
    assert main(["run", str(art), "--prompt", "a", "--max-new-tokens", "1", "--ctx", "64"]) == 0
    assert f"KV cache f16, {eng.kv_bytes_per_token / 1024:g} KiB a token" in capsys.readouterr().err
    with pytest.raises(SystemExit):   # argparse: exit 2 with the choices named
        main(["-q", "compile", str(tiny_q4), "--kv-dtype", "q4_1", "-o", str(tmp_path / "x.qwc")])
    assert "invalid choice: 'q4_1'" in capsys.readouterr().err and not (tmp_path / "x.qwc").exists()
    with pytest.raises(Exception, match="--kv-dtype 'bf16' is not supported"):
        compile_file(tiny_q4, "host", tmp_path / "y.qwc", kv_type="bf16")


def test_q8_0_kv_cache_takes_a_quarter_and_follows_onnxruntime(tiny_q4, tiny_host_artifact, tiny_lm, tmp_path,
                                                                capsys):
    """`--kv-dtype q8_0` (llama.cpp's blocks of 32 int8 and a float16 scale): the manifest
    records it, a token's cache takes 68 bytes a head where f32 takes 256 (0.27x), `qwc run`
    says so, greedy generation takes onnxruntime's tokens (float32 cache) with every step's
    logits within 3e-2 of their range (q8_0 rounds each cached element by up to 1/254 of its
    block's largest), and the batched step (its own cache writer and attention) takes each
    sequence's tokens alone. A model whose head_dim is not a multiple of 32 is refused."""
    from run_engine import greedy_alone_and_batched  # scripts/arm64

    art = tmp_path / "q8.qwc"
    assert main(["-q", "compile", str(tiny_q4), "--act-bits", "32", "--kv-dtype", "q8_0", "--max-batch", "3",
                 "-o", str(art)]) == 0
    assert json.loads((art / "manifest.json").read_text())["functions"]["cache_dtype"] == "q8_0"
    prompt = np.random.default_rng(11).integers(0, 259, (1, 9))
    eng, ref, logits = greedy_against_onnxruntime(art, tiny_q4, tiny_lm.config, prompt, 16, 64, tol=3e-2)
    assert [int(r.argmax()) for r in ref] == [int(g.argmax()) for g in logits]
    cfg = tiny_lm.config
    assert eng.seq.cache[0].dtype == "int8" and eng.seq.cache[0].shape[-1] == cfg.head_dim * 17 // 16
    f32 = Engine(tiny_host_artifact, ctx=64)
    assert eng.kv_bytes_per_token * 256 == f32.kv_bytes_per_token * 68
    alone, batched = greedy_alone_and_batched(eng, [[72, 101, 108], list(range(3, 40)), [7]], 6)
    assert np.array_equal(alone.argmax(-1), batched.argmax(-1))
    assert np.abs(alone - batched).max() / np.abs(alone).max() < 3e-2
    capsys.readouterr()
    assert main(["run", str(art), "--prompt", "a", "--max-new-tokens", "1", "--ctx", "64"]) == 0
    assert f"KV cache q8_0, {eng.kv_bytes_per_token / 1024:g} KiB a token" in capsys.readouterr().err
    from qwc.config import load_for_graph
    cfg48 = dataclasses.replace(load_for_graph(tiny_q4), head_dim=48)
    with mock.patch("qwc.compiler.compile.load_for_graph", return_value=cfg48):
        with pytest.raises(QwcError, match="--kv-dtype q8_0 needs a head_dim that is a multiple of 32"):
            compile_file(tiny_q4, "host", tmp_path / "z.qwc", kv_type="q8_0")
    assert not (tmp_path / "z.qwc").exists()


@pytest.mark.slow
def test_cli_compile_and_run(tiny_onnx, tmp_path, capsys):
    out = tmp_path / "m.qwc"
    assert main(["-q", "compile", str(tiny_onnx), "-o", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["lib.so", "manifest.json", "params.bin", "tokenizer.json"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]   # the scratch weight file is gone
    capsys.readouterr()
    assert main(["-q", "run", str(out), "--prompt", "Hello", "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out.startswith("Hello")


def test_unknown_target(tiny_q4, tmp_path, capsys):
    code = main(["-q", "compile", str(tiny_q4), "--target", "riscv", "-o", str(tmp_path / "x.qwc")])
    one_line(capsys, code, "unknown target 'riscv' (known: host, x86-avx2, x86-avx512, x86-zen, x86-amx, arm-yitian, arm-neon)")
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
    one_line(capsys, code, "node odd_activation (HardSigmoid)")
    assert not (tmp_path / "bad.qwc").exists()


@pytest.fixture(scope="module")
def generic_w4a8_steps(tiny_q4, tmp_path_factory):
    """What the generic TE kernel (a target without an integer dot rule) computes for the x86
    kernels' test: a 40-token prompt (AMX: two 16-token tiles, 8 tokens left) and 4 greedy
    steps, as (prompt, steps' tokens, logits), for a target's activation quantizer. Built once
    per quantizer (x86-avx512 and x86-amx share VNNI's), not once per kernel compared."""
    made = {}

    def steps(target: str):
        if target not in made:
            generic = tmp_path_factory.mktemp("generic") / "generic.qwc"
            with mock.patch.object(targets, "KERNEL_RULES", ((frozenset(), targets.Kernels(None, "three_pass")),)):
                compile_file(tiny_q4, target, generic, act_bits=8)
            eg, ids = Engine(generic, ctx=64), list(np.random.default_rng(5).integers(0, 259, 40))
            logits, tokens = [eg.prefill(ids)], []
            for _ in range(4):
                tokens.append(int(logits[-1].argmax()))
                logits.append(eg.decode(tokens[-1]))
            made[target] = ids, tokens, logits
        return made[target]

    return steps


@pytest.mark.slow
@pytest.mark.parametrize("dot, target", [("vnni", "x86-avx512"), ("avx2", "x86-avx2"), ("vnni_amx", "x86-amx")])
def test_x86_w4a8_kernels_equal_the_generic_w4a8_kernel(tiny_q4, tmp_path, dot, target, generic_w4a8_steps):
    """The x86 W4A8 kernels (AVX-512 VNNI; AVX2; VNNI with AMX's prefill tiles) and the
    generic TE kernel implement the same integer arithmetic, prefill and decode."""
    from qwc import cpu

    need = {"vnni": "avx512_vnni", "avx2": "avx2", "vnni_amx": "amx_int8"}[dot]
    if not cpu.has(need):
        pytest.skip(f"runs {need} code; this CPU has none (the VNNI library's code: "
                    "test_vnni_library_from_any_x86_host; AMX's: test_amx_library_builds_anywhere)")
    fast = tmp_path / "fast.qwc"
    compile_file(tiny_q4, target, fast, act_bits=8)
    syms = subprocess.run(["nm", "-D", str(fast / "lib.so")], capture_output=True, text=True).stdout
    decode = dot.removesuffix("_amx")
    assert f"q4_gemm_{dot}_" in syms and f"q4_gemv_{decode}_" in syms   # the kernels under test ran
    ids, tokens, want = generic_w4a8_steps("x86-avx2" if dot == "avx2" else "x86-avx512")
    ev = Engine(fast, ctx=64)
    got = [ev.prefill(ids)] + [ev.decode(tok) for tok in tokens]
    for x, y in zip(got, want):
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
    # itself (kernels/decode_attention.py): decode has no rotary or cache writer
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
    art = copy_artifact(tiny_host_artifact, tmp_path)
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
    compile_file(q4, "host", art, act_bits=32, kv_type="f32")
    params = json.loads((art / "manifest.json").read_text())["params"]
    embed = [p for p in params if "embed_tokens" in p["name"] and "scales" in p["name"]]
    assert [p["dtype"] for p in embed] == ["float16"]
    prompt = np.random.default_rng(5).integers(0, 259, (1, 7))
    greedy_against_onnxruntime(art, q4, cfg, prompt, 4, 32)
