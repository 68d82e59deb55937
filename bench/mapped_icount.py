"""Weights mapped from params.bin against weights read into memory (`--no-mmap`) on ARM, in guest
instructions under qemu (one thread, the counting plugin arm_icount.py uses): the ARM half of
bench/mapped_weights.py, where emulated wall time means nothing.

    .venv/bin/python bench/mapped_icount.py ARM.qwc [--prompt 8,24] [--gen 2,6]

`qwc bench` of the arm-yitian artifact runs under qemu as an ARM machine runs it (the runtime
alone), once per mode and size, the modes alternating. Per token = the difference of two runs
over the difference in tokens, so start-up cancels: prefill from `-p` of the two `--prompt`
sizes with no generation, decode from `-n` of the two `--gen` sizes with no prompt test.
The start row is the whole of the smaller prefill run: loading, which differs between the
modes (reading params.bin copies it, mapping does not), and everything else, which does not.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from qwc.bench import emulation
from qwc.bench.arm_icount import plugin

MODES = {"mapped": [], "copied": ["--no-mmap"]}


def count(env, plug: str, art: Path, mode: str, prompt: int, gen: int, work: Path) -> int:
    """Guest instructions of one `qwc bench ART -p PROMPT -n GEN -r 1`."""
    out = work / f"{mode}-{prompt}-{gen}.counts"
    cmd = emulation.cli_command(env, "bench", art, "-p", prompt, "-n", gen, "-r", "1", "--threads", "1",
                                *MODES[mode], plugin=f"{plug},out={out}")
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=7200)
    if r.returncode != 0 or "qwc-icount:" not in r.stderr:
        sys.exit(f"mapped_icount: the emulated qwc bench failed: {r.stderr.strip().splitlines()[-1:]}")
    return sum(int(line.split()[1]) for line in out.read_text().splitlines())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifact", type=Path, help="an arm-yitian artifact")
    ap.add_argument("--prompt", default="8,24", help="the two prompt sizes of the prefill difference")
    ap.add_argument("--gen", default="2,6", help="the two generation lengths of the decode difference")
    ap.add_argument("--workdir", type=Path, default=Path("build/mapped_icount"))
    args = ap.parse_args()
    p0, p1 = map(int, args.prompt.split(","))
    g0, g1 = map(int, args.gen.split(","))
    args.workdir.mkdir(parents=True, exist_ok=True)
    env, plug = emulation.arm64_env(single_thread=True), plugin()
    runs = {}   # deterministic counts: one run of each, no rounds
    for mode in MODES:
        for prompt, gen in ((p0, 0), (p1, 0), (0, g0), (0, g1)):
            runs[mode, prompt, gen] = count(env, plug, args.artifact, mode, prompt, gen, args.workdir)
            print(f"{mode} -p {prompt} -n {gen}: {runs[mode, prompt, gen]:,}", file=sys.stderr, flush=True)

    def row(mode):
        prefill = (runs[mode, p1, 0] - runs[mode, p0, 0]) / (p1 - p0)
        decode = (runs[mode, 0, g1] - runs[mode, 0, g0]) / (g1 - g0)
        return prefill, decode, runs[mode, p0, 0]

    m, c = row("mapped"), row("copied")
    print(f"{args.artifact.name}: guest instructions under qemu, one thread\n")
    print("| | mapped | copied (--no-mmap) | mapped / copied |")
    print("| --- | ---: | ---: | ---: |")
    for name, a, b in zip((f"prefill a token (-p {p0} -> {p1})", f"decode a token (-n {g0} -> {g1})",
                           f"a whole run of -p {p0} (start included)"), m, c):
        print(f"| {name} | {a:,.0f} | {b:,.0f} | {a / b:.4f}x |")


if __name__ == "__main__":
    main()
