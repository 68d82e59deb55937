"""What the import-time fusion passes share: reading what a Relax var was bound to, and a
mutator that replaces bindings one at a time.

The passes (fuse_residual_gemv, fuse_quantizer_inputs, fuse_gate_up, fuse_decode_attention)
run on one entry point's module right after the ONNX import (frontend.import_graph). Each
matches on the function as imported (`Bindings`), emits the fused calls in place of the
binding they replace, and leaves the calls they made unused to DeadCodeElimination (run by
the CPU pipeline, compiler/schedule.py).
"""

from __future__ import annotations

import functools

import tvm
from tvm import relax


def call_of(e, name: str) -> bool:
    """Whether e is a call of the Relax op `name` ("relax.reshape", "relax.call_tir", ...)."""
    return isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op) and e.op.name == name


def kernel_attr(mod: tvm.IRModule, call, key: str):
    """The attribute `key` of the PrimFunc a call_tir / call_tir_inplace calls, else None."""
    if not (call_of(call, "relax.call_tir") or call_of(call, "relax.call_tir_inplace")):
        return None
    gv = call.args[0]
    if not isinstance(gv, tvm.ir.GlobalVar) or gv not in mod.functions:
        return None
    func = mod[gv]
    if not isinstance(func, tvm.tirx.PrimFunc) or not func.attrs:
        return None
    return func.attrs.get(key)


def call_args(call) -> list:
    """The tensor arguments of a call_tir / call_tir_inplace."""
    return list(call.args[1].fields)


def static_dims(x) -> list:
    """x's shape as ints (None for a symbolic dim)."""
    return [getattr(d, "value", None) for d in x.ty.shape]


class Bindings:
    """Var -> the value it was bound to, over every block of one function as imported."""

    def __init__(self, func: relax.Function):
        self.func = func
        self.values = {}
        self.order = {}     # var -> its binding's position
        for block in func.body.blocks:
            for b in block.bindings:
                if isinstance(b, relax.VarBinding):
                    self.values[b.var] = b.value
                    self.order[b.var] = len(self.order)

    @functools.cached_property
    def uses(self) -> dict:
        """Var -> how many bindings (and the function's result) read it; counted on first use."""
        uses = {}
        for e in [*self.values.values(), self.func.body.body]:
            for v in relax.analysis.all_vars(e):
                uses[v] = uses.get(v, 0) + 1
        return uses

    def value(self, x):
        """What x was bound to (x itself if it is not a bound var)."""
        return self.values.get(x, x) if isinstance(x, relax.Var) else x

    def unreshaped(self, x):
        """The tensor a chain of reshapes made x from (x itself if none)."""
        e = self.value(x)
        while call_of(e, "relax.reshape"):
            x, e = e.args[0], self.value(e.args[0])
        return x


@relax.expr_functor.mutator
class BindingRewriter(relax.PyExprMutator):
    """Visits a function's bindings in order; `rewrite(self, binding)` returns the var that
    replaces binding.var (after emitting what computes it with self.builder_), `False` to drop
    the binding (a later rewrite replaces its readers), or None to keep it."""

    def __init__(self, mod, rewrite):
        super().__init__(mod)
        self.mod_ = mod
        self.rewrite = rewrite

    def visit_var_binding_(self, binding):
        new = self.rewrite(self, binding)
        if new is None:
            super().visit_var_binding_(binding)
        elif new is not False:
            self.set_var_remap(binding.var, new)

    def emit(self, expr):
        return self.builder_.emit(expr)

    def var(self, x):
        """x with the earlier rewrites applied."""
        return self.visit_expr(x)

    def unreshaped(self, x):
        """The tensor a chain of reshapes made x from, the earlier rewrites applied (one may
        have replaced x by a reshape)."""
        x = self.var(x)
        e = self.builder_.lookup_binding(x) if isinstance(x, relax.Var) else None
        while call_of(e, "relax.reshape"):
            x = e.args[0]
            e = self.builder_.lookup_binding(x) if isinstance(x, relax.Var) else None
        return x


def binding_pass(name: str, make_rewrite):
    """A module pass that runs each Relax function through a BindingRewriter with the rewrite
    make_rewrite(mod, Bindings of the function) returns."""
    def run(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        for gv, func in list(mod.functions_items()):
            if not isinstance(func, relax.Function):
                continue
            rewriter = BindingRewriter(mod, make_rewrite(mod, Bindings(func)))
            new = rewriter.visit_expr(func)
            mod = rewriter.builder_.finalize()
            mod[gv] = new
        return mod

    return tvm.transform.module_pass(run, opt_level=0, name=name)
