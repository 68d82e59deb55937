"""runtime/sampling.py: OpenAI's presence / frequency penalties and logit_bias, on logits
built so that each option decides the greedy choice."""

from __future__ import annotations

import numpy as np
import pytest

from qwc.errors import QwcError
from qwc.runtime.sampling import Sampler, SamplingParams


def _logits(best: int, margin: float, size: int = 8) -> np.ndarray:
    x = np.zeros(size, np.float32)
    x[best] = margin
    x[(best + 1) % size] = margin - 0.5   # the runner-up
    return x


def test_logit_bias_moves_the_greedy_choice_and_ignores_ids_past_the_limit():
    x = _logits(3, 1.0)
    assert Sampler(SamplingParams())(x, [0]) == 3
    assert Sampler(SamplingParams(logit_bias={3: -100}))(x, [0]) == 4
    assert Sampler(SamplingParams(logit_bias={6: 1.5}))(x, [0]) == 6
    assert Sampler(SamplingParams(logit_bias={6: 100}), limit=6)(x, [0]) == 3   # 6 is never sampled


def test_penalties_count_the_generated_tokens_only():
    x = _logits(3, 1.0)
    prompt = [3, 3, 3, 3]   # in the prompt: not penalised
    freq = Sampler(SamplingParams(frequency_penalty=0.3))
    assert freq(x, prompt) == 3
    assert freq(x, prompt + [3]) == 3                 # 1.0 - 0.3 > 0.5
    assert freq(x, prompt + [3, 3]) == 4              # 1.0 - 0.6 < 0.5
    pres = Sampler(SamplingParams(presence_penalty=0.4))
    assert pres(x, prompt) == 3
    assert pres(x, prompt + [3, 3, 3]) == 3           # once, whatever the count: 0.6 > 0.5
    both = Sampler(SamplingParams(presence_penalty=0.4, frequency_penalty=0.2))
    assert both(x, prompt) == 3 and both(x, prompt + [3]) == 4   # 1.0 - 0.4 - 0.2 < 0.5
    neg = Sampler(SamplingParams(frequency_penalty=-1.0))   # negative: encourages repeats
    assert neg(x, prompt) == 3 and neg(x, prompt + [4]) == 4


@pytest.mark.parametrize("kw, words", [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty"),
    ({"logit_bias": {1: 101}}, "logit_bias"),
    ({"logit_bias": {-1: 1}}, "logit_bias"),
    ({"logit_bias": {"1": 1}}, "logit_bias"),
])
def test_bad_values_are_refused(kw, words):
    with pytest.raises(QwcError, match=words):
        SamplingParams(**kw)


def _frequencies(sp: SamplingParams, logits: np.ndarray, n: int = 40000) -> np.ndarray:
    s = Sampler(sp, logits.size)
    return np.bincount([s(logits, []) for _ in range(n)], minlength=logits.size) / n


def test_draws_follow_softmax_top_k_and_top_p():
    """Temperature, top-k and top-p as their definitions say (within sampling error of 40,000
    draws): the two-level inverse CDF and the candidate-only top-k / top-p are the whole
    vocabulary's distribution."""
    rng = np.random.default_rng(0)
    x = (rng.normal(size=3000) * 2.5).astype(np.float32)
    p = np.exp((x - x.max()) / 0.8)
    p /= p.sum()
    got = _frequencies(SamplingParams(temperature=0.8, seed=1), x)
    assert np.abs(got - p).max() < 5 * np.sqrt(p.max() / 40000)
    order = np.argsort(-p)
    top = order[:5]
    got = _frequencies(SamplingParams(temperature=0.8, top_k=5, seed=2), x)
    assert set(np.flatnonzero(got)) <= set(top)
    assert np.allclose(got[top], p[top] / p[top].sum(), atol=0.015)
    keep = order[: np.searchsorted(np.cumsum(p[order]), 0.5) + 1]
    got = _frequencies(SamplingParams(temperature=0.8, top_p=0.5, seed=3), x)
    assert set(np.flatnonzero(got)) == set(keep)


def test_a_large_vocabulary_draws_every_block_and_never_a_zero():
    """152k ids: the block sums find every part of the vocabulary, an id of probability 0 is
    never drawn, and a seed repeats its draws."""
    rng = np.random.default_rng(1)
    x = np.full(151936, -200.0, np.float32)                        # exp(-200) is 0 in float32
    live = np.sort(rng.choice(x.size, 60, replace=False))
    x[live] = rng.normal(size=60).astype(np.float32)
    got = _frequencies(SamplingParams(temperature=1.0, seed=4), x, n=6000)
    assert set(np.flatnonzero(got)) == set(live)
    a, b = (Sampler(SamplingParams(temperature=1.0, top_p=0.9, seed=9), x.size) for _ in range(2))
    assert [a(x, []) for _ in range(50)] == [b(x, []) for _ in range(50)]


@pytest.mark.parametrize("temperature", [1e-40, 1e-300, 1e4])
def test_extreme_temperatures_draw_a_real_token(temperature):
    """A temperature near 0 is greedy's choice (no 0 * inf), a huge one is near uniform."""
    x = np.array([0.0, 3.0, 1.0, -2.0], np.float32)
    with np.errstate(invalid="raise", over="raise"):   # no NaN on the way to a right answer
        got = _frequencies(SamplingParams(temperature=temperature, seed=5), x, n=2000)
    if temperature < 1:
        assert got[1] == 1.0
    else:
        assert got.min() > 0.2
