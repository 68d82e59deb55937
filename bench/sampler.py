"""The sampler's cost per token (runtime/sampling.py), on random logits of a Qwen2.5-sized
vocabulary: what `qwc serve` spends on its scheduler thread for every sequence of a step.

    .venv/bin/python bench/sampler.py [--vocab 151936] [--calls 200]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from qwc.runtime.sampling import Sampler, SamplingParams

CASES = [("greedy", SamplingParams()),
         ("temperature 1", SamplingParams(temperature=1.0, seed=1)),
         ("temperature 0.7, top_p 0.9", SamplingParams(temperature=0.7, top_p=0.9, seed=1)),
         ("temperature 0.8, top_k 40", SamplingParams(temperature=0.8, top_k=40, seed=1)),
         ("temperature 1, presence_penalty 0.5", SamplingParams(temperature=1.0, presence_penalty=0.5, seed=1))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--calls", type=int, default=200)
    a = ap.parse_args()
    logits = (np.random.default_rng(0).normal(size=a.vocab) * 3).astype(np.float32)
    history = list(range(100))
    print(f"vocabulary {a.vocab}, median of 5 runs of {a.calls} calls")
    print("| options | µs a token |")
    print("| --- | ---: |")
    for name, sp in CASES:
        s = Sampler(sp, a.vocab)
        s(logits, history)
        runs = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(a.calls):
                s(logits, history)
            runs.append((time.perf_counter() - t0) / a.calls * 1e6)
        print(f"| {name} | {np.median(runs):,.0f} |")


if __name__ == "__main__":
    main()
