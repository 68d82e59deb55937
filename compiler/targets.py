"""The one table of compilation targets: name -> TVM target, ISA features, toolchain.

Everything that differs between targets is decided here and nowhere else.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass, field

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
        return self.arch == host_arch()


def host_arch() -> str:
    m = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(m, m)


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
