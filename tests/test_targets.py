"""compiler/targets.py's kernel table: what each target's ISA features select, and that the
importer, repacking and `qwc tune` read the same answer from it."""

from __future__ import annotations

import pytest

from qwc.compiler import targets
from qwc.compiler.targets import GEMM_LAYOUT, GEMM_TILES, default_act_bits, get_target, kernels_for, q4_0_path


@pytest.mark.parametrize("name, isa, decode, prefill, layouts, attention", [
    ("arm-yitian", "arm", "sdot", "smmla", ("arm", "arm_pairs"), "online"),
    ("arm-neon", "arm", "sdot", "sdot", ("arm", "arm"), "online"),
    ("x86-avx2", None, None, None, None, "three_pass"),
])
def test_each_target_selects_its_kernels(name, isa, decode, prefill, layouts, attention):
    k = kernels_for(get_target(name).features)
    assert k.decode_attention == attention
    if isa is None:
        assert k.w4a8 is None and default_act_bits(get_target(name).features) == 32
        assert q4_0_path(32, 4, 8, get_target(name).features) is None
        return
    assert (k.w4a8.isa, k.w4a8.decode, k.w4a8.prefill) == (isa, decode, prefill)
    assert (k.w4a8.decode_layout, k.w4a8.prefill_layout) == layouts
    assert default_act_bits(get_target(name).features) == 8
    assert q4_0_path(32, 4, 8, get_target(name).features) == isa
    assert q4_0_path(32, 4, 32, get_target(name).features) == "f32"
    assert q4_0_path(128, 4, 8, get_target(name).features) is None    # only Q4_0's block of 32


def test_vnni_needs_all_three_avx512_features():
    full = {"avx512_vnni", "avx512bw", "avx512f", "avx2"}
    assert kernels_for(full).w4a8.prefill == "vnni"
    assert kernels_for(full - {"avx512bw"}).w4a8 is None


def test_rules_end_with_a_catch_all_and_tiles_are_per_gemm():
    assert targets.KERNEL_RULES[-1][0] == frozenset()
    assert kernels_for(set()).w4a8 is None
    assert set(GEMM_TILES) == set(GEMM_LAYOUT) == {"vnni", "sdot", "smmla"}
    assert GEMM_LAYOUT["smmla"] == "arm_pairs" and all(t % 2 == 0 for t in GEMM_TILES["smmla"])


def test_tuning_tasks_take_the_tables_gemm(tiny_q4):
    """`qwc tune` extracts W4A8 tasks for the GEMM the table names for the target."""
    import onnx

    from qwc.compiler.tuning import extract_tasks

    model = onnx.load(str(tiny_q4))
    for name, impl in (("arm-yitian", "smmla"), ("arm-neon", "sdot")):
        tasks = extract_tasks(model, 8, get_target(name).features)
        assert tasks and {t.impl for t in tasks} == {impl}
