"""Quantize linears: MatMul(x, W) with a constant W [K, N] (and a following Add of a
constant bias [N]) -> com.microsoft MatMulNBits (bits 4, symmetric: no zero-point input,
so onnxruntime uses 8; block 32 or 128), Q4_0-exact (qwc.q4); with `--bits 8`, or for the
linears `--q8` names, Q8_0 (bits 8, uint8 q + 128, block 32).

With `--format q4_k_m` each linear takes the format passes/kquant_mix.py gives it (Q4_K, Q5_0
or Q8_0), its blocks searched by qwc/kquants.py against the importance matrix
(passes/imatrix.py) and written as a GGUF's blocks of that format are (models/gguf_blocks.py).

Linears whose module name matches a pattern in `options.keep_float` stay in float.
The tied lm_head (MatMul(x, Transpose(embedding))) is left to the embedding pass, which
quantizes both uses from one copy of the bytes.
"""

from __future__ import annotations

import fnmatch

import numpy as np
import onnx

from qwc.errors import QwcError
from qwc.q4 import pack_nibbles, quantize_q4_0, quantize_q8_0, row_chunks

from .graph import MS_DOMAIN, Graph, ensure_ms_opset, tensor_bytes
from .naming import module_name
from .options import PassOptions


def run(model: onnx.ModelProto, options: PassOptions | None = None) -> onnx.ModelProto:
    options = options or PassOptions()
    g = Graph(model)
    # Largest weight first: its float32 copy and temporaries then coexist with few quantized
    # weights (a 7B's lm_head is 2.2 GB in float32, its whole model 4.3 GB in Q4_0).
    matmuls = [n for n in g.g.node if n.op_type == "MatMul" and n.domain in ("", "ai.onnx")]
    matmuls.sort(key=lambda n: -tensor_bytes(g.inits[n.input[1]]) if n.input[1] in g.inits else 0)
    todo = []
    for n in matmuls:
        w = g.const(n.input[1])
        if w is None or w.ndim != 2 or g.const(n.input[0]) is not None:
            continue
        name = module_name(n)
        if not any(fnmatch.fnmatch(name, pat) for pat in options.keep_float):
            todo.append((n, name))
        del w
    if options.format != "q4_0":
        _k_quantize(g, model, todo, options)
        g.commit()
        ensure_ms_opset(model)
        return model
    for n, name in todo:
        w = g.const(n.input[1])
        bits = 8 if options.bits == 8 or any(fnmatch.fnmatch(name, pat) for pat in options.q8) else 4
        emit_matmul_nbits(g, n, w.T, options.block_size, name, bits=bits)   # a view: quantized in row chunks
        del w
    g.commit()
    ensure_ms_opset(model)
    return model


