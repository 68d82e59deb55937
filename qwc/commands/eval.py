"""`qwc eval`: perplexity and multiple-choice accuracy of a model at any stage."""

from __future__ import annotations

import argparse
import json
import os
import sys

from qwc.errors import QwcError

from .options import int_at_least, mmap_option, positive, thread_count


def register(sub) -> None:
    v = sub.add_parser("eval", help="perplexity and multiple-choice accuracy of a model at any stage",
                       description="MODEL: a HF directory, .gguf, preset or smollm2 (torch), an .onnx graph "
                                   "(onnxruntime) or a model.qwc artifact (the compiled runtime). Perplexity "
                                   "follows llama.cpp: non-overlapping chunks, second half scored, no BOS.")
    v.add_argument("model")
    v.add_argument("--ppl", metavar="TEXT_FILE", help="text to score: a file or austen:<novel>")
    v.add_argument("--ctx", type=int_at_least(4), default=512, help="chunk length in tokens (default 512)")
    v.add_argument("--chunks", type=positive, default=None, help="score only the first N chunks")
    v.add_argument("--choices", metavar="FILE.jsonl", help="multiple-choice items (see `qwc data choices`)")
    v.add_argument("--items", type=positive, default=None, help="score only the first N items")
    v.add_argument("--threads", type=thread_count, default=None)
    v.add_argument("--json", action="store_true", help="print the results as JSON")
    mmap_option(v)
    v.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:

    from qwc.eval.data import read_text, resolve_model, resolve_text

    if args.ppl is None and args.choices is None:
        raise QwcError("give --ppl TEXT_FILE and/or --choices FILE.jsonl")
    from pathlib import Path

    if (Path(args.model) / "manifest.json").is_file() and "tvm" not in sys.modules:  # an artifact
        os.environ.setdefault("TVM_USE_RUNTIME_LIB", "1")
    from qwc.eval.metrics import as_dict, multiple_choice, perplexity, read_choices
    from qwc.eval.scorers import open_scorer

    text = read_text(resolve_text(args.ppl)) if args.ppl else None
    items = read_choices(args.choices) if args.choices else None
    scorer = open_scorer(resolve_model(args.model), threads=args.threads, ctx=max(args.ctx, 2048),
                         map_weights=not args.no_mmap)
    out = {"model": args.model, "backend": scorer.backend}
    if text is not None:
        r = perplexity(scorer, text, ctx=args.ctx, chunks=args.chunks)
        out["perplexity"] = as_dict(r)
        if not args.json:
            print(f"{args.model} [{scorer.backend}]: {r}")
    if items is not None:
        r = multiple_choice(scorer, items[:args.items] if args.items else items)
        out["choices"] = as_dict(r)
        if not args.json:
            print(f"{args.model} [{scorer.backend}]: {r}")
    if args.json:
        print(json.dumps(out, indent=1))

