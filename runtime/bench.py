"""`qwc bench`: llama-bench style prompt-processing (pp) and text-generation (tg) rates of one
artifact, mean ± standard deviation over repetitions; with a depth, each test runs after that
many tokens are in the cache (llama-bench's `-d`: "pp512 @ d4096"), their prefill not timed."""

from __future__ import annotations

import time

import numpy as np

from .engine import Engine


def _rate(tokens: int, seconds: list[float]) -> tuple[float, float]:
    rates = np.array([tokens / s for s in seconds])
    return float(rates.mean()), float(rates.std())


def run_bench(eng: Engine, prompt: int, gen: int, reps: int = 3, seed: int = 0, depth: int = 0,
              progress=None) -> list[dict]:
    """pp and tg rows; `depth` tokens prefilled (untimed) before each repetition; `progress`
    (a callable taking a line) hears of each depth fill, which at 16k tokens takes minutes."""
    if depth + max(prompt, gen) > eng.ctx:
        raise ValueError(f"depth {depth} + {max(prompt, gen)} tokens exceed the engine's context of {eng.ctx}")
    rng = np.random.default_rng(seed)
    vocab = min(eng.model.vocab_size, 4096)
    rows = []
    at = f" @ d{depth}" if depth else ""
    eng.reset()
    eng.prefill(rng.integers(0, vocab, min(16, eng.ctx)).tolist())   # warm-up: first calls initialise

    def fill(test: str, rep: int) -> None:
        eng.reset()
        if depth:
            if progress:
                progress(f"{test}{at}: repetition {rep + 1}/{reps}, filling {depth} tokens of context")
            eng.prefill(rng.integers(0, vocab, depth).tolist())

    if prompt:
        times = []
        for rep in range(reps):
            ids = rng.integers(0, vocab, prompt).tolist()
            fill(f"pp{prompt}", rep)
            t0 = time.perf_counter()
            eng.prefill(ids)
            times.append(time.perf_counter() - t0)
        rows.append({"test": f"pp{prompt}{at}", "tokens": prompt, "depth": depth, "reps": reps,
                     **dict(zip(("tps", "std"), _rate(prompt, times)))})
    if gen:
        times = []
        for rep in range(reps):
            fill(f"tg{gen}", rep)
            tok = int(rng.integers(0, vocab))
            t0 = time.perf_counter()
            for _ in range(gen):      # from the depth's cache (empty at 0), as llama-bench's tg test
                tok = int(eng.decode(tok).argmax())
            times.append(time.perf_counter() - t0)
        rows.append({"test": f"tg{gen}{at}", "tokens": gen, "depth": depth, "reps": reps,
                     **dict(zip(("tps", "std"), _rate(gen, times)))})
    return rows
