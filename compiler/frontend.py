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
from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend as F

from qwc.errors import QwcError

from .kernels import attention as fast
from .kernels import generic, w4a8_gemm, w4a8_zero_point
from .targets import kernels_for, q4_0_path

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

    def kname(self, name: str) -> str:
        return f"{self.prefix}_{name}" if self.prefix else name


_CONTEXT: contextvars.ContextVar[ImportContext] = contextvars.ContextVar("qwc_import", default=ImportContext())


def _ctx() -> ImportContext:
    return _CONTEXT.get()


def _kname(name: str) -> str:
    return _ctx().kname(name)


class MatMulNBits(F.OnnxOpConverter):
    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        a, w, s = inputs[0], inputs[1], inputs[2]
        if len(inputs) > 3 and inputs[3] is not None:
            raise QwcError("MatMulNBits with explicit zero points is not supported (qwc emits symmetric Q4_0)")
        k, n, block, bits = int(attr["K"]), int(attr["N"]), int(attr["block_size"]), int(attr.get("bits", 4))
        bias = inputs[5] if len(inputs) > 5 else None
        path = q4_0_path(block, bits, _ctx().act_bits, _ctx().features)
        if path is not None:
            return cls.q4_0_matmul(bb, a, w, s, k, n, path, bias=bias)
        kernel = generic.matmul_nbits_a8 if _ctx().act_bits == 8 else generic.matmul_nbits
        out = bb.emit_te(kernel, a, w, s, k=k, n=n, block=block, bits=bits, primfunc_name_hint=_kname("matmul_nbits"))
        return out if bias is None else bb.emit(relax.op.add(out, bias))

    @classmethod
    def q4_0_matmul(cls, bb, a, w, s, k: int, n: int, path: str, features=None, bias=None):
        """a [..., K] (+ bias [N]) through one of qwc's Q4_0 kernels on [M, K] rows ("f32":
        W4A32; "x86", "arm": W4A8 integer dots); M = 1 selects the decode form."""
        lead = list(a.ty.shape)[:-1]
        a2 = bb.emit(relax.op.reshape(a, [-1, k]))
        m = a2.ty.shape[0]
        one_token = getattr(m, "value", None) == 1
        if path == "f32":
            y = cls._f32(bb, a2, m, one_token, w, s, k, n)
        else:
            silu, rms = _silu_mul_operands(bb, a), _rms_norm_operands(bb, a, k)
            if silu is not None:   # the quantizer computes silu(gate) * up itself
                silu = [_rows(bb, x, k) for x in silu]
            if rms is not None:    # ...or RMSNorm(x) * gamma
                rms = (_rows(bb, rms[0], k), *rms[1:])
            y, bias = cls._int8_dot(bb, a2, m, one_token, w, s, k, n, path,
                                    _ctx().features if features is None else features, silu, bias, rms)
        y = bb.emit(relax.op.reshape(y, [*lead, n]))
        return y if bias is None else bb.emit(relax.op.add(y, bias))

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
    def _int8_dot(bb, a2, m, one_token: bool, w, s, k: int, n: int, isa: str, features, silu=None, bias=None,
                  rms=None):
        """W4A8 through an ISA's integer dot-product kernel (vpdpbusd / sdot), both reading the
        row-group layout compile-time repacking wrote (kernels/row_groups.py). `silu`: (gate,
        up) [M, K] when a2 is silu(gate) * up, `rms`: (x [M, K], gamma, eps) when a2 is
        RMSNorm(x) * gamma; the activation quantizer then computes a2 itself (a2's own
        kernel is left unused and dead-code elimination drops it). Returns y and the bias
        still to add (None when the kernel added it: the x86 decode GEMV)."""
        from .kernels import act_quant

        if len(w.ty.shape) != 4:
            raise QwcError(f"MatMulNBits {n}x{k}: the W4A8 kernels read weights repacked into row groups "
                           "(compiler/repack.py), got the plain layout")
        nb = (k + act_quant.BLOCK - 1) // act_quant.BLOCK
        sdt = str(s.ty.dtype)
        tokens = None if one_token else _ctx().tuned.get(f"q4_a8_gemm_{n}x{k}", {}).get("tokens")  # `qwc tune`
        fused_bias = False
        w4a8 = kernels_for(features).w4a8
        impl = w4a8.decode if one_token else w4a8.prefill
        # How the kernel reads activations: the ARM kernels start from int32 offsets, the smmla
        # GEMM reads token pairs interleaved (act_quant.fused_quantizer).
        layout = w4a8.decode_layout if one_token else w4a8.prefill_layout
        if not one_token:
            kernel = bb.add_func(w4a8_gemm(impl, n, nb, sdt, tokens), _kname(f"q4_gemm_{impl}_{n}x{nb}_{sdt}"))
        elif impl == "sdot":
            from .kernels.arm import dotprod

            kernel = bb.add_func(dotprod.q4_dot(n, nb, True, sdt), _kname(f"q4_gemv_sdot_{n}x{nb}_{sdt}"))
        else:   # several of these may become one launch (compiler/sibling_gemvs.py)
            from .kernels.x86 import vnni

            fused_bias = bias is not None   # the decode GEMV adds it in its epilogue
            kernel = bb.add_func(vnni.decode_gemv(((n, fused_bias),), nb, sdt),
                                 _kname(f"q4_gemv_vnni_{n}x{nb}_{sdt}{'_bias' if fused_bias else ''}"))
        zp = w4a8_zero_point(impl)
        scales = [m, nb, 2] if layout == "arm_pairs" else [m, nb]   # act_quant.fused_quantizer
        q8 = [relax.TensorType(shape=[m, nb, act_quant.BLOCK], dtype="int8"),
              relax.TensorType(shape=scales, dtype="float32"),
              relax.TensorType(shape=scales, dtype="float32" if layout == "plain" else "int32")]
        # Decode: the gate and up GEMV computes silu(gate) * up and quantizes it itself, when
        # its blocks are whole (every Qwen2 size; else the quantizer below computes SiLU·mul)
        whole = silu is not None and one_token and isa == "x86" and k % act_quant.BLOCK == 0
        gate_up = _decode_gate_up(bb, *silu) if whole else None
        # ...and the o projection takes the blocks the decode attention wrote with its output
        attn_q8 = _decode_attention_q8(bb, a2) if one_token and isa == "x86" and silu is None and rms is None else None
        if attn_q8 is not None:
            q, scale, off = attn_q8
        else:
            if gate_up is not None:
                gnb = int(gate_up[3].ty.shape[1])
                from .kernels.x86 import vnni

                gu = bb.add_func(vnni.decode_gemv(((k, False), (k, False)), gnb, str(gate_up[4].ty.dtype),
                                                        silu_mul=True, quantize=zp),
                                 _kname(f"q4_gemv_vnni_silu_mul_q8_{k}x{gnb}"))
                parts = bb.emit(relax.call_tir(gu, gate_up, q8))
            else:
                eps = rms[2] if rms else None
                quant = bb.add_func(act_quant.fused_quantizer(k, zp, one_token, silu is not None, eps, layout),
                                    _kname(f"act_q8_{'silu_' if silu else 'rms_' if rms else ''}{k}_{int(one_token)}_sum{-zp}"
                                           + ("" if layout == "plain" else f"_{layout}")))
                parts = bb.emit(relax.call_tir(quant, list(silu) if silu else list(rms[:2]) if rms else [a2], q8))
            q, scale, off = (bb.emit(relax.TupleGetItem(parts, i)) for i in range(3))
        args = [q, scale, off, w, s] + ([bias] if fused_bias else [])
        y = bb.emit(relax.call_tir(kernel, args, relax.TensorType(shape=[m, n], dtype="float32")))
        return y, None if fused_bias else bias


