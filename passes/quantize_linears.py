"""Quantize linears: MatMul(x, W) with a constant W [K, N] (and a following Add of a
constant bias [N]) -> com.microsoft MatMulNBits (bits 4, symmetric: no zero-point input,
so onnxruntime uses 8; block 32 or 128), Q4_0-exact (qwc.q4); with `--bits 8`, or for the
linears `--q8` names, Q8_0 (bits 8, uint8 q + 128, block 32).

With `--format q4_k_m` this pass leaves the linears to passes/quantize_kquants.py.

Linears whose module name matches a pattern in `options.keep_float` stay in float.
The tied lm_head (MatMul(x, Transpose(embedding))) is left to the embedding pass, which
quantizes both uses from one copy of the bytes.
"""

from __future__ import annotations

import fnmatch

import numpy as np
import onnx

from qwc import weight_formats
from qwc.errors import QwcError
from qwc.models.gguf_blocks import minimums_form
from qwc.q4 import pack_nibbles, quantize_q4_0, quantize_q8_0, row_chunks

from .graph import MS_DOMAIN, Graph, ensure_ms_opset, tensor_bytes
from .naming import module_name
from .options import PassOptions


def run(model: onnx.ModelProto, options: PassOptions | None = None) -> onnx.ModelProto:
    options = options or PassOptions()
    if options.format != "q4_0":
        return model   # passes/quantize_kquants.py quantizes them
    g = Graph(model)
    for n, name in linears_to_quantize(g, options):
        w = g.const(n.input[1])
        bits = 8 if options.bits == 8 or any(fnmatch.fnmatch(name, pat) for pat in options.q8) else 4
        emit_matmul_nbits(g, n, w.T, options.block_size, name, bits=bits)   # a view: quantized in row chunks
        del w
    g.commit()
    ensure_ms_opset(model)
    return model


def linears_to_quantize(g: Graph, options: PassOptions) -> list[tuple[onnx.NodeProto, str]]:
    """(MatMul, module name) of every linear with a constant 2-D weight that `--keep-float`
    does not name, largest weight first: its float32 copy and temporaries then coexist with few
    quantized weights (a 7B's lm_head is 2.2 GB in float32, its whole model 4.3 GB in Q4_0)."""
    matmuls = [n for n in g.g.node if n.op_type == "MatMul" and n.domain in ("", "ai.onnx")]
    matmuls.sort(key=lambda n: -tensor_bytes(g.inits[n.input[1]]) if n.input[1] in g.inits else 0)
    todo = []
    for n in matmuls:
        # the weight's rank from its initializer's dims: reading a lazily loaded graph's weights
        # here as well would read every one twice
        t = g.inits.get(n.input[1])
        w = None if t is not None else g.const(n.input[1])
        dims = tuple(t.dims) if t is not None else None if w is None else w.shape
        if dims is None or len(dims) != 2 or g.const(n.input[0]) is not None or minimums_form(n) == "term":
            continue   # (the term that adds a GGUF Q5_1 / Q5_K linear's block minimums is no linear)
        name = module_name(n)
        if not any(fnmatch.fnmatch(name, pat) for pat in options.keep_float):
            todo.append((n, name))
    return todo


def emit_matmul_nbits(g: Graph, n: onnx.NodeProto, w_nk: np.ndarray, block: int, name: str,
                      packed: str | None = None, scales: str | None = None, bits: int = 4,
                      zero_points: str | None = None, fmt: str | None = None) -> onnx.NodeProto:
    """Replace MatMul node `n` (weight given as [N, K]) by MatMulNBits, folding a constant bias
    Add that follows it, marked with its weight format `fmt` (qwc/weight_formats.py; default
    Q8_0 for 8 bits, else Q4_0). `packed`/`scales` (and `zero_points`: float ones, Q4_1 /
    Q4_K) reuse already-quantized initializers."""
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
    node = g.node("MatMulNBits", inputs, [out], name=g.fresh(name + ".MatMulNBits"), domain=MS_DOMAIN,
                  K=k, N=nn, bits=bits, block_size=block)
    weight_formats.mark(node, fmt or ("Q8_0" if bits == 8 else "Q4_0"))
    return node


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
