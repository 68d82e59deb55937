"""The scheduler against its own earlier version: the same engine and the same requests through
runtime/scheduler.py as it is and as it was at a git revision, in alternating rounds. For a
change to the scheduler that should change neither replies nor speed:

    .venv/bin/python bench/scheduler_ab.py ART [--rev 5f650aa] [--rounds 4] [--requests 8] [--max-tokens 64]

Prints each round, whether the greedy replies are identical, the steps (and mixed steps) each
took, and the median tokens a second of each with their ratio. The earlier scheduler is read
with `git show REV:runtime/scheduler.py`, its relative imports pointed at today's package
(`next_chunk` now lives in runtime/prefill_chunks.py); a revision whose scheduler needs more
than that from the engine fails at import, with Python's own error.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
MOVED = {"engine import next_chunk": "prefill_chunks import next_chunk"}


def scheduler_at(rev: str):
    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:runtime/scheduler.py"], check=True,
                         capture_output=True, text=True).stdout
    for old, new in MOVED.items():
        src = src.replace(f"from .{old}", f"from .{new}")
    src = re.sub(r"^from \.(\w+) import", r"from qwc.runtime.\1 import", src, flags=re.M)
    path = Path(tempfile.mkdtemp()) / f"scheduler_{rev}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = mod   # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def one_round(mod, eng, prompts: list[list[int]], max_tokens: int) -> tuple[float, list, int, int]:
    from qwc.runtime.sampling import SamplingParams

    sched = mod.Scheduler(eng, max_running=len(prompts), min_reuse=None)
    done = [threading.Event() for _ in prompts]
    reqs = [mod.Request(p, max_tokens, SamplingParams(), lambda kind, _, d=d: kind == "done" and d.set(),
                        ignore_eos=True) for p, d in zip(prompts, done)]
    sched.start()
    t0 = time.perf_counter()
    for r in reqs:
        sched.submit(r)
    for d in done:
        d.wait()
    took = time.perf_counter() - t0
    sched.stop()
    return sum(len(r.generated) for r in reqs) / took, [r.generated for r in reqs], sched.steps, sched.mixed_steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--rev", default="5f650aa", help="the earlier scheduler's git revision")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int)
    a = ap.parse_args()
    from qwc.runtime import scheduler as today
    from qwc.runtime.engine import Engine

    eng = Engine(a.artifact, ctx=512, threads=a.threads)
    mods = {a.rev: scheduler_at(a.rev), "today": today}
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, min(eng.sample_limit, 20000), int(n)).tolist()
               for n in rng.integers(16, 256, a.requests)]
    rates: dict[str, list[float]] = {k: [] for k in mods}
    replies, steps = {}, {}
    for i in range(a.rounds):
        for name in (list(mods) if i % 2 == 0 else list(mods)[::-1]):
            rate, said, n, mixed = one_round(mods[name], eng, prompts, a.max_tokens)
            rates[name].append(rate)
            replies.setdefault(name, said)
            steps[name] = (n, mixed)
            print(f"round {i + 1} {name}: {rate:.1f} tok/s, {n} steps ({mixed} mixed)", flush=True)
    same = replies[a.rev] == replies["today"]
    print(f"\n{a.requests} requests of 16-256 prompt tokens, {a.max_tokens} tokens each, {eng.threads} threads; "
          f"greedy replies identical: {'yes' if same else 'NO'}\n")
    print(f"| scheduler | steps (mixed) | tok/s, median of {a.rounds} |\n| --- | ---: | ---: |")
    for k in mods:
        print(f"| {k} | {steps[k][0]} ({steps[k][1]}) | {np.median(rates[k]):.1f} |")
    print(f"\ntoday / {a.rev}: {np.median(rates['today']) / np.median(rates[a.rev]):.3f}")
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
