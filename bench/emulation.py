"""The environment for running qwc's runtime under qemu-aarch64, shared by tests/arm/test_arm.py,
the kernel tests and bench/arm_icount.py: prepares it with scripts/arm64/setup.sh if missing,
reads its env.sh, and builds the command lines of the runners in scripts/arm64."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

from qwc.allocator import with_tunable

REPO = Path(__file__).resolve().parent.parent
HERE = REPO / "scripts" / "arm64"   # setup.sh and the runners the emulated python runs


def arm64_env(single_thread: bool = False) -> dict:
    d = Path(os.environ.get("QWC_ARM64_DIR", Path.home() / ".cache" / "qwc" / "arm64"))
    if not (d / "env.sh").is_file():
        subprocess.run(["bash", str(HERE / "setup.sh"), str(d)], check=True)
    env = dict(os.environ)
    for line in (d / "env.sh").read_text().splitlines():
        m = re.match(r"export (\w+)=(.*)", line)
        if m:
            env[m.group(1)] = m.group(2).strip('"')
    env["PYTHONPATH"] = env["QWC_ARM64_SITE"]
    env["TVM_USE_RUNTIME_LIB"] = "1"   # the runtime alone: 4-6 s to import under emulation
    # glibc's small-block cache as `qwc run` sets it: the runners measure the Engine as the
    # command runs it
    env.update(with_tunable(env))
    # every run checks the artifact's hashes (qwc/checksum.py remembers them otherwise): the
    # counts are differences of runs, and start-up cancels only where it is the same work
    env["QWC_VERIFY_CACHE"] = "off"
    if single_thread:
        env["TVM_NUM_THREADS"] = "1"
    return env


def python_command(env: dict, script, *args, plugin: str | None = None) -> list[str]:
    """qemu-aarch64 [-plugin P] python3.11 SCRIPT ARGS..."""
    qemu = shlex.split(env["QWC_ARM64_PY"])
    if plugin:
        qemu = [qemu[0], "-plugin", plugin, *qemu[1:]]
    return qemu + [str(script), *map(str, args)]


def run_library(env: dict, lib, inputs: dict, workdir, threads=(1,), timeout: int = 600) -> list:
    """Every function of a cross-compiled Relax library on `inputs` ("<function>/<i>": argument
    i; run_module.py), once for each thread count, in one emulated process: the outputs of each
    run ({function: array}). Raises with the run's stderr if one fails or runs other than every
    function on aarch64."""
    import numpy as np

    workdir = Path(workdir)
    np.savez(workdir / "in.npz", **inputs)
    functions = len({k.split("/")[0] for k in inputs})
    counts = ",".join(map(str, threads))
    r = subprocess.run(python_command(env, HERE / "run_module.py", lib, workdir / "in.npz", workdir / "out{t}.npz", counts),
                       env=dict(env, TVM_NUM_THREADS=str(max(threads))), capture_output=True, text=True,
                       timeout=timeout * len(threads))
    if r.returncode != 0 or r.stdout.split() != ["aarch64", str(functions)] * len(threads):
        raise RuntimeError(f"run_module.py at {counts} threads: {r.stdout.strip()} {r.stderr[-2000:]}")
    return [np.load(workdir / f"out{t}.npz") for t in threads]


def engine_command(env: dict, artifact, out, steps_json: str, plugin: str | None = None) -> list[str]:
    """run_engine.py REPO ARTIFACT OUT STEPS under the emulated python."""
    return python_command(env, HERE / "run_engine.py", REPO, artifact, out, steps_json, plugin=plugin)


def cli_command(env: dict, *args, plugin: str | None = None) -> list[str]:
    """`qwc ARGS...` as an ARM machine runs it (run_cli.py: the runtime-only commands)."""
    return python_command(env, HERE / "run_cli.py", REPO, *args, plugin=plugin)
