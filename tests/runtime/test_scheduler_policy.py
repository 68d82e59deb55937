"""The scheduler's policy on a fake engine: chunking, batching, admission, prefix reuse (with its
row moves and its eviction), cancellation, stops, forks and speculation's backoff, without a
compiled model, so these run in seconds.

The fake engine keeps each KV-cache row as the token ids written into it, and its "model" picks
the next token from everything its cache holds: a step that reads a row left wrong (a prefix
reused from the wrong row, a move not made, a position not rewound) changes the reply, so each
test checks replies against the tokens the fake model gives on a fresh cache."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from qwc.errors import QwcError
from qwc.runtime.prefix_cache import PrefixCache
from qwc.runtime.sampling import SamplingParams
from qwc.runtime.scheduler import QueueFull, Request, Scheduler
from qwc.runtime.spec_policy import SPEC_BACKOFF, after_verify
from qwc.runtime.speculate import NgramDrafter
from qwc.runtime.step_policy import StepLimits, plan_step

VOCAB, EOS = 64, 1


def next_token(held) -> int:
    """The fake model: the next token after the cache's contents."""
    return (int(np.sum(held)) * 7 + len(held) * 3) % 40 + 10


def reference(prompt: list[int], n: int) -> list[int]:
    """What a fresh cache gives: `n` greedy tokens after `prompt`."""
    held = list(prompt)
    for _ in range(n):
        held.append(next_token(held))
    return held[len(prompt):]


def one_hot(tok: int) -> np.ndarray:
    x = np.full(VOCAB, -1.0, np.float32)
    x[tok] = 1.0
    return x


class FakeSeq:
    def __init__(self, pool: "FakePool", row: int, capacity: int):
        self.pool, self.row, self.capacity, self.pos = pool, row, capacity, 0
        self.adapter = 0
        self.writes = 0


class FakePool:
    def __init__(self, slots: int, capacity: int):
        self.rows = np.full((slots, capacity + 1), -1, np.int64)
        self.seqs = [FakeSeq(self, r, capacity) for r in range(slots)]

    def swap_rows(self, a: int, b: int, n: int) -> None:
        self.rows[[a, b], :n] = self.rows[[b, a], :n]

    def copy_row(self, src: int, dst: int, n: int) -> None:
        self.rows[dst, :n] = self.rows[src, :n]


class FakeTokenizer:
    def decode(self, ids) -> str:
        return "".join(chr(ord("a") + i % 26) for i in ids)


class FakeEngine:
    """The Engine's interface the scheduler uses, with a log of its calls."""

    def __init__(self, ctx: int = 256, max_batch: int = 4, mixes_steps: bool = False, chunk: int = 64):
        self.ctx, self.max_batch, self.mixes_steps = ctx, max_batch, mixes_steps
        self.max_tokens_per_call = chunk
        self.eos, self.sample_limit, self.tokenizer = {EOS}, VOCAB, FakeTokenizer()
        self.verifies_drafts = self.verifies_exactly = True
        self.path = Path("fake.qwc")
        self.calls: list[tuple] = []     # (kind, [(row, tokens fed)...])
        self.fail_next: str | None = None

    def pool(self, slots: int, commit: bool = False) -> FakePool:
        return FakePool(slots, self.ctx)

    def reset(self, seq) -> None:
        seq.pos = 0

    def _feed(self, seq, tokens: list[int]) -> list[np.ndarray]:
        if seq.pos + len(tokens) > seq.capacity:
            raise QwcError("past the context")
        out = []
        for t in tokens:
            seq.pool.rows[seq.row, seq.pos] = t
            seq.pos += 1
            out.append(one_hot(next_token(seq.pool.rows[seq.row, :seq.pos])))
        seq.writes += 1
        return out

    def _call(self, kind: str, parts: list) -> None:
        if self.fail_next:
            msg, self.fail_next = self.fail_next, None
            raise QwcError(msg)
        self.calls.append((kind, [(s.row, list(t)) for s, t in parts]))

    def prefill(self, tokens, seq) -> np.ndarray:
        self._call("prefill", [(seq, tokens)])
        return self._feed(seq, list(tokens))[-1]

    def decode_many(self, tokens, seqs) -> list[np.ndarray]:
        self._call("decode", [(s, [t]) for s, t in zip(seqs, tokens)])
        return [self._feed(s, [t])[-1] for s, t in zip(seqs, tokens)]

    def step(self, parts) -> list[np.ndarray]:
        self._call("step", parts)
        return [self._feed(s, list(t))[-1] for s, t in parts]

    def verify(self, tokens, seq) -> np.ndarray:
        self._call("verify", [(seq, tokens)])
        return np.stack(self._feed(seq, list(tokens)))

    def fed(self, kind: str | None = None) -> list[list[tuple]]:
        return [parts for k, parts in self.calls if kind is None or k == kind]


