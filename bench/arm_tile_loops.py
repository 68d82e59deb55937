"""The block loops of an ARM target's Q4_0 prefill GEMM, one per tile shape the kernel has
(or, with --decode, of the sdot decode GEMV on Q4_0, Q4_K, five-bit codes or IQ4 indices, or of the Q6_K kernel at one
token, on activations scaled by super-blocks): instructions,
multiply-adds and
llvm-mca's Neoverse-N2 cycles a block, from the cross-compiled kernel's disassembly (no
emulation: a loop's instructions are what every iteration executes).

    .venv/bin/python bench/arm_tile_loops.py [--target arm-yitian|arm-neon] [--act block|row]
                                             [--form q4_0|q5_k|q5_1] [--n 64] [--k 896]
    .venv/bin/python bench/arm_tile_loops.py --decode q4_k|q4_k-expanded|q4_0|q5_k|q5_1|q6_k|iq4
                                             [--n 256] [--k 1536]

The decode GEMV's compact Q4_K has two loops: the sub-block loop (its integer sums) inside the
super-block loop (that plus the float work once a super-block), whose figures are per
super-block; the expanded form's and Q4_0's loop takes UNROLL blocks an iteration.

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


def _weights(form: str, n: int, k: int, isa: str) -> tuple[list[np.ndarray], int]:
    """The prefill GEMM's weight arrays of an N x K linear in `form` (q4_0; q4_k: nibbles with
    compact factors; q5_k, q5_1: five-bit codes with compact factors or float32 block offsets),
    and their bits."""
    from qwc.compiler.kernels import row_groups
    from qwc.compiler.repack_q4_k import compact_scales
    from qwc.q4 import pack_nibbles, quantize_q4_0

    rng = np.random.default_rng(0)
    if form == "q4_0":
        q, d = quantize_q4_0(rng.standard_normal((n, k)).astype(np.float32))
        return list(row_groups.pack(pack_nibbles(q), d)), 4
    d = rng.uniform(0.01, 0.02, (n, k // 32)).astype(np.float32)
    if form == "q4_k":
        w, bits = row_groups.pack(pack_nibbles(rng.integers(0, 16, (n, k // 32, 32))), d)[0], 4
    else:
        (w, s), bits = row_groups.pack_five_bit(rng.integers(0, 32, (n, k // 32, 32)), d), 5
    if form == "q5_1":
        return [w, s, row_groups.pack_offsets(-8 * d)], 5
    sc = rng.integers(1, 64, (n, k // 32))
    mn = rng.integers(0, 64, (n, k // 32))
    scale, dmin = np.float16(0.001), np.float16(0.0005)
    return [w, *compact_scales((scale * sc).astype(np.float32), -(dmin * mn).astype(np.float32),
                               np.zeros((n, k // 32), bool), isa)], bits


def build_gemm(target: str, m: int, n: int, k: int, rows: bool, out: Path, form: str = "q4_0") -> Path:
    """lib.so with one function through the target's prefill GEMM (M tokens) on weights in
    `form` (_weights). Only its code is read: the row sums are an input, never computed."""
    import tvm
    from tvm import relax

    from qwc.compiler.build import build
    from qwc.compiler.frontend import MatMulNBits
    from qwc.compiler.targets import get_target

    t = get_target(target)
    weights, bits = _weights(form, n, k, "arm")
    bb = relax.BlockBuilder()
    params = [relax.Var("a", relax.TensorType([m, k], "float32"))] + [
        relax.Var(f"w{i}", relax.TensorType(list(x.shape), str(x.dtype))) for i, x in enumerate(weights)]
    rv = relax.Var("r", relax.TensorType([n], "float32")) if rows else None
    with bb.function("gemm", params + ([rv] if rv is not None else [])):
        with bb.dataflow():
            offsets = params[3] if len(params) > 3 else None
            y = MatMulNBits.q4_0_matmul(bb, params[0], params[1], params[2], k, n, "arm", t.features, row_sums=rv,
                                        offsets=offsets, bits=bits)
            gv = bb.emit_output(y)
        bb.emit_func_output(gv)
    lib = out / "gemm.so"
    build(bb.get(), t).export_library(str(lib), fcompile=tvm.support.cc.cross_compiler(t.cross_compiler))
    return lib


def build_decode_gemv(target: str, n: int, k: int, form: str, out: Path) -> Path:
    """lib.so with one function calling the sdot decode GEMV of an N x K linear in `form`
    (q4_k: the compact factors on Q8_K activations; q4_k-expanded: float32 d sc and c; q4_0;
    q5_k and q5_1: five-bit codes with compact factors or float32 block offsets; iq4: IQ4_NL's
    4-bit indices into the book). Only its
    code is read: the inputs are never made."""
    import tvm
    from tvm import relax

    from qwc.compiler.build import build
    from qwc.compiler.kernels import decode_gemv, dot_bits, q4_k_scales
    from qwc.compiler.kernels.row_groups import ROWS, chunks, groups
    from qwc.compiler.targets import get_target

    t = get_target(target)
    nb = k // 32
    sdt = {"q4_k": "uint8", "q4_k-expanded": "float32", "q4_0": "float16", "q5_k": "uint8", "q5_1": "float16",
           "iq4": "float16"}[form]
    dot = "sdot5" if form.startswith("q5") else "sdot_iq4" if form == "iq4" else "sdot"
    ws_shape, ws_dtype, wc_shape, wc_dtype = q4_k_scales.buffers(sdt, groups(n), nb, "arm")
    offsets = form not in ("q4_0", "iq4")
    shapes = [("aq", [1, nb, 32], "int8"), ("ad", [1, nb], "float32"), ("off", [1, nb], "int32"),
              ("w", [groups(n), nb, chunks(dot_bits(dot)), 4 * ROWS], "uint8"), ("s", list(ws_shape), ws_dtype)]
    shapes += [("c", list(wc_shape), wc_dtype)] if offsets else []
    params = [relax.Var(x, relax.TensorType(shape, dtype)) for x, shape, dtype in shapes]
    bb = relax.BlockBuilder()
    with bb.function("gemv", params):
        with bb.dataflow():
            kernel = bb.add_func(decode_gemv(((n, False, offsets),), nb, sdt, dot=dot), "decode_gemv")
            gv = bb.emit_output(bb.emit(relax.call_tir(kernel, params, relax.TensorType([1, n], "float32"))))
        bb.emit_func_output(gv)
    lib = out / "gemv.so"
    build(bb.get(), t).export_library(str(lib), fcompile=tvm.support.cc.cross_compiler(t.cross_compiler))
    return lib


def build_q6_k(target: str, n: int, k: int, out: Path) -> Path:
    """lib.so with one function calling the Q6_K kernel (kernels/arm/q6_k.py) at one token, on
    activations scaled by super-blocks (llama.cpp's Q8_K). Only its code is read: the inputs are
    never made."""
    import tvm
    from tvm import relax

    from qwc.compiler.build import build
    from qwc.compiler.kernels.arm import q6_k
    from qwc.compiler.kernels.row_groups import ROWS, groups
    from qwc.compiler.targets import get_target

    t = get_target(target)
    nb, g = k // 32, groups(n)
    shapes = [("aq", [1, nb, 32], "int8"), ("ad", [1, nb], "float32"), ("w", [g, nb, q6_k.CODE_CHUNKS, 4 * ROWS], "uint8"),
              ("sc", [g, nb, 2 * q6_k.SUB], "int8"), ("d", [g, nb // q6_k.SUPER_BLOCKS, ROWS], "float16")]
    params = [relax.Var(x, relax.TensorType(shape, dtype)) for x, shape, dtype in shapes]
    bb = relax.BlockBuilder()
    with bb.function("gemv", params):
        with bb.dataflow():
            kernel = bb.add_func(q6_k.q6_k_matmul(n, nb, 1), "q6_k_matmul")
            gv = bb.emit_output(bb.emit(relax.call_tir(kernel, params, relax.TensorType([1, n], "float32"))))
        bb.emit_func_output(gv)
    lib = out / "q6_k.so"
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
    p.add_argument("--form", default="q4_0", choices=("q4_0", "q4_k", "q5_k", "q5_1"),
                   help="the prefill GEMM's weights (q4_k: compact factors; q5_k, q5_1: five-bit codes)")
    p.add_argument("--decode", choices=("q4_k", "q4_k-expanded", "q4_0", "q5_k", "q5_1", "q6_k", "iq4"),
                   help="the sdot decode GEMV's loops on this weight form, instead of the prefill GEMM's")
    p.add_argument("--n", type=int, help="rows (default 64; 256 with --decode)")
    p.add_argument("--k", type=int, help="columns (default 896; 1536 with --decode)")
    args = p.parse_args()
    if args.form != "q4_0" and (args.decode or args.act == "row"):
        sys.exit("arm_tile_loops: --form is the prefill GEMM's weights, on blocks' activations")
    n = args.n or (256 if args.decode else 64)
    k = args.k or (1536 if args.decode or args.form in ("q4_k", "q5_k") else 896)
    step = 256 if args.form in ("q4_k", "q5_k") or args.decode and args.decode.startswith(("q4_k", "q5_k", "q6_k")) else 32
    if k % step or k < step or n < 1:
        sys.exit(f"arm_tile_loops: --k a positive multiple of {step}, --n from 1")
    dot = "sdot" if args.decode or args.target == "arm-neon" else "smmla"
    with tempfile.TemporaryDirectory() as d:
        if args.decode == "q6_k":
            found = loops(build_q6_k(args.target, n, k, Path(d)), dot)
        elif args.decode:
            found = loops(build_decode_gemv(args.target, n, k, args.decode, Path(d)), dot)
        else:
            found = loops(build_gemm(args.target, PROMPT, n, k, args.act == "row", Path(d), args.form), dot)
    what = f"the decode GEMV, {args.decode}" if args.decode else f"{args.form}, {args.act} activations"
    print(f"{args.target}, {what}, N = {n}, K = {k}: the loops holding {dot}\n")
    print(f"| {dot} an iteration | instructions an iteration | multiply-adds | instructions / MAC | N2 cycles an iteration "
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
