"""Speculative decoding by prompt lookup (`qwc serve --speculate ngram`), or by a draft model
(`qwc serve --draft SMALL.qwc`, with --draft here), against the same scheduler without it, one
request at a time on real weights:

    .venv/bin/python bench/speculate.py [ART.qwc] [--rounds 3] [--max-tokens 160] [--threads N]
                                        [--draft-max 7] [--lookup-min 3] [--draft SMALL.qwc] [--json F]
    .venv/bin/python bench/speculate.py ART.qwc --draft SMALL.qwc --peer ART.gguf --peer-draft SMALL.gguf
    .venv/bin/python bench/speculate.py ART.qwc --costs 0.6,0.8,0.9 [--depth 256] [--draft-max 7] [--draft SMALL.qwc]
    .venv/bin/python bench/speculate.py ART.qwc --oracle 0.5,0.7,0.9 --draft SMALL.qwc [--max-tokens 64]

Four kinds of reply, three prompts each, from Pride and Prejudice (`qwc data fetch`) and a
few lines of Python:
- quote: a passage, then its first words again (a completion): the reply copies it;
- rewrite: a chat turn asking for the passage with its spelling modernised;
- code: a chat turn asking for a function with type hints added;
- story: a chat turn asking for a short story (little to copy: what drafting costs).

Per kind and mode: generated tokens a second over the decode phase (first token to last; the
prompt's prefill is the same in both), the median over rounds, and the median of the rounds'
ratios (each prompt runs without and with drafts back to back: this machine is shared); draft
tokens verified and kept; and how many greedy replies are the same text in both modes. The
requests run through `qwc serve`'s scheduler (runtime/scheduler.py) without HTTP, whose cost
is the same in both modes.
The artifact needs a tokenizer and a chat template: the README's SmolLM2 build (default
build/smollm2.qwc).

--peer ART.gguf (the served model as llama.cpp runs it) with --peer-draft SMALL.gguf (the draft
model's GGUF) adds llama-server (bench/llamacpp.sh x86) without and with `-md SMALL.gguf
--spec-type draft-simple` (drafts of up to --draft-max tokens, its other settings its own), one
request at a time on the same threads, each prompt's runs back to
back: its tok/s from its own timings (predicted_per_second over the kind's prompts), its draft
tokens kept, and qwc's tok/s with drafts over llama-server's with drafts.

--costs Q,...: for a model size with no real weights here (the 0.5B-7B shapes of
bench/peers.py, random weights): a verify call's time against a decode step's at every draft
length up to --draft-max after --depth cached tokens (default 256), measured (and a score call's, which
verified drafts before the verify entry point, with how far each one's logits are from the
decode steps'), and from them (a model, labelled so) the per-token acceptance q at which
drafting breaks even and the speed-up at each q given. The first table's kept / verified
shares are what q is on real text. With --draft SMALL.qwc, the draft model's decode step is
timed too (after the same depth) and a draft of k tokens is charged k of its steps (the first
of which also feeds what the last verify kept): where a draft model pays on shapes with no
real pair here, e.g. the 0.5B drafting for the 7B of bench/scale.py.

--oracle Q,...: the same question end to end, through the scheduler and its draft-length and
backoff policies, on shapes with no real pair: three prompts of random tokens; each draft token
is the served model's own greedy one with probability Q (drawn independently), else a wrong
one, and each draft of k tokens pays k decode steps of the --draft model (its time, not its
tokens). The acceptance is set, so the ratio is what a real pair keeping that share would get
with these costs, not a measurement of any pair's acceptance.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import threading
import time
from pathlib import Path

import numpy as np

from qwc.bench.llamacpp import VERSION
from qwc.chat_template import ChatTemplate
from qwc.eval.data import novel, read_text
from qwc.limits import DRAFT_MAX
from qwc.runtime.engine import Engine
from qwc.runtime.sampling import SamplingParams
from qwc.runtime.scheduler import Request, Scheduler
from qwc.runtime.speculate import NGRAM_MAX, DraftModel, NgramDrafter, next_length

REPO = Path(__file__).resolve().parent.parent
CODE = ['''def mean(values):
    total = 0
    for v in values:
        total += v
    return total / len(values)
''', '''def find_user(users, name):
    for user in users:
        if user["name"] == name:
            return user
    return None
''', '''def word_counts(text):
    counts = {}
    for word in text.lower().split():
        counts[word] = counts.get(word, 0) + 1
    return counts
''']
STORIES = ["a lighthouse keeper who finds a message in a bottle", "a robot that learns to bake bread",
           "two friends lost in a snowy forest"]


def passages(n: int = 3, words: int = 90) -> list[str]:
    """n passages of Pride and Prejudice, `words` words each, from spread-out places."""
    text = " ".join(read_text(novel("prideprejudice")).split())
    ws = text.split()
    return [" ".join(ws[i:i + words]) for i in range(2000, 2000 + n * 20000, 20000)]


def prompts(engine: Engine) -> dict[str, list[list[int]]]:
    chat = ChatTemplate(engine.model.chat_template)

    def turn(content):
        return engine.encode(chat.render([{"role": "user", "content": content}], add_generation_prompt=True))

    ps = passages()
    return {
        "quote": [engine.encode(f"Here is a passage.\n\n{p}\n\nThe same passage, copied word for word:\n\n"
                                + " ".join(p.split()[:4])) for p in ps],
        "rewrite": [turn(f"Rewrite this passage with modern spelling and punctuation, changing nothing else:\n\n{p}")
                    for p in ps],
        "code": [turn(f"Add type hints to this Python function and return the whole function:\n\n{c}") for c in CODE],
        "story": [turn(f"Write a short story about {s}.") for s in STORIES],
    }


def run(engine: Engine, prompt: list[int], max_tokens: int, drafter) -> tuple[list[int], float, int, int]:
    """One greedy request alone: its tokens, decode seconds, draft tokens verified and kept."""
    sched = Scheduler(engine, max_running=1, speculate=drafter)
    done = threading.Event()
    req = Request(prompt=prompt, max_tokens=max_tokens, sampling=SamplingParams(),
                  emit=lambda kind, v: kind == "done" and done.set())
    sched.start()
    try:
        sched.submit(req)
        if not done.wait(600):
            raise SystemExit("speculate: a request did not finish in 10 minutes")
    finally:
        sched.stop()
    if req.finish_reason not in ("stop", "length"):
        raise SystemExit(f"speculate: a request ended with {req.finish_reason}")
    took = (req.token_times[-1] - req.token_times[0]) if len(req.token_times) > 1 else 0.0
    return req.generated, took, sched.drafted, sched.accepted


class Peer:
    """llama-server on args.peer without drafts ("off") and with -md args.peer_draft ("draft"),
    both started at once (only the one asked works at a time)."""

    def __init__(self, args):
        from qwc.bench.llamacpp import tools as llamacpp_tools
        from qwc.bench.serve import start, wait_ready

        server = llamacpp_tools("x86") / f"llama-server-{VERSION}"
        self.procs, self.base = {}, {}
        # llama-server drafts only with --spec-type; at most as many tokens as qwc's drafts (of
        # 3, 7 and 16 a draft, 7 was its fastest on SmolLM2's float target)
        draft = ["-md", args.peer_draft, "--spec-type", "draft-simple", "--spec-draft-n-max", str(args.draft_max)]
        for mode, extra in (("off", []), ("draft", draft)):
            proc, line = start([str(server), "-m", args.peer, *extra, "-t", str(args.threads), "-c", "2048",
                                "-np", "1", "--port", "0", "--host", "127.0.0.1"], r"listening on http")
            self.procs[mode] = proc
            self.base[mode] = re.search(r"(http://\S+)", line)[1].rstrip("/")
            wait_ready(self.base[mode], proc)

    def run(self, mode: str, prompt: list[int], max_tokens: int) -> tuple[str, int, float, int, int]:
        """One greedy request: its text, tokens generated, their seconds, draft tokens made and kept."""
        import httpx

        r = httpx.post(self.base[mode] + "/completion", timeout=600,
                       json={"prompt": prompt, "n_predict": max_tokens, "temperature": 0, "cache_prompt": False})
        r.raise_for_status()
        out = r.json()
        t = out["timings"]
        return (out["content"], int(t["predicted_n"]), t["predicted_ms"] / 1e3, int(t.get("draft_n", 0)),
                int(t.get("draft_n_accepted", 0)))

    def stop(self):
        from qwc.bench.serve import stop

        for proc in self.procs.values():
            stop(proc)


def costs(args, engine: Engine, rates: list[float]) -> None:
    """The verify call's time against a decode step's, by draft length, measured (and the
    score call's, which verified drafts before the verify entry point); then what a draft of
    each length gives at per-token acceptance rates q (a model: a draft's i-th token is kept
    with probability q^i, so a call advances the cache by 1 + q + ... + q^k positions). First,
    how far each call's logits are from the decode steps' over the same 8 tokens."""
    rng = np.random.default_rng(1)
    seq = engine.sequence()
    engine.prefill(rng.integers(0, engine.sample_limit, args.depth).tolist(), seq=seq)
    base = seq.pos
    new = rng.integers(0, engine.sample_limit, 8).tolist()
    steps = np.stack([engine.decode(t, seq=seq).copy() for t in new])
    apart = {}
    for what in ("score", "verify"):
        seq.pos = base
        apart[what] = float(np.abs(getattr(engine, what)(new, seq=seq) - steps).max())
    print(f"\nmax |logits - the decode steps'| over 8 tokens after {args.depth}: score {apart['score']:.3g}, "
          f"verify {apart['verify']:.3g}{'' if engine._verify is not None else ' (no verify entry point: score)'}")

    def timed(f, n=12):
        best = float("inf")
        for _ in range(args.rounds + 1):
            t0 = time.perf_counter()
            for _ in range(n):
                seq.pos = base
                f()
            best = min(best, (time.perf_counter() - t0) / n)
        return best

    lengths = list(range(1, max(args.draft_max, 1) + 1))   # every draft length up to --draft-max
    t_dec = timed(lambda: engine.decode(5, seq=seq))
    c_draft, t_draft = 0.0, None
    if args.draft:   # the draft model's step, after as many cached tokens
        small = Engine(args.draft, ctx=max(2048, args.depth + 64), threads=args.threads)
        dseq = small.sequence()
        small.prefill(rng.integers(0, small.sample_limit, args.depth).tolist(), seq=dseq)
        dbase = dseq.pos

        def draft_step():
            dseq.pos = dbase
            small.decode(5, seq=dseq)
        t_draft = timed(draft_step)
        c_draft = t_draft / t_dec
    t_ver = {k: timed(lambda k=k: engine.verify([5] * (k + 1), seq=seq)) for k in lengths}
    t_score = {k: timed(lambda k=k: engine.score([5] * (k + 1), seq=seq)) for k in lengths}
    name = Path(args.artifact).name
    drafted_by = (f"; drafts by {Path(args.draft).name}, whose step is {t_draft * 1e3:.2f} ms ({c_draft:.3f} of the "
                  "target's), k of its steps charged to a draft of k (the speed-ups are a model)" if args.draft else "")
    print(f"\nVerify calls against decode steps, {name}, {args.threads} threads, after {args.depth} cached tokens "
          f"(best of {args.rounds + 1} x 12 calls); decode step {t_dec * 1e3:.2f} ms{drafted_by}\n")
    print("| draft tokens k | verify call ms | / decode step | score call / decode step | break-even q | "
          + " | ".join(f"speed-up at q = {q:g}" for q in rates) + " |")
    print("| ---: | ---: | ---: | ---: | ---: | " + " | ".join("---:" for _ in rates) + " |")

    def advance(q, k):
        return sum(q ** i for i in range(k + 1))

    rows = []
    for k in lengths:
        c = t_ver[k] / t_dec + k * c_draft   # a round's cost in the target's decode steps
        lo, hi = 0.0, 1.0   # the q at which a call advances as far as it costs in decode steps
        for _ in range(40):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if advance(mid, k) < c else (lo, mid)
        even = hi if advance(1.0, k) >= c else None
        gains = [advance(q, k) / c for q in rates]
        rows.append({"k": k, "verify_ms": t_ver[k] * 1e3, "ratio": t_ver[k] / t_dec, "round_cost": c,
                     "score_ratio": t_score[k] / t_dec,
                     "break_even_q": even, "speedup": gains})
        print(f"| {k} | {t_ver[k] * 1e3:.2f} | {t_ver[k] / t_dec:.2f} | {t_score[k] / t_dec:.2f} | {'-' if even is None else f'{even:.2f}'} | "
              + " | ".join(f"{g:.2f}x" for g in gains) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps({"artifact": args.artifact, "threads": args.threads,
                                               "decode_ms": t_dec * 1e3, "draft": args.draft,
                                               "draft_step_ms": None if t_draft is None else t_draft * 1e3,
                                               "logits_apart": apart, "costs": rows},
                                              indent=1))


class OracleDrafter:
    """Drafts the served model's greedy reply (`ref`, after a prompt of `start` tokens), each
    token right with probability q, paying a draft model's decode steps for each (oracle mode)."""

    def __init__(self, small: Engine, seq, ref: list[int], start: int, q: float, rng, draft_max: int):
        self.small, self.seq, self.ref, self.start, self.q, self.rng = small, seq, ref, start, q, rng
        self.draft_max = self.length = draft_max

    def draft(self, history, limit=None, prompt=None):
        k = self.length if limit is None else min(self.length, limit)
        at = len(history) - self.start        # the next token's index in the reply
        out = []
        for j in range(min(k, len(self.ref) - at)):
            self.seq.pos = 64                 # a decode step at a fixed depth: its time, not its tokens
            self.small.decode(5, seq=self.seq)
            right = self.ref[at + j]
            out.append(right if self.rng.random() < self.q else (right + 1) % self.small.sample_limit)
        return out

    def kept(self, n):
        self.length = next_length(self.draft_max, n)


def oracle(args, engine: Engine, qs: list[float]) -> None:
    small = Engine(args.draft, ctx=256, threads=args.threads)
    sseq = small.sequence()
    small.prefill(list(range(64)), seq=sseq)
    rng = np.random.default_rng(2)
    prompts_ = [rng.integers(0, engine.sample_limit, 64).tolist() for _ in range(3)]
    refs = [run(engine, p, args.max_tokens, None)[0] for p in prompts_]
    rows = []
    for q in qs:
        ratios, rates, kept = [], {"off": [], "on": []}, [0, 0]
        for r in range(args.rounds):
            secs = {"off": 0.0, "on": 0.0}
            toks = {"off": 0, "on": 0}
            for i, (prompt, ref) in enumerate(zip(prompts_, refs)):
                drng = np.random.default_rng(100 * r + i)
                for mode in (["off", "on"] if r % 2 == 0 else ["on", "off"]):
                    factory = None if mode == "off" else functools.partial(
                        OracleDrafter, small, sseq, ref, len(prompt), q, drng, args.draft_max)
                    gen, took, d, a = run(engine, prompt, args.max_tokens, factory)
                    if gen != ref:
                        raise SystemExit(f"speculate: the reply with drafts (q={q}) is not the greedy one")
                    secs[mode] += took
                    toks[mode] += len(gen) - 1
                    if mode == "on":
                        kept[0] += d
                        kept[1] += a
            for mode in secs:
                rates[mode].append(toks[mode] / secs[mode])
            ratios.append(rates["on"][-1] / rates["off"][-1])
            print(f"  q={q:g} round {r + 1}: off {rates['off'][-1]:.2f} tok/s, drafts {rates['on'][-1]:.2f} tok/s "
                  f"({ratios[-1]:.2f}x)", flush=True)
        rows.append({"q": q, "off": float(np.median(rates["off"])), "on": float(np.median(rates["on"])),
                     "ratio": float(np.median(ratios)), "ratios": ratios, "drafted": kept[0], "kept": kept[1]})
    print(f"\nA draft model's costs end to end, {Path(args.artifact).name} with {Path(args.draft).name}'s decode steps, "
          f"{args.threads} threads, one request at a time, greedy, {args.max_tokens} tokens after 64 random ones; "
          f"draft tokens right with probability q (set, not measured); medians of {args.rounds} rounds\n")
    print("| q | tok/s, off | tok/s, drafts | drafts / off | draft tokens kept / verified | replies the greedy one |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in rows:
        d, a = row["drafted"], row["kept"]
        print(f"| {row['q']:g} | {row['off']:.2f} | {row['on']:.2f} | {row['ratio']:.2f}x | "
              f"{a} / {d} ({a / d if d else 0:.0%}) | {len(prompts_)} of {len(prompts_)} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"artifact": args.artifact, "draft": args.draft, "threads": args.threads,
                                               "oracle": rows}, indent=1))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("artifact", nargs="?", default=str(REPO / "build" / "smollm2.qwc"))
    p.add_argument("--rounds", type=int, default=3, help="rounds (medians are reported)")
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--draft-max", type=int, default=DRAFT_MAX)
    p.add_argument("--lookup-min", type=int, default=3)
    p.add_argument("--draft", help="a draft model's artifact (the same tokenizer) instead of prompt lookup")
    p.add_argument("--costs", help="Q,...: verify calls' cost by draft length, and the speed-up at acceptance Q")
    p.add_argument("--depth", type=int, default=256, help="--costs: cached tokens before the calls (default 256)")
    p.add_argument("--oracle", help="Q,...: drafts of the served model's own reply, each token right with probability "
                                    "Q, costing --draft's decode steps")
    p.add_argument("--peer", metavar="ART.gguf", help="llama-server on this GGUF of the served model beside qwc")
    p.add_argument("--peer-draft", metavar="SMALL.gguf", help="--peer's draft model (llama-server -md)")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args()
    if bool(args.peer) != bool(args.peer_draft) or (args.peer and not args.draft):
        p.error("--peer ART.gguf goes with --peer-draft SMALL.gguf and --draft SMALL.qwc")
    if args.rounds < 1 or args.max_tokens < 2:
        p.error("--rounds must be at least 1 and --max-tokens at least 2")

    def probabilities(flag: str, text: str | None) -> list[float]:
        try:
            out = [float(x) for x in text.split(",")] if text else []
        except ValueError:
            p.error(f"{flag} {text!r}: a comma-separated list of probabilities")
        if any(not 0 <= x <= 1 for x in out):
            p.error(f"{flag}: probabilities are in [0, 1]")
        return out
    qs, oracle_qs = probabilities("--costs", args.costs), probabilities("--oracle", args.oracle)
    if oracle_qs and not args.draft:
        p.error("--oracle needs --draft SMALL.qwc (whose decode steps the drafts cost)")

    peer = Peer(args) if args.peer and not (qs or oracle_qs) else None   # before this process pins threads
    engine = Engine(args.artifact, ctx=max(2048, args.depth + 64), threads=args.threads)
    if qs:
        return costs(args, engine, qs)
    if oracle_qs:
        return oracle(args, engine, oracle_qs)
    kinds = prompts(engine)
    on = "draft" if args.draft else "ngram"
    modes = {"off": None,
             on: (DraftModel(Engine(args.draft, ctx=2048, threads=args.threads), engine, args.draft_max) if args.draft
                  else lambda: NgramDrafter(args.draft_max, ngram_min=args.lookup_min))}
    # this machine is shared: each prompt runs without and with drafts back to back (the order
    # turning each round), and a kind's ratio is the median of its rounds' ratios
    rates = {(k, m): [] for k in kinds for m in modes}
    ratios = {k: [] for k in kinds}
    drafts = {k: [0, 0] for k in kinds}
    same = {k: 0 for k in kinds}
    peer_modes = ["off", "draft"] if peer else []
    peer_rates = {(k, m): [] for k in kinds for m in peer_modes}
    peer_drafts = {k: [0, 0] for k in kinds}
    peer_same = {k: 0 for k in kinds}
    try:
        for r in range(args.rounds):
            order = list(modes) if r % 2 == 0 else list(modes)[::-1]
            for kind, ps in kinds.items():
                toks, secs = dict.fromkeys(modes, 0), dict.fromkeys(modes, 0.0)
                ptoks, psecs = dict.fromkeys(peer_modes, 0), dict.fromkeys(peer_modes, 0.0)
                for prompt in ps:
                    got = {}
                    for mode in order:
                        gen, took, d, a = run(engine, prompt, args.max_tokens, modes[mode])
                        toks[mode] += len(gen) - 1
                        secs[mode] += took
                        got[mode] = gen
                        if mode != "off" and r == 0:
                            drafts[kind][0] += d
                            drafts[kind][1] += a
                    if r == 0:
                        same[kind] += got["off"] == got[on]
                    texts = {}
                    for mode in (peer_modes if r % 2 == 0 else peer_modes[::-1]):
                        texts[mode], n, took, d, a = peer.run(mode, prompt, args.max_tokens)
                        ptoks[mode] += n
                        psecs[mode] += took
                        if mode == "draft" and r == 0:
                            peer_drafts[kind][0] += d
                            peer_drafts[kind][1] += a
                    if peer and r == 0:
                        peer_same[kind] += texts["off"] == texts["draft"]
                for mode in modes:
                    rates[kind, mode].append(toks[mode] / secs[mode] if secs[mode] else 0.0)
                for mode in peer_modes:
                    peer_rates[kind, mode].append(ptoks[mode] / psecs[mode] if psecs[mode] else 0.0)
                ratios[kind].append(rates[kind, on][-1] / rates[kind, "off"][-1])
                print(f"  round {r + 1} {kind:7s} off {rates[kind, 'off'][-1]:7.1f} tok/s, {on} "
                      f"{rates[kind, on][-1]:7.1f} tok/s ({ratios[kind][-1]:.2f}x)"
                      + (f"; llama-server off {peer_rates[kind, 'off'][-1]:7.1f}, draft "
                         f"{peer_rates[kind, 'draft'][-1]:7.1f}" if peer else ""), flush=True)
    finally:
        if peer:
            peer.stop()

    name = Path(args.artifact).name
    how = (f"a draft model, {Path(args.draft).name}" if args.draft else
           f"prompt lookup (n-grams {args.lookup_min}..{max(NGRAM_MAX, args.lookup_min)})")
    print(f"\nSpeculative decoding by {how}, {name}, {args.threads} threads, one request at a time, "
          f"greedy, up to {args.max_tokens} tokens; draft_max {args.draft_max}; medians of {args.rounds} rounds, "
          "each prompt without and with drafts back to back\n")
    print(f"| reply | tok/s, off | tok/s, {on} | {on} / off | draft tokens kept / verified | replies with the same text |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    rows = []
    for kind, ps in kinds.items():
        off, with_drafts = float(np.median(rates[kind, "off"])), float(np.median(rates[kind, on]))
        ratio = float(np.median(ratios[kind]))
        d, a = drafts[kind]
        rows.append({"reply": kind, "off": off, on: with_drafts, "ratio": ratio, "ratios": ratios[kind],
                     "drafted": d, "kept": a, "same_text": same[kind], "prompts": len(ps)})
        print(f"| {kind} | {off:.1f} | {with_drafts:.1f} | {ratio:.2f}x | {a} / {d} ({a / d if d else 0:.0%}) | "
              f"{same[kind]} of {len(ps)} |")
    if peer:
        print(f"\nThe same prompts on llama-server ({Path(args.peer).name}, -md {Path(args.peer_draft).name}, "
              f"{args.threads} threads, drafts of up to {args.draft_max}), in the same rounds; medians\n")
        print("| reply | llama-server tok/s, off | llama-server tok/s, draft | draft / off | draft tokens kept / made | "
              "replies with the same text | qwc draft / llama-server draft |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        for row in rows:
            kind = row["reply"]
            off, dr = (float(np.median(peer_rates[kind, m])) for m in ("off", "draft"))
            ratio = float(np.median([b / a for a, b in zip(peer_rates[kind, "off"], peer_rates[kind, "draft"])]))
            vs = float(np.median([q / lc for q, lc in zip(rates[kind, on], peer_rates[kind, "draft"])]))
            d, a = peer_drafts[kind]
            row["llama_server"] = {"off": off, "draft": dr, "ratio": ratio, "drafted": d, "kept": a,
                                   "same_text": peer_same[kind], "qwc_over_llama_server": vs}
            print(f"| {kind} | {off:.1f} | {dr:.1f} | {ratio:.2f}x | {a} / {d} ({a / d if d else 0:.0%}) | "
                  f"{peer_same[kind]} of {row['prompts']} | {vs:.2f}x |")
    if args.json:
        Path(args.json).write_text(json.dumps({"artifact": args.artifact, "draft": args.draft, "threads": args.threads,
                                               "peer": args.peer, "peer_draft": args.peer_draft,
                                               "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
