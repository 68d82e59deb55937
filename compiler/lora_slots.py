"""Adapter slots in the canonical graph: `qwc compile --max-lora-rank R`.

Every linear of a decoder layer (q/k/v/o, gate/up/down) gets a QwcLoraAdd node after it,
y + B[slot]·(A[slot]·x) (compiler/kernels/lora.py), so the runtime can serve LoRA adapters
unmerged, a different one for each token of a batch (runtime/adapters.py writes the slots).
The node reads the linear's own input, the graph input LORA_SLOT (each token's slot, shaped as
input_ids) and two graph inputs of its own, A and B. Their slot count and padded rank are
symbolic, so one artifact serves any number of adapters up to its rank bound.

This runs on each entry point's node list after passes/last_position.py has cut it: where a
linear reads the last position only (prefill's last layer) or the tokens a step returns, its
slots are cut by the same op (a Slice, or QwcStepTokens) so that every row of x keeps its
token's slot.
"""

from __future__ import annotations

import re

import onnx
from onnx import TensorProto, helper

from qwc.errors import QwcError
from qwc.passes.graph import COLUMN_BLOCKS_OP, RESCALED_INPUTS_KEY
from qwc.passes.naming import module_name

from .kernels.lora import CHUNK

# (y, x, slot, a, b[, extra]) -> y + b[slot]·(a[slot]·x), x read through a prologue (_prologue)
OP = "QwcLoraAdd"
LORA_SLOT = "qwc_lora_slot"       # [batch, tokens] int64, as input_ids: 0 the base, k >= 1 slot k
LINEAR_OPS = ("MatMulNBits", "MatMul", COLUMN_BLOCKS_OP)
# The cuts passes/last_position.py makes, by node name: the tensors they output hold fewer rows
CUTS = ("qwc_last_position_query", "qwc_last_position", "qwc_last_position_residual", "qwc_step_tokens",
        "qwc_step_tokens_residual")
_LINEAR = re.compile(r"model\.layers\.(\d+)\.(self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj(?:\.|$)")


def input_names(i: int) -> tuple[str, str]:
    """The graph inputs of the i-th adapted linear's A and B (no dots: the library keeps names)."""
    return f"qwc_lora_a_{i}", f"qwc_lora_b_{i}"


def adapted_linears(nodes, shapes: dict[str, tuple[int, int]]) -> list[tuple[onnx.NodeProto, str]]:
    """(node, HF weight name) of every decoder linear among `nodes`, in graph order; `shapes`
    maps weight names to [out, in] (qwc/adapter_files.py: linear_shapes)."""
    found = []
    for n in nodes:
        if n.op_type not in LINEAR_OPS:
            continue
        hit = _LINEAR.search(module_name(n)) or _LINEAR.search(n.name)
        if hit is None:
            continue
        layer, block, proj = hit.groups()
        name = f"model.layers.{layer}.{block}.{proj}_proj.weight"
        if name in shapes:
            found.append((n, name))
    return found


def check_inputs_unscaled(model: onnx.ModelProto, src) -> None:
    """Adapter slots read each linear's input as the graph has it, and an adapter's A expects the
    checkpoint's: refuse a graph whose passes scaled those inputs (AWQ, folded norm gains)."""
    by = next((p.value for p in model.metadata_props if p.key == RESCALED_INPUTS_KEY), None)
    if by:
        flags = ", ".join("--awq" if b == "awq" else "--fold-norm-gains" for b in by.split(","))
        raise QwcError(f"--max-lora-rank: {src} was optimized with {flags}, which scale the linears' inputs that "
                       "an adapter reads; optimize without it to serve adapters unmerged, or merge the adapter "
                       "first (qwc export --lora)")


def add_slot_inputs(model: onnx.ModelProto, shapes: dict[str, tuple[int, int]]) -> list[dict]:
    """Declare LORA_SLOT and each adapted linear's A and B as graph inputs of `model` (after
    the cache); returns the linears, in argument order, as the manifest lists them."""
    linears = adapted_linears(model.graph.node, shapes)
    if not linears:
        raise QwcError("--max-lora-rank: the graph has no decoder linears to adapt")
    g = model.graph
    g.input.append(helper.make_tensor_value_info(LORA_SLOT, TensorProto.INT64, None))
    out = []
    for i, (_, name) in enumerate(linears):
        n_out, k = shapes[name]
        a, b = input_names(i)
        g.input.append(helper.make_tensor_value_info(a, TensorProto.FLOAT, ["lora_slots", k, "lora_chunks", CHUNK]))
        g.input.append(helper.make_tensor_value_info(b, TensorProto.FLOAT, ["lora_slots", "lora_chunks", CHUNK, n_out]))
        out.append({"name": name, "in": k, "out": n_out})
    return out


