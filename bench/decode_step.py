"""The batched decode step of artifacts side by side: `Engine.decode_many` of B sequences (64
cached tokens a row, or --depth), per B, the artifacts alternated round by round on this noisy
machine, the best round's median reported (bench/serve.py's step measure):

    .venv/bin/python bench/decode_step.py A.qwc B.qwc [--batches 1,2,4,6,8,12,16] [--rounds 3] [--depth 64]
                                          [--chunk N]

--chunk N: a mixed step instead (`Engine.step`: the B decode tokens and N tokens of another
sequence's prompt in one call, that prompt `depth` tokens in as well).

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
    ap.add_argument("--depth", type=int, default=64, help="cached tokens a row (default 64)")
    ap.add_argument("--chunk", type=int, help="a mixed step: B decode tokens and a prompt chunk of this many")
    a = ap.parse_args()
    counts = [int(b) for b in a.batches.split(",")]
    os.environ.setdefault("TVM_USE_RUNTIME_LIB", "1")
    from qwc.bench.serve import decode_steps
    from qwc.runtime.engine import Engine

    engines = {art: Engine(art, ctx=max(512, a.depth + (a.chunk or 0) + 16), threads=a.threads) for art in a.artifacts}
    for art, eng in engines.items():
        if eng.max_batch < max(counts) + bool(a.chunk) or (a.chunk and not eng.mixes_steps):
            sys.exit(f"decode_step: {art} decodes at most {eng.max_batch} sequences at once (qwc compile --max-batch)")
    best: dict = {art: {} for art in engines}
    for _ in range(a.rounds):
        for art, eng in engines.items():
            for b, ms in (mixed_steps(eng, counts, a.depth, a.chunk) if a.chunk
                          else decode_steps(eng, counts, a.depth)).items():
                best[art][b] = min(ms, best[art].get(b, float("inf")))
    print("| artifact | " + " | ".join(f"B = {b}, ms" for b in counts) + " |")
    print("| --- |" + " ---: |" * len(counts))
    for art in engines:
        print(f"| {art.name} | " + " | ".join(f"{best[art][b]:.2f}" for b in counts) + " |")


def mixed_steps(eng, counts: list[int], depth: int, chunk: int) -> dict:
    """One mixed step (B decode tokens and a `chunk`-token prompt chunk of row B), every row
    `depth` tokens in, the median of 10, per B."""
    import time

    import numpy as np

    seqs = eng.pool(max(counts) + 1).seqs
    steps = {}
    for b in counts:
        for s in seqs[:b + 1]:
            eng.reset(s)
            eng.prefill([100 + i % 1000 for i in range(depth)], s)
        ts = []
        for _ in range(11):
            for s in seqs[:b + 1]:
                s.pos = depth
            t0 = time.perf_counter()
            eng.step([(s, [5]) for s in seqs[:b]] + [(seqs[b], list(range(200, 200 + chunk)))])
            ts.append(time.perf_counter() - t0)
        steps[b] = float(np.median(ts[1:])) * 1000
    return steps


if __name__ == "__main__":
    main()
