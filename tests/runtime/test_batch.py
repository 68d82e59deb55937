"""Batched decode (`qwc compile --max-batch`, Engine.pool / decode_many): every sequence's
tokens are those it gets alone, its row's logits do not depend on what else is in the batch,
and rows that are not decoding (mid-prefill, idle) are left as they were. The scheduler's
prefix reuse prefills only what a free slot's cache does not hold, with the same tokens."""

import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from run_engine import (  # scripts/arm64 (also run under qemu by test_arm.py)
    greedy_alone_and_batched,
    mixed_and_separate,
)

from qwc.compiler.compile import compile_file
from qwc.errors import QwcError
from qwc.runtime.engine import Engine
from qwc.runtime.prefill_chunks import next_chunk
from qwc.runtime.sampling import SamplingParams
from qwc.runtime.scheduler import Request, Scheduler

PROMPTS = [[72, 101, 108, 108, 111], list(range(3, 40)), [7], list(range(100, 117))]


@pytest.fixture(scope="module")
def engine(tiny_q4, tmp_path_factory):
    out = tmp_path_factory.mktemp("batch") / "tiny.qwc"
    compile_file(tiny_q4, "host", out, max_batch=9)
    return Engine(out, ctx=64)


@pytest.mark.slow
def test_batched_greedy_equals_each_sequence_alone(engine):
    assert engine.max_batch == 9
    alone, batched = greedy_alone_and_batched(engine, PROMPTS, 8)
    assert alone.shape == batched.shape == (len(PROMPTS), 8, engine.vocab_size)
    # the batched step runs the GEMM kernels, alone the decode GEMV: the same integer dots and
    # the same float sums a token; both the three-pass attention (decode_attention's rows)
    np.testing.assert_array_equal(alone, batched)


def test_nine_sequences_take_every_tile_of_the_batched_gemm(engine):
    """9 rows: on x86 the batched-decode GEMM's whole 8-token tile (with its prefetch) and a
    1-token leftover tile, in the real model: each row's greedy tokens are its own alone."""
    prompts = PROMPTS + [[5 + i, 17, 200 + 3 * i] for i in range(5)]
    alone, batched = greedy_alone_and_batched(engine, prompts, 6)
    np.testing.assert_array_equal(alone, batched)


@pytest.mark.parametrize("remaining, most, want", [(1, 256, [1]), (2, 256, [2]), (257, 256, [255, 2]),
                                                    (129, 128, [127, 2]), (300, 128, [128, 128, 44]),
                                                    (3, 2, [2, 1])])
def test_prompt_chunks_leave_no_lone_token(remaining, most, want):
    """prefill_chunks.next_chunk: a prompt's calls, none of one token where it can be helped (a call of
    one runs decode's kernels); with calls of 2 at most a lone token is left."""
    got = []
    while remaining:
        got.append(next_chunk(remaining, most))
        remaining -= got[-1]
    assert got == want


def test_a_prompts_logits_do_not_depend_on_its_chunks(engine):
    """Its tokens in one call or in calls of two or more: the same logits to the bit (the online
    attention gives a token the same bits whichever call it is in), and the cache after either
    decodes the same."""
    prompt = [(11 * i) % 250 + 3 for i in range(40)]
    one = engine.sequence()
    want = engine.prefill(prompt, one).copy()
    after = engine.decode(9, one).copy()
    for cuts in ([2], [17], [38], [5, 7, 9]):
        seq, at = engine.sequence(), 0
        for n in cuts + [len(prompt) - sum(cuts)]:
            got = engine.prefill(prompt[at:at + n], seq)
            at += n
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(engine.decode(9, seq), after)


def _step(engine, rows):
    """Prefill every prompt into a fresh pool, then one batched step of `rows`."""
    seqs = engine.pool(4).seqs
    for p, s in zip(PROMPTS, seqs):
        engine.prefill(p, s)
    return engine.decode_many([5] * len(rows), [seqs[r] for r in rows]), seqs


def test_a_row_does_not_depend_on_the_others(engine):
    two, _ = _step(engine, [0, 1])
    four, _ = _step(engine, [3, 1, 0, 2])
    assert np.array_equal(two[0], four[2]) and np.array_equal(two[1], four[1])


def test_rows_that_do_not_decode_are_untouched(engine):
    seqs = engine.pool(4).seqs
    engine.prefill(PROMPTS[0], seqs[0])
    engine.prefill(PROMPTS[1][:20], seqs[2])    # row 2 is mid-prefill, row 1 idle
    engine.prefill(PROMPTS[3], seqs[3])
    for _ in range(3):
        engine.decode_many([5, 6], [seqs[0], seqs[3]])
    assert (seqs[1].pos, seqs[2].pos) == (0, 20)
    rest = engine.prefill(PROMPTS[1][20:], seqs[2])
    alone = engine.sequence()
    assert np.array_equal(rest, engine.prefill(PROMPTS[1], alone))


def test_a_copied_or_swapped_row_decodes_as_its_source(engine):
    """Prefix reuse and n > 1 move caches between rows: K interleaves 16 positions a tile, so
    a prefix of 5 or 37 positions (not whole tiles) must still come across whole."""
    seqs = engine.pool(4).seqs
    for s in seqs:
        engine.reset(s)
    engine.prefill(PROMPTS[0], seqs[0])
    engine.prefill(PROMPTS[1], seqs[2])
    seqs[0].pool.copy_row(0, 1, len(PROMPTS[0]))
    seqs[0].pool.swap_rows(2, 3, len(PROMPTS[1]))
    seqs[1].pos, seqs[3].pos, seqs[2].pos = len(PROMPTS[0]), len(PROMPTS[1]), 0
    out = engine.decode_many([5, 5, 9], [seqs[0], seqs[1], seqs[3]])
    assert np.array_equal(out[0], out[1])
    alone = engine.sequence()
    engine.prefill(PROMPTS[1], alone)
    np.testing.assert_array_equal(engine.decode(9, alone), out[2])