def _binding(bb, x):
    """What a Relax var was bound to in this import (x itself if it is not a bound var)."""
    return bb.lookup_binding(x) if isinstance(x, relax.Var) and bb.lookup_binding(x) is not None else x


def _call_of(e, name: str) -> bool:
    import tvm

    return isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op) and e.op.name == name


def _unreshaped(bb, x):
    """The tensor a chain of reshapes made x from (x itself if none)."""
    e = _binding(bb, x)
    while _call_of(e, "relax.reshape"):
        x, e = e.args[0], _binding(bb, e.args[0])
    return x


def _rows(bb, x, k: int):
    """x as [M, K] rows, reshaped once from what reshapes made x from: two reshapes in a row
    fuse into a copy kernel, one is a view."""
    x = _unreshaped(bb, x)
    if len(x.ty.shape) == 2 and getattr(x.ty.shape[1], "value", None) == k:
        return x
    return bb.emit(relax.op.reshape(x, [-1, k]))


def _single_decode_gemv(bb, x):
    """(kernel GlobalVar, args) when x is (a reshape of) the output of one x86 decode GEMV
    without a bias (kernels/x86/vnni.py: decode_gemv), else None."""
    from .kernels.x86 import vnni

    e = _binding(bb, x)
    if _call_of(e, "relax.reshape"):
        e = _binding(bb, e.args[0])
    if not _call_of(e, "relax.call_tir"):
        return None
    func = bb.get()[e.args[0]]
    args = list(e.args[1].fields)
    if not (func.attrs and func.attrs.get(vnni.DECODE_GEMV)) or len(args) != 5:
        return None
    return e.args[0], args


