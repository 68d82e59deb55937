"""Weights mapped from params.bin against weights read into memory (`--no-mmap`): speed, start
and memory of one artifact, the two ways alternating round by round (the machine is shared):

    .venv/bin/python bench/mapped_weights.py model.qwc [--rounds 3] [--threads 2] [-p 512] [-n 128] [-r 3]

Three tables:
- speed: `qwc bench`'s pp and tg (the mean of `-r` repetitions a round), a fresh process each,
  the two modes' order swapped every round (ABBA), medians and mapped / copied; and a row for
  the start: `qwc run` of a short prompt, seconds from the command's start to its first
  generated token (its own report), with the page cache warm (the rounds before read the file);
- speed in one process: an engine of each mode loaded side by side and called in turn (ABBA), a
  pp and a tg test each call: the weights' memory alone, without a fresh process's start-up and
  the machine's drift between processes (it holds the weights twice: not for a 32B);
- memory: two processes holding the artifact at once (each an Engine that decoded a token):
  one's resident set, how much of it is anonymous (its own) and the two's proportional set
  size together (pages they share counted once), from /proc/PID/smaps_rollup.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

QWC = [sys.executable, "-m", "qwc"]
MODES = {"mapped": [], "copied": ["--no-mmap"]}
HOLD = """
import sys
from qwc.runtime.engine import Engine
eng = Engine(sys.argv[1], ctx=64, threads=1, map_weights=sys.argv[2] == "mapped")
eng.prefill([1, 2, 3]); eng.decode(4)
print("ready", flush=True)
sys.stdin.readline()
"""

STEADY = """
import json, sys
from qwc.runtime.bench import run_bench
from qwc.runtime.engine import Engine
art, threads, p, n, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
engs = {m: Engine(art, ctx=max(p, n) + 16, threads=threads, map_weights=m == "mapped") for m in ("mapped", "copied")}
out = {m: [] for m in engs}
for i in range(rounds):
    for m in (("mapped", "copied") if i % 2 == 0 else ("copied", "mapped")):
        out[m].append({r["test"]: r["tps"] for r in run_bench(engs[m], p, n, reps=1)})
print(json.dumps(out))
"""


def in_one_process(art: Path, threads: int, p: int, n: int, rounds: int) -> dict[str, dict[str, list[float]]]:
    """{mode: {test: [tok/s a call]}} of the two engines called in turn in one process."""
    out = subprocess.run([sys.executable, "-c", STEADY, str(art), str(threads), str(p), str(n), str(rounds)],
                         capture_output=True, text=True, check=True).stdout
    calls = json.loads(out)
    return {m: {t: [c[t] for c in calls[m]] for t in calls[m][0]} for m in calls}


def speed_table(speed: dict[str, dict[str, list[float]]]) -> None:
    print("| test | mapped (tok/s) | copied (tok/s) | mapped / copied |\n| --- | ---: | ---: | ---: |")
    for test in speed["mapped"]:
        x, y = (statistics.median(speed[m][test]) for m in MODES)
        print(f"| {test} | {x:.2f} | {y:.2f} | {x / y:.3f}x |")


def bench_round(art: Path, mode: str, threads: int, p: int, n: int, reps: int) -> dict[str, float]:
    out = subprocess.run([*QWC, "bench", str(art), "-p", str(p), "-n", str(n), "-r", str(reps), "--threads", str(threads),
                          "--json", *MODES[mode]], capture_output=True, text=True, check=True).stdout
    return {r["test"]: r["tps"] for r in json.loads(out)["results"]}


def first_token(art: Path, mode: str, threads: int) -> float:
    err = subprocess.run([*QWC, "run", str(art), "--prompt", "The capital of France is", "--max-new-tokens", "2",
                          "--threads", str(threads), *MODES[mode]], capture_output=True, text=True, check=True).stderr
    return float(re.search(r"first token ([0-9.]+)s after start", err).group(1))


def rollup(pid: int) -> dict[str, int]:
    """smaps_rollup's fields in bytes."""
    text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    return {k: int(v) * 1024 for k, v in re.findall(r"^(\w+):\s+(\d+) kB", text, re.M)}


def two_processes(art: Path, mode: str) -> dict[str, int]:
    procs = [subprocess.Popen([sys.executable, "-c", HOLD, str(art), mode], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        for p in procs:
            if p.stdout.readline().strip() != "ready":
                raise SystemExit(f"mapped_weights: a {mode} process failed to load {art}")
        r = [rollup(p.pid) for p in procs]
    finally:
        for p in procs:
            p.communicate("\n")
    return {"rss": r[0]["Rss"], "anonymous": r[0]["Anonymous"], "pss_both": r[0]["Pss"] + r[1]["Pss"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-r", type=int, default=3, help="qwc bench's repetitions a round (their mean)")
    a = ap.parse_args()
    speed = {m: {} for m in MODES}
    start = {m: [] for m in MODES}
    for i in range(a.rounds):
        for m in (list(MODES) if i % 2 == 0 else list(MODES)[::-1]):
            for test, tps in bench_round(a.artifact, m, a.threads, a.p, a.n, a.r).items():
                speed[m].setdefault(test, []).append(tps)
            start[m].append(first_token(a.artifact, m, a.threads))
    print(f"\n{a.artifact.name}, {a.threads} threads, medians of {a.rounds} alternating rounds (ABBA)\n")
    speed_table(speed)
    x, y = (statistics.median(start[m]) for m in MODES)
    print(f"| first token after start (s) | {x:.2f} | {y:.2f} | {x / y:.3f}x |")
    print(f"\nin one process, the two engines called in turn, medians of {a.rounds * a.r} calls each\n")
    speed_table(in_one_process(a.artifact, a.threads, a.p, a.n, a.rounds * a.r))
    mem = {m: two_processes(a.artifact, m) for m in MODES}
    print("\n| weights | one process's RSS (MiB) | of it anonymous (MiB) | two processes' PSS (MiB) | PSS of two / RSS of one |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for m, r in mem.items():
        print(f"| {m} | {r['rss'] / 2**20:.1f} | {r['anonymous'] / 2**20:.1f} | {r['pss_both'] / 2**20:.1f}"
              f" | {r['pss_both'] / r['rss']:.3f}x |")


if __name__ == "__main__":
    main()
