"""compiler/targets.py's kernel table: what each target's ISA features select, and that the
importer, repacking and `qwc tune` read the same answer from it."""

from __future__ import annotations

import pytest

from qwc.compiler import targets
from qwc.compiler.targets import GEMM_LAYOUT, GEMM_TILES, default_act_bits, get_target, kernels_for, q4_0_path


@pytest.mark.parametrize("name, isa, decode, prefill, layouts, attention, split, registers", [
    ("arm-yitian", "arm", "sdot", "smmla", ("arm", "arm_pairs"), "three_pass_heads", 512, (32, 16)),
    ("arm-neon", "arm", "sdot", "sdot", ("arm", "arm"), "three_pass_heads", 512, (32, 16)),
    ("x86-avx2", "x86", "avx2", "avx2", ("plain", "plain"), "three_pass", None, (16, 32)),
    ("x86-avx512", "x86", "vnni", "vnni", ("plain", "plain"), "three_pass", None, (32, 64)),
])
def test_each_target_selects_its_kernels(name, isa, decode, prefill, layouts, attention, split, registers):
    k = kernels_for(get_target(name).features)
    assert (k.decode_attention, k.decode_split_keys) == (attention, split)
    assert k.decode_threads == (128 if isa == "arm" else None)
    assert targets.vector_registers(get_target(name).features) == registers
    if isa is None:
        assert k.int_dots is None and default_act_bits(get_target(name).features) == 32
        assert q4_0_path(32, 4, 8, get_target(name).features) is None
        return
    assert (k.int_dots.isa, k.int_dots.decode, k.int_dots.prefill) == (isa, decode, prefill)
    assert (k.int_dots.decode_layout, k.int_dots.prefill_layout) == layouts
    assert default_act_bits(get_target(name).features) == 8
    assert q4_0_path(32, 4, 8, get_target(name).features) == isa
    assert q4_0_path(32, 4, 32, get_target(name).features) == "f32"
    assert q4_0_path(128, 4, 8, get_target(name).features) is None    # only Q4_0's block of 32


def test_vnni_needs_all_three_avx512_features():
    full = {"avx512_vnni", "avx512bw", "avx512f", "avx2", "fma"}
    assert kernels_for(full).int_dots.prefill == "vnni"
    assert kernels_for(full - {"avx512bw"}).int_dots.prefill == "avx2"   # the AVX2 form of the same dots
    assert kernels_for({"avx512_vnni", "avx512bw", "avx512f"}).int_dots.prefill == "vnni"
    assert kernels_for({"sse4_2"}).int_dots is None and default_act_bits({"sse4_2"}) == 32


def test_amx_needs_its_tile_features_and_runs_only_prefill():
    """AMX (kernels/x86/amx.py) takes the prefill GEMM's 16-token tiles where the CPU has its
    tiles and int8 multiply on top of AVX-512 VNNI; decode and the other forms stay VNNI's. The
    host asks LLVM for the AMX instructions by name (a VM may report a CPU model without them)."""
    vnni = {"avx512_vnni", "avx512bw", "avx512f", "avx2", "fma"}
    assert kernels_for(vnni | {"amx_tile", "amx_int8"}).int_dots.amx
    assert not kernels_for(vnni | {"amx_tile"}).int_dots.amx and not kernels_for(vnni).int_dots.amx
    assert not kernels_for({"amx_tile", "amx_int8", "avx2", "fma"}).int_dots.amx   # AMX without VNNI: AVX2's
    amx = kernels_for(get_target("x86-amx").features).int_dots
    assert (amx.amx, amx.decode, amx.prefill) == (True, "vnni", "vnni")
    assert {"+amx-tile", "+amx-int8"} <= set(get_target("x86-amx").mattr)
    assert targets.kernel_summary(get_target("x86-amx"))["prefill"] == "w4a8-vnni+amx"
    assert targets.kernel_summary(get_target("x86-avx512"))["prefill"] == "w4a8-vnni"


AMD_CPUINFO = ("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\n"
               "flags\t\t: fpu avx2 fma avx512f avx512bw avx512vl avx512_vnni\n\nprocessor\t: 1\n")


