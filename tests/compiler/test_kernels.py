"""Every host matmul kernel against numpy on awkward shapes: K not a multiple of 128 (and not
of 32), N not a multiple of the row interleave, M = 1, 3, 17."""

from __future__ import annotations

import re
from collections import Counter

import numpy as np
import pytest
from tvm import relax

from qwc.compiler.build import build
from qwc.compiler.frontend import MatMulNBits
from qwc.compiler.kernels import generic, row_groups, w4a8
from qwc.compiler.targets import get_target
from qwc.errors import QwcError
from qwc.q4 import pack_nibbles, quantize_q4_0, quantize_q8_0

# (K, N). N = 136 and 128 take the decode GEMV's multi-stream path (N >= 64 rows), with a
# ragged leftover group and without one.
SHAPES = [(96, 24), (160, 6), (100, 20), (896, 40), (96, 136), (64, 128)]
ARM_M = (1, 3, 4, 7, 9, 10, 12, 17, 23, 27, 29, 33)
Q8_SHAPES = [(96, 24), (100, 20), (96, 136)]   # the W8A8 kernels': ragged N and K, the multi-group path



# The x86 W4A8 kernels by their dot product, and the target whose features select each.
X86_DOTS = {"vnni": "x86-avx512", "avx2": "x86-avx2"}


def _run_needs(dot: str):
    """Running an x86 W4A8 kernel needs its instructions: AVX-512 VNNI, which no emulator here
    has (QEMU's TCG stops at AVX2), or AVX2. On a CPU without VNNI (an AMD EPYC Zen 3) the
    VNNI cases cannot run; what can be checked without running, the kernels' code, is
    test_compile's test_vnni_library_from_any_x86_host. The AVX2 kernels run on both."""
    from qwc import cpu

    need = {"vnni": "avx512_vnni", "vnni8": "avx512_vnni", "avx2": "avx2"}[dot]
    if not cpu.has(need):
        pytest.skip(f"runs {need} code; this CPU has no {need}")


def _weights(k, n, seed):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32)
    q, d = quantize_q4_0(w)
    deq = ((q.astype(np.float32) - 8) * d[..., None]).reshape(n, -1)
    return pack_nibbles(q), d, deq


