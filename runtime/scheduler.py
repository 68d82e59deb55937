"""Continuous batching over one Engine: requests join and leave between steps.

One thread owns the engine (it is not thread-safe) and loops: admit queued requests into free
sequence slots (rows of one KV-cache pool, Engine.pool; the lowest free row first, so that the
running rows stay packed), run at most `prefill_chunk` prompt tokens of one prefilling request,
then one decode step for every running request, so a long prompt arriving never stalls the
streams already flowing (chunked prefill). The decode step is one batched call
(Engine.decode_many: the artifact's decode_batch reads the weights once for every sequence)
where the artifact has it, else one decode per sequence. A request leaves at its stop token, a
stop string, its token budget, the context's end, or when it is cancelled (a client that went
away); its slot is free for the next step.

Prefix reuse (llama-server's prompt cache): a free slot keeps the cache of the request it
last ran. A new request gets the cache that shares the longest prefix with its prompt, if that
prefix is at least `min_reuse` tokens (a shared system prompt, an earlier turn of the same
chat), and prefills only the rest. It runs in the lowest free row all the same (the cache is
swapped down into it: a few MB copied against milliseconds a prompt token), and a cache about
to be overwritten moves to the free row holding the least recently used one, so caches live
as long as idle rows can keep them. The reused positions are what a prefill of the same tokens
writes, so this changes speed, not output (to rounding, where decode steps wrote them).

Each request's tokens depend only on its own prompt, cache and sampler, not on what else runs
beside it: a token decoded alone (decode), in a batched step (decode_batch), beside a prompt
chunk (step) or in a verify call gets the same logits to the bit (on x86: each runs the decode
step's attention, kernels/attention.py: decode_attention), and a prompt's chunks never leave
a lone token (engine.next_chunk), so its logits do not depend on where they fall.

Callers get events through `Request.emit` (called on the scheduler's thread):
("text", piece) for every token (the piece may be empty), before it ("logprob", (id, logprob,
[(id, logprob), ...])) where the request asked for logprobs, then ("done", finish_reason) with
finish_reason "stop" | "length" | "cancelled" | "error: ..."; counts and times are on the request.

A request with a grammar (Request.constraint) samples only what the grammar allows, and ends
with "stop" as soon as the grammar is complete. OpenAI's n > 1 is n requests of one prompt: the
others (Request.fork_of) copy the first one's prompt cache and first logits instead of
prefilling the prompt again.

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
from .engine import next_chunk
from .sampling import Sampler, SamplingParams, logprobs
from .speculate import ModelDrafter, NgramDrafter

# A draft is verified in one call, which costs more than a decode step: 1.4 decode steps of
# SmolLM2 at 2 tokens, 2.4 at 5, 3.2 at 8 (x86, 2 threads; docs/results.md). A request whose
# last verify call (with the draft model's steps, where one drafts) took longer a cache
# position than a decode step takes stops drafting for a number of steps that doubles with each
# such call (up to the last figure), then tries again: what is worth drafting changes along a
# reply (a quote, then free text). Short waits, judged on the last call alone: a reply that
# copies does so in bursts, and a miss before a burst cost it the burst. SmolLM2, prompt lookup
# (bench/speculate.py): waits of 8-128 steps on a running average gave 1.79x / 1.15x / 1.05x /
# 1.01x on the quote, rewrite, code and story replies; 2-32 on the last call 1.88x / 1.37x /
# 1.04x / 1.01x; never waiting 1.91x / 1.38x / 1.02x / 1.02x (but a draft model's steps are
# not free, and a slow verify call must still stop it).
SPEC_BACKOFF = (2, 32)
SPEC_AVERAGE = 0.5   # weight of the newest decode step in the running average of their times
# What a verify call costs grows with its length at a rate that depends on the model and the
# machine: 0.1-0.25 of a decode step a token, then a jump where a call leaves decode's streams
# (a 7B shape on 2 x86 cores: 1.03 / 1.09 / 1.21 / 1.32 / 1.68 steps at 1-5 draft tokens), so
# the drafter's own length (runtime/speculate.py: next_length) is cut to the measured length
# that advances the cache fastest at the acceptance seen so far (Scheduler._draft_length).


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
        self.logits: np.ndarray | None = None
        self.limit = limit
        self.sampler = Sampler(req.sampling, limit, req.constraint)
        self.history = list(req.prompt)
        self.detok = IncrementalText(tokenizer)   # the reply's text, a token at a time
        self.shown = ""                  # text already emitted
        self.pending: int | None = None  # a token sampled and emitted, not yet in the cache
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
        self.min_reuse = min_reuse        # None: no prefix reuse
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
        self._cached: dict[int, list[int]] = {}   # row -> the tokens its cache holds, for idle slots
        # row -> the adapter those tokens were computed with: a prefix is reused only by the same
        # adapter (every layer's keys and values depend on it)
        self._cached_adapter: dict[int, int] = {}
        self._used: dict[int, int] = {}           # row -> when it last finished a request (a count)
        self._finished = 0
        self._waiting: collections.deque[Request] = collections.deque()
        self._running: list[_Running] = []
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

    @property
    def queued(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._running)

    # -- the scheduler's thread -----------------------------------------------------------
    def _slot(self, req: Request):
        """The lowest free slot (running rows stay packed: a batched step computes every row up
        to the highest running one), holding the longest prefix of `req`'s prompt that any free
        slot's cache holds; and how many prompt tokens that is."""
        seq = min(self._free, key=lambda s: s.row)
        self._free.remove(seq)
        keep = 0
        if self.min_reuse is not None:
            def held(s) -> list[int]:
                return self._cached.get(s.row, ()) if self._cached_adapter.get(s.row, 0) == req.adapter else ()
            src = max([seq, *self._free], key=lambda s: _common(held(s), req.prompt))
            # at least two prompt tokens are prefilled (engine.next_chunk: one alone would run
            # decode's kernels): the last one's logits give the first new token
            n = min(_common(held(src), req.prompt), len(req.prompt) - 2)
            if n >= self.min_reuse:
                keep = n
                if src is not seq:   # the prefix comes down to this slot, what it held goes up
                    self._swap(seq, src)
        if not keep:
            self._keep_elsewhere(seq)
        self._cached.pop(seq.row, None)
        self._cached_adapter.pop(seq.row, None)
        self.engine.reset(seq)
        seq.pos = keep
        seq.adapter = req.adapter
        return seq, keep

    def _swap(self, a, b) -> None:
        ta, tb = self._cached.get(a.row, []), self._cached.get(b.row, [])
        a.pool.swap_rows(a.row, b.row, max(len(ta), len(tb)))
        self._cached[a.row], self._cached[b.row] = tb, ta
        ad = self._cached_adapter
        ad[a.row], ad[b.row] = ad.get(b.row, 0), ad.get(a.row, 0)
        self._used[a.row], self._used[b.row] = self._used.get(b.row, -1), self._used.get(a.row, -1)
        a.pos, b.pos = len(tb), len(ta)   # a free row's placeholder token goes past what it holds

    def _keep_elsewhere(self, seq) -> None:
        """Before `seq`'s cache is overwritten, move what it holds to the free slot that holds
        the oldest (or nothing), if that is older: the eviction is least recently used."""
        mine = self._cached.get(seq.row)
        if not mine or not self._free:
            return
        age = (lambda s: self._used[s.row] if self._cached.get(s.row) else -1)   # an empty row is oldest
        other = min(self._free, key=age)
        if age(other) < self._used[seq.row]:
            seq.pool.copy_row(seq.row, other.row, len(mine))
            self._cached[other.row], self._used[other.row], other.pos = mine, self._used[seq.row], len(mine)
            self._cached_adapter[other.row] = self._cached_adapter.get(seq.row, 0)

    def _finish(self, run: _Running, reason: str) -> None:
        run.req.finish_reason = reason
        self._running.remove(run)
        self._free.append(run.seq)
        if hasattr(run.drafter, "close"):   # a draft model's cache goes back for the next request
            run.drafter.close()
        if not reason.startswith("error"):   # after a failed step the cache's contents are unknown
            self._cached[run.seq.row] = (run.req.prompt + run.req.generated)[:run.seq.pos]
            self._cached_adapter[run.seq.row] = run.req.adapter
            self._finished += 1
            self._used[run.seq.row] = self._finished
        run.req.emit("done", reason)

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stop and not self._waiting and not self._running:
                    self._cv.wait()
                if self._stop:
                    for run in list(self._running):
                        self._finish(run, "cancelled")
                    while self._waiting:
                        self._waiting.popleft().emit("done", "cancelled")
                    return
                self._admit()
            try:
                self._step()
            except Exception as e:   # a failing step ends its requests with the reason, not the server
                self._fail(e)

    def _admit(self) -> None:
        """Queued requests into free slots, oldest first."""
        while self._waiting and len(self._running) < self.max_running and self._free:
            req = self._waiting.popleft()
            seq, req.cached_tokens = self._slot(req)
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
        for run in [r for r in self._running if r.req.cancelled.is_set()]:
            self._finish(run, "cancelled")
        # one prefill chunk a step, to the request that has waited longest; a fork waits for its
        # leader's prompt and copies it
        pending = [r for r in self._running if r.fed < len(r.req.prompt)]
        leads = {id(r.req): r for r in self._running}
        own = [r for r in pending if not self._fork(r, leads.get(id(r.req.fork_of)))]
        # Mixed steps: the running sequences' decode tokens ride in the chunk's call (one read
        # of the weights for both, as llama-server's batches), sampled before it; a prompt
        # that completes there samples its first token next step. Without running sequences,
        # or where the engine cannot take them in one call, the chunk runs on its own first.
        mixed = bool(own) and self._mixes([r for r in self._running if r.fed == len(r.req.prompt)] + own[:1])
        if own and not mixed:
            self._prefill(own[0], self.prefill_chunk, [])
            for r in pending:
                self._fork(r, leads.get(id(r.req.fork_of)))
        decoding = [r for r in self._running if r.fed == len(r.req.prompt) and r.logits is not None]
        going = [(run, tok) for run in decoding if (tok := self._next(run)) is not None]
        if mixed:   # (no drafts: a scheduler that drafts does not mix)
            self._prefill(own[0], min(self.prefill_chunk, self.engine.max_tokens_per_call - len(going)), going)
            for r in pending:
                self._fork(r, leads.get(id(r.req.fork_of)))
            return
        drafts = {}
        # no draft before a decode step's time is known: it is what a draft must beat (a draft
        # model proposes one at every step, so a plain step would otherwise never be timed)
        if self.speculate is not None and len(going) <= self.spec_batch and (
                self.decode_time is not None or not self.spec_backoff):
            for run, _ in going:
                if run.spec_wait:
                    run.spec_wait -= 1
                    continue
                # a verify call emits up to a token more than its draft: none past the request's
                # budget, and no position past the context's end
                room = min(run.req.max_tokens - len(run.req.generated) - 1, run.seq.capacity - run.seq.pos - 1)
                if self.spec_backoff:
                    room = min(room, self._draft_length(run))
                t0 = time.perf_counter()
                if draft := run.drafter.draft(run.history, room):
                    drafts[id(run)] = draft
                run.draft_time = time.perf_counter() - t0
        plain = [(run, tok) for run, tok in going if id(run) not in drafts]
        if plain:
            seqs, toks = [r.seq for r, _ in plain], [t for _, t in plain]
            t0 = time.perf_counter()
            for (run, _), lg in zip(plain, self.engine.decode_many(toks, seqs)):
                run.logits = lg
            if len(plain) == 1 and self.speculate is not None:
                self.decode_time = _average(self.decode_time, time.perf_counter() - t0)
        for run, tok in going:
            if id(run) in drafts:
                self._verify(run, tok, drafts[id(run)])
        self.last_batch = len(going)
        if going:
            self.steps += 1
            if self.on_step:
                self.on_step(len(going))

    def _mixes(self, runs: list[_Running]) -> bool:
        """Whether the engine takes these sequences' tokens in one step call."""
        return (len(runs) > 1 and self.mixing and self.engine.mixes_steps and self.speculate is None
                and max(r.seq.row for r in runs) < self.engine.max_batch)

    def _prefill(self, run: _Running, most: int, plain: list) -> None:
        """The next chunk (up to `most` tokens) of run's prompt, with the decode tokens of
        `plain` ((run, token) pairs) in the same call where there are any."""
        chunk = run.req.prompt[run.fed:run.fed + next_chunk(len(run.req.prompt) - run.fed, most)]
        if plain:
            out = self.engine.step([(r.seq, [t]) for r, t in plain] + [(run.seq, chunk)])
            for (r, _), lg in zip(plain, out):
                r.logits = lg
            run.logits = out[-1]
            self.mixed_steps += 1
            self.steps += 1
            self.last_batch = len(plain)
            if self.on_step:
                self.on_step(len(plain))
        else:
            run.logits = self.engine.prefill(chunk, seq=run.seq)
        run.fed += len(chunk)
        if run.fed == len(run.req.prompt):
            run.req.t_prompt = time.perf_counter()

    def _next(self, run: _Running) -> int | None:
        """The token `run` feeds this step: one a verification sampled (and emitted) already,
        else a new one from its last logits (None: the request ended)."""
        tok, run.pending = run.pending, None
        return tok if tok is not None else self._advance(run)

    def _verify(self, run: _Running, tok: int, draft: list[int]) -> None:
        """Feed `tok` and `draft` in one call, then sample from each position's logits in turn:
        while the sampler draws the draft's next token, that position's cache and logits are
        the ones a decode step would have made, so the next is valid too. The first token it
        draws that is not the draft's is emitted and fed next step (Running.pending); the cache
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
            self.verify_times[k] = _average(self.verify_times.get(k), call)
        self._verified.add(k)
        run.draft_step = _average(run.draft_step, run.draft_time / len(draft))
        self.drafted += len(draft)
        kept = 0
        for i, want in enumerate(draft):
            seq.pos = base + 1 + i          # tok and draft[:i] are in the cache
            run.logits = logits[i]
            got = self._advance(run)
            if got is None:
                break                       # the request ended on this token
            if got != want:
                run.pending = got
                run.spec_missed += 1
                self.missed += 1
                break
            kept += 1
        else:
            seq.pos = base + 1 + len(draft)
            run.logits = logits[-1]
        self.accepted += kept
        run.spec_kept += kept
        run.drafter.kept(kept)
        # the call advanced the cache by tok and the kept draft tokens
        run.spec_cost = took / (1 + kept)
        if self.spec_backoff and self.decode_time is not None and run.spec_cost > self.decode_time:
            run.spec_wait, run.backoff = run.backoff, min(2 * run.backoff, SPEC_BACKOFF[1])
        else:
            run.backoff = SPEC_BACKOFF[0]

    def _draft_length(self, run: _Running) -> int:
        """The most draft tokens to ask `run`'s drafter for: its own next length, or a shorter one
        whose verify calls (as timed here) with the drafting (the request's time a draft token)
        advance the cache more a second, at the request's acceptance so far. Each draft token is
        taken as kept with probability q = (kept + 2 q0) / (kept + misses + 2): the request's own
        counts, with a start worth two drafts at q0, the rate of every request so far (so a
        request's first drafts are judged on the others'). A call of k then advances
        1 + q + ... + q^k positions. A length not timed yet is asked for as it is (that is how
        lengths get timed; a length's first call, which can be slow with buffers made and
        caches cold, is not counted)."""
        wish = run.drafter.length
        if wish not in self.verify_times:
            return wish
        q0 = (self.accepted + 1) / (self.accepted + self.missed + 2)
        q = (run.spec_kept + 2 * q0) / (run.spec_kept + run.spec_missed + 2)
        step = run.draft_step or 0.0

        def rate(k: int) -> float:
            return sum(q ** i for i in range(k + 1)) / (self.verify_times[k] + k * step)
        return max((k for k in self.verify_times if k <= wish), key=rate)

    def _fork(self, run: _Running, lead: _Running | None) -> bool:
        """For one of n replies to a prompt (Request.fork_of): True while its leader's prompt is
        still being prefilled (it waits), or once it has copied the leader's prompt cache and
        first logits (the step the leader's prefill completes, before the leader samples);
        False where it prefills on its own (no leader running, or the leader is past that step)."""
        if lead is None or run.fed == len(run.req.prompt) or lead.req.prompt != run.req.prompt:
            return False
        if lead.fed < len(lead.req.prompt):
            return True
        if lead.req.generated or lead.logits is None or lead.seq.pos != len(lead.req.prompt):
            return False
        n = len(run.req.prompt)
        lead.seq.pool.copy_row(lead.seq.row, run.seq.row, n)
        run.seq.pos = run.fed = run.req.cached_tokens = n
        run.req.t_prompt = time.perf_counter()
        run.logits = lead.logits.copy()   # the leader's is a view the next call overwrites
        return True

    def _advance(self, run: _Running) -> int | None:
        """Sample the next token from the last logits and emit its text; the token to decode
        next, or None where the request ends here."""
        req = run.req
        try:
            tok = run.sampler(run.logits, run.history)
        except QwcError as e:     # this request's grammar failed: it ends, the others go on
            self._finish(run, f"error: {e}")
            return None
        now = time.perf_counter()
        if tok in run.eos:
            self._finish(run, "stop")
            return None
        if req.logprobs is not None:
            req.emit("logprob", (tok, *logprobs(run.logits, tok, req.logprobs, run.limit)))
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


def check_speculation(engine, speculate) -> None:
    """Speculation verifies drafts through the artifact's verify entry point, or score's in
    artifacts compiled before it (speculation_warning)."""
    if speculate is not None and engine._score is None:
        raise QwcError(f"{engine.path}: speculative decoding needs the artifact's score entry point "
                       "(compiled by an older qwc; recompile it)")


def speculation_warning(engine, speculate) -> str | None:
    """What `qwc run` / `qwc serve` warn of when drafts are verified by score (an artifact
    compiled before the verify entry point), whose rounding differs from the decode step's."""
    if speculate is None or engine._verify is not None:
        return None
    return (f"{engine.path.name} has no verify entry point (compiled by an older qwc): drafts are verified by "
            "score, whose rounding differs from the decode step's, so a greedy reply can part from the one "
            "without drafts; recompile it for the same replies")


def _average(old: float | None, new: float) -> float:
    return new if old is None else (1 - SPEC_AVERAGE) * old + SPEC_AVERAGE * new


def _common(a, b) -> int:
    """The length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    neq = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(neq[0]) if neq.size else n


def _safe_end(text: str, stops: tuple[str, ...]) -> int:
    """The length of `text` that cannot be the beginning of a stop string still being written."""
    end = len(text)
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                end = min(end, len(text) - k)
                break
    return end
