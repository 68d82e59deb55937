"""When the scheduler drafts, and how long a draft it asks for: the policy of speculative decoding,
on timings and counts only, so it is tested without a model (runtime/scheduler.py runs it).

A draft is verified in one call, which costs more than a decode step, and more the longer the
draft. A request whose last verify call (with the drafting, where a draft model's steps make
it) took longer a cache position than a decode step takes stops drafting for a number of steps
that doubles with each such call (up to SPEC_BACKOFF's last figure), then tries again: what is
worth drafting changes along a reply (a quote, then free text). The waits are short and judged
on the last call alone, because a reply that copies does so in bursts, and a miss just before a
burst would cost the whole burst (bench/speculate.py measured the alternatives; docs/history/README.md).

What a verify call costs grows with its length at a rate that depends on the model and the
machine, with a jump where a call leaves the decode kernels' streams. So the drafter's own
length (runtime/speculate.py: next_length) is cut to the timed length that advances the cache
fastest at the acceptance seen so far (draft_length).
"""

from __future__ import annotations

from qwc.errors import QwcError

SPEC_BACKOFF = (2, 32)   # decode steps without drafting after a slow verify call: first, most
SPEC_AVERAGE = 0.5       # weight of the newest time in a running average


def average(old: float | None, new: float) -> float:
    """A running average of times, `new` weighted SPEC_AVERAGE."""
    return new if old is None else (1 - SPEC_AVERAGE) * old + SPEC_AVERAGE * new


def draft_length(wish: int, verify_times: dict[int, float], accepted: int, missed: int,
                 kept: int, misses: int, draft_step: float | None) -> int:
    """The most draft tokens to ask a request's drafter for: its own next length `wish`, or a
    shorter one whose verify calls (`verify_times`: seconds by draft length) with the drafting
    (`draft_step`: the request's seconds a draft token) advance the cache more a second, at
    the request's acceptance so far. Each draft token is taken as kept with probability
    q = (kept + 2 q0) / (kept + misses + 2): the request's own counts, with a start worth two
    drafts at q0, the rate of every request so far (`accepted` draft tokens kept, `missed`
    drafts that ended at a wrong token), so a request's first drafts are judged on the others'.
    A call of k then advances 1 + q + ... + q^k positions. A length not timed yet is asked for
    as it is: that is how lengths get timed."""
    if wish not in verify_times:
        return wish
    q0 = (accepted + 1) / (accepted + missed + 2)
    q = (kept + 2 * q0) / (kept + misses + 2)
    step = draft_step or 0.0

    def rate(k: int) -> float:
        return sum(q ** i for i in range(k + 1)) / (verify_times[k] + k * step)
    return max((k for k in verify_times if k <= wish), key=rate)


def after_verify(cost: float, decode_time: float | None, backoff: int) -> tuple[int, int]:
    """A request's (steps to wait before drafting again, next backoff) after a verify call that
    took `cost` seconds a cache position it advanced, against `decode_time`, a decode step's."""
    if decode_time is not None and cost > decode_time:
        return backoff, min(2 * backoff, SPEC_BACKOFF[1])
    return 0, SPEC_BACKOFF[0]


def check_speculation(engine, speculate) -> None:
    """Speculation verifies drafts through the artifact's verify entry point, or score's in
    artifacts compiled before it (speculation_warning)."""
    if speculate is not None and not engine.verifies_drafts:
        raise QwcError(f"{engine.path}: speculative decoding needs the artifact's score entry point "
                       "(compiled by an older qwc; recompile it)")


def speculation_warning(engine, speculate) -> str | None:
    """What `qwc run` / `qwc serve` warn of when drafts are verified by score (an artifact
    compiled before the verify entry point), whose rounding differs from the decode step's."""
    if speculate is None or engine.verifies_exactly:
        return None
    return (f"{engine.path.name} has no verify entry point (compiled by an older qwc): drafts are verified by "
            "score, whose rounding differs from the decode step's, so a greedy reply can part from the one "
            "without drafts; recompile it for the same replies")
