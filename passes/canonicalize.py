"""Canonicalize: Constant nodes to initializers, Identity removal, constant folding of shape
arithmetic, dead-code removal, topological order, shape inference.

Folding is limited to small results (`options.fold_limit` elements): shape arithmetic folds,
while a Transpose of a large weight (a tied lm_head) stays, so no weight is duplicated.
"""

from __future__ import annotations

import warnings

import numpy as np
import onnx
from onnx import numpy_helper, shape_inference
from onnx.reference import ReferenceEvaluator

from .graph import Graph, tensor_view
from .options import PassOptions

# Ops that are deterministic and cheap to evaluate on constants.
_FOLDABLE = {
    "Add", "Sub", "Mul", "Div", "Neg", "Sqrt", "Reciprocal", "Pow", "Cast", "Concat", "Gather",
    "Reshape", "Squeeze", "Unsqueeze", "Slice", "Range", "Equal", "Where", "Less", "LessOrEqual",
    "Greater", "GreaterOrEqual", "And", "Or", "Not", "Max", "Min", "Expand", "ConstantOfShape",
    "Shape", "Size", "Transpose", "Floor", "Ceil", "Abs", "ReduceProd", "ReduceSum", "Tile",
    "Cos", "Sin", "Exp", "Mod", "Flatten", "ScatterND", "Trilu", "CumSum",
}


def run(model: onnx.ModelProto, options: PassOptions | None = None) -> onnx.ModelProto:
    options = options or PassOptions()
    g = Graph(model)
    _constants_to_initializers(g)
    g.commit()
    model = infer_shapes(model)
    g = Graph(model)
    _remove_identities(g)
    _retie_embedding(g)
    g.commit()
    g = Graph(model)
    for _ in range(8):  # folding a Shape can enable more folding downstream
        changed = _fold_static_shapes(g) | _fold_constants(g, options.fold_limit)
        g.commit()
        if not changed:
            break
        model = infer_shapes(model)
        g = Graph(model)
    return infer_shapes(model)


def infer_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    """onnx shape inference on the graph's structure: large initializers are replaced by
    typed graph inputs first, so models past protobuf's 2 GB limit infer as well (and fast).
    The inferred value_info is copied back onto `model`."""
    skeleton = onnx.ModelProto()
    skeleton.ir_version = model.ir_version
    skeleton.opset_import.extend(model.opset_import)
    sg = skeleton.graph
    sg.node.extend(model.graph.node)
    sg.input.extend(model.graph.input)
    sg.output.extend(model.graph.output)
    for t in model.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL or len(t.raw_data) > (1 << 16):
            sg.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
        else:
            sg.initializer.append(t)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            inferred = shape_inference.infer_shapes(skeleton, check_type=False, strict_mode=False,
                                                    data_prop=True)
        except Exception:
            return model  # inference is an aid, never a requirement
    del model.graph.value_info[:]
    model.graph.value_info.extend(inferred.graph.value_info)
    return model


def _constants_to_initializers(g: Graph) -> None:
    for n in list(g.g.node):
        if n.op_type == "Constant" and n.domain in ("", "ai.onnx"):
            v = g.const(n.output[0])
            if v is None:
                continue
            t = numpy_helper.from_array(np.asarray(v), n.output[0])
            g.remove_node(n)
            g.g.initializer.append(t)
            g.inits[t.name] = t


def _remove_identities(g: Graph) -> None:
    """Identity, single-input Concat and a Cast to the type its input already has."""
    for n in list(g.g.node):
        if n.domain not in ("", "ai.onnx") or n.output[0] in g.graph_outputs:
            continue
        if n.op_type == "Identity" or (n.op_type == "Concat" and len(n.input) == 1) or (
                n.op_type == "Cast" and g.elem_type(n.input[0]) == g.attr(n, "to")):
            g.remove_node(n)
            g.rename_uses(n.output[0], n.input[0])


def _retie_embedding(g: Graph) -> None:
    """Some exporters store a tied lm_head as its own, transposed copy of the embedding.
    Point that MatMul back at Transpose(embedding), so the file keeps one copy and the
    embedding pass quantizes both uses from the same bytes."""
    for gather in list(g.g.node):
        if gather.op_type != "Gather" or gather.input[0] not in g.inits:
            continue
        dims = list(g.inits[gather.input[0]].dims)
        if len(dims) != 2:
            continue
        for mm in list(g.g.node):
            if mm.op_type != "MatMul" or mm.input[1] not in g.inits:
                continue
            if list(g.inits[mm.input[1]].dims) != dims[::-1]:
                continue
            # Memory maps (for a lazily loaded graph), a corner first: an untied 7B's head and
            # embedding are 2.2 GB each and differ at once.
            e, w = tensor_view(g.inits[gather.input[0]]), tensor_view(g.inits[mm.input[1]])
            tied = np.array_equal(w[:, :4], e[:4].T) and all(
                np.array_equal(w[:, r:r + 4096], e[r:r + 4096].T) for r in range(0, dims[0], 4096))
            del e, w
            if not tied:
                continue
            tr = g.fresh(gather.input[0] + "_T")
            g.node("Transpose", [gather.input[0]], [tr], perm=[1, 0])
            mm.input[1] = tr


def _fold_static_shapes(g: Graph) -> bool:
    changed = False
    for n in list(g.g.node):
        if n.op_type != "Shape" or n.domain not in ("", "ai.onnx") or g.const(n.output[0]) is not None:
            continue
        dims = g.static_dims(n.input[0])
        if dims is None:
            continue
        start, end = g.attr(n, "start", 0), g.attr(n, "end", None)
        sel = dims[slice(start, end)]
        if sel and all(d is not None for d in sel):
            _replace_with_constant(g, n, [np.array(sel, np.int64)])
            changed = True
    return changed


def _fold_constants(g: Graph, limit: int) -> bool:
    changed = False
    for n in list(g.g.node):
        if n.domain not in ("", "ai.onnx") or n.op_type not in _FOLDABLE:
            continue
        if any(o in g.graph_outputs for o in n.output):
            continue
        # Only fold when inputs and results stay small: shape arithmetic, not weights.
        # Sizes come from initializer dims, so no large tensor is ever decoded here.
        sizes = [_const_size(g, i) for i in n.input if i]
        if any(sz is None for sz in sizes) or sum(sizes) > limit:
            continue
        vals = [g.const(i) if i else None for i in n.input]
        try:
            outs = ReferenceEvaluator(n).run(None, {i: v for i, v in zip(n.input, vals) if i})
        except Exception:
            continue
        if any(np.asarray(o).size > limit for o in outs):
            continue
        _replace_with_constant(g, n, [np.asarray(o) for o in outs])
        changed = True
    return changed


def _const_size(g: Graph, name: str) -> int | None:
    """Element count of a constant input, or None if it is not a constant."""
    t = g.inits.get(name)
    if t is not None:
        return int(np.prod(t.dims)) if len(t.dims) else 1
    v = g.const(name)  # Constant nodes are small by construction here
    return None if v is None else int(v.size)


def _replace_with_constant(g: Graph, n: onnx.NodeProto, values: list[np.ndarray]) -> None:
    g.remove_node(n)
    for name, v in zip(n.output, values):
        if not name:
            continue
        t = numpy_helper.from_array(np.ascontiguousarray(v), name)
        g.g.initializer.append(t)
        g.inits[name] = t
