"""ONNX (canonical graph) -> TVM Relax.

TVM 0.27's ONNX frontend has no hook for custom ops: its op table is the module function
`onnx_frontend._get_convert_map()`, looked up on every use and keyed by op_type only. qwc
extends it here, in one place, with converters for the canonical ops; each emits qwc's
kernels (`compiler/kernels/`), so int4 weights stay int4 and are dequantized inside the
matmul. Params stay function inputs (`keep_params_in_input=True`): constant folding would
otherwise dequantize every weight into an fp32 constant.

The KV cache is a contiguous per-layer buffer [1, kv_heads, cache_len, head_dim] owned by
the runtime; GroupQueryAttention writes the new K/V into it in place (call_tir_inplace) and
attends over it.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import warnings
from dataclasses import dataclass, field

import onnx
from tvm import relax, tirx
from tvm.relax.frontend.onnx import onnx_frontend as F
from tvm_ffi import structural_equal

from qwc.errors import QwcError
from qwc.passes.graph import (
    BLOCK_OFFSETS_ATTR,
    COLUMN_BLOCKS_OP,
    FIVE_BIT_ATTR,
    IQ4_ATTR,
    NIBBLE_HALVES_ATTR,
    Q4_K_SCALES_ATTR,
    Q6_K_ATTR,
    ROW_ACTIVATIONS_ATTR,
)
from qwc.passes.last_position import GQA_STEP_INPUTS, STEP_LOGIT_TOKENS, STEP_SEGMENTS, STEP_TOKENS_OP

from .kernels import decode_attention, generic, kv_cache, prefill_attention, prefill_bias, w4a8_gemm
from .kernels.q4_k_scales import SCALE_DTYPE
from .kernels.w4a8 import ZERO_POINT
from .lora_slots import LORA_SLOT
from .lora_slots import OP as LORA_OP
from .pipeline import fusions
from .relax_match import call_of
from .targets import kernels_for, q4_0_path, q6_k_path, q8_0_path, vector_registers


@dataclass
class ImportContext:
    """What one import_graph call hands its converters (TVM calls them with the block builder,
    the inputs and the attributes only, so they find it in _CONTEXT)."""
    # Kernel names get the entry point's name in front, so the prefill and decode imports can
    # live in one IRModule without their (differently specialised) kernels colliding.
    prefix: str = ""
    act_bits: int = 32                              # 8: W4A8 integer kernels
    features: frozenset = frozenset()               # the target's ISA features (targets.py)
    tuned: dict = field(default_factory=dict)       # tuning task key -> knobs (`--tuning-db`)
    rotary_kernels: dict = field(default_factory=dict)   # rotary kernel emitted -> its num_heads
    head_norms: dict = field(default_factory=dict)       # those that norm each head first -> epsilon
    batched: bool = False                           # B sequences, each with its own cache row
    step: bool = False                              # segments of tokens of B rows (build.py: step)
    verify: bool = False                            # decode's attention for each new token (build.py: verify)
    # every activation quantizer that can scales by super-blocks (act_quant's super_blocks):
    # where an ARM graph has compact Q4_K or IQ4_XS linears, whose kernels read only those, so that
    # the linears reading one input (q, k and v; gate and up) still share one quantizer
    super_blocks: bool = False

    def kname(self, name: str) -> str:
        return f"{self.prefix}_{name}" if self.prefix else name


_CONTEXT: contextvars.ContextVar[ImportContext] = contextvars.ContextVar("qwc_import")
_OUTSIDE = ImportContext()   # a converter run outside import_graph (tests): the defaults


def _ctx() -> ImportContext:
    return _CONTEXT.get(_OUTSIDE)


def _kname(name: str) -> str:
    return _ctx().kname(name)


def half_products() -> bool:
    """Whether the target multiplies float16 pairs into float32 sums (FEAT_FHM's `fmlal`),
    which the prefill attention takes on a float16 cache (kernels/prefill_attention.py)."""
    return "fp16fml" in _ctx().features


class MatMulNBits(F.OnnxOpConverter):
    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        a, w, s = inputs[0], inputs[1], inputs[2]
        zp = inputs[3] if len(inputs) > 3 else None
        k, n, block, bits = int(attr["K"]), int(attr["N"]), int(attr["block_size"]), int(attr.get("bits", 4))
        bias = inputs[5] if len(inputs) > 5 else None
        if attr.get(Q6_K_ATTR):   # repacked for the Q6_K kernel (repack_q6_k.py)
            return cls.q6_k_matmul(bb, a, w, s, inputs[6], k, n, bias)
        if attr.get(NIBBLE_HALVES_ATTR):   # Q8_0 (Q5_1, Q5_K) as two Q4_0 halves (repack.q8_0_nibble_halves)
            path = q4_0_path(block, 4, _ctx().act_bits, _ctx().features)
            hi = cls.q4_0_matmul(bb, a, w, s, k, n, path)
            lo = cls.q4_0_matmul(bb, a, inputs[6], inputs[7], k, n, path, bias=bias, offsets=zp,
                                 zero_offset=zp is None)
            return bb.emit(relax.op.add(hi, lo))
        if attr.get(IQ4_ATTR):   # 4-bit indices into the book (repack_iq4.py; zp: IQ4_XS's d on ARM)
            isa = kernels_for(_ctx().features).int_dots.isa
            return cls.q4_0_matmul(bb, a, w, s, k, n, isa, bias=bias, book=True, offsets=zp)
        if attr.get(FIVE_BIT_ATTR):   # five-bit codes plus block offsets (repack_five_bit.py)
            isa = q8_0_path(block, bits, _ctx().act_bits, _ctx().features)
            return cls.q4_0_matmul(bb, a, w, s, k, n, isa, bias=bias, offsets=zp, bits=5)
        if zp is not None and attr.get(BLOCK_OFFSETS_ATTR):
            # Q4_1 / Q4_K as Q4_0 plus offsets (repack.py); Q5_1 / Q5_K as 8-bit codes plus their
            # minimums (block_minimums.py) on the W8A8 kernels
            path = (q8_0_path if bits == 8 else q4_0_path)(block, bits, _ctx().act_bits, _ctx().features)
            if path is None:   # no such kernel here: the generic one, and the offsets' own pair
                return cls.q4_0_matmul(bb, a, w, s, k, n, "generic", bias=bias, offsets=zp, bits=bits)
            return cls.q4_0_matmul(bb, a, w, s, k, n, path, bias=bias, offsets=zp, bits=bits)
        if zp is not None and (bits != 4 or not str(zp.ty.dtype).startswith("float")):
            raise QwcError(f"MatMulNBits {n}x{k}: zero points are supported as float ones on 4-bit codes "
                           f"(llama.cpp's Q4_1), not {bits}-bit codes with {zp.ty.dtype} ones")
        # per-token activations in prefill (compiler/row_activations.py): the weight rows' sums
        row_sums = inputs[6] if attr.get(ROW_ACTIVATIONS_ATTR) else None
        if zp is None and (path := q8_0_path(block, bits, _ctx().act_bits, _ctx().features)):   # W8A8 (repack.py)
            return cls.q4_0_matmul(bb, a, w, s, k, n, path, bias=bias, bits=8, row_sums=row_sums)
        path = q4_0_path(block, bits, _ctx().act_bits, _ctx().features, zero_points=zp is not None)
        if path is not None:
            return cls.q4_0_matmul(bb, a, w, s, k, n, path, bias=bias, row_sums=row_sums)
        kernel = generic.matmul_nbits_a8 if _ctx().act_bits == 8 else generic.matmul_nbits
        out = bb.emit_te(kernel, a, w, s, *([] if zp is None else [zp]), k=k, n=n, block=block, bits=bits,
                         primfunc_name_hint=_kname("matmul_nbits"))
        return out if bias is None else bb.emit(relax.op.add(out, bias))

    @classmethod
    def q4_0_matmul(cls, bb, a, w, s, k: int, n: int, path: str, features=None, bias=None, offsets=None,
                    zero_offset: bool = False, bits: int = 4, row_sums=None, book: bool = False):
        """a [..., K] (+ bias [N]) through one of qwc's Q4_0 kernels on [M, K] rows ("f32":
        W4A32; "x86", "arm": W4A8 integer dots; "generic": the TE kernels, for block offsets on
        a target without the others; with `bits` 8, the target's W8A8 kernels for
        Q8_0 codes); M = 1 selects the decode form. `offsets` (Q4_1, compiler/repack.py:
        q4_1_block_offsets): plus each block's offset times the activations' block sum, inside
        the W4A8 kernels (offsets in row groups, row_groups.pack_offsets); for W4A32 ([N, K/32])
        a small kernel pair of its own (generic.block_sums, block_offsets_term).
        `zero_offset` (W4A8 only): the integer dots start from 0, not from the quantizer's -8 x
        sum(a): the codes count as 0..15 (a Q8_0's low nibbles: repack.q8_0_nibble_halves).
        `row_sums` (W4A8 / W8A8 prefill where the target has the form): the weight rows' sums
        [N], and the prefill GEMM takes activations with a scale and zero point a token.
        `book`: 4-bit indices into IQ4's code book on the target's kernels for them
        (targets.IntDots.iq4)."""
        lead = list(a.ty.shape)[:-1]
        a2 = bb.emit(relax.op.reshape(a, [-1, k]))
        m = a2.ty.shape[0]
        one_token = getattr(m, "value", None) == 1
        if path == "f32":
            y = cls._f32(bb, a2, m, one_token, w, s, k, n)
        elif path == "generic":
            kernel = generic.matmul_nbits_a8 if _ctx().act_bits == 8 else generic.matmul_nbits
            y = bb.emit_te(kernel, a2, w, s, k=k, n=n, block=32, bits=bits, primfunc_name_hint=_kname("matmul_nbits"))
        else:
            y, bias = cls._int8_dot(bb, a2, m, one_token, w, s, k, n,
                                    _ctx().features if features is None else features, bias, zero_offset, bits,
                                    offsets, row_sums, book)
            offsets = None   # the kernel added the term
        if offsets is not None:
            sums = bb.emit_te(generic.block_sums, a2, k=k, act_bits=_ctx().act_bits,
                              primfunc_name_hint=_kname("block_sums"))
            term = bb.emit_te(generic.block_offsets_term, sums, offsets, primfunc_name_hint=_kname("block_offsets_term"))
            y = bb.emit(relax.op.add(y, term))
        y = bb.emit(relax.op.reshape(y, [*lead, n]))
        return y if bias is None else bb.emit(relax.op.add(y, bias))

    @staticmethod
    def q6_k_matmul(bb, a, w, sc, d, k: int, n: int, bias=None):
        """a [..., K] (+ bias [N]) through the target's Q6_K kernel (kernels/x86/q6_k.py,
        kernels/arm/q6_k.py) on the weights compile-time repacking wrote (codes w, sub-block
        scales sc, super-block scales d): the activation quantizer (which the fusion passes give
        the RMSNorm or SiLU·mul before it), on x86 the sub-blocks' chain starts, then the matmul
        (x86: with the bias as it stores; ARM: the bias added after)."""
        from .kernels import act_quant, q6_k_module

        if len(w.ty.shape) != 4:
            raise QwcError(f"MatMulNBits {n}x{k}: the Q6_K kernel reads weights repacked into row groups "
                           "(compiler/repack_q6_k.py), got the plain layout")
        lead = list(a.ty.shape)[:-1]
        a2 = bb.emit(relax.op.reshape(a, [-1, k]))
        m = a2.ty.shape[0]
        one_token = getattr(m, "value", None) == 1
        nb = k // act_quant.BLOCK
        arm = q6_k_path(16, 8, _ctx().act_bits, _ctx().features) == "arm"
        layout = "arm" if arm else "plain"   # the "arm" layout at any M: the sdot kernel's
        # ARM's Q6_K takes Q8_K activations in every graph, as llama.cpp's does: its sub-block
        # scales then multiply int32 sums, and the float work comes once a super-block
        aq, ad, off = _quantized(bb, a2, k, nb, one_token, layout, super_blocks=arm)
        dots = kernels_for(_ctx().features).int_dots
        q6_k = q6_k_module(dots.q6_k)   # the target's Q6_K kernel module
        if arm:
            ddt = str(d.ty.dtype)   # the file's fp16 where it holds every d (repack_q6_k.pack)
            kernel = bb.add_func(q6_k.q6_k_matmul(n, nb, d_dtype=ddt), _kname(f"q6_k_matmul_sdot_{n}x{nb}_k_{ddt}"))
            y = bb.emit(relax.call_tir(kernel, [aq, ad, w, sc, d], relax.TensorType(shape=[m, n], dtype="float32")))
            y = bb.emit(relax.op.reshape(y, [*lead, n]))
            return y if bias is None else bb.emit(relax.op.add(y, bias))
        starts = bb.add_func(q6_k.q6_k_starts(nb, one_token), _kname(f"q6_k_starts_{nb}_{int(one_token)}"))
        st = bb.emit(relax.call_tir(starts, [aq, off], relax.TensorType(shape=[m, nb, 2], dtype="int32")))
        amx = dots.amx and not one_token
        # (one token takes the kernel's streamed form: decode's prefetch choice)
        kernel = bb.add_func(q6_k.q6_k_matmul(n, nb, bias=bias is not None, amx=amx, prefetch=dots.decode_prefetch),
                             _kname(f"q6_k_matmul{'_amx' if amx else ''}_{n}x{nb}{'_bias' if bias is not None else ''}"))
        y = bb.emit(relax.call_tir(kernel, [aq, ad, st, w, sc, d] + ([bias] if bias is not None else []),
                                   relax.TensorType(shape=[m, n], dtype="float32")))
        return bb.emit(relax.op.reshape(y, [*lead, n]))

    @staticmethod
    def _f32(bb, a2, m, one_token: bool, w, s, k: int, n: int):
        """W4A32: weights dequantized in registers, 16-lane float FMAs (kernels/q4_f32.py)."""
        from .kernels import q4_f32

        nb = (k + q4_f32.BLOCK - 1) // q4_f32.BLOCK
        kind = f"q4_f32_{'gemv' if one_token else 'gemm'}"
        kernel = bb.add_func(q4_f32.kernel(k, n, nb, one_token, _ctx().tuned.get(f"{kind}_{n}x{k}")),
                             _kname(f"{kind}_{n}x{nb}"))
        return bb.emit(relax.call_tir(kernel, [a2, w, s], relax.TensorType(shape=[m, n], dtype="float32")))

    @staticmethod
    def _int8_dot(bb, a2, m, one_token: bool, w, s, k: int, n: int, features, bias=None, zero_offset: bool = False,
                  bits: int = 4, offsets=None, row_sums=None, book: bool = False):
        """W4A8 through an ISA's integer dot-product kernel (vpdpbusd / sdot / smmla), all
        reading the row-group layout compile-time repacking wrote (kernels/row_groups.py), after
        the activation quantizer (the fusion passes give it the RMSNorm or SiLU·mul before it:
        fuse_quantizer_inputs.py). Returns y and the bias still to add (None when the kernel
        added it: the decode GEMVs, and the GEMMs of a kernel module with PREFILL_BIAS)."""
        from .kernels import act_quant

        if len(w.ty.shape) != 4:
            raise QwcError(f"MatMulNBits {n}x{k}: the W4A8 kernels read weights repacked into row groups "
                           "(compiler/repack.py), got the plain layout")
        nb = (k + act_quant.BLOCK - 1) // act_quant.BLOCK
        sdt = str(s.ty.dtype)
        # `qwc tune` measures the Q4_0 GEMMs; a Q8_0 one takes its module's tile
        tokens = None if one_token or bits != 4 or book else _ctx().tuned.get(f"q4_a8_gemm_{n}x{k}", {}).get("tokens")
        fused_bias = False
        w4a8 = kernels_for(features).int_dots
        if bits == 8:
            dot = w4a8.q8_decode if one_token else w4a8.q8_prefill
        elif bits == 5:   # (repack_five_bit.py wrote them only where the target has the kernels)
            dot = w4a8.q5 if one_token else w4a8.q5_prefill
        elif book:   # (so did repack_iq4.py)
            dot = w4a8.iq4 if one_token else w4a8.iq4_prefill
        else:
            dot = w4a8.decode if one_token else w4a8.prefill
        stem = f"q{bits}"
        # How the kernel reads activations: the ARM kernels start from int32 offsets, the smmla
        # GEMM reads token pairs interleaved (act_quant.fused_quantizer).
        layout = w4a8.decode_layout if one_token else w4a8.prefill_layout
        has_c = offsets is not None   # Q4_1's block offsets, in row groups (repack.py)
        # per-token activations: the prefill and score entry points only, on the targets with
        # the form, for Q4_0 / Q8_0 codes without offsets. Every decode token keeps blocks
        # (alone, batched, in a mixed step or verified), so its logits do not depend on how
        # the server grouped it; a one-token GEMV's blocks cost it nothing to save.
        ctx = _ctx()
        per_row = (row_sums is not None and not one_token and w4a8.row_layout is not None and not has_c
                   and not zero_offset and bits in (4, 8) and not book and k % act_quant.BLOCK == 0
                   and not (ctx.batched or ctx.step or ctx.verify))
        if per_row:
            layout = w4a8.row_layout
        if has_c and len(offsets.ty.shape) != 3:
            raise QwcError(f"MatMulNBits {n}x{k}: the W4A8 kernels read block offsets repacked into row groups "
                           "(compiler/repack.py), got the plain layout")
        if not one_token:   # the bias in the GEMM's stores where it can (x86), not an add kernel after it
            fused_bias = bias is not None and prefill_bias(dot)
            amx = w4a8.amx and not _ctx().batched
            kernel = bb.add_func(w4a8_gemm(dot, n, nb, sdt, tokens, batched_decode=_ctx().batched, offsets=has_c,
                                           bias=fused_bias, amx=amx, per_row=per_row),
                                 _kname(f"{stem}_gemm_{dot}{'_amx' if amx else ''}{'_rows' if per_row else ''}_{n}x{nb}"
                                        f"_{sdt}{'_c' if has_c else ''}{'_bias' if fused_bias else ''}"))
        else:   # several of these may become one launch (compiler/sibling_gemvs.py)
            from .kernels import decode_gemv

            fused_bias = bias is not None   # the decode GEMV adds it in its epilogue
            kernel = bb.add_func(decode_gemv(((n, fused_bias, has_c),), nb, sdt, dot=dot, prefetch=w4a8.decode_prefetch),
                                 _kname(f"{stem}_gemv_{dot}_{n}x{nb}_{sdt}{'_c' if has_c else ''}"
                                        f"{'_bias' if fused_bias else ''}"))
        # compact Q4_K and IQ4_XS on ARM: their kernels read activations scaled by super-blocks only
        q, scale, off = _quantized(bb, a2, k, nb, one_token, layout,
                                   super_blocks=w4a8.isa == "arm" and sdt == SCALE_DTYPE)
        if zero_offset:
            off = bb.emit(relax.op.zeros(off.ty.shape, "int32"))
        args = [q, scale, off, w, s] + ([offsets] if has_c else []) + ([row_sums] if per_row else []) + (
            [bias] if fused_bias else [])
        y = bb.emit(relax.call_tir(kernel, args, relax.TensorType(shape=[m, n], dtype="float32")))
        return y, None if fused_bias else bias


def _scaled_by_super_blocks(k: int, layout: str, asked: bool = False) -> bool:
    """Whether _quantized scales rows of K in `layout` by super-blocks: where the linear asks
    or the graph does (ImportContext.super_blocks), and the layout and K allow."""
    from .kernels import act_quant

    return (asked or _ctx().super_blocks) and act_quant.takes_super_blocks(k, layout)


def _quantized(bb, a2, k: int, nb: int, one_token: bool, layout: str, super_blocks: bool = False):
    """(aq, ad, off) of the activation quantizer (act_quant.fused_quantizer) on a2 [M, K] in
    `layout`: what every integer-dot linear reads (scales and offsets [M, NB, 2] in "arm_pairs").
    Scaled by super-blocks where the linear asks (`super_blocks`) or the graph does
    (ImportContext.super_blocks) and the layout and K allow."""
    from .kernels import act_quant

    super_blocks = _scaled_by_super_blocks(k, layout, super_blocks)
    m = a2.ty.shape[0]
    offsets = [m, nb, 2] if layout in ("arm_pairs", "arm_rows") else [m, nb]
    scales = [m, 2] if layout in act_quant.ROW_LAYOUTS else offsets   # (s, s zp) a token
    q8 = [relax.TensorType(shape=[m, nb, act_quant.BLOCK], dtype="int8"),
          relax.TensorType(shape=scales, dtype="float32"), relax.TensorType(shape=offsets, dtype="int32")]
    quant = bb.add_func(act_quant.fused_quantizer(k, ZERO_POINT, one_token, layout=layout, super_blocks=super_blocks),
                        _kname(act_quant.quantizer_name(k, ZERO_POINT, one_token, layout=layout,
                                                        super_blocks=super_blocks)))
    parts = bb.emit(relax.call_tir(quant, [a2], q8))
    return tuple(bb.emit(relax.TupleGetItem(parts, i)) for i in range(3))


class GatherBlockQuantized(F.OnnxOpConverter):
    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        w, idx, s = inputs[0], inputs[1], inputs[2]
        if attr.get("gather_axis", 0) != 0 or attr.get("quantize_axis", 1) != 2:
            raise QwcError("GatherBlockQuantized: qwc supports gather_axis 0, quantize_axis 2")
        if attr.get(Q6_K_ATTR):   # a Q6_K lm_head's repacked codes, scales sc and d (repack_q6_k.py)
            isa = q6_k_path(16, 8, _ctx().act_bits, _ctx().features)
            return bb.emit_te(generic.gather_q6_k_row_groups, w, idx, s, inputs[3], isa=isa,
                              primfunc_name_hint=_kname("gather_q6_k_packed"))
        if attr.get(Q4_K_SCALES_ATTR):   # an untied Q4_K table's compact factors (repack_q4_k.q4_k_gather)
            return bb.emit_te(generic.gather_q4_k_compact, w, idx, s, inputs[3],
                              primfunc_name_hint=_kname("gather_q4_k_compact"))
        if len(w.ty.shape) == 4:  # shared with an lm_head whose kernel reads a repacked layout
            if int(attr.get("bits", 4)) == 8:   # the W8A8 kernels' (row_groups.pack_int8)
                signed = q8_0_path(32, 8, _ctx().act_bits, _ctx().features) == "arm"
                return bb.emit_te(generic.gather_q8_row_groups, w, idx, s, signed=signed,
                                  primfunc_name_hint=_kname("gather_q8_packed"))
            return bb.emit_te(generic.gather_q4_row_groups, w, idx, s, primfunc_name_hint=_kname("gather_q4_packed"))
        return bb.emit_te(generic.gather_block_quantized, w, idx, s, block=int(attr["block_size"]),
                          bits=int(attr.get("bits", 4)), primfunc_name_hint=_kname("gather_block_quantized"))


class SimplifiedLayerNormalization(F.OnnxOpConverter):
    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        return relax.op.nn.rms_norm(inputs[0], inputs[1], axes=[-1], epsilon=float(attr.get("epsilon", 1e-5)))


class SkipSimplifiedLayerNormalization(F.OnnxOpConverter):
    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        total = bb.emit(relax.op.add(inputs[0], inputs[1]))   # decode: fuse_residual_gemv.py
        if len(inputs) > 3 and inputs[3] is not None:
            total = bb.emit(relax.op.add(total, inputs[3]))
        y = bb.emit(relax.op.nn.rms_norm(total, inputs[2], axes=[-1], epsilon=float(attr.get("epsilon", 1e-5))))
        return relax.Tuple([y, total, total, total])  # outputs 1-2 (mean, inv std) are never read


class RotaryEmbedding(F.OnnxOpConverter):
    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        x, pos, cos, sin = inputs[:4]
        if attr.get("interleaved", 0):
            raise QwcError("RotaryEmbedding: interleaved rotary is not supported")
        heads = int(attr["num_heads"])
        x, pos = (v if isinstance(v, relax.Var) else bb.emit(v) for v in (x, pos))
        x_ty = x.ty
        vector = x_ty.ndim == 3 and isinstance(x_ty.shape[2], tirx.IntImm) and x_ty.dtype == "float32"
        normed = cls._head_norm(bb, x, heads) if vector else None
        eps = None if normed is None else normed[2]
        kernel = generic.rotary_halves(int(x_ty.shape[2]), heads, str(pos.ty.dtype), eps) if vector else None
        if kernel is not None and normed is not None:   # Qwen3's QK-norm in the rotary kernel (kernels/head_norm.py)
            out = bb.emit(relax.call_tir(bb.add_func(kernel, _kname("rotary_head_norm")), [normed[0], normed[1], pos, cos, sin],
                                         relax.TensorType(shape=x_ty.shape, dtype="float32")))
            _ctx().head_norms[bb.lookup_binding(out).args[0].name_hint] = eps
        elif kernel is not None:   # the vector form; the TE one for head sizes it does not take
            out = bb.emit(relax.call_tir(bb.add_func(kernel, _kname("rotary")), [x, pos, cos, sin],
                                         relax.TensorType(shape=x_ty.shape, dtype="float32")))
        else:
            out = bb.emit_te(generic.rotary, x, pos, cos, sin, heads=heads, primfunc_name_hint=_kname("rotary"))
        _ctx().rotary_kernels[bb.lookup_binding(out).args[0].name_hint] = heads   # fuse_decode_attention.py
        return out

    @staticmethod
    def _head_norm(bb, x, heads: int):
        """(y, gain, epsilon) where x is Qwen3's QK-norm of y [b, s, heads x head_dim] as the
        passes write it: Reshape(RMSNorm over head_dim (Reshape(y) to [b, s, heads, head_dim])),
        else None."""
        def bound(v):
            return bb.lookup_binding(v) if isinstance(v, relax.Var) else v

        flat = bound(x)
        norm = bound(flat.args[0]) if call_of(flat, "relax.reshape") else None
        if not call_of(norm, "relax.nn.rms_norm") or [int(a) for a in norm.attrs.axes] not in ([-1], [3]):
            return None
        split = bound(norm.args[0])
        y, gain = (split.args[0] if call_of(split, "relax.reshape") else None), norm.args[1]
        d = int(x.ty.shape[2]) // heads

        def dims(v):
            return [getattr(n, "value", None) for n in v.ty.shape]

        if y is None or y.ty.ndim != 3 or dims(norm.args[0])[2:] != [heads, d] or dims(gain) != [d]:
            return None
        y, gain = (v if isinstance(v, relax.Var) else bb.emit(v) for v in (y, gain))
        return y, gain, float(norm.attrs.epsilon)


class GroupQueryAttention(F.OnnxOpConverter):
    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        q, k, v, past_k, past_v, seqlens = (
            x if isinstance(x, relax.Var) else bb.emit(x) for x in inputs[:6])
        if attr.get("do_rotary", 0) or attr.get("softcap", 0.0) or attr.get("local_window_size", -1) != -1:
            raise QwcError("GroupQueryAttention: do_rotary, softcap and local windows are not supported")
        heads, kv_heads = int(attr["num_heads"]), int(attr["kv_num_heads"])
        kv_dtype = kv_cache.cache_format(past_k.ty.dtype)   # import_graph's kv_dtype
        head_dim = kv_cache.head_dim_of(int(past_k.ty.shape[3]), kv_dtype)
        scale = float(attr.get("scale", 0.0)) or 1.0 / math.sqrt(head_dim)
        # The fast kernel reads K in its key-tile layout (kernels/kv_cache.py); V, and K for
        # the generic kernel, are rows.
        # Decode's rotary, cache writes and attention may become one kernel: fuse_decode_attention.py
        tiled, batched = kv_cache.supports(head_dim), _ctx().batched
        if (batched or _ctx().step) and not tiled:
            raise QwcError(f"batched decode needs a head_dim that is a multiple of {kv_cache.LANES} (got {head_dim})")
        if not kv_cache.supports_format(kv_dtype, head_dim):
            raise QwcError(f"a {kv_dtype} KV cache needs a head_dim that is a multiple of {kv_cache.Q8} (got {head_dim})")
        suffix = "" if kv_dtype == "float32" else f"_{kv_dtype}"
        if _ctx().step:   # passes/last_position.py: step_nodes gives it the segments and positions
            segments, positions = (bb.emit(x) if not isinstance(x, relax.Var) else x
                                   for x in (inputs[GQA_STEP_INPUTS], inputs[GQA_STEP_INPUTS + 1]))
            kc, vc = (bb.emit(relax.call_tir_inplace(
                bb.add_func(kv_cache.ragged_kv_cache_write(tiles, kv_dtype, head_dim),
                            _kname(("k_cache_write_tiles" if tiles else "kv_cache_write") + suffix)),
                [cache, new, segments, positions], 0, cache.ty)) for tiles, cache, new in ((True, past_k, k), (False, past_v, v)))
            rule = kernels_for(_ctx().features)
            # the decode tokens (one-token segments) attend as decode does, in a kernel of their
            # own after the online one: their logits are decode's to the bit, as decode_batch's
            three_pass = (rule.decode_attention != "online" and rule.exact_step_decode
                          and decode_attention.fuses_decode_prologue(head_dim))
            kernel = bb.add_func(prefill_attention.attention(heads, kv_heads, head_dim, scale, kv_dtype=kv_dtype,
                                                registers=vector_registers(_ctx().features), ragged=True,
                                                singles=not three_pass, half_products=half_products()),
                                 _kname("attention_online" + suffix))
            out = bb.emit(relax.call_tir(kernel, [q, kc, vc, segments, positions], q.ty))
            if three_pass:
                per_head = rule.decode_attention == "three_pass_heads"
                decode_like = bb.add_func(decode_attention.decode_attention(
                    heads, kv_heads, head_dim, scale, str(positions.ty.dtype), None, "plain", 1 if per_head else None,
                    kv_dtype, vector_registers(_ctx().features), rule.decode_split_keys, segments=True,
                    key_prefetch=rule.decode_key_prefetch),
                    _kname("attention_3pass_segments" + ("_heads" if per_head else "") + suffix))
                out = bb.emit(relax.call_tir_inplace(decode_like, [q, kc, vc, segments, positions, out], 5, q.ty))
            return relax.Tuple([out, kc, vc])
        write_k = bb.add_func(kv_cache.kv_cache_write(tiled, batched, kv_dtype, head_dim),
                              _kname(("k_cache_write_tiles" if tiled else "kv_cache_write") + suffix))
        write_v = bb.add_func(kv_cache.kv_cache_write(False, batched, kv_dtype, head_dim), _kname("kv_cache_write" + suffix))
        kc = bb.emit(relax.call_tir_inplace(write_k, [past_k, k, seqlens], 0, past_k.ty))
        vc = bb.emit(relax.call_tir_inplace(write_v, [past_v, v, seqlens], 0, past_v.ty))
        # prefill's last layer may take only the chunk's last query (passes/last_position.py:
        # prefill_nodes); the generic kernel places queries from the end of the chunk already
        last = not batched and not structural_equal(q.ty.shape[1], k.ty.shape[1])
        if tiled:
            kernel = bb.add_func(prefill_attention.attention(heads, kv_heads, head_dim, scale, batched, kv_dtype,
                                                vector_registers(_ctx().features), half_products=half_products(),
                                                last_query=last),
                                 _kname("attention_online" + ("_last" if last else "") + suffix))
            chunk = [relax.prim_value(k.ty.shape[1])] if last else []
            out = bb.emit(relax.call_tir(kernel, [q, kc, vc, seqlens, *chunk], q.ty))
        else:
            out = bb.emit_te(generic.attention, q, kc, vc, seqlens, heads=heads, kv_heads=kv_heads,
                             head_dim=head_dim, scale=scale, primfunc_name_hint=_kname("attention"))
        return relax.Tuple([out, kc, vc])


class MatMulColumnBlocks(F.OnnxOpConverter):
    """A float MatMul whose weight compiler/repack.py stored in column blocks [N / cols, K,
    cols]: kernels/f32_matmul.py on [M, K] rows (M = 1: the decode form)."""
    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        from .kernels import f32_matmul

        a, w = inputs[0], inputs[1]
        groups, k, cols = (int(d) for d in w.ty.shape)
        n = groups * cols
        lead = list(a.ty.shape)[:-1]
        a2 = bb.emit(relax.op.reshape(a, [-1, k]))
        m = a2.ty.shape[0]
        one_token = getattr(m, "value", None) == 1
        kernel = bb.add_func(f32_matmul.kernel(k, n, cols, one_token, vector_registers(_ctx().features)),
                             _kname(f"f32_matmul_{'gemv' if one_token else 'gemm'}_{n}x{k}"))
        y = bb.emit(relax.call_tir(kernel, [a2, w], relax.TensorType(shape=[m, n], dtype="float32")))
        return bb.emit(relax.op.reshape(y, [*lead, n]))


class LoraAdd(F.OnnxOpConverter):
    """compiler/lora_slots.py: y + B[slot]·(A[slot]·x), each token its own adapter slot."""
    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        from .kernels import lora

        y, x, slot, a, b = (v if isinstance(v, relax.Var) else bb.emit(v) for v in inputs[:5])
        k, n = int(a.ty.shape[1]), int(b.ty.shape[3])
        # compiler/lora_slots.py: x may be the gate (input 5 the up projection) or the sum an
        # RMSNorm normalises (input 5 its gamma)
        prologue = attr.get("prologue", b"plain")
        prologue = prologue.decode() if isinstance(prologue, bytes) else str(prologue)
        x2, y2 = (cls._rows(bb, v, d) for v, d in ((x, k), (y, n)))
        extra = inputs[5] if len(inputs) > 5 else None
        if prologue == "silu_mul":
            extra = cls._rows(bb, extra, k)
        elif prologue == "rms":
            extra = extra if isinstance(extra, relax.Var) else bb.emit(extra)
        s2 = bb.emit(relax.op.reshape(slot, [-1]))
        m, chunks = x2.ty.shape[0], a.ty.shape[2]
        eps = float(attr.get("epsilon", 0.0))
        tag = "" if prologue == "plain" else f"_{prologue}"
        shrink = bb.add_func(lora.shrink(k, prologue, eps), _kname(f"lora_shrink_{k}{tag}"))
        ins = [x2] + ([extra] if prologue != "plain" else [])
        t = bb.emit(relax.call_tir(shrink, [*ins, s2, a],
                                   relax.TensorType(shape=[m, chunks, lora.CHUNK], dtype="float32")))
        expand = bb.add_func(lora.expand_add(n), _kname(f"lora_expand_add_{n}"))
        out = bb.emit(relax.call_tir_inplace(expand, [y2, t, s2, b], 0, y2.ty))   # y2 has no other reader
        return bb.emit(relax.op.reshape(out, y.ty.shape))


    @staticmethod
    def _rows(bb, v, width: int):
        """v as [rows, width]: the tensor v is a reshape of where it is one already (a reshape
        of a reshape lowers to a copy kernel)."""
        e = bb.lookup_binding(v) if isinstance(v, relax.Var) else None
        if call_of(e, "relax.reshape"):
            src = e.args[0]
            if isinstance(src, relax.Var) and src.ty.ndim == 2 and isinstance(src.ty.shape[1], tirx.IntImm) \
                    and int(src.ty.shape[1]) == width:
                return src
        return bb.emit(relax.op.reshape(v, [-1, width]))


class StepTokens(F.OnnxOpConverter):
    """passes/last_position.py: the step entry point's tokens whose logits it returns (indices
    clipped: the runtime builds them, a wrong one must not read outside the buffer)."""
    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        return relax.op.take(inputs[0], inputs[1], axis=1, mode="clip")


_QWC_CONVERTERS = {
    LORA_OP: LoraAdd,
    STEP_TOKENS_OP: StepTokens,
    COLUMN_BLOCKS_OP: MatMulColumnBlocks,
    "MatMulNBits": MatMulNBits,
    "GatherBlockQuantized": GatherBlockQuantized,
    "SimplifiedLayerNormalization": SimplifiedLayerNormalization,
    "SkipSimplifiedLayerNormalization": SkipSimplifiedLayerNormalization,
    "RotaryEmbedding": RotaryEmbedding,
    "GroupQueryAttention": GroupQueryAttention,
}


@contextlib.contextmanager
def qwc_converters():
    """Install qwc's converters into TVM's ONNX op table for the duration of an import."""
    stock = F._get_convert_map

    def extended():
        table = stock()
        table.update(_QWC_CONVERTERS)
        return table

    F._get_convert_map = extended
    try:
        yield
    finally:
        F._get_convert_map = stock


def _compact_k_scales_on_arm(model: onnx.ModelProto, act_bits: int, features) -> bool:
    """Whether the graph has a Q4_K linear with compact scales (compiler/repack_q4_k.py) or an
    IQ4_XS one with the file's (compiler/repack_iq4.py: d in its zero-point input) on an ARM
    target's W4A8 kernels: its activations are then scaled by super-blocks (ImportContext)."""
    if q4_0_path(32, 4, act_bits, features) != "arm":
        return False

    from .repack_iq4 import is_iq4_xs_compact

    return any(n.op_type == "MatMulNBits" and (any(a.name == Q4_K_SCALES_ATTR and a.i for a in n.attribute)
                                               or is_iq4_xs_compact(n)) for n in model.graph.node)


