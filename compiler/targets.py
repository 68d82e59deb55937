"""The tables of compilation targets: name -> TVM target, ISA features, toolchain; and ISA
features -> the kernels they select (KERNEL_RULES).

Everything that differs between targets is decided here and nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from qwc.errors import QwcError
from qwc.manifest import machine_arch as host_arch   # the one map of machine names


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
        return self.arch == host_arch()


def _x86_host() -> Target:
    import tvm

    cpu = tvm.get_global_func("target.llvm_get_system_cpu")()  # "native" is rejected by TVM 0.27
    feats = set()
    try:
        flags = open("/proc/cpuinfo").read()
        for f in ("avx2", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "fma"):
            if f" {f}" in flags:
                feats.add(f)
    except OSError:
        pass
    return Target("host", "x86_64", "x86_64-linux-gnu", cpu, features=frozenset(feats),
                  description=f"this machine ({cpu})")


def _arm_host() -> Target:
    import tvm

    cpu = tvm.get_global_func("target.llvm_get_system_cpu")()
    return Target("host", "aarch64", "aarch64-linux-gnu", cpu, features=frozenset({"neon"}),
                  description=f"this machine ({cpu})")


_TABLE = {
    "x86-avx2": Target("x86-avx2", "x86_64", "x86_64-linux-gnu", "haswell",
                       features=frozenset({"avx2", "fma"}), description="x86-64 with AVX2 and FMA"),
    "arm-yitian": Target(
        "arm-yitian", "aarch64", "aarch64-linux-gnu", "neoverse-n2",
        mattr=("+neon", "+sve2", "+dotprod", "+i8mm", "+bf16"),
        features=frozenset({"neon", "sve2", "dotprod", "i8mm", "bf16", "sve128"}),
        cross_compiler="aarch64-linux-gnu-g++",
        description="Alibaba Yitian 710: Armv9 Neoverse-N2 class, SVE2 128-bit, dotprod, i8mm"),
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
        return _x86_host() if host_arch() == "x86_64" else _arm_host()
    if name not in _TABLE:
        raise QwcError(f"unknown target {name!r} (known: {', '.join(TARGET_NAMES)})")
    return _TABLE[name]


# -- which kernels a target's ISA features select ---------------------------------------------
# One table, read by the importer (compiler/frontend.py), compile-time repacking (repack.py),
# `qwc tune` (tuning.py), `qwc compile` and bench/gemv.py. Rules are tried in order and the
# first whose features the target has wins, as TVM's dlight rules or ggml's per-arch folders.
# The builders behind the names are in compiler/kernels/__init__.py.

@dataclass(frozen=True)
class W4A8:
    """A target's W4A8 kernels: Q4_0 weights, activations quantized per 32-block to int8."""
    isa: str                          # "x86" | "arm": the weight layout (kernels/row_groups.py)
    decode: str                       # the decode GEMV: "vnni" | "sdot"
    prefill: str                      # the prefill GEMM: "vnni" | "sdot" | "smmla"
    decode_layout: str                # act_quant.fused_quantizer's layout for decode ...
    prefill_layout: str               # ... and for prefill: "plain" | "arm" | "arm_pairs"
    prefill_tokens: tuple[int, ...]   # the GEMM tile widths `qwc tune` searches


@dataclass(frozen=True)
class Kernels:
    w4a8: W4A8 | None                 # None: no integer dot-product kernel (the default is W4A32)
    decode_attention: str             # "three_pass" | "online" (kernels/attention.py)


_VNNI = W4A8("x86", "vnni", "vnni", "plain", "plain", (1, 2, 4, 8))
_SDOT = W4A8("arm", "sdot", "sdot", "arm", "arm", (1, 2, 4, 8))
_SMMLA = W4A8("arm", "sdot", "smmla", "arm", "arm_pairs", (4, 8, 10, 12))

KERNEL_RULES: tuple[tuple[frozenset[str], Kernels], ...] = (
    # Decode attention: three passes on x86, 1.5x the online kernel at 512 cached tokens; ARM
    # keeps the online kernel, 4% fewer instructions per decoded token under qemu (results.md).
    (frozenset({"dotprod", "i8mm"}), Kernels(_SMMLA, "online")),
    (frozenset({"dotprod"}), Kernels(_SDOT, "online")),
    (frozenset({"neon"}), Kernels(None, "online")),
    (frozenset({"avx512_vnni", "avx512bw", "avx512f"}), Kernels(_VNNI, "three_pass")),
    (frozenset(), Kernels(None, "three_pass")),
)
GEMM_TILES = {w.prefill: w.prefill_tokens for _, k in KERNEL_RULES if (w := k.w4a8)}
GEMM_LAYOUT = {w.prefill: w.prefill_layout for _, k in KERNEL_RULES if (w := k.w4a8)}


def kernels_for(features) -> Kernels:
    features = set(features)
    return next(k for needs, k in KERNEL_RULES if needs <= features)


def q4_0_path(block: int, bits: int, act_bits: int, features) -> str | None:
    """Which of qwc's Q4_0 kernels a MatMulNBits takes: "x86" / "arm" (W4A8 integer dots),
    "f32" (W4A32), or None for the generic TE kernels."""
    if bits != 4 or block != 32:
        return None
    if act_bits == 32:
        return "f32"
    w = kernels_for(features).w4a8
    return w.isa if w else None


def default_act_bits(features) -> int:
    """8 where the target has an integer dot-product kernel (W4A8, as llama.cpp computes Q4_0;
    +0.4% perplexity on real weights, docs/design.md), else 32: the float kernel is faster
    than the generic integer one."""
    return 8 if kernels_for(features).w4a8 else 32
