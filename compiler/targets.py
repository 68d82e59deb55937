"""The tables of compilation targets: name -> TVM target, ISA features, toolchain; and ISA
features -> the kernels they select (KERNEL_RULES).

Everything that differs between targets is decided here and nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from qwc import cpu
from qwc.errors import QwcError


@dataclass(frozen=True)
class Target:
    name: str
    arch: str                       # "x86_64" or "aarch64": what machine can run the library
    triple: str
    mcpu: str
    mattr: tuple[str, ...] = ()
    features: frozenset[str] = field(default_factory=frozenset)   # ISA features kernels check
    cross_compiler: str | None = None   # None: the host's c++ links the library
    description: str = ""

    def tvm_target(self):
        import tvm

        spec = {"kind": "llvm", "mtriple": self.triple, "mcpu": self.mcpu}
        if self.mattr:
            spec["mattr"] = list(self.mattr)
        return tvm.target.Target(spec)

    def runs_here(self) -> bool:
        return self.arch == cpu.machine_arch()

    @property
    def vm_exec_mode(self) -> str:
        """How the Relax VM runs the entry points between kernels. ARM: "compiled", native code
        instead of the bytecode interpreter. It runs on the calling thread while the others wait,
        which on a 64-128-core server is a large part of a decode step: 0.5B, 0.39M -> 0.16M
        serial instructions a step under qemu (docs/history/README.md), for a longer compile (0.5B, 24
        layers: 53 -> 190 s, LLVM compiling each entry point as one function). x86 keeps the
        bytecode: a faster compile, and at its 2-16 threads the VM is a small part of a step."""
        return "compiled" if self.arch == "aarch64" else "bytecode"


# The host features a target records: what the kernels and LLVM's -mattr use.
_X86_FEATURES = ("avx2", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "fma", "amx_tile", "amx_int8", "zen")
# LLVM's -mattr for the x86 features it needs spelled out (the host CPU's name does not always
# imply them: a VM may report a CPU model without AMX)
_X86_MATTR = {"amx_tile": "+amx-tile", "amx_int8": "+amx-int8"}
_ARM_MATTR = {"neon": "+neon", "sve2": "+sve2", "dotprod": "+dotprod", "i8mm": "+i8mm", "bf16": "+bf16",
              "fp16fml": "+fp16fml"}


def _system_cpu(default: str) -> str:
    """LLVM's name for this CPU ("native" is rejected by TVM 0.27); `default` where only TVM's
    runtime is loaded (`qwc targets` on a runtime-only install)."""
    try:
        import tvm

        return tvm.get_global_func("target.llvm_get_system_cpu")()
    except Exception:  # runtime-only TVM has no such function
        return default


def host_target() -> Target:
    """This machine as a target: its architecture and the ISA features qwc/cpu.py reads, so
    `--target host` selects the kernels of the named target with the same features (a
    Neoverse-N2 those of arm-yitian, a dotprod-only core those of arm-neon)."""
    have = cpu.features() or frozenset()
    if cpu.machine_arch() == "x86_64":
        cpu_name = _system_cpu("x86-64")
        feats = frozenset(f for f in _X86_FEATURES if f in have)
        return Target("host", "x86_64", "x86_64-linux-gnu", cpu_name,
                      mattr=tuple(m for f, m in _X86_MATTR.items() if f in feats), features=feats,
                      description=f"this machine ({cpu_name})")
    if cpu.machine_arch() == "aarch64":
        feats = {f for f in _ARM_MATTR if f in have}
        # SVE2 code is written for 128-bit vectors (the kernels' and LLVM's fixed-length
        # assumption); another length gets the NEON code, as arm-neon.
        if not {"sve2", "sve128"} <= have:
            feats.discard("sve2")
        else:
            feats.add("sve128")
        cpu_name = _system_cpu("generic")
        return Target("host", "aarch64", "aarch64-linux-gnu", cpu_name,
                      mattr=tuple(m for f, m in _ARM_MATTR.items() if f in feats),
                      features=frozenset(feats), description=f"this machine ({cpu_name})")
    raise QwcError(f"--target host: qwc has no kernels for this machine's architecture ({cpu.machine_arch()})")


_TABLE = {
    "x86-avx2": Target("x86-avx2", "x86_64", "x86_64-linux-gnu", "haswell",
                       features=frozenset({"avx2", "fma"}), description="x86-64 with AVX2 and FMA"),
    # The VNNI kernels from any x86 machine (the host gets them only where its CPU has VNNI).
    "x86-avx512": Target("x86-avx512", "x86_64", "x86_64-linux-gnu", "x86-64-v4", mattr=("+avx512vnni",),
                         features=frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"}),
                         description="x86-64 with AVX-512 and VNNI (Ice Lake and later Xeons)"),
    # The same kernels, decode's weights left to the hardware prefetchers (IntDots.decode_prefetch).
    "x86-zen": Target("x86-zen", "x86_64", "x86_64-linux-gnu", "znver4", mattr=("+avx512vnni",),
                      features=frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "zen"}),
                      description="AMD EPYC Zen 4 and later (Genoa, Turin): AVX-512 VNNI, decode prefetched by the hardware"),
    # The same with the prefill GEMM's 16-token tiles on AMX (Sapphire Rapids and later Xeons).
    "x86-amx": Target("x86-amx", "x86_64", "x86_64-linux-gnu", "sapphirerapids",
                      mattr=("+avx512vnni", "+amx-tile", "+amx-int8"),
                      features=frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "amx_tile",
                                          "amx_int8"}),
                      description="x86-64 with AVX-512 VNNI and AMX-INT8 (Sapphire Rapids and later Xeons)"),
    "arm-yitian": Target(
        "arm-yitian", "aarch64", "aarch64-linux-gnu", "neoverse-n2",
        mattr=("+neon", "+sve2", "+dotprod", "+i8mm", "+bf16", "+fp16fml"),
        features=frozenset({"neon", "sve2", "dotprod", "i8mm", "bf16", "fp16fml", "sve128"}),
        cross_compiler="aarch64-linux-gnu-g++",
        description="Alibaba Yitian 710: Armv9 Neoverse-N2 class, SVE2 128-bit, dotprod, i8mm, fp16fml"),
    "arm-neon": Target(
        "arm-neon", "aarch64", "aarch64-linux-gnu", "generic",
        mattr=("+v8.2a", "+neon", "+dotprod"),
        features=frozenset({"neon", "dotprod"}),
        cross_compiler="aarch64-linux-gnu-g++",
        description="Armv8.2-A with NEON dotprod, no SVE"),
}

TARGET_NAMES = ("host", *_TABLE)


def get_target(name: str) -> Target:
    if name == "host":
        return host_target()
    if name not in _TABLE:
        raise QwcError(f"unknown target {name!r} (known: {', '.join(TARGET_NAMES)})")
    return _TABLE[name]


# -- which kernels a target's ISA features select ---------------------------------------------
# One table, read by the importer (compiler/frontend.py), compile-time repacking (repack.py),
# `qwc tune` (tuning.py), `qwc compile` and bench/gemv.py. Rules are tried in order and the
# first whose features the target has wins, as TVM's dlight rules or ggml's per-arch folders.
# The builders behind the names are in compiler/kernels/__init__.py.

@dataclass(frozen=True)
class IntDots:
    """A target's integer-dot kernels: activations quantized per 32-block to int8, times Q4_0
    weights (W4A8) and, where q8_decode / q8_prefill name them, Q8_0 weights (W8A8)."""
    isa: str                          # "x86" | "arm": the weight layout (kernels/row_groups.py)
    decode: str                       # the decode GEMV: "vnni" | "avx2" | "sdot"
    prefill: str                      # the prefill GEMM: "vnni" | "avx2" | "sdot" | "smmla"
    decode_layout: str                # act_quant.fused_quantizer's layout for decode ...
    prefill_layout: str               # ... and for prefill: "plain" | "arm" | "arm_pairs"
    prefill_tokens: tuple[int, ...]   # the GEMM tile widths `qwc tune` searches
    # Q8_0 weights (W8A8) on the same activations and layouts: the decode GEMV and prefill
    # GEMM for 8-bit codes ("vnni8", "sdot8", "smmla8"), or None: Q8_0 runs as two Q4_0
    # halves on the kernels above (compiler/repack.py: q8_0_nibble_halves; AVX2, whose
    # vpmaddubsw sums of 8-bit codes would overflow)
    q8_decode: str | None = None
    q8_prefill: str | None = None
    # llama.cpp's Q6_K weights (8-bit codes, an int8 scale a sub-block of 16) on their own
    # kernel ("vnni": kernels/x86/q6_k.py, "sdot": kernels/arm/q6_k.py), or None: Q6_K becomes
    # Q8_0 at compile time (compiler/repack_q6_k.py), close but not exact
    q6_k: str | None = None
    # llama.cpp's Q4_K in the W4A8 kernels with the file's compact factors (kernels/q4_k_scales.py:
    # 4.625 bits a weight on x86, the file's 4.5 on ARM), or expanded to float32 scales and block
    # offsets (6 bits). Compact on every target: a decode at many threads is bound by the bytes
    # it reads. ARM's decode GEMV takes them as llama.cpp's Q4_K x Q8_K dot (the sub-block
    # scales on integer sums, on activations scaled by super-blocks: kernels/arm/dotprod.py), so
    # the factors cost it no conversions a block (docs/history/weight-formats.md)
    q4_k_compact: bool = False
    # llama.cpp's Q5_0 / Q5_1 / Q5_K as five-bit codes 0..31 with a block offset each, or Q5_K's
    # compact factors (row_groups.pack_five_bit, compiler/repack_five_bit.py): the decode GEMV
    # and prefill GEMM for them ("vnni5", "sdot5", "smmla5"), or None: they stay 8-bit codes on
    # the W8A8 kernels. Decode at many threads reads every weight, and the bytes are 5/8 of the
    # codes'; each nibble costs ARM an insert of its fifth bit (kernels/arm/dotprod.py)
    q5: str | None = None
    q5_prefill: str | None = None
    # llama.cpp's IQ4_NL / IQ4_XS as 4-bit indices into their code book, looked up by one byte
    # shuffle a vector (kernels/code_book.py, compiler/repack_iq4.py): the decode GEMV and the
    # prefill GEMM for them, or None: they stay the book's values as 8-bit codes on the W8A8
    # kernels (AVX2's vpmaddubsw pairs of those would overflow int16, as Q8_0's do)
    iq4: str | None = None
    iq4_prefill: str | None = None
    # the prefill GEMM's whole 16-token tiles on AMX's tile multiply (kernels/x86/amx.py), the
    # leftover tokens, decode and the batched decode step on the VNNI kernels: a block's 16 x 16
    # dots are one instruction, so what is left is scaling them (docs/history/x86-speed.md)
    amx: bool = False
    # the prefill GEMM's other activation format: one int8 scale and zero point a token
    # (act_quant layout "arm_rows" for smmla, "arm_rows_flat" for sdot; design.md "Two activation
    # formats"), for the linears
    # `qwc optimize --act-scale` chose (compiler/row_activations.py); None: blocks everywhere
    row_layout: str | None = None
    # how decode's memory-bound kernels (the decode GEMVs, x86's Q6_K at one token) get their
    # weights ahead of use: "software", a prefetch a few blocks ahead in each of their streams
    # (Intel Xeons: the hardware streamer restarts at every 4 KiB page), or "hardware", no
    # prefetch instruction and the fused MLP GEMV's two row groups one after the other, where the
    # hardware prefetchers stream alone faster (AMD Zen: docs/history/x86-speed.md)
    decode_prefetch: str = "software"


@dataclass(frozen=True)
class Kernels:
    int_dots: IntDots | None          # None: no integer dot-product kernel (the default is W4A32)
    # kernels/decode_attention.py: "three_pass" (rotary, cache writes and the o projection's quantizer
    # in decode_attention, a task per kv head), "three_pass_heads" (the same, a task per query
    # head: more tasks for many cores), "online" (those kernels apart, the online attention)
    decode_attention: str
    # decode attention's keys split in spans of this many, a task each, merged after ("split-K"):
    # at depth every thread of a many-core machine gets work, where a 2-kv-head model had 2
    # (x86) or 14 (ARM) tasks. None: one task takes all of its heads' keys (x86: at 1-2 threads
    # 2 kv heads already fill the cores and the split's merge only costs, bench/decode_attention.py;
    # a many-core x86 would want it)
    decode_split_keys: int | None = None
    # the threads a decode step's launches are sized for: a residual GEMV of fewer row groups
    # splits its blocks into parts (compiler/split_residual_gemv.py). ARM: a Yitian 710 has 128
    # cores. None: no split (x86 at 2-64 threads: 56 groups already fill them)
    decode_threads: int | None = None
    # a mixed step's decode tokens attend in decode_attention's segments form, a launch a layer
    # after the online kernel's, so that their logits are decode's to the bit (design.md, "One
    # arithmetic for a token"). Only where the linears agree to the bit too (x86): on ARM the
    # decode GEMVs' split sums differ from the GEMM's anyway, and the launch lengthened the
    # mixed step's critical path at 64 threads (docs/history/arm.md).
    exact_step_decode: bool = True
    # bytes decode attention's scores pass prefetches ahead in each K stream (None: the
    # kernel's K_PREFETCH_LINES lines, 1 KiB of a float32 cache, 512 bytes of a float16 one).
    # AMD Zen: 4 KiB, where the nearer prefetch left the pass waiting on DRAM
    # (kernels/decode_attention.py, docs/history/x86-speed.md)
    decode_key_prefetch: int | None = None


_VNNI = IntDots("x86", "vnni", "vnni", "plain", "plain", (1, 2, 4, 8), "vnni8", "vnni8", "vnni", q4_k_compact=True,
                q5="vnni5", q5_prefill="vnni5", iq4="vnni_iq4", iq4_prefill="vnni_iq4")
_VNNI_AMX = replace(_VNNI, amx=True)
_VNNI_ZEN = replace(_VNNI, decode_prefetch="hardware")
# The same kernels and layout with vpdpbusd built from AVX2's vpmaddubsw + vpmaddwd
# (x86/vnni.py: _block_dot_avx2): what an AVX2-only x86 (Zen 3, Haswell to Comet Lake) has.
_AVX2 = IntDots("x86", "avx2", "avx2", "plain", "plain", (1, 2, 4, 8), q4_k_compact=True)
_SDOT = IntDots("arm", "sdot", "sdot", "arm", "arm", (1, 2, 4, 8), "sdot8", "sdot8", "sdot", q4_k_compact=True,
                q5="sdot5", q5_prefill="sdot5", iq4="sdot_iq4", iq4_prefill="sdot_iq4", row_layout="arm_rows_flat")
_SMMLA = IntDots("arm", "sdot", "smmla", "arm", "arm_pairs", (4, 8, 10, 12), "sdot8", "smmla8", "sdot",
                 q4_k_compact=True, q5="sdot5", q5_prefill="smmla5", iq4="sdot_iq4", iq4_prefill="smmla_iq4",
                 row_layout="arm_rows")

# The module under compiler/kernels that builds each W4A8 kernel the rules name (the interface
# it exports: kernels/w4a8.py). A new ISA kernel is that module, an entry here and a rule.
KERNEL_MODULES = {"vnni": "x86.vnni", "avx2": "x86.vnni", "sdot": "arm.dotprod", "smmla": "arm.i8mm",
                  "vnni8": "x86.vnni", "sdot8": "arm.dotprod", "smmla8": "arm.i8mm", "vnni5": "x86.vnni",
                  "sdot5": "arm.dotprod", "smmla5": "arm.i8mm", "vnni_iq4": "x86.vnni", "sdot_iq4": "arm.dotprod",
                  "smmla_iq4": "arm.i8mm"}

KERNEL_RULES: tuple[tuple[frozenset[str], Kernels], ...] = (
    # Decode attention: three passes on x86, faster than the online kernel at depth; on ARM a
    # task per query head, so the kernels it absorbs are no serial work between launches on a
    # 64-128-core machine (docs/history/long-context.md, docs/history/arm.md).
    (frozenset({"dotprod", "i8mm"}), Kernels(_SMMLA, "three_pass_heads", 512, 128, exact_step_decode=False)),
    (frozenset({"dotprod"}), Kernels(_SDOT, "three_pass_heads", 512, 128, exact_step_decode=False)),
    (frozenset({"neon"}), Kernels(None, "three_pass_heads", 512, exact_step_decode=False)),
    (frozenset({"amx_int8", "amx_tile", "avx512_vnni", "avx512bw", "avx512f"}), Kernels(_VNNI_AMX, "three_pass")),
    (frozenset({"avx512_vnni", "avx512bw", "avx512f", "zen"}), Kernels(_VNNI_ZEN, "three_pass", decode_key_prefetch=4096)),
    (frozenset({"avx512_vnni", "avx512bw", "avx512f"}), Kernels(_VNNI, "three_pass")),
    (frozenset({"avx2", "fma"}), Kernels(_AVX2, "three_pass")),
    (frozenset(), Kernels(None, "three_pass")),
)
GEMM_TILES = {w.prefill: w.prefill_tokens for _, k in KERNEL_RULES if (w := k.int_dots)}
GEMM_LAYOUT = {w.prefill: w.prefill_layout for _, k in KERNEL_RULES if (w := k.int_dots)}


def kernels_for(features) -> Kernels:
    features = set(features)
    return next(k for needs, k in KERNEL_RULES if needs <= features)


def q4_0_path(block: int, bits: int, act_bits: int, features, zero_points: bool = False) -> str | None:
    """Which of qwc's Q4_0 kernels a MatMulNBits takes: "x86" / "arm" (W4A8 integer dots),
    "f32" (W4A32), or None for the generic TE kernels (other bits and blocks, and Q4_1's
    zero points)."""
    if bits != 4 or block != 32 or zero_points:
        return None
    if act_bits == 32:
        return "f32"
    w = kernels_for(features).int_dots
    return w.isa if w else None


def q8_0_path(block: int, bits: int, act_bits: int, features) -> str | None:
    """"x86" / "arm" when a MatMulNBits of 8-bit codes in blocks of 32 (Q8_0) takes the
    target's native W8A8 kernels (row_groups.pack_int8: unsigned codes on x86, signed on ARM),
    else None (two Q4_0 halves where the target has Q4_0 kernels, compiler/repack.py; the
    generic kernels otherwise)."""
    if bits != 8 or block != 32 or act_bits != 8:
        return None
    w = kernels_for(features).int_dots
    return w.isa if w and w.q8_decode else None


def five_bit_path(block: int, bits: int, act_bits: int, features) -> str | None:
    """The decode kernel ("vnni5", "sdot5") a MatMulNBits of 8-bit codes in blocks of 32 whose codes fit five
    bits (a GGUF's Q5_0 / Q5_1 / Q5_K) takes as five-bit codes (IntDots.q5), else None."""
    if bits != 8 or block != 32 or act_bits != 8:
        return None
    w = kernels_for(features).int_dots
    return w.q5 if w else None


def iq4_path(block: int, act_bits: int, features) -> str | None:
    """The decode kernel ("vnni_iq4", "sdot_iq4") an IQ4_NL / IQ4_XS MatMulNBits (blocks of 32)
    takes as 4-bit indices into the book (IntDots.iq4), else None."""
    if block != 32 or act_bits != 8:
        return None
    w = kernels_for(features).int_dots
    return w.iq4 if w else None


def q6_k_path(block: int, bits: int, act_bits: int, features) -> str | None:
    """"x86" / "arm" when a MatMulNBits of 8-bit codes in blocks of 16 (llama.cpp's Q6_K
    sub-blocks, models/gguf_blocks.py) takes the target's own Q6_K kernel (IntDots.q6_k: its
    codes unsigned on x86, signed on ARM), else None."""
    if bits != 8 or block != 16 or act_bits != 8:
        return None
    w = kernels_for(features).int_dots
    return w.isa if w and w.q6_k else None


def vector_registers(features) -> tuple[int, int]:
    """(count, bytes) of the vector registers a target's kernels compile to: the file a
    kernel's register tile (accumulators, and the loads and broadcasts feeding them) must
    fit (kernels/decode_attention.py)."""
    if "avx512f" in features:
        return 32, 64
    if "neon" in features:
        return 32, 16
    if "avx2" in features:
        return 16, 32
    return 16, 16    # SSE


def default_kv_dtype(target: Target) -> str:
    """The KV cache's element type where `qwc compile --kv-dtype` is not given: float16 where
    the target widens it in one instruction as it loads (x86 F16C, on every AVX2 CPU; every
    aarch64), else float32. At depth a decode step reads the cache, so half the bytes is the
    faster step (docs/history/README.md, "Long context")."""
    return "float16" if target.arch == "aarch64" or "avx2" in target.features else "float32"


def default_act_bits(features) -> int:
    """8 where the target has an integer dot-product kernel (W4A8, as llama.cpp computes Q4_0;
    a little perplexity on real weights: docs/figures.md), else 32: the float kernel is faster
    than the generic integer one."""
    return 8 if kernels_for(features).int_dots else 32


def kernel_summary(target: Target) -> dict[str, str]:
    """What the kernel table picks for a target, by name (`qwc targets`, the tests)."""
    k = kernels_for(target.features)
    w = k.int_dots
    # Q8_0 weights: native W8A8 (decode/prefill), else as two 4-bit halves (repack.py)
    q8 = (f"w8a8-{w.q8_decode}/{w.q8_prefill}" if w.q8_decode else "2x w4a8") if w else "2x w4a32"
    q6 = f"w6a8-{w.q6_k}" if w and w.q6_k else "as q8_0"
    q4k = ("w4a8-compact" if w.q4_k_compact else "w4a8-expanded") if w else "w4a32"   # its scales' form
    q5 = f"w5a8-{w.q5}/{w.q5_prefill}" if w and w.q5 else "as q8_0"   # Q5_0 / Q5_1 / Q5_K: five-bit codes, or bytes
    iq4 = f"w4a8-{w.iq4}/{w.iq4_prefill}" if w and w.iq4 else "as q8_0"   # IQ4_NL / IQ4_XS: indices, or the values
    prefill = f"w4a8-{w.prefill}{'+amx' if w.amx else ''}" if w else "w4a32"
    decode = f"w4a8-{w.decode}{'+hw-prefetch' if w.decode_prefetch == 'hardware' else ''}" if w else "w4a32"
    return {"decode": decode, "prefill": prefill,
            "attention": k.decode_attention, "q8_0": q8, "q4_k": q4k, "q5": q5, "q6_k": q6, "iq4": iq4}


def describe_targets() -> list[tuple[Target, dict[str, str]]]:
    """Every target with its kernels, the host first."""
    return [(t, kernel_summary(t)) for t in (host_target(), *_TABLE.values())]
