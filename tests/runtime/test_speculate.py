"""Speculative decoding: the prompt-lookup drafter, the draft model, and the scheduler's
verification of drafts (runtime/scheduler.py: Scheduler._verify) against the same scheduler
without drafts, on the tiny model built as `qwc compile` builds by default (W4A8 where the host
has the integer kernels, a float16 cache, the three-pass decode attention): the verify entry
point gives the decode steps' logits to the bit, so greedy replies are equal token for token.
The schedulers verify every draft (spec_backoff=False): whether drafting pays is timed, and the
tests are of what a verification does; the backoff has its own test."""

import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from qwc.errors import QwcError
from qwc.runtime.engine import Engine
from qwc.runtime.sampling import SamplingParams
from qwc.runtime.scheduler import Request, Scheduler
from qwc.runtime.spec_policy import draft_length
from qwc.runtime.speculate import DraftModel, NgramDrafter, same_vocabulary

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

    def draft(self, history, limit=None, prompt=None):
        i = len(history) - len(PROMPT)    # generated so far, the last one included
        n = self.length if limit is None else min(self.length, limit)
        return [self.script(j) for j in range(i, i + n)]

    def kept(self, n):
        self.kept_counts.append(n)


@pytest.fixture(scope="module")
def default_artifact(tiny_q4, tmp_path_factory):
    from qwc.compiler.compile import compile_file

    out = tmp_path_factory.mktemp("speculate") / "tiny.qwc"
    compile_file(tiny_q4, "host", out)
    return out


@pytest.fixture(scope="module")
def engine(default_artifact):
    return Engine(default_artifact, ctx=128, threads=1)


@pytest.mark.parametrize("past, n", [(8, 1), (8, 9), (13, 4), (40, 20), (100, 3)])
def test_a_verify_call_gives_the_decode_steps_logits_to_the_bit(engine, past, n):
    """verify() of n tokens after `past` cached against n decode steps: equal logits, bit for
    bit (20 tokens: two calls of the entry point's 16 and 4), and the cache left as they leave
    it, so that the next decode step after either is the same too. score() runs the prefill
    kernels, whose rounding differs: it is not what a verify call may use."""
    rng = np.random.default_rng(past + n)
    prompt, new = (rng.integers(1, 200, k).tolist() for k in (past, n + 1))
    assert engine._verify is not None
    a, b = engine.sequence(), engine.sequence()
    engine.prefill(prompt, seq=a)
    engine.prefill(prompt, seq=b)
    steps = np.stack([engine.decode(t, seq=a).copy() for t in new[:n]])
    np.testing.assert_array_equal(engine.verify(new[:n], seq=b), steps)
    assert a.pos == b.pos == past + n
    np.testing.assert_array_equal(engine.decode(new[n], seq=b), engine.decode(new[n], seq=a))


def test_verify_falls_back_to_score_without_the_entry_point(engine, monkeypatch):
    """An artifact compiled before the verify entry point: score's logits, which are the
    decode steps' to the rounding of a prompt's attention (float16 operands on a float16
    cache, kernels/prefill_attention.py), which the tiny model's 8-bit activations carry on
    to a few hundredths of the logits' range."""
    seq = engine.sequence()
    engine.prefill(PROMPT, seq=seq)
    want = engine.verify([3, 4, 5], seq=seq)
    seq.pos = len(PROMPT)
    monkeypatch.setattr(engine, "_verify", None)
    got = engine.verify([3, 4, 5], seq=seq)
    assert np.abs(got - want).max() < 0.05 * np.abs(want).max()
    seq.pos = len(PROMPT)
    np.testing.assert_array_equal(got, engine.score([3, 4, 5], seq=seq))


def _generate(engine, drafter=None, sampling=None, max_tokens=TOKENS, spec_batch=1, backoff=False):
    made = []

    def factory():
        made.append(drafter())
        return made[-1]

    sched = Scheduler(engine, max_running=2, speculate=factory if drafter else None, spec_batch=spec_batch,
                      spec_backoff=backoff)
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
        _Script(lambda j: reference[j] if j < TOKENS else 0)) or made[-1], spec_backoff=False)
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


def test_drafting_that_costs_more_than_it_saves_backs_off(engine, reference):
    """A drafter whose drafts take 50 ms to make (a decode step of the tiny model: ~1 ms): after
    one decode step timed, the first draft's cost a position is past a step's, so the request
    stops drafting for 2 steps, then 4, 8, 16 (SPEC_BACKOFF): 4 drafts in 24 tokens, not 23."""
    class Slow(_Script):
        calls = 0

        def draft(self, history, limit=None, prompt=None):
            Slow.calls += 1
            time.sleep(0.05)
            return super().draft(history, limit, prompt)

    req, _, _ = _generate(engine, lambda: Slow(lambda j: 0), backoff=True)
    assert req.generated == reference
    assert 1 <= Slow.calls <= 4


