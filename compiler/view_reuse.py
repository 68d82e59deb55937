"""One tensor object per planned buffer view: fewer VM instructions between kernels.

After static memory planning every kernel output is `R.memory.alloc_tensor(storage, offset,
shape, dtype)` on one of a few planned storages, and the VM runs each as a builtin that builds
a new tensor object, then another to drop it after its last use, besides the tuple it builds for
each multi-output call and the reshapes of outputs. A 0.5B decode step ran ~1,380 of these
against 171 kernel calls, one at a time on the calling thread while the other threads waited.

The views one layer makes are the views the last layer made (same storage, offset, shape and
dtype): this pass keeps the first of each and has later ones use it, likewise for a reshape of
one tensor to one shape, reads tuple fields straight from the tuple's parts, and drops the
bindings nothing reads any more. Memory is unchanged: the planner decided which values share
a storage; a view names the same bytes whichever instruction built it.

The same holds where a shape has symbolic sizes (prefill's and verify's `seq`, decode_batch's
`batch`): in one call `seq` has one value, so two views of one storage, offset and shape
expression are one tensor. Without that, a 2-token verify call of SmolLM2 ran ~3,000 VM
builtins (a `make_shape` for each view and reshape, the view, its drop) against 511 kernels,
a visible part of the call (docs/history/arm.md).

It runs after `LowerAllocTensor`, before `KillAfterLastUse` (which then drops each view once,
after its last layer), on functions without branches (all of qwc's).
"""

from __future__ import annotations

import tvm
from tvm import relax


def _shape_key(expr):
    """A ShapeExpr's dims as a key: ints, and the text of symbolic ones (unique in a function
    whose symbolic variables have distinct names: reuse_views checks); else None."""
    if not isinstance(expr, relax.ShapeExpr):
        return None
    return tuple(int(v.value) if isinstance(v, tvm.tirx.IntImm) else ("sym", str(v)) for v in expr.values)


def _is_op(value, name: str) -> bool:
    return isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) and value.op.name == name


def _view_key(value):
    """A key equal for two bindings that build the same view, else None."""
    if _is_op(value, "relax.memory.alloc_tensor"):
        storage, offset, shape = value.args[:3]
        dims = _shape_key(shape)
        if isinstance(storage, relax.Var) and isinstance(offset, tvm.tirx.IntImm) and dims is not None:
            rest = tuple(str(a) for a in value.args[3:])   # dtype, device index
            return ("alloc", storage, int(offset.value), dims, rest)
    if _is_op(value, "relax.reshape"):
        x, shape = value.args
        dims = _shape_key(shape)
        if isinstance(x, relax.Var) and dims is not None:
            return ("reshape", x, dims)
    return None


@relax.expr_functor.mutator
class _Reuse(relax.PyExprMutator):
    def __init__(self, mod):
        super().__init__(mod)
        self.views = {}    # _view_key -> the var that built it first
        self.tuples = {}   # var bound to a tuple literal -> its (remapped) fields

    def visit_var_binding_(self, binding):
        value = self.visit_expr(binding.value)   # with the earlier bindings' remaps applied
        key = _view_key(value)
        if key is not None and key in self.views:
            self.set_var_remap(binding.var, self.views[key])
            return
        if isinstance(value, relax.Var) and (isinstance(binding.var, relax.DataflowVar)
                                             or not isinstance(value, relax.DataflowVar)):
            self.set_var_remap(binding.var, value)   # an alias: its readers read the value
            return
        if isinstance(value, relax.TupleGetItem) and isinstance(value.tuple_value, relax.Var) \
                and value.tuple_value in self.tuples:
            field = self.tuples[value.tuple_value][value.index]
            if isinstance(field, relax.Var):
                self.set_var_remap(binding.var, field)
                return
        if isinstance(value, relax.Tuple):
            self.tuples[binding.var] = list(value.fields)
        if key is not None:
            self.views[key] = binding.var
        super().visit_var_binding_(binding)


@relax.expr_functor.visitor
class _Uses(relax.PyExprVisitor):
    def __init__(self):
        super().__init__()
        self.used = set()

    def visit_var_(self, var):
        self.used.add(var)

    def visit_dataflow_var_(self, var):
        self.used.add(var)


def _drop_unread(func: relax.Function) -> relax.Function:
    """Drops bindings of tuples, tuple fields and aliases that nothing reads (pure values the
    VM would still build)."""
    while True:
        uses = _Uses()
        uses.visit_expr(func)
        blocks, dropped = [], 0
        for block in func.body.blocks:
            keep = [b for b in block.bindings
                    if not (isinstance(b, relax.VarBinding) and b.var not in uses.used
                            and isinstance(b.value, (relax.Tuple, relax.TupleGetItem, relax.Var)))]
            dropped += len(block.bindings) - len(keep)
            blocks.append(type(block)(keep) if isinstance(block, relax.DataflowBlock) else relax.BindingBlock(keep))
        if not dropped:
            return func
        func = relax.Function(func.params, relax.SeqExpr(blocks, func.body.body), func.ret_ty,
                              func.is_pure, func.attrs, func.span)


def _names_unique(func: relax.Function) -> bool:
    """No two of func's symbolic size variables share a name (shape keys are their text)."""
    names = [v.name for v in relax.analysis.defined_symbolic_vars(func)]
    return len(names) == len(set(names))


def _has_branches(func: relax.Function) -> bool:
    found = []
    relax.analysis.post_order_visit(func, lambda e: found.append(1) if isinstance(e, relax.If) else None)
    return bool(found)


@tvm.transform.module_pass(opt_level=0, name="qwc.ReuseViews")
def reuse_views(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    for gv, func in list(mod.functions_items()):
        if (not isinstance(func, relax.Function) or not isinstance(func.body, relax.SeqExpr) or _has_branches(func)
                or not _names_unique(func)):
            continue
        mutator = _Reuse(mod)
        new = mutator.visit_expr(func)
        mod = mutator.builder_.finalize()
        mod[gv] = _drop_unread(new)
    return mod
