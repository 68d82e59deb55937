"""llama.cpp's Q6_K on its own x86 kernel (kernels/x86/q6_k.py), and as Q8_0 where a target has
none (compiler/repack_q6_k.py)."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize
from tvm import relax

from qwc.compiler.build import build
from qwc.compiler.frontend import MatMulNBits
from qwc.compiler.repack_q6_k import pack
from qwc.compiler.targets import get_target, kernel_summary
from qwc.models import gguf_blocks
from qwc.q4 import quantize_q8_0

from conftest import random_q6_k


def test_q6_k_blocks_dequantize_as_llama_cpp_does():
    raw = random_q6_k(np.random.default_rng(0), 5, 512)
    b = gguf_blocks.from_gguf(raw, "Q6_K", (5, 512), "w")
    assert b.bits == 8 and b.block == 16 and b.codes.shape == (5, 32, 16) and b.scales.shape == (5, 32)
    assert np.array_equal(gguf_blocks.dequantize(b), dequantize(raw, Q.Q6_K).reshape(5, 512))


def test_q6_k_factors_give_the_files_d_and_sc_back():
    """The kernels apply d and sc apart: taken back from their products, they are the file's
    where llama.cpp wrote them (one sc of -128 a super-block), and a pair with the same products
    otherwise."""
    rng = np.random.default_rng(1)
    raw = random_q6_k(rng, 6, 512, flat_row=False).reshape(6, 2, 210)
    raw[:3, :, 192] = np.uint8(0x80)   # rows 0-2: sc[0] = -128, as llama.cpp's quantizer makes the largest
    raw[..., 193:208] = (raw[..., 193:208].view(np.int8) // 2).view(np.uint8)   # |sc| < 64 elsewhere
    raw[3:, :, 192:208] = (raw[3:, :, 192:208].view(np.int8) * 2).view(np.uint8)   # rows 3-5: every sc even
    b = gguf_blocks.from_gguf(raw.reshape(6, -1), "Q6_K", (6, 512), "w")
    d, sc = gguf_blocks.q6_k_factors(b.scales)
    file_d = raw[..., 208:210].copy().view(np.float16)[..., 0].astype(np.float32)
    file_sc = raw[..., 192:208].view(np.int8).reshape(6, -1)
    assert np.array_equal(d[:3], file_d[:3]) and np.array_equal(sc[:3], file_sc[:3])
    assert np.array_equal(np.repeat(d, 16, axis=1) * sc, b.scales)   # every row: the same products
    assert not np.array_equal(sc[3:], file_sc[3:])                    # the even ones: d 2x, sc / 2


def _run_q6_k(k: int, n: int, m: int, raw: np.ndarray, a: np.ndarray, bias: np.ndarray | None):
    import tvm

    b = gguf_blocks.from_gguf(raw, "Q6_K", (n, k), "w")
    w, sc, d = pack(b.codes, b.scales)
    av = relax.Var("a", relax.TensorType([m, k], "float32"))
    vs = [relax.Var(x, relax.TensorType(list(t.shape), str(t.dtype))) for x, t in (("w", w), ("sc", sc), ("d", d))]
    bv = relax.Var("bias", relax.TensorType([n], "float32")) if bias is not None else None
    bb = relax.BlockBuilder()
    with bb.function("main", [av, *vs] + ([bv] if bv is not None else [])):
        with bb.dataflow():
            gv = bb.emit_output(MatMulNBits.q6_k_matmul(bb, av, *vs, k, n, bv))
        bb.emit_func_output(gv)
    vm = relax.VirtualMachine(build(bb.get(), get_target("x86-avx512")), tvm.cpu())
    args = [a, w, sc, d] + ([bias] if bias is not None else [])
    return vm["main"](*(tvm.runtime.tensor(x) for x in args)).numpy(), b


@pytest.mark.parametrize("m", [1, 3, 9])
# N = 150: decode's four streams of two row groups each, then the two left over (one ragged)
@pytest.mark.parametrize("k, n, with_bias", [(256, 32, False), (512, 40, True), (256, 150, True)])
def test_q6_k_kernel_computes_llama_cpps_w6a8(k, n, m, with_bias):
    """Decode (one token), a tile of 4 with leftovers, a ragged last row group (N = 40), against
    numpy in float64: the activations as Q8_0 blocks times the file's dequantized weights. The
    integer sums are exact; what differs is float32 rounding of the scales' products and the
    row sums, within a few ulps of the largest terms' magnitude."""
    from qwc import cpu

    if not cpu.has("avx512_vnni"):
        pytest.skip("runs AVX-512 VNNI code; this CPU has none")
    rng = np.random.default_rng(k + n + m)
    raw = random_q6_k(rng, n, k)
    # activations the quantizer takes exactly (codes times a power of two, one code a block
    # at 127): the check is then of the kernel, not of a rounding tie between two quantizers
    qa = rng.integers(-127, 128, (m, k // 32, 32))
    qa[..., 5] = 127
    da = np.ldexp(1.0, rng.integers(-8, 2, (m, k // 32, 1)))
    a = (qa * da).reshape(m, k).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32) if with_bias else None
    got, _ = _run_q6_k(k, n, m, raw, a, bias)
    assert np.array_equal(quantize_q8_0(a)[0], qa)
    a8 = a.astype(np.float64)
    w = dequantize(raw, Q.Q6_K).reshape(n, k).astype(np.float64)
    ref, scale = a8 @ w.T, np.abs(a8) @ np.abs(w).T
    if bias is not None:
        ref += bias
    assert (np.abs(got - ref) <= 1e-6 * scale + 1e-6).all(), np.abs(got - ref).max()


def test_targets_say_which_run_q6_k_natively():
    assert kernel_summary(get_target("x86-avx512"))["q6_k"] == "w6a8-vnni"
    assert kernel_summary(get_target("arm-yitian"))["q6_k"] == "as q8_0"
