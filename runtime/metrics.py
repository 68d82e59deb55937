"""Prometheus metrics of `qwc serve` (prometheus-client, from the `serve` extra), in a registry
of the server's own: requests by outcome, prompt tokens (and those found cached), generated
tokens, queue depth, running sequences, sequences per decode step, draft tokens verified and
kept, time to first token and inter-token latency."""

from __future__ import annotations


class Metrics:
    def __init__(self, scheduler):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        r = self.registry = CollectorRegistry()
        self.requests = Counter("qwc_requests", "finished requests by outcome", ["outcome", "status"], registry=r)
        self.in_flight = Gauge("qwc_requests_in_flight", "requests accepted and not yet finished", registry=r)
        self.prompt_tokens = Counter("qwc_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.cached_tokens = Counter("qwc_prompt_tokens_cached", "prompt tokens of finished requests found in a "
                                     "slot's cache, not prefilled", registry=r)
        self.generated = Counter("qwc_generated_tokens", "tokens generated", registry=r)
        Gauge("qwc_queue_depth", "requests waiting for a slot", registry=r).set_function(lambda: scheduler.queued)
        Gauge("qwc_running_sequences", "sequences in slots", registry=r).set_function(lambda: scheduler.running)
        self.batch = Histogram("qwc_decode_batch_size", "sequences advanced per decode step", registry=r,
                               buckets=(1, 2, 4, 8, 16, 32, 64))
        self.ttft = Histogram("qwc_time_to_first_token_seconds", "request arrival to its first token", registry=r,
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        self.itl = Histogram("qwc_inter_token_latency_seconds", "time between a request's tokens", registry=r,
                             buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1))
        # speculative decoding (qwc serve --speculate): acceptance = accepted / drafted
        Gauge("qwc_draft_tokens", "draft tokens verified (speculative decoding)",
              registry=r).set_function(lambda: scheduler.drafted)
        Gauge("qwc_draft_tokens_accepted", "draft tokens kept (speculative decoding)",
              registry=r).set_function(lambda: scheduler.accepted)
        Gauge("qwc_mixed_steps", "decode steps that carried a prompt chunk in the same call (mixed steps)",
              registry=r).set_function(lambda: scheduler.mixed_steps)
        scheduler.on_step = self.batch.observe

    def request_started(self) -> None:
        self.in_flight.inc()

    def request_done(self, outcome: str, status: int, reqs=None) -> None:
        """One HTTP request's end; `reqs`: its replies (n of them: the prompt counts once)."""
        if reqs:
            self.in_flight.dec()
            self.prompt_tokens.inc(len(reqs[0].prompt))
            self.cached_tokens.inc(reqs[0].cached_tokens)
            for req in reqs:
                self.generated.inc(len(req.generated))
                if req.t_first is not None:
                    self.ttft.observe(req.t_first - req.t_submit)
                for a, b in zip(req.token_times, req.token_times[1:]):
                    self.itl.observe(b - a)
        self.requests.labels("error" if outcome.startswith("error") else outcome, str(status)).inc()

    def embeddings_done(self, tokens: int) -> None:
        """A /v1/embeddings request's end: its inputs' tokens count as prompt tokens."""
        self.prompt_tokens.inc(tokens)
        self.requests.labels("embeddings", "200").inc()

    def render(self) -> str:
        from prometheus_client import generate_latest

        return generate_latest(self.registry).decode()