def _weights8(k, n, seed):
    """Q8_0 weights as qwc's MatMulNBits holds them (codes q + 128 [N, nb, 32]), their scales
    and the dequantized matrix [N, nb * 32]."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    q, d = quantize_q8_0(w)
    q[0, 0, :2] = -128, 127   # the codes' extremes (llama.cpp writes -127..127; a file may hold -128)
    deq = (q.astype(np.float32) * d[..., None]).reshape(n, -1)
    return (q.astype(np.int16) + 128).astype(np.uint8), d, deq


def _weights41(k, n, seed):
    """Q4_1 as the W4A8 kernels take it (compiler/repack.py: q4_1_block_offsets): Q4_0 codes
    and scales plus block offsets c [N, nb], and the matrix d (q - 8) + c."""
    wp, d, deq = _weights(k, n, seed)
    c = (np.random.default_rng(seed + 1).standard_normal(d.shape) * d).astype(np.float32)
    return wp, d, c, deq + np.repeat(c, 32, axis=1)


def _emit(bb, name, variant, k, n, m, wp, d, features=None, offsets=None, row_sums: bool = False):
    """Function `name`(a, w, s[, c][, r]) through one kernel variant for a target's `features`
    (the host's by default); returns the weights in the layout it reads (compile-time repacking
    gives the W4A8 kernels row groups; "arm8": the ARM W8A8 kernels' Q8_0 row groups), with
    Q4_1's block `offsets` [N, nb] where given (W4A8 variants), and with `row_sums` the weight
    rows' sums r (compiler/row_activations.py), which give prefill per-token activations."""
    from qwc.compiler.row_activations import row_sums as sums_of

    r = sums_of(wp, d, 8 if variant in ("arm8", "vnni8") else 4) if row_sums else None
    if variant in ("arm8", "vnni8"):
        wp, d = row_groups.pack_int8(wp, d, signed=variant == "arm8")
    if variant in ("vnni", "avx2", "arm"):
        wp, d = row_groups.pack(wp, d)
    av = relax.Var("a", relax.TensorType([m, k], "float32"))
    wv = relax.Var("w", relax.TensorType(list(wp.shape), "uint8"))
    sv = relax.Var("s", relax.TensorType(list(d.shape), str(d.dtype)))
    params, packed = [av, wv, sv], [wp, d]
    cv = None
    if offsets is not None:
        packed.append(row_groups.pack_offsets(offsets))
        cv = relax.Var("c", relax.TensorType(list(packed[-1].shape), "float32"))
        params.append(cv)
    rv = None
    if r is not None:
        packed.append(r)
        rv = relax.Var("r", relax.TensorType([n], "float32"))
        params.append(rv)
    with bb.function(name, params):
        with bb.dataflow():
            if variant in ("arm8", "vnni8"):
                isa = "arm" if variant == "arm8" else "x86"
                features = features or get_target("x86-avx512").features
                out = MatMulNBits.q4_0_matmul(bb, av, wv, sv, k, n, isa, features, bits=8, row_sums=rv)
            elif variant in ("f32", "vnni", "avx2", "arm"):
                if features is None:   # an x86 dot: the features of the target that selects it
                    features = get_target(X86_DOTS[variant] if variant in X86_DOTS else "host").features
                out = MatMulNBits.q4_0_matmul(bb, av, wv, sv, k, n, "x86" if variant in X86_DOTS else variant, features,
                                              offsets=cv, row_sums=rv)
            else:
                kern = generic.matmul_nbits if variant == "generic32" else generic.matmul_nbits_a8
                out = bb.emit_te(kern, av, wv, sv, k=k, n=n, block=32, bits=4, primfunc_name_hint="mm")
            gv = bb.emit_output(out)
        bb.emit_func_output(gv)
    return tuple(packed)


def _run(variant, k, n, m, a, wp, d, offsets=None):
    import tvm

    bb = relax.BlockBuilder()
    packed = _emit(bb, "main", variant, k, n, m, wp, d, offsets=offsets)
    vm = relax.VirtualMachine(build(bb.get(), get_target("host")), tvm.cpu())
    return vm["main"](*(tvm.runtime.tensor(x) for x in (a, *packed))).numpy()


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
@pytest.mark.parametrize("variant", ["vnni", "avx2", "generic8"])
def test_w4a8_kernels(variant, k, n, m):
    if variant in X86_DOTS:
        _run_needs(variant)
    wp, d, deq = _weights(k, n, k + n)
    a = np.random.default_rng(m).standard_normal((m, k)).astype(np.float32)
    got = _run(variant, k, n, m, a, wp, d)
    ref = _a8_reference(a, deq, d, k)
    # activation rounding ties (round-half-even vs away) may differ: one step of one block
    np.testing.assert_allclose(got, ref, rtol=0, atol=2e-3 * np.abs(ref).max())
    exact = a @ deq[:, :k].T
    assert np.abs(got - exact).max() < 0.05 * np.abs(exact).max()   # and int8 activations are close


@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("k, n", SHAPES)
@pytest.mark.parametrize("dot", sorted(X86_DOTS))
def test_w4a8_kernels_with_q4_1_block_offsets(dot, k, n, m):
    """Q4_1 on the x86 W4A8 kernels: the Q4_0 dot plus each block's offset times the
    activations' block sum, inside the kernel (decode GEMV and prefill GEMM)."""
    _run_needs(dot)
    wp, d, c, deq = _weights41(k, n, k + n)
    a = np.random.default_rng(m).standard_normal((m, k)).astype(np.float32)
    got = _run(dot, k, n, m, a, wp, d, offsets=c)
    ref = _a8_reference(a, deq, d, k)
    np.testing.assert_allclose(got, ref, rtol=0, atol=2e-3 * np.abs(ref).max())


@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("k, n", SHAPES)
def test_w8a8_vnni_kernels(k, n, m):
    """Q8_0 weights on the VNNI kernels (unsigned codes q + 128, row_groups.pack_int8), decode
    and prefill, against numpy's W8A8, the codes' extremes -128 and 127 included."""
    _run_needs("vnni8")
    u, d, deq = _weights8(k, n, k + n)
    a = np.random.default_rng(m).standard_normal((m, k)).astype(np.float32)
    got = _run("vnni8", k, n, m, a, u, d)
    ref = _a8_reference(a, deq, d, k)
    np.testing.assert_allclose(got, ref, rtol=0, atol=2e-3 * np.abs(ref).max())


@pytest.mark.parametrize("dot", sorted(X86_DOTS))
def test_x86_w4a8_kernels_at_the_extremes(dot):
    """The largest sums the dots can meet: 31 of 32 nibbles at 15 and every activation byte at
    +-127 (the AVX2 form adds a block's products in int16 lanes: at most 8 x 2 x 15 x 127), and
    the smallest: all activations of opposite sign."""
    _run_needs(dot)
    k, n, m = 64, 32, 2
    w = np.full((n, k), 7.0 / 8.0, np.float32)
    w[:, ::32] = -1.0          # each block's extreme: d = 1/8, so q = 0 there and 15 elsewhere
    w[n // 2:] *= -1
    q, d = quantize_q4_0(w)
    assert (q[:, :, 1:] == 15).all() and (q[:, :, 0] == 0).all()
    deq = ((q.astype(np.float32) - 8) * d[..., None]).reshape(n, -1)
    a = np.stack([np.ones(k, np.float32), -np.ones(k, np.float32)])
    got = _run(dot, k, n, m, a, pack_nibbles(q), d)
    # qwc keeps the activation scale (1/127) in float32, llama.cpp's Q8_0 rounds it to fp16:
    # against the float product the integer sums are exact here (+-1 quantizes to +-127)
    np.testing.assert_allclose(got, a @ deq.T, rtol=1e-6)


@pytest.mark.parametrize("dot", [*sorted(X86_DOTS), "vnni8"])
@pytest.mark.parametrize("batched", [False, True])
def test_x86_gemm_adds_its_bias_as_it_stores(dot, batched):
    """The x86 GEMMs' bias epilogue (PREFILL_BIAS: the q, k and v projections' bias in the
    stores, not an add kernel after them): every token count up to 17 (the streamed few-token
    forms, the tiles, the leftovers' tiles) and a ragged last row group give the GEMM without
    it plus the bias, to the bit."""
    import tvm

    from qwc.compiler.kernels import prefill_bias, w4a8_gemm
    from qwc.compiler.kernels.row_groups import groups

    _run_needs(dot)
    assert prefill_bias(dot)
    n, nb = 16 * 9 + 8, 4
    target = get_target(X86_DOTS.get(dot, "x86-avx512")).tvm_target()
    plain, biased = (tvm.compile(tvm.IRModule({"main": w4a8_gemm(dot, n, nb, "float16", batched_decode=batched, bias=b)
                                               .with_attr("global_symbol", "main")}), target=target)["main"]
                     for b in (False, True))
    rng = np.random.default_rng(5)
    w = tvm.runtime.tensor(rng.integers(0, 255, (groups(n), nb, 8 if dot == "vnni8" else 4, 64)).astype("uint8"))
    ws = tvm.runtime.tensor(rng.random((groups(n), nb, 16)).astype("float16"))
    bias = rng.standard_normal(n).astype(np.float32)
    for m in range(1, 18):
        aq, ad, off = (tvm.runtime.tensor(x) for x in (rng.integers(-127, 128, (m, nb, 32)).astype("int8"),
                                                       rng.random((m, nb)).astype("float32"),
                                                       rng.integers(-4000, 4000, (m, nb)).astype("int32")))
        y0, y1 = (tvm.runtime.tensor(np.full((m, n), np.nan, np.float32)) for _ in range(2))
        plain(aq, ad, off, w, ws, y0)
        biased(aq, ad, off, w, ws, tvm.runtime.tensor(bias), y1)
        np.testing.assert_array_equal(y1.numpy(), y0.numpy() + bias, err_msg=f"{m} tokens")


@pytest.mark.parametrize("dot", [*sorted(X86_DOTS), "vnni8"])
def test_w4a8_batched_decode_gemm_takes_every_token_count(dot):
    """The x86 GEMMs for every token count up to 17: up to 8 tokens in decode's streams (4, 2
    and 1 of them, with the groups left over as one more task and a ragged last group), past
    that decode_batch's 8-token tiles (leftovers in tiles of 4, 2 and 1) and the prefill form's
    tiles (AVX-512: 8 tokens and the same leftovers; AVX2: 4, leftovers one at a time). Each
    equals the others bit for bit (the same per-token arithmetic) and llama.cpp's W4A8
    reference."""
    import tvm

    from qwc.compiler.frontend import _CONTEXT, ImportContext
    from qwc.compiler.kernels.x86.vnni import FEW_STREAMS

    _run_needs(dot)
    k, n = 100, 16 * 9 + 8   # 10 row groups: 4 streams of 2 and 2 groups left; 2 streams of 5
    # every streamed form some dot takes (AVX-512's Q4_0 goes from 4 streams to 1)
    assert {4, 1} <= set(FEW_STREAMS[dot]) and {4, 2, 1} <= {s for v in FEW_STREAMS.values() for s in v}
    wp, d, deq = (_weights8 if dot == "vnni8" else _weights)(k, n, 7)
    m = tvm.tirx.Var("m", "int64")
    outs, prefetches = {}, {}
    for batched in (False, True):
        features = get_target(X86_DOTS.get(dot, "x86-avx512")).features
        token = _CONTEXT.set(ImportContext(act_bits=8, features=features, batched=batched))
        try:
            bb = relax.BlockBuilder()
            wr, dr = _emit(bb, "main", dot, k, n, m, wp, d)
            mod = bb.get()
        finally:
            _CONTEXT.reset(token)
        # the form asked for is the one built: the batched tiles prefetch their own weights into
        # L1 (locality 3), the prefill ones the next groups' into L2 (2) in a group's first
        # tile (both share the streamed few-token branch, which prefetches into L1)
        script = mod.script()
        prefetches[batched] = {loc: len(re.findall(rf"llvm\.prefetch\b.*, 0, {loc}, 1\)", script)) for loc in (2, 3)}
        vm = relax.VirtualMachine(build(mod, get_target("host")), tvm.cpu())
        for rows in range(1, 18):
            a = np.random.default_rng(rows).standard_normal((rows, k)).astype(np.float32)
            outs[batched, rows] = (a, vm["main"](*(tvm.runtime.tensor(x) for x in (a, wr, dr))).numpy())
    assert prefetches[True][3] > prefetches[False][3] > 0 and prefetches[False][2] > 0 == prefetches[True][2]
    for rows in range(1, 18):
        a, got = outs[True, rows]
        np.testing.assert_array_equal(got, outs[False, rows][1])
        ref = _a8_reference(a, deq, d, k)
        np.testing.assert_allclose(got, ref, rtol=0, atol=2e-3 * np.abs(ref).max())


@pytest.mark.slow
@pytest.mark.arm
@pytest.mark.parametrize("target", ["arm-yitian", "arm-neon"])
def test_w4a8_arm_kernels_under_qemu(target, tmp_path):
    """The ARM kernels (sdot for M = 1; for M > 1 smmla on arm-yitian, sdot on arm-neon),
    cross-compiled, on every shape and M in one library run under qemu-aarch64
    (scripts/arm64), against the same reference as the host's, with 1, 2, 4 and 8 threads
    (identical results: a task owns its rows). M covers every smmla tile (5 pairs; a lone
    leftover pair joining the last tile's five as 4 + 2; other leftovers in tiles of 4, 2 and 1
    pairs; an odd token): 3 = 1 pair + odd, 4 = 2, 7 = 2 + 1 + odd, 9 = 4 + odd, 10 = 5,
    12 = 4 + 2, 17 = 5 + 2 + 1 + odd, 23 = 5 + 4 + 2 + odd, 27 = 5 + 5 + 2 + 1 + odd,
    29 = 5 + 5 + 4 + odd, 33 = 5 + 5 + 6 + odd; from two whole tiles on (27, 29, 33) a task
    unpacks its weights once. The W8A8 kernels (Q8_0
    codes: sdot8, and smmla8 on arm-yitian) and Q4_1's block offsets take the same tiles on
    three of the shapes, and the multi-output and split decode GEMVs in all three formats."""
    import re
    import subprocess

    import tvm

    from qwc.bench import emulation

    env = emulation.arm64_env()
    t = get_target(target)
    bb, inputs, refs = relax.BlockBuilder(), {}, {}
    # Q4_0 on every shape; Q4_1 (the Q4_0 kernels with block offsets) and Q8_0 on three
    for prefix, fmt, shapes in (("mm", "q4_0", SHAPES), ("mm41", "q4_1", Q8_SHAPES), ("mm8", "q8_0", Q8_SHAPES)):
        for k, n in shapes:
            for m in ARM_M:
                name = f"{prefix}_{k}_{n}_{m}"
                codes, d, c, deq = _format_weights(fmt, k, n, k + n)
                a = np.random.default_rng(m).standard_normal((m, k)).astype(np.float32)
                variant = "arm8" if fmt == "q8_0" else "arm"
                for i, x in enumerate((a, *_emit(bb, name, variant, k, n, m, codes, d, t.features, offsets=c))):
                    inputs[f"{name}/{i}"] = x
                refs[name] = _a8_reference(a, deq, d, k)
    for case in (_arm_decode_gemv_case, _arm_split_gemv_case):
        for fmt in ARM_GEMV_DOTS:
            name, inputs_, refs[name] = case(bb, fmt=fmt)
            inputs.update({f"{name}/{i}": x for i, x in enumerate(inputs_)})
    lib = tmp_path / "kernels.so"
    build(bb.get(), t).export_library(str(lib), fcompile=tvm.support.cc.cross_compiler(t.cross_compiler))
    asm = subprocess.run(["aarch64-linux-gnu-objdump", "-d", str(lib)], capture_output=True, text=True).stdout
    assert bool(re.search(r"\ssmmla\s", asm)) == ("i8mm" in t.features) and re.search(r"\ssdot\s", asm)
    outs = emulation.run_library(env, lib, inputs, tmp_path, threads=(1, 2, 4, 8))
    for name, ref in refs.items():
        np.testing.assert_allclose(outs[0][name], ref, rtol=0, atol=2e-3 * np.abs(ref).max(), err_msg=name)
        for other in outs[1:]:
            assert np.array_equal(other[name], outs[0][name]), name


ARM_GEMV_DOTS = {"q4_0": "sdot", "q8_0": "sdot8", "q4_1": "sdot"}   # the decode GEMV for each format


# the per-row prefill GEMM of each ARM target: (target, its GEMMs' name stems, the quantizer's layout)
ARM_ROW_GEMMS = {"arm-yitian": (("q4_gemm_smmla_rows", "q8_gemm_smmla8_rows"), "arm_rows"),
                 "arm-neon": (("q4_gemm_sdot_rows", "q8_gemm_sdot8_rows"), "arm_rows_flat")}


@pytest.mark.slow
@pytest.mark.arm
@pytest.mark.parametrize("target", sorted(ARM_ROW_GEMMS))
def test_arm_per_row_gemm_under_qemu(tmp_path, target):
    """Each ARM target's prefill GEMM on per-token activations (a scale and zero point a row,
    act_quant layout "arm_rows" for smmla, "arm_rows_flat" for sdot), Q4_0 and Q8_0 codes,
    every smmla tile and the sdot tiles' leftovers (ARM_M), against numpy
    on the same int8 codes (qwc.q4.quantize_rows_asym: the quantizer's float32 steps), with 1,
    3, 8 and 64 threads to the bit. Where the kernel sums in float32, the reference's only
    difference is the order of float sums; the tolerance 1e-4 of the output's range covers the
    zero point's cancellation (y = s acc - s zp R). smmla's running tiles (prompts of 16 tokens
    or more, i8mm.py) sum in a fixed point whose unit is a power of two above twice the row's
    largest scale: 2e-3 of the range, as the blocks' own reference (measured up to 1e-3, at K =
    18944, the 7B's down_proj, over 592 blocks). A row of zeros, a row of one sign and a row with one
    outlier are among the tokens; decode (M = 1) and a K off whole blocks keep their blocks."""
    import subprocess

    import tvm

    from qwc.bench import emulation
    from qwc.compiler.kernels.arm import i8mm
    from qwc.q4 import quantize_rows_asym

    env = emulation.arm64_env()
    t = get_target(target)
    gemms, layout = ARM_ROW_GEMMS[target]
    bb, inputs, refs = relax.BlockBuilder(), {}, {}
    for prefix, fmt, shapes in (("r4", "q4_0", [(96, 24), (160, 6), (96, 136), (896, 40), (18944, 16)]), ("r8", "q8_0", Q8_SHAPES)):
        for k, n in shapes:
            for m in ARM_M:
                name = f"{prefix}_{k}_{n}_{m}"
                codes, d, _, deq = _format_weights(fmt, k, n, k + n)
                a = np.random.default_rng(m).standard_normal((m, k)).astype(np.float32)
                if m > 3:
                    a[1] = 0                  # a row of zeros: scale 1, zero point 0, codes 0
                    a[2] = np.abs(a[2])       # one sign: lo = 0
                    a[3, 5] = 40.0            # an outlier
                for i, x in enumerate((a, *_emit(bb, name, "arm8" if fmt == "q8_0" else "arm", k, n, m, codes, d,
                                                 t.features, row_sums=True))):
                    inputs[f"{name}/{i}"] = x
                if m == 1 or k % 32:   # decode, and K off whole blocks (100): blocks, as the other tests
                    refs[name] = _a8_reference(a, deq, d, k), 2e-3
                else:
                    q, sc, zp = quantize_rows_asym(a)
                    fixed = target == "arm-yitian" and m >= 2 * i8mm.MADE_FROM * i8mm.RUNNING_PAIRS
                    refs[name] = ((q.astype(np.float64) - zp[:, None]) * sc[:, None]) @ deq.T.astype(np.float64), (
                        2e-3 if fixed else 1e-4)
    codes = {}
    for kind in ("plain", "rms", "silu_mul"):   # the quantizers the fusions give the GEMM
        arrays, ref = _row_quantizer_case(bb, f"quant_{kind}", kind, 96, 7, layout)
        for out in range(3):
            inputs.update({f"quant_{kind}_{out}/{i}": x for i, x in enumerate(arrays)})
        codes[kind] = ref
    lib = tmp_path / "kernels.so"
    build(bb.get(), t).export_library(str(lib), fcompile=tvm.support.cc.cross_compiler(t.cross_compiler))
    asm = subprocess.run(["aarch64-linux-gnu-objdump", "-d", str(lib)], capture_output=True, text=True).stdout
    assert all(re.search(g, asm) for g in gemms), gemms
    outs = emulation.run_library(env, lib, inputs, tmp_path, threads=(1, 3, 8, 64), timeout=900)
    for name, (ref, tol) in refs.items():
        np.testing.assert_allclose(outs[0][name], ref, rtol=0, atol=tol * np.abs(ref).max(), err_msg=name)
        for other in outs[1:]:
            assert np.array_equal(other[name], outs[0][name]), name
    # the quantizers: plain to the bit; the fused ones' inputs (the norm, silu) round
    # differently in numpy, so their scales to 1e-6 and their codes to one step
    for kind, (q, sc, zp) in codes.items():
        got_q, got_s, got_off = (outs[0][f"quant_{kind}_{i}"] for i in range(3))
        np.testing.assert_allclose(got_s, np.stack([sc, sc * zp], -1), rtol=1e-6 if kind != "plain" else 0,
                                   err_msg=kind)
        # codes and offsets read back: the pair layout (rows 2p, 2p + 1 alternate 8-byte
        # pieces), or the flat one (a row's blocks in order)
        flat, m = got_q.reshape(-1), q.shape[0]
        if layout == "arm_rows":
            back = np.stack([[flat[[_pair_place(i, b, e, m) for e in range(32)]] for b in range(3)] for i in range(m)])
            offsets = _pair_offsets(got_off, m)
        else:
            back, offsets = flat.reshape(m, 3, 32), got_off
        deinterleaved = np.concatenate([q.reshape(m, 3, 32)[..., 0::2], q.reshape(m, 3, 32)[..., 1::2]], -1)
        assert np.abs(back.astype(int) - deinterleaved).max() <= (0 if kind == "plain" else 1), kind
        assert np.array_equal(offsets, -8 * back.astype(np.int32).sum(-1)), kind


@pytest.mark.arm
@pytest.mark.parametrize("act", ["block", "row"])
def test_smmla_tiles_of_a_long_prompt_read_unpacked_operands(tmp_path, act):
    """arm-yitian's Q4_0 GEMM has two block loops for its 5-pair tile: the one tiles run where a
    task has fewer than two whole tiles, which unpacks the nibbles (zips, masks, shifts, the
    scales' converts), and the one of longer prompts, whose operands the task unpacked once
    (kernels/arm/i8mm.py, _made_operands): that loop loads them and has none of that work, and
    it executes fewer instructions a block, two blocks an iteration. On per-row activations
    it sums by parts in tiles of 4 pairs: it loads no offsets (26 `ldp` for two blocks: 8 of
    operands, 16 of activations, two of scales), and each pair's dot joins its sums in one
    `sqrdmlah` a block, with no convert or float multiply-add."""
    from qwc.bench import arm_tile_loops

    lib = arm_tile_loops.build_gemm("arm-yitian", 48, 64, 896, act == "row", tmp_path)
    pairs = 4 if act == "row" else 5   # the long prompt's tiles (i8mm.RUNNING_PAIRS on rows)
    inner = [body for body in arm_tile_loops.loops(lib, "smmla")   # innermost loops: one branch, their own
             if sum(bool(arm_tile_loops.BRANCH.match(o)) for o, _ in body) == 1]
    unpacking = {"and", "ushr", "zip1", "zip2", "fcvtl"}
    made = [b for b in inner if not unpacking & {o for o, _ in b} and sum(o == "smmla" for o, _ in b) == 16 * pairs]
    direct = [b for b in inner if unpacking <= {o for o, _ in b} and sum(o == "smmla" for o, _ in b) == 40]
    assert made and direct, [len(b) for b in inner]
    # a token's instructions a block: the made loop's two blocks against the 5-pair direct one's
    assert max(len(b) / (4 * pairs) for b in made) < min(len(b) / 10 for b in direct), (
        [len(b) for b in made], [len(b) for b in direct])
    if act == "row":
        assert all(sum(o == "ldp" for o, _ in b) == 26 and sum(o == "sqrdmlah" for o, _ in b) == 16
                   and not {"scvtf", "fmla"} & {o for o, _ in b} for b in made), [Counter(o for o, _ in b) for b in made]
    # the loop that unpacks them takes two blocks an iteration: 8 zips of row pieces (4 a block)
    unpack = [b for b in arm_tile_loops.loops(lib, "zip2") if not any(o == "smmla" for o, _ in b)
              and sum(bool(arm_tile_loops.BRANCH.match(o)) for o, _ in b) == 1]
    assert [sum(o in ("zip1", "zip2") and ".4s" in x for o, x in b) for b in unpack] == [8], [len(b) for b in unpack]


def _row_quantizer_case(bb, name, kind, k, m, layout="arm_rows"):
    """Functions name_0, name_1, name_2 returning the per-row quantizer's codes, scales and
    offsets (act_quant `layout`, one of ROW_LAYOUTS) of `kind` ("plain", "rms": RMSNorm(x) * gamma,
    "silu_mul": silu(gate) * up) on random rows; returns their inputs and the numpy reference
    (q, s, zp) of the values the kernel quantizes."""
    from qwc.compiler.kernels import act_quant
    from qwc.q4 import quantize_rows_asym

    rng = np.random.default_rng(k + m)
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[1] = 0
    if kind == "plain":
        arrays, values = [x], x
    elif kind == "rms":
        gamma = rng.standard_normal(k).astype(np.float32)
        inv = np.float32(1) / np.sqrt((x * x).sum(-1, dtype=np.float32) / np.float32(k) + np.float32(1e-6))
        arrays, values = [x, gamma], (x * inv[:, None]) * gamma
    else:
        up = rng.standard_normal((m, k)).astype(np.float32)
        arrays, values = [x, up], x / (np.float32(1) + np.exp(-x)) * up
    kernel = act_quant.fused_quantizer(k, -8, False, silu_mul=kind == "silu_mul",
                                       rms_eps=1e-6 if kind == "rms" else None, layout=layout)
    gv = bb.add_func(kernel, f"{name}_kernel")
    nb = k // 32
    out_types = [relax.TensorType([m, nb, 32], "int8"), relax.TensorType([m, 2], "float32"),
                 relax.TensorType([m, nb, 2] if layout == "arm_rows" else [m, nb], "int32")]
    for out in range(3):
        params = [relax.Var(f"x{i}", relax.TensorType(list(a.shape), "float32")) for i, a in enumerate(arrays)]
        with bb.function(f"{name}_{out}", params):
            with bb.dataflow():
                parts = bb.emit(relax.call_tir(gv, params, out_types))
                gv_out = bb.emit_output(bb.emit(relax.TupleGetItem(parts, out)))
            bb.emit_func_output(gv_out)
    return arrays, quantize_rows_asym(values)


def _pair_place(i, b, e, m):
    """Where act_quant.pair_index puts byte e of row i, block b (M rows), in numpy."""
    paired = m - m % 2
    if i < paired:
        return b * m * 32 + (i - i % 2) * 32 + (e // 8) * 16 + (i % 2) * 8 + e % 8
    return b * m * 32 + i * 32 + e


def _pair_offsets(off, m):
    """[M, NB] of the offsets the "arm_pairs" / "arm_rows" quantizer wrote ([NB, M, 2] flat,
    block-major: a pair's [t0, t1, t0, t1], an odd last row's [x, x])."""
    nb = off.shape[1]
    flat = off.reshape(-1)
    return np.array([[flat[b * m * 2 + (i - i % 2) * 2 + (i % 2 if i < m - m % 2 else 0)] for b in range(nb)]
                     for i in range(m)])


def _format_weights(fmt, k, n, seed):
    """Weights of format `fmt` as MatMulNBits holds them: (codes, scales, Q4_1's block offsets or
    None, the dequantized matrix)."""
    if fmt == "q8_0":
        u, d, deq = _weights8(k, n, seed)
        return u, d, None, deq
    if fmt == "q4_1":
        return _weights41(k, n, seed)
    wp, d, deq = _weights(k, n, seed)
    return wp, d, None, deq


def _arm_weights(k, n, seed, fmt):
    """The decode GEMV's arrays for one output of weight format `fmt` (row-group codes, scales,
    and Q4_1's block offsets), its scales and the dequantized matrix."""
    codes, d, c, deq = _format_weights(fmt, k, n, seed)
    packed = row_groups.pack_int8(codes, d) if fmt == "q8_0" else row_groups.pack(codes, d)
    return [*packed, *([] if c is None else [row_groups.pack_offsets(c)])], d, deq


def _arm_decode_gemv_case(bb, k: int = 160, fmt: str = "q4_0"):
    """A function of the ARM multi-output decode GEMV (kernels.decode_gemv, dot "sdot", or
    "sdot8" for Q8_0) as the decode fusions build it: three outputs of one quantized activation
    row (a ragged one of 40 rows; biases on two: a projection's bias or the residual), their
    rows concatenated. Returns its name, inputs and numpy reference."""
    from qwc.compiler.kernels import act_quant, decode_gemv

    c = fmt == "q4_1"
    outputs = ((64, True, c), (40, False, c), (136, True, c))
    dot = ARM_GEMV_DOTS[fmt]
    rng = np.random.default_rng(7)
    a = rng.standard_normal((1, k)).astype(np.float32)
    av = relax.Var("a", relax.TensorType([1, k], "float32"))
    params, inputs, refs = [av], [a], []
    for i, (n, has_bias, _) in enumerate(outputs):
        arrays, d, deq = _arm_weights(k, n, 100 + i, fmt)
        bias = rng.standard_normal(n).astype(np.float32) if has_bias else None
        for j, x in enumerate([*arrays, bias]):
            if x is not None:
                params.append(relax.Var(f"x{i}_{j}", relax.TensorType(list(x.shape), str(x.dtype))))
                inputs.append(x)
        refs.append(_a8_reference(a, deq, d, k)[0] + (0 if bias is None else bias))
    nb = (k + 31) // 32
    name = f"decode_gemv3_{fmt}"
    with bb.function(name, params):
        with bb.dataflow():
            quant = bb.add_func(act_quant.fused_quantizer(k, w4a8.ZERO_POINT, True, layout="arm"), "quant")
            parts = bb.emit(relax.call_tir(quant, [av], [relax.TensorType([1, nb, 32], "int8"),
                                                         relax.TensorType([1, nb], "float32"),
                                                         relax.TensorType([1, nb], "int32")]))
            act = [bb.emit(relax.TupleGetItem(parts, j)) for j in range(3)]
            gemv = bb.add_func(decode_gemv(outputs, nb, "float16", dot=dot), f"gemv3_{fmt}")
            ys = bb.emit(relax.call_tir(gemv, act + params[1:], [relax.TensorType([1, o[0]], "float32") for o in outputs]))
            out = bb.emit(relax.op.concat([bb.emit(relax.TupleGetItem(ys, j)) for j in range(3)], axis=1))
            gv = bb.emit_output(out)
        bb.emit_func_output(gv)
    return name, inputs, np.concatenate(refs)[None]


def _arm_split_gemv_case(bb, k: int = 160, n: int = 136, split: int = 2, fmt: str = "q4_0"):
    """The ARM decode GEMV with its blocks in parts (compiler/split_residual_gemv.py: K = 160
    is 5 blocks, parts of 2 and 3), ragged N, the bias in part 0; the parts summed after."""
    from qwc.compiler.kernels import act_quant, decode_gemv

    dot = ARM_GEMV_DOTS[fmt]
    rng = np.random.default_rng(9)
    a = rng.standard_normal((1, k)).astype(np.float32)
    arrays, d, deq = _arm_weights(k, n, 200, fmt)
    bias = rng.standard_normal(n).astype(np.float32)
    inputs = [a, *arrays, bias]
    params = [relax.Var(f"x{j}", relax.TensorType(list(x.shape), str(x.dtype))) for j, x in enumerate(inputs)]
    nb = (k + 31) // 32
    name = f"decode_split_{fmt}"
    with bb.function(name, params):
        with bb.dataflow():
            quant = bb.add_func(act_quant.fused_quantizer(k, w4a8.ZERO_POINT, True, layout="arm"), "quant")
            parts = bb.emit(relax.call_tir(quant, [params[0]], [relax.TensorType([1, nb, 32], "int8"),
                                                                relax.TensorType([1, nb], "float32"),
                                                                relax.TensorType([1, nb], "int32")]))
            act = [bb.emit(relax.TupleGetItem(parts, j)) for j in range(3)]
            gemv = bb.add_func(decode_gemv(((n, True, fmt == "q4_1"),), nb, "float16", dot=dot, split=split),
                               f"gemv_split_{fmt}")
            ys = bb.emit(relax.call_tir(gemv, act + params[1:], relax.TensorType([split, n], "float32")))
            gv = bb.emit_output(bb.emit(relax.op.sum(ys, axis=[0], keepdims=True)))
        bb.emit_func_output(gv)
    return name, inputs, _a8_reference(a, deq, d, k) + bias


_COMPILED = {}   # id(func) -> (func, its library): the kernel builders return one func per arguments


def _host_kernel(func):
    import tvm

    if id(func) not in _COMPILED:
        _COMPILED[id(func)] = func, tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}),
                                                target=get_target("host").tvm_target())
    return _COMPILED[id(func)][1]


