"""Decode's gate and up GEMVs, SiLU·mul and the down projection's quantizer as one kernel.

After fuse_quantizer_inputs, the down projection's quantizer reads gate and up [1, K] and
computes silu(gate) * up itself. When gate and up are x86 decode GEMVs without biases of the
same activations and K is whole 32-blocks (every Qwen2 size), this pass replaces the
quantizer by one GEMV over both weights that computes silu(gate) * up in its epilogue and
writes its Q8_0 blocks (kernels/x86/vnni.py: decode_gemv with silu_mul and quantize): the
hidden state is never stored and the gate and up GEMVs are left to dead-code elimination.

Where it runs: in the import-time fusions (frontend.import_graph) after
fuse_quantizer_inputs, and before the CPU pipeline's merge_sibling_gemvs, which would
otherwise make gate and up one two-output launch without the fused epilogue.
"""

from __future__ import annotations

from tvm import relax

from .fuse_residual_gemv import single_decode_gemv
from .kernels import act_quant, decode_epilogues, decode_gemv, dot_bits, gemv_dot, gemv_prefetch, weight_args
from .relax_match import Bindings, binding_pass, call_args, call_of, kernel_attr


def gate_up_arguments(mod, defs: Bindings, gate, up):
    """([aq, ad, off, w_gate, s_gate, w_up, s_up], the GEMVs' `dot`, their prefetch) when gate and
    up are bias-free decode GEMV outputs of the same activations whose kernel has the silu_mul and
    quantize epilogues (x86), else None (on ARM, gate and up become one two-output launch in
    sibling_gemvs, and the quantizer stays its own)."""
    calls, forms = [], set()   # (dot, prefetch) of each GEMV kernel
    for x in (gate, up):
        gemv = single_decode_gemv(mod, defs, x)
        if gemv is None:
            return None
        calls.append(gemv[1])
        forms.add((gemv_dot(mod[gemv[0]]), gemv_prefetch(mod[gemv[0]])))
    if len(forms) != 1 or not {"silu_mul", "quantize"} <= decode_epilogues(next(iter(forms))[0]):
        return None   # (the ARM GEMV has no such epilogue)
    if str(calls[0][4].ty.dtype) != str(calls[1][4].ty.dtype):
        return None   # one kernel reads one scale form (fp16, float32, Q4_K's compact bytes)

    def source(aq):   # the tensor the quantizer of `aq` read, reshapes looked through
        parts = defs.value(defs.value(aq).tuple_value)
        a2 = defs.value(call_args(parts)[0])
        return a2.args[0] if call_of(a2, "relax.reshape") else a2

    if not source(calls[0][0]).same_as(source(calls[1][0])):
        return None
    return calls[0] + calls[1][3:], *forms.pop()


def fuse_gate_up(kname):
    """The pass; `kname` names a kernel in this entry point (frontend.ImportContext.kname)."""

    def make(mod, defs: Bindings):
        def rewrite(rw, binding):
            mark = kernel_attr(mod, binding.value, act_quant.QUANTIZER)
            if mark is None or mark["kind"] != "silu_mul":
                return None
            gate, up = call_args(binding.value)
            k = int(gate.ty.shape[1])
            if getattr(gate.ty.shape[0], "value", None) != 1 or k % act_quant.BLOCK:
                return None
            found = gate_up_arguments(mod, defs, gate, up)
            if found is None:
                return None
            args, dot, prefetch = found
            nb = int(args[3].ty.shape[1])
            (c_gate, _), (c_up, _) = weight_args(args)   # Q4_1's block offsets, where they have them
            kernel = decode_gemv(((k, False, c_gate), (k, False, c_up)), nb, str(args[4].ty.dtype), silu_mul=True,
                                 quantize=int(mark["zero_point"]), dot=dot, prefetch=prefetch)
            gv = rw.builder_.add_func(kernel, kname(f"q{dot_bits(dot)}_gemv_{dot}_silu_mul_q8_{k}x{nb}"))
            return rw.emit(relax.call_tir(gv, [rw.var(a) for a in args], list(binding.var.ty.fields)))
        return rewrite

    return binding_pass("qwc.FuseGateUp", make)
