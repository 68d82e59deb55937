"""A decode GEMV that leaves threads idle split over its blocks, its parts summed by the
RMSNorm quantizer that reads it (ARM).

A 0.5B's o and down projections have 56 row groups of 16 rows: on a 128-thread server 72
threads wait while 56 do a whole projection each (docs/history/README.md, "ARM at 64-128 threads").
Both are decode GEMVs with the residual as their bias (compiler/fuse_residual_gemv.py), and
their output, the residual stream, is read by the next RMSNorm's quantizer
(compiler/fuse_quantizer_inputs.py). This pass splits such a GEMV's blocks into parts
(the GEMV's kernel module's block_split, kernels/arm/dotprod.py; a task a row group and part,
the bias in part 0) and
gives the quantizer the parts: it sums them, writes the sum (the residual stream, which the
next residual GEMV reads as its bias) and quantizes it, in the launch it had anyway. No
launch is added and none waits on a reduction.

Where it runs: last of the import-time fusions (pipeline.fusions), on targets whose
kernel rule sizes decode for a thread count (targets.Kernels.decode_threads).
"""

from __future__ import annotations

from tvm import relax

from .fuse_residual_gemv import single_decode_gemv
from .kernels import act_quant, decode_gemv, gemv_dot, gemv_prefetch, kernel_module, weight_args
from .relax_match import Bindings, binding_pass, call_args, kernel_attr


def split_residual_gemv(kname, threads: int):
    """The pass; `kname` names a kernel in this entry point (frontend.ImportContext.kname),
    `threads` the thread count the GEMVs' tasks are sized for."""

    def make(mod, defs: Bindings):
        done = {}   # GEMV output -> the quantizers' outputs: q, k and v each have one (until CSE)

        def rewrite(rw, binding):
            mark = kernel_attr(mod, binding.value, act_quant.QUANTIZER)
            if mark is None or mark["kind"] != "rms" or mark["layout"] == "plain":
                return None
            x, gamma = call_args(binding.value)
            if getattr(x.ty.shape[0], "value", None) != 1:
                return None    # prefill: many rows, already many tasks
            found = single_decode_gemv(mod, defs, x, bias=True)
            if found is None:
                return None
            gv, args = found
            out = defs.unreshaped(x)   # the GEMV's own output var
            key = (out, gamma)
            if key in done:
                return done[key]
            n, k, nb = int(out.ty.shape[-1]), int(x.ty.shape[1]), int(args[3].ty.shape[1])
            block_split = getattr(kernel_module(gemv_dot(mod[gv])), "block_split", None)   # the GEMV's module's
            split = block_split(n, nb, threads, str(args[4].ty.dtype)) if block_split is not None else 1
            if split == 1 or n != k or any(o.same_as(out) for o, _ in done):
                return None
            zp, layout, eps = int(mark["zero_point"]), str(mark["layout"]), float(mark["eps"])
            gemv = rw.builder_.add_func(
                decode_gemv(((n, True, weight_args(args)[0][0]),), nb, str(args[4].ty.dtype), dot=gemv_dot(mod[gv]),
                            split=split, prefetch=gemv_prefetch(mod[gv])),
                gv.name_hint + f"_split{split}")
            parts = rw.emit(relax.call_tir(gemv, [rw.var(a) for a in args],
                                           relax.TensorType([split, n], "float32")))
            sb = act_quant.marked_super_blocks(mark)
            quant = rw.builder_.add_func(
                act_quant.fused_quantizer(k, zp, True, rms_eps=eps, layout=layout, parts=split, super_blocks=sb),
                kname(act_quant.quantizer_name(k, zp, True, "rms", layout, sb) + f"_parts{split}"))
            fields = list(binding.var.ty.fields)
            res = rw.emit(relax.call_tir(quant, [parts, rw.var(gamma)],
                                         fields + [relax.TensorType([1, k], "float32")]))
            # the residual stream: every reshape of the GEMV's output now reads the sum
            hidden = rw.emit(relax.TupleGetItem(res, 3))
            for v in defs.values:
                if defs.unreshaped(v).same_as(out):
                    rw.set_var_remap(v, hidden if v.same_as(out) else rw.emit(relax.op.reshape(hidden, v.ty.shape)))
            done[key] = rw.emit(relax.Tuple([rw.emit(relax.TupleGetItem(res, j)) for j in range(len(fields))]))
            return done[key]
        return rewrite

    return binding_pass("qwc.SplitResidualGEMV", make)
