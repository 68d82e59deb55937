"""The residual add into the decode GEMV that produces its other operand.

A decode step's o and down projections are the skip input of the residual add (ONNX's
SkipSimplifiedLayerNormalization). When such a projection is a decode GEMV without a bias
(kernels.decode_gemv: x86/vnni.py, arm/dotprod.py), this pass replaces `r + y` by the same
GEMV with r as its bias, added in the epilogue: one kernel launch and one [1, N] round trip
fewer a projection. The GEMV without the add is left to dead-code elimination.

Where it runs: first of the import-time fusions (frontend.import_graph), before
fuse_quantizer_inputs, so the next RMSNorm's quantizer reads the GEMV's output directly (it
looks through reshapes to find rows: a reshape of this pass's output would be two reshapes in
a row, which lower to a copy kernel).
"""

from __future__ import annotations

from tvm import relax
from tvm_ffi import structural_equal

from .kernels import DECODE_GEMV, decode_gemv, gemv_dot, gemv_prefetch, weight_args
from .relax_match import Bindings, binding_pass, call_args, call_of, kernel_attr


def single_decode_gemv(mod, defs: Bindings, x, bias: bool = False):
    """(kernel GlobalVar, args) when x is (a reshape of) the output of one decode GEMV
    without a bias (with one: `bias`), else None."""
    e = defs.value(x)
    if call_of(e, "relax.reshape"):
        e = defs.value(e.args[0])
    if not call_of(e, "relax.call_tir") or not kernel_attr(mod, e, DECODE_GEMV):
        return None
    args = call_args(e)
    outputs = weight_args(args)
    return (e.args[0], args) if len(outputs) == 1 and outputs[0][1] == bias else None


def _rewrite(mod, defs: Bindings):
    def rewrite(rw, binding):
        e = binding.value
        if not call_of(e, "relax.add"):
            return None
        for y, r in (e.args[::-1], e.args):
            gemv = single_decode_gemv(mod, defs, y)
            if gemv is not None and structural_equal(y.ty.shape, r.ty.shape):
                break
        else:
            return None
        gv, args = gemv
        n, nb, sdt = int(y.ty.shape[-1]), int(args[3].ty.shape[1]), str(args[4].ty.dtype)
        has_c = weight_args(args)[0][0]   # Q4_1's block offsets, before the bias
        kernel = rw.builder_.add_func(decode_gemv(((n, True, has_c),), nb, sdt, dot=gemv_dot(mod[gv]),
                                                  prefetch=gemv_prefetch(mod[gv])),
                                      gv.name_hint + "_bias")
        bias = rw.emit(relax.op.reshape(rw.unreshaped(r), [n]))
        out = rw.emit(relax.call_tir(kernel, [rw.var(a) for a in args] + [bias],
                                     relax.TensorType(shape=[1, n], dtype="float32")))
        return rw.emit(relax.op.reshape(out, y.ty.shape))
    return rewrite


fuse_residual_gemv = binding_pass("qwc.FuseResidualGEMV", _rewrite)
