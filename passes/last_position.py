"""The lm_head for the last position only: the rewrite `qwc compile` applies to the prefill
and decode graphs (the `score` entry point keeps every position). For prefill it goes
further back, further than llama.cpp (whose graph keeps only the output rows from the last
layer's o projection on): the last layer's q projection, attention, o projection, MLP and
final norm work on the last position only, since each is position-wise or, for attention,
per query; only the keys and values every position writes to the cache need them all. On a
28-layer model that is a 28th of a prompt's MLP and of its queries.
The embed entry points take the head off instead (hidden_state_nodes)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from qwc.errors import QwcError
from qwc.manifest import STEP_INPUTS
from qwc.passes.graph import COLUMN_BLOCKS_OP

SKIP_NORM = "SkipSimplifiedLayerNormalization"
# A linear by a weight, position by position: Q4_0 / Q8_0 ones and the float ones in column blocks.
LINEARS = {"MatMulNBits", COLUMN_BLOCKS_OP}


def _add_constants(g):
    if any(i.name == "qwc_last_start" for i in g.initializer):
        return
    g.initializer.extend([numpy_helper.from_array(np.array([-1], np.int64), "qwc_last_start"),
                          numpy_helper.from_array(np.array([np.iinfo(np.int64).max], np.int64), "qwc_last_end"),
                          numpy_helper.from_array(np.array([1], np.int64), "qwc_seq_axis")])


def _slice_before(g, node, i: int, name: str):
    """node's input i becomes its last position (a Slice inserted just before node)."""
    x = node.input[i]
    sliced = f"{x}_last"
    s = helper.make_node("Slice", [x, "qwc_last_start", "qwc_last_end", "qwc_seq_axis"], [sliced], name=name)
    g.node.insert(list(g.node).index(node), s)
    node.input[i] = sliced


def last_position_logits(model: onnx.ModelProto) -> onnx.ModelProto:
    """Compute the lm_head for the last position only: generation needs nothing else, and a
    512-token prompt would otherwise produce 512 x vocab logits (311 MB for Qwen2.5)."""
    g = model.graph
    head = next((n for n in g.node if "logits" in n.output), None)
    if head is None:
        raise QwcError("graph has no 'logits' output")
    _add_constants(g)
    _slice_before(g, head, 0, "qwc_last_position")
    return model


def prefill_nodes(model: onnx.ModelProto, query: bool = True) -> list[onnx.NodeProto] | None:
    """The graph's nodes with the last layer's query (q projection, its rotary, the attention's
    queries), o projection, MLP, final norm and head on the last position only (for the
    prefill entry point; the slices' constants are added to model's initializers, as
    last_position_logits adds them), or None where the graph does not have the shape qwc's
    passes give it. The query is left whole where its path is not QUERY_PATH's, or `query` is
    False (onnxruntime's GroupQueryAttention takes no fewer queries than keys; qwc's kernels
    do). Nodes only: a copy of the whole model would copy its weights."""
    g = onnx.GraphProto()
    g.node.extend(model.graph.node)
    g.output.extend(model.graph.output)
    prod = {o: n for n in g.node for o in n.output}
    head = prod.get("logits")
    start = _last_layer_start(g, prod, head, {i.name for i in model.graph.initializer}) if head else None
    if start is None:
        return None
    _add_constants(model.graph)
    o_proj, norm, residual = start
    query = _query_path(g, prod, prod.get(o_proj.input[0]), {i.name: i for i in model.graph.initializer}) if query else None
    if query is not None:   # the attention's output is then the last position's already
        _last_query(g, *query)
    else:
        _slice_before(g, o_proj, 0, "qwc_last_position")
    _slice_before(g, norm, residual, "qwc_last_position_residual")
    return list(g.node)


# What may lie between the last layer's q projection and its attention, position by position:
# the bias, Qwen3's QK-norm (a Reshape to heads, RMSNorm, a Reshape back), the rotary.
QUERY_PATH = {"Add", "Reshape", "SimplifiedLayerNormalization", "RotaryEmbedding"}