def _decode_gemv_plus(bb, y, r):
    """y + r as one decode GEMV that adds r in its epilogue (r as the bias: one row), when y
    is a bias-free x86 decode GEMV's output of r's shape (the o and down projections are the
    skip input of the residual add); else None. The GEMV without the add is left to
    dead-code elimination."""
    from tvm_ffi import structural_equal

    from .kernels.x86 import vnni

    gemv = _single_decode_gemv(bb, y)
    if gemv is None or not structural_equal(y.ty.shape, r.ty.shape):
        return None
    gv, args = gemv
    n, nb, sdt = int(y.ty.shape[-1]), int(args[3].ty.shape[1]), str(args[4].ty.dtype)
    kernel = bb.add_func(vnni.decode_gemv(((n, True),), nb, sdt), gv.name_hint + "_bias")
    out = bb.emit(relax.call_tir(kernel, args + [bb.emit(relax.op.reshape(_unreshaped(bb, r), [n]))],
                                 relax.TensorType(shape=[1, n], dtype="float32")))
    return bb.emit(relax.op.reshape(out, y.ty.shape))


def _decode_gate_up(bb, gate, up):
    """[aq, ad, off, w_gate, s_gate, w_up, s_up] when gate and up [1, K] are x86 decode GEMV
    outputs (no bias) of the same activations: the arguments of one silu_mul GEMV that makes
    silu(gate) * up and its Q8_0 itself (kernels/x86/vnni.py: decode_gemv), leaving their own
    GEMVs and quantizers to dead-code elimination; else None."""
    calls = []
    for x in (gate, up):
        gemv = _single_decode_gemv(bb, x)
        if gemv is None:
            return None
        calls.append(gemv[1])

    def source(aq):   # the tensor the activation quantizer of `aq` read, reshapes looked through
        parts = _binding(bb, _binding(bb, aq).tuple_value)
        a2 = _binding(bb, parts.args[1].fields[0])
        return a2.args[0] if _call_of(a2, "relax.reshape") else a2

    if not source(calls[0][0]).same_as(source(calls[1][0])):
        return None
    return calls[0] + calls[1][3:]


def _rms_norm_operands(bb, a, k: int):
    """(x, gamma, eps) when `a` is RMSNorm over its last axis (K) with a [K] gamma, else None."""
    e = _binding(bb, a)
    if not _call_of(e, "relax.nn.rms_norm"):
        return None
    x, gamma = e.args
    rank = len(x.ty.shape)
    if ([int(ax) % rank for ax in e.attrs.axes] != [rank - 1] or [int(d) for d in gamma.ty.shape] != [k]
            or str(x.ty.dtype) != "float32" or str(gamma.ty.dtype) != "float32"):
        return None
    return x, gamma, float(e.attrs.epsilon)


