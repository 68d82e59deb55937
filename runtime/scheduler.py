"""Continuous batching over one Engine: requests join and leave between steps.

The scheduler executes; its decisions are pure functions in three modules, tested on a fake
engine (tests/runtime/test_scheduler_policy.py):
- runtime/step_policy.py: plan_step, who feeds a token this step and whose prompt advances by
  how much (one chunk a step, chunked prefill), in one call or two;
- runtime/prefix_cache.py: which free slot a new request runs in, and which cached prompt it
  reuses (llama-server's prompt cache, least-recently-used eviction, per adapter);
- runtime/spec_policy.py: whether a request drafts, how long a draft, and the backoff.

One thread owns the engine (it is not thread-safe) and loops: admit queued requests into free
sequence slots (rows of one KV-cache pool, Engine.pool), plan a step, run it, and sample each
call's logits as it returns (_advance: the text is emitted there), so the next plan knows every
request's next token. The decode tokens go in one batched call (Engine.decode_many: the
artifact's decode_batch reads the weights once for every sequence) where the artifact has it,
else one decode per sequence. A request leaves at its stop token, a stop string, its token
budget, the context's end, or when it is cancelled (a client that went away); its slot is free
for the next step.

A reused prefix's positions are what a prefill of the same tokens writes, so reuse changes
speed, not output (to rounding, where decode steps wrote them). Each request's tokens depend
only on its own prompt, cache and sampler, not on what else runs beside it: a token decoded
alone (decode), in a batched step (decode_batch), beside a prompt chunk (step) or in a verify
call gets the same logits to the bit (on x86: each runs the decode step's attention,
kernels/decode_attention.py), and a prompt's chunks never leave a lone token
(prefill_chunks.next_chunk), so its logits do not depend on where they fall.

Callers get events through `Request.emit` (called on the scheduler's thread):
("text", piece) for every token (the piece may be empty), before it ("logprob", (id, logprob,
[(id, logprob), ...])) where the request asked for logprobs, then ("done", finish_reason) with
finish_reason "stop" | "length" | "cancelled" | "error: ..."; counts and times are on the request.

A request with a grammar (Request.constraint) samples only what the grammar allows, and ends
with "stop" as soon as the grammar is complete. OpenAI's n > 1 is n requests of one prompt: the
others (Request.fork_of) copy the first one's prompt cache and sample from its last logits
instead of prefilling the prompt again.

`drive` runs one request on the caller's thread instead, step by step, yielding its events:
Engine.generate (`qwc run`) goes through this same loop, in a scheduler of one slot.

Speculative decoding (`speculate`: a drafter per request, runtime/speculate.py): where at most
`spec_batch` sequences decode, each that has a draft verifies it in one `verify` call (its
last token and the draft) instead of taking a decode step, and keeps every draft token its own
sampler draws, plus the one it draws where they part (Scheduler._verify). Where more decode,
the batched step reads the weights once for all of them, which a call per sequence would not.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np

from qwc.errors import QwcError

from .detokenize import IncrementalText
from .prefix_cache import PrefixCache
from .sampling import Sampler, SamplingParams, logprobs
from .spec_policy import SPEC_BACKOFF, after_verify, average, check_speculation, draft_length
from .speculate import ModelDrafter, NgramDrafter
from .step_policy import StepLimits, forks_of, plan_step, prompt_done


class QueueFull(QwcError):
    """More requests are waiting than the server queues."""


@dataclass
class Request:
    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams
    emit: Callable[[str, str], None]
    stop_strings: tuple[str, ...] = ()
    ignore_eos: bool = False          # llama-server's option: generate max_tokens whatever comes
    constraint: object = None         # runtime/grammar.py: Constraint (response_format, grammar)
    logprobs: int | None = None       # None: off; k: each token's logprob and the k likeliest
    fork_of: "Request | None" = None  # one of n > 1 replies to a prompt: copies this one's prompt cache
    stop_tokens: frozenset[int] | None = None   # tokens that end it (None: the model's end tokens)
    adapter: int = 0                  # its LoRA adapter's slot (runtime/adapters.py); 0: the base
    # filled in by the scheduler
    generated: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    t_submit: float = 0.0
    t_prompt: float | None = None     # its prompt is in the cache
    t_first: float | None = None      # first generated token
    token_times: list[float] = field(default_factory=list)
    cached_tokens: int = 0            # prompt tokens found in a slot's cache (prefix reuse)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        self.cancelled.set()


class _Running:
    """A request in a slot: how much of its prompt is in the cache, what it has said."""

    def __init__(self, req: Request, seq, eos: set[int], limit: int | None = None, tokenizer=None):
        self.req, self.seq, self.eos = req, seq, eos
        self.fed = 0                     # prompt tokens in the cache
        self.next: int | None = None     # a token sampled and emitted, to feed next step
        self.limit = limit
        self.sampler = Sampler(req.sampling, limit, req.constraint)
        self.history = list(req.prompt)
        self.detok = IncrementalText(tokenizer)   # the reply's text, a token at a time
        self.shown = ""                  # text already emitted
        self.drafter = None              # runtime/speculate.py, where the scheduler speculates
        self.draft_time = 0.0            # seconds the last draft took to make (a draft model's steps)
        self.spec_cost: float | None = None   # seconds a cache position in its last verify call
        self.spec_wait = 0               # decode steps to take before drafting again
        self.backoff = SPEC_BACKOFF[0]
        self.spec_kept = self.spec_missed = 0   # draft tokens kept; drafts that ended at a wrong token
        self.draft_step: float | None = None    # seconds a draft token takes to make (running average)


class Scheduler:
    def __init__(self, engine, max_running: int = 8, max_queue: int = 64, prefill_chunk: int = 128,
                 min_reuse: int | None = 16, speculate: Callable[[], NgramDrafter | ModelDrafter] | None = None,
                 spec_batch: int = 1, spec_backoff: bool = True, slots: list | None = None,
                 mixed_steps: bool = True):
        """`slots`: the sequences requests run in (Engine.generate: the engine's own one); by
        default the rows of a pool of `max_running`, taken now. `mixed_steps`: decode tokens
        ride in prompt chunks' calls where the engine can (Engine.step)."""
        if max_running < 1 or max_queue < 0 or prefill_chunk < 1 or (min_reuse is not None and min_reuse < 1):
            raise QwcError("max_running, prefill_chunk and min_reuse must be at least 1, max_queue at least 0")
        if spec_batch < 1:
            raise QwcError(f"spec_batch {spec_batch}: must be at least 1")
        check_speculation(engine, speculate)
        self.engine = engine
        self.max_running, self.max_queue, self.prefill_chunk = max_running, max_queue, prefill_chunk
        self.speculate, self.spec_batch = speculate, spec_batch   # a drafter factory, or None
        self.mixing = mixed_steps   # Engine.step calls where it can (off: `qwc serve --no-mixed-steps`)
        # False: verify every draft, whatever it costs (tests of the verification itself)
        self.spec_backoff = spec_backoff
        self.drafted = self.accepted = 0  # draft tokens verified, and those kept (for metrics)
        self.verify_times: dict[int, float] = {}   # draft length -> seconds of its verify calls (running average)
        self._verified: set[int] = set()           # draft lengths verified at least once
        self.missed = 0                   # drafts that ended at a wrong token
        self.decode_time: float | None = None   # seconds of a one-sequence decode step (average)
        self._free: list = self._allocate() if slots is None else list(slots)   # idle slots
        # what the idle slots' caches hold, and which a new request runs in (Engine.generate
        # hands it from one of its schedulers to the next)
        self.prefix_cache = PrefixCache(min_reuse)
        self._waiting: collections.deque[Request] = collections.deque()
        self._running: list[_Running] = []
        # /v1/embeddings' jobs (runtime/embeddings.py), oldest first, and the slots the first
        # holds for inputs part-way through (row -> sequence)
        self._embeds: collections.deque = collections.deque()
        self._embed_seqs: dict[int, object] = {}
        self._cv = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        self.steps = 0                   # decode steps run, and sequences in them (for metrics)
        self.mixed_steps = 0             # of them, steps that also carried a prompt chunk
        self.last_batch = 0
        self.on_step: Callable[[int], None] | None = None

    def _allocate(self) -> list:
        """The slots, with every byte a step needs taken now, as llama-server takes its KV cache
        at start: the pool's pages, and the logits buffers the library keeps per batch size
        (one batched step of each size, on empty rows). A server that started then does not
        grow while it runs (bench/soak.py) and cannot run out of memory for its caches later."""
        seqs = self.engine.pool(self.max_running, commit=True).seqs
        for b in range(2, min(self.max_running, self.engine.max_batch) + 1):
            self.engine.decode_many([0] * b, seqs[:b])
            for s in seqs[:b]:
                self.engine.reset(s)
        return list(seqs)   # the free list; the pool keeps its own

    # -- the caller's side -------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="qwc-scheduler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread:
            self._thread.join()

    def submit(self, req: Request) -> Request:
        if not req.prompt:
            raise QwcError("a request needs at least one prompt token")
        if len(req.prompt) + 1 > self.engine.ctx:
            raise QwcError(f"the prompt has {len(req.prompt)} tokens; the context holds {self.engine.ctx} "
                           "with room for at least one new token")
        with self._cv:
            if len(self._waiting) >= self.max_queue and len(self._running) + len(self._waiting) >= self.max_running:
                raise QueueFull(f"the server is full: {len(self._running)} running, {len(self._waiting)} queued")
            req.t_submit = time.perf_counter()
            self._waiting.append(req)
            self._cv.notify()
        return req

    def submit_embedding(self, job):
        """Queue an EmbeddingJob (runtime/embeddings.py); its `done` is set when its vectors (or
        its error) are in. Each input must fit the context."""
        if not job.inputs or any(not x for x in job.inputs):
            raise QwcError("an embedding input needs at least one token")
        longest = max(len(x) for x in job.inputs)
        if longest > self.engine.ctx:
            raise QwcError(f"an input has {longest} tokens; the context holds {self.engine.ctx}")
        with self._cv:
            if len(self._embeds) >= max(self.max_queue, 1):
                raise QueueFull(f"the server is full: {len(self._embeds)} embedding requests queued")
            job.t_submit = time.perf_counter()
            self._embeds.append(job)
            self._cv.notify()
        return job

    @property
    def queued(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._running)

    def slot_states(self) -> list[tuple[int, "Request | None", int]]:
        """Every slot as (its row, the request running in it or None, the prompt tokens in its
        cache): a snapshot for `qwc serve`'s /slots, read while the scheduler's thread runs."""
        with self._cv:
            running = {r.seq.row: (r.req, r.fed) for r in list(self._running)}
            idle = [s.row for s in list(self._free)]
        states = [(row, *running[row]) for row in running]
        states += [(row, None, len(self.prefix_cache.held(row))) for row in idle]
        return sorted(states, key=lambda s: s[0])

    # -- the scheduler's thread -----------------------------------------------------------
    def _place(self, req: Request):
        """The slot `req` runs in and how many of its prompt tokens that slot's cache holds
        (runtime/prefix_cache.py decides; here its moves are made on the pool)."""
        rows = {s.row: s for s in self._free}
        free = list(rows)
        where = self.prefix_cache.place(free, req.prompt, req.adapter)
        seq = rows[where.row]
        self._free.remove(seq)
        for m in where.moves:
            (seq.pool.swap_rows if m.kind == "swap" else seq.pool.copy_row)(m.src, m.dst, m.n)
            for r in (m.src, m.dst):   # a free row's placeholder token goes past what it holds
                if r != seq.row:
                    rows[r].pos = len(self.prefix_cache.held(r))
        self.engine.reset(seq)
        seq.pos = where.keep
        seq.adapter = req.adapter
        return seq, where.keep

    def _finish(self, run: _Running, reason: str) -> None:
        run.req.finish_reason = reason
        self._running.remove(run)
        self._free.append(run.seq)
        if hasattr(run.drafter, "close"):   # a draft model's cache goes back for the next request
            run.drafter.close()
        if not reason.startswith("error"):   # after a failed step the cache's contents are unknown
            self.prefix_cache.finished(run.seq.row, (run.req.prompt + run.req.generated)[:run.seq.pos],
                                       run.req.adapter)
        run.req.emit("done", reason)

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stop and not self._waiting and not self._running and not self._embeds:
                    self._cv.wait()
                if self._stop:
                    for run in list(self._running):
                        self._finish(run, "cancelled")
                    while self._waiting:
                        self._waiting.popleft().emit("done", "cancelled")
                    while self._embeds:
                        self._end_embedding("cancelled")
                    return
                # an embedding job older than the oldest queued request takes free slots first
                embed_first = self._embeds and (not self._waiting
                                                or self._embeds[0].t_submit <= self._waiting[0].t_submit)
                if not embed_first:
                    self._admit()
            if self._embeds:
                self._embed_round()
            if embed_first:
                with self._cv:
                    self._admit()
            if not self._running:
                continue
            try:
                self._step()
            except Exception as e:   # a failing step ends its requests with the reason, not the server
                self._fail(e)

    def _embed_round(self) -> None:
        """One embedding call of the oldest job (runtime/embeddings.py plans it): its inputs
        part-way through in the slots they hold, new ones in free slots. A slot whose input
        ended goes back to the free ones, its cache holding that input (the prefix cache's)."""
        job = self._embeds[0]
        if job.cancelled.is_set():
            self._end_embedding("cancelled")
            return
        eng = self.engine
        rows = {s.row: s for s in self._free if s.row < eng.embeds_in_batches or eng.embeds_in_batches == 1}
        # while requests wait for a slot, a job that holds slots finishes those inputs and starts
        # no others, so the slots it frees go to the requests
        offered = [] if self._waiting and self._embed_seqs else sorted(rows)
        try:
            parts = job.plan(offered, eng.max_tokens_per_call, eng.embeds_in_batches)
            if not parts:
                return   # no free slot: generation holds them all, and frees one as it ends
            for p in parts:
                if p.row not in self._embed_seqs:
                    seq = rows[p.row]
                    self._free.remove(seq)
                    eng.reset(seq)
                    seq.adapter = job.adapter
                    self._embed_seqs[p.row] = seq
            states = eng.embed_parts([(self._embed_seqs[p.row], p.tokens, p.rows) for p in parts])
            for row in job.add(parts, states):
                self.prefix_cache.finished(row, job.inputs[next(p.index for p in parts if p.row == row)], job.adapter)
                self._free.append(self._embed_seqs.pop(row))
        except Exception as e:   # a failing call ends the job with the reason, not the server
            self._end_embedding(f"error: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
            return
        if job.finished:
            self._embeds.popleft()
            job.done.set()

    def _end_embedding(self, reason: str) -> None:
        """The oldest embedding job ends without its vectors; the slots it held are free, their
        caches holding nothing known."""
        job = self._embeds.popleft()
        for row, seq in list(self._embed_seqs.items()):
            self.prefix_cache.finished(row, [], job.adapter)
            self._free.append(seq)
        self._embed_seqs.clear()
        job.fail(reason)

    def _admit(self) -> None:
        """Queued requests into free slots, oldest first."""
        while self._waiting and len(self._running) < self.max_running and self._free:
            req = self._waiting.popleft()
            seq, req.cached_tokens = self._place(req)
            eos = req.stop_tokens if req.stop_tokens is not None else self.engine.eos
            run = _Running(req, seq, set() if req.ignore_eos else set(eos), self.engine.sample_limit,
                           self.engine.tokenizer)
            run.fed = req.cached_tokens
            if self.speculate is not None:
                run.drafter = self.speculate()
            self._running.append(run)

    def _fail(self, e: Exception) -> str:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        for run in list(self._running):
            self._finish(run, f"error: {msg}")
        return msg

    def drive(self, req: Request) -> Iterator[tuple[str, object]]:
        """Run `req` on the caller's thread, step by step, yielding its events as they come:
        `qwc run` and Engine.generate go through the same loop as the server (speculation and
        prefix reuse included). Only for a scheduler whose thread is not started. A step that
        fails raises its error (a QwcError) once the request has ended."""
        if self._thread is not None:
            raise QwcError("drive: this scheduler runs on its own thread")
        events: list[tuple[str, object]] = []
        emit = req.emit
        req.emit = lambda kind, value: (events.append((kind, value)), emit and emit(kind, value))
        self.submit(req)
        try:
            while req.finish_reason is None:
                self._admit()
                try:
                    self._step()
                except QwcError as e:
                    self._fail(e)
                    raise
                yield from events
                events.clear()
        finally:   # a consumer that stopped early: the request ends, its slot is free again
            if req in self._waiting:
                self._waiting.remove(req)
            elif req.finish_reason is None:
                req.cancel()
                try:
                    self._step()
                except Exception as e:
                    self._fail(e)

    def _step(self) -> None:
        """Run one plan (runtime/step_policy.py) on the engine; each call's logits are sampled
        as soon as it returns (_advance), so the next plan knows every request's token."""
        for run in [r for r in self._running if r.req.cancelled.is_set()]:
            self._finish(run, "cancelled")
        plan = plan_step(self._running, StepLimits(
            self.prefill_chunk, self.engine.max_tokens_per_call, self.engine.max_batch,
            self.mixing and self.engine.mixes_steps and self.speculate is None))
        if plan.mixed:
            self._mixed(plan)
            return
        if plan.prefill is not None:
            run = plan.prefill
            self._prefilled(run, self.engine.prefill(self._chunk(run, plan.chunk), seq=run.seq))
        # a prompt that chunk completed decodes in this step too
        going = [r for r in self._running if prompt_done(r) and r.next is not None]
        drafts = self._drafts(going)
        plain = [r for r in going if id(r) not in drafts]
        if plain:
            t0 = time.perf_counter()
            out = self.engine.decode_many(self._feed(plain), [r.seq for r in plain])
            if len(plain) == 1 and self.speculate is not None:
                self.decode_time = average(self.decode_time, time.perf_counter() - t0)
            for r, lg in zip(plain, out):
                r.next = self._advance(r, lg)
        for r in going:
            if id(r) in drafts:
                self._verify(r, self._feed([r])[0], drafts[id(r)])
        self._stepped(len(going))

    def _mixed(self, plan) -> None:
        """The decode tokens and a prompt chunk in one call (Engine.step)."""
        run = plan.prefill
        chunk = self._chunk(run, plan.chunk)
        toks = self._feed(plan.decode)
        out = self.engine.step([(r.seq, [t]) for r, t in zip(plan.decode, toks)] + [(run.seq, chunk)])
        for r, lg in zip(plan.decode, out):
            r.next = self._advance(r, lg)
        self._prefilled(run, out[-1])
        self.mixed_steps += 1
        self._stepped(len(plan.decode))

    def _stepped(self, decoded: int) -> None:
        self.last_batch = decoded
        if decoded:
            self.steps += 1
            if self.on_step:
                self.on_step(decoded)

    def _chunk(self, run: _Running, n: int) -> list[int]:
        """The next `n` tokens of run's prompt, which the call about to run puts in its cache."""
        chunk = run.req.prompt[run.fed:run.fed + n]
        run.fed += n
        return chunk

    @staticmethod
    def _feed(runs: list[_Running]) -> list[int]:
        """The tokens `runs` feed now (each one's `next`, taken)."""
        toks = [r.next for r in runs]
        for r in runs:
            r.next = None
        return toks

    def _prefilled(self, run: _Running, logits: np.ndarray) -> None:
        """After a call that put a chunk of run's prompt in its cache: where the prompt is all
        in, the replies that wait for it copy it, and each samples its first token."""
        if not prompt_done(run):
            return
        run.req.t_prompt = time.perf_counter()
        n = len(run.req.prompt)
        for fork in forks_of(run, self._running):
            run.seq.pool.copy_row(run.seq.row, fork.seq.row, n)
            fork.seq.pos = fork.fed = fork.req.cached_tokens = n
            fork.req.t_prompt = run.req.t_prompt
            fork.next = self._advance(fork, logits)
        run.next = self._advance(run, logits)

    def _drafts(self, going: list[_Running]) -> dict[int, list[int]]:
        """Drafts of the requests in `going` that draft this step (id(run) -> draft). None
        before a decode step's time is known: it is what a draft must beat (a draft model
        proposes one at every step, so a plain step would otherwise never be timed)."""
        drafts: dict[int, list[int]] = {}
        if self.speculate is None or len(going) > self.spec_batch or (
                self.decode_time is None and self.spec_backoff):
            return drafts
        for run in going:
            if run.spec_wait:
                run.spec_wait -= 1
                continue
            # a verify call emits up to a token more than its draft: none past the request's
            # budget, and no position past the context's end
            room = min(run.req.max_tokens - len(run.req.generated) - 1, run.seq.capacity - run.seq.pos - 1)
            if self.spec_backoff:
                room = min(room, draft_length(run.drafter.length, self.verify_times, self.accepted,
                                              self.missed, run.spec_kept, run.spec_missed, run.draft_step))
            t0 = time.perf_counter()
            if draft := run.drafter.draft(run.history, room, prompt=len(run.req.prompt)):
                drafts[id(run)] = draft
            run.draft_time = time.perf_counter() - t0
        return drafts

    def _verify(self, run: _Running, tok: int, draft: list[int]) -> None:
        """Feed `tok` and `draft` in one call, then sample from each position's logits in turn:
        while the sampler draws the draft's next token, that position's cache and logits are
        the ones a decode step would have made, so the next is valid too. The first token it
        draws that is not the draft's is emitted and fed next step (_Running.next); the cache
        forgets the positions past what was kept. Each token is drawn by the request's own
        sampler from its own logits, so a sampled reply follows the same distribution (a draft
        token is kept with the probability the sampler gives it, the rest of the time another
        is drawn from the others: speculative sampling with a draft that puts all its mass on
        one token), and a greedy one is the same token for token: the verify call's logits are
        the decode steps' to the bit (Engine.verify; on ARM to ~1e-6)."""
        seq, base = run.seq, run.seq.pos
        t0 = time.perf_counter()
        logits = self.engine.verify([tok, *draft], seq=seq)
        call = time.perf_counter() - t0
        took = call + run.draft_time   # what the tokens cost, drafting included
        k = len(draft)
        if k in self._verified:   # a first call of a length can be slow (buffers made, caches cold)
            self.verify_times[k] = average(self.verify_times.get(k), call)
        self._verified.add(k)
        run.draft_step = average(run.draft_step, run.draft_time / len(draft))
        self.drafted += len(draft)
        kept = 0
        for i, want in enumerate(draft):
            seq.pos = base + 1 + i          # tok and draft[:i] are in the cache
            got = self._advance(run, logits[i])
            if got is None:
                break                       # the request ended on this token
            if got != want:
                run.next = got
                run.spec_missed += 1
                self.missed += 1
                break
            kept += 1
        else:
            seq.pos = base + 1 + len(draft)
            run.next = self._advance(run, logits[-1])
        self.accepted += kept
        run.spec_kept += kept
        run.drafter.kept(kept)
        # the call advanced the cache by tok and the kept draft tokens
        run.spec_cost = took / (1 + kept)
        if self.spec_backoff:
            run.spec_wait, run.backoff = after_verify(run.spec_cost, self.decode_time, run.backoff)

    def _advance(self, run: _Running, logits: np.ndarray) -> int | None:
        """Sample the next token from the last logits and emit its text; the token to decode
        next, or None where the request ends here."""
        req = run.req
        try:
            tok = run.sampler(logits, run.history)
        except QwcError as e:     # this request's grammar failed: it ends, the others go on
            self._finish(run, f"error: {e}")
            return None
        now = time.perf_counter()
        if tok in run.eos:
            self._finish(run, "stop")
            return None
        if req.logprobs is not None:
            req.emit("logprob", (tok, *logprobs(logits, tok, req.logprobs, run.limit)))
        req.generated.append(tok)
        run.history.append(tok)
        if req.t_first is None:
            req.t_first = now
        req.token_times.append(now)
        run.detok.add(tok)
        text = run.detok.text
        reason = None
        cut = min((i for i in (text.find(s, max(0, len(run.shown) - len(s))) for s in req.stop_strings) if i >= 0),
                  default=-1)
        if cut >= 0:
            text, reason = text[:cut], "stop"
        elif req.constraint is not None and req.constraint.finished:
            reason = "stop"       # the grammar is complete: only an end token could follow
        elif len(req.generated) >= req.max_tokens or run.seq.pos + 1 > run.seq.capacity:
            reason = "length"
        # Hold back text that may be the start of a stop string (a partial UTF-8 sequence is not
        # in run.detok.text yet); text before a stop string is final, whatever it ends with.
        # Every token gets an event, its text possibly empty (held back, or a token without
        # text), so clients see the token cadence as from llama-server.
        safe = len(text) if reason else _safe_end(text, req.stop_strings)
        piece = ""
        if safe > len(run.shown):
            piece, run.shown = text[len(run.shown):safe], text[:safe]
        if piece or cut < 0:
            req.emit("text", piece)
        if reason:
            self._finish(run, reason)
            return None
        return tok


def _safe_end(text: str, stops: tuple[str, ...]) -> int:
    """The length of `text` that cannot be the beginning of a stop string still being written."""
    end = len(text)
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                end = min(end, len(text) - k)
                break
    return end