class Collector:
    """A request's events, and a way to wait for its end."""

    def __init__(self):
        self.events: list[tuple[str, object]] = []
        self.done = threading.Event()
        self.on = None   # called after each event is kept (on the scheduler's thread)

    def __call__(self, kind, value) -> None:
        self.events.append((kind, value))
        if self.on:
            self.on(kind, value)
        if kind == "done":
            self.done.set()

    @property
    def text(self) -> str:
        return "".join(v for k, v in self.events if k == "text")


def request(prompt, max_tokens=8, **kw) -> Request:
    return Request(list(prompt), max_tokens, kw.pop("sampling", SamplingParams()), Collector(), **kw)


class Serving:
    """A scheduler on its own thread, as the server runs it: `serve(*reqs)` submits requests
    and waits for every one to end."""

    def __init__(self, sched: Scheduler):
        self.sched = sched

    def __enter__(self):
        self.sched.start()
        return self

    def __exit__(self, *exc):
        self.sched.stop()

    def __call__(self, *reqs: Request, timeout: float = 10.0) -> list[Request]:
        for r in reqs:
            self.sched.submit(r)
        for r in reqs:
            assert r.emit.done.wait(timeout), "a request did not end"
        return list(reqs)


def scheduler(eng: FakeEngine, **kw) -> Scheduler:
    """A scheduler on `eng`, its start-up calls (each batch size run once) out of the log."""
    sched = Scheduler(eng, **kw)
    eng.calls.clear()
    return sched


def run(sched: Scheduler, reqs: list[Request]) -> list[Request]:
    with Serving(sched) as serve:
        return serve(*reqs)


PROMPT = [5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45, 49, 53, 57, 2, 6, 10, 14, 18, 22]


# -- prefill chunking and batching -------------------------------------------------------------

def test_a_long_prompt_goes_in_chunks_and_never_a_lone_token():
    eng = FakeEngine(ctx=512)
    prompt = [(7 * i) % 50 + 2 for i in range(257)]
    (req,) = run(scheduler(eng, max_running=1, prefill_chunk=128), [request(prompt, 4)])
    sizes = [len(parts[0][1]) for parts in eng.fed("prefill")]
    assert sizes == [128, 127, 2] and req.generated == reference(prompt, 4)


def test_sequences_decode_in_one_batched_call():
    eng = FakeEngine()
    prompts = [PROMPT, PROMPT[3:], PROMPT[5:]]
    reqs = run(scheduler(eng, max_running=4, min_reuse=None), [request(p, 6) for p in prompts])
    assert [r.generated for r in reqs] == [reference(p, 6) for p in prompts]
    assert max(len(parts) for parts in eng.fed("decode")) == 3
    assert all(r.finish_reason == "length" for r in reqs)


def test_mixed_steps_carry_a_chunk_with_the_decode_tokens_and_change_no_reply():
    eng = FakeEngine(mixes_steps=True)
    prompts = [PROMPT, [3] * 30 + PROMPT]
    sched = scheduler(eng, max_running=2, prefill_chunk=8, min_reuse=None)
    reqs = run(sched, [request(p, 10) for p in prompts])
    assert [r.generated for r in reqs] == [reference(p, 10) for p in prompts]
    mixed = eng.fed("step")
    assert mixed and sched.mixed_steps == len(mixed)
    assert all(len(parts[-1][1]) > 1 and all(len(t) == 1 for _, t in parts[:-1]) for parts in mixed)


