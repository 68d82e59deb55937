"""Compile-time repacking (compiler/repack.py): which weights move to the row-group layout,
how a tied embedding keeps sharing them, and that a weight something else reads is copied."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from qwc.compiler.kernels import row_groups
from qwc.compiler.repack import repack_weights

X86 = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_vnni"})


def _inits(m):
    return {i.name: numpy_helper.to_array(i) for i in m.graph.initializer}


def test_tied_embedding_shares_the_repacked_weight(tiny_q4):
    m = onnx.load(str(tiny_q4))
    before = _inits(m)
    mms = [n for n in m.graph.node if n.op_type == "MatMulNBits"]
    gather = next(n for n in m.graph.node if n.op_type == "GatherBlockQuantized")
    head = next(n for n in mms if n.input[1] == gather.input[0])      # the tiny model is tied
    own_scales = gather.input[2]          # a constant-folded [V, nb, 1] copy of the head's scales
    assert own_scales in before and own_scales != head.input[2]
    assert repack_weights(m, 8, X86) == len(mms)
    after = _inits(m)
    assert set(before) - set(after) == {own_scales} and set(after) <= set(before)   # nothing duplicated
    w, s = after[head.input[1]], after[head.input[2]]
    ew, es = row_groups.pack(before[head.input[1]], before[head.input[2]])
    assert w.dtype == np.uint8 and w.ndim == 4 and np.array_equal(w, ew)
    assert s.dtype == np.float16 and np.array_equal(s, es)
    assert gather.input[0] == head.input[1] and gather.input[2] == head.input[2]


def test_float_activations_and_no_integer_dot_keep_the_plain_layout(tiny_q4):
    for act, feats in ((32, X86), (32, frozenset({"avx2", "fma"})), (8, frozenset({"sse4_2"}))):
        m = onnx.load(str(tiny_q4))
        assert repack_weights(m, act, feats) == 0
    # AVX2 without VNNI has W4A8 kernels of its own, on the same row groups as VNNI's
    avx2, vnni = onnx.load(str(tiny_q4)), onnx.load(str(tiny_q4))
    assert repack_weights(avx2, 8, frozenset({"avx2", "fma"})) == repack_weights(vnni, 8, X86) > 0
    assert _inits(avx2).keys() == _inits(vnni).keys()
    assert all(np.array_equal(a, _inits(vnni)[k]) for k, a in _inits(avx2).items())


def test_a_weight_read_elsewhere_gets_a_packed_copy():
    rng = np.random.default_rng(0)
    n, k = 20, 64
    wp = rng.integers(0, 256, (n, k // 32, 16), dtype=np.uint8)
    s = rng.standard_normal((n, k // 32)).astype(np.float16).astype(np.float32)
    mm = helper.make_node("MatMulNBits", ["x", "w", "s"], ["y"], domain="com.microsoft", K=k, N=n,
                          bits=4, block_size=32)
    other = helper.make_node("Identity", ["w"], ["w_copy"])
    g = helper.make_graph([mm, other], "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, k])],
                          [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, n]),
                           helper.make_tensor_value_info("w_copy", onnx.TensorProto.UINT8, None)],
                          [numpy_helper.from_array(wp, "w"), numpy_helper.from_array(s, "s")])
    m = helper.make_model(g)
    assert repack_weights(m, 8, frozenset({"dotprod"})) == 1
    got = _inits(m)
    assert np.array_equal(got["w"], wp)                              # the plain one stays for Identity
    assert list(m.graph.node[0].input[1:]) == ["w.qwc_packed", "s.qwc_packed"]
    assert got["w.qwc_packed"].shape == (2, 2, 4, 64)                # 20 rows -> 2 groups, padded
    assert np.array_equal(got["w.qwc_packed"], row_groups.pack(wp, s)[0])