def _query_path(g, prod, attention, inits: dict[str, onnx.TensorProto]):
    """(q projection, its input's norm, the rotaries) of the attention feeding the last layer's
    o projection when its query comes from a linear of an RMSNorm through QUERY_PATH only,
    each op read once and reading constants besides (a Reshape's target keeping the token axis,
    a rotary's positions the graph's), else None."""
    if attention is None or attention.op_type != "GroupQueryAttention":
        return None
    readers: dict[str, int] = {}
    for n in g.node:
        for x in n.input:
            readers[x] = readers.get(x, 0) + 1
    x, rotaries = attention.input[0], []
    while True:
        n = prod.get(x)
        if n is None or readers.get(x) != 1:
            return None
        if n.op_type in LINEARS:
            break
        if n.op_type not in QUERY_PATH:
            return None
        if n.op_type == "RotaryEmbedding":
            if n.input[1] != "position_ids" or any(c not in inits for c in n.input[2:4]):
                return None
            rotaries.append(n)
            x = n.input[0]
            continue
        path = [c for c in n.input if c not in inits]
        if len(path) != 1 or (n.op_type == "Reshape" and (
                path[0] != n.input[0] or [int(d) for d in numpy_helper.to_array(inits[n.input[1]])[:2]] != [0, 0])):
            return None
        x = path[0]
    linear, norm = n, prod.get(n.input[0])
    if norm is None or norm.output[0] != linear.input[0] or _norm_operands(norm) is None:
        return None
    return linear, norm, rotaries


def _norm_operands(norm) -> tuple[str, str, float] | None:
    """(rows, gain, epsilon) of an RMSNorm node: the skip form's rows are its sum (output 3)."""
    eps = next((float(helper.get_attribute_value(a)) for a in norm.attribute if a.name == "epsilon"), 1e-5)
    if norm.op_type == "SimplifiedLayerNormalization" and len(norm.input) == 2:
        return norm.input[0], norm.input[1], eps
    if (norm.op_type == SKIP_NORM and len(norm.input) == 3 and len(norm.output) > 3 and norm.output[3]):
        return norm.output[3], norm.input[2], eps
    return None


def _last_query(g, linear, norm, rotaries) -> None:
    """The q projection reads the norm of the last position's rows (a norm of its own; k and
    v keep every position, which the cache needs) and the rotaries its position."""
    rows, gain, eps = _norm_operands(norm)
    last_rows, normed = f"{rows}_last_query", f"{linear.input[0]}_last_query"
    at = list(g.node).index(linear)
    g.node.insert(at, helper.make_node("SimplifiedLayerNormalization", [last_rows, gain], [normed],
                                       name="qwc_last_position_query_norm", axis=-1, epsilon=eps, stash_type=1))
    g.node.insert(at, helper.make_node("Slice", [rows, "qwc_last_start", "qwc_last_end", "qwc_seq_axis"], [last_rows],
                                       name="qwc_last_position_query"))
    linear.input[0] = normed
    at = min(list(g.node).index(r) for r in rotaries) if rotaries else None
    if at is not None:
        g.node.insert(at, helper.make_node("Slice", ["position_ids", "qwc_last_start", "qwc_last_end", "qwc_seq_axis"],
                                           ["position_ids_last"], name="qwc_last_position_ids"))
        for r in rotaries:
            r.input[1] = "position_ids_last"


# The step entry point's own inputs (qwc/manifest.py). Its attention nodes read the segments
# and the positions as inputs past ORT's own (GQA_STEP_INPUTS: the converter's).
STEP_SEGMENTS, STEP_LOGIT_TOKENS = STEP_INPUTS
GQA_STEP_INPUTS = 12


STEP_TOKENS_OP = "QwcStepTokens"   # x [1, t, ...], indices [L] -> [1, L, ...] (compiler/frontend.py)


def _gather_before(g, node, i: int, name: str):
    """node's input i becomes the rows at STEP_LOGIT_TOKENS of its token axis (qwc's own op,
    not ONNX's Gather, which TVM lowers with negative-index handling and no bounds)."""
    x = node.input[i]
    picked = f"{x}_picked"
    gather = helper.make_node(STEP_TOKENS_OP, [x, STEP_LOGIT_TOKENS], [picked], name=name)
    g.node.insert(list(g.node).index(node), gather)
    node.input[i] = picked