def test_no_more_than_max_running_run_and_the_queue_is_first_in_first_out():
    eng = FakeEngine()
    prompts = [[i + 2] * 6 for i in range(5)]
    reqs = run(scheduler(eng, max_running=2, min_reuse=None), [request(p, 3) for p in prompts])
    assert max(len(parts) for parts in eng.fed()) <= 2
    first = [parts[0][1][:6] for parts in eng.fed("prefill")]
    assert first == prompts
    assert [r.generated for r in reqs] == [reference(p, 3) for p in prompts]


def test_a_full_queue_and_an_over_long_prompt_are_refused():
    eng = FakeEngine(ctx=32)
    sched = scheduler(eng, max_running=1, max_queue=2)
    sched.submit(request(PROMPT))
    sched.submit(request(PROMPT))
    with pytest.raises(QueueFull, match="full"):
        sched.submit(request(PROMPT))
    with pytest.raises(QwcError, match="the context holds 32"):
        scheduler(FakeEngine(ctx=32)).submit(request(list(range(2, 34))))


def _running(prompt_len: int, fed: int, row: int, nxt=None, fork_of=None, prompt=None):
    req = SimpleNamespace(prompt=prompt or [3] * prompt_len, fork_of=fork_of)
    return SimpleNamespace(req=req, fed=fed, next=nxt, seq=SimpleNamespace(row=row))


LIMITS = StepLimits(prefill_chunk=128, max_tokens_per_call=256, max_batch=4, can_mix=True)


def test_the_plan_mixes_a_chunk_only_within_the_batched_rows_and_shrinks_it_to_fit_the_call():
    decoding = [_running(5, 5, row=r, nxt=7) for r in range(3)]
    prompt = _running(1000, 0, row=3)
    plan = plan_step([*decoding, prompt], LIMITS)
    assert plan.mixed and plan.prefill is prompt and plan.decode == decoding and plan.chunk == 128
    small = StepLimits(prefill_chunk=128, max_tokens_per_call=64, max_batch=4, can_mix=True)
    assert plan_step([*decoding, prompt], small).chunk == 61   # the call's 64 less three decode tokens
    prompt.seq.row = 4   # past the batched call's rows: the chunk runs alone
    plan = plan_step([*decoding, prompt], LIMITS)
    assert not plan.mixed and plan.chunk == 128
    assert not plan_step([prompt], LIMITS).mixed   # nothing to mix with


def test_the_plan_gives_the_chunk_to_the_oldest_prompt_and_never_a_lone_token():
    old, new = _running(129, 0, row=0), _running(50, 0, row=1)
    plan = plan_step([old, new], LIMITS)
    assert plan.prefill is old and plan.chunk == 127   # 128 would leave one token alone
    old.fed = 127
    assert plan_step([old, new], LIMITS).chunk == 2


def test_a_fork_waits_while_its_leader_prefills_and_prefills_alone_after():
    lead = _running(40, 0, row=0)
    fork = _running(40, 0, row=1, fork_of=lead.req, prompt=lead.req.prompt)
    other = _running(40, 0, row=2, prompt=[4] * 40)
    assert plan_step([lead, fork, other], LIMITS).prefill is lead
    lead.fed = 20
    assert plan_step([fork, lead, other], LIMITS).prefill is lead   # the fork, though older, waits
    lead.fed, lead.next = 40, 9    # the leader is past its prompt: a fork admitted now prefills
    plan = plan_step([lead, fork], LIMITS)
    assert plan.prefill is fork and plan.decode == [lead]


# -- prefix reuse ------------------------------------------------------------------------------

def test_a_shared_prefix_is_reused_and_only_the_rest_prefilled():
    eng = FakeEngine()
    first, second = PROMPT + [40, 41], PROMPT + [50, 51, 52]
    with Serving(scheduler(eng, max_running=1, min_reuse=16)) as serve:
        a, = serve(request(first, 4))
        b, = serve(request(second, 4))
    assert b.cached_tokens == len(PROMPT) and b.generated == reference(second, 4)
    assert eng.fed("prefill")[-1][0][1] == [50, 51, 52]
    assert a.generated == reference(first, 4)


