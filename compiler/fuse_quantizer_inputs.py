"""RMSNorm and SiLU·mul into the activation quantizer that reads their output.

The W4A8 matmuls quantize their input per 32-block (kernels/act_quant.py). When that input
is RMSNorm(x) * gamma (every q/k/v and gate/up projection) or silu(gate) * up (every down
projection), this pass gives the quantizer x and gamma, or gate and up, and it computes the
norm or the SiLU·mul itself: the normalized row and the MLP's hidden state are never stored,
and their kernels (a parallel launch each) are left to dead-code elimination.

Where it runs: in the import-time fusions (frontend.import_graph) after fuse_residual_gemv
(whose output the next norm reads) and before fuse_gate_up and fuse_decode_attention, which
look for the quantizers it writes. Prefill and decode, every ISA with W4A8 kernels.
"""

from __future__ import annotations

from tvm import relax
from tvm_ffi import structural_equal

from .kernels import act_quant
from .relax_match import Bindings, binding_pass, call_args, call_of, kernel_attr


def rms_norm_operands(defs: Bindings, a, k: int):
    """(x, gamma, eps) when `a` is RMSNorm over its last axis (K) with a [K] gamma, else None.
    A slice that keeps a's shape is looked through: the last position's slice in front of
    the head (passes/last_position.py), which a decode step's one position (and prefill's,
    whose last layer is already cut to it) makes the identity; else the final norm would
    stay a kernel of its own, and serial, before a plain quantizer."""
    e = defs.value(a)
    if call_of(e, "relax.strided_slice") and structural_equal(e.args[0].ty.shape, a.ty.shape):
        e = defs.value(e.args[0])
    if not call_of(e, "relax.nn.rms_norm"):
        return None
    x, gamma = e.args
    rank = len(x.ty.shape)
    if ([int(ax) % rank for ax in e.attrs.axes] != [rank - 1] or [int(d) for d in gamma.ty.shape] != [k]
            or str(x.ty.dtype) != "float32" or str(gamma.ty.dtype) != "float32"):
        return None
    return x, gamma, float(e.attrs.epsilon)


def silu_mul_operands(defs: Bindings, a):
    """(gate, up) when `a` is silu(gate) * up as the exporter writes it, Mul(Mul(g,
    Sigmoid(g)), up) in either operand order and without broadcasting; else None."""
    e = defs.value(a)
    if not call_of(e, "relax.multiply"):
        return None
    for silu, up in (e.args, e.args[::-1]):
        se = defs.value(silu)
        if not call_of(se, "relax.multiply"):
            continue
        for g, sig in (se.args, se.args[::-1]):
            sg = defs.value(sig)
            if (call_of(sg, "relax.sigmoid") and sg.args[0].same_as(g)
                    and structural_equal(g.ty.shape, a.ty.shape)
                    and structural_equal(up.ty.shape, a.ty.shape)):
                return g, up
    return None


def rows(rw, x, k: int):
    """x as [M, K] rows, reshaped once from what reshapes made x from: two reshapes in a row
    lower to a copy kernel, one is a view."""
    x = rw.unreshaped(x)
    if len(x.ty.shape) == 2 and getattr(x.ty.shape[1], "value", None) == k:
        return x
    return rw.emit(relax.op.reshape(x, [-1, k]))


def fuse_quantizer_inputs(kname):
    """The pass; `kname` names a kernel in this entry point (frontend.ImportContext.kname)."""

    def make(mod, defs: Bindings):
        def rewrite(rw, binding):
            mark = kernel_attr(mod, binding.value, act_quant.QUANTIZER)
            if mark is None or mark["kind"] != "plain":
                return None
            a2 = call_args(binding.value)[0]    # [M, K]: a reshape of the matmul's input
            e = defs.value(a2)
            a = e.args[0] if call_of(e, "relax.reshape") else a2
            k = int(a2.ty.shape[1])
            silu, rms = silu_mul_operands(defs, a), rms_norm_operands(defs, a, k)
            if silu is None and rms is None:
                return None
            one_row = getattr(a2.ty.shape[0], "value", None) == 1
            zp, layout = int(mark["zero_point"]), str(mark["layout"])
            kind = "silu_mul" if silu else "rms"
            sb = act_quant.marked_super_blocks(mark)
            kernel = act_quant.fused_quantizer(k, zp, one_row, silu is not None, rms[2] if rms else None, layout,
                                               super_blocks=sb)
            gv = rw.builder_.add_func(kernel, kname(act_quant.quantizer_name(k, zp, one_row, kind, layout, sb)))
            inputs = [rows(rw, x, k) for x in silu] if silu else [rows(rw, rms[0], k), rw.var(rms[1])]
            return rw.emit(relax.call_tir(gv, inputs, list(binding.var.ty.fields)))
        return rewrite

    return binding_pass("qwc.FuseQuantizerInputs", make)
