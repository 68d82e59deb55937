"""Shared fixtures: the tiny preset and its ONNX export, built once per test session."""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import numpy as np
import onnx
import pytest

from qwc import cpu, progress
from qwc.compiler.schedule import STRICT_ENV
from qwc.config import sidecar_paths
from qwc.passes.options import PassOptions
from qwc.passes.pipeline import optimize, save_graph

# torch (and the exporters and presets built on it) is imported where a fixture needs it: an
# install without the torch extra, an ARM server's (scripts/arm64/native.sh), still collects
# and runs the tests that need none.

# The slowest files, slowest first (measured: `pytest --durations=0`, summed by file). pytest
# runs on two workers a whole file each (pyproject.toml: --dist loadfile) in collection order:
# a long file collected last would run alone at the end. The rest keep their order.
SLOW_FILES = ["test_fuzz.py", "test_tune.py", "test_realdata.py", "test_lora_realdata.py", "test_arm.py", "test_kernels.py",
              "test_arm_threads.py", "test_compile.py", "test_engine.py", "test_serve.py", "test_serve_lora.py", "test_replicas.py",
              "test_structured.py", "test_stream_export.py",
              "test_load.py"]


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOW_FILES)}
    items.sort(key=lambda it: rank.get(it.path.name, len(SLOW_FILES)))


@pytest.fixture(scope="session", autouse=True)
def _quiet():
    progress.set_quiet(True)


@pytest.fixture(scope="session", autouse=True)
def _amx():
    """On a CPU with AMX a host build's prefill GEMMs use it, and tests run some such modules in
    their own process, not through the runtime's Engine (which asks Linux for AMX itself)."""
    if cpu.has("amx_tile"):
        cpu.enable_amx()


# Every kernel a test compiles (here or in a `qwc` it runs) is scheduled: one left to TVM's
# serial scalar loops fails the build rather than warn (compiler/schedule.py).
os.environ[STRICT_ENV] = "error"
# The digests an Engine remembers (qwc/checksum.py) go to a folder of the run's own, not the user's.
os.environ.setdefault("QWC_VERIFY_CACHE", tempfile.mkdtemp(prefix="qwc-verified-"))


@pytest.fixture(scope="session")
def tiny_lm():
    from qwc.models.presets import load_preset

    return load_preset("tiny")


@pytest.fixture(scope="module")
def hf_base(tiny_lm, tmp_path_factory):
    """The tiny model as a Hugging Face directory: the base adapters are read against."""
    src = tmp_path_factory.mktemp("base") / "hf"
    tiny_lm.model.save_pretrained(src)
    tiny_lm.tokenizer.save(str(src / "tokenizer.json"))
    return src


@pytest.fixture(scope="session")
def tiny_onnx(tiny_lm, tmp_path_factory):
    from qwc.models.export import export_onnx

    return export_onnx(tiny_lm, tmp_path_factory.mktemp("tiny") / "tiny.onnx")


@pytest.fixture(scope="session")
def tiny_legacy_onnx(tiny_lm, tmp_path_factory):
    """The same model through torch's older TorchScript exporter (dynamo=False)."""
    from qwc.models.export import export_onnx

    return export_onnx(tiny_lm, tmp_path_factory.mktemp("tiny_legacy") / "tiny.onnx", dynamo=False)


@pytest.fixture(scope="session")
def tiny_q4(tiny_onnx, tiny_lm, tmp_path_factory):
    """The tiny export through the passes: the canonical int4 graph."""
    out = tmp_path_factory.mktemp("q4") / "tiny.q4.onnx"
    m = optimize(onnx.load(str(tiny_onnx)), PassOptions(config=tiny_lm.config))
    save_graph(m, out, tiny_lm.config, sidecar_paths(tiny_onnx)[1])
    return out


@pytest.fixture(scope="session")
def tiny_float(tiny_onnx, tiny_lm, tmp_path_factory):
    """The tiny export through the passes with every linear left in float (`--keep-float '*'`)."""
    out = tmp_path_factory.mktemp("float") / "tiny.float.onnx"
    m = optimize(onnx.load(str(tiny_onnx)), PassOptions(config=tiny_lm.config, keep_float=["*"]))
    save_graph(m, out, tiny_lm.config, sidecar_paths(tiny_onnx)[1])
    return out