def test_a_prefix_shorter_than_min_reuse_is_prefilled_again():
    eng = FakeEngine()
    with Serving(scheduler(eng, max_running=1, min_reuse=16)) as serve:
        serve(request(PROMPT[:12] + [40, 41], 4))
        b, = serve(request(PROMPT[:12] + [50, 51], 4))
    assert b.cached_tokens == 0 and b.generated == reference(PROMPT[:12] + [50, 51], 4)


def test_a_prefix_is_reused_only_under_the_adapter_that_computed_it():
    eng = FakeEngine()
    with Serving(scheduler(eng, max_running=1, min_reuse=4)) as serve:
        serve(request(PROMPT, 4, adapter=1))
        other, = serve(request(PROMPT, 4, adapter=2))
        same, = serve(request(PROMPT, 4, adapter=2))
    assert other.cached_tokens == 0 and same.cached_tokens == len(PROMPT) - 2


def test_a_prefix_held_higher_up_comes_down_to_the_lowest_free_row():
    """Three prompts run at once (rows 0, 1, 2) and leave; a prompt that continues the third runs
    in row 0 with the third's cache swapped down, and gives a fresh cache's reply."""
    eng = FakeEngine()
    prompts = [[i + 2] * 20 for i in range(3)]
    follow = prompts[2] + [55, 56, 57]   # the fake model says 10-49: no more in common
    with Serving(scheduler(eng, max_running=3, min_reuse=8)) as serve:
        serve(*[request(p, 2) for p in prompts])
        b, = serve(request(follow, 5))
    assert b.cached_tokens == 20 and b.generated == reference(follow, 5)
    assert eng.fed("prefill")[-1][0] == (0, [55, 56, 57])   # row 0, only what is new


def test_eviction_is_least_recently_used():
    cache = PrefixCache(min_reuse=2)
    for row, toks in enumerate(([2] * 8, [3] * 8, [4] * 8)):
        cache.finished(row, toks, 0)
    # no match: the request runs in row 0, whose cache is the oldest of all, so it goes
    where = cache.place([0, 1, 2], [9] * 8)
    assert where.row == 0 and where.keep == 0 and where.moves == []
    cache.finished(0, [9] * 8, 0)
    # row 0 now holds the newest cache: before it is overwritten it moves over the oldest, row 1's
    where = cache.place([0, 1, 2], [8] * 8)
    assert where.row == 0 and [(m.kind, m.src, m.dst, m.n) for m in where.moves] == [("copy", 0, 1, 8)]
    assert cache.held(1) == [9] * 8 and cache.held(2) == [4] * 8 and cache.held(0) == []


def test_reuse_always_leaves_two_prompt_tokens_to_prefill():
    cache = PrefixCache(min_reuse=2)
    cache.finished(0, [5] * 10, 0)
    assert cache.place([0], [5] * 10).keep == 8
    cache.finished(0, [5] * 10, 0)
    assert cache.place([0], [5] * 11).keep == 9
    assert PrefixCache(min_reuse=None).place([0, 1], [5] * 11).keep == 0


def test_forks_copy_their_leaders_prompt_instead_of_prefilling_it():
    eng = FakeEngine()
    lead = request(PROMPT, 4)
    forks = [request(PROMPT, 4, fork_of=lead) for _ in range(2)]
    reqs = run(scheduler(eng, max_running=3, min_reuse=None), [lead, *forks])
    assert len(eng.fed("prefill")) == 1 and all(f.cached_tokens == len(PROMPT) for f in forks)
    assert all(r.generated == reference(PROMPT, 4) for r in reqs)


# -- ends: cancellation, stops, errors ---------------------------------------------------------

