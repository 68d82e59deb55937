"""`qwc compile`'s time with the kernel cache off, cold and warm: what the cache of kernels'
TIR and machine code (compiler/kernels/kernel_cache.py, compiler/kernel_objects.py) saves.

Each round compiles each graph three times, in turn: with `QWC_KERNEL_CACHE=off` (the module
built whole, every kernel parsed), into an empty cache folder (cold: every kernel parsed and
built, each as an object of its own), and again into that folder (warm: a second compile of
the model, or of a fine-tune of it). Prints the medians of the stage times `qwc compile`
reports.

    .venv/bin/python bench/compile_time.py GRAPH.onnx [GRAPH.onnx ...] --target host --rounds 3
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

QWC = Path(sys.executable).with_name("qwc")
SUMMARY = re.compile(r"in ([\d.]+)s \(passes ([\d.]+)s, import ([\d.]+)s, build ([\d.]+)s, write ([\d.]+)s\)")
MODES = ("off", "cold", "warm")


def compile_once(graph: Path, target: str, out: Path, cache: str) -> list[float]:
    env = dict(os.environ, QWC_KERNEL_CACHE=cache)
    r = subprocess.run([str(QWC), "compile", str(graph), "--target", target, "-o", str(out)],
                       env=env, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"compile_time: qwc compile {graph} failed: {r.stderr.strip().splitlines()[-1]}")
    m = SUMMARY.search(r.stderr)
    if m is None:
        sys.exit(f"compile_time: no summary line in qwc compile's output for {graph}")
    return [float(x) for x in m.groups()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("graphs", nargs="+", type=Path, help="canonical graphs (qwc optimize's output)")
    ap.add_argument("--target", default="host")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    times = {(g, m): [] for g in a.graphs for m in MODES}
    with tempfile.TemporaryDirectory() as d:
        for r in range(a.rounds):
            for g in a.graphs:
                cache = Path(d) / f"cache-{r}-{g.stem}"
                for mode in MODES:
                    where = "off" if mode == "off" else str(cache)
                    times[g, mode].append(compile_once(g, a.target, Path(d) / f"{mode}.qwc", where))
    print("| graph | cache | total s | import s | build s | write s | total / off |\n"
          "| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for g in a.graphs:
        off = statistics.median(t[0] for t in times[g, "off"])
        for mode in MODES:
            med = [statistics.median(t[i] for t in times[g, mode]) for i in range(5)]
            print(f"| {g.name} | {mode} | {med[0]:.1f} | {med[2]:.1f} | {med[3]:.1f} | {med[4]:.1f} | "
                  f"{med[0] / off:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
