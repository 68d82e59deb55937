"""`qwc targets`: the compilation targets and the kernels each selects."""

from __future__ import annotations

import argparse


def register(sub) -> None:
    tg = sub.add_parser("targets", help="the compilation targets and the kernels each selects, this machine first",
                        description="One line per target (`host` first: this machine's CPU features as "
                                    "`qwc compile --target host` reads them): architecture, ISA features and "
                                    "the decode, prefill and decode-attention kernels the kernel table picks.")
    tg.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    from qwc.compiler.targets import describe_targets

    rows = [(t.name, t.arch, ",".join(sorted(t.features)) or "-", k["decode"], k["prefill"], k["attention"],
             k["q8_0"], k["q4_k"], k["q5"], k["q6_k"], k["iq4"], t.description) for t, k in describe_targets()]
    head = ("target", "arch", "features", "decode", "prefill", "attention", "q8_0", "q4_k", "q5", "q6_k", "iq4", "")
    widths = [max(len(r[i]) for r in (head, *rows)) for i in range(len(head))]
    for r in (head, *rows):
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())

