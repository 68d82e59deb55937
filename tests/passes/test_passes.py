"""Passes on the tiny model, exported by both torch exporters: every pass keeps onnxruntime's
outputs (fusions and folds within 1e-5 relative), and the quantized graph equals a torch model
whose weights went through the numpy Q4_0 reference."""

from __future__ import annotations

import copy
from collections import Counter

import numpy as np
import onnx
import pytest
import torch

from qwc.passes import canonicalize, fold_norm_scales, fuse_attention, fuse_rmsnorm, fuse_rotary, schemas
from qwc.passes.options import PassOptions
from qwc.passes.pipeline import CANONICAL_OPS, optimize
from qwc.passes.verify import compare, random_steps, run_steps, session
from qwc.q4 import dequantize_q8_0, fake_quantize_q4_0, quantize_q8_0

from conftest import torch_kv_logits

FUSIONS = [canonicalize, fuse_rmsnorm, fold_norm_scales, fuse_rotary, fuse_attention]


@pytest.fixture(params=["dynamo", "legacy"])
def exported(request, tiny_onnx, tiny_legacy_onnx):
    return tiny_onnx if request.param == "dynamo" else tiny_legacy_onnx


def _ops(m):
    return Counter(n.op_type for n in m.graph.node)


def test_each_fusion_and_fold_keeps_outputs(exported, tiny_lm):
    schemas.register()
    cfg = tiny_lm.config
    opts = PassOptions(config=cfg, fold_norm_gains=True)
    steps = random_steps(cfg, batch=2, prompt=8, decode=4)
    prev = onnx.load(str(exported))
    for p in FUSIONS:
        cur = p.run(copy.deepcopy(prev), opts)
        onnx.checker.check_model(cur)
        r = compare(prev, cur, cfg, steps)
        assert r.max_rel < 1e-5 and r.greedy_equal, (p.__name__, str(r))
        prev = cur
    ops = _ops(prev)
    assert ops["SimplifiedLayerNormalization"] == 1 and ops["SkipSimplifiedLayerNormalization"] == 4
    assert ops["RotaryEmbedding"] == 4 and ops["GroupQueryAttention"] == 2
    for gone in ("ReduceMean", "Pow", "Softmax", "Neg", "Concat", "Expand", "GatherND"):
        assert ops[gone] == 0, gone


def test_chunked_prefill_on_the_cache_buffer(exported, tiny_lm):
    """Batch 1: prompt, decode, then a 5-token chunk on top of the cache (onnxruntime's GQA
    supports chunks after a past only for batch 1)."""
    cfg = tiny_lm.config
    m = onnx.load(str(exported))
    fused = m
    for p in FUSIONS:
        fused = p.run(fused, PassOptions(config=cfg, fold_norm_gains=True))
    rng = np.random.default_rng(7)
    steps = [rng.integers(0, 259, (1, 6)), rng.integers(0, 259, (1, 1)), rng.integers(0, 259, (1, 5)),
             rng.integers(0, 259, (1, 1))]
    r = compare(onnx.load(str(exported)), fused, cfg, steps, ctx=32)
    assert r.max_rel < 1e-5


def test_fold_sets_gains_to_one_except_the_tied_lm_head(tiny_onnx, tiny_lm):
    cfg = tiny_lm.config
    m = onnx.load(str(tiny_onnx))
    for p in (canonicalize, fuse_rmsnorm, fold_norm_scales):
        m = p.run(m, PassOptions(config=cfg, fold_norm_gains=True))
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in m.graph.initializer}
    gains = [inits[n.input[1 if n.op_type == "SimplifiedLayerNormalization" else 2]] for n in m.graph.node
             if "SimplifiedLayerNormalization" in n.op_type]
    assert sum(np.all(g == 1) for g in gains) == 4          # all but the final norm
    untied = onnx.load(str(tiny_onnx))
    for p in (canonicalize, fuse_rmsnorm, fold_norm_scales):
        untied = p.run(untied, PassOptions(config=cfg, fold_norm_gains=True, untie_lm_head=True))
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in untied.graph.initializer}
    gains = [inits[n.input[1 if n.op_type == "SimplifiedLayerNormalization" else 2]] for n in untied.graph.node
             if "SimplifiedLayerNormalization" in n.op_type]
    assert all(np.all(g == 1) for g in gains)
    assert compare(m, untied, cfg).max_rel < 1e-5


def _fake_quant_reference(lm, block=32, embed_bits=4, fold=False):
    """transformers' model with the passes' transformations done in torch: norm gains folded
    into the linears (`fold`), every linear weight through the numpy Q4_0 round trip, the
    (tied) embedding through Q4_0 or Q8_0."""
    ref = copy.deepcopy(lm.model)
    with torch.no_grad():
        for layer in ref.model.layers:
            a, m = layer.self_attn, layer.mlp
            for norm, lins in ((layer.input_layernorm, (a.q_proj, a.k_proj, a.v_proj)),
                               (layer.post_attention_layernorm, (m.gate_proj, m.up_proj))):
                if not fold:
                    continue
                for lin in lins:
                    lin.weight.mul_(norm.weight)
                norm.weight.fill_(1.0)
            for lin in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj):
                lin.weight.copy_(torch.from_numpy(fake_quantize_q4_0(lin.weight.numpy(), block)))
        e = ref.model.embed_tokens.weight
        if embed_bits == 4:
            e.copy_(torch.from_numpy(fake_quantize_q4_0(e.numpy(), 32)))
        else:
            e.copy_(torch.from_numpy(dequantize_q8_0(*quantize_q8_0(e.numpy(), 32), e.shape[1])))
    return ref