def _silu_mul_operands(bb, a):
    """(gate, up) when `a` is silu(gate) * up as the exporter writes it, Mul(Mul(g,
    Sigmoid(g)), up) in either operand order and without broadcasting; else None."""
    from tvm_ffi import structural_equal

    e = _binding(bb, a)
    if not _call_of(e, "relax.multiply"):
        return None
    for silu, up in (e.args, e.args[::-1]):
        se = _binding(bb, silu)
        if not _call_of(se, "relax.multiply"):
            continue
        for g, sig in (se.args, se.args[::-1]):
            sg = _binding(bb, sig)
            if (_call_of(sg, "relax.sigmoid") and sg.args[0].same_as(g)
                    and structural_equal(g.ty.shape, a.ty.shape)
                    and structural_equal(up.ty.shape, a.ty.shape)):
                return g, up
    return None


class GatherBlockQuantized(F.OnnxOpConverter):
    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        w, idx, s = inputs[0], inputs[1], inputs[2]
        if attr.get("gather_axis", 0) != 0 or attr.get("quantize_axis", 1) != 2:
            raise QwcError("GatherBlockQuantized: qwc supports gather_axis 0, quantize_axis 2")
        if len(w.ty.shape) == 4:  # shared with an lm_head whose kernel reads a repacked layout
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
        total = _decode_gemv_plus(bb, inputs[1], inputs[0])
        if total is None:
            total = bb.emit(relax.op.add(inputs[0], inputs[1]))
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
        out = bb.emit_te(generic.rotary, x, pos, cos, sin, heads=heads, primfunc_name_hint=_kname("rotary"))
        _ctx().rotary_kernels[_binding(bb, out).args[0].name_hint] = heads   # decode attention may rotate itself
        return out


