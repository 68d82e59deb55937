"""ARM targets, cross-compiled here and run under qemu-aarch64 (SVE2 at 128 bits, dotprod,
i8mm): the same logits as the host build, and the instructions the targets promise.
The emulation environment comes from scripts/arm64/setup.sh (run here if missing)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from qwc.bench import emulation
from qwc.compiler.compile import compile_file
from qwc.runtime.engine import Engine

pytestmark = [pytest.mark.slow, pytest.mark.arm]

REPO = Path(__file__).resolve().parents[2]

STEPS = [[72, 101, 108, 108, 111, 44, 32, 119], 5, 6, 7, 8]


@pytest.fixture(scope="session")
def arm64_env():
    return emulation.arm64_env()


def _run_arm(env, artifact, tmp_path, threads: int | None = None) -> np.ndarray:
    out = tmp_path / f"{Path(artifact).name}-{threads}.npy"
    if threads is not None:
        env = dict(env, TVM_NUM_THREADS=str(threads))
    r = subprocess.run(emulation.engine_command(env, artifact, out, json.dumps(STEPS)), env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    machine, _, used = r.stdout.split()
    assert machine == "aarch64"
    if threads is not None:   # TVM's pool really ran the kernels on that many guest threads
        assert int(used) == threads
    return np.load(out)


def test_yitian_batched_decode_equals_each_sequence_alone(arm64_env, tiny_q4, tmp_path):
    """decode_batch on arm-yitian (the smmla GEMMs at M = batch) under qemu: the greedy tokens
    each sequence gets alone (tests/runtime/test_batch.py on the host); and the same artifact's
    step entry point: two sequences decode while a third's prompt goes in 8-token chunks beside
    them, against decode_batch then prefill; and its verify entry point (a task per query head,
    keys in spans of 512) against decode steps, the tokens' keys in one span and straddling
    two: the attention is decode's to the bit (tests/compiler/test_kernels.py), but on ARM the
    decode step's GEMVs sum in other orders than the GEMM (blocks split in parts for 128
    threads, sdot against smmla), so the logits agree to 1e-5, not to the bit."""
    art = tmp_path / "yitian-batch.qwc"
    compile_file(tiny_q4, "arm-yitian", art, max_batch=3)
    for steps, shape in (({"batch": [[72, 101, 108], list(range(3, 30)), [7]], "tokens": 5}, (3, 5, 288)),
                         ({"mixed": [[72, 101, 108], [7], list(range(3, 30))], "chunk": 8}, (4, 3, 288))):
        out = tmp_path / f"{next(iter(steps))}.npy"
        r = subprocess.run(emulation.engine_command(arm64_env, art, out, json.dumps(steps)), env=arm64_env,
                           capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stderr[-2000:]
        ours, reference = np.load(out)   # alone / batched; mixed / separate
        assert ours.shape == reference.shape == shape
        assert np.array_equal(ours.argmax(-1), reference.argmax(-1))
        assert np.abs(ours - reference).max() / np.abs(reference).max() < 1e-5
    for past in (20, 507):
        out = tmp_path / f"verify-{past}.npy"
        steps = {"verify": [(7 * i) % 250 + 3 for i in range(past)], "tokens": [5, 9, 17, 33, 65, 129, 2, 4, 8]}
        r = subprocess.run(emulation.engine_command(arm64_env, art, out, json.dumps(steps)), env=arm64_env,
                           capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stderr[-2000:]
        steps, verified = np.load(out)
        assert steps.shape == verified.shape == (9, 288)
        assert np.array_equal(verified.argmax(-1), steps.argmax(-1))
        assert np.abs(verified - steps).max() / np.abs(steps).max() < 1e-5


def _host_logits(artifact) -> np.ndarray:
    eng = Engine(artifact, ctx=64)
    return np.stack([eng.prefill(STEPS[0])] + [eng.decode(t) for t in STEPS[1:]])


@pytest.fixture(scope="session")
def builds(tiny_q4, tmp_path_factory):
    d = tmp_path_factory.mktemp("arm")
    out = {}
    for target, act in (("host", 32), ("host", 8), ("arm-yitian", 32), ("arm-yitian", 8),
                        ("arm-neon", 32), ("arm-neon", 8)):
        out[target, act] = d / f"{target}-a{act}.qwc"
        compile_file(tiny_q4, target, out[target, act], act_bits=act)
    return out


def _assert_follows(arm, host, tolerance: float) -> None:
    assert arm.shape == host.shape == (len(STEPS), 288)
    for a, h in zip(arm, host):
        assert np.abs(a - h).max() / np.abs(h).max() < tolerance
    assert [int(x.argmax()) for x in arm] == [int(x.argmax()) for x in host]


@pytest.mark.parametrize("target", ["arm-yitian", "arm-neon"])
@pytest.mark.parametrize("act", [32, 8])
def test_arm_logits_match_host(arm64_env, builds, tmp_path, target, act):
    """To 1e-3 of the logits' range, on the default (float16) caches: a prompt's attention
    takes the scaled query and its weights rounded to float16 on every target
    (kernels/prefill_attention.py), FEAT_FHM's `fmlal` on arm-yitian and the same products in
    float32 elsewhere, so the 8-bit activations have no float16 rounding of one target's to
    carry on (2e-2 of the logits' range when only arm-yitian's took them)."""
    _assert_follows(_run_arm(arm64_env, builds[target, act], tmp_path), _host_logits(builds["host", act]), 1e-3)


@pytest.mark.parametrize("target", ["arm-yitian", "arm-neon"])
def test_arm_float_linears_match_host(arm64_env, tiny_float, tmp_path, target):
    """`--keep-float '*'`: the float column-block kernel on 4-lane NEON vectors, against the
    host build's (16-lane) logits to 1e-5 of their range."""
    art, host = tmp_path / f"{target}-float.qwc", tmp_path / "host-float.qwc"
    compile_file(tiny_float, target, art, act_bits=32, kv_type="f32")
    compile_file(tiny_float, "host", host, act_bits=32, kv_type="f32")
    assert json.loads((art / "manifest.json").read_text())["quantization"]["weight_layout"]["column_blocks"] > 0
    arm, ref = _run_arm(arm64_env, art, tmp_path), _host_logits(host)
    assert arm.shape == ref.shape == (len(STEPS), 288)
    assert np.abs(arm - ref).max() / np.abs(ref).max() < 1e-5
    assert [int(x.argmax()) for x in arm] == [int(x.argmax()) for x in ref]