def test_a_cancelled_request_ends_and_frees_its_slot_for_the_next():
    eng = FakeEngine()
    sched = scheduler(eng, max_running=1, min_reuse=None)
    gone = request(PROMPT, 10_000)
    gone.emit.on = lambda kind, value: kind == "text" and len(gone.generated) == 3 and gone.cancel()
    nxt = request(PROMPT[2:], 4)
    run(sched, [gone, nxt])
    assert gone.finish_reason == "cancelled" and 3 <= len(gone.generated) <= 4
    assert nxt.finish_reason == "length" and nxt.generated == reference(PROMPT[2:], 4)


def test_a_consumer_that_stops_early_frees_the_slot_it_drove():
    eng = FakeEngine()
    sched = scheduler(eng, max_running=1, min_reuse=None)
    req = request(PROMPT, 100)
    for kind, _ in sched.drive(req):
        if kind == "text":
            break
    assert req.finish_reason == "cancelled" and sched.running == 0
    again = request(PROMPT, 3)
    list(sched.drive(again))
    assert again.generated == reference(PROMPT, 3)


def test_stop_tokens_stop_strings_and_the_budget_end_a_reply():
    want = reference(PROMPT, 12)
    eng = FakeEngine()
    by_token = request(PROMPT, 12, stop_tokens=frozenset({want[4]}))
    text = FakeTokenizer().decode(want)
    by_string = request(PROMPT, 12, stop_strings=(text[6:8],))
    by_budget = request(PROMPT, 5)
    run(scheduler(eng, max_running=3, min_reuse=None), [by_token, by_string, by_budget])
    first = want.index(want[4])
    assert by_token.finish_reason == "stop" and by_token.generated == want[:first]
    cut = text.find(text[6:8])
    assert by_string.finish_reason == "stop" and by_string.emit.text == text[:cut]
    assert by_budget.finish_reason == "length" and len(by_budget.generated) == 5


def test_the_context_end_ends_a_reply_with_length():
    eng = FakeEngine(ctx=24)
    req, = run(scheduler(eng, max_running=1), [request(PROMPT, 100)])
    assert req.finish_reason == "length" and len(PROMPT) + len(req.generated) - 1 <= 24


def test_a_failing_step_ends_its_requests_with_the_error_and_the_next_runs():
    eng = FakeEngine()
    sched = scheduler(eng, max_running=1, min_reuse=4)
    first = request(PROMPT, 4)
    first.emit.on = lambda kind, value: kind == "text" and setattr(eng, "fail_next", "the library failed")
    second = request(PROMPT, 4)
    run(sched, [first, second])
    assert first.finish_reason == "error: the library failed"
    # after a failed step its cache's contents are unknown: nothing reused from it
    assert second.cached_tokens == 0 and second.generated == reference(PROMPT, 4)


# -- speculation -------------------------------------------------------------------------------

def test_drafts_verified_in_one_call_give_the_reply_without_them():
    eng = FakeEngine(ctx=512)
    prompt = PROMPT * 3   # the fake model's replies repeat: prompt lookup finds drafts
    sched = scheduler(eng, max_running=1, min_reuse=None, speculate=NgramDrafter, spec_backoff=False)
    req, = run(sched, [request(prompt, 40)])
    assert req.generated == reference(prompt, 40)
    assert eng.fed("verify") and sched.drafted > 0 and sched.accepted + sched.missed > 0


def test_a_slow_verify_call_backs_off_drafting_twice_as_long_each_time():
    waits, backoff = [], SPEC_BACKOFF[0]
    for _ in range(6):
        wait, backoff = after_verify(cost=2.0, decode_time=1.0, backoff=backoff)
        waits.append(wait)
    assert waits == [2, 4, 8, 16, 32, 32]
    assert after_verify(cost=0.5, decode_time=1.0, backoff=backoff) == (0, SPEC_BACKOFF[0])
    assert after_verify(cost=9.0, decode_time=None, backoff=8) == (0, SPEC_BACKOFF[0])   # untimed: no wait


def test_speculation_needs_an_artifact_that_verifies():
    eng = FakeEngine()
    eng.verifies_drafts = False
    with pytest.raises(QwcError, match="score entry point"):
        Scheduler(eng, speculate=NgramDrafter)