def test_an_amd_zen_leaves_decode_prefetch_to_the_hardware():
    """/proc/cpuinfo of an AMD Zen (family 0x17 on) gives the hint "zen"; with AVX-512 VNNI the
    rules then pick the VNNI kernels with decode_prefetch "hardware" and decode attention's K
    prefetched 4 KiB ahead, as the named x86-zen; an Intel CPU with the same flags, and a Zen
    with AVX2 only, keep software prefetches and the kernel's own K distance."""
    from qwc import cpu

    zen = cpu.x86_features_of(AMD_CPUINFO)
    intel = cpu.x86_features_of(AMD_CPUINFO.replace("AuthenticAMD", "GenuineIntel").replace("25", "6"))
    assert "zen" in zen and "zen" in cpu.HINTS and zen - {"zen"} == intel
    assert "zen" not in cpu.x86_features_of(AMD_CPUINFO.replace("25", "16"))   # before Zen
    assert cpu.x86_features_of("processor\t: 0\n") is None
    assert kernels_for(zen).int_dots.decode_prefetch == "hardware"
    assert kernels_for(get_target("x86-zen").features) == kernels_for(zen)
    assert kernels_for(intel).int_dots.decode_prefetch == "software"
    assert (kernels_for(zen).decode_key_prefetch, kernels_for(intel).decode_key_prefetch) == (4096, None)
    assert kernels_for(get_target("arm-yitian").features).decode_key_prefetch is None   # ARM's kernels unchanged
    zen3 = {"avx2", "fma", "zen"}
    assert (kernels_for(zen3).int_dots.decode, kernels_for(zen3).int_dots.decode_prefetch) == ("avx2", "software")
    assert kernels_for(zen).int_dots.prefill == kernels_for(intel).int_dots.prefill == "vnni"
    assert targets.kernel_summary(get_target("x86-zen"))["decode"] == "w4a8-vnni+hw-prefetch"
    assert targets.kernel_summary(get_target("x86-avx512"))["decode"] == "w4a8-vnni"


def test_an_artifact_built_on_a_zen_runs_on_an_intel_cpu(monkeypatch):
    """"zen" is a hint (cpu.HINTS): the runtime's load check asks a machine for the ISA
    features only, and still refuses one that lacks them."""
    from qwc import cpu
    from qwc.errors import QwcError
    from qwc.manifest import ArtifactTarget
    from qwc.runtime import engine

    t = get_target("x86-zen")

    class Manifest:
        target = ArtifactTarget(t.name, t.arch, t.triple, t.mcpu, tuple(sorted(t.features)), t.mattr)

    monkeypatch.setattr(cpu, "machine_arch", lambda: "x86_64")
    monkeypatch.setattr(cpu, "features", lambda: get_target("x86-avx512").features)
    engine.check_runs_here(Manifest())
    monkeypatch.setattr(cpu, "features", lambda: get_target("x86-avx2").features)
    with pytest.raises(QwcError, match="lacks: avx512_vnni, avx512bw, avx512f, avx512vl$"):
        engine.check_runs_here(Manifest())


def test_rules_end_with_a_catch_all_and_tiles_are_per_gemm():
    assert targets.KERNEL_RULES[-1][0] == frozenset()
    assert kernels_for(set()).int_dots is None
    assert set(GEMM_TILES) == set(GEMM_LAYOUT) == {k.int_dots.prefill for _, k in targets.KERNEL_RULES if k.int_dots}
    assert GEMM_LAYOUT["smmla"] == "arm_pairs" and all(t % 2 == 0 for t in GEMM_TILES["smmla"])


def test_every_kernel_a_rule_names_has_a_module_with_the_interface():
    """The registry (design.md, "Adding an ISA kernel"): each name a rule gives resolves to a
    module with kernels/w4a8.py's KernelModule interface, with a tile default for it; the decode
    kernels build a GEMV carrying their dot, and asking one for an epilogue it lacks fails."""
    from qwc.compiler.kernels import DECODE_GEMV, decode_epilogues, decode_gemv, kernel_module
    from qwc.compiler.kernels.w4a8 import KernelModule

    for _, k in targets.KERNEL_RULES:
        if k.int_dots is None:
            continue
        for dot in (k.int_dots.decode, k.int_dots.prefill, k.int_dots.q8_decode, k.int_dots.q8_prefill):
            if dot is None:
                continue
            mod = kernel_module(dot)
            assert isinstance(mod, KernelModule) and dot in mod.DEFAULT_TOKENS
        assert "bias" in decode_epilogues(k.int_dots.decode)
        gemv = decode_gemv(((32, True), (48, False)), 2, dot=k.int_dots.decode)
        assert str(gemv.attrs[DECODE_GEMV]) == k.int_dots.decode
    assert decode_epilogues("vnni") >= {"silu_mul", "quantize"}
    with pytest.raises(ValueError, match="sdot decode GEMV has no quantize, silu_mul epilogue"):
        decode_gemv(((64, False), (64, False)), 2, silu_mul=True, quantize=-8, dot="sdot")
    with pytest.raises(ValueError, match="unknown W4A8 kernel 'svdot'"):
        kernel_module("svdot")


