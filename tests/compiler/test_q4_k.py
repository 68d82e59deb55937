"""Q4_K's compact scales (kernels/q4_k_scales.py, compiler/repack_q4_k.py): the file's factors
come back from the canonical graph's float32 scales, and every W4A8 kernel reading them (x86
VNNI and AVX2; ARM sdot and smmla under qemu) gives the expanded form's numbers to the bit."""

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

from conftest import random_q4_k


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


def _emit(bb, name: str, k: int, n: int, m: int, raw: np.ndarray, compact: bool, target: str):
    """Function `name`(a, w, s, c) through `target`'s W4A8 kernels on the compact form, or on the expanded one made from the same factors (float32 d sc and
    c = 8 d sc - dmin mn, as compiler/repack.py's q4_1_block_offsets gives them); returns
    those weights."""
    b, mins, free = _blocks(raw, n, k)
    w, ws, wc = pack(b.codes, b.scales, b.zero_points)
    if not compact:
        d, sc, dmin, mn = gguf_blocks.q4_k_factors(b.scales, mins, free)
        s = np.repeat(d, 8, axis=1).astype(np.float64) * sc
        c = (8 * s - np.repeat(dmin, 8, axis=1).astype(np.float64) * mn).astype(np.float32)
        w, ws = row_groups.pack(b.codes, s.astype(np.float32))
        wc = row_groups.pack_offsets(c)
    t = get_target(target)
    av = relax.Var("a", relax.TensorType([m, k], "float32"))
    vs = [relax.Var(x, relax.TensorType(list(a.shape), str(a.dtype))) for x, a in zip("wsc", (w, ws, wc))]
    with bb.function(name, [av, *vs]):
        with bb.dataflow():
            isa = "arm" if t.arch == "aarch64" else "x86"
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


@pytest.mark.arm
@pytest.mark.slow
def test_arm_kernels_read_compact_q4_k_as_the_expanded_form(tmp_path):
    """arm-yitian (smmla prefill, sdot decode) and arm-neon (sdot prefill) under qemu-aarch64,
    at 1, 3, 9 and 17 tokens: the compact form's bits are the expanded one's."""
    import subprocess

    import tvm

    from qwc.bench import emulation

    inputs, names = {}, []
    for target in ("arm-yitian", "arm-neon"):
        bb = relax.BlockBuilder()
        for k, n in CASES:
            for m in (1, 3, 9, 17):
                raw, a = _inputs(k, n, m)
                for compact in (True, False):
                    name = f"{target.replace('-', '_')}_{k}_{n}_{m}_{int(compact)}"
                    for i, x in enumerate([a, *_emit(bb, name, k, n, m, raw, compact, target)]):
                        inputs[f"{name}/{i}"] = x
                    names.append(name)
        t = get_target(target)
        build(bb.get(), t).export_library(str(tmp_path / f"{target}.so"),
                                          fcompile=tvm.support.cc.cross_compiler(t.cross_compiler))
    env, got = emulation.arm64_env(), {}
    for target in ("arm-yitian", "arm-neon"):
        prefix = target.replace("-", "_")
        np.savez(tmp_path / "in.npz", **{x: v for x, v in inputs.items() if x.startswith(prefix)})
        out = tmp_path / f"{target}.npz"
        cmd = emulation.python_command(env, emulation.HERE / "run_module.py", tmp_path / f"{target}.so",
                                       tmp_path / "in.npz", out)
        r = subprocess.run(cmd, env=dict(env, TVM_NUM_THREADS="1"), capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stderr[-2000:]
        got.update(np.load(out))
    for name in names:
        if name.endswith("_1"):
            assert np.array_equal(got[name], got[name[:-1] + "0"]), name
