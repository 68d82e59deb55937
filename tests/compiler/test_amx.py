"""The prefill GEMM's AMX tiles (compiler/kernels/x86/amx.py) against the VNNI kernels they
stand in for: every weight form the x86 GEMM takes, token counts around the 16-token tile,
bit for bit. The VNNI kernels are held to llama.cpp's W4A8 reference in test_kernels.py."""

from __future__ import annotations

import numpy as np
import pytest

from qwc import cpu
from qwc.compiler.kernels import dot_bits, q4_k_scales, w4a8_gemm
from qwc.compiler.kernels.row_groups import chunks, groups
from qwc.compiler.targets import get_target

# (dot, with Q4_1's block offsets, scale dtype, blocks of K): Q4_0; Q4_K's compact factors
# with its minimums; Q8_0's bytes; Q5_K's five-bit codes with offsets; IQ4's indices into the
# book (its scales fp16 as IQ4_NL's, float32 as IQ4_XS's); odd block counts (the pipelined loop's tail);
# one and two blocks (no more than amx.LAG: the pipelined loop never runs)
FORMS = [("vnni", False, "float16", 6), ("vnni", True, q4_k_scales.SCALE_DTYPE, 16), ("vnni8", False, "float16", 5),
         ("vnni5", True, "float32", 7), ("vnni_iq4", False, "float16", 6), ("vnni_iq4", False, "float32", 5),
         ("vnni", False, "float16", 1), ("vnni8", False, "float16", 2)]


def _needs_amx():
    """Tile instructions cannot run without AMX (no emulator here has it): on another CPU only
    the build is checked (test_amx_library_builds_anywhere)."""
    if not cpu.has("amx_int8"):
        pytest.skip("runs AMX code; this CPU has no amx_int8")


def _kernels(dot, offsets, sdt, nb, n):
    import tvm

    target = get_target("x86-amx").tvm_target()
    return [tvm.compile(tvm.IRModule({"main": w4a8_gemm(dot, n, nb, sdt, offsets=offsets, amx=amx)
                                      .with_attr("global_symbol", "main")}), target=target)["main"]
            for amx in (True, False)]


def _weights(rng, dot, offsets, sdt, nb, n):
    """Packed codes, scales (and offsets) as the repackers write them, random within range."""
    import tvm

    ng = groups(n)
    w = rng.integers(0, 256, (ng, nb, chunks(dot_bits(dot)), 64)).astype("uint8")
    ws_shape, ws_dtype, wc_shape, wc_dtype = q4_k_scales.buffers(sdt, ng, nb)
    if sdt == q4_k_scales.SCALE_DTYPE:   # 6-bit sc and mn, d and dmin of weights ~0.01
        ws = rng.integers(0, 64, ws_shape).astype(ws_dtype)
        wc = rng.uniform(1e-4, 1e-3, wc_shape).astype(wc_dtype)
    else:
        ws = rng.random(ws_shape).astype(ws_dtype)
        wc = rng.standard_normal(wc_shape).astype(wc_dtype)
    return [tvm.runtime.tensor(x) for x in ((w, ws, wc) if offsets else (w, ws))]


@pytest.mark.parametrize("dot, offsets, sdt, nb", FORMS)
def test_amx_tiles_give_the_vnni_kernels_bits(dot, offsets, sdt, nb):
    """16-token tiles on AMX, the 8-15 left on a VNNI tile and the rest on VNNI's 4/2/1 tiles,
    a ragged last row group: every output equals the VNNI GEMM's to the bit (integer dots are
    exact; the scaling runs in the same order). The quantizer's offsets are -8 x the block sums,
    as it writes them: the AMX tiles take the codes as q - 8 instead."""
    import tvm

    _needs_amx()
    n = 16 * 5 + 8
    amx, vnni = _kernels(dot, offsets, sdt, nb, n)
    rng = np.random.default_rng(11)
    weights = _weights(rng, dot, offsets, sdt, nb, n)
    for m in (16, 17, 24, 31, 32, 47, 100):
        a = rng.integers(-127, 128, (m, nb, 32)).astype("int8")
        aq, ad, off = (tvm.runtime.tensor(x) for x in (a, rng.random((m, nb)).astype("float32"),
                                                       (-8 * a.astype(np.int64).sum(-1)).astype("int32")))
        y_amx, y_vnni = (tvm.runtime.tensor(np.full((m, n), np.nan, np.float32)) for _ in range(2))
        amx(aq, ad, off, *weights, y_amx)
        vnni(aq, ad, off, *weights, y_vnni)
        assert np.isfinite(y_vnni.numpy()).all()
        np.testing.assert_array_equal(y_amx.numpy(), y_vnni.numpy(), err_msg=f"{m} tokens")