def test_the_draft_length_is_the_timed_one_that_advances_fastest():
    """Verify calls of 1 / 2 / 4 / 7 draft tokens timed at 1.0 / 1.1 / 1.3 / 3.0 (a jump past 4,
    as on the 7B shape): a request whose drafts are all kept asks for 4, not its drafter's 7;
    one whose drafts all miss asks for 1; drafting that costs a decode step a token asks for 1;
    a length never timed is asked for as the drafter wants it; nothing past the drafter's."""
    times = {1: 1.0, 2: 1.1, 4: 1.3, 7: 3.0}
    totals = [0, 0]   # no request's counts yet: q0 = 1/2

    def length(wish, kept, missed, step=0.0):
        return draft_length(wish, times, *totals, kept, missed, step)
    assert length(7, kept=50, missed=0) == 4
    assert length(7, kept=0, missed=5) == 1
    assert length(7, kept=50, missed=0, step=1.0) == 1
    assert length(5, kept=0, missed=5) == 5
    assert length(2, kept=50, missed=0) == 2
    # a request's first draft, judged on the others': most kept, or most missed
    assert length(7, kept=0, missed=0) == 2
    totals[:] = 95, 5
    assert length(7, kept=0, missed=0) == 4
    totals[:] = 5, 95
    assert length(7, kept=0, missed=0) == 1


def test_scheduler_refuses_a_bad_spec_batch(engine):
    with pytest.raises(QwcError, match="spec_batch"):
        Scheduler(engine, speculate=NgramDrafter, spec_batch=0)


def _greedy(engine, history, n):
    """n greedy tokens after `history`, from a fresh cache."""
    seq = engine.sequence()
    logits, out = engine.prefill(history, seq=seq), []
    for _ in range(n):
        out.append(int(np.argmax(logits[:engine.sample_limit])))
        logits = engine.decode(out[-1], seq=seq)
    return out


@pytest.fixture(scope="module")
def draft_engine(default_artifact):
    return Engine(default_artifact, ctx=128, threads=1)


def test_a_draft_model_drafts_its_greedy_continuation_after_any_history(engine, draft_engine):
    """A drafter's cache follows the history it is given: after a draft of which only the first
    token was kept and another came, it sets its cache back and drafts what a fresh cache gives."""
    d = DraftModel(draft_engine, engine, draft_max=4)()
    first = d.draft(list(PROMPT))
    assert first == _greedy(draft_engine, PROMPT, 4)
    d.kept(1)                                      # the next draft: 2 * 1 + 2 tokens
    history = list(PROMPT) + [first[0], (first[1] + 1) % 200]
    assert d.draft(history) == _greedy(draft_engine, history, 4)
    assert d.draft(history, limit=2) == _greedy(draft_engine, history, 2)
    assert d.draft(history, limit=0) == []
    d.close()
    assert d.seq is None and len(d.model._free) == 1


def test_a_draft_model_of_the_same_weights_changes_nothing(engine, draft_engine, reference):
    """The served model drafting for itself: every greedy draft is its own reply, kept whole
    (the verify call's logits are its decode steps', and the drafter takes the kept tokens
    through verify too: as a prompt chunk, on a float16 cache, their attention would round
    its operands and turn the tiny model's near ties), and the reply is the one without
    drafts; the request's draft cache goes back to the model when it ends."""
    model = DraftModel(draft_engine, engine)
    req, sched, made = _generate(engine, model)
    assert req.generated == reference
    assert sched.drafted > 0 and sched.accepted == sched.drafted
    assert sched.steps < TOKENS // 2
    assert made[0].seq is None and len(model._free) == 1


def test_a_draft_model_needs_the_same_vocabulary():
    def eng(vocab, size=300):
        tok = None if vocab is None else SimpleNamespace(get_vocab=lambda with_added_tokens: vocab)
        return SimpleNamespace(tokenizer=tok, vocab_size=size, sample_limit=size, path="small.qwc")

    assert same_vocabulary(eng({"a": 0, "b": 1}), eng({"a": 0, "b": 1}, 400))
    assert not same_vocabulary(eng({"a": 0, "b": 1}), eng({"a": 1, "b": 0}))
    assert not same_vocabulary(eng({"a": 0}), eng(None))
    assert same_vocabulary(eng(None), eng(None)) and not same_vocabulary(eng(None), eng(None, 400))
    with pytest.raises(QwcError, match="--draft small.qwc: its tokenizer is not the served model's"):
        DraftModel(eng({"a": 0}), eng({"b": 0}))
    with pytest.raises(QwcError, match="draft_max"):
        DraftModel(eng(None), eng(None), draft_max=0)
