"""Where a decode step's time goes, kernel by kernel and thread by thread: perf (Debian's
linux-perf) samples a process while it decodes an artifact, after its prompt:

    .venv/bin/python bench/decode_profile.py ART.qwc [--threads 2] [--past 512] [--steps 1000] [--top 15]

The process loads the artifact, prefills `--past` tokens and waits; perf attaches and the
process decodes `--steps` tokens (the context grows from past to past + steps), so neither the
load nor the prompt is sampled. Two tables:

- per thread: its samples in the artifact's kernels, in the kernel of the system (on TVM's pool
  that is a thread waiting: `sched_yield` while another thread still works, or while the
  calling thread runs the VM and Python), and in the host's code (the VM, Python, libc);
- per kernel: its share of the kernels' samples over all threads, the functions named by the
  artifact's `__tvm_ffi_*` entry points (a parallel body is attributed to the entry point it
  follows in lib.so).

A thread that waits while the other still reads weights is the time issue 90 counts: what a
decode step loses to its launches' barriers and to the host, kernel by kernel what `bench/gemv.py
--decode` measures as one figure.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HOST = ("libpython", "libtvm", "libc.so", "_multiarray", "core.cpython", "libstdc++", "ld-linux")


def child(art: Path, threads: int, past: int, steps: int) -> None:
    """Load, prefill, say so, wait for a line on stdin, then decode and print tokens a second;
    then wait for another line before exiting, so that the interpreter's shutdown (its last
    garbage collections) is not sampled."""
    from qwc.runtime.engine import Engine

    eng = Engine(art, ctx=past + steps + 16, threads=threads)
    eng.prefill([1000 + i % 1000 for i in range(past)])
    print("ready", flush=True)
    sys.stdin.readline()
    t0 = time.perf_counter()
    for i in range(steps):
        eng.decode(5 + i % 1000)
    print(f"{steps / (time.perf_counter() - t0):.1f}", flush=True)
    sys.stdin.readline()


def kernel_starts(lib: Path) -> tuple[list[int], list[str]]:
    """The addresses and names of lib.so's `__tvm_ffi_*` entry points, in order."""
    out = subprocess.run(["nm", "-n", "--defined-only", str(lib)], capture_output=True, text=True, check=True).stdout
    rows = [(int(a, 16), n[len("__tvm_ffi_"):]) for a, t, n in (line.split() for line in out.splitlines()
                                                                  if len(line.split()) == 3)
            if t == "T" and n.startswith("__tvm_ffi_")]
    return [a for a, _ in rows], [n for _, n in rows]


def samples(data: Path) -> list[tuple[float, str, str, str]]:
    """(share %, thread, dso, symbol or address) of each row of perf's report."""
    rep = subprocess.run(["perf", "report", "-i", str(data), "--sort", "pid,dso,sym", "--stdio", "--no-children"],
                         capture_output=True, text=True, check=True).stdout
    rows = []
    for line in rep.splitlines():
        m = re.match(r"\s*([\d.]+)%\s+(\d+):\S+\s+(\S+)\s+\[[.k]\]\s+(\S+)", line)
        if m:
            rows.append((float(m.group(1)), m.group(2), m.group(3), m.group(4)))
    return rows


def report(rows, starts: tuple[list[int], list[str]], top: int, main_tid: int) -> None:
    addrs, names = starts
    threads = collections.defaultdict(collections.Counter)
    kernels = collections.Counter()
    for share, tid, dso, sym in rows:
        if dso == "lib.so" or dso.startswith("[JIT]"):
            where = "kernels"
            name = sym
            if re.fullmatch(r"0x[0-9a-f]+", sym):
                i = bisect.bisect_right(addrs, int(sym, 16)) - 1
                name = names[i] if i >= 0 else sym
            kernels[name.removeprefix("__tvm_ffi_")] += share
        elif dso == "[kernel.kallsyms]":
            where = "waiting (system)"
        elif any(h in dso for h in HOST):
            where = "host (VM, Python, libc)"
        else:
            where = "other"
        threads[tid][where] += share
    cols = ("kernels", "waiting (system)", "host (VM, Python, libc)", "other")
    print("| thread | " + " | ".join(cols) + " |")
    print("| --- |" + " ---: |" * len(cols))
    for tid, c in sorted(threads.items(), key=lambda kv: -sum(kv[1].values())):
        total = sum(c.values())
        label = f"{tid} (the caller's)" if int(tid) == main_tid else f"{tid} (a pool worker)"
        print(f"| {label} | " + " | ".join(f"{100 * c[k] / total:.1f}%" for k in cols) + " |")
    total = sum(kernels.values())
    print("\n| kernel (its share of the kernels' samples) | share |\n| --- | ---: |")
    shown = [(name, share) for name, share in kernels.most_common(top) if share >= 0.0005 * total]
    for name, share in shown:
        print(f"| {name} | {100 * share / total:.1f}% |")
    rest = total - sum(s for _, s in shown)
    if rest >= 0.0005 * total:
        print(f"| (the rest) | {100 * rest / total:.1f}% |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("artifact", type=Path)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--past", type=int, default=512, help="prompt tokens before the decoded ones")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        return child(a.artifact, a.threads, a.past, a.steps)
    if shutil.which("perf") is None:
        sys.exit("decode_profile: no `perf` here (Debian: apt-get install linux-perf)")
    if not (a.artifact / "lib.so").is_file():
        sys.exit(f"decode_profile: {a.artifact} is not an artifact (no lib.so)")
    proc = subprocess.Popen([sys.executable, __file__, str(a.artifact), "--child", "--threads", str(a.threads),
                             "--past", str(a.past), "--steps", str(a.steps)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    if proc.stdout.readline().strip() != "ready":
        sys.exit(f"decode_profile: the decoding process failed (exit {proc.wait()})")
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "perf.data"
        perf = subprocess.Popen(["perf", "record", "-q", "-F", "2000", "-p", str(proc.pid), "-o", str(data)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(0.5)   # perf attached
        proc.stdin.write("go\n")
        proc.stdin.flush()
        rate = proc.stdout.readline().strip()
        perf.send_signal(signal.SIGINT)   # perf writes its data and detaches
        perf.wait()
        proc.stdin.write("exit\n")
        proc.stdin.flush()
        proc.wait()
        rows = samples(data)
    print(f"{a.artifact.name}: {a.threads} threads, {a.steps} decode steps after {a.past} tokens, {rate} tok/s\n")
    report(rows, kernel_starts(a.artifact / "lib.so"), a.top, proc.pid)


if __name__ == "__main__":
    main()
