"""Q8_0 activations in onnxruntime: a compiled A8 artifact against the graph it came from run
with llama.cpp's activation arithmetic, and against the graph in float:

    .venv/bin/python bench/a8_reference.py GRAPH.onnx ART.qwc [--only q_proj] [--prompt 72,101,108] [--steps 5,6,7]
        [--super-blocks down_proj]

The A8 reference is the graph with, before every MatMulNBits (or those whose name holds
`--only`), its input rounded as llama.cpp's Q8_0 does: blocks of 32, d = amax / 127, codes
rounded half away from zero, times d. Where qwc's logits equal that reference and not the float
one, the gap is what Q8_0 activations do to this model, not a kernel's error; `--only` names
the linears whose rounding moves the logits (a model near a tie moves by a lot).
`--super-blocks NAME` rounds the inputs of the linears whose node name holds NAME by
super-blocks of 256 instead, as llama.cpp quantizes a K-quant dot's activations (Q8_K).

Each row: a step (the prompt, then each of --steps fed in turn), the largest logit gap of each
pair over the float logits' range, and the three argmaxes.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper


def with_q8_0_activations(model: onnx.ModelProto, only: str = "", super_blocks: str | None = None) -> onnx.ModelProto:
    """`model` with each MatMulNBits input (whose node name holds `only`) rounded to Q8_0 blocks;
    where the node name also holds `super_blocks` and K is whole super-blocks, to one scale a
    super-block of 256 instead (llama.cpp's Q8_K, which its K-quant dots take)."""
    g = model.graph
    g.initializer.extend([numpy_helper.from_array(np.float32(127), "qwc_a8_127"),
                          numpy_helper.from_array(np.float32(0.5), "qwc_a8_half"),
                          numpy_helper.from_array(np.float32(1e-30), "qwc_a8_tiny"),
                          numpy_helper.from_array(np.array([2], np.int64), "qwc_a8_axis")])
    nodes = []
    for i, node in enumerate(g.node):
        if node.op_type == "MatMulNBits" and only in node.name:
            k = next(a.i for a in node.attribute if a.name == "K")
            x, p = node.input[0], f"qwc_a8_{i}_"
            block = 256 if super_blocks is not None and super_blocks in node.name and k % 256 == 0 else 32
            g.initializer.append(numpy_helper.from_array(np.array([-1, k // block, block], np.int64), p + "blocks"))
            nodes += [helper.make_node("Shape", [x], [p + "shape"]),
                      helper.make_node("Reshape", [x, p + "blocks"], [p + "x"]),
                      helper.make_node("Abs", [p + "x"], [p + "abs"]),
                      helper.make_node("ReduceMax", [p + "abs", "qwc_a8_axis"], [p + "amax"], keepdims=1),
                      helper.make_node("Div", [p + "amax", "qwc_a8_127"], [p + "d0"]),
                      helper.make_node("Max", [p + "d0", "qwc_a8_tiny"], [p + "d"]),
                      helper.make_node("Div", [p + "x", p + "d"], [p + "r"]),
                      # half away from zero (llama.cpp's roundf; ONNX's Round rounds halves to even)
                      helper.make_node("Abs", [p + "r"], [p + "ra"]),
                      helper.make_node("Add", [p + "ra", "qwc_a8_half"], [p + "rh"]),
                      helper.make_node("Floor", [p + "rh"], [p + "qa"]),
                      helper.make_node("Sign", [p + "r"], [p + "sign"]),
                      helper.make_node("Mul", [p + "qa", p + "sign"], [p + "q"]),
                      helper.make_node("Mul", [p + "q", p + "d"], [p + "dq"]),
                      helper.make_node("Reshape", [p + "dq", p + "shape"], [p + "out"])]
            node.input[0] = p + "out"
        nodes.append(node)
    del g.node[:]
    g.node.extend(nodes)
    return model


def main() -> None:
    from qwc.config import load_for_graph
    from qwc.passes.verify import run_steps, session
    from qwc.runtime.engine import Engine

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("graph", type=Path)
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--only", default="", help="round only the inputs of linears whose node name holds this")
    ap.add_argument("--prompt", default="72,101,108,108,111,44,32,119")
    ap.add_argument("--steps", default="5,6,7")
    ap.add_argument("--super-blocks", metavar="NAME",
                    help="round the inputs of linears whose node name holds NAME by super-blocks of 256 (Q8_K: "
                         "llama.cpp's for K-quant weights: down_proj on SmolLM2's Q4_K_M or Q5_K_M)")
    args = ap.parse_args()
    cfg = load_for_graph(args.graph)
    steps = [np.array([[int(t) for t in args.prompt.split(",")]])] + [np.array([[int(t)]]) for t in args.steps.split(",")]
    ref = [r[0, -1] for r in run_steps(session(str(args.graph)), cfg, steps)]
    with tempfile.TemporaryDirectory() as tmp:
        a8 = Path(tmp) / "a8.onnx"
        onnx.save(with_q8_0_activations(onnx.load(str(args.graph)), args.only, args.super_blocks), str(a8),
                  save_as_external_data=True, location="a8.data")
        ref_a8 = [r[0, -1] for r in run_steps(session(str(a8)), cfg, steps)]
    eng = Engine(args.artifact, ctx=64)
    got = [eng.prefill(steps[0][0])] + [eng.decode(int(t[0, 0])) for t in steps[1:]]
    print(f"{args.artifact.name} against onnxruntime on {args.graph.name}"
          f"{f' (Q8_0 activations only where the node name holds {args.only!r})' if args.only else ''}\n")
    print("| step | A8 reference vs float | qwc vs float | qwc vs A8 reference | argmax float / A8 ref / qwc |")
    print("| ---: | ---: | ---: | ---: | --- |")
    for i, (r, a, q) in enumerate(zip(ref, ref_a8, got)):
        span = np.abs(r).max()
        print(f"| {i} | {np.abs(a - r).max() / span:.4f} | {np.abs(q - r).max() / span:.4f} | "
              f"{np.abs(q - a).max() / span:.4f} | {r.argmax()} / {a.argmax()} / {q.argmax()} |")


if __name__ == "__main__":
    main()