def with_slots(nodes: list, linears: list[dict], shapes: dict[str, tuple[int, int]]) -> list:
    """Copies of `nodes` with a QwcLoraAdd after each adapted linear (`linears`: add_slot_inputs'
    list, whose order gives the inputs' names)."""
    g = onnx.GraphProto()
    for n in nodes:
        g.node.add().CopyFrom(n)
    index = {d["name"]: i for i, d in enumerate(linears)}
    cut = [n for n in g.node if n.name in CUTS]
    downstream = _reachable(g.node, {o for n in cut for o in n.output})
    cut_slot = None
    prod = {o: n for n in g.node for o in n.output}
    for node, name in adapted_linears(list(g.node), shapes):
        slot = LORA_SLOT
        if node.input[0] in downstream:
            if cut_slot is None:   # the same cut for the slots: Slice's bounds, or the tokens picked
                cut_slot = f"{LORA_SLOT}_cut"
                c = cut[0]
                g.node.insert(list(g.node).index(c), helper.make_node(c.op_type, [LORA_SLOT, *c.input[1:]],
                                                                      [cut_slot], name=f"{LORA_SLOT}_cut"))
            slot = cut_slot
        y = node.output[0]
        base = f"{y}_base"
        node.output[0] = base
        a, b = input_names(index[name])
        x, more, attrs = _prologue(prod, node.input[0])
        add = helper.make_node(OP, [base, x, slot, a, b, *more], [y], name=f"{node.name}_lora", **attrs)
        g.node.insert(list(g.node).index(node) + 1, add)
    return list(g.node)


def _prologue(prod: dict, x: str) -> tuple[str, list[str], dict]:
    """What the shrink reads for the linear input x: (x, [], {}) as it is; (gate, [up],
    prologue silu_mul) where x = silu(gate)·up; (h, [gamma], prologue rms) where x is an
    RMSNorm of h (ONNX's SimplifiedLayerNormalization, or the skip form's sum, output 3). The
    quantizers compute these themselves, so the float x need not exist (compiler/kernels/lora.py)."""
    gate_up = _silu_mul(prod, x)
    if gate_up:
        return gate_up[0], [gate_up[1]], {"prologue": "silu_mul"}
    norm = prod.get(x)
    if norm is not None and norm.output[0] == x:
        eps = next((helper.get_attribute_value(at) for at in norm.attribute if at.name == "epsilon"), 1e-5)
        if norm.op_type == "SimplifiedLayerNormalization" and len(norm.input) == 2:
            return norm.input[0], [norm.input[1]], {"prologue": "rms", "epsilon": float(eps)}
        if (norm.op_type == "SkipSimplifiedLayerNormalization" and len(norm.output) > 3 and norm.output[3]
                and len(norm.input) == 3):
            return norm.output[3], [norm.input[2]], {"prologue": "rms", "epsilon": float(eps)}
    return x, [], {}


def _silu_mul(prod: dict, x: str) -> tuple[str, str] | None:
    """(gate, up) where x = Mul(Mul(gate, Sigmoid(gate)), up) (in either order), else None."""
    mul = prod.get(x)
    if mul is None or mul.op_type != "Mul" or len(mul.input) != 2:
        return None
    for silu, up in (mul.input, mul.input[::-1]):
        m = prod.get(silu)
        if m is None or m.op_type != "Mul" or len(m.input) != 2:
            continue
        for gate, sig in (m.input, m.input[::-1]):
            s = prod.get(sig)
            if s is not None and s.op_type == "Sigmoid" and s.input[0] == gate:
                return gate, up
    return None


def _reachable(nodes, start: set[str]) -> set[str]:
    """Tensors computed from any of `start` (nodes in topological order), `start` included."""
    seen = set(start)
    for n in nodes:
        if any(x in seen for x in n.input):
            seen.update(n.output)
    return seen
