"""`qwc tune`: MetaSchedule over the model's kernels, into a resumable database."""

from __future__ import annotations

import argparse
import json
import time

from qwc import progress
from qwc.errors import QwcError

from .options import float_in, positive, whole_tvm


def register(sub) -> None:
    t = sub.add_parser("tune", help="autotune the model's kernels with TVM MetaSchedule (resumable)",
                       description="Extract the model's tunable kernels (deduplicated by kind and shape), "
                                   "search a design space that contains qwc's own schedule, and save every "
                                   "record in DIR. Rerunning the same command resumes. See docs/tuning.md.")
    t.add_argument("model", help=".onnx graph (exported or canonical) with its .config.json beside it")
    t.add_argument("--target", default="host", help="target name, as for compile (default: host)")
    t.add_argument("--trials", type=positive, default=16, help="measured candidates per kernel (default 16)")
    t.add_argument("--db", required=True, metavar="DIR", help="tuning database folder (created; resumed)")
    t.add_argument("--rpc-tracker", metavar="HOST:PORT", help="measure on devices of a TVM RPC tracker")
    t.add_argument("--rpc-key", help="the tracker key of the devices to measure on")
    t.add_argument("--time-budget", type=float_in(0, 1e6, lo_open=True), metavar="MIN", help="stop starting new kernels after MIN minutes")
    t.add_argument("--act-bits", type=int, choices=(8, 32),
                   help="tune the kernels of an artifact with these activation bits (default: the "
                        "target's, as for compile)")
    t.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    whole_tvm("tune")
    from qwc.compiler.targets import get_target
    from qwc.compiler.tuning import run

    target = get_target(args.target)
    rpc = None
    if args.rpc_tracker or args.rpc_key:
        if not (args.rpc_tracker and args.rpc_key):
            raise QwcError("--rpc-tracker and --rpc-key go together")
        host, _, port = args.rpc_tracker.rpartition(":")
        if not host or not port.isdigit():
            raise QwcError(f"--rpc-tracker {args.rpc_tracker!r}: expected HOST:PORT")
        rpc = (host, int(port), args.rpc_key)
    elif not target.runs_here():
        raise QwcError(f"target {target.name} does not run on this machine: measure on a device with "
                       "--rpc-tracker HOST:PORT --rpc-key KEY")
    t0 = time.perf_counter()
    results = run(args.model, target, args.trials, args.db, rpc=rpc, time_budget_min=args.time_budget,
                  act_bits=args.act_bits)
    print(f"| {'kernel':28s} | {'uses':>4s} | {'hand':>14s} | {'tuned':>14s} | {'knobs':26s} | used |")
    print(f"| {'-' * 28} | {'-' * 4}: | {'-' * 14}: | {'-' * 14}: | {'-' * 26} | ---- |")
    for task, rec in results:
        tuned = task.rate(rec.best_s) if rec.best_s else "-"
        used = "yes" if rec.best_s and rec.hand_s and rec.best_s < rec.hand_s else "no"
        print(f"| {task.key:28s} | {task.uses:4d} | {task.rate(rec.hand_s):>14s} | {tuned:>14s} | "
              f"{json.dumps(rec.knobs):26s} | {used:4s} |")
    progress.info(f"[qwc] tuned {len(results)} kernels into {args.db} in {time.perf_counter() - t0:.0f}s")

