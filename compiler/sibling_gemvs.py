"""One parallel launch for the decode GEMVs that read the same quantized activations.

After common-subexpression elimination, q, k and v share one activation quantizer; their
GEMVs are still separate launches, each paying a fork/join and a cold start of its memory
streams, and k and v (64 KiB of weights each) are too small to reach the memory's speed on
their own. This pass replaces each such set, within a dataflow block, by one call of an
n-output kernel (kernels.decode_gemv: x86/vnni.py, arm/dotprod.py) at the place of the
first, the others reading their output from its tuple. (On x86, gate and up already are one
GEMV that writes silu(gate) * up: fuse_gate_up.py, run at import; on ARM they are merged
here, as q, k and v.)
"""

from __future__ import annotations

import tvm
from tvm import relax

from .kernels import DECODE_GEMV, decode_gemv, dot_bits, gemv_dot, gemv_prefetch, weight_args


def _gemv_call(mod, value):
    """(callee, args) when `value` is a call_tir of a single-output decode_gemv kernel."""
    if not (isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) and value.op.name == "relax.call_tir"):
        return None
    callee = value.args[0]
    func = mod[callee] if isinstance(callee, tvm.ir.GlobalVar) and callee in mod.functions else None
    if not isinstance(func, tvm.tirx.PrimFunc) or not (func.attrs and func.attrs.get(DECODE_GEMV)):
        return None
    if not isinstance(value.ty, relax.TensorType):   # already an n-output call
        return None
    return callee, list(value.args[1].fields)


@relax.expr_functor.mutator
class _Merger(relax.PyExprMutator):
    def __init__(self, mod, groups):
        super().__init__(mod)
        self.mod_ = mod
        self.groups = groups      # first member's var -> [binding, ...] of the set
        self.merged = {}          # member var -> (merged tuple var, index)

    def visit_var_binding_(self, binding):
        var = binding.var
        if var in self.groups:
            members = self.groups[var]
            first, first_args = _gemv_call(self.mod_, members[0].value)
            args = [self.visit_expr(a) for a in first_args[:3]]
            outputs, out_types = [], []
            for b in members:
                _, margs = _gemv_call(self.mod_, b.value)
                w, s = margs[3], margs[4]
                n = int(b.var.ty.shape[1])
                (has_c, has_bias), = weight_args(margs)
                outputs.append((n, has_bias, has_c))
                args += [self.visit_expr(a) for a in margs[3:]]
                out_types.append(relax.TensorType([1, n], "float32"))
            nb, sdt = int(w.ty.shape[1]), str(s.ty.dtype)
            dot = gemv_dot(self.mod_[first])
            kernel = decode_gemv(tuple(outputs), nb, sdt, dot=dot, prefetch=gemv_prefetch(self.mod_[first]))
            stem = f"q{dot_bits(dot)}_gemv"
            prefix = first.name_hint.split(stem)[0]   # "decode_"
            name = f"{prefix}{stem}_{dot}_" + "_".join(str(o[0]) for o in outputs) + f"x{nb}_{sdt}"
            gv = self.builder_.add_func(kernel, name)
            tup = self.builder_.emit(relax.call_tir(gv, args, out_types))
            for i, b in enumerate(members):
                self.merged[b.var] = (tup, i)
        if var in self.merged:
            tup, i = self.merged[var]
            self.set_var_remap(var, self.builder_.emit(relax.TupleGetItem(tup, i)))
            return
        super().visit_var_binding_(binding)


def _sets(mod, func) -> dict:
    """First member's var -> the bindings of each set of >= 2 decode GEMVs in one dataflow
    block reading the same activations (args 0-2) with scales of one dtype and one kernel
    (`dot`: a Q8_0 GEMV does not join Q4_0 ones), weights and bias being function params (so
    the merged call may move to the first member's place)."""
    params = set(func.params)
    out = {}
    for block in func.body.blocks:
        if not isinstance(block, relax.DataflowBlock):
            continue
        by_input = []
        for b in block.bindings:
            call = isinstance(b, relax.VarBinding) and isinstance(b.var, relax.DataflowVar) and _gemv_call(mod, b.value)
            if not call or not all(a in params for a in call[1][3:]) or int(b.var.ty.shape[0]) != 1:
                continue
            key = call[1][:3]
            for k, members in by_input:
                same_scales = str(members[0].value.args[1].fields[4].ty.dtype) == str(call[1][4].ty.dtype)
                same_kernel = all(f(mod[members[0].value.args[0]]) == f(mod[call[0]]) for f in (gemv_dot, gemv_prefetch))
                if same_scales and same_kernel and all(x.same_as(y) for x, y in zip(k, key)):
                    members.append(b)
                    break
            else:
                by_input.append((key, [b]))
        for _, members in by_input:
            if len(members) > 1:
                out[members[0].var] = members
    return out


@tvm.transform.module_pass(opt_level=0, name="qwc.MergeSiblingGEMVs")
def merge_sibling_gemvs(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    for gv, func in list(mod.functions_items()):
        if not isinstance(func, relax.Function):
            continue
        sets = _sets(mod, func)
        if not sets:
            continue
        merger = _Merger(mod, sets)
        new = merger.visit_expr(func)
        mod = merger.builder_.finalize()
        mod[gv] = new
    return mod

