"""`qwc prune`: whole transformer blocks removed, chosen on calibration text."""

from __future__ import annotations

import argparse

from qwc import progress
from qwc.atomic import check_destination

from .options import calibration_options, positive, thread_count


def register(sub) -> None:
    pr = sub.add_parser("prune", help="remove whole transformer blocks chosen on calibration text",
                        description="Depth pruning: SLEB removes, greedily, the block whose removal raises "
                                    "the calibration perplexity least; ShortGPT the blocks whose output is "
                                    "closest in angle to their input. Writes a HF Qwen2 directory that "
                                    "`qwc export` and `qwc qat` take as it is.")
    pr.add_argument("source", help="preset, HF directory, .gguf file, or smollm2 (the cached SmolLM2 GGUF)")
    pr.add_argument("--remove", type=positive, required=True, metavar="N", help="blocks to remove")
    pr.add_argument("--method", choices=("sleb", "shortgpt"), default="sleb", help="default: sleb")
    calibration_options(pr, "", 2048)
    pr.add_argument("--threads", type=thread_count, default=None)
    pr.add_argument("-o", "--output", required=True, help="output HF directory")
    pr.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    from pathlib import Path

    from qwc.eval.data import calibration_ids, resolve_model
    from qwc.models.load import load_source
    from qwc.models.prune import check_remove, foreign_files, prune, save

    check_destination(args.output, folder=True, foreign=foreign_files)
    source = resolve_model(args.source)
    lm = load_source(source)
    check_remove(args.remove, lm.config.num_hidden_layers)   # before the calibration text is read
    windows = calibration_ids(args.calib, lm.tokenizer, args.calib_tokens).reshape(-1, 512)
    r = prune(lm, windows, args.remove, args.method, threads=args.threads)
    save(lm, Path(args.output), {"source": source, "calibration": args.calib, "calibration_tokens": int(windows.size), **r})
    print(f"removed blocks {r['removed_blocks']} ({args.method}): {r['blocks']} of "
          f"{r['blocks'] + args.remove} left; calibration perplexity {r['calibration_ppl_before']:.2f} -> "
          f"{r['calibration_ppl_after']:.2f}")
    progress.info(f"[qwc] wrote {args.output}")