def import_graph(model: onnx.ModelProto, seq: int | None = None, prefix: str = "", act_bits: int = 32,
                 features: frozenset = frozenset(), tuned: dict | None = None, fuse: bool = True,
                 batched: bool = False, kv_dtype: str = "float32", step: bool = False, verify: bool = False):
    """Import the canonical graph for batch 1 and `seq` new tokens (None: any number) as
    `main`; `prefix` names its kernels; `act_bits` 8 selects the W4A8 matmuls; `tuned` maps
    tuning task keys (compiler/tuning.py) to schedule knobs; `fuse` False skips the fusion
    passes (tests, measurements of what a fusion gains). `batched`: any number B of sequences
    instead of one, each with its own row of the cache buffers [B, ...] and its own length
    (its attention_mask row: ones, then zeros). `kv_dtype`: the cache's format
    (kernels/kv_cache.py: KV_DTYPES), whatever the ONNX graph's cache inputs say: its buffers
    hold cache_element(kv_dtype), rows cache_width(kv_dtype, head_dim) wide. `step`: the
    step entry point's nodes (passes/last_position.py: step_nodes): `seq` tokens of segments
    of B cache rows, one batch of tokens for the linears. `verify`: each new token attends as
    its decode step would (fuse_decode_attention's `queries`), so the logits are decode's."""
    from tvm import tirx

    seq_dim = tirx.Var("seq", "int64") if seq is None else seq
    batch = tirx.Var("batch", "int64") if batched or step else 1
    tokens_batch = 1 if step else batch    # a step's tokens are one batch for the linears
    total, cache = tirx.Var("total", "int64"), tirx.Var("cache_len", "int64")
    present = {i.name for i in model.graph.input}
    shapes = {k: v for k, v in {"input_ids": [tokens_batch, seq_dim], "position_ids": [tokens_batch, seq_dim],
                                "attention_mask": [tokens_batch, total],
                                STEP_SEGMENTS: [tirx.Var("segments", "int64"), 3],
                                STEP_LOGIT_TOKENS: [tirx.Var("outputs", "int64")]}.items() if k in present}
    dtypes = {k: "int64" for k in (STEP_SEGMENTS, STEP_LOGIT_TOKENS) if k in present}
    if LORA_SLOT in present:   # compiler/lora_slots.py: each token's slot, and every slot's A and B
        shapes[LORA_SLOT], dtypes[LORA_SLOT] = [tokens_batch, seq_dim], "int64"
        slots, chunks = tirx.Var("lora_slots", "int64"), tirx.Var("lora_chunks", "int64")
        for i in model.graph.input:
            if i.name.startswith("qwc_lora_") and i.name != LORA_SLOT:
                dims = [d.dim_value or d.dim_param for d in i.type.tensor_type.shape.dim]
                shapes[i.name] = [slots if d == "lora_slots" else chunks if d == "lora_chunks" else d for d in dims]
    for i in model.graph.input:
        if i.name.startswith("past_key_values."):
            dims = [d.dim_value for d in i.type.tensor_type.shape.dim]
            shapes[i.name] = [batch, dims[1], cache, kv_cache.cache_width(kv_dtype, dims[3])]
            dtypes[i.name] = kv_cache.cache_element(kv_dtype)
    ctx = ImportContext(prefix, act_bits, frozenset(features), dict(tuned or {}), batched=batched, step=step,
                        verify=verify, super_blocks=_compact_k_scales_on_arm(model, act_bits, features))
    token = _CONTEXT.set(ctx)
    try:
        with qwc_converters(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # input renaming, the checker's view of com.microsoft ops
            mod = F.from_onnx(model, shape_dict=shapes, dtype_dict=dtypes, keep_params_in_input=True,
                              sanitize_input_names=True)
    finally:
        _CONTEXT.reset(token)
    return fusions(ctx)(mod) if fuse else mod
