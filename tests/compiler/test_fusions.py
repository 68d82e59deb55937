"""The import-time fusion passes (compiler/fuse_*.py): each fires on the tiny graph where its
target's kernels allow it, on its own and in the pipeline's order, and leaves nothing of what it
replaced once dead code is gone. That the fused artifacts compute the same logits as
onnxruntime is test_compile's and test_arm's job."""

from __future__ import annotations

import re

import onnx
import pytest
import tvm
from tvm import relax

from qwc.compiler.frontend import ImportContext, import_graph
from qwc.compiler.pipeline import fusions
from qwc.compiler.repack import repack_weights
from qwc.compiler.targets import get_target

VNNI = frozenset({"avx512_vnni", "avx512bw", "avx512f"})   # the x86 rule, whatever this CPU has


@pytest.fixture(scope="module")
def graph(tiny_q4):
    def load(features):
        model = onnx.load(str(tiny_q4))
        repack_weights(model, 8, features)
        return model
    return load


def _kernels(mod) -> list[str]:
    """The kernels `main` calls once dead code is gone, in order."""
    mod = relax.transform.DeadCodeElimination(["main"])(mod)
    names = []

    def visit(e):
        if isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op) and e.op.name.startswith("relax.call_tir"):
            names.append(e.args[0].name_hint)

    relax.analysis.post_order_visit(mod["main"], visit)
    return names


def _has(names, pattern) -> int:
    return sum(1 for n in names if re.fullmatch(pattern, n))


def test_x86_decode_fuses_everything_it_can(graph):
    names = _kernels(import_graph(graph(VNNI), seq=1, prefix="decode", act_bits=8, features=VNNI))
    layers = 2
    # rotary, cache writes, attention and the o projection's quantizer: one kernel a layer
    assert _has(names, r"decode_attention_3pass_q8") == layers
    assert not _has(names, r"decode_(rotary\d*|k_cache_write_tiles|kv_cache_write|attention_online)")
    # gate, up, SiLU·mul and the down projection's quantizer: one GEMV a layer
    assert _has(names, r"decode_q4_gemv_vnni_silu_mul_q8_320x4") == layers
    assert not _has(names, r"decode_act_q8_(silu_)?320_.*")
    # the residual rides in the o and down projections' epilogue (q's own bias in q's)
    assert _has(names, r"decode_q4_gemv_vnni_128x10_float16_bias") == layers
    assert _has(names, r"decode_q4_gemv_vnni_128x4_float16_bias") == 2 * layers
    assert not _has(names, r"decode_q4_gemv_vnni_128x(4|10)_float16")
    # q, k, v and the MLP read RMSNorm through their quantizers; no plain quantizer is left
    assert _has(names, r"decode_act_q8_rms_128_1_sum8") >= 2 * layers
    assert not _has(names, r"decode_act_q8_\d+_.*")


def test_a_zens_decode_gemvs_keep_their_prefetch_through_the_fusions(graph):
    """On an AMD Zen (the hint "zen": targets.IntDots.decode_prefetch "hardware") every decode
    GEMV the fusions build (siblings, residual, gate/up with the quantizer) is built as the
    importer built its parts: without software prefetches. Elsewhere they keep them. Decode
    attention's scores pass prefetches its K lines 4 KiB ahead on the Zen
    (targets.Kernels.decode_key_prefetch), K_PREFETCH_LINES lines elsewhere."""
    import re

    from qwc.compiler.kernels import DECODE_PREFETCH, decode_attention
    from qwc.compiler.kernels.kv_cache import KEY_TILE

    for features, prefetch in ((VNNI | {"zen"}, "hardware"), (VNNI, "software")):
        mod = relax.transform.DeadCodeElimination(["main"])(
            import_graph(graph(features), seq=1, prefix="decode", act_bits=8, features=features))
        attention = [gv for gv in mod.functions if "attention_3pass" in gv.name_hint]
        assert len(attention) == 1 and attention[0].name_hint.endswith("_q8"), attention   # a float32 cache
        lines = 4096 // (KEY_TILE * 4) if prefetch == "hardware" else decode_attention.K_PREFETCH_LINES
        assert f"d + {lines}" in mod[attention[0]].script(), re.findall(r"d \+ \d+", mod[attention[0]].script())
        gemvs = [gv for gv in mod.functions if "_gemv_" in gv.name_hint and gv.name_hint in _kernels(mod)]
        assert any("silu_mul_q8" in gv.name_hint for gv in gemvs) and any("_bias" in gv.name_hint for gv in gemvs)
        for gv in gemvs:
            func = mod[gv]
            assert ("llvm.prefetch" in func.script()) == (prefetch == "software"), gv.name_hint
            if "silu_mul" not in gv.name_hint:   # (the last of the fusions: nothing reads its mark)
                assert str(func.attrs.get(DECODE_PREFETCH, "software")) == prefetch, gv.name_hint


@pytest.mark.parametrize("features, kernel", [(VNNI, r"verify_attention_3pass_queries"),
                                               (frozenset({"neon", "dotprod", "i8mm"}),
                                                r"verify_attention_3pass_queries_heads")])
def test_verify_attends_as_decode_does(graph, features, kernel):
    """The verify entry point (any number of tokens, every position's logits): rotary, cache
    writes and attention in decode_attention's queries form a layer (x86; ARM a task per query
    head), the online kernel gone; the o projection reads the quantizer kernel's blocks (a
    GEMM, not the decode GEMV the fused quantizer serves)."""
    names = _kernels(import_graph(graph(features), prefix="verify", act_bits=8, features=features, verify=True))
    assert _has(names, kernel) == 2
    assert not _has(names, r"verify_(rotary\d*|k_cache_write_tiles|kv_cache_write|attention_online)(_float16)?")


