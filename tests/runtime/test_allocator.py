"""On aarch64 the commands that run an artifact start once more with glibc's small-block cache
sized for a decode step (qwc/allocator.py); nothing else does, nothing does on x86, and a
user's own setting is kept."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from qwc import allocator


@pytest.fixture
def execs(monkeypatch):
    calls = []
    monkeypatch.setattr(os, "execve", lambda exe, argv, env: calls.append((exe, argv, env)))
    monkeypatch.delenv("QWC_NO_RESTART", raising=False)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.setattr(allocator.platform, "machine", lambda: "aarch64")
    return calls


@pytest.mark.parametrize("command", ["run", "serve", "bench", "eval"])
@pytest.mark.parametrize("quiet", [[], ["-q"]])
def test_artifact_commands_restart_with_the_tunable(execs, command, quiet):
    allocator.restart_with_tunable([*quiet, command, "m.qwc", "--threads", "2"])
    (exe, argv, env), = execs
    assert argv == [sys.executable, "-P", "-m", "qwc", *quiet, command, "m.qwc", "--threads", "2"]
    assert env["GLIBC_TUNABLES"] == allocator.TUNABLE and env["QWC_NO_RESTART"] == "1"


@pytest.mark.parametrize("argv", [[], ["compile", "m.onnx"], ["export", "tiny"], ["targets"]])
def test_other_commands_do_not_restart(execs, argv):
    allocator.restart_with_tunable(argv)
    assert execs == []


def test_nothing_restarts_on_x86(execs, monkeypatch):
    monkeypatch.setattr(allocator.platform, "machine", lambda: "x86_64")
    allocator.restart_with_tunable(["serve", "m.qwc"])
    assert execs == []


def test_a_users_tunables_are_kept_and_no_second_restart(execs, monkeypatch):
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.check=0")
    allocator.restart_with_tunable(["run", "m.qwc"])
    assert execs[0][2]["GLIBC_TUNABLES"] == f"glibc.malloc.check=0:{allocator.TUNABLE}"
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.tcache_count=8")   # the user's own size
    allocator.restart_with_tunable(["run", "m.qwc"])
    monkeypatch.setenv("QWC_NO_RESTART", "1")
    monkeypatch.delenv("GLIBC_TUNABLES")
    allocator.restart_with_tunable(["run", "m.qwc"])
    assert len(execs) == 1


def test_the_qwc_command_really_restarts_with_it(tmp_path):
    """End to end: every Python process started prints its GLIBC_TUNABLES (a sitecustomize on
    PYTHONPATH, which also makes the machine aarch64 to Python): `qwc run` runs twice, the
    second time with the tunable; `qwc compile` once, without it."""
    (tmp_path / "sitecustomize.py").write_text(
        "import os, platform, sys\nplatform.machine = lambda: 'aarch64'\n"
        "print('TUNABLES', os.environ.get('GLIBC_TUNABLES'), file=sys.stderr)\n")
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "QWC_NO_RESTART")}
    env["PYTHONPATH"] = str(tmp_path)
    # run where a folder named qwc (a clone of this repository's own, which has no runtime/)
    # would shadow the installed package if the restart put the working directory on the path
    (tmp_path / "cwd" / "qwc").mkdir(parents=True)
    (tmp_path / "cwd" / "qwc" / "__init__.py").write_text("")
    (tmp_path / "cwd" / "qwc" / "__main__.py").write_text("raise SystemExit('the working directory shadowed qwc')")
    seen = {}
    for command in ("run", "compile"):
        # -P: as the `qwc` console script starts, without the working directory on the path
        r = subprocess.run([sys.executable, "-P", "-m", "qwc", command, str(tmp_path / "missing")], env=env,
                           capture_output=True, text=True, timeout=120, cwd=tmp_path / "cwd")
        assert r.returncode != 0 and "qwc: error:" in r.stderr   # the command itself ran, and refused
        seen[command] = [line for line in r.stderr.splitlines() if line.startswith("TUNABLES")]
    assert seen["run"] == ["TUNABLES None", f"TUNABLES {allocator.TUNABLE}"]
    assert seen["compile"] == ["TUNABLES None"]