def test_amx_q6_k_tiles_give_the_vnni_kernels_bits():
    """Q6_K's AMX tiles (two sub-blocks of 16 a block, each one multiply of K = 16 on the
    activations copied in sub-block order; kernels/x86/amx.py: q6_k_macros) against its VNNI
    tiles, with the bias as it stores and a ragged last group: the same bits at every token
    count around the tile."""
    import tvm

    from qwc.compiler.kernels.x86.q6_k import q6_k_matmul

    _needs_amx()
    n, nb = 16 * 5 + 8, 16   # two super-blocks
    target = get_target("x86-amx").tvm_target()
    amx, vnni = (tvm.compile(tvm.IRModule({"main": q6_k_matmul(n, nb, bias=True, amx=a).with_attr("global_symbol", "main")}),
                             target=target)["main"] for a in (True, False))
    rng = np.random.default_rng(12)
    ng = groups(n)
    weights = [tvm.runtime.tensor(x) for x in (rng.integers(0, 256, (ng, nb, 6, 64)).astype("uint8"),
                                               rng.integers(-128, 128, (ng, nb, 32)).astype("int8"),
                                               rng.uniform(1e-3, 1e-2, (ng, nb // 8, 16)).astype("float32"),
                                               rng.standard_normal(n).astype("float32"))]
    for m in (16, 17, 24, 25, 31, 32, 47, 100):
        a = rng.integers(-127, 128, (m, nb, 32)).astype("int8")
        sub_a = a[..., 0:8].astype(np.int64).sum(-1) + a[..., 16:24].astype(np.int64).sum(-1)   # q6_k_starts' chains
        starts = np.stack([-32 * sub_a, -32 * (a.astype(np.int64).sum(-1) - sub_a)], -1).astype("int32")
        args = [tvm.runtime.tensor(x) for x in (a, rng.random((m, nb)).astype("float32"), starts)]
        y_amx, y_vnni = (tvm.runtime.tensor(np.full((m, n), np.nan, np.float32)) for _ in range(2))
        amx(*args, *weights, y_amx)
        vnni(*args, *weights, y_vnni)
        assert np.isfinite(y_vnni.numpy()).all()
        np.testing.assert_array_equal(y_amx.numpy(), y_vnni.numpy(), err_msg=f"{m} tokens")


def test_amx_library_builds_anywhere():
    """The AMX GEMM compiles from any x86 host (cross-compiling for x86-amx) and its code holds
    the tile multiply, signed by signed (every form's codes made signed in its B tiles)."""
    import tvm

    target = get_target("x86-amx").tvm_target()
    for dot in ("vnni", "vnni8", "vnni5", "vnni_iq4"):
        lib = tvm.compile(tvm.IRModule({"main": w4a8_gemm(dot, 32, 4, "float16", amx=True)
                                        .with_attr("global_symbol", "main")}), target=target)
        asm = lib.mod.inspect_source("asm") if hasattr(lib, "mod") else lib.inspect_source("asm")
        assert "tdpbssd" in asm and "ldtilecfg" in asm and "tilerelease" in asm, dot


def test_a_refused_amx_request_is_one_line(monkeypatch, tmp_path):
    """An artifact whose kernels use AMX on a machine whose Linux refuses the tile state: the
    runtime says so in one line before any kernel can fault."""
    from qwc.errors import QwcError
    from qwc.manifest import ArtifactTarget
    from qwc.runtime import engine

    def refused():
        raise OSError(1, "Linux refused this process AMX's tile state (arch_prctl ARCH_REQ_XCOMP_PERM): "
                         "Operation not permitted")

    t = get_target("x86-amx")
    monkeypatch.setattr(cpu, "machine_arch", lambda: "x86_64")
    monkeypatch.setattr(cpu, "features", lambda: t.features)
    monkeypatch.setattr(cpu, "enable_amx", refused)

    class Manifest:
        target = ArtifactTarget(t.name, t.arch, t.triple, t.mcpu, tuple(sorted(t.features)), t.mattr)

    with pytest.raises(QwcError, match="uses AMX: .*Operation not permitted"):
        engine.check_runs_here(Manifest())