def torch_kv_logits(model, prompt: np.ndarray, steps: list[np.ndarray]) -> list[np.ndarray]:
    """Reference: transformers' own cache handling, prefill then one token per step."""
    import torch
    from transformers.cache_utils import DynamicCache

    cache = DynamicCache(config=model.config)
    outs, ids, past = [], torch.from_numpy(prompt), 0
    with torch.no_grad():
        for step in [None] + steps:
            if step is not None:
                ids = torch.from_numpy(step)
            b, s = ids.shape
            pos = torch.arange(past, past + s).unsqueeze(0).expand(b, s)
            mask = torch.ones(b, past + s, dtype=torch.int64)
            out = model(input_ids=ids, attention_mask=mask, position_ids=pos,
                        past_key_values=cache, use_cache=True)
            outs.append(out.logits.numpy())
            past += s
    return outs


def ort_kv_logits(onnx_path, cfg, prompt: np.ndarray, steps: list[np.ndarray]) -> list[np.ndarray]:
    """onnxruntime on a graph, feeding present.* back as past_key_values.*."""
    from qwc.passes.verify import run_steps, session

    return run_steps(session(onnx_path), cfg, [prompt] + list(steps))


# --- a host artifact of the tiny model, and what tests of artifacts share --------------------

@pytest.fixture(scope="session")
def tiny_host_artifact(tiny_q4, tmp_path_factory):
    from qwc.compiler.compile import compile_file

    out = tmp_path_factory.mktemp("art") / "tiny.qwc"
    compile_file(tiny_q4, "host", out, act_bits=32, kv_type="f32")   # onnxruntime's arithmetic: float activations and cache
    return out


def greedy_against_onnxruntime(art, q4, cfg, prompt, n_steps: int, ctx: int, tol: float = 1e-3):
    """Greedy generation on the compiled module; onnxruntime on the canonical graph `q4` is fed
    the same tokens, and every step's logits agree within `tol` of their range. Returns the
    engine, the references and the compiled module's logits."""
    from qwc.passes.verify import run_steps, session
    from qwc.runtime.engine import Engine

    eng = Engine(art, ctx=ctx)
    logits = [eng.prefill(prompt[0])]
    steps = [prompt]
    for _ in range(n_steps):
        tok = int(logits[-1].argmax())
        steps.append(np.array([[tok]]))
        logits.append(eng.decode(tok))
    ref = [r[0, -1] for r in run_steps(session(str(q4)), cfg, steps, ctx=ctx)]
    for r, g in zip(ref, logits):
        assert np.abs(r - g).max() / np.abs(r).max() < tol
    return eng, ref, logits


def random_peft_adapter(model, folder, r=4, alpha=None, seed=1, target=None, **config):
    """A PEFT adapter of `model` (by default on all seven linears, alpha 2 x r) with non-zero A
    and B (peft starts B at zero), saved to `folder`; returns the peft model."""
    import copy

    import torch
    from peft import LoraConfig, get_peft_model

    from qwc.adapter_files import LINEARS

    torch.manual_seed(seed)
    cfg = LoraConfig(r=r, lora_alpha=2 * r if alpha is None else alpha, target_modules=list(target or LINEARS),
                     lora_dropout=0.0, init_lora_weights=False, **config)
    pm = get_peft_model(copy.deepcopy(model), cfg)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.1)
    pm.save_pretrained(folder)
    return pm


@pytest.fixture
def calib_text(tmp_path):
    """A calibration text file for `qwc optimize --awq / --gptq` (1024 tokens of it in the tests)."""
    text = tmp_path / "calib.txt"
    text.write_text("It is a truth universally acknowledged, that a single man in possession of a good fortune, "
                    "must be in want of a wife. " * 20)
    return text


