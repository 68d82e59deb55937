"""Registers with onnx the schema of the onnxruntime op qwc emits in the default domain.

onnxruntime registers SimplifiedLayerNormalization in the default ONNX domain (not
com.microsoft), where onnx's checker knows no such op. Registering its schema (as
onnxruntime defines it) lets `onnx.checker` validate canonical graphs. Ops in
com.microsoft need nothing: the checker does not check custom domains.
"""

from __future__ import annotations

import onnx
from onnx.defs import OpSchema

_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    _registered = True
    if onnx.defs.has("SimplifiedLayerNormalization", ""):
        return
    schema = OpSchema(
        "SimplifiedLayerNormalization", "", 1,
        doc="onnxruntime's RMSNorm: Y = X / sqrt(mean(X^2, axis) + epsilon) * scale.",
        inputs=[
            OpSchema.FormalParameter("X", "T"),
            OpSchema.FormalParameter("scale", "V"),
        ],
        outputs=[
            OpSchema.FormalParameter("Y", "V"),
            OpSchema.FormalParameter("inv_std_var", "U", param_option=OpSchema.FormalParameterOption.Optional),
        ],
        type_constraints=[
            ("T", ["tensor(float)", "tensor(float16)", "tensor(double)", "tensor(bfloat16)"], "input"),
            ("U", ["tensor(float)", "tensor(double)"], "statistics"),
            ("V", ["tensor(float)", "tensor(float16)", "tensor(double)", "tensor(bfloat16)"], "output"),
        ],
        attributes=[
            OpSchema.Attribute("axis", onnx.helper.make_attribute("axis", -1), "normalized axis"),
            OpSchema.Attribute("epsilon", onnx.helper.make_attribute("epsilon", 1e-5), "epsilon"),
            OpSchema.Attribute("stash_type", onnx.helper.make_attribute("stash_type", 1), "statistics type"),
        ],
    )
    onnx.defs.register_schema(schema)
