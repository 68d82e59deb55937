"""What the next step of continuous batching runs: which requests feed a token, whose prompt
advances and by how many tokens, and whether both go in one call. A pure function of the running
requests, so it is tested without a model (runtime/scheduler.py executes the plan).

One prompt chunk a step, to the request that has waited longest, so a long prompt arriving never
stalls the streams already flowing (chunked prefill). The chunk rides in the decode tokens' call
where the engine takes both at once (Engine.step: the weights read once for both, as
llama-server's batches do); otherwise it runs first, on its own, and a prompt it completes
decodes in the same step. One of n replies to a prompt (Request.fork_of) waits while its leader
prefills, then copies the leader's cache instead of prefilling the prompt again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from .prefill_chunks import next_chunk


class Running(Protocol):
    """What the policy reads of a running request (runtime/scheduler.py: _Running)."""
    fed: int             # prompt tokens in its cache
    next: int | None     # a sampled token it feeds next (None while its prompt is not all in)
    req: object          # its Request: prompt, fork_of
    seq: object          # its sequence: row


@dataclass
class StepPlan:
    decode: list = field(default_factory=list)   # requests that feed their `next` token
    prefill: Running | None = None                # the request whose prompt advances
    chunk: int = 0                                # by this many tokens
    mixed: bool = False                           # in one call with `decode`'s tokens


@dataclass
class StepLimits:
    prefill_chunk: int          # prompt tokens a step at most
    max_tokens_per_call: int    # tokens one engine call takes
    max_batch: int              # rows one batched call reaches
    can_mix: bool               # the engine takes decode tokens and a chunk in one call


def plan_step(running: list[Running], limits: StepLimits) -> StepPlan:
    """The next step for `running`, in admission order."""
    plan = StepPlan(decode=[r for r in running if prompt_done(r) and r.next is not None])
    own = [r for r in running if not prompt_done(r) and waits_for(r, running) is None]
    if not own:
        return plan
    run = plan.prefill = own[0]
    plan.mixed = (limits.can_mix and bool(plan.decode)
                  and max(r.seq.row for r in [*plan.decode, run]) < limits.max_batch)
    most = limits.prefill_chunk
    if plan.mixed:
        most = min(most, limits.max_tokens_per_call - len(plan.decode))
    plan.chunk = next_chunk(len(run.req.prompt) - run.fed, most)
    return plan


def prompt_done(run: Running) -> bool:
    return run.fed == len(run.req.prompt)


def waits_for(run: Running, running: list[Running]) -> Running | None:
    """The leader whose prompt `run` (one of n replies) waits to copy: running, with the same
    prompt, still prefilling it. None where `run` prefills its own."""
    fork_of = run.req.fork_of
    if fork_of is None:
        return None
    lead = next((r for r in running if r.req is fork_of), None)
    if lead is None or lead.req.prompt != run.req.prompt or prompt_done(lead):
        return None
    return lead


def forks_of(lead: Running, running: list[Running]) -> list[Running]:
    """The requests that wait for `lead`'s prompt, asked when it is all in: their copy is due."""
    return [r for r in running if r is not lead and r.req.fork_of is lead.req
            and r.req.prompt == lead.req.prompt and not prompt_done(r)]
