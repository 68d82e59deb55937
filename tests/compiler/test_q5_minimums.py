"""A GGUF's Q5_0 / Q5_1 / Q5_K linears (8-bit codes u - 128 = q with a minimum m a block,
models/gguf_blocks.py) on the targets' kernels: five-bit codes on x86 VNNI ("vnni5") and ARM
sdot ("sdot5", under qemu; compiler/repack_five_bit.py), two Q4_0 halves where there are none
(AVX2, and float activations), each against the file's dequantized weights times the
activations as the kernels quantize them (llama.cpp's Q8_0 blocks; Q8_K's for ARM's Q5_K),
which the integer sums make exact up to float rounding."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from onnx import helper
from tvm import relax

from qwc import weight_formats
from qwc.compiler.build import build
from qwc.compiler.frontend import MatMulNBits
from qwc.compiler.kernels import row_groups
from qwc.compiler.repack import q8_0_nibble_halves
from qwc.compiler.repack_five_bit import five_bit_codes
from qwc.compiler.targets import five_bit_path, get_target, q8_0_path
from qwc.models import gguf_blocks
from qwc.passes.graph import BLOCK_OFFSETS_ATTR, tensor_array

from conftest import assert_arm_library_follows, compact_k_factors, random_q5_k

# K = 768: three super-blocks; N = 150: x86 decode's four streams and a ragged last row group
CASES = [(512, 40), (768, 150)]


def _weights(kind: Q, n: int, k: int, seed: int) -> tuple[np.ndarray, gguf_blocks.Blocks]:
    rng = np.random.default_rng(seed)
    if kind == Q.Q5_K:
        raw = random_q5_k(rng, n, k)
    else:
        raw = quantize((0.1 * rng.standard_normal((n, k)) + 0.02).astype(np.float32), kind)
    return raw, gguf_blocks.from_gguf(raw, kind.name, (n, k), "w")


def _q8_reference(a: np.ndarray, w: np.ndarray) -> np.ndarray:
    """a [M, K] quantized to int8 blocks of 32 as the kernels' quantizer does (a float32 scale
    amax / 127 a block, codes rounded), times w [N, K]."""
    blocks = a.reshape(a.shape[0], -1, 32)
    d = (np.abs(blocks).max(-1, keepdims=True) / np.float32(127)).astype(np.float32)
    q = np.rint(blocks / d)
    return (q.astype(np.float64) * d).reshape(a.shape) @ w.astype(np.float64).T


def _node(b: gguf_blocks.Blocks, n: int, k: int) -> onnx.ModelProto:
    """The folded node (compiler/block_minimums.py's result) in a model, for the compile-time
    rewrites to act on."""
    parts = ((b.codes, "w"), (b.scales, "s")) + (((b.minimums, "m"),) if b.minimums is not None else ())
    inits = [onnx.numpy_helper.from_array(x, name) for x, name in parts]
    node = helper.make_node("MatMulNBits", ["x", *(name for _, name in parts)], ["y"], domain="com.microsoft",
                            K=k, N=n, bits=8, block_size=32)
    weight_formats.mark(node, b.fmt)   # (the format's marker, as the export writes and the fold keeps it)
    if b.minimums is not None:
        node.attribute.append(helper.make_attribute(BLOCK_OFFSETS_ATTR, 1))
    return helper.make_model(helper.make_graph([node], "g", [], [], inits))


def _emit(bb, name: str, b: gguf_blocks.Blocks, k: int, n: int, m: int, target: str, act_bits: int = 8,
          as_bytes: bool = False):
    """Function `name`(a, weights...) through `target`'s kernels for the node, laid out as
    compile time lays it out (`as_bytes`: as codes that do not fit five bits are); returns
    those weights."""
    t = get_target(target)
    isa = "arm" if t.arch == "aarch64" else "x86"
    av = relax.Var("a", relax.TensorType([m, k], "float32"))
    if five_bit_path(32, 8, act_bits, t.features) and not as_bytes:   # five-bit codes (repack_five_bit.py)
        model = _node(b, n, k)
        assert five_bit_codes(model, act_bits, t.features) == 1
        inits = {x.name: tensor_array(x) for x in model.graph.initializer}
        weights = [inits[x] for x in model.graph.node[0].input[1:4]]
        bits = 5
    elif q8_0_path(32, 8, act_bits, t.features):   # the W8A8 kernels, the minimums as block offsets
        w, s = row_groups.pack_int8(b.codes, b.scales, signed=isa == "arm")
        weights, bits = [w, s, row_groups.pack_offsets(b.minimums)], 8
    else:   # two Q4_0 halves (repack.q8_0_nibble_halves), the low one with offsets m + 8 d
        model = _node(b, n, k)
        assert q8_0_nibble_halves(model, act_bits, t.features) == 1
        inits = {x.name: tensor_array(x) for x in model.graph.initializer}
        node = model.graph.node[0]
        weights = [inits[node.input[i]] for i in (1, 2, 6, 7, 3)]
    vs = [relax.Var(f"v{i}", relax.TensorType(list(x.shape), str(x.dtype))) for i, x in enumerate(weights)]
    with bb.function(name, [av, *vs]):
        with bb.dataflow():
            if len(vs) == 3:
                y = MatMulNBits.q4_0_matmul(bb, av, vs[0], vs[1], k, n, isa, t.features, offsets=vs[2], bits=bits)
            else:
                path = "f32" if act_bits == 32 else isa
                hi = MatMulNBits.q4_0_matmul(bb, av, vs[0], vs[1], k, n, path, t.features)
                lo = MatMulNBits.q4_0_matmul(bb, av, vs[2], vs[3], k, n, path, t.features, offsets=vs[4])
                y = bb.emit(relax.op.add(hi, lo))
            gv = bb.emit_output(y)
        bb.emit_func_output(gv)
    return weights


def _run(target: str, b, k: int, n: int, a: np.ndarray, act_bits: int = 8) -> np.ndarray:
    import tvm

    bb = relax.BlockBuilder()
    weights = _emit(bb, "main", b, k, n, a.shape[0], target, act_bits)
    vm = relax.VirtualMachine(build(bb.get(), get_target(target)), tvm.cpu())
    return vm["main"](*(tvm.runtime.tensor(x) for x in [a, *weights])).numpy()


@pytest.mark.parametrize("m", [1, 9])
def test_q5_0_takes_five_bit_codes_with_offsets_of_minus_16_d(m):
    """A Q5_0 tensor (8-bit codes q - 16 + 128, no minimums) on x86 VNNI: codes 0..31, read from
    -8 as Q4_0's nibbles are, and block offsets -8 d: the same values."""
    from qwc import cpu

    if not cpu.has("avx512_vnni"):
        pytest.skip("runs avx512_vnni code; this CPU has none")
    k, n = CASES[1]
    raw, b = _weights(Q.Q5_0, n, k, m)
    model = _node(b, n, k)
    assert five_bit_codes(model, 8, get_target("x86-avx512").features) == 1
    offsets = tensor_array(next(t for t in model.graph.initializer if t.name.endswith("offsets")))
    assert np.array_equal(offsets, row_groups.pack_offsets(-8 * b.scales))
    a = np.random.default_rng(m).standard_normal((m, k)).astype(np.float32)
    got = _run("x86-avx512", b, k, n, a)
    ref = _q8_reference(a, dequantize(raw, Q.Q5_0).reshape(n, k))
    assert np.abs(got - ref).max() < 1e-5 * np.abs(ref).max()


def test_q5_k_five_bit_codes_keep_the_files_factors():
    """Q5_K's d sc and -dmin mn come back as the file's 6-bit sc, mn and fp16 d, dmin
    (kernels/q4_k_scales.py's form, as compact Q4_K); Q5_1 keeps float32 offsets m + 8 d."""
    k, n = CASES[1]
    for kind, compact in ((Q.Q5_K, True), (Q.Q5_1, False)):
        _, b = _weights(kind, n, k, 2)
        model = _node(b, n, k)
        assert five_bit_codes(model, 8, get_target("x86-avx512").features) == 1
        node = model.graph.node[0]
        inits = {x.name: tensor_array(x) for x in model.graph.initializer}
        s, c = inits[node.input[2]], inits[node.input[3]]
        assert (s.dtype == np.uint8) == compact and any(a.name == "qwc_q4_k_scales" for a in node.attribute) == compact
        if compact:   # sc and mn a block, then d and dmin a super-block, per row group
            scales, mins = compact_k_factors(s, c, n)
            assert np.array_equal(scales, b.scales) and np.array_equal(mins, b.minimums)
        else:
            want = (b.minimums.astype(np.float64) + 8 * b.scales.astype(np.float64)).astype(np.float32)
            assert np.array_equal(c, row_groups.pack_offsets(want))


def test_codes_that_do_not_fit_five_bits_keep_their_bytes():
    k, n = CASES[0]
    _, b = _weights(Q.Q5_1, n, k, 0)
    b.codes[3, 2, 7] = 160   # q = 32
    assert five_bit_codes(_node(b, n, k), 8, get_target("x86-avx512").features) == 0


def test_q5_blocks_are_the_files_weights():
    for kind in (Q.Q5_K, Q.Q5_1):
        raw, b = _weights(kind, 8, 512, 1)
        assert b.bits == 8 and b.codes.min() >= 128 and b.codes.max() <= 159
        assert np.array_equal(gguf_blocks.dequantize(b), dequantize(raw, kind).reshape(8, 512)), kind


# (the W8A8 form with offsets, which VNNI takes for codes that span more than five bits, is
# the ARM test's "bytes" cases: test_arm_kernels_take_five_bit_codes)
X86 = {"vnni5": ("x86-avx512", "avx512_vnni", 8), "avx2": ("x86-avx2", "avx2", 8), "f32": ("x86-avx512", "avx512f", 32)}


@pytest.mark.parametrize("path", sorted(X86))
@pytest.mark.parametrize("kind", [Q.Q5_K, Q.Q5_1], ids=["q5_k", "q5_1"])
@pytest.mark.parametrize("m", [1, 3, 9])
@pytest.mark.parametrize("k, n", CASES)
def test_x86_kernels_add_the_block_minimums(path, kind, m, k, n):
    """Decode (one token), the few-token streams and a prefill tile with leftovers."""
    from qwc import cpu

    target, need, act_bits = X86[path]
    if not cpu.has(need):
        pytest.skip(f"runs {need} code; this CPU has none")
    raw, b = _weights(kind, n, k, k + n + m)
    a = np.random.default_rng(m).standard_normal((m, k)).astype(np.float32)
    w = dequantize(raw, kind).reshape(n, k)
    got = _run(target, b, k, n, a, act_bits)
    ref = _q8_reference(a, w) if act_bits == 8 else a.astype(np.float64) @ w.astype(np.float64).T
    assert np.abs(got - ref).max() < 1e-5 * np.abs(ref).max(), np.abs(got - ref).max() / np.abs(ref).max()


@pytest.mark.arm
@pytest.mark.slow
def test_arm_kernels_take_five_bit_codes(tmp_path):
    """arm-yitian (smmla5 prefill, sdot5 decode) and arm-neon (sdot5) under qemu-aarch64, at 1,
    3, 9, 13 (whole tiles and a lone pair), 17 and 27 tokens (two whole tiles: the codes made once a
    task), Q5_K (the file's factors, on Q8_K activations as compact Q4_K's), Q5_1 and
    Q5_0 (block offsets, on Q8_0 blocks): five bits a weight in memory; and Q5_1 as bytes on the
    W8A8 kernels. Each result is the file's weights times the activations within float32
    rounding, the same bits at 1, 3, 8 and 64 threads."""
    from conftest import q8_k

    inputs, refs = {}, {}
    for target in ("arm-yitian", "arm-neon"):
        bb, prefix = relax.BlockBuilder(), target.replace("-", "_")
        # (Q5_1 "bytes": the W8A8 kernels with block offsets, which codes wider than five bits take)
        for kind, as_bytes in ((Q.Q5_K, False), (Q.Q5_1, False), (Q.Q5_0, False), (Q.Q5_1, True)):
            for k, n in CASES:
                for m in (1, 3, 9, 13, 17, 27):
                    raw, b = _weights(kind, n, k, k + n + m)
                    a = np.random.default_rng(m).standard_normal((m, k)).astype(np.float32)
                    name = f"{prefix}_{kind.name}{'_bytes' if as_bytes else ''}_{k}_{n}_{m}"
                    weights = _emit(bb, name, b, k, n, m, target, as_bytes=as_bytes)
                    assert weights[0].shape[2] == (row_groups.INT8_CHUNKS if as_bytes else row_groups.FIVE_BIT_CHUNKS)
                    for i, x in enumerate([a, *weights]):
                        inputs[f"{name}/{i}"] = x
                    w = dequantize(raw, kind).reshape(n, k)
                    refs[name] = (q8_k(a) @ w.T.astype(np.float64) if kind == Q.Q5_K else _q8_reference(a, w))
        assert_arm_library_follows(bb, target, inputs, refs, prefix, tmp_path)