def test_a_batched_step_attends_as_decode_does(graph):
    """decode_batch (a token of each of B sequences): decode_attention's rows form a layer, the
    online kernel and the separate rotary and cache writes gone."""
    names = _kernels(import_graph(graph(VNNI), seq=1, prefix="decode_batch", act_bits=8, features=VNNI, batched=True))
    assert _has(names, r"decode_batch_attention_3pass_rows") == 2
    assert not _has(names, r"decode_batch_(rotary\d*|k_cache_write_tiles|kv_cache_write|attention_online)")


def test_without_the_passes_the_converters_emit_each_op_alone(graph):
    features = VNNI
    ctx = ImportContext("decode", 8, features)
    mod = import_graph(graph(features), seq=1, prefix="decode", act_bits=8, features=features, fuse=False)
    names = _kernels(mod)
    assert _has(names, r"decode_attention_online") == 2 and _has(names, r"decode_rotary\d*") == 4
    assert not _has(names, r".*(3pass|silu_mul_q8|rms|silu).*")
    # the passes on that module give the fused one (the rotary kernels' head counts, as the
    # import records them: the tiny model's head_dim is 32)
    def record(e):
        if (isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op) and e.op.name == "relax.call_tir"
                and "rotary" in e.args[0].name_hint):
            ctx.rotary_kernels[e.args[0].name_hint] = int(e.args[1].fields[0].ty.shape[2]) // 32

    relax.analysis.post_order_visit(mod["main"], record)
    fused = _kernels(fusions(ctx)(mod))
    assert _has(fused, r"decode_attention_3pass_q8") == 2 and _has(fused, r".*silu_mul_q8.*") == 2


@pytest.mark.parametrize("target", ["x86-avx512", "arm-yitian"])
def test_the_final_norm_behind_the_last_position_slice_is_the_heads_quantizer(graph, target):
    """compile's last-position slice in front of the head (passes/last_position.py) is the
    identity at one position: the final norm still goes into the head's quantizer, so no
    RMSNorm op and no plain quantizer is left (on ARM: fed by the split down projection)."""
    from qwc.passes.last_position import last_position_logits

    features = get_target(target).features
    mod = import_graph(last_position_logits(graph(features)), seq=1, prefix="decode", act_bits=8,
                       features=features)
    names = _kernels(mod)
    assert not _has(names, r"decode_act_q8_\d+_.*")
    assert _ops(mod).count("relax.nn.rms_norm") == 0
    if target == "arm-yitian":
        assert _has(names, r"decode_act_q8_rms_128_1_sum8_arm_parts4") == 2   # layer 1's norm and the final one


def _ops(mod) -> list[str]:
    mod = relax.transform.DeadCodeElimination(["main"])(mod)
    ops = []
    relax.analysis.post_order_visit(mod["main"], lambda e: ops.append(e.op.name) if isinstance(e, relax.Call)
                                    and isinstance(e.op, tvm.ir.Op) else None)
    return ops


def _adds(mod) -> int:
    return _ops(mod).count("relax.add")


@pytest.mark.slow
@pytest.mark.parametrize("target", ["arm-yitian", "arm-neon"])
def test_arm_fuses_norm_and_silu_into_quantizers_and_adds_into_decode_gemvs(graph, target):
    features = get_target(target).features
    for seq, prefix in ((1, "decode"), (None, "prefill")):
        mod = import_graph(graph(features), seq=seq, prefix=prefix, act_bits=8, features=features)
        names = _kernels(mod)
        assert _has(names, rf"{prefix}_act_q8_rms_128_{int(seq == 1)}_sum8_arm(_pairs)?") >= 2
        assert _has(names, rf"{prefix}_act_q8_silu_320_{int(seq == 1)}_sum8_arm(_pairs)?") == 2
        assert not _has(names, r".*vnni.*")
        if seq is None:   # prefill: the online attention
            assert _has(names, r"prefill_attention_online") == 2 and not _has(names, r".*3pass.*")
            continue
        # decode: rotary, cache writes, attention and the o projection's quantizer (the sdot
        # GEMV's int32-offset layout) in one launch a layer, a task per query head
        assert _has(names, r"decode_attention_3pass_heads_q8_arm") == 2
        assert not _has(names, r"decode_(rotary\d*|k_cache_write_tiles|kv_cache_write|attention_online)")
        assert not _has(names, r"decode_act_q8_128_1_sum8_arm")
    # decode: q, k and v add their biases, o and down the residual, as they store (ARM's
    # decode GEMV epilogue); gate and up have none. No add kernel is left. o and down (8 row
    # groups each, for 128 threads) split their blocks in parts, which the next RMSNorm's
    # quantizer sums (compiler/split_residual_gemv.py): 2 of o's 4 blocks, 4 of down's 10.
    layers = 2
    mod = import_graph(graph(features), seq=1, prefix="decode", act_bits=8, features=features)
    names = _kernels(mod)
    assert _has(names, r"decode_q4_gemv_sdot_\d+x\d+_float16_bias") == 3 * layers
    assert _has(names, r"decode_q4_gemv_sdot_128x4_float16_bias_split2") == layers
    assert _has(names, r"decode_q4_gemv_sdot_128x10_float16_bias_split4") == layers
    assert _has(names, r"decode_act_q8_rms_128_1_sum8_arm_parts2") == layers
    assert _has(names, r"decode_act_q8_rms_128_1_sum8_arm_parts4") == layers
    assert _has(names, r"decode_q4_gemv_sdot_320x4_float16") == 2 * layers
    assert _adds(mod) == 0
