"""Every host matmul kernel against numpy on awkward shapes: K not a multiple of 128 (and not
of 32), N not a multiple of the row interleave, M = 1, 3, 17."""

from __future__ import annotations

import numpy as np
import pytest
from tvm import relax

from qwc.compiler.build import build
from qwc.compiler.frontend import MatMulNBits
from qwc.compiler.kernels import generic
from qwc.compiler.kernels import row_groups
from qwc.compiler.targets import get_target
from qwc.q4 import pack_nibbles, quantize_q4_0, quantize_q8_0

SHAPES = [(96, 24), (160, 6), (100, 20), (896, 40)]   # (K, N)


def _weights(k, n, seed):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32)
    q, d = quantize_q4_0(w)
    deq = ((q.astype(np.float32) - 8) * d[..., None]).reshape(n, -1)
    return pack_nibbles(q), d, deq


def _emit(bb, name, variant, k, n, m, wp, d, features=None):
    """Function `name`(a, w, s) through one kernel variant for a target's `features` (the
    host's by default); returns the weights in the layout it reads (compile-time repacking
    gives the W4A8 kernels row groups)."""
    if variant in ("vnni", "arm"):
        wp, d = row_groups.pack(wp, d)
    av = relax.Var("a", relax.TensorType([m, k], "float32"))
    wv = relax.Var("w", relax.TensorType(list(wp.shape), "uint8"))
    sv = relax.Var("s", relax.TensorType(list(d.shape), str(d.dtype)))
    with bb.function(name, [av, wv, sv]):
        with bb.dataflow():
            if variant in ("f32", "vnni", "arm"):
                out = MatMulNBits.q4_0_matmul(bb, av, wv, sv, k, n, {"vnni": "x86"}.get(variant, variant),
                                              features if features is not None else get_target("host").features)
            else:
                kern = generic.matmul_nbits if variant == "generic32" else generic.matmul_nbits_a8
                out = bb.emit_te(kern, av, wv, sv, k=k, n=n, block=32, bits=4, primfunc_name_hint="mm")
            gv = bb.emit_output(out)
        bb.emit_func_output(gv)
    return wp, d


def _run(variant, k, n, m, a, wp, d):
    import tvm

    bb = relax.BlockBuilder()
    wp, d = _emit(bb, "main", variant, k, n, m, wp, d)
    vm = relax.VirtualMachine(build(bb.get(), get_target("host")), tvm.cpu())
    return vm["main"](*(tvm.runtime.tensor(x) for x in (a, wp, d))).numpy()


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


@pytest.mark.slow
@pytest.mark.parametrize("target", ["arm-yitian", "arm-neon"])
def test_w4a8_arm_kernels_under_qemu(target, tmp_path):
    """The ARM kernels (sdot for M = 1; for M > 1 smmla on arm-yitian, sdot on arm-neon),
    cross-compiled, on every shape and M above in one library run under qemu-aarch64
    (scripts/arm64), against the same reference as the host's."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    import tvm

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts" / "arm64"))
    import emulation

    env = emulation.arm64_env()
    t = get_target(target)
    bb, inputs, refs = relax.BlockBuilder(), {}, {}
    for k, n in SHAPES:
        for m in (1, 3, 17):
            name = f"mm_{k}_{n}_{m}"
            wp, d, deq = _weights(k, n, k + n)
            a = np.random.default_rng(m).standard_normal((m, k)).astype(np.float32)
            for i, x in enumerate((a, *_emit(bb, name, "arm", k, n, m, wp, d, t.features))):
                inputs[f"{name}/{i}"] = x
            refs[name] = _a8_reference(a, deq, d, k)
    lib = tmp_path / "kernels.so"
    build(bb.get(), t).export_library(str(lib), fcompile=tvm.support.cc.cross_compiler(t.cross_compiler))
    asm = subprocess.run(["aarch64-linux-gnu-objdump", "-d", str(lib)], capture_output=True, text=True).stdout
    assert bool(re.search(r"\ssmmla\s", asm)) == ("i8mm" in t.features) and re.search(r"\ssdot\s", asm)
    np.savez(tmp_path / "in.npz", **inputs)
    cmd = emulation.python_command(env, emulation.HERE / "run_module.py", lib, tmp_path / "in.npz", tmp_path / "out.npz")
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["aarch64", str(len(refs))]
    got = np.load(tmp_path / "out.npz")
    for name, ref in refs.items():
        np.testing.assert_allclose(got[name], ref, rtol=0, atol=2e-3 * np.abs(ref).max(), err_msg=name)
