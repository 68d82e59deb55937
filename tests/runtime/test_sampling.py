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
