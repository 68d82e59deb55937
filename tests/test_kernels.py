"""Every host matmul kernel against numpy on awkward shapes: K not a multiple of 128 (and not
of 32), N not a multiple of the row interleave, M = 1, 3, 17."""

from __future__ import annotations

import numpy as np
import pytest
from tvm import relax

from qwc.compiler.build import build
from qwc.compiler.frontend import MatMulNBits
from qwc.compiler.kernels import generic
from qwc.compiler.kernels.x86 import vnni
from qwc.compiler.targets import get_target
from qwc.q4 import pack_nibbles, quantize_q4_0, quantize_q8_0

SHAPES = [(96, 24), (160, 6), (100, 20), (896, 40)]   # (K, N)


def _weights(k, n, seed):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32)
    q, d = quantize_q4_0(w)
    deq = ((q.astype(np.float32) - 8) * d[..., None]).reshape(n, -1)
    return pack_nibbles(q), d, deq


def _run(variant, k, n, m, a, wp, d):
    import tvm

    target = get_target("host")
    if variant == "vnni":
        wp, d = vnni.pack(wp, d)   # the layout compile-time repacking gives it
    bb = relax.BlockBuilder()
    av = relax.Var("a", relax.TensorType([m, k], "float32"))
    wv = relax.Var("w", relax.TensorType(list(wp.shape), "uint8"))
    sv = relax.Var("s", relax.TensorType(list(d.shape), str(d.dtype)))
    with bb.function("main", [av, wv, sv]):
        with bb.dataflow():
            if variant == "f32":
                out = MatMulNBits.q4_0_matmul(bb, av, wv, sv, k, n, "f32")
            elif variant == "vnni":
                out = MatMulNBits.q4_0_matmul(bb, av, wv, sv, k, n, "x86")
            else:
                kern = generic.matmul_nbits if variant == "generic32" else generic.matmul_nbits_a8
                out = bb.emit_te(kern, av, wv, sv, k=k, n=n, block=32, bits=4, primfunc_name_hint="mm")
            gv = bb.emit_output(out)
        bb.emit_func_output(gv)
    ex = build(bb.get(), target)
    vm = relax.VirtualMachine(ex, tvm.cpu())
    dev = tvm.cpu()
    return vm["main"](*(tvm.runtime.tensor(x, dev) for x in (a, wp, d))).numpy()


def _a8_reference(a, deq_q, d, k):
    """llama.cpp's W4A8: activations as Q8_0 per 32-block, integer dots, fp32 block scales."""
    qa, da = quantize_q8_0(a)
    a8 = (qa.astype(np.float32) * da[..., None]).reshape(a.shape[0], -1)
    return a8 @ deq_q.T


@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("k, n", SHAPES)
@pytest.mark.parametrize("variant", ["f32", "generic32"])
def test_w4a32_kernels(variant, k, n, m):
    wp, d, deq = _weights(k, n, k + n)
    a = np.random.default_rng(m).standard_normal((m, k)).astype(np.float32)
    got = _run(variant, k, n, m, a, wp, d)
    ref = a @ deq[:, :k].T
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("k, n", SHAPES)
@pytest.mark.parametrize("variant", ["vnni", "generic8"])
def test_w4a8_kernels(variant, k, n, m):
    if variant == "vnni" and "avx512_vnni" not in get_target("host").features:
        pytest.fail("this test expects an AVX-512 VNNI host (the project's CI machine has one)")
    wp, d, deq = _weights(k, n, k + n)
    a = np.random.default_rng(m).standard_normal((m, k)).astype(np.float32)
    got = _run(variant, k, n, m, a, wp, d)
    ref = _a8_reference(a, deq, d, k)
    # activation rounding ties (round-half-even vs away) may differ: one step of one block
    np.testing.assert_allclose(got, ref, rtol=0, atol=2e-3 * np.abs(ref).max())
    exact = a @ deq[:, :k].T
    assert np.abs(got - exact).max() < 0.05 * np.abs(exact).max()   # and int8 activations are close