def _attention_reference(q, k, v, past, s, heads, kvh, hd, scale):
    """numpy's causal attention of q [1, s, heads*hd] over keys and values [past + s, kvh*hd]."""
    ref = np.zeros_like(q)
    kh, vh = k.reshape(-1, kvh, hd), v.reshape(-1, kvh, hd)
    for h in range(heads):
        for i in range(s):
            sc = kh[:past + i + 1, h // (heads // kvh)] @ q[0, i, h * hd:(h + 1) * hd] * scale
            p = np.exp(sc - sc.max())
            ref[0, i, h * hd:(h + 1) * hd] = p @ vh[:past + i + 1, h // (heads // kvh)] / p.sum()
    return ref


def _assert_prompt_attention(out, q, k, v, past, s, heads, kvh, hd, scale, dtype, err_msg=""):
    """out against numpy's attention over the keys and values the cache holds: to 2e-6; a
    prompt (two tokens or more) on a float16 cache to 1e-3 of the output's range, where the
    kernel multiplies the scaled query rounded to float16, as numpy's does here, and the
    weights rounded to float16 (prefill_attention.attention: 3e-4 measured)."""
    if dtype == "float16" and s >= 2:
        rounded = (q * np.float32(scale)).astype(np.float16).astype(np.float32)
        ref = _attention_reference(rounded, k, v, past, s, heads, kvh, hd, 1.0)
        np.testing.assert_allclose(out, ref, rtol=0, atol=1e-3 * np.abs(ref).max(), err_msg=err_msg)
        assert not np.allclose(out, _attention_reference(q, k, v, past, s, heads, kvh, hd, scale), rtol=0, atol=2e-6)
    else:
        np.testing.assert_allclose(out, _attention_reference(q, k, v, past, s, heads, kvh, hd, scale), rtol=0,
                                   atol=2e-6, err_msg=err_msg)


def _q8_0(x):
    """x [n, m] through llama.cpp's q8_0 (blocks of 32 along m: roundf(x / d), d = max |x| / 127
    as float16), dequantized: what a q8_0 cache holds."""
    blocks = x.reshape(-1, 32)
    d = np.abs(blocks).max(1, keepdims=True) / np.float32(127)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    codes = np.trunc(blocks * inv + np.copysign(np.float32(0.5), blocks * inv))
    return (codes * d.astype(np.float16).astype(np.float32)).reshape(x.shape).astype(np.float32)


def _cache_holds(x, dtype):
    """What a cache of `dtype` holds of x (float32)."""
    return _q8_0(x) if dtype == "q8_0" else x.astype(dtype).astype(np.float32)


def _filled_caches(k, v, chunks, kvh, hd, cap, dtype="float32"):
    """K (key tiles) and V (rows) cache buffers of `dtype`, NaN past what the cache writers
    wrote of k, v [n, kvh*hd] chunk by chunk: a kernel that read an unwritten slot would return
    NaN (q8_0: bytes 0x7e, codes of 126 with float16 NaN scales)."""
    import tvm

    from qwc.compiler.kernels import kv_cache

    write_k, write_v = (_host_kernel(kv_cache.kv_cache_write(tiles, dtype=dtype, head_dim=hd)) for tiles in (True, False))
    shape, element = (1, kvh, cap, kv_cache.cache_width(dtype, hd)), kv_cache.cache_element(dtype)
    fill = 0x7E if dtype == "q8_0" else np.nan
    kc, vc = (tvm.runtime.tensor(np.full(shape, fill, element)) for _ in range(2))
    for lo, hi in chunks:
        if hi > lo:
            n = tvm.runtime.tensor(np.array([hi - 1], np.int32))
            write_k(kc, tvm.runtime.tensor(k[None, lo:hi].copy()), n)
            write_v(vc, tvm.runtime.tensor(v[None, lo:hi].copy()), n)
    return kc, vc


@pytest.mark.parametrize("past, s", [(0, 1), (0, 17), (5, 1), (15, 3), (16, 1), (37, 17), (40, 1),
                                     (100, 40), (0, 257), (131, 255), (0, 31), (2, 31), (0, 33), (999, 1),
                                     (744, 256), (40, 300)])
@pytest.mark.parametrize("dtype", ["float32", "float16", "q8_0"])
@pytest.mark.parametrize("registers", [(16, 32), (32, 64)])
def test_attention_reads_the_key_tiles_its_cache_writer_wrote(past, s, dtype, registers):
    """The cache writers (K in key tiles of 16, V in rows) then the online-softmax attention,
    against numpy's causal attention (over the keys and values rounded to the cache's dtype):
    histories and chunks that do and do not fill tiles, one query a task (s < 32), blocks of 2
    and of 16 queries with a ragged last block, keys in one span and in several, 1,000
    positions; one query at a time (AVX2's and NEON's registers) and in groups of 3 (AVX-512's:
    a span below all of a group's keys taken by the group, the others one by one). A prompt
    on a float16 cache takes float16 operands (_assert_prompt_attention)."""
    import tvm

    from qwc.compiler.kernels import prefill_attention

    heads, kvh, hd, cap = 14, 2, 64, max(64, -(-(past + s) // 16) * 16)
    rng = np.random.default_rng(past * 31 + s)
    k, v = (rng.standard_normal((past + s, kvh * hd), dtype=np.float32) for _ in range(2))
    q = rng.standard_normal((1, s, heads * hd), dtype=np.float32)
    kc, vc = _filled_caches(k, v, ((0, past), (past, past + s)), kvh, hd, cap, dtype)  # the history, then the chunk
    out = tvm.runtime.tensor(np.zeros_like(q))
    _host_kernel(prefill_attention.attention(heads, kvh, hd, 0.125, kv_dtype=dtype, registers=registers))(
        tvm.runtime.tensor(q), kc, vc, tvm.runtime.tensor(np.array([past + s - 1], np.int32)), out)
    k, v = (_cache_holds(x.reshape(-1, hd), dtype).reshape(x.shape) for x in (k, v))
    _assert_prompt_attention(out.numpy(), q, k, v, past, s, heads, kvh, hd, 0.125, dtype)


@pytest.mark.parametrize("dtype", ["float32", "float16", "q8_0"])
def test_attention_at_head_dim_128_on_neon_registers(dtype):
    """The one-query kernel as NEON's registers build it at head_dim 128 (a 7B's, Qwen3's): the
    tiles' scores a loop of 16 elements, and the values chunk by chunk, each chunk rescaled as
    it is loaded (prefill_attention: tile_scores, weigh_values), against
    numpy, keys in tiles only (48 tokens), in spans and tiles (100 after 40) and a masked
    tile; and the same bits whichever chunk a query comes in."""
    import tvm

    from qwc.compiler.kernels import prefill_attention

    heads, kvh, hd, n = 4, 2, 128, 140
    rng = np.random.default_rng(128)
    k, v = (rng.standard_normal((n, kvh * hd), dtype=np.float32) for _ in range(2))
    q = rng.standard_normal((1, n, heads * hd), dtype=np.float32)
    kernel = _host_kernel(prefill_attention.attention(heads, kvh, hd, 0.09, kv_dtype=dtype, registers=(32, 16)))
    held = [_cache_holds(x.reshape(-1, hd), dtype).reshape(x.shape) for x in (k, v)]
    outs = {}
    for past, s in ((0, 48), (40, 100), (0, 140), (5, 17)):
        kc, vc = _filled_caches(k[:past + s], v[:past + s], ((0, past), (past, past + s)), kvh, hd, 160, dtype)
        out = tvm.runtime.tensor(np.zeros((1, s, heads * hd), np.float32))
        kernel(tvm.runtime.tensor(q[:, past:past + s].copy()), kc, vc, tvm.runtime.tensor(np.array([past + s - 1], np.int32)),
               out)
        outs[past, s] = out.numpy()
        _assert_prompt_attention(outs[past, s], q[:, past:past + s], held[0][:past + s], held[1][:past + s], past, s,
                                 heads, kvh, hd, 0.09, dtype, f"{past} + {s}")
    np.testing.assert_array_equal(outs[40, 100], outs[0, 140][:, 40:])


@pytest.mark.slow
@pytest.mark.arm
def test_attention_takes_float16_products_on_arm_yitian(tmp_path):
    """arm-yitian's prefill attention on a float16 cache (`half_products`: FEAT_FHM's `fmlal`,
    no widening of the cache's elements), under qemu at head_dim 128 and 64: within 1e-3 of
    numpy's attention where the scaled query is rounded to float16 as the kernel rounds it (the
    weights' rounding to float16 is the rest: 3e-4 measured), and the bits of the form a target
    without FEAT_FHM takes (the same operands rounded, multiplied in float32: fmlal's products
    are exact), so the targets agree; the library has `fmlal` (which only the FEAT_FHM form
    makes)."""
    import subprocess

    import tvm

    from qwc.bench import emulation
    from qwc.compiler.kernels import prefill_attention

    t = get_target("arm-yitian")
    assert "fp16fml" in t.features
    bb, inputs, refs, runs = relax.BlockBuilder(), {}, {}, ((0, 48), (40, 100), (0, 140), (5, 17))
    for hd in (128, 64):
        heads, kvh, n, scale = 4, 2, 140, hd ** -0.5
        rng = np.random.default_rng(hd)
        k, v = (rng.standard_normal((n, kvh * hd), dtype=np.float32) for _ in range(2))
        q = rng.standard_normal((1, n, heads * hd), dtype=np.float32)
        held = [_cache_holds(x.reshape(-1, hd), "float16").reshape(x.shape) for x in (k, v)]
        rounded = (q * np.float32(scale)).astype(np.float16).astype(np.float32)   # the query as the kernel takes it
        for half in (True, False):
            f = prefill_attention.attention(heads, kvh, hd, scale, kv_dtype="float16", registers=(32, 16),
                                            half_products=half)
            gv = bb.add_func(f, f"attention_{hd}_{half}")
            for past, s in runs:
                name = f"attention_{hd}_{half}_{past}_{s}"
                kc, vc = _filled_caches(k[:past + s], v[:past + s], ((0, past), (past, past + s)), kvh, hd, 160, "float16")
                args = [q[:, past:past + s].copy(), kc.numpy(), vc.numpy(), np.array([past + s - 1], np.int32)]
                params = [relax.Var(f"x{i}", relax.TensorType(list(a.shape), str(a.dtype))) for i, a in enumerate(args)]
                with bb.function(name, params):
                    bb.emit_func_output(bb.emit(relax.call_tir(gv, params, relax.TensorType([1, s, heads * hd], "float32"))))
                inputs.update({f"{name}/{i}": a for i, a in enumerate(args)})
                refs[name] = _attention_reference(rounded[:, past:past + s], held[0][:past + s], held[1][:past + s],
                                                  past, s, heads, kvh, hd, 1.0)
    lib = tmp_path / "attention.so"
    build(bb.get(), t).export_library(str(lib), fcompile=tvm.support.cc.cross_compiler(t.cross_compiler))
    asm = subprocess.run(["aarch64-linux-gnu-objdump", "-d", "--no-show-raw-insn", str(lib)], capture_output=True,
                         text=True).stdout
    assert re.search(r"\sfmlal\s", asm) and re.search(r"\sfmlal2\s", asm)
    out = emulation.run_library(emulation.arm64_env(), lib, inputs, tmp_path)[0]
    for hd in (128, 64):
        for past, s in runs:
            got, ref = out[f"attention_{hd}_True_{past}_{s}"], refs[f"attention_{hd}_True_{past}_{s}"]
            np.testing.assert_allclose(got, ref, rtol=0, atol=1e-3 * np.abs(ref).max(), err_msg=f"{hd}: {past} + {s}")
            np.testing.assert_array_equal(got, out[f"attention_{hd}_False_{past}_{s}"], err_msg=f"{hd}: {past} + {s}")
        np.testing.assert_array_equal(out[f"attention_{hd}_True_40_100"], out[f"attention_{hd}_True_0_140"][:, 40:])


@pytest.mark.parametrize("dtype", ["float32", "float16", "q8_0"])
@pytest.mark.parametrize("registers", [(16, 32), (32, 64)])
def test_attention_bits_do_not_depend_on_the_chunking(dtype, registers):
    """A query's output is the same to the bit whichever chunk it comes in and wherever it falls
    in its task's block and query groups (AVX-512: the diagonal's last spans in masked groups
    of 3, or one by one): 150 tokens in one chunk, and after histories of 1, 5, 17, 64 and 70."""
    import tvm

    from qwc.compiler.kernels import prefill_attention

    heads, kvh, hd, n = 14, 2, 64, 150
    rng = np.random.default_rng(11)
    k, v = (rng.standard_normal((n, kvh * hd), dtype=np.float32) for _ in range(2))
    q = rng.standard_normal((1, n, heads * hd), dtype=np.float32)
    kernel = _host_kernel(prefill_attention.attention(heads, kvh, hd, 0.125, kv_dtype=dtype, registers=registers))
    outs = {}
    for past in (0, 1, 5, 17, 64, 70):
        kc, vc = _filled_caches(k, v, ((0, past), (past, n)), kvh, hd, 160, dtype)
        out = tvm.runtime.tensor(np.zeros((1, n - past, heads * hd), np.float32))
        kernel(tvm.runtime.tensor(q[:, past:].copy()), kc, vc, tvm.runtime.tensor(np.array([n - 1], np.int32)), out)
        outs[past] = out.numpy()
        assert np.isfinite(outs[past]).all()
        np.testing.assert_array_equal(outs[past], outs[0][:, past:], err_msg=f"after {past}")


@pytest.mark.parametrize("dtype", ["float32", "float16", "q8_0"])
@pytest.mark.parametrize("registers", [(16, 32), (32, 64)])
def test_a_chunks_last_query_alone_attends_as_among_the_chunk(dtype, registers):
    """`last_query` (prefill's last layer: passes/last_position.py): the chunk's last query
    alone, told the chunk's length, gives the bits the whole chunk gives its last row (on a
    float16 cache, the prompt's float16 operands), for chunks of 2 to 150 tokens after
    histories of 0 to 70; a chunk of one token attends as the plain kernel's, in float32."""
    import tvm

    from qwc.compiler.kernels import prefill_attention

    heads, kvh, hd, n = 14, 2, 64, 150
    rng = np.random.default_rng(12)
    k, v = (rng.standard_normal((n, kvh * hd), dtype=np.float32) for _ in range(2))
    q = rng.standard_normal((1, n, heads * hd), dtype=np.float32)
    whole = _host_kernel(prefill_attention.attention(heads, kvh, hd, 0.125, kv_dtype=dtype, registers=registers))
    last = _host_kernel(prefill_attention.attention(heads, kvh, hd, 0.125, kv_dtype=dtype, registers=registers,
                                                    last_query=True))
    for past, s in ((0, 150), (70, 80), (5, 2), (17, 48), (100, 1)):
        kc, vc = _filled_caches(k[:past + s], v[:past + s], ((0, past), (past, past + s)), kvh, hd, 160, dtype)
        seqlens = tvm.runtime.tensor(np.array([past + s - 1], np.int32))
        out = tvm.runtime.tensor(np.zeros((1, s, heads * hd), np.float32))
        whole(tvm.runtime.tensor(q[:, past:past + s].copy()), kc, vc, seqlens, out)
        alone = tvm.runtime.tensor(np.zeros((1, 1, heads * hd), np.float32))
        last(tvm.runtime.tensor(q[:, past + s - 1:past + s].copy()), kc, vc, seqlens, s, alone)
        assert np.isfinite(alone.numpy()).all()
        np.testing.assert_array_equal(alone.numpy(), out.numpy()[:, -1:], err_msg=f"{past} + {s}")


@pytest.mark.parametrize("segments", [
    # (row, history, new tokens): decode tokens of several rows beside a prompt chunk; chunks
    # that fill tiles and spans and that do not; a row left out (row 1 below)
    [(0, 5, 1), (2, 40, 1), (3, 0, 37)],
    [(3, 100, 40), (0, 0, 1), (2, 16, 1)],
    [(0, 131, 17)],
    [(2, 999, 1), (0, 63, 1), (3, 64, 2), (1, 0, 1)],
])
@pytest.mark.parametrize("dtype", ["float32", "float16", "q8_0"])
@pytest.mark.parametrize("registers", [(16, 32), (32, 64)])
def test_ragged_attention_attends_each_segment_to_its_own_row(segments, dtype, registers):
    """A mixed step's attention (kernels/prefill_attention.py, `ragged`): the tokens of several
    segments in one buffer, each written by ragged_kv_cache_write into its own cache row after
    that row's history (written by the one-sequence writer), and attending to that row's
    cache as a prefill chunk does (a segment of two tokens or more as a prompt: on a float16
    cache with float16 operands); against numpy's causal attention a row at a time, and
    with the row not in any segment untouched (NaN stays NaN)."""
    import tvm

    from qwc.compiler.kernels import kv_cache, prefill_attention

    heads, kvh, hd, cap, rows = 14, 2, 64, 1024, 4
    rng = np.random.default_rng(len(segments) * 7 + segments[0][1])
    data, caches = {}, []
    for r in range(rows):
        seg = next((x for x in segments if x[0] == r), None)
        past, s = (seg[1], seg[2]) if seg else (3, 0)
        k, v = (rng.standard_normal((past + s, kvh * hd), dtype=np.float32) for _ in range(2))
        data[r] = k, v
        caches.append([c.numpy() for c in _filled_caches(k, v, ((0, past),), kvh, hd, cap, dtype)])
    kc, vc = (tvm.runtime.tensor(np.concatenate([c[i] for c in caches])) for i in (0, 1))
    total = sum(s for _, _, s in segments)
    seg = np.array([(r, sum(x[2] for x in segments[:i]), s) for i, (r, _, s) in enumerate(segments)], np.int64)
    pos = np.concatenate([np.arange(p, p + s) for _, p, s in segments])[None].astype(np.int64)
    new_k = np.concatenate([data[r][0][p:] for r, p, _ in segments])[None]
    new_v = np.concatenate([data[r][1][p:] for r, p, _ in segments])[None]
    q = rng.standard_normal((1, total, heads * hd), dtype=np.float32)
    seg_t, pos_t = tvm.runtime.tensor(seg), tvm.runtime.tensor(pos)
    for tiles, c, new in ((True, kc, new_k), (False, vc, new_v)):
        _host_kernel(kv_cache.ragged_kv_cache_write(tiles, dtype, hd))(c, tvm.runtime.tensor(new.copy()), seg_t, pos_t)
    out = tvm.runtime.tensor(np.zeros_like(q))
    _host_kernel(prefill_attention.attention(heads, kvh, hd, 0.125, kv_dtype=dtype, registers=registers, ragged=True))(
        tvm.runtime.tensor(q), kc, vc, seg_t, pos_t, out)
    got = out.numpy()
    for (r, past, s), (_, first, _) in zip(segments, seg):
        k, v = (_cache_holds(x.reshape(-1, hd), dtype).reshape(x.shape) for x in data[r])
        _assert_prompt_attention(got[:, first:first + s], q[:, first:first + s], k, v, past, s, heads, kvh, hd, 0.125,
                                 dtype, f"row {r}")
    untouched = next((r for r in range(rows) if all(x[0] != r for x in segments)), None)
    if untouched is not None and dtype != "q8_0":   # its slots past its history were never written
        assert np.isnan(vc.numpy()[untouched, :, 3:]).all()


def _rotary(x, pos, cos, sin, heads):
    """The TE rotary (generic.rotary, scheduled as the build schedules it; what RotaryEmbedding
    compiles to where the vector form does not apply) on x [b, s, heads*hd] at positions pos."""
    import tvm
    from tvm import te

    from qwc.compiler.schedule import schedule_func

    xs, ps, cs, ss = (te.placeholder(a.shape, str(a.dtype)) for a in (x, pos, cos, sin))
    func = schedule_func(te.create_prim_func([xs, ps, cs, ss, generic.rotary(xs, ps, cs, ss, heads=heads)]))
    out = tvm.runtime.tensor(np.zeros_like(x))
    _host_kernel(func)(*(tvm.runtime.tensor(a) for a in (x, pos, cos, sin)), out)
    return out.numpy()


@pytest.mark.parametrize("b, s, heads, hd, pos_dtype", [
    (1, 1, 14, 64, "int64"), (1, 37, 2, 64, "int64"), (3, 1, 4, 128, "int32"), (1, 300, 14, 64, "int64")])
def test_vector_rotary_gives_the_te_rotarys_bits(b, s, heads, hd, pos_dtype):
    """The rotary kernel RotaryEmbedding compiles to (generic.rotary_halves: vector halves, on
    the calling thread for a decode step, over threads for a 300-token prompt) against the TE
    rotary it replaces, bit for bit, and numpy's rotate-half within float rounding."""
    import tvm

    rng = np.random.default_rng(b * 7 + s)
    x = rng.standard_normal((b, s, heads * hd), dtype=np.float32)
    pos = rng.integers(0, 50, (b, s)).astype(pos_dtype)
    cos, sin = (rng.standard_normal((64, hd // 2), dtype=np.float32) for _ in range(2))
    out = tvm.runtime.tensor(np.zeros_like(x))
    _host_kernel(generic.rotary_halves(heads * hd, heads, pos_dtype))(
        *(tvm.runtime.tensor(a) for a in (x, pos, cos, sin)), out)
    assert np.array_equal(out.numpy(), _rotary(x, pos, cos, sin, heads))
    xh = x.reshape(b, s, heads, 2, hd // 2)
    c, sn = cos[pos][:, :, None], sin[pos][:, :, None]
    ref = np.concatenate([xh[..., 0, :] * c - xh[..., 1, :] * sn, xh[..., 1, :] * c + xh[..., 0, :] * sn], -1)
    np.testing.assert_allclose(out.numpy(), ref.reshape(x.shape), rtol=0, atol=1e-5)
    assert generic.rotary_halves(3 * 6, 3, "int64") is None   # halves of 3: the TE kernel's


@pytest.mark.parametrize("heads, kvh, hd", [(14, 2, 64), (4, 2, 32)])
@pytest.mark.parametrize("past", [0, 5, 15, 16, 40, 130, 999, 1600])
@pytest.mark.parametrize("layout, per_task", [("plain", None), ("arm", 1)])
@pytest.mark.parametrize("dtype", ["float32", "float16", "q8_0"])
@pytest.mark.parametrize("registers, split", [((16, 32), None), ((32, 64), None), ((32, 16), 512), ((16, 32), 64)])
def test_decode_attention_rotates_writes_the_cache_and_quantizes(heads, kvh, hd, past, layout, per_task, dtype,
                                                                 registers, split):
    """The three-pass decode attention given one token's q, k, v before rotary: the cache it
    leaves equals, bit for bit, what the rotary kernel then the cache writers leave (K tiles, V
    rows; slot `past`, at position past + 3 to tell the two apart), its output equals numpy's
    attention over it, and its Q8_0 blocks equal the quantizer kernel's of that output, bit
    for bit: as x86 builds it (a task per kv head, the plain layout) and as ARM does (a task
    per query head, every task of a kv head writing its new key and value; int32 offsets); at
    each cache dtype; with the register tiles of AVX2's, AVX-512's and NEON's register files
    (several score groups, value tiles of a part of a head); across several blocks of values;
    the keys whole, or split in spans of 512 or 64 keys (a task each, then merged)."""
    import tvm

    from qwc.compiler.kernels import act_quant, decode_attention

    cap, scale = -(-(past + 1) // 16) * 16 + 16, 1 / np.sqrt(hd)
    pos = np.array([[past + 3]], np.int64)
    rng = np.random.default_rng(past * 7 + hd)
    k, v = (rng.standard_normal((past + 1, kvh * hd), dtype=np.float32) for _ in range(2))
    q = rng.standard_normal((1, 1, heads * hd), dtype=np.float32)
    angles = np.arange(past + 8)[:, None] * 10000.0 ** (-np.arange(hd // 2) / (hd // 2))
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    keys = np.concatenate([k[:past], _rotary(k[None, past:], pos, cos, sin, kvh)[0]])
    want_k, want_v = (x.numpy() for x in _filled_caches(keys, v, ((0, past), (past, past + 1)), kvh, hd, cap, dtype))
    kc, vc = _filled_caches(k, v, ((0, past),), kvh, hd, cap, dtype)
    nb = heads * hd // 32
    out, aq, ad, off = (tvm.runtime.tensor(np.zeros(shape, dt)) for shape, dt in (
        (q.shape, np.float32), ((1, nb, 32), np.int8), ((1, nb), np.float32), ((1, nb), np.int32)))
    kernel = _host_kernel(decode_attention.decode_attention(heads, kvh, hd, float(scale), "int64", w4a8.ZERO_POINT,
                                                     layout, per_task, dtype, registers, split))
    kernel(*(tvm.runtime.tensor(x) for x in (q, k[None, past:], v[None, past:])), kc, vc,
           tvm.runtime.tensor(np.array([past], np.int32)), *(tvm.runtime.tensor(x) for x in (pos, cos, sin)),
           out, aq, ad, off)
    np.testing.assert_array_equal(kc.numpy(), want_k)
    np.testing.assert_array_equal(vc.numpy(), want_v)
    keys, v = (_cache_holds(x.reshape(-1, hd), dtype).reshape(x.shape) for x in (keys, v))
    ref = _attention_reference(_rotary(q, pos, cos, sin, heads), keys, v, past, 1, heads, kvh, hd, scale)
    np.testing.assert_allclose(out.numpy(), ref, rtol=0, atol=2e-6)
    quantizer = _host_kernel(act_quant.fused_quantizer(heads * hd, w4a8.ZERO_POINT, True, layout=layout))
    want = [tvm.runtime.tensor(np.zeros(x.shape, x.dtype)) for x in (aq, ad, off)]
    quantizer(tvm.runtime.tensor(out.numpy().reshape(1, -1)), *want)
    for got, exp in zip((aq, ad, off), want):
        np.testing.assert_array_equal(got.numpy(), exp.numpy())


@pytest.mark.parametrize("dtype", ["float32", "float16", "q8_0"])
def test_decode_attention_key_prefetch_moves_only_the_prefetch(dtype):
    """key_prefetch (targets.Kernels.decode_key_prefetch) sets how far ahead the scores pass
    prefetches each K stream, in bytes whatever the cache's type: the kernel's outputs and
    cache are the default kernel's bit for bit, and its prefetches reach 4 KiB past the line
    they are issued at, where the default's reach K_PREFETCH_LINES lines."""
    import re

    import tvm

    from qwc.compiler.kernels import decode_attention
    from qwc.compiler.kernels.kv_cache import KEY_TILE, KV_DTYPES

    heads, kvh, hd, past = 14, 2, 64, 1300
    rng = np.random.default_rng(3)
    cap = -(-(past + 1) // 16) * 16 + 16
    k, v = (rng.standard_normal((past + 1, kvh * hd), dtype=np.float32) for _ in range(2))
    q = rng.standard_normal((1, 1, heads * hd), dtype=np.float32)
    angles = np.arange(past + 8)[:, None] * 10000.0 ** (-np.arange(hd // 2) / (hd // 2))
    inputs = (q, k[None, past:], v[None, past:])
    tables = (np.array([[past]], np.int64), np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32))
    nb = heads * hd // 32
    results = []
    for ahead in (None, 4096):
        func = decode_attention.decode_attention(heads, kvh, hd, hd ** -0.5, "int64", w4a8.ZERO_POINT, "plain", None,
                                                 dtype, (32, 64), None, key_prefetch=ahead)
        # the line a K prefetch reads: `d + distance` in the scores pass's index arithmetic
        assert "llvm.prefetch" in func.script()
        lines = {int(x) for x in re.findall(r"d \+ (\d+)", func.script())}
        want = decode_attention.K_PREFETCH_LINES if ahead is None else ahead // (KEY_TILE * KV_DTYPES[dtype])
        assert want in lines, (ahead, lines)
        kc, vc = _filled_caches(k, v, ((0, past),), kvh, hd, cap, dtype)
        outs = [tvm.runtime.tensor(np.zeros(shape, dt)) for shape, dt in (
            (q.shape, np.float32), ((1, nb, 32), np.int8), ((1, nb), np.float32), ((1, nb), np.int32))]
        _host_kernel(func)(*(tvm.runtime.tensor(x) for x in inputs), kc, vc, tvm.runtime.tensor(np.array([past], np.int32)),
                           *(tvm.runtime.tensor(x) for x in tables), *outs)
        results.append([x.numpy() for x in (kc, vc, *outs)])
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("heads, kvh, hd, per_task", [(14, 2, 64, None), (4, 2, 32, 1)])
@pytest.mark.parametrize("past, t", [(0, 1), (5, 3), (14, 4), (40, 9), (1020, 7), (1300, 2)])
@pytest.mark.parametrize("dtype", ["float32", "float16", "q8_0"])
@pytest.mark.parametrize("split", [None, 512])
def test_decode_attention_over_queries_is_each_tokens_decode_step(heads, kvh, hd, per_task, past, t, dtype, split):
    """decode_attention(queries=True), t tokens after `past` cached in one call (a verify
    call), leaves the cache and gives the output of t decode_attention calls one token after
    another, bit for bit: across tiles, and with keys split in spans of 512 where the
    tokens straddle a span's end (1020 + 7) or are past several (1300)."""
    import tvm

    from qwc.compiler.kernels import decode_attention

    cap, scale = -(-(past + t) // 16) * 16 + 16, float(1 / np.sqrt(hd))
    rng = np.random.default_rng(past * 7 + t)
    k, v = (rng.standard_normal((past + t, kvh * hd), dtype=np.float32) for _ in range(2))
    q = rng.standard_normal((1, t, heads * hd), dtype=np.float32)
    pos = np.arange(past, past + t, dtype=np.int64)[None] + 3
    angles = np.arange(past + t + 8)[:, None] * 10000.0 ** (-np.arange(hd // 2) / (hd // 2))
    cos, sin = (tvm.runtime.tensor(f(angles).astype(np.float32)) for f in (np.cos, np.sin))
    one = _host_kernel(decode_attention.decode_attention(heads, kvh, hd, scale, "int64", None, "plain", per_task, dtype,
                                                  (32, 64), split))
    many = _host_kernel(decode_attention.decode_attention(heads, kvh, hd, scale, "int64", None, "plain", per_task, dtype,
                                                   (32, 64), split, queries=True))
    kc1, vc1 = _filled_caches(k, v, ((0, past),), kvh, hd, cap, dtype)
    outs = []
    for i in range(t):
        out = tvm.runtime.tensor(np.zeros((1, 1, heads * hd), np.float32))
        one(*(tvm.runtime.tensor(np.ascontiguousarray(x)) for x in (q[:, i:i + 1], k[None, past + i:past + i + 1],
                                                                    v[None, past + i:past + i + 1])),
            kc1, vc1, tvm.runtime.tensor(np.array([past + i], np.int32)), tvm.runtime.tensor(pos[:, i:i + 1]),
            cos, sin, out)
        outs.append(out.numpy())
    kc2, vc2 = _filled_caches(k, v, ((0, past),), kvh, hd, cap, dtype)
    out = tvm.runtime.tensor(np.zeros(q.shape, np.float32))
    many(*(tvm.runtime.tensor(x) for x in (q, k[None, past:], v[None, past:])), kc2, vc2,
         tvm.runtime.tensor(np.array([past + t - 1], np.int32)), tvm.runtime.tensor(pos), cos, sin, out)
    np.testing.assert_array_equal(kc2.numpy(), kc1.numpy())
    np.testing.assert_array_equal(vc2.numpy(), vc1.numpy())
    np.testing.assert_array_equal(out.numpy(), np.concatenate(outs, axis=1))


@pytest.mark.parametrize("heads, kvh, hd, per_task", [(14, 2, 64, None), (4, 2, 32, 1)])
@pytest.mark.parametrize("pasts", [(0,), (5, 40, 17), (1020, 3, 1300, 511)])
@pytest.mark.parametrize("dtype", ["float16", "q8_0"])
@pytest.mark.parametrize("split", [None, 512])
def test_decode_attention_over_rows_is_each_rows_decode_step(heads, kvh, hd, per_task, pasts, dtype, split):
    """decode_attention(rows=True), a token of each of B sequences (cache rows [B, ...], each
    at its own length: decode_batch), leaves each row's cache and gives its output as a
    decode_attention call on that row alone would, bit for bit; rows of one span and of
    several (split)."""
    import tvm

    from qwc.compiler.kernels import decode_attention

    n, scale = len(pasts), float(1 / np.sqrt(hd))
    cap = -(-(max(pasts) + 1) // 16) * 16 + 16
    rng = np.random.default_rng(sum(pasts) + n)
    ks, vs = ([rng.standard_normal((p + 1, kvh * hd), dtype=np.float32) for p in pasts] for _ in range(2))
    q = rng.standard_normal((n, 1, heads * hd), dtype=np.float32)
    pos = np.array(pasts, np.int64)[:, None] + 2
    angles = np.arange(cap + 8)[:, None] * 10000.0 ** (-np.arange(hd // 2) / (hd // 2))
    cos, sin = (tvm.runtime.tensor(f(angles).astype(np.float32)) for f in (np.cos, np.sin))
    args = (heads, kvh, hd, scale, "int64", None, "plain", per_task, dtype, (32, 64), split)
    one, many = _host_kernel(decode_attention.decode_attention(*args)), _host_kernel(decode_attention.decode_attention(*args, rows=True))
    want_k, want_v, want_out = [], [], []
    for b, p in enumerate(pasts):
        kc, vc = _filled_caches(ks[b], vs[b], ((0, p),), kvh, hd, cap, dtype)
        out = tvm.runtime.tensor(np.zeros((1, 1, heads * hd), np.float32))
        one(*(tvm.runtime.tensor(np.ascontiguousarray(x)) for x in (q[b:b + 1], ks[b][None, p:], vs[b][None, p:])),
            kc, vc, tvm.runtime.tensor(np.array([p], np.int32)), tvm.runtime.tensor(pos[b:b + 1]), cos, sin, out)
        want_k.append(kc.numpy())
        want_v.append(vc.numpy())
        want_out.append(out.numpy())
    caches = [_filled_caches(ks[b], vs[b], ((0, p),), kvh, hd, cap, dtype) for b, p in enumerate(pasts)]
    kc, vc = (tvm.runtime.tensor(np.concatenate([c[i].numpy() for c in caches])) for i in (0, 1))
    out = tvm.runtime.tensor(np.zeros(q.shape, np.float32))
    many(tvm.runtime.tensor(q), *(tvm.runtime.tensor(np.stack([x[b][p:] for b, p in enumerate(pasts)]))
                                  for x in (ks, vs)),
         kc, vc, tvm.runtime.tensor(np.array(pasts, np.int32)), tvm.runtime.tensor(pos), cos, sin, out)
    np.testing.assert_array_equal(kc.numpy(), np.concatenate(want_k))
    np.testing.assert_array_equal(vc.numpy(), np.concatenate(want_v))
    np.testing.assert_array_equal(out.numpy(), np.concatenate(want_out))


@pytest.mark.parametrize("heads, kvh, hd, per_task", [(14, 2, 64, None), (4, 2, 32, 1)])
@pytest.mark.parametrize("pasts", [(3, 20, 7), (1020, 40, 1300)])
@pytest.mark.parametrize("dtype", ["float16", "q8_0"])
@pytest.mark.parametrize("split", [None, 512])
def test_decode_attention_over_segments_is_each_decode_tokens_step(heads, kvh, hd, per_task, pasts, dtype, split):
    """decode_attention(segments=True) in a mixed step (a decode token of rows 0 and 2, a
    3-token chunk of row 1 between them), given the queries as the rotary kernel rotates them
    and the caches with the tokens' keys and values in: each decode token's output is its
    decode step's, bit for bit (the step's online output for the chunk left as it was)."""
    import tvm

    from qwc.compiler.kernels import decode_attention, generic

    scale = float(1 / np.sqrt(hd))
    cap = -(-(max(pasts) + 4) // 16) * 16 + 16
    rng = np.random.default_rng(sum(pasts))
    angles = np.arange(cap + 8)[:, None] * 10000.0 ** (-np.arange(hd // 2) / (hd // 2))
    cos, sin = (tvm.runtime.tensor(f(angles).astype(np.float32)) for f in (np.cos, np.sin))
    args = (heads, kvh, hd, scale, "int64", None, "plain", per_task, dtype, (32, 64), split)
    one, seg = _host_kernel(decode_attention.decode_attention(*args)), _host_kernel(decode_attention.decode_attention(*args, segments=True))
    rotary = _host_kernel(generic.rotary_halves(heads * hd, heads, "int64"))
    positions = np.array([[pasts[0], pasts[1], pasts[1] + 1, pasts[1] + 2, pasts[2]]], np.int64)
    q = rng.standard_normal((1, 5, heads * hd), dtype=np.float32)
    caches, want = [], {}
    for b, tok in ((0, 0), (1, None), (2, 4)):
        k, v = (rng.standard_normal((pasts[b] + 1, kvh * hd), dtype=np.float32) for _ in range(2))
        kc, vc = _filled_caches(k, v, ((0, pasts[b]),), kvh, hd, cap, dtype)
        if tok is not None:   # the decode step, which also writes the token's key and value
            out = tvm.runtime.tensor(np.zeros((1, 1, heads * hd), np.float32))
            one(tvm.runtime.tensor(np.ascontiguousarray(q[:, tok:tok + 1])), *(tvm.runtime.tensor(x[None, -1:])
                                                                               for x in (k, v)),
                kc, vc, tvm.runtime.tensor(np.array([pasts[b]], np.int32)),
                tvm.runtime.tensor(positions[:, tok:tok + 1]), cos, sin, out)
            want[tok] = out.numpy()[0, 0]
        caches.append((kc.numpy(), vc.numpy()))
    rotated = tvm.runtime.tensor(np.zeros(q.shape, np.float32))
    rotary(tvm.runtime.tensor(q), tvm.runtime.tensor(positions), cos, sin, rotated)
    before = rng.standard_normal(q.shape, dtype=np.float32)   # the online kernel's output
    out = tvm.runtime.tensor(before)
    segments = np.array([[0, 0, 1], [1, 1, 3], [2, 4, 1]], np.int64)
    seg(rotated, *(tvm.runtime.tensor(np.concatenate([c[i] for c in caches])) for i in (0, 1)),
        tvm.runtime.tensor(segments), tvm.runtime.tensor(positions), out)
    got = out.numpy()[0]
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[4], want[4])
    np.testing.assert_array_equal(got[1:4], before[0, 1:4])


def test_attention_rejects_a_cache_capacity_off_the_tile():
    import tvm

    from qwc.compiler.kernels import prefill_attention

    f = _host_kernel(prefill_attention.attention(2, 1, 16, 0.25))
    args = [np.zeros((1, 1, 32), np.float32), np.zeros((1, 1, 20, 16), np.float32),
            np.zeros((1, 1, 20, 16), np.float32), np.array([0], np.int32), np.zeros((1, 1, 32), np.float32)]
    with pytest.raises(Exception, match="multiple of 16"):
        f(*(tvm.runtime.tensor(a) for a in args))


@pytest.mark.parametrize("k", [100, 896])
@pytest.mark.parametrize("mode", ["plain", "silu", "rms"])
@pytest.mark.parametrize("m", [1, 17])
def test_activation_quantizer_against_q8_0(k, mode, m):
    """The W4A8 activation quantizer (vector blocks, a scalar partial block at K = 100), alone,
    computing silu(gate) * up first, and computing RMSNorm(x) * gamma first, one row (decode,
    serial) and 17 (parallel), against numpy's Q8_0 of the same input."""
    import tvm

    from qwc.compiler.kernels import act_quant

    nb, eps = (k + 31) // 32, 1e-6
    rng = np.random.default_rng(k)
    g, u = rng.standard_normal((m, k), dtype=np.float32) * 3, rng.standard_normal((m, k), dtype=np.float32)
    gamma = rng.random(k, dtype=np.float32) + 0.5
    if mode == "silu":
        x, ins = (g / (1 + np.exp(-g.astype(np.float64))) * u).astype(np.float32), (g, u)
    elif mode == "rms":
        x, ins = (g / np.sqrt((g.astype(np.float64) ** 2).mean(-1, keepdims=True) + eps) * gamma).astype(np.float32), (g, gamma)
    else:
        x, ins = g, (g,)
    outs = [np.zeros((m, nb, 32), np.int8), np.zeros((m, nb), np.float32), np.zeros((m, nb), np.int32)]
    outs = [tvm.runtime.tensor(o) for o in outs]
    f = _host_kernel(act_quant.fused_quantizer(k, -8, m == 1, mode == "silu", eps if mode == "rms" else None))
    f(*(tvm.runtime.tensor(a) for a in ins), *outs)
    aq, ad, off = (o.numpy() for o in outs)
    q, _ = quantize_q8_0(x)
    q = np.concatenate([q[..., 0::2], q[..., 1::2]], axis=-1)   # the kernel's de-interleaved order
    amax = np.abs(np.pad(x, ((0, 0), (0, nb * 32 - k)))).reshape(m, nb, 32).max(-1)
    np.testing.assert_allclose(ad, amax / 127, rtol=1e-5 if mode == "rms" else 1e-6)
    diff = np.abs(aq.astype(np.int32) - q)
    assert diff.max() <= 1 and (diff > 0).mean() < 1e-3   # a rounding tie may differ by one step
    assert off.dtype == np.int32
    np.testing.assert_array_equal(off, -8 * aq.astype(np.int32).sum(-1))


@pytest.mark.parametrize("k", [100, 300, 896])
def test_x86_quantizer_row_groups_and_silu_stages_keep_the_row_bits(k, monkeypatch):
    """The many-row x86 quantizers' two schedules: RMSNorm runs ROW_GROUP rows a task, their
    sums of squares side by side, and must give each row the bits of the one-row kernel (a
    lone serial sum), at every row count to 9 and a ragged 17; silu(gate) * up computes
    SILU_STAGE blocks' inputs before quantizing them, and must give the bits of a block at a
    time (a stage longer than the row). K = 100, 300: a partial last block; 300: a stage and
    a leftover whole block."""
    import tvm

    from qwc.compiler.kernels import act_quant

    nb, eps, m = (k + 31) // 32, 1e-6, 17
    rng = np.random.default_rng(k)
    x, u = rng.standard_normal((m, k), dtype=np.float32) * 3, rng.standard_normal((m, k), dtype=np.float32)
    gamma = rng.random(k, dtype=np.float32) + 0.5

    def run(kernel, *ins):
        rows = ins[0].shape[0]
        outs = [tvm.runtime.tensor(np.zeros(shape, dt)) for shape, dt in
                (((rows, nb, 32), np.int8), ((rows, nb), np.float32), ((rows, nb), np.int32))]
        _host_kernel(kernel)(*(tvm.runtime.tensor(np.ascontiguousarray(a)) for a in ins), *outs)
        return [o.numpy() for o in outs]

    one = act_quant.fused_quantizer.__wrapped__(k, -8, True, rms_eps=eps)
    alone = [run(one, x[i:i + 1], gamma) for i in range(m)]
    grouped = act_quant.fused_quantizer.__wrapped__(k, -8, False, rms_eps=eps)
    for rows in list(range(1, 10)) + [m]:
        for got, want in zip(run(grouped, x[:rows], gamma), zip(*alone[:rows])):
            np.testing.assert_array_equal(got, np.concatenate(want))
    staged = run(act_quant.fused_quantizer.__wrapped__(k, -8, False, True), x, u)
    monkeypatch.setattr(act_quant, "SILU_STAGE", 10 ** 6)
    for got, want in zip(staged, run(act_quant.fused_quantizer.__wrapped__(k, -8, False, True), x, u)):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("k", [100, 896, 3584])
def test_arm_rms_quantizer_over_tasks_keeps_the_serial_bits(k):
    """The ARM decode RMSNorm quantizer runs one row as RMS_TASKS parallel tasks, each taking
    the row's sum of squares itself: its output must be the bits of the same kernel over rows
    (a row a task, the sum once), and Q8_0 of numpy's RMSNorm. With parts (a decode GEMV's
    blocks split in two) it takes their sum first, writes it, and quantizes it to the same
    bits. K = 100: a partial last block."""
    import tvm

    from qwc.compiler.kernels import act_quant

    nb, eps = (k + 31) // 32, 1e-6
    rng = np.random.default_rng(k)
    parts = rng.standard_normal((2, k), dtype=np.float32) * 3
    x = parts[:1] + parts[1:]
    gamma = rng.random(k, dtype=np.float32) + 0.5

    def run(one_row, a, n=1):
        outs = [tvm.runtime.tensor(np.zeros(shape, dt)) for shape, dt in
                (((1, nb, 32), np.int8), ((1, nb), np.float32), ((1, nb), np.int32), ((1, k), np.float32))]
        kernel = act_quant.fused_quantizer(k, -8, one_row, rms_eps=eps, layout="arm", parts=n)
        _host_kernel(kernel)(tvm.runtime.tensor(a), tvm.runtime.tensor(gamma), *outs[:3 + (n > 1)])
        return [o.numpy() for o in outs]

    tasks, rows, summed = run(True, x), run(False, x), run(True, parts, 2)
    for a, b, c in zip(tasks[:3], rows[:3], summed[:3]):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)
    np.testing.assert_array_equal(summed[3], x)
    ref = (x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + eps) * gamma).astype(np.float32)
    q, _ = quantize_q8_0(ref)
    q = np.concatenate([q[..., 0::2], q[..., 1::2]], axis=-1)
    diff = np.abs(tasks[0].astype(np.int32) - q)
    assert diff.max() <= 1 and (diff > 0).mean() < 1e-2
    np.testing.assert_array_equal(tasks[2], -8 * tasks[0].astype(np.int32).sum(-1))
    with pytest.raises(ValueError, match="sums parts"):
        act_quant.fused_quantizer(k, -8, False, rms_eps=eps, layout="arm", parts=2)


def _x86_weights(k, n, seed, dot, q4_1: bool = False):
    """The arrays a decode GEMV of `dot` reads for one output (Q8_0 for "vnni8", else Q4_0, or
    Q4_1 with its block offsets) and the dequantized matrix."""
    if dot == "vnni8":
        u, d, deq = _weights8(k, n, seed)
        return row_groups.pack_int8(u, d, signed=False), deq
    if q4_1:
        wp, d, c, deq = _weights41(k, n, seed)
        return (*row_groups.pack(wp, d), row_groups.pack_offsets(c)), deq
    wp, d, deq = _weights(k, n, seed)
    return row_groups.pack(wp, d), deq


@pytest.mark.parametrize("prefetch", ["software", "hardware"])
@pytest.mark.parametrize("dot, q4_1", [*((d, False) for d in sorted(X86_DOTS)), ("vnni8", False), ("vnni", True)])
@pytest.mark.parametrize("silu_mul", [False, True])
def test_decode_gemv_outputs_biases_and_silu_mul(silu_mul, dot, q4_1, prefetch):
    """The x86 decode GEMV that runs several weights of the same activations in one launch
    (compiler/sibling_gemvs.py): ragged outputs with and without a bias (N = 136, 24, 40:
    the multi-stream path and leftover groups), and gate/up written as silu(gate) * up; Q4_0,
    Q8_0 and Q4_1 (block offsets) weights; with software prefetches, and without (an AMD
    Zen's form: targets.IntDots.decode_prefetch), whose code has none."""
    import tvm

    from qwc.compiler.kernels import act_quant
    from qwc.compiler.kernels.x86 import vnni

    _run_needs(dot)
    k, nb = 96, 3
    outputs = ((200, False, q4_1), (200, False, q4_1)) if silu_mul else ((136, True, q4_1), (24, False, q4_1),
                                                                         (40, True, q4_1))
    rng = np.random.default_rng(7)
    a = rng.standard_normal((1, k), dtype=np.float32)
    parts = [tvm.runtime.tensor(np.zeros(s, dt)) for s, dt in (((1, nb, 32), np.int8), ((1, nb), np.float32),
                                                                ((1, nb), np.int32))]
    _host_kernel(act_quant.fused_quantizer(k, w4a8.ZERO_POINT, True))(tvm.runtime.tensor(a), *parts)
    aq, ad = parts[0].numpy(), parts[1].numpy()
    inter = np.empty_like(aq)
    inter[..., 0::2], inter[..., 1::2] = aq[..., :16], aq[..., 16:]   # back to element order
    a8 = (inter.astype(np.float32) * ad[..., None]).reshape(1, k)
    args, refs = list(parts), []
    for i, (n, has_bias, _) in enumerate(outputs):
        packed, deq = _x86_weights(k, n, 100 + i, dot, q4_1)
        args += [tvm.runtime.tensor(x) for x in packed]
        refs.append(a8 @ deq.T)
        if has_bias:
            bias = rng.standard_normal(n, dtype=np.float32)
            args.append(tvm.runtime.tensor(bias))
            refs[-1] = refs[-1] + bias
    if silu_mul:
        g, u = refs
        refs = [g / (1 + np.exp(-g)) * u]
    outs = [tvm.runtime.tensor(np.zeros(r.shape, np.float32)) for r in refs]
    kernel = vnni.decode_gemv(outputs, nb, "float16", silu_mul, dot=dot, prefetch=prefetch)
    assert ("llvm.prefetch" in kernel.script()) == (prefetch == "software")
    _host_kernel(kernel)(*args, *outs)
    for o, r in zip(outs, refs):
        np.testing.assert_allclose(o.numpy(), r, rtol=0, atol=1e-5 * np.abs(r).max())


@pytest.mark.parametrize("prefetch", ["software", "hardware"])
@pytest.mark.parametrize("dot, q4_1", [*((d, False) for d in sorted(X86_DOTS)), ("vnni8", False), ("vnni", True)])
@pytest.mark.parametrize("n", [224, 4864])
def test_decode_gemv_quantizing_its_silu_mul_output_equals_the_quantizer(n, dot, q4_1, prefetch):
    """The gate/up decode GEMV that writes the down projection's Q8_0 input itself (`quantize`:
    adjacent row groups, a block a task, read in lockstep or, prefetch "hardware", one after
    the other) gives the very bits of the silu_mul GEMV followed by the quantizer kernel (N =
    224: an odd number of 32-blocks)."""
    import tvm

    from qwc.compiler.kernels import act_quant
    from qwc.compiler.kernels.x86 import vnni

    _run_needs(dot)
    k, nb, nq = 96, 3, n // 32
    rng = np.random.default_rng(11)

    def q8(blocks):   # empty (aq, ad, off) of `blocks` blocks
        return [tvm.runtime.tensor(np.zeros(s, dt)) for s, dt in (
            ((1, blocks, 32), np.int8), ((1, blocks), np.float32), ((1, blocks), np.int32))]

    act = q8(nb)
    _host_kernel(act_quant.fused_quantizer(k, w4a8.ZERO_POINT, True))(
        tvm.runtime.tensor(rng.standard_normal((1, k), dtype=np.float32)), *act)
    weights = [tvm.runtime.tensor(x) for i in range(2) for x in _x86_weights(k, n, 200 + i, dot, q4_1)[0]]
    outputs = ((n, False, q4_1), (n, False, q4_1))
    hidden = tvm.runtime.tensor(np.zeros((1, n), np.float32))
    _host_kernel(vnni.decode_gemv(outputs, nb, "float16", True, dot=dot))(*act, *weights, hidden)
    ref = q8(nq)
    _host_kernel(act_quant.fused_quantizer(n, w4a8.ZERO_POINT, True))(hidden, *ref)
    got = q8(nq)
    _host_kernel(vnni.decode_gemv(outputs, nb, "float16", True, quantize=w4a8.ZERO_POINT, dot=dot,
                                  prefetch=prefetch))(*act, *weights, *got)
    assert np.abs(ref[1].numpy()).min() > 0   # every block quantized, none left at zero
    for g, r in zip(got, ref):
        np.testing.assert_array_equal(g.numpy(), r.numpy())


def test_quantizing_decode_gemv_refuses_streams_that_split_a_block(monkeypatch):
    """The quantizing gate/up GEMV gives each task one 32-row block as STREAMS / 2 row groups:
    another STREAMS would overlap the tasks' groups (patched, it gave wrong logits), so the
    kernel builder refuses it."""
    from qwc.compiler.kernels.x86 import vnni

    monkeypatch.setattr(vnni, "STREAMS", 6)
    with pytest.raises(ValueError, match="STREAMS"):
        vnni.decode_gemv.__wrapped__(((64, False), (64, False)), 2, "float16", silu_mul=True, quantize=w4a8.ZERO_POINT)


def test_a_kernel_the_generic_schedule_cannot_read_is_named_not_skipped(capsys):
    """compiler/schedule.py: a kernel that is neither scheduled by its writer nor readable by the
    generic rule would run serial scalar loops; the build says which, and hand-scheduled kernels
    (the attribute kernels.SCHEDULED) are left alone without a word."""
    import tvm
    from tvm.script import tirx as T

    from qwc.compiler import schedule
    from qwc.compiler.kernels import hand_scheduled

    @T.prim_func(private=True)
    def loops(a: T.Buffer((64,), "float32"), b: T.Buffer((64,), "float32")):
        for i in range(64):   # no block: nothing the generic rule can read
            b[i] = a[i] * T.float32(2)

    mod = tvm.IRModule({"scale_twice": loops, "mine": hand_scheduled(loops)})
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(schedule.STRICT_ENV)        # a user's build: a warning
        schedule.generic_cpu_schedule(mod)
    err = capsys.readouterr().err
    assert "kernel scale_twice left unscheduled" in err and "mine" not in err
    # the test suite's builds: an error naming it (TVM's pass machinery hands it on as its own)
    with pytest.raises((QwcError, RuntimeError), match="kernel scale_twice left unscheduled"):
        schedule.generic_cpu_schedule(tvm.IRModule({"scale_twice": loops}))
