"""Two artifacts' decode steps side by side: a change to the decode kernels measured against the
build before it, in one process, window by window in turn (the machine is shared and noisy):

    .venv/bin/python bench/decode_pair.py BEFORE.qwc AFTER.qwc [--threads 2] [--rounds 5] [--past 512]

Each round times a window of 64 decode steps of each artifact after the same fresh `--past`-token
prompt (bench/gemv.py's decode_window; 4096 measures decode at depth, where the cache is a large
share of a step's bytes). The table has each artifact's best and median window in tok/s, the
GB/s that is of the bytes a step reads (gemv.py's read_per_step and the K/V cache), its share
of the read bandwidth measured before and after the rounds (the higher reading), and AFTER's
ratio to BEFORE.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

STEPS = 64


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("before")
    p.add_argument("after")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--past", type=int, default=512, help="prompt tokens before each window (default 512)")
    args = p.parse_args()
    if args.rounds < 1 or args.past < 1:
        p.error("--rounds and --past must be at least 1")
    os.environ.setdefault("TVM_NUM_THREADS", str(args.threads))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from gemv import decode_window, read_bandwidth, read_per_step

    from qwc.runtime.engine import Engine

    engines = [Engine(a, ctx=args.past + STEPS + 8, threads=args.threads) for a in (args.before, args.after)]
    prompt = list(np.random.default_rng(0).integers(0, 1000, args.past))
    step_bytes = [read_per_step(e.manifest) + e.kv_bytes_per_token * (args.past + STEPS // 2) for e in engines]
    bw_before = read_bandwidth()
    rates = [[], []]
    for _ in range(args.rounds):
        for i, e in enumerate(engines):
            rates[i].append(decode_window(e, prompt, STEPS))
    bw_after = read_bandwidth()
    held = max(bw_before, bw_after)
    print(f"{args.threads} threads; read bandwidth "
          f"{bw_before:.1f} GB/s before, {bw_after:.1f} after; {args.rounds} rounds of {STEPS} steps after {args.past} tokens\n")
    print("| artifact | best tok/s | median tok/s | GB/s (best) | of the bandwidth | windows |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    for name, b, r in zip((args.before, args.after), step_bytes, rates):
        gbs = max(r) * b / 1e9
        print(f"| {name} | {max(r):.1f} | {np.median(r):.1f} | {gbs:.1f} | {100 * gbs / held:.0f}% | "
              f"{', '.join(f'{x:.0f}' for x in r)} |")
    print(f"\nafter / before: best {max(rates[1]) / max(rates[0]):.3f}, median {np.median(rates[1]) / np.median(rates[0]):.3f}")


if __name__ == "__main__":
    main()
