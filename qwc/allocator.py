"""glibc's per-thread cache of small freed blocks, sized for a decode step.

A step's TVM objects (a tensor header per kernel output, call frames) are allocated and
freed a few hundred at a time, many of one size. glibc's per-thread cache keeps 7 per size
by default; the rest go through its bins, whose slow path (sorting, coalescing) then cost a
0.5B decode step 0.7-2.5M instructions on the calling thread under qemu, varying with the
heap's history: at 64-128 threads more than the step's matrix work per thread
(bench/arm_threads.py, docs/design.md). The cache's size can only be set before the process
starts (`GLIBC_TUNABLES`), so on aarch64 the commands that run an artifact start themselves
once more with it. A program that embeds `runtime.Engine` there sets it itself (`TUNABLE`).

Not on x86: its decode and prefill speed did not move with it (SmolLM2 and the 0.5B shape, 2
threads, alternating runs within their noise), and a larger cache holds memory for good in a
server (below: `qwc serve` under structured requests grew 1.8 MiB a minute with 512, 0.05
with glibc's 7; bench/soak.py)."""

from __future__ import annotations

import os
import platform
import sys

# Not glibc's maximum (65535): a block freed on another thread than the one that allocated it
# stays in the freeing thread's cache, so with no bound a server whose threads pass objects
# along (the grammar worker's masks, the event loop's requests) grew with every tool-call
# request for good (bench/soak.py; docs/history/reliability.md); 512 a size holds a step's
# objects, and still keeps up to 512 a size of what other threads free (a bounded hoard, but
# it grew a structured-output server for minutes on x86, where it buys nothing).
TUNABLE = "glibc.malloc.tcache_count=512"
RUNS_ARTIFACTS = frozenset({"run", "serve", "bench", "eval"})
WHERE = frozenset({"aarch64", "arm64"})   # platform.machine() of the machines it pays on


def with_tunable(env: dict) -> dict:
    """env with TUNABLE added to GLIBC_TUNABLES (kept as the user set it if already there)."""
    have = env.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.tcache_count=" in have:
        return env
    return dict(env, GLIBC_TUNABLES=f"{have}:{TUNABLE}" if have else TUNABLE)


def restart_with_tunable(argv: list[str]) -> None:
    """Replace this process by `python -P -m qwc argv` with TUNABLE set, where the command runs
    an artifact on glibc on aarch64 and the variable does not say it yet; otherwise return."""
    command = next((a for a in argv if not a.startswith("-")), None)   # after -q / --quiet
    if command not in RUNS_ARTIFACTS or platform.system() != "Linux" or platform.machine() not in WHERE:
        return
    if platform.libc_ver()[0] != "glibc" or os.environ.get("QWC_NO_RESTART"):
        return
    env = with_tunable(dict(os.environ))
    if env.get("GLIBC_TUNABLES") == os.environ.get("GLIBC_TUNABLES"):
        return
    env["QWC_NO_RESTART"] = "1"   # never twice, whatever glibc made of the variable
    sys.stdout.flush()
    sys.stderr.flush()
    # -P: not the working directory first on the path, where a clone of this repository (its
    # own qwc/ folder, which has no runtime/) would shadow the installed package
    os.execve(sys.executable, [sys.executable, "-P", "-m", "qwc", *argv], env)
