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

from conftest import q8_k, random_q6_k


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


def _emit_q6_k(bb, name: str, k: int, n: int, m: int, raw: np.ndarray, bias: np.ndarray | None, target: str,
               super_blocks: bool = False):
    """Function `name`(a, w, sc, d[, bias]) through the Q6_K kernel of `target`, as the importer
    emits it (`super_blocks`: in a graph whose activations are scaled by super-blocks, as an
    ARM graph with compact Q4_K); returns the weights in its layout."""
    from qwc.compiler.frontend import _CONTEXT, ImportContext

    t = get_target(target)
    b = gguf_blocks.from_gguf(raw, "Q6_K", (n, k), "w")
    w, sc, d = pack(b.codes, b.scales, "arm" if t.arch == "aarch64" else "x86")
    av = relax.Var("a", relax.TensorType([m, k], "float32"))
    vs = [relax.Var(x, relax.TensorType(list(a.shape), str(a.dtype))) for x, a in (("w", w), ("sc", sc), ("d", d))]
    bv = relax.Var("bias", relax.TensorType([n], "float32")) if bias is not None else None
    token = _CONTEXT.set(ImportContext(prefix=name, act_bits=8, features=t.features, super_blocks=super_blocks))
    try:
        with bb.function(name, [av, *vs] + ([bv] if bv is not None else [])):
            with bb.dataflow():
                gv = bb.emit_output(MatMulNBits.q6_k_matmul(bb, av, *vs, k, n, bv))
            bb.emit_func_output(gv)
    finally:
        _CONTEXT.reset(token)
    return [w, sc, d] + ([bias] if bias is not None else [])


