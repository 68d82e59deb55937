"""Q4_K's compact scales (kernels/q4_k_scales.py, compiler/repack_q4_k.py): the file's factors
come back from the canonical graph's float32 scales; the x86 W4A8 kernels reading them (VNNI and
AVX2) give the expanded form's numbers to the bit, and the ARM ones (sdot and smmla under qemu),
on Q8_K activations, the file's weights times those activations."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize
from tvm import relax

from qwc.compiler.build import build
from qwc.compiler.frontend import MatMulNBits
from qwc.compiler.kernels import row_groups
from qwc.compiler.repack_q4_k import pack
from qwc.compiler.targets import get_target
from qwc.models import gguf_blocks

from conftest import assert_arm_library_follows, q8_k, random_q4_k


def _blocks(raw: np.ndarray, n: int, k: int):
    b = gguf_blocks.from_gguf(raw, "Q4_K", (n, k), "w")
    return b, gguf_blocks.block_mins(b.scales, b.zero_points, "q4_k"), ~b.codes.any(-1)


def _file_d(raw: np.ndarray, n: int, k: int) -> np.ndarray:
    """The file's own d [N, K/256], read from its bytes."""
    return raw.reshape(n, k // 256, 144)[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)


def test_q4_k_factors_give_the_files_d_and_scales_back():
    """Where a super-block's largest sc is 63 (llama.cpp's quantizer writes that) the pair is
    the file's own; elsewhere (random scales here, a searched quantizer's) another pair with the
    same products to the bit; the free sub-block (scale 0, codes 0) takes sc = 0."""
    n, k = 64, 512
    raw = random_q4_k(np.random.default_rng(3), n, k)
    b, mins, free = _blocks(raw, n, k)
    d, sc, dmin, mn = gguf_blocks.q4_k_factors(b.scales, mins, free)
    fd = _file_d(raw, n, k)
    fsc = np.rint(b.scales / np.repeat(fd, 8, axis=1))   # (the free sub-block: 1 / d, not 63)
    assert free[0, 0] and not sc[free].any()   # (random scales: about one sub-block in 64 is 0)
    assert np.array_equal(np.repeat(d, 8, axis=1) * sc, np.where(free, 0, b.scales))
    assert np.array_equal(-(np.repeat(dmin, 8, axis=1) * mn), mins)
    top = np.where(free, 0, fsc).reshape(n, -1, 8).max(-1) == 63
    assert top.sum() >= 10 and np.array_equal(d[top], fd[top])
    assert np.array_equal(d.astype(np.float16).astype(np.float32), d) and sc.max() <= 63 and mn.max() <= 63


def test_scales_that_are_no_fp16_times_six_bits_keep_the_expanded_form():
    n, k = 4, 256
    b, mins, free = _blocks(random_q4_k(np.random.default_rng(4), n, k), n, k)
    bad = b.scales.copy()
    bad[2, 3] = np.nextafter(bad[2, 3], np.float32(1))   # one ulp off d sc
    assert gguf_blocks.q4_k_factors(bad, mins, free) is None
    assert pack(b.codes, bad, b.zero_points) is None
    assert pack(b.codes, b.scales, b.zero_points) is not None


def test_arm_stores_sc_and_mn_at_six_bits_in_pairs_of_blocks():
    """ARM's compact scales are the file's 12 bytes of sc and mn a super-block and row: 48
    bytes a row group and pair of blocks, from which kernels/q4_k_scales.py's rule (the low
    six bits of A, B, C; mn1 from their top two bits) gives back every sc and mn."""
    n, k = 40, 512
    b, mins, free = _blocks(random_q4_k(np.random.default_rng(5), n, k), n, k)
    _, sc, _, mn = gguf_blocks.q4_k_factors(b.scales, mins, free)
    _, ws, wc = pack(b.codes, b.scales, b.zero_points, "arm")
    _, ws_x86, _ = pack(b.codes, b.scales, b.zero_points)
    g = row_groups.groups(n)
    assert ws.shape == (g, k // 64, 48) and ws.nbytes * 8 == g * 16 * k // 32 * 12
    a, bb_, c = (ws[..., 16 * i:16 * (i + 1)] for i in range(3))
    got_sc = np.stack([a & 63, c & 63], 2).reshape(g, -1, 16)
    got_mn = np.stack([bb_ & 63, (a >> 6) | ((bb_ >> 6) << 2) | ((c >> 6) << 4)], 2).reshape(g, -1, 16)
    rows = np.arange(g * 16) < n
    assert np.array_equal(got_sc.transpose(0, 2, 1).reshape(g * 16, -1)[rows], sc)
    assert np.array_equal(got_mn.transpose(0, 2, 1).reshape(g * 16, -1)[rows], mn)
    assert np.array_equal(ws_x86[..., :16], got_sc) and np.array_equal(ws_x86[..., 16:], got_mn)


def _emit(bb, name: str, k: int, n: int, m: int, raw: np.ndarray, compact: bool, target: str):
    """Function `name`(a, w, s, c) through `target`'s W4A8 kernels on the compact form, or on the expanded one made from the same factors (float32 d sc and
    c = 8 d sc - dmin mn, as compiler/repack.py's q4_1_block_offsets gives them); returns
    those weights."""
    b, mins, free = _blocks(raw, n, k)
    t = get_target(target)
    isa = "arm" if t.arch == "aarch64" else "x86"
    w, ws, wc = pack(b.codes, b.scales, b.zero_points, isa)
    if not compact:
        d, sc, dmin, mn = gguf_blocks.q4_k_factors(b.scales, mins, free)
        s = np.repeat(d, 8, axis=1).astype(np.float64) * sc
        c = (8 * s - np.repeat(dmin, 8, axis=1).astype(np.float64) * mn).astype(np.float32)
        w, ws = row_groups.pack(b.codes, s.astype(np.float32))
        wc = row_groups.pack_offsets(c)
    av = relax.Var("a", relax.TensorType([m, k], "float32"))
    vs = [relax.Var(x, relax.TensorType(list(a.shape), str(a.dtype))) for x, a in zip("wsc", (w, ws, wc))]
    with bb.function(name, [av, *vs]):
        with bb.dataflow():
            gv = bb.emit_output(MatMulNBits.q4_0_matmul(bb, av, vs[0], vs[1], k, n, isa, t.features, offsets=vs[2]))
        bb.emit_func_output(gv)
    return [w, ws, wc]


# N = 150: x86 decode's four streams of two row groups, then the two left over (one ragged);
# K = 768: three super-blocks, so a block's super-block index is read at b // 8 past the first
CASES = [(512, 40), (768, 150)]
X86 = {"vnni": ("x86-avx512", "avx512_vnni"), "avx2": ("x86-avx2", "avx2")}


def _inputs(k: int, n: int, m: int):
    rng = np.random.default_rng(k + n + m)
    raw = random_q4_k(rng, n, k)
    return raw, rng.standard_normal((m, k)).astype(np.float32)


@pytest.mark.parametrize("dot", sorted(X86))
@pytest.mark.parametrize("m", [1, 3, 9])
@pytest.mark.parametrize("k, n", CASES)
def test_x86_kernels_read_compact_q4_k_as_the_expanded_form(dot, k, n, m):
    """Decode (one token), the few-token streams and a prefill tile with leftovers: the same
    bits as the expanded scales and offsets, and within int8 activations' error of the file's
    dequantized weights."""
    import tvm

    from qwc import cpu

    target, need = X86[dot]
    if not cpu.has(need):
        pytest.skip(f"runs {need} code; this CPU has none")
    raw, a = _inputs(k, n, m)
    outs = []
    for compact in (True, False):
        bb = relax.BlockBuilder()
        weights = _emit(bb, "main", k, n, m, raw, compact, target)
        vm = relax.VirtualMachine(build(bb.get(), get_target(target)), tvm.cpu())
        outs.append(vm["main"](*(tvm.runtime.tensor(x) for x in [a, *weights])).numpy())
    assert np.array_equal(outs[0], outs[1])
    ref = a @ dequantize(raw, Q.Q4_K).reshape(n, k).T
    assert np.abs(outs[0] - ref).max() < 2e-2 * np.abs(ref).max()


def _decode_split_case(bb, name: str, k: int, n: int, raw: np.ndarray, split: int):
    """The ARM decode GEMV on compact Q4_K with its blocks in `split` parts of whole
    super-blocks (compiler/split_residual_gemv.py), the parts summed after."""
    from qwc.compiler.kernels import act_quant, decode_gemv

    b, _, _ = _blocks(raw, n, k)
    w, ws, wc = pack(b.codes, b.scales, b.zero_points, "arm")
    nb = k // 32
    av = relax.Var("a", relax.TensorType([1, k], "float32"))
    vs = [relax.Var(x, relax.TensorType(list(x_.shape), str(x_.dtype))) for x, x_ in zip("wsc", (w, ws, wc))]
    with bb.function(name, [av, *vs]):
        with bb.dataflow():
            quant = bb.add_func(act_quant.fused_quantizer(k, -8, True, layout="arm", super_blocks=True), "quant_k")
            q = bb.emit(relax.call_tir(quant, [av], [relax.TensorType([1, nb, 32], "int8"),
                                                     relax.TensorType([1, nb], "float32"),
                                                     relax.TensorType([1, nb], "int32")]))
            act = [bb.emit(relax.TupleGetItem(q, j)) for j in range(3)]
            gemv = bb.add_func(decode_gemv(((n, False, True),), nb, "uint8", dot="sdot", split=split),
                               f"gemv_k_split{split}_{k}")
            ys = bb.emit(relax.call_tir(gemv, act + vs, relax.TensorType([split, n], "float32")))
            gv = bb.emit_output(bb.emit(relax.op.sum(ys, axis=[0], keepdims=True)))
        bb.emit_func_output(gv)
    return [w, ws, wc]


@pytest.mark.arm
@pytest.mark.slow
def test_arm_kernels_on_compact_q4_k_take_q8_k_activations(tmp_path):
    """arm-yitian (smmla prefill, sdot decode) and arm-neon (sdot prefill) under qemu-aarch64,
    at 1, 3, 9 and 17 tokens, and the decode GEMV split in parts of whole super-blocks: the
    compact form's activations are Q8_K's (a scale a super-block), its decode GEMV takes the
    sub-block scales on integer sums, and every result is the file's weights times those
    activations within float32 rounding, the same bits at 1, 3, 8 and 64 threads."""

    inputs, refs = {}, {}
    for target in ("arm-yitian", "arm-neon"):
        bb, prefix = relax.BlockBuilder(), target.replace("-", "_")
        for k, n in CASES:
            for m in (1, 3, 9, 17):
                raw, a = _inputs(k, n, m)
                name = f"{prefix}_{k}_{n}_{m}"
                for i, x in enumerate([a, *_emit(bb, name, k, n, m, raw, True, target)]):
                    inputs[f"{name}/{i}"] = x
                refs[name] = q8_k(a) @ dequantize(raw, Q.Q4_K).reshape(n, k).T.astype(np.float64)
            raw, a = _inputs(k, n, 1)
            for split in range(2, k // 256 + 1):   # parts of 1 .. super-blocks
                name = f"{prefix}_split{split}_{k}_{n}"
                for i, x in enumerate([a, *_decode_split_case(bb, name, k, n, raw, split)]):
                    inputs[f"{name}/{i}"] = x
                refs[name] = refs[f"{prefix}_{k}_{n}_1"]
        assert_arm_library_follows(bb, target, inputs, refs, prefix, tmp_path)


def _host(func):
    import tvm

    return tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}),
                       target=get_target("host").tvm_target())


