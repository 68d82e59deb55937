"""Every Relax pass the compiler runs, in order, in named phases:

1. import: ONNX to Relax with qwc's converters, each emitting its own kernels (frontend.import_graph);
2. fusions: across the converters' kernels, where one kernel's output feeds the next
   (`fusions`, run by import_graph for each entry point);
3. merge siblings: linears that read the same activations quantize them once, and their decode
   GEMVs become one launch (`merge_siblings`);
4. legalize: TVM's library dispatch and its lowering of the remaining Relax ops to TIR;
5. schedule: every kernel without a hand schedule gets the generic one (schedule.py);
6. finalize: TVM's dataflow lowering and VM finalization, the views' reuse added (view_reuse.py).

Phases 3-6 run in relax.build (`lowering`); each fusion and merge pass is a file of its own whose
docstring says why it sits where it does.
"""

from __future__ import annotations

import tvm


def fusions(ctx):
    """Phase 2, for one entry point's import context (frontend.ImportContext): the fusions in the
    order their docstrings require. The kernels they replace stay in the module until phase 3's
    dead-code elimination."""
    from .fuse_decode_attention import fuse_decode_attention
    from .fuse_gate_up import fuse_gate_up
    from .fuse_quantizer_inputs import fuse_quantizer_inputs
    from .fuse_residual_gemv import fuse_residual_gemv
    from .kernels.w4a8 import ZERO_POINT
    from .split_residual_gemv import split_residual_gemv
    from .targets import kernels_for, q4_0_path, vector_registers

    passes = [fuse_residual_gemv, fuse_quantizer_inputs(ctx.kname), fuse_gate_up(ctx.kname)]
    kernels = kernels_for(ctx.features)
    if kernels.decode_attention != "online" and not ctx.step:   # a step's attention is ragged
        # with W4A8 decode GEMVs the attention also writes the o projection's Q8_0, in the
        # layout they read (a verify call's and a batched step's o projection is a GEMM,
        # reading the quantizer kernel's blocks)
        w4a8_path = (q4_0_path(32, 4, ctx.act_bits, ctx.features) not in (None, "f32")
                     and not ctx.verify and not ctx.batched)
        passes.append(fuse_decode_attention(
            ctx.kname, dict(ctx.rotary_kernels), ZERO_POINT if w4a8_path else None,
            kernels.int_dots.decode_layout if w4a8_path else "plain", kernels.decode_attention == "three_pass_heads",
            vector_registers(ctx.features), kernels.decode_split_keys, queries=ctx.verify, rows=ctx.batched))
    if kernels.decode_threads and kernels.int_dots and ctx.act_bits == 8:
        passes.append(split_residual_gemv(ctx.kname, kernels.decode_threads))
    return tvm.transform.Sequential(passes)


def merge_siblings() -> list:
    """Phase 3. q, k and v (and gate, up) read the same activations: quantize them once (common
    subexpressions); q, k and v's decode GEMVs then become one launch (sibling_gemvs.py; gate
    and up already are one, fuse_gate_up.py). Dead-code elimination drops what a fused kernel
    made unused (the SiLU·mul and RMSNorm the quantizers compute themselves, the GEMVs a merged
    or fused one replaced)."""
    from tvm import relax

    from .sibling_gemvs import merge_sibling_gemvs

    return [relax.transform.EliminateCommonSubexpr(), relax.transform.DeadCodeElimination(), merge_sibling_gemvs,
            relax.transform.DeadCodeElimination()]


def legalize(target) -> list:
    """Phase 4: TVM's CPU library dispatch and legalization."""
    from tvm.relax.backend.cpu_generic import pipeline as P

    return P.library_dispatch_passes(target) + P.legalize_passes(target)


def schedule() -> list:
    """Phase 5: the generic CPU schedule for every kernel no hand schedule claims."""
    from .schedule import generic_cpu_schedule

    return [generic_cpu_schedule]


def finalize(target) -> list:
    """Phase 6: TVM's dataflow lowering and finalization. The VM builds each kernel output's view
    once a call, not once a layer (view_reuse.py): after the views are lowered to storages,
    before the pass that drops them after last use."""
    from tvm.relax.backend.cpu_generic import pipeline as P

    from .view_reuse import reuse_views

    last = list(P.finalize_passes(target))
    at = [p.info.name for p in last].index("LowerAllocTensor") + 1
    last[at:at] = [reuse_views]
    return P.dataflow_lower_passes(target) + last


def lowering(target):
    """Phases 3-6, as relax.build's pipeline for `target` (a tvm.target.Target)."""
    @tvm.transform.module_pass(opt_level=0, name="qwc.CPUPipeline")
    def _pipeline(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        with target:
            phases = merge_siblings() + legalize(target) + schedule() + finalize(target)
            return tvm.transform.Sequential(phases)(mod)

    return _pipeline