def _k_quantize(g: Graph, model: onnx.ModelProto, todo: list, options: PassOptions) -> None:
    """The linears `todo` [(node, module name)] in the --format mix, searched against the
    importance matrix (a file's, or computed now from the float graph on calibration text)."""
    from qwc import progress
    from qwc.kquants import quantize_q4_k, quantize_q5_0
    from qwc.models import gguf_blocks

    from . import gptq, imatrix
    from .kquant_mix import BITS, linear_format

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
    for n, name in progress.bar(todo, desc=f"--format {options.format}", unit="linear"):
        w = g.const(n.input[1]).T                      # [N, K], a view
        nn, k = w.shape
        fmt = linear_format(name, k, layers)
        check_quantizable(w, name)
        imp = importance.get(name)
        if imp is not None and np.shape(imp) != (k,):
            raise QwcError(f"--imatrix: {name} has {np.shape(imp)[0]} importances for {k} inputs (another model's?)")
        if fmt == "Q8_0":
            q8, d = quantize_q8_0(w, 32)
            b = gguf_blocks.Blocks("Q8_0", (q8.astype(np.int16) + 128).astype(np.uint8), d)
        else:
            if hessians is not None:   # GPTQ in the format: each group searched as GPTQ reaches it
                raw = gptq.quantize_k(w, hessians[n.input[0]], fmt)
            else:
                raw = (quantize_q4_k if fmt == "Q4_K" else quantize_q5_0)(w, imp)
            b = gguf_blocks.from_gguf(raw, fmt, (nn, k), name)
        packed = g.add_init(b.codes, f"{name}.qweight")
        scales = g.add_init(b.scales, f"{name}.scales")
        zp = g.add_init(b.zero_points, f"{name}.zero_points") if b.zero_points is not None else None
        node = emit_matmul_nbits(g, n, w, 32, name, packed=packed, scales=scales, bits=b.bits, zero_points=zp)
        if zp is not None and b.mins != "fp16":
            gguf_blocks.set_block_mins_form(node, b.mins)
        counts[fmt] = counts.get(fmt, 0) + 1
        weights += w.size
        bits += w.size * BITS[fmt]
        del w, b
    missing = [name for _, name in todo if name not in importance] if importance else []
    if missing:
        progress.info(f"[qwc]   --imatrix has no entry for {len(missing)} linears ({missing[0]}, ...): "
                      "searched unweighted")
    progress.info(f"[qwc]   --format {options.format}: " + ", ".join(f"{c} {f}" for f, c in sorted(counts.items()))
                  + f"; {bits / max(weights, 1):.2f} bits a weight over the linears"
                  + (" (GPTQ)" if hessians is not None else " (importance-weighted)" if importance else ""))


def emit_matmul_nbits(g: Graph, n: onnx.NodeProto, w_nk: np.ndarray, block: int, name: str,
                      packed: str | None = None, scales: str | None = None, bits: int = 4,
                      zero_points: str | None = None) -> onnx.NodeProto:
    """Replace MatMul node `n` (weight given as [N, K]) by MatMulNBits, folding a constant bias
    Add that follows it. `packed`/`scales` (and `zero_points`: float ones, Q4_1 / Q4_K) reuse
    already-quantized initializers."""
    nn, k = w_nk.shape
    if packed is None:
        check_quantizable(w_nk, name)
        if bits == 8:   # Q8_0 as uint8 q + 128 (onnxruntime's default zero point for 8 bits)
            q8, d = quantize_q8_0(w_nk, block)
            packed = g.add_init((q8.astype(np.int16) + 128).astype(np.uint8), f"{name}.qweight")
        else:
            q, d = quantize_q4_0(w_nk, block)
            packed = g.add_init(pack_nibbles(q), f"{name}.qweight")
        scales = g.add_init(d, f"{name}.scales")
    inputs = [n.input[0], packed, scales] + ([zero_points] if zero_points else [])
    out = n.output[0]
    add = g.only_consumer(out)
    if add is not None and add.op_type == "Add":
        other = add.input[1] if add.input[0] == out else add.input[0]
        b = g.const(other)
        if b is not None and b.shape == (nn,) and add.output[0] not in g.graph_outputs:
            inputs += ["", other] if zero_points else ["", "", other]
            g.remove_node(add)
            out = add.output[0]
    g.remove_node(n)
    return g.node("MatMulNBits", inputs, [out], name=g.fresh(name + ".MatMulNBits"), domain=MS_DOMAIN,
                  K=k, N=nn, bits=bits, block_size=block)


F16_MAX_SCALE = 65504.0   # Q4_0's block scale is a float16


def check_quantizable(w: np.ndarray, name: str) -> None:
    """Weights Q4_0 can hold: finite, and small enough that a block's scale (max |w| / 8) is a
    finite float16. A corrupt or diverged checkpoint stops here, by name."""
    big = 0.0
    for rows in row_chunks(w):   # in chunks: the temporaries of a 7B embedding would be GBs
        part = w[rows]
        if not np.isfinite(part).all():
            raise QwcError(f"{name}: the weights hold NaN or infinite values")
        big = max(big, float(np.abs(part).max(initial=0.0)))
    if big / 8 > F16_MAX_SCALE:
        raise QwcError(f"{name}: a weight of magnitude {big:.3g} is beyond Q4_0's float16 scales")