def _case(k: int, n: int, m: int, with_bias: bool):
    """(raw Q6_K weights, activations the quantizer takes exactly, bias or None, the float64
    reference and the sum of its terms' magnitudes). Exact activations: codes times a power of
    two, one code a block at 127, so the check is of the kernel, not of a rounding tie between
    two quantizers."""
    rng = np.random.default_rng(k + n + m)
    raw = random_q6_k(rng, n, k)
    qa = rng.integers(-127, 128, (m, k // 32, 32))
    qa[..., 5] = 127
    da = np.ldexp(1.0, rng.integers(-8, 2, (m, k // 32, 1)))
    a = (qa * da).reshape(m, k).astype(np.float32)
    assert np.array_equal(quantize_q8_0(a)[0], qa)
    bias = rng.standard_normal(n).astype(np.float32) if with_bias else None
    w = dequantize(raw, Q.Q6_K).reshape(n, k).astype(np.float64)
    ref = a.astype(np.float64) @ w.T + (0 if bias is None else bias)
    return raw, a, bias, ref, np.abs(a.astype(np.float64)) @ np.abs(w).T


# N = 150: x86 decode's four streams of two row groups each, then the two left over (one ragged)
CASES = [(256, 32, False), (512, 40, True), (256, 150, True)]


@pytest.mark.parametrize("m", [1, 3, 9])
@pytest.mark.parametrize("k, n, with_bias", CASES)
def test_q6_k_kernel_computes_llama_cpps_w6a8(k, n, m, with_bias):
    """Decode (one token), a tile with leftovers, a ragged last row group, against numpy in
    float64: the activations as Q8_0 blocks times the file's dequantized weights. The integer
    sums are exact; what differs is float32 rounding of the scales' products and the row sums,
    within a few ulps of the largest terms' magnitude."""
    import tvm

    from qwc import cpu

    if not cpu.has("avx512_vnni"):
        pytest.skip("runs AVX-512 VNNI code; this CPU has none")
    raw, a, bias, ref, scale = _case(k, n, m, with_bias)
    bb = relax.BlockBuilder()
    weights = _emit_q6_k(bb, "main", k, n, m, raw, bias, "x86-avx512")
    vm = relax.VirtualMachine(build(bb.get(), get_target("x86-avx512")), tvm.cpu())
    got = vm["main"](*(tvm.runtime.tensor(x) for x in [a, *weights])).numpy()
    assert (np.abs(got - ref) <= 1e-6 * scale + 1e-6).all(), np.abs(got - ref).max()


@pytest.mark.parametrize("prefetch", ["software", "hardware"])
def test_q6_k_decode_keeps_its_chains_in_registers(prefetch):
    """The one-token form's vpdpbusd chains are expressions, not variables reassigned in a TIR
    loop: those become buffers the thread allocates, and every vpdpbusd then waits on a store
    and a load (the decode GEMV ran compute-bound, under the memory's rate)."""
    import tvm

    from qwc.compiler.kernels.x86 import q6_k

    func = q6_k.q6_k_matmul(256, 8, m=1, prefetch=prefetch).with_attr("global_symbol", "main")
    code = tvm.compile(tvm.IRModule({"main": func}), target=get_target("x86-avx512").tvm_target()).mod.inspect_source("s")
    assert code.count("vpdpbusd") >= 8 and "TVMBackendAllocWorkspace" not in code


def test_q6_k_on_a_zen_gives_the_same_bits_without_prefetches():
    """x86-zen's Q6_K (targets.IntDots.decode_prefetch "hardware") is x86-avx512's kernel without
    its software prefetches: the same bits at one token and at three, and no prefetch in its code."""
    import tvm

    from qwc import cpu
    from qwc.compiler.kernels.x86 import q6_k

    assert "llvm.prefetch" in q6_k.q6_k_matmul(256, 8).script()
    assert "llvm.prefetch" not in q6_k.q6_k_matmul(256, 8, prefetch="hardware").script()
    if not cpu.has("avx512_vnni"):
        pytest.skip("runs AVX-512 VNNI code; this CPU has none")
    k, n, with_bias = CASES[-1]
    for m in (1, 3):
        raw, a, bias, _, _ = _case(k, n, m, with_bias)
        got = []
        for target in ("x86-avx512", "x86-zen"):
            bb = relax.BlockBuilder()
            weights = _emit_q6_k(bb, "main", k, n, m, raw, bias, target)
            vm = relax.VirtualMachine(build(bb.get(), get_target(target)), tvm.cpu())
            got.append(vm["main"](*(tvm.runtime.tensor(x) for x in [a, *weights])).numpy())
        np.testing.assert_array_equal(*got)


@pytest.mark.arm
@pytest.mark.slow
def test_q6_k_arm_kernel_computes_llama_cpps_w6a8(tmp_path):
    """The sdot form (signed codes, no chain starts) cross-compiled for arm-yitian and run under
    qemu-aarch64, on the x86 test's cases at 1, 3, 9 and 17 tokens, 1 and 4 threads (the same
    bits: a task owns its rows), against the float64 products of its activations as the importer
    quantizes them for it: by super-blocks (Q8_K, as llama.cpp's Q6_K dot takes them), in a
    graph whose other linears take Q8_0 blocks as in one scaled by super-blocks."""

    import tvm

    from qwc.bench import emulation

    t = get_target("arm-yitian")
    bb, inputs, refs = relax.BlockBuilder(), {}, {}
    for k, n, with_bias in CASES:
        for m in (1, 3, 9, 17):
            raw, a, bias, _, _ = _case(k, n, m, with_bias)
            w = dequantize(raw, Q.Q6_K).reshape(n, k).astype(np.float64)
            a8 = q8_k(a)
            for graph_sb in (False, True):
                name = f"q6k_{k}_{n}_{m}_{int(graph_sb)}"
                for i, x in enumerate([a, *_emit_q6_k(bb, name, k, n, m, raw, bias, "arm-yitian", graph_sb)]):
                    inputs[f"{name}/{i}"] = x
                refs[name] = (a8 @ w.T + (0 if bias is None else bias), np.abs(a8) @ np.abs(w).T)
    lib = tmp_path / "q6_k.so"
    build(bb.get(), t).export_library(str(lib), fcompile=tvm.support.cc.cross_compiler(t.cross_compiler))
    outs = emulation.run_library(emulation.arm64_env(), lib, inputs, tmp_path, threads=(1, 4))
    for name, (ref, scale) in refs.items():
        got = outs[0][name]
        assert (np.abs(got - ref) <= 1e-6 * scale + 1e-6).all(), (name, np.abs(got - ref).max())
        assert np.array_equal(outs[1][name], got), name


def test_targets_say_which_run_q6_k_natively():
    assert kernel_summary(get_target("x86-avx512"))["q6_k"] == "w6a8-vnni"
    assert kernel_summary(get_target("arm-yitian"))["q6_k"] == "w6a8-sdot"
    assert kernel_summary(get_target("x86-avx2"))["q6_k"] == "as q8_0"


def test_targets_say_which_read_q4_k_compact():
    assert kernel_summary(get_target("x86-avx512"))["q4_k"] == "w4a8-compact"
    assert kernel_summary(get_target("x86-avx2"))["q4_k"] == "w4a8-compact"
    assert kernel_summary(get_target("arm-yitian"))["q4_k"] == "w4a8-compact"   # (on Q8_K activations)
    assert kernel_summary(get_target("arm-neon"))["q4_k"] == "w4a8-compact"
    assert kernel_summary(get_target("x86-avx512"))["q5"] == "w5a8-vnni5/vnni5"   # (compiler/repack_five_bit.py)
    assert kernel_summary(get_target("arm-yitian"))["q5"] == "w5a8-sdot5/smmla5"


@pytest.mark.parametrize("isa", ["x86", "arm"])
def test_q6_k_layouts_made_a_chunk_of_rows_at_a_time_are_the_same(monkeypatch, isa):
    """pack lays the codes out ROWS_AT_ONCE rows at a time (a 7B output's temporaries): chunks of
    two row groups and a ragged last one give the whole layout's bytes."""
    from qwc.compiler import repack_q6_k

    raw = random_q6_k(np.random.default_rng(11), 70, 512)
    b = gguf_blocks.from_gguf(raw, "Q6_K", (70, 512), "w")
    whole = pack(b.codes, b.scales, isa)
    monkeypatch.setattr(repack_q6_k, "ROWS_AT_ONCE", 32)
    for a, c in zip(whole, pack(b.codes, b.scales, isa)):
        assert a.dtype == c.dtype and np.array_equal(a, c)


@pytest.mark.parametrize("isa", ["x86", "arm"])
def test_tied_q6_k_gather_reads_the_kernels_layout(isa):
    """A tied embedding's rows from the Q6_K kernel's weights (x86's six-bit codes, ARM's signed
    bytes: the gather is generic TE, so both run here) equal the file's dequantized rows exactly."""
    import tvm
    from tvm import te

    from qwc.compiler.kernels import generic

    raw = random_q6_k(np.random.default_rng(9), 40, 512)
    b = gguf_blocks.from_gguf(raw, "Q6_K", (40, 512), "w")
    w, sc, d = pack(b.codes, b.scales, isa)
    ids = np.array([[0, 17, 39, 16]], np.int64)
    args = [te.placeholder(x.shape, str(x.dtype)) for x in (w, ids, sc, d)]
    out = generic.gather_q6_k_row_groups(args[0], args[1], args[2], args[3], isa=isa)
    f = tvm.compile(te.create_prim_func([*args, out]), target="llvm")
    got = tvm.runtime.tensor(np.zeros((1, 4, 16, 32), np.float32))
    f(*(tvm.runtime.tensor(x) for x in (w, ids, sc, d)), got)
    ref = dequantize(raw, Q.Q6_K).reshape(40, 512)[ids[0]]
    assert np.array_equal(got.numpy().reshape(4, 512), ref)
