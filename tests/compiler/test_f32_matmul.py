"""The float linears (`qwc optimize --keep-float`): kernels/f32_matmul.py against numpy, the
compile-time column blocks (compiler/repack.py: float_column_blocks), and a float artifact
against onnxruntime, its verify calls giving decode's logits to the bit."""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from qwc.compiler.kernels import f32_matmul
from qwc.compiler.repack import float_column_blocks
from qwc.compiler.targets import get_target
from qwc.passes.graph import COLUMN_BLOCKS_OP

# register files (count, bytes): AVX-512, AVX2, NEON
REGISTERS = [(32, 64), (16, 32), (32, 16)]


def _run_kernel(k, n, m, registers, one_token=False, a=None, w=None):
    import tvm

    cols = f32_matmul.columns(n, registers)
    f = f32_matmul.kernel(k, n, cols, one_token, registers).with_attr("global_symbol", "main")
    lib = tvm.compile(tvm.IRModule({"main": f}), target=get_target("host").tvm_target())
    rng = np.random.default_rng(k + n + m)
    a = rng.standard_normal((m, k)).astype(np.float32) if a is None else a
    w = rng.standard_normal((k, n)).astype(np.float32) if w is None else w
    y = tvm.runtime.tensor(np.full((m, n), np.nan, np.float32))
    lib["main"](tvm.runtime.tensor(a), tvm.runtime.tensor(f32_matmul.pack(w, cols)), y)
    return a, w, y.numpy()


@pytest.mark.parametrize("registers", REGISTERS)
@pytest.mark.parametrize("k, n", [(64, 16), (96, 48), (100, 192), (576, 576)])
def test_the_float_kernel_takes_every_row_count(k, n, registers):
    """Every M from 1 to 17 (full tiles, then the leftover tiles of 4, 2 and 1 rows) and the
    decode form: every row written, each the numpy product to float32 rounding."""
    for m, one_token in [*((m, False) for m in range(1, 18)), (1, True)]:
        a, w, y = _run_kernel(k, n, m, registers, one_token)
        ref = a.astype(np.float64) @ w.astype(np.float64)
        np.testing.assert_allclose(y, ref, rtol=0, atol=2e-6 * k ** 0.5 * np.abs(ref).max())


def test_a_row_is_the_same_bits_in_any_tile():
    """A row's sums do not depend on how many rows share its tile: a verify call's logits are
    decode's to the bit (runtime/engine.py: verify)."""
    k, n = 96, 64
    rng = np.random.default_rng(0)
    a, w = rng.standard_normal((9, k)).astype(np.float32), rng.standard_normal((k, n)).astype(np.float32)
    alone = np.concatenate([_run_kernel(k, n, 1, REGISTERS[0], True, a[i:i + 1], w)[2] for i in range(9)])
    for m in (2, 5, 8, 9):
        np.testing.assert_array_equal(_run_kernel(k, n, m, REGISTERS[0], a=a[:m], w=w)[2], alone[:m])


def test_tile_sizes():
    """Four vectors of columns, narrower where N has few blocks; rows keep the sums in half the
    register file and under TVM's stack limit."""
    assert f32_matmul.columns(1536, (32, 64)) == 64
    assert f32_matmul.columns(576, (32, 64)) == 32      # 9 blocks of 64: too few to share
    assert f32_matmul.columns(192, (32, 64)) == 16
    assert f32_matmul.columns(100, (32, 64)) is None    # no multiple of 16 floats
    assert f32_matmul.columns(100, (32, 16)) == 4
    assert f32_matmul.tile_rows(64, (32, 64), False) == 3   # 4 x 64 floats would be 1024 bytes
    assert f32_matmul.tile_rows(32, (32, 64), False) == 7
    assert f32_matmul.tile_rows(16, (32, 16), False) == 4   # NEON: 16 sums of 4 lanes
    assert f32_matmul.tile_rows(64, (32, 64), True) == 1


def _graph(shared: bool):
    k, n = 32, 48
    w = np.arange(k * n, dtype=np.float32).reshape(k, n)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")]
    outs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n])]
    if shared:   # something else reads the weight too
        nodes.append(helper.make_node("Identity", ["w"], ["w_out"]))
        outs.append(helper.make_tensor_value_info("w_out", TensorProto.FLOAT, [k, n]))
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k])], outs,
                          [numpy_helper.from_array(w, "w")])
    return helper.make_model(g), w


@pytest.mark.parametrize("shared", [False, True])
def test_column_blocks_rewrite_float_matmuls(shared):
    model, w = _graph(shared)
    features = get_target("x86-avx512").features
    assert float_column_blocks(model, features) == 1
    node = model.graph.node[0]
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    assert node.op_type == COLUMN_BLOCKS_OP
    np.testing.assert_array_equal(inits[node.input[1]], f32_matmul.pack(w, 16))
    if shared:   # the other reader keeps the plain weight
        assert node.input[1] != "w" and np.array_equal(inits["w"], w)
    else:
        assert set(inits) == {"w"}


def test_a_float_artifact_follows_onnxruntime_and_verifies_at_decodes_bits(tiny_float, tiny_lm, tmp_path):
    """`--keep-float '*'`: every linear in float through the column-block kernel; greedy
    generation takes onnxruntime's tokens with every step's logits within 1e-4 of their range;
    verify() of 5 tokens gives 5 decode steps' logits bit for bit, and so does a batched step
    of two sequences (their tokens are the GEMM's rows)."""
    from run_engine import decode_and_verify

    from qwc.compiler.compile import compile_file
    from qwc.runtime.engine import Engine

    from conftest import greedy_against_onnxruntime

    cfg = tiny_lm.config
    floats = sum(n.op_type == "MatMul" for n in onnx.load(str(tiny_float), load_external_data=False).graph.node)
    assert floats == 7 * cfg.num_hidden_layers
    art = tmp_path / "float.qwc"
    compile_file(tiny_float, "host", art, act_bits=32, kv_type="f32", max_batch=2)
    quant = json.loads((art / "manifest.json").read_text())["quantization"]
    assert quant["weight_layout"]["column_blocks"] == floats
    prompt = np.random.default_rng(3).integers(0, 259, (1, 9))
    greedy_against_onnxruntime(art, tiny_float, cfg, prompt, 8, 64, tol=1e-4)

    eng = Engine(art, ctx=64, threads=2)
    new = [5, 17, 42, 3, 99]
    steps, verified = decode_and_verify(eng, prompt[0], new)
    np.testing.assert_array_equal(verified, steps)

    assert eng._decode_batch is not None   # the batched step, not decode after decode
    pool = eng.pool(2)
    rows = list(pool.seqs)
    for r, p in zip(rows, (prompt[0], prompt[0][:5])):
        eng.prefill(p, seq=r)
    alone = [eng.sequence(), eng.sequence()]
    for r, p in zip(alone, (prompt[0], prompt[0][:5])):
        eng.prefill(p, seq=r)
    for t in new:
        both = eng.decode_many([t, t + 1], rows)
        np.testing.assert_array_equal(both[0], eng.decode(t, seq=alone[0]))
        np.testing.assert_array_equal(both[1], eng.decode(t + 1, seq=alone[1]))
