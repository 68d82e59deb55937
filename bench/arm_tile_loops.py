"""The block loops of an ARM target's Q4_0 prefill GEMM, one per tile shape the kernel has:
instructions, multiply-adds and llvm-mca's Neoverse-N2 cycles a block, from the
cross-compiled kernel's disassembly (no emulation: a loop's instructions are what every
iteration executes).

    .venv/bin/python bench/arm_tile_loops.py [--target arm-yitian|arm-neon] [--act block|row]
                                             [--n 64] [--k 896]

Prints one row per loop holding the GEMM's dot instructions (smmla: 32 multiply-adds, sdot:
16): instructions and cycles per iteration (one block of 32 across the tile) and per
multiply-add, and the loop's instruction mix. The kernel takes any number of tokens, so every
tile kind is in it; which tiles a prompt of M tokens runs is the kernel's body
(kernels/arm/i8mm.py). docs/history/arm.md uses it to choose between tile shapes.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
from qwc.bench import n2_model

MACS = {"smmla": 32, "sdot": 16}
PROMPT = 48   # the tokens of the calling function: the kernel itself takes any number
BRANCH = re.compile(r"(b\.\w+|b|cbn?z|tbn?z)$")


def build_gemm(target: str, m: int, n: int, k: int, rows: bool, out: Path) -> Path:
    """lib.so with one function through the target's Q4_0 prefill GEMM (M tokens). Only its
    code is read: the row sums are an input, never computed."""
    import tvm
    from tvm import relax

    from qwc.compiler.build import build
    from qwc.compiler.frontend import MatMulNBits
    from qwc.compiler.kernels import row_groups
    from qwc.compiler.targets import get_target
    from qwc.q4 import pack_nibbles, quantize_q4_0

    t = get_target(target)
    q, d = quantize_q4_0(np.random.default_rng(0).standard_normal((n, k)).astype(np.float32))
    wp = pack_nibbles(q)
    wp, d = row_groups.pack(wp, d)
    bb = relax.BlockBuilder()
    params = [relax.Var("a", relax.TensorType([m, k], "float32")), relax.Var("w", relax.TensorType(list(wp.shape), "uint8")),
              relax.Var("s", relax.TensorType(list(d.shape), str(d.dtype)))]
    rv = relax.Var("r", relax.TensorType([n], "float32")) if rows else None
    with bb.function("gemm", params + ([rv] if rv is not None else [])):
        with bb.dataflow():
            y = MatMulNBits.q4_0_matmul(bb, params[0], params[1], params[2], k, n, "arm", t.features, row_sums=rv)
            gv = bb.emit_output(y)
        bb.emit_func_output(gv)
    lib = out / "gemm.so"
    build(bb.get(), t).export_library(str(lib), fcompile=tvm.support.cc.cross_compiler(t.cross_compiler))
    return lib


def loops(lib: Path, dot: str) -> list[list[tuple[str, str]]]:
    """Every loop (a backward branch's span, under 600 instructions) holding `dot`, once each."""
    dis = subprocess.run(["aarch64-linux-gnu-objdump", "-d", "--no-show-raw-insn", str(lib)],
                         capture_output=True, text=True, check=True).stdout
    ins = []
    for line in dis.splitlines():
        m = re.match(r"^\s*([0-9a-f]+):\s+(\S+)\s*(.*)$", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2), re.sub(r"\s*(//|<).*", "", m.group(3))))
    at = {a: i for i, (a, _, _) in enumerate(ins)}
    found, seen = [], set()
    for i, (a, op, args) in enumerate(ins):
        target = re.match(r"([0-9a-f]+)$", args.split(",")[-1].strip()) if BRANCH.match(op) else None
        if target and int(target.group(1), 16) < a and int(target.group(1), 16) in at:
            body = [(o, x) for _, o, x in ins[at[int(target.group(1), 16)]:i + 1]]
            key = tuple(o for o, _ in body)
            if len(body) < 600 and any(o == dot for o, _ in body) and key not in seen:
                seen.add(key)
                found.append(body)
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="arm-yitian", choices=("arm-yitian", "arm-neon"))
    p.add_argument("--act", default="block", choices=("block", "row"), help="the activations' scales")
    p.add_argument("--n", type=int, default=64)
    p.add_argument("--k", type=int, default=896)
    args = p.parse_args()
    if args.k % 32 or args.k < 32 or args.n < 1:
        sys.exit("arm_tile_loops: --k a positive multiple of 32, --n from 1")
    dot = "smmla" if args.target == "arm-yitian" else "sdot"
    with tempfile.TemporaryDirectory() as d:
        found = loops(build_gemm(args.target, PROMPT, args.n, args.k, args.act == "row", Path(d)), dot)
    print(f"{args.target}, Q4_0, {args.act} activations, N = {args.n}, K = {args.k}: the loops holding {dot}\n")
    print(f"| {dot} a block | instructions a block | multiply-adds | instructions / MAC | N2 cycles a block "
          "| N2 cycles / MAC | mix |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for body in sorted(found, key=lambda b: -sum(o == dot for o, _ in b)):
        dots = sum(o == dot for o, _ in body)
        macs = dots * MACS[dot]
        cycles = n2_model.mca_cycles([f"{o} {x}".strip() for o, x in body])
        mix = ", ".join(f"{o} {c}" for o, c in Counter(o for o, _ in body).most_common(8))
        cyc = f"{cycles:.1f} | {cycles / macs:.4f}" if cycles else "- | -"
        print(f"| {dots} | {len(body)} | {macs} | {len(body) / macs:.4f} | {cyc} | {mix} |")


if __name__ == "__main__":
    main()
