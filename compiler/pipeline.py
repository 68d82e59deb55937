"""Every pass the compiler runs, in order, in named phases:

0. weights: on the ONNX graph, each linear's weights rewritten into the form its target's kernels
   read, by the rewrites its format's record names (qwc/weight_formats.py: `rewrites`; `weights`);
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

from collections import Counter
from dataclasses import dataclass, field

import tvm

from qwc import progress


@dataclass
class WeightsDone:
    """What phase 0 did, for the manifest: the linears' formats before any rewrite, the quantized
    embedding's bits, the linears on per-token prefill activations, and the layouts written."""
    formats: tuple = ()
    embedding_bits: int | None = None
    row_linears: int = 0
    layout: dict = field(default_factory=dict)


def weight_rewrites() -> dict:
    """Phase 0's rewrites by the names the formats' records give them, in the order they run:
    each takes (model, act_bits, features) and the linears its own test selects (the format,
    and whether the target has the kernel), returning what it rewrote."""
    from .block_minimums import fold_block_minimums
    from .repack import q4_1_block_offsets, q8_0_nibble_halves, repack_weights
    from .repack_five_bit import five_bit_codes
    from .repack_iq4 import iq4_indices
    from .repack_q4_k import q4_k_compact
    from .repack_q6_k import q6_k_linears
    from .row_activations import mark_row_activations

    return {
        # first: every later rewrite finds a Q5_1 / Q5_K linear as one node
        "block_minimums": lambda m, a, f: fold_block_minimums(m),
        # next: where Q6_K becomes Q8_0, the manifest's formats say so
        "q6_k_linears": lambda m, a, f: q6_k_linears(m, a, f)[0],
        # before row_activations: an IQ4 linear the target has kernels for takes its indices
        "iq4_indices": iq4_indices,
        "row_activations": mark_row_activations,   # before repacking: it reads the plain codes
        "q8_0_nibble_halves": q8_0_nibble_halves,
        "q4_k_compact": lambda m, a, f: q4_k_compact(m, a, f)[0],
        "q4_1_block_offsets": q4_1_block_offsets,
        "five_bit_codes": five_bit_codes,
        "repack_weights": repack_weights,
    }


def linear_formats(model) -> tuple[tuple, int | None]:
    """The linears' formats (qwc/weight_formats.py), each with its count, and the quantized
    embedding's bits (None: float)."""
    from onnx import helper

    from qwc import weight_formats
    from qwc.manifest import LinearFormat
    from qwc.passes.graph import matmul_nbits_dims

    blocks = Counter()
    for n in model.graph.node:
        if n.op_type == "MatMulNBits":
            _, _, block, bits = matmul_nbits_dims(n)
            blocks[(bits, block, weight_formats.format_of(n).name.lower())] += 1
    gbq = [n for n in model.graph.node if n.op_type == "GatherBlockQuantized"]
    emb_bits = int(next((helper.get_attribute_value(a) for a in gbq[0].attribute if a.name == "bits"), 4)) if gbq else None
    return tuple(LinearFormat(b, k, f, c) for (b, k, f), c in sorted(blocks.items())), emb_bits


def weights(model, act_bits: int, target) -> WeightsDone:
    """Phase 0: the weights phase, on the canonical graph in place."""
    from qwc.passes.graph import release_unused_weights

    from .repack import float_column_blocks, half_gather_scales
    from .repack_iq4 import is_iq4_xs_compact
    from .repack_q4_k import q4_k_gather
    from .row_activations import chosen

    rewrites, done, out = weight_rewrites(), {}, WeightsDone()
    features = target.features
    done["block_minimums"] = rewrites["block_minimums"](model, act_bits, features)
    if _has(model, "Q6_K"):
        with progress.stage("Q6_K weights for the target's kernels"):
            done["q6_k_linears"] = rewrites["q6_k_linears"](model, act_bits, features)
    out.formats, out.embedding_bits = linear_formats(model)
    done["iq4_indices"] = rewrites["iq4_indices"](model, act_bits, features)
    done["iq4_xs_compact_scales"] = sum(is_iq4_xs_compact(n) for n in model.graph.node)
    done["row_activations"] = out.row_linears = rewrites["row_activations"](model, act_bits, features)
    if chosen(model):
        int8 = sum(f.count for f in out.formats if f.format in ("q4_0", "q8_0"))
        rows = out.row_linears
        progress.info(f"[qwc] prefill activations: {rows} linears with a scale and zero point a token, "
                      + (f"the other {int8 - rows} Q4_0 / Q8_0 ones in blocks of 32" if rows
                         else f"none on {target.name} (its GEMM has no per-token form): blocks of 32"))
    release_unused_weights(model)   # what the passes made and replaced
    with progress.stage("repacking weights for the target's kernels"):
        for name in ("q8_0_nibble_halves", "q4_k_compact", "q4_1_block_offsets", "five_bit_codes", "repack_weights"):
            done[name] = rewrites[name](model, act_bits, features)
            release_unused_weights(model)   # the forms it replaced: the scratch disk holds one form
        embedding = q4_k_gather(model, features)   # an untied Q4_K table at the file's bytes
        half_gather_scales(model)
        column_blocks = float_column_blocks(model, features)
        release_unused_weights(model)
    repacked = done["repack_weights"] + done["q4_k_compact"] + done["five_bit_codes"] + done["iq4_indices"]
    out.layout = {k: v for k, v in (("row_groups_16", repacked), ("q4_k_compact_scales", done["q4_k_compact"]),
                                    ("five_bit_codes", done["five_bit_codes"]), ("iq4_indices", done["iq4_indices"]),
                                    ("iq4_xs_compact_scales", done["iq4_xs_compact_scales"]),
                                    ("column_blocks", column_blocks),
                                    ("q4_k_compact_embedding", embedding)) if v}
    return out


def _has(model, fmt: str) -> bool:
    from qwc import weight_formats

    return any(n.op_type == "MatMulNBits" and weight_formats.format_of(n).name == fmt for n in model.graph.node)


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
            vector_registers(ctx.features), kernels.decode_split_keys, queries=ctx.verify, rows=ctx.batched,
            head_norms=dict(ctx.head_norms), key_prefetch=kernels.decode_key_prefetch))
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
