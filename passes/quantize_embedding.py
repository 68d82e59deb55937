"""Quantize the embedding: Gather(E, ids) -> com.microsoft GatherBlockQuantized on E's
block-quantized bytes, and a tied lm_head MatMul(x, Transpose(E)) -> MatMulNBits reading the
very same bytes and scales (one copy of the weight in the file).

Both ops take the weight as [vocab, blocks, bytes-per-block] uint8 (MatMulNBits insists on
that shape): GatherBlockQuantized quantizes along its last axis and returns
[..., blocks, block] values that a Reshape flattens to [..., hidden]; it reads the scales
through an Unsqueeze to [vocab, blocks, 1].

4 bits: Q4_0 (zero point 8). 8 bits (`--lm-head-bits 8`, llama.cpp's default for a tied
Qwen2.5 output matrix): Q8_0 stored as uint8 with onnxruntime's default zero point 128. Under
`--format q4_k_m` a tied embedding is the output matrix, which that mix gives Q6_K (searched by
qwc/kquants.py, blocks of 16 as a GGUF's, models/gguf_blocks.py), or Q8_0 where its rows are
not whole super-blocks of 256, as llama.cpp falls back (passes/kquant_mix.py).
"""

from __future__ import annotations

import numpy as np
import onnx

from qwc.q4 import pack_nibbles, quantize_q4_0, quantize_q8_0

from .graph import MS_DOMAIN, Graph, ensure_ms_opset
from .options import PassOptions
from .quantize_linears import check_quantizable, emit_matmul_nbits

EMBED_BLOCK = 32  # llama.cpp's block for Q4_0 and Q8_0 alike
SUPER = 256       # a K-quant super-block


def run(model: onnx.ModelProto, options: PassOptions | None = None) -> onnx.ModelProto:
    options = options or PassOptions()
    bits = options.lm_head_bits
    g = Graph(model)
    for n in list(g.g.node):
        if n.op_type != "Gather" or n.domain not in ("", "ai.onnx") or g.attr(n, "axis", 0) != 0:
            continue
        e = g.const(n.input[0])
        if e is None or e.ndim != 2 or e.shape[1] % EMBED_BLOCK:
            continue
        vocab, hidden = e.shape
        check_quantizable(e, "the embedding")
        block = EMBED_BLOCK
        kquant_head = options.format != "q4_0" and _tied(g, n.input[0])
        if kquant_head:
            bits = 8
        if kquant_head and hidden % SUPER == 0:   # the mix's Q6_K output
            from qwc.kquants import quantize_q6_k
            from qwc.models import gguf_blocks

            imp = (options.importance or {}).get("lm_head")
            b = gguf_blocks.from_gguf(quantize_q6_k(e, imp), "Q6_K", e.shape, "lm_head")
            data, d, block = b.codes, b.scales, b.block
        elif bits == 4:
            q, d = quantize_q4_0(e, EMBED_BLOCK)
            data = pack_nibbles(q)
        else:
            q8, d = quantize_q8_0(e, EMBED_BLOCK)
            data = (q8.astype(np.int16) + 128).astype(np.uint8)
        packed = g.add_init(data, "embed_tokens.qweight")
        scales = g.add_init(d, "embed_tokens.scales")
        axis = g.add_init(np.array([2], np.int64), "axis_two")
        scales3 = g.fresh("embed_tokens.scales3")
        g.node("Unsqueeze", [scales, axis], [scales3])
        blocks = g.fresh("embedding_blocks")
        g.node("GatherBlockQuantized", [packed, n.input[1], scales3], [blocks], domain=MS_DOMAIN,
               gather_axis=0, quantize_axis=2, block_size=block, bits=bits)
        shape = g.add_init(np.array([0, 0, hidden], np.int64), "embedding_shape")
        g.remove_node(n)
        g.node("Reshape", [blocks, shape], [n.output[0]])
        # The tied lm_head: MatMul(x, Transpose(E)).
        for t in list(g.consumers.get(n.input[0], [])):
            if t.op_type != "Transpose" or list(g.attr(t, "perm", [1, 0])) != [1, 0]:
                continue
            for mm in list(g.consumers.get(t.output[0], [])):
                if mm.op_type == "MatMul" and mm.input[1] == t.output[0]:
                    emit_matmul_nbits(g, mm, e, block, "lm_head", packed=packed, scales=scales, bits=bits)
    g.commit()
    ensure_ms_opset(model)
    return model


def _tied(g: Graph, name: str) -> bool:
    """Whether the embedding `name` is also the lm_head (read through a Transpose)."""
    return any(t.op_type == "Transpose" for t in g.consumers.get(name, []))