def step_nodes(model: onnx.ModelProto, nodes: list[onnx.NodeProto]) -> list[onnx.NodeProto]:
    """The step entry point's nodes, from `nodes` (the graph's, every position's logits): the
    logits of the tokens STEP_LOGIT_TOKENS names only, gathered where prefill_nodes slices
    (before the last layer's o projection and post-attention norm) or else before the head,
    and every attention reading the segments and the positions (copies: `nodes` stay)."""
    g = onnx.GraphProto()
    for n in nodes:
        c = g.node.add()
        c.CopyFrom(n)
    g.output.extend(model.graph.output)
    prod = {o: n for n in g.node for o in n.output}
    head = prod.get("logits")
    if head is None:
        raise QwcError("graph has no 'logits' output")
    start = _last_layer_start(g, prod, head, {i.name for i in model.graph.initializer})
    if start is None:
        _gather_before(g, head, 0, "qwc_step_tokens")
    else:
        o_proj, norm, residual = start
        _gather_before(g, o_proj, 0, "qwc_step_tokens")
        _gather_before(g, norm, residual, "qwc_step_tokens_residual")
    for n in g.node:
        if n.op_type == "GroupQueryAttention":
            if len(n.input) > GQA_STEP_INPUTS:
                raise QwcError(f"{n.name}: GroupQueryAttention with {len(n.input)} inputs (qwc reads up to "
                               f"{GQA_STEP_INPUTS})")
            n.input.extend([""] * (GQA_STEP_INPUTS - len(n.input)) + [STEP_SEGMENTS, "position_ids"])
    return list(g.node)


def hidden_state_nodes(nodes: list[onnx.NodeProto]) -> list[onnx.NodeProto]:
    """`nodes` (an entry point's) with the head replaced by an Identity of its input, so that
    the graph's 'logits' output carries the final norm's states [1, seq, hidden] instead: the
    embed entry points (runtime/embeddings.py). Copies: `nodes` stay."""
    g = onnx.GraphProto()
    for n in nodes:
        c = g.node.add()
        c.CopyFrom(n)
    head = next((n for n in g.node if "logits" in n.output), None)
    if head is None:
        raise QwcError("graph has no 'logits' output")
    head.CopyFrom(helper.make_node("Identity", [head.input[0]], ["logits"], name="qwc_hidden_states"))
    return list(g.node)


def _last_layer_start(g, prod, head, inits: set[str]):
    """(o projection, post-attention norm, index of the norm's residual input) of the last
    layer when everything from them to the head is position-wise and reads nothing else of
    full length: o_proj -> SkipNorm(residual, o) -> MLP -> SkipNorm(its sum, down) -> head."""
    readers: dict[str, list] = {}
    for n in g.node:
        for x in n.input:
            readers.setdefault(x, []).append(n)
    outputs = {o.name for o in g.output}
    final = prod.get(head.input[0])
    if final is None or final.op_type != SKIP_NORM or final.output[0] != head.input[0]:
        return None
    norm = prod.get(final.input[0])
    if norm is None or norm.op_type != SKIP_NORM or len(norm.output) < 4 or norm.output[3] != final.input[0]:
        return None
    branch = [i for i in (0, 1) if (p := prod.get(norm.input[i])) is not None and p.op_type in LINEARS
              and len(readers.get(norm.input[i], [])) == 1]
    if len(branch) != 1:
        return None
    o_proj = prod[norm.input[branch[0]]]
    attn = o_proj.input[0]
    if len(readers.get(attn, [])) != 1 or attn in outputs:
        return None
    # the nodes between the norm and the head: position-wise ops reading only each other,
    # constants and the norm's outputs, none of them a graph output
    between, frontier = {id(norm)}, [o for o in norm.output if o]
    allowed = {*LINEARS, "Sigmoid", "Mul", "Add", SKIP_NORM}
    made = set(frontier)
    while frontier:
        x = frontier.pop()
        for n in readers.get(x, []):
            if id(n) in between or n is head:
                continue
            if n.op_type not in allowed or any(o in outputs for o in n.output if o):
                return None
            between.add(id(n))
            made.update(o for o in n.output if o)
            frontier.extend(o for o in n.output if o)
    if id(final) not in between:
        return None
    for n in g.node:
        if id(n) in between and n is not norm:
            if any(x and x not in made and x not in inits for x in n.input):
                return None
    return o_proj, norm, 1 - branch[0]
