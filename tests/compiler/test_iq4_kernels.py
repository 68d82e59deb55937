"""A GGUF's IQ4_NL / IQ4_XS linears on the targets' own kernels for them: the file's 4-bit
indices in Q4_0's row groups (compiler/repack_iq4.py), looked up in llama.cpp's code book by one
byte shuffle (kernels/code_book.py: x86 VNNI's vpshufb, ARM's tbl under qemu), each against the
file's dequantized weights times the activations as the kernels quantize them (llama.cpp's Q8_0
blocks; Q8_K super-blocks for IQ4_XS on ARM, whose kernels read the file's 6-bit sub-block
scales: kernels/iq4_xs_scales.py), which the integer sums make exact up to float rounding."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper
from tvm import relax

from qwc import weight_formats
from qwc.compiler.frontend import MatMulNBits
from qwc.compiler.kernels import row_groups
from qwc.compiler.repack_iq4 import book_indices, iq4_indices
from qwc.compiler.targets import get_target, kernel_summary
from qwc.models import gguf_blocks
from qwc.passes.graph import tensor_array

from conftest import assert_arm_library_follows, q8_k, random_iq4

# K = 768: three super-blocks; N = 150: x86 decode's four streams and a ragged last row group
CASES = [(512, 40), (768, 150)]
FORMATS = ("IQ4_NL", "IQ4_XS")


def _weights(fmt: str, n: int, k: int, seed: int):
    raw = random_iq4(np.random.default_rng(seed), n, k, fmt)
    if fmt == "IQ4_XS":   # as llama.cpp writes them: the first sub-block's ls - 32 is -32 (file_factors)
        sb = raw.reshape(n, -1, 136)
        sb[..., 4] &= 0xF0
        sb[..., 2] &= 0xFC
    return raw, gguf_blocks.from_gguf(raw, fmt, (n, k), "w")


def file_factors(raw: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """An IQ4_XS file's d [N, K/256] float32 and 6-bit ls [N, K/32], read from its bytes. Its
    largest |scale| is the -32 one (_weights), so the file's pair is the one factoring gives."""
    sb = raw.reshape(n, -1, 136)
    d = sb[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    high = (sb[..., 2:4].copy().view(np.uint16)[..., 0, None] >> (2 * np.arange(8, dtype=np.uint16))) & 3
    low = np.stack([sb[..., 4:8] & 15, sb[..., 4:8] >> 4], axis=-1).reshape(n, -1, 8)
    return d, (low | (high << 4)).astype(np.uint8).reshape(n, -1)


def unpack_runs(ws: np.ndarray) -> np.ndarray:
    """ARM's IQ4_XS ls runs ws [G, NB/4, 48] -> [G, NB, 16] (kernels/iq4_xs_scales.py), read
    apart from the kernels."""
    a, b, c = (ws[..., i * 16:(i + 1) * 16] for i in range(3))
    fourth = (a >> 6) | ((b >> 6) << 2) | ((c >> 6) << 4)
    return np.stack([a & 63, c & 63, b & 63, fourth], axis=2).reshape(ws.shape[0], -1, 16)


def _q8_reference(a: np.ndarray, w: np.ndarray) -> np.ndarray:
    """a [M, K] quantized to int8 blocks of 32 as the kernels' quantizer does, times w [N, K]."""
    blocks = a.reshape(a.shape[0], -1, 32)
    d = (np.abs(blocks).max(-1, keepdims=True) / np.float32(127)).astype(np.float32)
    return (np.rint(blocks / d).astype(np.float64) * d).reshape(a.shape) @ w.astype(np.float64).T


def _node(b: gguf_blocks.Blocks, n: int, k: int) -> onnx.ModelProto:
    """The exported node (8-bit codes book[q] + 128, marked with its format) in a model."""
    inits = [onnx.numpy_helper.from_array(b.codes, "w"), onnx.numpy_helper.from_array(b.scales, "s")]
    node = helper.make_node("MatMulNBits", ["x", "w", "s"], ["y"], domain="com.microsoft", K=k, N=n, bits=8,
                            block_size=32)
    weight_formats.mark(node, b.fmt)
    return helper.make_model(helper.make_graph([node], "g", [], [], inits))


def _emit(bb, name: str, b: gguf_blocks.Blocks, k: int, n: int, m: int, target: str):
    """Function `name`(a, w, s) through `target`'s IQ4 kernels, the weights laid out as compile
    time lays them out; returns those weights."""
    t = get_target(target)
    model = _node(b, n, k)
    assert iq4_indices(model, 8, t.features) == 1
    inits = {x.name: tensor_array(x) for x in model.graph.initializer}
    weights = [inits[x] for x in model.graph.node[0].input[1:4] if x]
    assert weights[0].shape[2] == row_groups.CHUNKS   # 4 bits a weight
    av = relax.Var("a", relax.TensorType([m, k], "float32"))
    vs = [relax.Var(f"v{i}", relax.TensorType(list(x.shape), str(x.dtype))) for i, x in enumerate(weights)]
    isa = "arm" if t.arch == "aarch64" else "x86"
    with bb.function(name, [av, *vs]):
        with bb.dataflow():
            y = MatMulNBits.q4_0_matmul(bb, av, vs[0], vs[1], k, n, isa, t.features, book=True,
                                        offsets=vs[2] if len(vs) > 2 else None)
            gv = bb.emit_output(y)
        bb.emit_func_output(gv)
    return weights


def test_indices_are_the_files():
    """The rewrite's indices are the file's nibbles (reordered into row groups), its scales the
    file's: IQ4_NL's d as fp16; IQ4_XS's d and 6-bit ls on ARM, its d (ls - 32) as float32 on
    x86; codes not of the book stay."""
    def scales(model):
        inits = {x.name: tensor_array(x) for x in model.graph.initializer}
        return [inits[x] for x in model.graph.node[0].input[2:4] if x]

    for fmt in FORMATS:
        raw, b = _weights(fmt, 40, 512, 1)
        q = book_indices(b.codes, weight_formats.IQ4_BOOK)
        assert q is not None and q.max() < 16
        assert np.array_equal(np.array(weight_formats.IQ4_BOOK)[q] + 128, b.codes)
        for target in ("arm-yitian", "x86-avx512"):
            model = _node(b, 40, 512)
            assert iq4_indices(model, 8, get_target(target).features) == 1
            got = scales(model)
            if fmt == "IQ4_XS" and target == "arm-yitian":
                d, ls = file_factors(raw, 40)
                assert [x.dtype for x in got] == [np.uint8, np.float16]
                assert np.array_equal(unpack_runs(got[0]).transpose(0, 2, 1).reshape(-1, 16)[:40], ls)
                assert np.array_equal(got[1].astype(np.float32).transpose(0, 2, 1).reshape(-1, 2)[:40], d)
                # the file's bytes: 8 a super-block (d, 8 ls of six bits), 2 super-blocks, 48 rows (3 groups)
                assert got[0].nbytes + got[1].nbytes == 8 * 2 * 48
                continue
            assert len(got) == 1 and got[0].dtype == (np.float16 if fmt == "IQ4_NL" else np.float32)
            assert np.array_equal(got[0].astype(np.float32).transpose(0, 2, 1).reshape(-1, 16)[:40],
                                  b.scales.astype(np.float32))
    b.codes[0, 0, 0] = 130   # book + 128 holds no 130
    assert book_indices(b.codes, weight_formats.IQ4_BOOK) is None
    assert iq4_indices(_node(b, 40, 512), 8, get_target("arm-yitian").features) == 0


def test_targets_name_their_iq4_kernels():
    assert kernel_summary(get_target("x86-avx512"))["iq4"] == "w4a8-vnni_iq4/vnni_iq4"
    assert kernel_summary(get_target("arm-yitian"))["iq4"] == "w4a8-sdot_iq4/smmla_iq4"
    assert kernel_summary(get_target("arm-neon"))["iq4"] == "w4a8-sdot_iq4/sdot_iq4"
    assert kernel_summary(get_target("x86-avx2"))["iq4"] == "as q8_0"   # (vpmaddubsw pairs would overflow)


def test_qwc_targets_shows_the_iq4_kernels(capsys):
    from qwc.cli import main

    main(["targets"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[-1] == "iq4"
    row = next(x for x in lines if x.startswith("arm-yitian"))
    assert "w4a8-sdot_iq4/smmla_iq4" in row.split()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", [1, 3, 9])
@pytest.mark.parametrize("k, n", CASES)
def test_x86_kernels_look_up_the_book(fmt, m, k, n):
    """Decode (one token), the few-token streams and a prefill tile with leftovers."""
    import tvm

    from qwc import cpu
    from qwc.compiler.build import build

    if not cpu.has("avx512_vnni"):
        pytest.skip("runs avx512_vnni code; this CPU has none")
    raw, b = _weights(fmt, n, k, k + n + m)
    a = np.random.default_rng(m).standard_normal((m, k)).astype(np.float32)
    bb = relax.BlockBuilder()
    weights = _emit(bb, "main", b, k, n, m, "x86-avx512")
    vm = relax.VirtualMachine(build(bb.get(), get_target("x86-avx512")), tvm.cpu())
    got = vm["main"](*(tvm.runtime.tensor(x) for x in [a, *weights])).numpy()
    ref = _q8_reference(a, gguf_blocks.dequantize(b))
    assert np.abs(got - ref).max() < 1e-5 * np.abs(ref).max(), np.abs(got - ref).max() / np.abs(ref).max()


@pytest.mark.arm
@pytest.mark.slow
def test_arm_kernels_look_up_the_book(tmp_path):
    """arm-yitian (smmla_iq4 prefill, sdot_iq4 decode) and arm-neon (sdot_iq4) under qemu-aarch64,
    at 1, 3, 9, 13 (whole tiles and a lone pair), 17 and 27 tokens (two whole tiles: IQ4_NL's
    indices looked up once a task): within float32 rounding of the
    file's weights times the quantized activations (IQ4_XS: on Q8_K super-blocks, the file's
    6-bit scales), the same bits at 1, 3, 8 and 64 threads."""
    inputs, refs = {}, {}
    for target in ("arm-yitian", "arm-neon"):
        bb, prefix = relax.BlockBuilder(), target.replace("-", "_")
        for fmt in FORMATS:
            for k, n in CASES:
                for m in (1, 3, 9, 13, 17, 27):
                    raw, b = _weights(fmt, n, k, k + n + m)
                    a = np.random.default_rng(m).standard_normal((m, k)).astype(np.float32)
                    name = f"{prefix}_{fmt}_{k}_{n}_{m}"
                    for i, x in enumerate([a, *_emit(bb, name, b, k, n, m, target)]):
                        inputs[f"{name}/{i}"] = x
                    w = gguf_blocks.dequantize(b)
                    refs[name] = q8_k(a) @ w.astype(np.float64).T if fmt == "IQ4_XS" else _q8_reference(a, w)
        assert_arm_library_follows(bb, target, inputs, refs, prefix, tmp_path)
