"""Speculative decoding: the prompt-lookup drafter, and the scheduler's verification of drafts
(runtime/scheduler.py: Scheduler._verify) against the same scheduler without drafts, on the
tiny artifact with float activations and a float32 cache (the verify call's kernels and the
decode step's then agree to float rounding, so greedy tokens are equal)."""

import threading

import pytest

from qwc.errors import QwcError
from qwc.runtime.engine import Engine
from qwc.runtime.sampling import SamplingParams
from qwc.runtime.scheduler import Request, Scheduler
from qwc.runtime.speculate import NgramDrafter

PROMPT = [5, 9, 13, 17, 21, 25, 29, 33]
TOKENS = 24


def test_the_drafter_continues_the_latest_longest_match():
    d = NgramDrafter(draft_max=3, ngram_max=3, ngram_min=2)
    # "1 2 3" occurs twice before the end; the later one is followed by 7 8 9
    h = [1, 2, 3, 4, 5, 1, 2, 3, 7, 8, 9, 6, 1, 2, 3]
    assert d.draft(h) == [7, 8, 9]
    assert d.draft(h, limit=2) == [7, 8]
    assert d.draft(h, limit=0) == []
    # the history grows; the index keeps up: "9 6" occurred once, followed by 1 2 3
    h += [5, 9, 6]
    assert d.draft(h) == [1, 2, 3]
    assert NgramDrafter(ngram_min=2).draft([1, 2, 3, 4]) == []   # no earlier occurrence


def test_the_drafter_prefers_the_longer_ngram():
    d = NgramDrafter(draft_max=2, ngram_max=3, ngram_min=1)
    # the last token 3 was last followed by 5; the last 3-gram "1 2 3" by 4 4
    assert d.draft([1, 2, 3, 4, 4, 9, 3, 5, 0, 1, 2, 3]) == [4, 4]


def test_draft_length_follows_what_was_kept():
    d = NgramDrafter(draft_max=8)
    assert d.length == 8
    d.kept(0)
    assert d.length == 2
    d.kept(2)
    assert d.length == 6
    d.kept(7)
    assert d.length == 8


@pytest.mark.parametrize("args", [dict(draft_max=0), dict(ngram_min=0), dict(ngram_min=4, ngram_max=3)])
def test_the_drafter_refuses_bad_settings(args):
    with pytest.raises(QwcError, match="speculation"):
        NgramDrafter(**args)


class _Script:
    """A drafter that proposes what `script(i)` says the reply's tokens i, i + 1, ... are."""

    def __init__(self, script, length=4):
        self.script, self.length = script, length
        self.kept_counts = []

    def draft(self, history, limit=None):
        i = len(history) - len(PROMPT)    # generated so far, the last one included
        n = self.length if limit is None else min(self.length, limit)
        return [self.script(j) for j in range(i, i + n)]

    def kept(self, n):
        self.kept_counts.append(n)


@pytest.fixture(scope="module")
def engine(tiny_host_artifact):
    return Engine(tiny_host_artifact, ctx=128, threads=1)


def _generate(engine, drafter=None, sampling=None, max_tokens=TOKENS, spec_batch=1):
    made = []

    def factory():
        made.append(drafter())
        return made[-1]

    sched = Scheduler(engine, max_running=2, speculate=factory if drafter else None, spec_batch=spec_batch)
    done = threading.Event()
    req = Request(prompt=list(PROMPT), max_tokens=max_tokens, sampling=sampling or SamplingParams(),
                  emit=lambda kind, v: kind == "done" and done.set(), ignore_eos=True)
    sched.start()
    try:
        sched.submit(req)
        assert done.wait(120)
    finally:
        sched.stop()
    return req, sched, made


@pytest.fixture(scope="module")
def reference(engine):
    req, _, _ = _generate(engine)
    assert len(req.generated) == TOKENS
    return req.generated


def test_right_drafts_are_kept_and_change_nothing(engine, reference):
    req, sched, made = _generate(engine, lambda: _Script(lambda j: reference[j] if j < TOKENS else 0))
    assert req.generated == reference
    assert sched.accepted == sched.drafted > 0
    assert sched.steps < TOKENS // 2    # a step verified several tokens
    assert sum(made[0].kept_counts) == sched.accepted   # the drafter heard of every kept token


def test_wrong_drafts_are_dropped_and_change_nothing(engine, reference):
    """Every draft is wrong from its first token: each call's cache past the fed token is
    forgotten, and the next call overwrites it."""
    req, sched, made = _generate(engine, lambda: _Script(lambda j: (reference[j] + 1) % 200 if j < TOKENS else 0))
    assert req.generated == reference
    assert sched.drafted > 0 and sched.accepted == 0
    assert set(made[0].kept_counts) == {0}


def test_half_right_drafts(engine, reference):
    """Right for two tokens, then wrong: each verify keeps two and draws the third itself."""
    req, sched, made = _generate(engine, lambda: _Script(
        lambda j: (reference[j] + (j % 3 == 2)) % 200 if j < TOKENS else 0))
    assert req.generated == reference
    assert 0 < sched.accepted < sched.drafted


def test_drafts_stop_at_the_budget(engine, reference):
    req, sched, _ = _generate(engine, lambda: _Script(lambda j: reference[j] if j < TOKENS else 0, length=8),
                              max_tokens=6)
    assert req.generated == reference[:6] and req.finish_reason == "length"
    assert sched.drafted <= 4    # the 6th token is drawn from the 5th's logits: no draft reaches it


def test_a_sampled_reply_is_the_same_draw(engine):
    """One draw of the request's sampler per emitted token, whatever was drafted: with a seed,
    the reply is the one the same seed gives without drafts."""
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=11)
    want, _, _ = _generate(engine, sampling=params)
    got, sched, _ = _generate(engine, lambda: _Script(lambda j: want.generated[j] if j < TOKENS else 0),
                              sampling=SamplingParams(temperature=0.9, top_p=0.95, seed=11))
    assert got.generated == want.generated and sched.accepted > 0


def test_a_draft_past_the_spec_batch_takes_the_batched_step(engine, reference):
    """spec_batch=1 with two requests decoding: neither verifies (each decodes in the step)."""
    made = []
    sched = Scheduler(engine, max_running=2, speculate=lambda: made.append(
        _Script(lambda j: reference[j] if j < TOKENS else 0)) or made[-1])
    done = [threading.Event(), threading.Event()]
    reqs = [Request(prompt=list(PROMPT), max_tokens=TOKENS, sampling=SamplingParams(), ignore_eos=True,
                    emit=lambda kind, v, e=e: kind == "done" and e.set()) for e in done]
    sched.start()
    try:
        for r in reqs:
            sched.submit(r)
        assert all(e.wait(120) for e in done)
    finally:
        sched.stop()
    assert all(r.generated == reference for r in reqs)
    # both decode together from the step both prompts are in: drafts only before or after
    assert sched.drafted < 2 * TOKENS


def test_scheduler_refuses_a_bad_spec_batch(engine):
    with pytest.raises(QwcError, match="spec_batch"):
        Scheduler(engine, speculate=NgramDrafter, spec_batch=0)