def test_arm_decode_at_depth_splits_the_keys_and_matches_host(arm64_env, builds, tmp_path):
    """At depth the ARM decode attention splits the cached keys in spans of 512, a task each,
    merged after (targets.Kernels.decode_split_keys); the x86 host's takes them whole. 700
    cached tokens (two spans), then decode steps, under qemu at 1 and 8 threads: the host's
    logits, and the same bits at both thread counts (the spans do not depend on them)."""
    steps = [[int(t) for t in np.random.default_rng(3).integers(0, 259, 700)], 5, 6, 7]
    out = {}
    for threads in (1, 8):
        dest = tmp_path / f"depth-{threads}.npy"
        env = dict(arm64_env, TVM_NUM_THREADS=str(threads))
        r = subprocess.run(emulation.engine_command(env, builds["arm-yitian", 8], dest, json.dumps(steps)),
                           env=env, capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stderr[-2000:]
        out[threads] = np.load(dest)
    assert np.array_equal(out[1], out[8])
    eng = Engine(builds["host", 8], ctx=len(steps[0]) + len(steps))
    host = np.stack([eng.prefill(steps[0])] + [eng.decode(t) for t in steps[1:]])
    for a, h in zip(out[1], host):
        assert np.abs(a - h).max() / np.abs(h).max() < 1e-3
    assert [int(x.argmax()) for x in out[1]] == [int(x.argmax()) for x in host]


def test_arm_q8_0_cache_matches_host(arm64_env, tiny_q4, tmp_path):
    """A q8_0 KV cache (`--kv-dtype q8_0`) on arm-yitian under qemu, 600 cached tokens (the
    decode attention's keys in two spans) then decode steps, at 1 and 8 threads: the same bits
    at both, and the logits of the host's q8_0 build within 1e-3 (both quantize each cached
    row with roundf, so their caches hold the same codes)."""
    arts = {t: tmp_path / f"{t}-q8.qwc" for t in ("host", "arm-yitian")}
    for t, art in arts.items():
        compile_file(tiny_q4, t, art, act_bits=8, kv_type="q8_0")
    steps = [[int(t) for t in np.random.default_rng(5).integers(0, 259, 600)], 5, 6, 7]
    out = {}
    for threads in (1, 8):
        dest = tmp_path / f"q8-{threads}.npy"
        env = dict(arm64_env, TVM_NUM_THREADS=str(threads))
        r = subprocess.run(emulation.engine_command(env, arts["arm-yitian"], dest, json.dumps(steps)), env=env,
                           capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stderr[-2000:]
        out[threads] = np.load(dest)
    assert np.array_equal(out[1], out[8])
    eng = Engine(arts["host"], ctx=len(steps[0]) + len(steps))
    host = np.stack([eng.prefill(steps[0])] + [eng.decode(t) for t in steps[1:]])
    for a, h in zip(out[1], host):
        assert np.abs(a - h).max() / np.abs(h).max() < 1e-3
    assert [int(x.argmax()) for x in out[1]] == [int(x.argmax()) for x in host]


def test_runner_fill_counts_positions_as_cached(arm64_env, builds, tmp_path):
    """scripts/arm64/run_engine.py's "fill" (bench/arm_icount.py --depth): the steps run after
    N positions of zeros, as the host Engine does from the same fill level, and not as they do
    from an empty cache."""
    steps = {"steps": [[72, 101, 108], 5, 6], "fill": 300}
    dest = tmp_path / "fill.npy"
    r = subprocess.run(emulation.engine_command(arm64_env, builds["arm-yitian", 8], dest, json.dumps(steps)),
                       env=arm64_env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    arm = np.load(dest)
    eng = Engine(builds["host", 8], ctx=320)
    eng.seq.pos = 300
    host = np.stack([eng.prefill([72, 101, 108]), eng.decode(5), eng.decode(6)])
    eng.reset()
    empty = np.stack([eng.prefill([72, 101, 108]), eng.decode(5), eng.decode(6)])
    assert arm.shape == host.shape == (3, 288)
    assert np.abs(arm - host).max() / np.abs(host).max() < 1e-3
    assert np.abs(arm - empty).max() / np.abs(empty).max() > 1e-2


def _disassemble(artifact) -> str:
    return subprocess.run(["aarch64-linux-gnu-objdump", "-d", str(Path(artifact) / "lib.so")],
                          capture_output=True, text=True, check=True).stdout


@pytest.mark.parametrize("target", ["arm-yitian", "arm-neon"])
def test_arm_logits_do_not_depend_on_threads(arm64_env, builds, tmp_path, target):
    """Every kernel's task owns its output rows: 1, 3, 8 and 64 threads (guest threads, many
    more than the host's cores: the engine sizes TVM's pool itself) give the same bits."""
    runs = [_run_arm(arm64_env, builds[target, 8], tmp_path, threads) for threads in (1, 3, 8, 64)]
    assert all(np.array_equal(r, runs[0]) for r in runs[1:])


def test_yitian_kernels_linked_from_the_cache_equal_the_whole_build(arm64_env, builds, tiny_q4, tmp_path,
                                                                    monkeypatch):
    """ARM's compiled VM calls each kernel by name (compiler/kernel_objects.py): the artifact
    linked from the cache's objects gives the bits of the module built whole."""
    from qwc.compiler import kernel_objects

    monkeypatch.setattr(kernel_objects, "_writable", lambda _where: False)   # as QWC_KERNEL_CACHE=off
    whole = tmp_path / "whole.qwc"
    compile_file(tiny_q4, "arm-yitian", whole, act_bits=8)
    assert np.array_equal(_run_arm(arm64_env, whole, tmp_path), _run_arm(arm64_env, builds["arm-yitian", 8], tmp_path))


def _targets_under(env, qemu_cpu: str) -> dict[str, list[str]]:
    """`qwc targets` as an aarch64 machine with this CPU runs it: {target: its columns}."""
    r = subprocess.run(emulation.cli_command(env, "targets"), env=dict(env, QEMU_CPU=qemu_cpu),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    assert lines[0].split()[:6] == ["target", "arch", "features", "decode", "prefill", "attention"]
    assert lines[1].startswith("host ")
    return {line.split()[0]: line.split()[1:6] for line in lines[1:]}


@pytest.mark.parametrize("qemu_cpu, named", [("max,sve128=on", "arm-yitian"),   # N2: SVE2-128, i8mm
                                             ("neoverse-n1", "arm-neon"),       # dotprod, no i8mm
                                             ("cortex-a72", None)])             # neither
def test_host_target_on_an_arm_cpu_picks_the_kernels_of_its_named_target(arm64_env, qemu_cpu, named):
    rows = _targets_under(arm64_env, qemu_cpu)
    host = rows["host"]
    assert host[0] == "aarch64"
    if named:
        assert host == rows[named]    # the same features, so the same decode, prefill, attention
    else:
        assert host[1] == "neon" and host[2:4] == ["w4a32", "w4a32"]


@pytest.mark.parametrize("qemu_cpu, lacking", [("neoverse-n1", "bf16, fp16fml, i8mm, sve128, sve2"),
                                               ("max", "sve128")])   # SVE at 512 bits, not N2's 128
def test_yitian_artifact_refused_on_a_cpu_without_its_features(arm64_env, builds, qemu_cpu, lacking):
    cmd = emulation.cli_command(arm64_env, "-q", "run", builds["arm-yitian", 8], "--prompt", "a")
    r = subprocess.run(cmd, env=dict(arm64_env, QEMU_CPU=qemu_cpu), capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    assert r.stderr.strip() == f"qwc: error: artifact for arm-yitian needs CPU features this machine lacks: {lacking}"


@pytest.mark.parametrize("threads", [2, 8])
def test_qwc_bench_runs_arm_artifacts_with_threads(arm64_env, builds, threads):
    """`qwc bench --threads N` on an ARM artifact, as an ARM machine runs the CLI; the runtime
    maps params.bin there too (what it stores smaller at rest is unpacked beside it)."""
    cmd = emulation.cli_command(arm64_env, "bench", builds["arm-yitian", 8], "-p", "8", "-n", "4", "-r", "1",
                                "--threads", threads)
    r = subprocess.run(cmd, env=arm64_env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert re.search(r"[0-9.]+ GiB of weights mapped from params\.bin", r.stderr), r.stderr[-2000:]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in r.stdout.splitlines() if "arm-yitian" in line]
    assert [row[5] for row in rows] == ["pp8", "tg4"]
    assert all(row[4] == str(threads) and float(row[6].split()[0]) > 0 for row in rows)


def test_yitian_library_uses_sdot_smmla_and_sve(arm64_env, builds):
    asm = _disassemble(builds["arm-yitian", 8])
    assert len(re.findall(r"\ssdot\s", asm)) > 0              # decode GEMV
    assert len(re.findall(r"\ssmmla\s", asm)) > 0             # prefill GEMM (i8mm)
    assert len(re.findall(r"\bz\d+\.[bhsd]\b", asm)) > 0        # SVE vector registers
    # decode attention a task per query head, rotary, cache writes and the o projection's
    # quantizer in it; the VM's entry points native code (targets.Target.vm_exec_mode). A
    # kernel is its exported `__tvm_ffi_` wrapper and, unless LLVM inlined it, `*_compute_`.
    kernels = set(re.findall(r"<(?:__tvm_ffi_)?(\w+?)(?:_compute_)?>:", asm))
    assert "decode_attention_3pass_heads_q8_arm_float16" in kernels, sorted(kernels)
    assert not {k for k in kernels if re.match(r"decode_(attention_online|rotary|k_cache_write)", k)}
    assert {"__vmtir__decode", "__vmtir__prefill", "__vmtir__verify"} <= kernels


def test_neon_library_uses_sdot_and_no_sve(arm64_env, builds):
    asm = _disassemble(builds["arm-neon", 8])
    assert len(re.findall(r"\ssdot\s", asm)) > 0
    assert not re.findall(r"\ssmmla\s", asm)                  # no i8mm on arm-neon
    assert not re.findall(r"\bz\d+\.[bhsd]\b", asm)


def test_arm_artifact_refused_on_this_machine(builds, capsys):
    from qwc.cli import main

    code = main(["-q", "run", str(builds["arm-yitian", 32]), "--prompt", "a"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert "compiled for arm-yitian (aarch64); this machine is x86_64" in err[0]


def test_board_bench_tables_qwc_bench_beside_llama_bench(arm64_env, builds, tmp_path):
    """scripts/arm64/board_bench.py as a board runs it, under qemu: the real `qwc bench` of an
    arm-yitian artifact at 1 and 2 threads. llama.cpp's side is the JSON of a real aarch64
    llama-bench run (tests/data; no llama.cpp is built in CI, ~20 minutes)."""
    import shlex

    recorded = REPO / "tests" / "data" / "llama-bench-arm64.json"
    fake_llama = shlex.join([sys.executable, "-c", f"print(open({str(recorded)!r}).read())"])
    out = tmp_path / "rows.json"
    cmd = [sys.executable, str(REPO / "scripts" / "arm64" / "board_bench.py"), str(builds["arm-yitian", 8]),
           "model.gguf", "--threads", "1,2", "-p", "8", "-n", "4", "-r", "1",
           "--qwc", shlex.join(emulation.cli_command(arm64_env)), "--llama-bench", fake_llama, "--json", str(out)]
    r = subprocess.run(cmd, env=arm64_env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.strip().splitlines()
    assert lines[0].startswith("| threads | qwc pp8 | llama.cpp pp8 |") and len(lines) == 4
    rows = json.loads(out.read_text())
    assert [row["threads"] for row in rows] == [1, 2]
    for row, line in zip(rows, lines[2:]):
        assert row["qwc"]["pp"] > 0 and row["qwc"]["tg"] > 0
        assert row["llama.cpp"] == {"pp": 1.032415, "tg": 0.521639}
        assert line.split("|")[4].strip() == f"{row['qwc']['pp'] / 1.032415:.2f}x"


def test_board_bench_refuses_a_failing_command(tmp_path):
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "arm64" / "board_bench.py"), "m.qwc", "m.gguf",
                        "--threads", "1", "--qwc", "false", "--llama-bench", "false"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1].startswith("board_bench: qwc bench --threads 1 failed (1)")


@pytest.mark.parametrize("qemu_cpu, gemm, instruction", [("max,sve128=on", "smmla", "smmla"),
                                                         ("neoverse-n1", "sdot", "sdot")])
def test_host_target_compiles_its_integer_gemm_on_an_arm_python(arm64_env, qemu_cpu, gemm, instruction):
    """`--target host` on an aarch64 machine, with the aarch64 TVM wheel's own compiler under
    qemu: the prefill GEMM the table picks for the emulated CPU, built for the host target's
    LLVM target, holds that CPU's matrix instruction. (A whole `qwc compile` there would take
    the tiny model tens of minutes under emulation.)"""
    env = {k: v for k, v in arm64_env.items() if k != "TVM_USE_RUNTIME_LIB"}   # the compiler too
    r = subprocess.run(emulation.python_command(env, REPO / "tests" / "data" / "host_gemm_under_qemu.py", REPO),
                       env=dict(env, QEMU_CPU=qemu_cpu), capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    features, picked, found = r.stdout.split()
    assert picked == gemm and instruction in found.split(",")


def test_yitian_adapter_slots_match_host(arm64_env, tiny_q4, tiny_lm, tmp_path):
    """An adapter served unmerged (`--max-lora-rank`) on arm-yitian under qemu: the base's and
    the adapter's logits, alone and as two rows of one batched step, are the host build's
    within the usual tolerance (on float32 caches, as the slots' tests on x86), and the adapter
    changes them."""
    from run_engine import lora_runs, save_adapter

    from qwc.adapter_files import read_adapter

    from conftest import random_peft_adapter

    random_peft_adapter(tiny_lm.model, tmp_path / "ad", r=8, seed=4)
    npz = tmp_path / "ad.npz"
    save_adapter(read_adapter(str(tmp_path / "ad"), tiny_lm.config), npz)
    arts = {}
    for target in ("host", "arm-yitian"):
        arts[target] = tmp_path / f"{target}-lora.qwc"
        compile_file(tiny_q4, target, arts[target], max_batch=2, max_lora_rank=16, kv_type="f32")
    out = tmp_path / "lora.npy"
    steps = {"lora": str(npz), "steps": STEPS}
    r = subprocess.run(emulation.engine_command(arm64_env, arts["arm-yitian"], out, json.dumps(steps)),
                       env=arm64_env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    arm = np.load(out)
    host = np.array(lora_runs(Engine(arts["host"], ctx=64), str(npz), STEPS))
    assert arm.shape == host.shape == (4, len(STEPS), 288)
    for a, h in zip(arm.reshape(-1, 288), host.reshape(-1, 288)):
        assert np.abs(a - h).max() / np.abs(h).max() < 1e-3
    assert np.abs(host[1] - host[0]).max() > 0.1 * np.abs(host[0]).max()   # the adapter matters
    assert np.abs(arm[2:] - arm[:2]).max() <= 1e-5 * np.abs(arm).max()    # batched rows = each alone


def test_icount_attribution_names_the_parallel_bodies_after_their_kernels(builds):
    """bench/arm_icount.py: lib.so's parallel loop bodies are unnamed code placed after the
    named functions; each is named after a kernel that launches it, so a kernel's work is not
    counted under whatever symbol precedes the bodies."""
    from qwc.bench import arm_icount

    lib = str(builds["arm-yitian", 8] / "lib.so")
    named = {name for _, _, name in arm_icount._symbols(lib)}
    bodies = arm_icount.parallel_bodies(lib)
    kernels = {name.removesuffix(" (parallel body)") for _, _, name in bodies}
    assert any("gemv" in k for k in kernels) and any("gemm" in k for k in kernels), sorted(kernels)[:10]
    assert kernels <= named
    attr = arm_icount.Attributor(lib, static=False)
    for start, _, name in bodies:
        assert attr._name(start) == name


# each ARM target's per-token prefill GEMM and quantizer layout (kernels/arm/i8mm.py, dotprod.py)
ROW_GEMMS = {"arm-yitian": ("smmla", "arm_rows"), "arm-neon": ("sdot", "arm_rows_flat")}


@pytest.mark.parametrize("target", sorted(ROW_GEMMS))
def test_per_token_activations(arm64_env, builds, tiny_q4, tmp_path, target):
    """`qwc optimize --act-scale row` then `qwc compile --target T`: every Q4_0 linear's
    prefill on the per-token GEMM (kernels/arm/i8mm.py or dotprod.py, per_row) after the per-row
    quantizers the fusions give the RMSNorm and silu(gate) * up. Under qemu: the same bits at 1, 3, 8 and
    64 threads, and every step's logits near the host's float-activation build (the kernels
    against numpy to 1e-4: tests/compiler/test_kernels.py). The tiny random model's int8
    activations move its logits by a few percent of their range: rows within 3x the block
    build's distance (measured: 2.4% blocks, 2.5-4.2% rows). Compiled with --max-batch 2: the
    batched decode, mixed step and verify entry points keep blocks."""
    from qwc.cli import main
    from qwc.manifest import Manifest

    graph, art = tmp_path / "rows.q4.onnx", tmp_path / "rows.qwc"
    assert main(["-q", "optimize", str(tiny_q4), "-o", str(graph), "--act-scale", "row"]) == 0
    assert main(["-q", "compile", str(graph), "--target", target, "-o", str(art), "--max-batch", "2"]) == 0
    quant = Manifest.from_dict(json.loads((art / "manifest.json").read_text())).quantization
    assert quant.row_activations == sum(f.count for f in quant.linears if f.format == "q4_0") - 1   # not the head
    asm = _disassemble(art)
    dot, layout = ROW_GEMMS[target]
    assert re.search(rf"<[^>]*q4_gemm_{dot}_rows[^>]*>:", asm) and re.search(rf"<[^>]*act_q8_rms_\d+_0_sum8_{layout}", asm)
    # rows in the prefill and score entry points only: decode tokens keep blocks however batched
    assert {m for m in re.findall(rf"<__tvm_ffi_(\w+?)_q4_gemm_{dot}_rows", asm)} == {"prefill", "score"}
    assert re.search(rf"<__tvm_ffi_step_q4_gemm_{dot}_\d", asm)
    runs = [_run_arm(arm64_env, art, tmp_path, threads) for threads in (1, 3, 8, 64)]
    assert all(np.array_equal(r, runs[0]) for r in runs[1:])
    rows, blocks, float_acts = runs[0], _run_arm(arm64_env, builds[target, 8], tmp_path), _host_logits(builds["host", 32])
    for r, b, f in zip(rows, blocks, float_acts):
        dist = {k: float(np.abs(v - f).max() / np.abs(f).max()) for k, v in (("rows", r), ("blocks", b))}
        assert dist["rows"] < max(3 * dist["blocks"], 0.01), dist