def random_q4_k(rng, n: int, k: int) -> np.ndarray:
    """[N, K/256 * 144] bytes of Q4_K super-blocks: random codes and 6-bit scales and mins, fp16
    d and dmin of weights ~0.1; row 0's first sub-block has scale 0 (its codes weigh nothing)."""
    sb = k // 256
    raw = rng.integers(0, 256, (n, sb, 144), dtype=np.uint8)
    for at, lo, hi in ((0, 2e-4, 4e-4), (2, 1e-4, 3e-4)):
        raw[..., at:at + 2] = rng.uniform(lo, hi, (n, sb, 1)).astype(np.float16).view(np.uint8)
    raw[0, 0, 4] &= 0xC0   # sub-block 0's scale: the low six bits of byte 0
    return raw.reshape(n, -1)


def random_iq4(rng, n: int, k: int, fmt: str, scale: float = 1.0) -> np.ndarray:
    """[n, K/block * bytes] of random IQ4 blocks whose d are small fp16 values (every index and
    sub-block scale, 0 and negative ones included, as random bytes), times `scale`."""
    from qwc import weight_formats

    f = weight_formats.get(fmt)
    raw = rng.integers(0, 256, (n, k // f.block, f.block_bytes), dtype=np.uint8)
    top = 0.004 if fmt == "IQ4_XS" else 0.02
    d = (scale * rng.uniform(0.0005, top, (n, k // f.block))).astype(np.float16)
    raw[..., 0:2] = d[..., None].view(np.uint8)
    return raw.reshape(n, -1)


def random_q5_k(rng, n: int, k: int) -> np.ndarray:
    """[N, K/256 * 176] bytes of Q5_K super-blocks: random codes, fifth bits and 6-bit scales and
    mins, fp16 d and dmin of weights ~0.1 (as random_q4_k's, codes to 31)."""
    sb = k // 256
    raw = rng.integers(0, 256, (n, sb, 176), dtype=np.uint8)
    for at, lo, hi in ((0, 1e-4, 2e-4), (2, 1e-4, 3e-4)):
        raw[..., at:at + 2] = rng.uniform(lo, hi, (n, sb, 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(n, -1)


def q8_k(a: np.ndarray) -> np.ndarray:
    """a quantized as llama.cpp's Q8_K, a scale a super-block of 256 (d = amax / 127, codes
    rounded half away from zero, act_quant's super_blocks), back in float64."""
    m, k = a.shape
    sb = a.reshape(m, k // 256, 256)
    d = np.abs(sb).max(-1, keepdims=True) / np.float32(127)
    x = sb / np.where(d > 0, d, np.float32(1))
    return (np.sign(x) * np.floor(np.abs(x) + np.float32(0.5)) * d.astype(np.float64)).reshape(m, k)


def compact_k_factors(ws: np.ndarray, wc: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Kernel-layout compact K-quant scales (kernels/q4_k_scales.py: sc, mn [G, nb, 32] uint8; d,
    dmin [G, nb/8, 32] fp16) -> (d sc, -dmin mn) [N, nb] float32, read apart from the kernels."""
    d, dmin = (np.repeat(wc[:, :, h * 16:(h + 1) * 16].astype(np.float32), 8, axis=1) for h in (0, 1))

    def rows(x):   # [G, nb, 16] -> [N, nb]
        return x.transpose(0, 2, 1).reshape(-1, x.shape[1])[:n]

    return rows(d * ws[:, :, :16]), rows(-(dmin * ws[:, :, 16:]))


def random_q6_k(rng, n: int, k: int, flat_row: bool = True) -> np.ndarray:
    """[N, K/256 * 210] bytes of Q6_K super-blocks: random codes and int8 sub-block scales (the
    extremes -128 and 127 among them), fp16 d of weights ~0.05 (|w| up to 0.4); with `flat_row`, row 0's first
    super-block is all zero (d = 0), as llama.cpp writes a block of zeros."""
    sb = k // 256
    raw = rng.integers(0, 256, (n, sb, 210), dtype=np.uint8)
    raw[..., 208:210] = rng.uniform(3e-5, 1e-4, (n, sb, 1)).astype(np.float16).view(np.uint8)
    raw[0, 0, 192:194] = np.array([-128, 127], np.int8).view(np.uint8)
    if flat_row:
        raw[0, 0] = 0
    return raw.reshape(n, -1)


def one_line(capsys, code, expect):
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and expect in err[0], err


def copy_artifact(art, tmp_path):
    dst = tmp_path / "copy.qwc"
    shutil.copytree(art, dst)
    return dst


def edit_manifest(art, fn):
    mf = art / "manifest.json"
    m = json.loads(mf.read_text())
    fn(m)
    mf.write_text(json.dumps(m))


# --- llama.cpp's Python converters, from the llama-cpp-python sdist on PyPI ---------------------

LLAMACPP_VERSION = "0.3.36"   # bench/llamacpp.sh's


@pytest.fixture(scope="session")
def llamacpp_scripts():
    """llama.cpp's own `convert_*.py` and its gguf-py, unpacked once from the sdist (a cache
    outside the repo, as bench/llamacpp.sh keeps its builds): the reference for GGUF adapters."""
    import subprocess
    import sys
    import tarfile
    import tempfile
    from pathlib import Path

    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "qwc" / f"llamacpp-scripts-{LLAMACPP_VERSION}"
    if (cache / "convert_lora_to_gguf.py").is_file():
        return cache
    cache.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache.parent) as tmp:
        r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary=:all:",
                            "-d", tmp, f"llama-cpp-python=={LLAMACPP_VERSION}"], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-2000:]
        top = f"llama_cpp_python-{LLAMACPP_VERSION}/vendor/llama.cpp/"
        keep = ("convert_lora_to_gguf.py", "convert_hf_to_gguf.py", "conversion/", "gguf-py/")
        stage = Path(tmp) / "scripts"
        with tarfile.open(Path(tmp) / f"llama_cpp_python-{LLAMACPP_VERSION}.tar.gz") as t:
            for m in t.getmembers():
                rel = m.name[len(top):] if m.name.startswith(top) else None
                if rel and rel.startswith(keep) and (m.isfile() or m.isdir()):
                    m.name = rel
                    t.extract(m, stage, filter="data")
        os.replace(stage, cache)
    return cache


def assert_arm_library_follows(bb, target: str, inputs: dict, refs: dict, prefix: str, tmp_path) -> None:
    """Build bb's functions for the ARM `target`, run those named `prefix`... under qemu at 1, 3, 8
    and 64 threads, and hold each to its reference in `refs` within float32 rounding (2e-6 of its
    largest value), the same bits at every thread count."""
    import tvm

    from qwc.bench import emulation
    from qwc.compiler.build import build
    from qwc.compiler.targets import get_target

    t = get_target(target)
    lib = tmp_path / f"{target}.so"
    build(bb.get(), t).export_library(str(lib), fcompile=tvm.support.cc.cross_compiler(t.cross_compiler))
    ours = {x: v for x, v in inputs.items() if x.startswith(prefix)}
    outs = emulation.run_library(emulation.arm64_env(), lib, ours, tmp_path, threads=(1, 3, 8, 64))
    for name, ref in refs.items():
        if name.startswith(prefix):
            got = outs[0][name]
            np.testing.assert_allclose(got, ref, rtol=0, atol=2e-6 * np.abs(ref).max(), err_msg=name)
            for other in outs[1:]:
                assert np.array_equal(other[name], got), name


def _converts_to_q8_0() -> bool:
    """This machine's host target runs Q6_K, the Q5 formats and IQ4 as Q8_0 (`qwc targets`: an
    x86 CPU without AVX-512 VNNI, such as AMD Zen 3)."""
    from qwc import cpu

    return cpu.machine_arch() == "x86_64" and not cpu.has("avx512_vnni")


# The tests that read the file's own codes in a host artifact: not kept where the host converts.
KEEPS_FILE_CODES = pytest.mark.skipif(_converts_to_q8_0(), reason="this CPU's host target runs Q6_K / Q5 / IQ4 as "
                                      "Q8_0 (qwc targets), so its artifact does not hold the file's codes")