@pytest.mark.parametrize("block,embed_bits,fold", [(32, 4, False), (128, 4, False), (32, 8, False), (32, 4, True)])
def test_quantized_graph_matches_numpy_q4_0_reference(exported, tiny_lm, block, embed_bits, fold):
    cfg = tiny_lm.config
    m = optimize(onnx.load(str(exported)), PassOptions(config=cfg, block_size=block, lm_head_bits=embed_bits,
                                                       fold_norm_gains=fold))
    steps = random_steps(cfg, batch=1, prompt=8, decode=8, seed=3)
    ref = torch_kv_logits(_fake_quant_reference(tiny_lm, block, embed_bits, fold), steps[0], steps[1:])
    got = run_steps(session(m), cfg, steps)
    for r, g in zip(ref, got):
        assert np.abs(r - g).max() < 1e-4
    # Greedy decoding from the prompt: the same tokens as the fake-quantized torch model.
    assert [int(x[0, -1].argmax()) for x in ref] == [int(x[0, -1].argmax()) for x in got]


def test_canonical_graph_holds_only_canonical_ops_and_one_copy_of_the_embedding(exported, tiny_lm):
    cfg = tiny_lm.config
    m = optimize(onnx.load(str(exported)), PassOptions(config=cfg))
    plain = {"Add", "Mul", "Sigmoid", "Cast", "Shape", "ReduceSum", "Sub", "Reshape", "Unsqueeze"}
    for n in m.graph.node:
        assert (n.domain, n.op_type) in CANONICAL_OPS or (n.domain == "" and n.op_type in plain), n.op_type
    ops = _ops(m)
    assert ops["MatMulNBits"] == 2 * 7 + 1 and ops["GatherBlockQuantized"] == 1
    gbq = next(n for n in m.graph.node if n.op_type == "GatherBlockQuantized")
    lm_head = [n for n in m.graph.node if n.op_type == "MatMulNBits" and n.input[1] == gbq.input[0]]
    assert len(lm_head) == 1                                  # tied: the same packed bytes
    v, h = cfg.vocab_size, cfg.hidden_size
    shapes = [list(t.dims) for t in m.graph.initializer]
    assert shapes.count([v, h // 32, 16]) == 1                # one packed copy
    assert [v, h] not in shapes and [h, v] not in shapes      # no float copy left
    onnx.checker.check_model(m)


def test_keep_float_leaves_matching_linears(tiny_onnx, tiny_lm):
    m = optimize(onnx.load(str(tiny_onnx)), PassOptions(config=tiny_lm.config, keep_float=["*.down_proj"]))
    ops = _ops(m)
    assert ops["MatMul"] == 2 and ops["MatMulNBits"] == 13


def test_prefill_takes_the_last_layers_query_o_projection_and_mlp_at_the_last_position_only(tiny_q4, tiny_lm):
    """prefill_nodes (the prefill entry point's graph): the last layer's o projection and its
    residual are sliced to the last position, so its MLP, the final norm and the head run on
    one row (as llama.cpp's graph), and onnxruntime gives the same last logits (1e-5
    relative) and the same cache as the graph that slices only before the head. The query is
    cut too: its projection reads a norm of the last row, its rotary the last position
    (onnxruntime's attention refuses fewer queries than keys: the compiled artifacts check
    that form, tests/runtime/test_batch.py). A graph that also outputs the MLP's result keeps
    the plain form."""
    from qwc.passes.last_position import last_position_logits, prefill_nodes

    schemas.register()
    base = last_position_logits(onnx.load(str(tiny_q4)))

    def sliced(nodes):
        readers = {x: n for n in nodes for x in n.input}
        return {n.output[0]: readers[n.output[0]] for n in nodes if n.op_type == "Slice"}

    cut_nodes = prefill_nodes(onnx.load(str(tiny_q4)))
    cut = sliced(cut_nodes)
    assert sorted(r.op_type for r in cut.values()) == ["RotaryEmbedding", "SimplifiedLayerNormalization",
                                                       "SkipSimplifiedLayerNormalization"]
    query = next(r for r in cut.values() if r.op_type == "SimplifiedLayerNormalization")
    assert any("q_proj" in n.name and query.output[0] in n.input for n in cut_nodes)
    nodes = prefill_nodes(onnx.load(str(tiny_q4)), query=False)
    assert nodes is not None
    assert sorted(r.op_type for r in sliced(nodes).values()) == ["MatMulNBits", "SkipSimplifiedLayerNormalization"]
    assert any("o_proj" in r.name for r in sliced(nodes).values())
    pre = copy.deepcopy(base)
    del pre.graph.node[:]
    pre.graph.node.extend(nodes)
    cfg = tiny_lm.config
    steps = random_steps(cfg, batch=1, prompt=7, decode=2)
    caps = [{}, {}]
    a = run_steps(session(base), cfg, steps, capture=caps[0])
    b = run_steps(session(pre), cfg, steps, capture=caps[1])
    for x, y in zip(a, b):
        np.testing.assert_allclose(y, x, rtol=0, atol=1e-5 * np.abs(x).max())
    for name in caps[0]:
        if name.startswith("present"):
            np.testing.assert_array_equal(caps[1][name], caps[0][name])

    other = onnx.load(str(tiny_q4))
    down = next(n for n in reversed(other.graph.node) if "down_proj" in n.name)
    other.graph.output.append(onnx.helper.make_tensor_value_info(down.output[0], onnx.TensorProto.FLOAT, None))
    assert prefill_nodes(other) is None