def test_decode_many_refuses_bad_tokens_and_a_full_context(engine):
    seqs = engine.pool(2, ctx=8).seqs
    engine.prefill(list(range(8)), seqs[0])
    engine.prefill([1], seqs[1])
    with pytest.raises(QwcError, match="do not fit the context of 8"):
        engine.decode_many([1, 1], seqs)
    with pytest.raises(QwcError, match="not in the vocabulary"):
        engine.decode_many([1, engine.vocab_size], [seqs[1], seqs[0]])
    with pytest.raises(QwcError, match="2 tokens for 1 sequences"):
        engine.decode_many([1, 2], seqs[:1])


def test_max_batch_is_checked(tiny_q4, tmp_path):
    with pytest.raises(QwcError, match="--max-batch 0"):
        compile_file(tiny_q4, "host", tmp_path / "a.qwc", max_batch=0)
    r = subprocess.run([sys.executable, "-m", "qwc", "compile", str(tiny_q4), "--max-batch", "999",
                        "-o", str(tmp_path / "b.qwc")], capture_output=True, text=True)
    assert r.returncode == 2 and "999 is more than 256" in r.stderr and not (tmp_path / "b.qwc").exists()


def _serve(sched, prompt, n=6):
    """One greedy request through the scheduler: its tokens and how many prompt tokens it reused."""
    done = threading.Event()
    req = Request(list(prompt), n, SamplingParams(), lambda kind, _: kind == "done" and done.set(), ignore_eos=True)
    sched.submit(req)
    assert done.wait(60) and req.finish_reason == "length"
    return req.generated, req.cached_tokens


def _alone(engine, prompt, n=6):
    seq = engine.sequence()
    logits, out = engine.prefill(prompt, seq), []
    for _ in range(n):
        out.append(int(np.argmax(logits[: engine.sample_limit])))   # greedy over the tokenizer's ids
        logits = engine.decode(out[-1], seq)
    return out


def test_prefix_reuse_prefills_only_the_new_tokens(engine):
    system = list(range(200, 230))                         # a shared 30-token "system prompt"
    a, b, c = system + [7, 8, 9], system + [40, 41], list(range(250, 270))
    sched = Scheduler(engine, max_running=2, min_reuse=16)
    sched.start()
    try:
        assert _serve(sched, a) == (_alone(engine, a), 0)
        assert _serve(sched, b) == (_alone(engine, b), 30)        # the system prompt came from a's slot
        assert _serve(sched, c) == (_alone(engine, c), 0)         # nothing in common
        # all but the two tokens that give the logits (prefill_chunks.next_chunk: one alone would run
        # decode's kernels, and the reply could differ from a fresh prefill's)
        assert _serve(sched, b) == (_alone(engine, b), len(b) - 2)
        # the slot that held c was the other one: a request sharing 16+ tokens with b's still finds it
        assert _serve(sched, b[:20] + [1, 2]) == (_alone(engine, b[:20] + [1, 2]), 20)
    finally:
        sched.stop()
    off = Scheduler(engine, max_running=2, min_reuse=None)
    off.start()
    try:
        assert _serve(off, a)[1] == _serve(off, a)[1] == 0
    finally:
        off.stop()


def test_a_mixed_step_gives_what_decode_and_prefill_give(engine):
    """Engine.step: three sequences' decode tokens and chunks of a fourth's prompt in one call
    at each step (the rows' K and V written at their own positions, each chunk attending to its
    row's cache), against decode_many then prefill on another pool: the same logits to the bit
    (the step's GEMMs and attention are the batched step's and prefill's: the same order of
    sums) and the same greedy tokens."""
    assert engine.mixes_steps
    mixed, separate = mixed_and_separate(engine, PROMPTS[:3] + [list(range(200, 237))], 8)
    assert mixed.shape == (5, 4, engine.vocab_size)
    assert np.array_equal(mixed, separate)


def test_a_mixed_step_refuses_bad_parts(engine):
    seqs = engine.pool(2).seqs
    with pytest.raises(QwcError, match="outside the vocabulary"):
        engine.step([(seqs[0], [engine.vocab_size]), (seqs[1], [1, 2])])
    seqs[1].pos = seqs[1].capacity - 1
    with pytest.raises(QwcError, match="do not fit the context"):
        engine.step([(seqs[0], [1]), (seqs[1], [1, 2])])
    assert seqs[0].pos == 0   # nothing ran


def test_the_scheduler_mixes_decode_tokens_into_prompt_chunks(engine):
    """Requests that arrive while others decode: their prompts' chunks carry the running
    sequences' tokens (Scheduler.mixed_steps), and every request still gets the tokens it
    gets alone."""
    sched = Scheduler(engine, max_running=4, prefill_chunk=8, min_reuse=None)
    done, reqs = threading.Semaphore(0), []
    prompts = [PROMPTS[0], list(range(3, 40)), list(range(200, 237)), PROMPTS[3]]
    for p in prompts:
        reqs.append(Request(p, 10, SamplingParams(), lambda k, v: k == "done" and done.release(), ignore_eos=True))
    sched.submit(reqs[0])
    sched.start()
    try:
        while not reqs[0].generated:   # the first decodes before the others arrive
            time.sleep(0.001)
        for r in reqs[1:]:
            sched.submit(r)
        for _ in reqs:
            assert done.acquire(timeout=120)
    finally:
        sched.stop()
    assert sched.mixed_steps >= 4     # the 37-token prompts' chunks rode with decode tokens
    for p, r in zip(prompts, reqs):
        assert r.generated == _alone(engine, p, 10), p
