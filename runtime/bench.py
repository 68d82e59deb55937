"""`qwc bench`: llama-bench style prompt-processing (pp) and text-generation (tg) rates of one
artifact, mean ± standard deviation over repetitions."""

from __future__ import annotations

import time

import numpy as np

from .engine import Engine


def _rate(tokens: int, seconds: list[float]) -> tuple[float, float]:
    rates = np.array([tokens / s for s in seconds])
    return float(rates.mean()), float(rates.std())


def run_bench(eng: Engine, prompt: int, gen: int, reps: int = 3, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    vocab = min(eng.model.vocab_size, 4096)
    rows = []
    eng.reset()
    eng.prefill(rng.integers(0, vocab, min(16, eng.ctx)).tolist())   # warm-up: first calls initialise
    if prompt:
        times = []
        for _ in range(reps):
            ids = rng.integers(0, vocab, prompt).tolist()
            eng.reset()
            t0 = time.perf_counter()
            eng.prefill(ids)
            times.append(time.perf_counter() - t0)
        rows.append({"test": f"pp{prompt}", "tokens": prompt, "reps": reps, **dict(zip(("tps", "std"), _rate(prompt, times)))})
    if gen:
        times = []
        for _ in range(reps):
            eng.reset()
            tok = int(rng.integers(0, vocab))
            t0 = time.perf_counter()
            for _ in range(gen):      # from an empty cache, as llama-bench's tg test
                tok = int(eng.decode(tok).argmax())
            times.append(time.perf_counter() - t0)
        rows.append({"test": f"tg{gen}", "tokens": gen, "reps": reps, **dict(zip(("tps", "std"), _rate(gen, times)))})
    return rows