@pytest.mark.parametrize("kind, k, m", [("plain", 512, 1), ("plain", 8960, 1), ("rms", 1536, 1), ("rms", 768, 5),
                                        ("silu", 768, 3), ("silu", 8960, 1), ("parts", 1536, 1)])
def test_the_quantizer_by_super_blocks_is_llama_cpps_q8_k(kind, k, m):
    """act_quant's super_blocks ("arm" layout; the decode forms run by super-blocks in parallel,
    the RMSNorm's in tasks of whole super-blocks): one scale a super-block at each of its
    blocks' places, codes as Q8_K rounds them, each block's offset -8 x the sum of its codes."""
    import tvm

    from qwc.compiler.kernels import act_quant

    rng = np.random.default_rng(k + m)
    x = rng.standard_normal((2 if kind == "parts" else m, k)).astype(np.float32)
    nb = k // 32
    outs = [np.zeros((m, nb, 32), np.int8), np.zeros((m, nb), np.float32), np.zeros((m, nb), np.int32)]
    gamma = rng.uniform(0.5, 1.5, k).astype(np.float32)
    up = rng.standard_normal((m, k)).astype(np.float32)
    if kind == "plain":
        f, args, want = act_quant.fused_quantizer(k, -8, m == 1, layout="arm", super_blocks=True), [x], x
    elif kind == "silu":
        f, args = act_quant.fused_quantizer(k, -8, m == 1, silu_mul=True, layout="arm", super_blocks=True), [x, up]
        want = x / (1 + np.exp(-x)) * up
    else:
        parts = 2 if kind == "parts" else 1
        f = act_quant.fused_quantizer(k, -8, m == 1, rms_eps=1e-6, layout="arm", parts=parts, super_blocks=True)
        args = [x, gamma]
        h = x.sum(0, keepdims=True) if parts > 1 else x
        want = h / np.sqrt((h * h).mean(-1, keepdims=True) + 1e-6) * gamma
        if parts > 1:
            outs.append(np.zeros((1, k), np.float32))
    got = [tvm.runtime.tensor(o) for o in outs]
    _host(f)(*(tvm.runtime.tensor(a) for a in args), *got)
    aq, ad, off = (g.numpy() for g in got[:3])
    sb = want.reshape(m, -1, 256)
    d = np.abs(sb).max(-1) / np.float32(127)
    np.testing.assert_allclose(ad, np.repeat(d, 8, axis=1), rtol=1e-6)
    codes = np.concatenate([aq[..., :16, None], aq[..., 16:, None]], -1).reshape(m, k)   # de-interleaved
    r = (want.astype(np.float32) / np.repeat(ad, 32, axis=1)).astype(np.float32)
    expect = np.sign(r) * np.floor(np.abs(r) + np.float32(0.5))   # halves away from zero
    if kind == "plain":   # the same input: the same codes
        assert np.array_equal(codes, expect)
    else:   # the norm or silu(gate) * up computed in another order: a code off by one at a tie at most
        assert np.abs(codes - expect).max() <= 1 and (codes != expect).mean() < 1e-3
    assert np.array_equal(off, -8 * aq.astype(np.int32).sum(-1))
    if kind == "parts":
        assert np.array_equal(got[3].numpy(), x.sum(0, keepdims=True))


def test_super_block_scales_need_whole_super_blocks_in_an_arm_layout():
    from qwc.compiler.kernels import act_quant

    with pytest.raises(ValueError, match="K a multiple of 256"):
        act_quant.fused_quantizer(896, -8, True, layout="arm", super_blocks=True)
    with pytest.raises(ValueError, match="in 'plain'"):
        act_quant.fused_quantizer(512, -8, True, super_blocks=True)
