"""Quantize linears in a K-quant mix (`qwc optimize --format q4_k_m`, q4_k_s, q5_k_m, q6_k): each
linear takes the format passes/kquant_mix.py gives it (Q4_K, Q5_K, Q6_K, or their fallbacks Q5_0,
Q5_1, Q8_0), its blocks searched by
qwc/kquants.py against the importance matrix (passes/imatrix.py: a llama-imatrix file's, or
computed here on calibration text), or by GPTQ in that format (`--gptq`: passes/gptq.py), and
written as a GGUF's blocks of that format are (models/gguf_blocks.py), so the graph holds
exactly what a downloaded file of that mix would. passes/quantize_linears.py leaves the
linears to this pass under a K format; the tied lm_head is the embedding pass's.
"""

from __future__ import annotations

import numpy as np
import onnx

from qwc import progress
from qwc.errors import QwcError
from qwc.kquants import quantize_q4_k, quantize_q5_0, quantize_q5_1, quantize_q5_k, quantize_q6_k
from qwc.models import gguf_blocks
from qwc.q4 import quantize_q8_0

from . import gptq, imatrix
from .graph import Graph, ensure_ms_opset
from .kquant_mix import BITS, linear_format
from .options import PassOptions
from .quantize_linears import check_quantizable, emit_matmul_nbits, linears_to_quantize

QUANTIZERS = {"Q4_K": quantize_q4_k, "Q5_K": quantize_q5_k, "Q5_0": quantize_q5_0, "Q5_1": quantize_q5_1,
              "Q6_K": quantize_q6_k}
GPTQ_FORMATS = ("Q4_K", "Q5_0")   # gptq.quantize_k's: the others take the search alone


def run(model: onnx.ModelProto, options: PassOptions | None = None) -> onnx.ModelProto:
    options = options or PassOptions()
    if options.format == "q4_0":
        return model
    g = Graph(model)
    _quantize(g, model, linears_to_quantize(g, options), options)
    g.commit()
    ensure_ms_opset(model)
    return model


def _quantize(g: Graph, model: onnx.ModelProto, todo: list, options: PassOptions) -> None:
    """The linears `todo` [(node, module name)] in the --format mix, searched against the
    importance matrix (a file's, or computed now from the float graph on calibration text)."""
    layers = options.require_config(f"--format {options.format}").num_hidden_layers
    importance = options.importance or {}
    tensors = sorted({n.input[0] for n, _ in todo})
    if options.imatrix_calibration is not None:
        by_tensor = imatrix.from_calibration(model, tensors, options.imatrix_calibration, options)
        importance = {name: by_tensor[n.input[0]] for n, name in todo}
    hessians = gptq.hessians(model, tensors, options.gptq_calibration, options) \
        if options.gptq_calibration is not None else None
    counts: dict[str, int] = {}
    weights = bits = 0.0
    searched_only = 0
    for n, name in progress.bar(todo, desc=f"--format {options.format}", unit="linear"):
        w = g.const(n.input[1]).T                      # [N, K], a view
        nn, k = w.shape
        fmt = linear_format(name, k, layers, options.format)
        check_quantizable(w, name)
        imp = importance.get(name)
        if imp is not None and np.shape(imp) != (k,):
            raise QwcError(f"--imatrix: {name} has {np.shape(imp)[0]} importances for {k} inputs (another model's?)")
        if fmt == "Q8_0":
            q8, d = quantize_q8_0(w, 32)
            b = gguf_blocks.Blocks("Q8_0", (q8.astype(np.int16) + 128).astype(np.uint8), d)
        else:
            if hessians is not None and fmt in GPTQ_FORMATS:   # each group searched as GPTQ reaches it
                raw = gptq.quantize_k(w, hessians[n.input[0]], fmt)
            else:
                raw = QUANTIZERS[fmt](w, imp)
                searched_only += hessians is not None
            b = gguf_blocks.from_gguf(raw, fmt, (nn, k), name)
        packed = g.add_init(b.codes, f"{name}.qweight")
        scales = g.add_init(b.scales, f"{name}.scales")
        zp = g.add_init(b.zero_points, f"{name}.zero_points") if b.zero_points is not None else None
        node = emit_matmul_nbits(g, n, w, b.block, name, packed=packed, scales=scales, bits=b.bits, zero_points=zp,
                                 fmt=b.fmt)
        if b.minimums is not None:
            _add_minimums_term(g, node, b, name)
        counts[fmt] = counts.get(fmt, 0) + 1
        weights += w.size
        bits += w.size * BITS[fmt]
        del w, b
    if searched_only:
        progress.info(f"[qwc]   --gptq: {searched_only} linears in Q5_K, Q5_1 or Q6_K took the search alone "
                      "(GPTQ runs in Q4_K and Q5_0)")
    missing = [name for _, name in todo if name not in importance] if importance else []
    if missing:
        progress.info(f"[qwc]   --imatrix has no entry for {len(missing)} linears ({missing[0]}, ...): "
                      "searched unweighted")
    progress.info(f"[qwc]   --format {options.format}: " + ", ".join(f"{c} {f}" for f, c in sorted(counts.items()))
                  + f"; {bits / max(weights, 1):.2f} bits a weight over the linears"
                  + (" (GPTQ)" if hessians is not None else " (importance-weighted)" if importance else ""))


def _add_minimums_term(g: Graph, node: onnx.NodeProto, b: gguf_blocks.Blocks, name: str) -> None:
    """A Q5_K / Q5_1 linear's block minimums added beside its MatMulNBits, as a file's are
    (gguf_blocks.minimums_term; compiler/block_minimums.py folds them at compile time)."""
    out, k = node.output[0], b.codes.shape[1] * gguf_blocks.BLOCK
    node.output[0] = out + ".codes_term"
    g.producer[node.output[0]] = node
    minimums_t = g.add_init(np.ascontiguousarray(b.minimums.T), f"{name}.block_minimums.T")
    shape, axis = (g.inits[c].name if c in g.inits else g.add_init(a, c)
                   for c, a in gguf_blocks.minimums_constants(k).items())
    for nd in gguf_blocks.minimums_term(node.input[0], node.output[0], minimums_t, shape, axis, out,
                                        node.name + "/block_minimums"):
        g.add_node(nd)
