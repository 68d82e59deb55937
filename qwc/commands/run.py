"""`qwc run`: text from an artifact: a prompt continued, or a chat."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from qwc import progress
from qwc.errors import QwcError
from qwc.limits import MAX_LORA_RANK

from .options import (
    check_utf8,
    float_in,
    int_in,
    mmap_option,
    nonnegative,
    poll_option,
    positive,
    seed_value,
    speculation_options,
    template_variables,
    thread_count,
)

RUN_CONTEXT = 512   # the cache without --ctx: a prompt and a reply, not the model's whole context


def register(sub) -> None:
    r = sub.add_parser("run", help="generate text with a compiled artifact")
    r.add_argument("model", help="model.qwc artifact folder")
    r.add_argument("--prompt", help="text to continue")
    r.add_argument("--chat", action="store_true", help="interactive chat with the model's chat template")
    r.add_argument("--chat-template-kwargs", type=template_variables, default={}, metavar="JSON",
                   help="--chat: variables for the chat template, e.g. '{\"enable_thinking\": false}' (Qwen3 answers "
                        "without thinking)")
    r.add_argument("--max-new-tokens", type=nonnegative, default=32)
    r.add_argument("--ctx", type=positive, default=None,
                   help=f"KV-cache size in tokens (default {RUN_CONTEXT}, or the model's context where it is shorter)")
    r.add_argument("--temperature", type=float_in(0, 1e4), default=0.0, help="0 = greedy (default)")
    r.add_argument("--top-k", type=nonnegative, default=0, help="0 = off (default)")
    r.add_argument("--top-p", type=float_in(0, 1, lo_open=True), default=1.0, help="1 = off (default)")
    r.add_argument("--repetition-penalty", type=float_in(0, 1e4, lo_open=True), default=1.0, help="1 = off (default)")
    r.add_argument("--presence-penalty", type=float_in(-2, 2), default=0.0,
                   help="subtracted from the logit of every token generated so far (OpenAI's; 0 = off, default)")
    r.add_argument("--frequency-penalty", type=float_in(-2, 2), default=0.0,
                   help="subtracted per time a token was generated so far (OpenAI's; 0 = off, default)")
    r.add_argument("--seed", type=seed_value, default=None, help="sampling seed (-1 or none: random)")
    r.add_argument("--json-schema", metavar="SCHEMA",
                   help="the reply is JSON valid under this JSON Schema (inline; '{}': any JSON object), as llama.cpp's")
    r.add_argument("--grammar-file", metavar="FILE", help="the reply follows this GBNF grammar (llama.cpp's format)")
    r.add_argument("--threads", type=thread_count, default=None, help="worker threads (default: every usable CPU)")
    r.add_argument("--lora", metavar="PATH[:SCALE]",
                   help="a LoRA adapter (a PEFT directory or a llama.cpp GGUF adapter) applied unmerged, its "
                        "weights times SCALE (default 1); needs an artifact compiled with --max-lora-rank")
    r.add_argument("--max-lora-rank", type=int_in(1, MAX_LORA_RANK), metavar="R",
                   help="refuse an adapter above rank R (default: the artifact's bound)")
    speculation_options(r)
    mmap_option(r)
    poll_option(r)
    r.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    start = time.perf_counter()
    if "tvm" not in sys.modules:
        os.environ.setdefault("TVM_USE_RUNTIME_LIB", "1")  # the runtime alone: faster start, less memory
    from pathlib import Path

    from qwc.manifest import read_manifest
    from qwc.runtime.context_size import default_context
    from qwc.runtime.engine import Engine
    from qwc.runtime.sampling import SamplingParams
    from qwc.runtime.serving import check_draft_options, drafter
    from qwc.runtime.spec_policy import check_speculation, speculation_warning

    check_draft_options(args)
    t0 = time.perf_counter()
    ctx = args.ctx if args.ctx is not None else default_context(read_manifest(Path(args.model)), 1, RUN_CONTEXT)[0]
    eng = Engine(args.model, ctx=ctx, threads=args.threads, map_weights=not args.no_mmap, poll=args.poll)
    adapter = None
    if args.lora:
        from qwc.runtime.adapters import load_adapters

        eng.load_adapters(load_adapters([("lora", args.lora)], eng.model), args.max_lora_rank)
        adapter = "lora"
    elif args.max_lora_rank:
        raise QwcError("--max-lora-rank bounds the adapter of --lora: give --lora PATH")
    speculate = drafter(args, eng)
    check_speculation(eng, speculate)   # before the prompt is echoed
    if warning := speculation_warning(eng, speculate):
        print(f"qwc: warning: {warning}", file=sys.stderr, flush=True)
    progress.info(f"[qwc] loaded {args.model} ({eng.describe_weights()}) in {time.perf_counter() - t0:.1f}s; "
                  f"{eng.kv_summary()}")
    if adapter:
        progress.info(f"[qwc] {eng.adapters.describe()}")
    sp = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                        repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
                        frequency_penalty=args.frequency_penalty,
                        seed=None if args.seed == -1 else args.seed)   # -1: random, as llama.cpp
    if args.chat:
        chat(eng, sp, args.max_new_tokens, speculate, adapter, args.chat_template_kwargs)
        return
    if args.prompt is None:
        raise QwcError("give --prompt TEXT (or --chat)")
    check_utf8(args.prompt, "--prompt")
    constraint = run_constraint(eng, args)
    sys.stdout.write(args.prompt)
    first = None   # seconds from the command's start to the first generated token
    for piece in eng.generate(args.prompt, max_new_tokens=args.max_new_tokens, sampling=sp, constraint=constraint,
                              speculate=speculate, adapter=adapter):
        first = first or time.perf_counter() - start
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()   # the text before the timings, also when stdout is a pipe
    st = eng.stats
    rate = (lambda n, s: f"{n / s:.1f} tok/s" if s > 0 and n else "-")
    spec = ""
    if speculate is not None:
        spec = f", {st['draft_tokens_kept']} of {st['draft_tokens']} draft tokens kept"
    progress.info(f"[qwc] prompt {st['prompt_tokens']} tokens at {rate(st['prompt_tokens'], st['prompt_s'])}, "
                  f"generated {st['generated']} at {rate(st['generated'], st['generate_s'])} "
                  f"({eng.threads} threads, {eng.pos} tokens in context{spec})"
                  + (f"; first token {first:.2f}s after start" if first else ""))


def run_constraint(eng, args: argparse.Namespace):
    """`qwc run --json-schema` / `--grammar-file`: the grammar the reply follows, or None."""
    if args.json_schema is None and args.grammar_file is None:
        return None
    if args.json_schema is not None and args.grammar_file is not None:
        raise QwcError("give --json-schema or --grammar-file, not both")
    from qwc.runtime.grammar import TokenVocab

    vocab = TokenVocab(eng.tokenizer, eng.vocab_size, eng.eos, eng.sample_limit)
    if args.json_schema is not None:
        try:
            schema = json.loads(args.json_schema)
        except ValueError as e:
            raise QwcError(f"--json-schema is not JSON ({e})") from None
        if not isinstance(schema, dict):
            raise QwcError("--json-schema must be a JSON object (a JSON Schema; {} for any object)")
        grammar = vocab.json_grammar(schema or None)
        vocab.check(grammar, "--json-schema")
    else:
        try:
            text = open(args.grammar_file, encoding="utf-8").read()
        except (OSError, UnicodeDecodeError) as e:
            raise QwcError(f"--grammar-file {args.grammar_file}: {e}") from None
        grammar = vocab.gbnf_grammar(text)
        vocab.check(grammar, f"--grammar-file {args.grammar_file}")
    return vocab.constraint(grammar)


def chat(eng, sp, max_new_tokens: int, speculate=None, adapter: str | None = None, variables: dict | None = None) -> None:
    from qwc.chat_template import ChatTemplate

    if not eng.model.chat_template:
        raise QwcError("this model has no chat template; use --prompt")
    template = ChatTemplate(eng.model.chat_template)
    messages = []
    while True:
        try:
            line = input("> ")
        except EOFError:
            print()
            return
        except UnicodeDecodeError:
            raise QwcError("stdin is not valid UTF-8 text") from None
        check_utf8(line, "stdin")
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        prompt = template.render(messages, **(variables or {}))
        reply = ""   # the earlier turns are in the cache already: only the new ones are prefilled
        for piece in eng.generate(prompt, max_new_tokens=max_new_tokens, sampling=sp, speculate=speculate,
                                  adapter=adapter):
            reply += piece
            sys.stdout.write(piece)
            sys.stdout.flush()
        print()
        messages.append({"role": "assistant", "content": reply})