def test_a_module_without_the_interface_is_refused_as_it_loads(monkeypatch):
    from qwc.compiler.kernels import kernel_module

    monkeypatch.setitem(targets.KERNEL_MODULES, "svdot", "vector_math")   # a kernels module, not an ISA's
    with pytest.raises(TypeError, match="vector_math .W4A8 kernel 'svdot'. lacks DEFAULT_TOKENS, DECODE_EPILOGUES, "
                                        "PREFILL_BIAS, prefill_gemm, decode_gemv"):
        kernel_module("svdot")


def test_tuning_tasks_take_the_tables_gemm(tiny_q4):
    """`qwc tune` extracts W4A8 tasks for the GEMM the table names for the target."""
    import onnx

    from qwc.compiler.tuning import extract_tasks

    model = onnx.load(str(tiny_q4))
    for name, dot in (("arm-yitian", "smmla"), ("arm-neon", "sdot")):
        tasks = extract_tasks(model, 8, get_target(name).features)
        assert tasks and {t.dot for t in tasks} == {dot}


@pytest.mark.parametrize("arch, have, named", [
    # hwcaps as qwc/cpu.py reads them: N2 (SVE2 at 128 bits), N1, a core with 256-bit SVE2
    ("aarch64", {"neon", "dotprod", "sve", "sve2", "i8mm", "bf16", "fp16fml", "sve128"}, "arm-yitian"),
    ("aarch64", {"neon", "dotprod"}, "arm-neon"),
    ("aarch64", {"neon", "dotprod", "sve", "sve2", "i8mm", "bf16", "fp16fml"}, None),
    ("x86_64", {"avx2", "fma", "sse4_2", "aes"}, "x86-avx2"),
    ("x86_64", {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "amx_tile", "amx_int8", "amx_bf16"},
     "x86-amx"),
])
def test_host_target_has_the_features_of_the_named_target_with_them(monkeypatch, arch, have, named):
    from qwc import cpu

    monkeypatch.setattr(cpu, "machine_arch", lambda: arch)
    monkeypatch.setattr(cpu, "features", lambda: frozenset(have))
    host = targets.host_target()
    assert host.arch == arch
    if named:
        assert host.features == get_target(named).features
        assert set(host.mattr) == set(get_target(named).mattr) - {"+v8.2a", "+avx512vnni"}   # (x86: the CPU's name)
    else:   # SVE2 at another length: the NEON code and its i8mm GEMM, no SVE in the build
        assert host.features == {"neon", "dotprod", "i8mm", "bf16", "fp16fml"}
        assert "+sve2" not in host.mattr and kernels_for(host.features).int_dots.prefill == "smmla"


def test_cpu_features_of_this_machine_match_proc_cpuinfo():
    from pathlib import Path

    from qwc import cpu

    if cpu.machine_arch() != "x86_64":
        pytest.skip("the x86 reader; the aarch64 one is tested under qemu (tests/arm/test_arm.py)")
    flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    assert cpu.features() - cpu.HINTS == frozenset(flags.split(":", 1)[1].split())
    assert cpu.has("zen") == ("AuthenticAMD" in Path("/proc/cpuinfo").read_text())   # (every AMD here is a Zen)
    assert cpu.has("sse2") and not cpu.has("no-such-flag")


@pytest.mark.parametrize("n, nb, threads, split", [
    (896, 152, 128, 2),    # a 0.5B's down projection: 56 row groups -> 112 tasks
    (896, 28, 128, 2),     # its o projection
    (896, 152, 64, 1),     # 56 groups already fill 64 threads but for 8
    (3584, 592, 128, 1),   # a 7B's: 224 groups
    (128, 10, 128, 4),     # 8 groups, parts of 2 and 3 blocks
    (128, 4, 128, 2),      # parts of at least 2 blocks
    (128, 3, 128, 1),
])
def test_a_decode_gemv_of_few_row_groups_splits_its_blocks(n, nb, threads, split):
    from qwc.compiler.kernels.arm.dotprod import block_split

    assert block_split(n, nb, threads) == split
