"""What structured output costs: json_schema replies against free text of the same lengths, N
requests at once through `qwc serve`'s scheduler (its batched decode steps, without HTTP),
alternating rounds:

    .venv/bin/python bench/structured.py ART.qwc [--clients 8] [--rounds 3] [--max-tokens 128] [--json F]

Each round: N chat requests asking for a person as JSON, sampled at temperature 1 (seeds new
each round) under a json_schema; then the same prompts as free text, with ignore_eos and each
request's max_tokens set to the length its JSON reply had, so both runs generate the same
number of tokens in the same batches. Reported: aggregate generated tok/s of each and their
ratio, and the grammar's time per token: computing masks (on the worker thread, overlapping
the decode step) and the sampler waiting for them (on the critical path). The artifact needs a
tokenizer and a chat template, e.g. the README's SmolLM2 build (build/smollm2.qwc).
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

import numpy as np

from qwc.chat_template import ChatTemplate
from qwc.runtime.engine import Engine
from qwc.runtime.grammar import TokenVocab
from qwc.runtime.sampling import SamplingParams
from qwc.runtime.scheduler import Request, Scheduler

PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 40},
                         "age": {"type": "integer", "minimum": 0, "maximum": 130},
                         "city": {"type": "string", "maxLength": 40},
                         "languages": {"type": "array", "items": {"enum": ["English", "French", "German"]},
                                       "maxItems": 3}},
          "required": ["name", "age", "city", "languages"], "additionalProperties": False}
PLACES = ["France", "Japan", "Peru", "Norway", "Kenya", "Canada", "India", "Italy", "Chile", "Egypt"]


def run(sched: Scheduler, reqs: list[Request]) -> float:
    """Submit every request at once; seconds until the last one is done."""
    left, done = [len(reqs)], threading.Event()

    def emit(kind, value):
        if kind == "done":
            left[0] -= 1
            if not left[0]:
                done.set()
    t0 = time.perf_counter()
    for r in reqs:
        r.emit = emit
        sched.submit(r)
    done.wait()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    eng = Engine(a.artifact, ctx=512, threads=a.threads)
    vocab = TokenVocab(eng.tokenizer, eng.vocab_size, eng.eos, eng.sample_limit)
    grammar = vocab.json_grammar(PERSON)
    chat = ChatTemplate(eng.model.chat_template)
    prompts = [eng.encode(chat.render([{"role": "user", "content": f"Describe a person who lives in "
                                        f"{PLACES[i % len(PLACES)]}, as JSON."}])) for i in range(a.clients)]
    sched = Scheduler(eng, max_running=a.clients, min_reuse=None)   # no prefix reuse: both runs prefill alike
    sched.start()
    rounds = []
    try:
        for k in range(a.rounds):
            cons = [vocab.constraint(grammar) for _ in prompts]
            js = [Request(prompt=p, max_tokens=a.max_tokens, sampling=SamplingParams(temperature=1.0, seed=k * 100 + i),
                          emit=None, constraint=c) for i, (p, c) in enumerate(zip(prompts, cons))]
            t_js = run(sched, js)
            lengths = [len(r.generated) for r in js]
            free = [Request(prompt=p, max_tokens=n, sampling=SamplingParams(temperature=1.0, seed=k * 100 + i),
                            emit=None, ignore_eos=True) for i, (p, n) in enumerate(zip(prompts, lengths))]
            t_free = run(sched, free)
            n = sum(lengths)
            valid = sum(r.finish_reason == "stop" for r in js)
            rounds.append({"tokens": n, "json_tok_s": n / t_js, "free_tok_s": n / t_free, "stopped": valid,
                           "mask_us": sum(c.mask_s for c in cons) / n * 1e6,
                           "wait_us": sum(c.wait_s for c in cons) / n * 1e6})
            r = rounds[-1]
            print(f"round {k + 1}: {n} tokens, json_schema {r['json_tok_s']:.1f} tok/s, free {r['free_tok_s']:.1f} "
                  f"tok/s ({r['json_tok_s'] / r['free_tok_s']:.3f}x); {valid}/{len(js)} ended by the grammar",
                  flush=True)
    finally:
        sched.stop()
    med = (lambda key: float(np.median([r[key] for r in rounds])))
    print(f"\n{a.artifact.name}: vocabulary {eng.vocab_size}, {a.clients} requests at once, {eng.threads} threads, "
          f"median of {a.rounds} alternating rounds")
    print("| json_schema tok/s | free text tok/s | ratio | mask µs / token (worker) | wait µs / token (critical path) |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    print(f"| {med('json_tok_s'):.1f} | {med('free_tok_s'):.1f} | "
          f"{float(np.median([r['json_tok_s'] / r['free_tok_s'] for r in rounds])):.3f}x | "
          f"{med('mask_us'):.0f} | {med('wait_us'):.0f} |")
    if a.json:
        a.json.write_text(json.dumps(rounds, indent=1))


if __name__ == "__main__":
    main()
