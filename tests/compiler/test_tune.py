"""`qwc tune`: a short session on the tiny model writes its database, survives being killed
mid-way and resumes; `qwc compile --tuning-db` builds a correct artifact with tuned schedules;
the RPC path measures on a local tracker's servers (the host, and arm64 under qemu)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from qwc.cli import main
from qwc.compiler import tuning
from qwc.compiler.targets import get_target
from qwc.errors import QwcError
from qwc.passes.pipeline import load_graph
from qwc.passes.verify import run_steps, session
from qwc.runtime.engine import Engine

pytestmark = pytest.mark.slow
QWC = [sys.executable, "-m", "qwc"]


def _summary(db: Path) -> dict:
    try:
        return json.loads((db / tuning.SUMMARY).read_text())["tasks"]
    except (OSError, ValueError, KeyError):
        return {}


def _assert_matches_onnxruntime(art: Path, q4: Path, cfg):
    ids = np.random.default_rng(3).integers(0, cfg.vocab_size, 9)
    eng = Engine(art, ctx=64)
    got = [eng.prefill(ids)] + [eng.decode(t) for t in (5, 17, 99)]
    steps = [ids[None]] + [np.array([[t]]) for t in (5, 17, 99)]
    ref = [r[0, -1] for r in run_steps(session(q4), cfg, steps, ctx=64)]
    for a, b in zip(got, ref):
        assert np.abs(a - b).max() <= 1e-3 * (b.max() - b.min())


def test_tasks_are_deduplicated_by_kind_and_shape(tiny_q4):
    tasks = tuning.extract_tasks(load_graph(tiny_q4))
    keys = [t.key for t in tasks]
    assert len(keys) == len(set(keys)) == 10  # 5 shapes (q/o, k/v, gate/up, down, lm_head) x gemv/gemm
    assert {t.uses for t in tasks if t.key.startswith("q4_f32_gemv_64x")} == {4}


def test_session_is_killed_then_resumes_and_compiles(tiny_q4, tiny_lm, tmp_path):
    db = tmp_path / "db"
    cmd = [*QWC, "tune", str(tiny_q4), "--act-bits", "32", "--trials", "2", "--db", str(db)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 600
    while sum(r["done"] for r in _summary(db).values()) < 2:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no task finished in 10 minutes"
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    done_before = {k for k, r in _summary(db).items() if r["done"]}
    assert 2 <= len(done_before) < 10

    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stderr
    assert f"resuming {db}: {len(done_before)}/10 tasks already tuned" in r.stderr
    for key in done_before:
        assert f"{key} (used" not in r.stderr          # finished tasks are not tuned again
    tasks = _summary(db)
    assert len(tasks) == 10 and all(t["done"] and t["trials"] == 2 and t["hand_s"] > 0 for t in tasks.values())
    assert all(t["best_s"] > 0 and t["knobs"]["rows"] >= 1 for t in tasks.values())
    records = (db / "database_tuning_record.json").read_text().splitlines()
    assert len(records) == 20
    assert "| q4_f32_gemv_64x128" in r.stdout

    art = tmp_path / "tuned.qwc"
    assert main(["-q", "compile", str(tiny_q4), "--act-bits", "32", "--tuning-db", str(db), "-o", str(art)]) == 0
    _assert_matches_onnxruntime(art, tiny_q4, tiny_lm.config)


def test_compile_uses_only_faster_records(tiny_q4, tiny_lm, tmp_path):
    """Tuned knobs that differ from the hand schedule's (rows 1, 4-token tiles) still compute the
    same model; records slower than the hand schedule are ignored."""
    db = tmp_path / "db"
    db.mkdir()
    tasks = {t.key: {"hand_s": 1.0, "best_s": 0.5, "knobs": {"rows": 1, "tokens": 4}, "trials": 1, "done": True}
             for t in tuning.extract_tasks(load_graph(tiny_q4))}
    slow = "q4_f32_gemv_64x128"
    tasks[slow] = {**tasks[slow], "best_s": 2.0, "knobs": {"rows": 2}}
    (db / tuning.SUMMARY).write_text(json.dumps({"format": 1, "target": "host", "tasks": tasks}))
    assert set(tuning.tuned_knobs(db, get_target("host"))) == set(tasks) - {slow}
    art = tmp_path / "t.qwc"
    assert main(["-q", "compile", str(tiny_q4), "--act-bits", "32", "--tuning-db", str(db), "-o", str(art)]) == 0
    manifest = json.loads((art / "manifest.json").read_text())
    assert slow not in manifest["quantization"]["tuned_kernels"] and len(manifest["quantization"]["tuned_kernels"]) == 9
    _assert_matches_onnxruntime(art, tiny_q4, tiny_lm.config)


def test_w4a8_session_and_compile_with_other_tiles(tiny_q4, tmp_path, capsys):
    """An x86-avx512 artifact is W4A8: `qwc tune` tunes its prefill GEMMs' tile (MetaSchedule
    traces annotate it; one task, within a time budget), and an artifact built with other tiles
    computes the same logits. (The host's own target has no such knob where the CPU has AMX:
    test_tune_errors.)"""
    from qwc import cpu

    if not cpu.has("avx512_vnni"):
        # The host's default is W4A8 with AVX2 too, and this test passes there (2026-11-26, Zen 3),
        # but took 618 s on two cores: the tuning code is the same for both dots, so the suite
        # (CI's 45 minutes) runs it on VNNI hosts only.
        pytest.skip("tunes the x86 W4A8 kernels; run here only with AVX-512 VNNI (the W4A8 "
                    "tuning path on ARM: test_rpc_tuning_against_local_servers)")
    db, target = tmp_path / "db", ["--target", "x86-avx512"]
    keys = [t.key for t in tuning.extract_tasks(load_graph(tiny_q4), 8, get_target("x86-avx512").features)]
    assert len(keys) == 5 and all(k.startswith("q4_a8_gemm_") for k in keys)
    # a budget of 3 s: the first task, then no new one (each is a few builds and runs)
    assert main(["-q", "tune", str(tiny_q4), *target, "--trials", "2", "--time-budget", "0.05", "--db", str(db)]) == 0
    tasks = _summary(db)
    assert list(tasks) == keys[:1]
    assert all(t["done"] and t["trials"] == 2 and t["hand_s"] > 0 and t["knobs"]["tokens"] in (1, 2, 4, 8)
               for t in tasks.values())
    assert f"| {keys[0]}" in capsys.readouterr().out
    hand = tmp_path / "hand.qwc"
    assert main(["-q", "compile", str(tiny_q4), *target, "-o", str(hand)]) == 0
    ids = list(np.random.default_rng(4).integers(0, 259, 11))    # 11 tokens: tiles and leftovers
    ref = Engine(hand, ctx=64).prefill(ids)
    # every task's record as if tuned to 4-token tiles, faster than the hand schedule's 8
    forced = {k: {"hand_s": 1.0, "best_s": 0.5, "knobs": {"tokens": 4}, "trials": 2, "done": True} for k in keys}
    (db / tuning.SUMMARY).write_text(json.dumps({"format": 1, "target": "x86-avx512", "tasks": forced}))
    art = tmp_path / "t4.qwc"
    assert main(["-q", "compile", str(tiny_q4), *target, "--tuning-db", str(db), "-o", str(art)]) == 0
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["quantization"]["tuned_kernels"] == {k: {"tokens": 4} for k in keys}
    got = Engine(art, ctx=64).prefill(ids)
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5 * np.abs(ref).max())
    assert (art / "lib.so").read_bytes() != (hand / "lib.so").read_bytes()   # the tiles changed the code


def test_tune_errors(tiny_q4, tmp_path, capsys):
    db = tmp_path / "db"
    db.mkdir()
    (db / tuning.SUMMARY).write_text(json.dumps({"format": 1, "target": "x86-avx2", "tasks": {}}))
    assert main(["-q", "tune", str(tiny_q4), "--db", str(db)]) == 2
    assert "holds tuning for target x86-avx2, not host" in capsys.readouterr().err
    assert main(["-q", "tune", str(tiny_q4), "--target", "arm-yitian", "--db", str(tmp_path / "a")]) == 2
    assert "does not run on this machine" in capsys.readouterr().err
    assert main(["-q", "tune", str(tiny_q4), "--rpc-tracker", "nohost", "--rpc-key", "k", "--db", str(db)]) == 2
    assert "expected HOST:PORT" in capsys.readouterr().err
    assert main(["-q", "compile", str(tiny_q4), "--act-bits", "32", "--tuning-db", str(tmp_path / "none"), "-o", str(tmp_path / "o")]) == 2
    assert "not a tuning database" in capsys.readouterr().err
    # AMX's prefill tiles are 16 tokens by construction: a W4A8 x86-amx artifact has nothing to
    # tune, and says so before any database is made (the AMX host's own default, too)
    assert tuning.extract_tasks(load_graph(tiny_q4), 8, get_target("x86-amx").features) == []
    with pytest.raises(QwcError, match="no tunable kernels for --act-bits 8 on x86-amx: its prefill GEMMs take "
                                       "AMX's fixed 16-token tiles"):
        tuning.run(tiny_q4, get_target("x86-amx"), 2, tmp_path / "amx")
    assert not (tmp_path / "amx").exists()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tracker(tmp_path_factory):
    """A TVM RPC tracker and a server on 127.0.0.1: the emulated arm64 Python of scripts/arm64
    (key `arm64`, through scripts/arm64/rpc_server.py)."""
    from qwc.bench import emulation

    logs = tmp_path_factory.mktemp("rpc")
    port = _free_port()
    procs = []

    def start(cmd, name, env=None):
        log = open(logs / f"{name}.log", "w")
        procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True),
                      logs / f"{name}.log"))

    start([sys.executable, "-m", "tvm.exec.rpc_tracker", "--host", "127.0.0.1", "--port", str(port),
           "--port-end", str(port + 1)], "tracker")
    time.sleep(2)
    env = emulation.arm64_env(single_thread=True)
    env.pop("TVM_USE_RUNTIME_LIB")  # the RPC server needs the full Python package
    p = _free_port()
    start([*env["QWC_ARM64_PY"].split(), str(emulation.HERE / "rpc_server.py"), "--tracker", f"127.0.0.1:{port}",
           "--port", str(p), "--port-end", str(p + 10), "--key", "arm64"], "arm64", env)
    deadline = time.monotonic() + 300
    while True:   # both servers registered?
        for proc, log in procs:
            assert proc.poll() is None, log.read_text()[-2000:]
        q = subprocess.run([sys.executable, "-m", "tvm.exec.query_rpc_tracker", "--host", "127.0.0.1",
                            "--port", str(port)], capture_output=True, text=True)
        if "arm64 " in q.stdout:
            break
        assert time.monotonic() < deadline, q.stdout + q.stderr
        time.sleep(2)
    yield f"127.0.0.1:{port}"
    for proc, _ in procs:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.arm
@pytest.mark.parametrize("target, key, act, n_tasks", [("arm-yitian", "arm64", 8, 5)])
def test_rpc_tuning_against_local_servers(tiny_q4, tmp_path, tracker, target, key, act, n_tasks):
    """arm-yitian's default kernels, the W4A8 smmla prefill GEMMs (5 tasks), measured on the
    emulated arm64 server. (The W4A32 tasks over RPC, host and arm64, took 12 of CI's 45
    minutes; the W4A32 tuning itself runs in test_session_is_killed_then_resumes_and_compiles,
    and the RPC path is the same for every kind of task.)"""
    db = tmp_path / "db"
    r = subprocess.run([*QWC, "tune", str(tiny_q4), "--target", target, "--act-bits", str(act), "--trials", "1",
                        "--db", str(db), "--rpc-tracker", tracker, "--rpc-key", key],
                       capture_output=True, text=True, timeout=3000)
    assert r.returncode == 0, r.stderr[-2000:]
    tasks = _summary(db)
    assert len(tasks) == n_tasks and all(t["done"] and t["best_s"] > 0 and t["hand_s"] > 0 for t in tasks.values())
    assert all(k.startswith("q4_f32_" if act == 32 else "q4_a8_gemm_") for k in tasks)
    summary = json.loads((db / tuning.SUMMARY).read_text())
    assert summary["target"] == target
    # records measured remotely, with their traces: the knob decisions
    recs = [json.loads(x) for x in (db / "database_tuning_record.json").read_text().splitlines()]
    assert len(recs) == n_tasks
    assert max(t["hand_s"] for t in tasks.values()) > 1e-4   # emulated: far slower than this machine
