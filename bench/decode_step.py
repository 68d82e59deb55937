"""The batched decode step of artifacts side by side: `Engine.decode_many` of B sequences (64
cached tokens a row), per B, the artifacts alternated round by round on this noisy machine, the
best round's median reported (bench/serve.py's step measure):

    .venv/bin/python bench/decode_step.py A.qwc B.qwc [--batches 1,2,4,6,8,12,16] [--rounds 3]

Artifacts compiled with `qwc compile --max-batch` at least the largest B; compare two builds of
the same ONNX (a kernel before and after a change).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

HERE = Path(__file__).parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifacts", nargs="+", type=Path)
    ap.add_argument("--batches", default="1,2,4,6,8,12,16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    a = ap.parse_args()
    counts = [int(b) for b in a.batches.split(",")]
    os.environ.setdefault("TVM_USE_RUNTIME_LIB", "1")
    sys.path.insert(0, str(HERE))
    from serve import decode_steps

    from qwc.runtime.engine import Engine

    engines = {art: Engine(art, ctx=512, threads=a.threads) for art in a.artifacts}
    for art, eng in engines.items():
        if eng.max_batch < max(counts):
            sys.exit(f"decode_step: {art} decodes at most {eng.max_batch} sequences at once (qwc compile --max-batch)")
    best: dict = {art: {} for art in engines}
    for _ in range(a.rounds):
        for art, eng in engines.items():
            for b, ms in decode_steps(eng, counts).items():
                best[art][b] = min(ms, best[art].get(b, float("inf")))
    print("| artifact | " + " | ".join(f"B = {b}, ms" for b in counts) + " |")
    print("| --- |" + " ---: |" * len(counts))
    for art in engines:
        print(f"| {art.name} | " + " | ".join(f"{best[art][b]:.2f}" for b in counts) + " |")


if __name__ == "__main__":
    main()
