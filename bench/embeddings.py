"""/v1/embeddings batched against one input a request: N passages of a novel embedded by one
request listing them all (the scheduler packs them into embed_step calls, several sequences a
call: runtime/embeddings.py) and by N requests one after another, alternating rounds, through a
real `qwc serve` over HTTP:

    .venv/bin/python bench/embeddings.py ART.qwc [--inputs 64] [--rounds 3] [--threads 2] [--pooling last]

The artifact needs a tokenizer and the embed entry points (`qwc compile --embeddings`), with
`--max-batch N` (N >= 2) for batches (the server runs N sequences). Reported: the median seconds of
each way, its inputs a second, and the batched / sequential ratio; the vectors of both ways are
checked equal (cosine) before any time counts.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from pathlib import Path

import httpx
import numpy as np

from qwc.bench.serve import start, stop


def passages(n: int) -> list[str]:
    """n paragraphs of Pride and Prejudice of 20-400 characters (`qwc data fetch`)."""
    from qwc.eval import data

    paras = [p.replace("\n", " ").strip() for p in data.novel("prideprejudice").read_text().split("\n\n")]
    return [p for p in paras if 20 <= len(p) <= 400][:n]


class Served:
    """`qwc serve ART` on a free port until closed."""

    def __init__(self, art: Path, threads: int, batch: int, pooling: str):
        self.proc, line = start([sys.executable, "-m", "qwc", "serve", str(art), "--port", "0", "--threads",
                                 str(threads), "--max-batch", str(batch), "--pooling", pooling], r"at http://")
        self.base = re.search(r"at (http://[^ ]+)/v1", line)[1]

    def embed(self, inputs) -> np.ndarray:
        """One request; on one kept connection, as the `openai` client keeps it."""
        if not hasattr(self, "client"):
            self.client = httpx.Client(timeout=600)
        r = self.client.post(self.base + "/v1/embeddings", json={"input": inputs})
        if r.status_code != 200:
            raise SystemExit(f"embeddings: {r.status_code} {r.text[:300]}")
        return np.array([d["embedding"] for d in r.json()["data"]])

    def close(self) -> None:
        stop(self.proc)


def main() -> None:
    from qwc.manifest import read_manifest

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--inputs", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pooling", default="last", choices=("last", "mean", "cls"))
    args = ap.parse_args()
    batch = read_manifest(args.artifact).functions.max_batch
    texts = passages(args.inputs)
    srv = Served(args.artifact, args.threads, batch, args.pooling)
    try:
        one_by_one = np.concatenate([srv.embed([t]) for t in texts])   # also the warm-up
        together = srv.embed(texts)
        cos = (one_by_one * together).sum(-1)
        if cos.min() < 0.9999:
            raise SystemExit(f"embeddings: batched vectors differ from one-at-a-time ones (cosine {cos.min():.6f})")
        times = {"one request, all inputs": [], "one request an input": []}
        for _ in range(args.rounds):   # alternating: the machine is shared
            t0 = time.perf_counter()
            srv.embed(texts)
            times["one request, all inputs"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            for t in texts:
                srv.embed([t])
            times["one request an input"].append(time.perf_counter() - t0)
    finally:
        srv.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{len(texts)} passages, {sum(len(t) for t in texts)} characters; {args.artifact.name} (max batch {batch}), "
          f"{args.threads} threads, pooling {args.pooling}, median of {args.rounds} alternating rounds; "
          f"cosine of the two ways' vectors >= {cos.min():.6f}\n")
    print("| way | seconds | inputs/s |\n| --- | ---: | ---: |")
    for k, v in med.items():
        print(f"| {k} | {v:.3f} | {len(texts) / v:.1f} |")
    print(f"\nbatched / sequential: {med['one request, all inputs'] / med['one request an input']:.2f}x the time")


if __name__ == "__main__":
    main()