def _rotary_operands(bb, x, heads: int, head_dim: int):
    """(x, position_ids, cos, sin) when x is this import's rotary of heads x head_dim with cos
    and sin [P, head_dim / 2] (the layout decode attention's own rotary reads), else None."""
    e = _binding(bb, x)
    if not _call_of(e, "relax.call_tir") or _ctx().rotary_kernels.get(e.args[0].name_hint) != heads:
        return None
    args = list(e.args[1].fields)
    if ([getattr(d, "value", None) for d in args[0].ty.shape] != [1, 1, heads * head_dim]
            or [getattr(d, "value", None) for d in args[1].ty.shape] != [1, 1]
            or any(getattr(t.ty.shape[1], "value", None) != head_dim // 2 for t in args[2:])):
        return None
    return args


def _decode_attention_q8(bb, x):
    """[aq, ad, off] when x is (a reshape of) the output of a decode attention that also wrote
    it as Q8_0 blocks (GroupQueryAttention below), else None."""
    e = _binding(bb, _unreshaped(bb, x))
    if not isinstance(e, relax.TupleGetItem) or e.index != 0:
        return None
    call = _binding(bb, e.tuple_value)
    if not _call_of(call, "relax.call_tir_inplace"):
        return None
    attrs = bb.get()[call.args[0]].attrs
    if not (attrs and attrs.get(fast.WRITES_Q8)):
        return None
    return [bb.emit(relax.TupleGetItem(e.tuple_value, i)) for i in (3, 4, 5)]


class GroupQueryAttention(F.OnnxOpConverter):
    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        q, k, v, past_k, past_v, seqlens = (
            x if isinstance(x, relax.Var) else bb.emit(x) for x in inputs[:6])
        if attr.get("do_rotary", 0) or attr.get("softcap", 0.0) or attr.get("local_window_size", -1) != -1:
            raise QwcError("GroupQueryAttention: do_rotary, softcap and local windows are not supported")
        heads, kv_heads = int(attr["num_heads"]), int(attr["kv_num_heads"])
        head_dim = int(past_k.ty.shape[3])
        scale = float(attr.get("scale", 0.0)) or 1.0 / math.sqrt(head_dim)
        # The fast kernel reads K in its key-tile layout (kernels/attention.py); V, and K for
        # the generic kernel, are rows.
        tiled = fast.supports(head_dim)
        if (tiled and getattr(q.ty.shape[1], "value", None) == 1
                and kernels_for(_ctx().features).decode_attention == "three_pass"):
            fused = cls._decode(bb, q, k, v, past_k, past_v, seqlens, heads, kv_heads, head_dim, scale)
            if fused is not None:
                return fused
        write_k = bb.add_func(fast.kv_cache_write(tiled), _kname("k_cache_write_tiles" if tiled else "kv_cache_write"))
        write_v = bb.add_func(fast.kv_cache_write(False), _kname("kv_cache_write"))
        kc = bb.emit(relax.call_tir_inplace(write_k, [past_k, k, seqlens], 0, past_k.ty))
        vc = bb.emit(relax.call_tir_inplace(write_v, [past_v, v, seqlens], 0, past_v.ty))
        if tiled:
            kernel = bb.add_func(fast.attention(heads, kv_heads, head_dim, scale), _kname("attention_online"))
            out = bb.emit(relax.call_tir(kernel, [q, kc, vc, seqlens], q.ty))
        else:
            out = bb.emit_te(generic.attention, q, kc, vc, seqlens, heads=heads, kv_heads=kv_heads,
                             head_dim=head_dim, scale=scale, primfunc_name_hint=_kname("attention"))
        return relax.Tuple([out, kc, vc])

    @staticmethod
    def _decode(bb, q, k, v, past_k, past_v, seqlens, heads, kv_heads, head_dim, scale):
        """One token's attention as the one three-pass kernel that also rotates q and k and
        writes the cache (kernels/attention.py: decode_attention), when q and k are this
        import's rotary of one position; with the x86 W4A8 GEMVs it also writes its output's
        Q8_0 blocks, which the o projection takes (_decode_attention_q8). Else None."""
        from .kernels.x86 import vnni

        rq, rk = _rotary_operands(bb, q, heads, head_dim), _rotary_operands(bb, k, kv_heads, head_dim)
        if (not fast.fuses_decode_prologue(head_dim) or rq is None or rk is None
                or not all(a.same_as(b) for a, b in zip(rq[1:], rk[1:]))):
            return None
        pos, cos, sin = rq[1:]
        zp = vnni.ZERO_POINT if q4_0_path(32, 4, _ctx().act_bits, _ctx().features) == "x86" else None
        kernel = bb.add_func(fast.decode_attention(heads, kv_heads, head_dim, scale, str(pos.ty.dtype), zp),
                             _kname("attention_3pass" + ("" if zp is None else "_q8")))
        nb = heads * head_dim // 32
        q8 = [] if zp is None else [relax.TensorType(shape=[1, nb, 32], dtype="int8"),
                                    relax.TensorType(shape=[1, nb], dtype="float32"),
                                    relax.TensorType(shape=[1, nb], dtype="float32")]
        # outputs: out (new), the two caches (in place), the Q8_0 blocks (new)
        call = bb.emit(relax.call_tir_inplace(
            kernel, [rq[0], rk[0], v, past_k, past_v, seqlens, pos, cos, sin],
            [-1, 3, 4] + [-1] * len(q8), [q.ty, past_k.ty, past_v.ty] + q8))
        return relax.Tuple([bb.emit(relax.TupleGetItem(call, i)) for i in range(3)])


_QWC_CONVERTERS = {
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


def import_graph(model: onnx.ModelProto, seq: int | None = None, prefix: str = "", act_bits: int = 32,
                 features: frozenset = frozenset(), tuned: dict | None = None):
    """Import the canonical graph for batch 1 and `seq` new tokens (None: any number) as
    `main`; `prefix` names its kernels; `act_bits` 8 selects the W4A8 matmuls; `tuned` maps
    tuning task keys (compiler/tuning.py) to schedule knobs."""
    from tvm import tirx

    seq_dim = tirx.Var("seq", "int64") if seq is None else seq
    total, cache = tirx.Var("total", "int64"), tirx.Var("cache_len", "int64")
    present = {i.name for i in model.graph.input}
    shapes = {k: v for k, v in {"input_ids": [1, seq_dim], "position_ids": [1, seq_dim],
                                "attention_mask": [1, total]}.items() if k in present}
    for i in model.graph.input:
        if i.name.startswith("past_key_values."):
            dims = [d.dim_value for d in i.type.tensor_type.shape.dim]
            shapes[i.name] = [1, dims[1], cache, dims[3]]
    token = _CONTEXT.set(ImportContext(prefix, act_bits, frozenset(features), dict(tuned or {})))
    try:
        with qwc_converters(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # input renaming, the checker's view of com.microsoft ops
            return F.from_onnx(model, shape_dict=shapes, keep_params_in_input=True, sanitize_input_names=True)
    finally:
        _CONTEXT.reset(token)
