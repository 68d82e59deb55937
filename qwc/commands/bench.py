"""`qwc bench`: llama-bench's pp / tg table for an artifact."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from qwc import progress
from qwc.errors import QwcError

from .options import mmap_option, nonnegative, poll_option, positive, thread_count


def register(sub) -> None:
    b = sub.add_parser("bench", help="prompt-processing and generation speed of an artifact (llama-bench style)")
    b.add_argument("model", help="model.qwc artifact folder")
    b.add_argument("-p", "--n-prompt", type=nonnegative, default=512, help="prompt tokens for the pp test (0: skip)")
    b.add_argument("-n", "--n-gen", type=nonnegative, default=128, help="generated tokens for the tg test (0: skip)")
    b.add_argument("-r", "--repetitions", type=positive, default=3)
    b.add_argument("-d", "--n-depth", type=nonnegative, default=0,
                   help="tokens in the cache before each test, their prefill not timed (llama-bench's -d; default 0)")
    b.add_argument("--ctx", type=nonnegative, default=0, help="KV-cache size (default: what the tests need)")
    b.add_argument("--threads", type=thread_count, default=None)
    b.add_argument("--json", action="store_true", help="print JSON instead of the table")
    mmap_option(b)
    poll_option(b)
    b.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:

    start = time.perf_counter()
    if "tvm" not in sys.modules:
        os.environ.setdefault("TVM_USE_RUNTIME_LIB", "1")
    from qwc.runtime.bench import run_bench
    from qwc.runtime.engine import Engine

    if not args.n_prompt and not args.n_gen:
        raise QwcError("nothing to measure: -p and -n are both 0")
    need = args.n_depth + max(args.n_prompt, args.n_gen)
    if args.ctx and args.ctx < need:
        raise QwcError(f"--ctx {args.ctx} is less than the {need} tokens the tests need (depth + the longest test)")
    eng = Engine(args.model, ctx=max(args.ctx, need, 16), threads=args.threads, map_weights=not args.no_mmap,
                 poll=args.poll)
    load_s = time.perf_counter() - start
    progress.info(f"[qwc] loaded in {load_s:.2f}s ({eng.describe_weights()})")
    rows = run_bench(eng, args.n_prompt, args.n_gen, reps=args.repetitions, depth=args.n_depth,
                     progress=lambda line: progress.info(f"[qwc] {line}"))
    m, t = eng.manifest.model, eng.manifest.target
    size = eng.manifest.weight_bytes
    quant = eng.manifest.quantization
    if args.json:
        print(json.dumps({"model": m.name, "target": t.name, "threads": eng.threads,
                          "params_bytes": size, "load_s": load_s, "mapped_bytes": eng.mapped_bytes,
                          "quantization": quant.to_dict(), "results": rows}, indent=1))
        return
    w = max(6, *(len(r["test"]) for r in rows))
    print(f"| {'model':14s} | {'size':>10s} | {'target':10s} | {'act':>4s} | {'threads':>7s} | {'test':>{w}s} | {'t/s':>16s} |")
    print(f"| {'-' * 14} | {'-' * 10}: | {'-' * 10} | {'-' * 4}: | {'-' * 7}: | {'-' * w}: | {'-' * 16}: |")
    for r in rows:
        print(f"| {m.name[:14]:14s} | {size / 2**20:6.1f} MiB | {t.name:10s} | {quant.activation_bits:4d}"
              f" | {eng.threads:7d} | {r['test']:>{w}s} | {r['tps']:9.2f} ± {r['std']:5.2f} |")

