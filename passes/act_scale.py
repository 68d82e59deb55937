"""Which linears' prefill takes per-token int8 activations (`qwc optimize --act-scale`;
design.md, "Two activation formats").

Every integer-dot linear quantizes its input to int8 first. In blocks of 32 (llama.cpp's
Q8_0, the default) the GEMM multiplies each block's dot by the activation's block scale as
well as the weight's; with one scale and one zero point a token (KleidiAI's qai8dx) that
multiply and its load leave the block loop (kernels/arm/i8mm.py, dotprod.py). Rows cost accuracy where a
token's values span a wide range (the MLP's down projection above all), so:

- `block`: every linear in blocks (nothing recorded);
- `row`: every linear that can (Q4_0 or Q8_0 codes, blocks of 32, whole blocks of K; not the
  head, whose one prefill position runs the decode GEMV);
- `auto`: those whose relative output error ||W (q(x) - x)|| / ||W x|| on calibration text is
  at most ROW_MARGIN above their block error. Linears that read the same tensor (q/k/v,
  gate/up) share one quantizer, so they go to rows together or not at all.

The choice is graph metadata (graph.ROW_ACTIVATIONS_KEY, by weight name), which onnxruntime
ignores; `qwc compile` acts on it where the target's GEMM has the form
(compiler/row_activations.py).
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import onnx

from qwc import progress
from qwc.q4 import (
    dequantize_q4_0,
    dequantize_q8_0,
    fake_quantize_q8_0_activations,
    fake_quantize_rows_asym,
    unpack_nibbles,
)

from .graph import ROW_ACTIVATIONS_KEY, Graph, has_zero_points, matmul_nbits_dims, tensor_array

MODES = ("block", "row", "auto")
# Rows where a linear's error in them exceeds its block error by at most this (relative-error
# units): on SmolLM2 / Austen it kept the all-block perplexity with half the multiply-adds on
# rows, where 0.02 lost perplexity (docs/history/accuracy.md)
ROW_MARGIN = 0.01
WINDOW = 512        # tokens a calibration prefill
SAMPLE_EVERY = 4    # of each window's tokens, every 4th measures the errors (a 7B's linears in numpy)


def candidates(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """The MatMulNBits that can take per-token activations (see the module's `row`)."""
    out = []
    for n in model.graph.node:
        if n.op_type != "MatMulNBits" or len(n.input) < 3 or has_zero_points(n) or n.name.startswith("lm_head"):
            continue
        k, _, block, bits = matmul_nbits_dims(n)
        if block == 32 and bits in (4, 8) and k % 32 == 0 and not any(a.name.startswith("qwc_") for a in n.attribute):
            out.append(n)
    return out


def dequantized(node: onnx.NodeProto, inits) -> np.ndarray:
    """The weight [N, K] float32 a Q4_0 / Q8_0 MatMulNBits computes with."""
    k, n, _, bits = matmul_nbits_dims(node)
    codes = tensor_array(inits[node.input[1]])
    d = tensor_array(inits[node.input[2]]).astype(np.float32).reshape(n, -1)
    if bits == 4:
        return dequantize_q4_0(unpack_nibbles(codes), d, k)
    return dequantize_q8_0(codes.astype(np.int16) - 128, d, k)


def relative_errors(x: np.ndarray, w: np.ndarray) -> tuple[float, float]:
    """(block, row) relative output errors of x [R, K] through w [N, K]."""
    y = np.linalg.norm(x @ w.T)
    if y == 0:
        return 0.0, 0.0
    return tuple(float(np.linalg.norm((f(x) - x) @ w.T) / y)
                 for f in (fake_quantize_q8_0_activations, fake_quantize_rows_asym))


def errors(model: onnx.ModelProto, nodes, ids: np.ndarray, options) -> dict[str, tuple[float, float]]:
    """{weight name: (block, row) error} over calibration prefills of `ids` in onnxruntime."""
    from .verify import calibration_windows

    cfg = options.require_config("--act-scale auto's calibration")
    tensors = sorted({n.input[0] for n in nodes})
    seen = defaultdict(list)
    for outs in calibration_windows(model, tensors, ids, cfg, WINDOW, "activation formats"):
        for t, x in outs.items():
            seen[t].append(x[::SAMPLE_EVERY].astype(np.float32))
    inits = Graph(model).inits
    out = {}
    for n in progress.bar(nodes, desc="activation errors", unit="linear"):
        out[n.input[1]] = relative_errors(np.concatenate(seen[n.input[0]]), dequantized(n, inits))
    return out


def choose(nodes, errs: dict[str, tuple[float, float]], margin: float = ROW_MARGIN) -> set[str]:
    """The weight names that go to rows: every linear of an input within `margin`."""
    by_input = defaultdict(list)
    for n in nodes:
        by_input[n.input[0]].append(n.input[1])
    return {w for ws in by_input.values() if all(errs[w][1] <= errs[w][0] + margin for w in ws) for w in ws}


def _kind(node: onnx.NodeProto) -> str:
    parts = node.name.split(".")
    return next((p for p in parts if p.endswith("_proj")), node.op_type)


def run(model: onnx.ModelProto, options) -> onnx.ModelProto:
    mode = options.act_scale
    kept = [p for p in model.metadata_props if p.key != ROW_ACTIVATIONS_KEY]
    if mode == "block":
        del model.metadata_props[:]
        model.metadata_props.extend(kept)
        return model
    nodes = candidates(model)
    if mode == "row" or not nodes:   # (no candidate: nothing to calibrate)
        rows = {n.input[1] for n in nodes}
    else:
        rows = choose(nodes, errors(model, nodes, options.act_scale_calibration, options))
    per_kind = defaultdict(lambda: [0, 0])
    for n in nodes:
        per_kind[_kind(n)][0] += n.input[1] in rows
        per_kind[_kind(n)][1] += 1
    progress.info(f"[qwc]   activations a token ({mode}): {len(rows)} of {len(nodes)} linears ("
                  + ", ".join(f"{k} {a}/{b}" for k, (a, b) in sorted(per_kind.items())) + ")")
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    if rows:
        p = model.metadata_props.add()
        p.key, p.value = ROW_ACTIVATIONS_KEY, ",".join(sorted(rows))
    return model
