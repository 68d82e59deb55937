"""What this machine's CPU is: its architecture and ISA features, read in one place for the
host target (compiler/targets.py), the runtime's load check (runtime/engine.py) and the
benches. Needs only the standard library, so it runs wherever the runtime does.

Feature names are the targets' (compiler/targets.py): on x86 the kernel's /proc/cpuinfo flags
(`avx512_vnni`, `amx_int8`, ...); on AArch64 the kernel's hwcaps through getauxval, as
`neon`, `dotprod`, `sve`, `sve2`, `i8mm`, `bf16`, plus `sve128` where SVE's vector length is
128 bits (the Neoverse-N2 / Yitian 710 length the arm-yitian kernels are written for).
qemu-user reports the hwcaps and the SVE length of the CPU it emulates, which is how the
aarch64 paths are tested here.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
from pathlib import Path

from .errors import QwcError
from .limits import is_int

# getauxval keys and the AArch64 hwcap bits (linux/arch/arm64/include/uapi/asm/hwcap.h)
_AT_HWCAP, _AT_HWCAP2 = 16, 26
_ARM_BITS = {"neon": (_AT_HWCAP, 1), "dotprod": (_AT_HWCAP, 20), "sve": (_AT_HWCAP, 22),
             "sve2": (_AT_HWCAP2, 1), "i8mm": (_AT_HWCAP2, 13), "bf16": (_AT_HWCAP2, 14),
             "fp16fml": (_AT_HWCAP, 23)}   # fp16fml: HWCAP_ASIMDFHM, FEAT_FHM's fmlal
_PR_SVE_GET_VL = 51            # prctl: this thread's SVE vector length in bytes (low 16 bits)


def machine_arch() -> str:
    """This machine's architecture as a manifest's target.arch names it."""
    m = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(m, m)


def _libc():
    return ctypes.CDLL(None, use_errno=True)


# Linux grants a process AMX's tile data only on request (asm/prctl.h, x86 syscall numbers):
# a tile instruction before it faults with SIGILL
_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA = 158, 0x1023, 18


@functools.cache
def enable_amx() -> None:
    """Ask Linux for AMX's tile state for this process (every thread), once; OSError where it
    is refused (a kernel before 5.16, a sandbox), before a kernel that uses it can fault."""
    libc = _libc()
    if libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"Linux refused this process AMX's tile state (arch_prctl ARCH_REQ_XCOMP_PERM): "
                           f"{os.strerror(err)}")


def sve_vector_bytes() -> int | None:
    """SVE's vector length in bytes, or None without SVE (or where it cannot be read)."""
    try:
        prctl = _libc().prctl
    except (OSError, AttributeError):
        return None
    prctl.restype = ctypes.c_int
    vl = prctl(_PR_SVE_GET_VL, 0, 0, 0, 0)
    return vl & 0xFFFF if vl > 0 else None


def _arm_features() -> frozenset[str] | None:
    try:
        getauxval = _libc().getauxval
    except (OSError, AttributeError):
        return None
    getauxval.restype = ctypes.c_ulong
    getauxval.argtypes = [ctypes.c_ulong]
    words = {key: getauxval(key) for key in (_AT_HWCAP, _AT_HWCAP2)}
    have = {name for name, (key, bit) in _ARM_BITS.items() if words[key] >> bit & 1}
    if "sve" in have and sve_vector_bytes() == 16:
        have.add("sve128")
    return frozenset(have)


# Facts about how this CPU runs code, not what it can run: they select kernels that are faster
# on it (compiler/targets.py's rules), and an artifact built with them still runs on a machine
# without them (runtime/engine.py: check_runs_here). "zen": an AMD Zen core (family 0x17 and
# later), whose hardware prefetchers stream decode's weights faster alone than with software
# prefetches beside them (kernels/x86/vnni.py: decode_gemv).
HINTS = frozenset({"zen"})
_ZEN_FAMILY = 0x17


def _x86_features() -> frozenset[str] | None:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    return x86_features_of(text)


def x86_features_of(cpuinfo: str) -> frozenset[str] | None:
    """The first processor's flags in /proc/cpuinfo's text, and "zen" (HINTS) where it is an AMD
    Zen core; None without a flags line."""
    fields = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
        if key.strip() == "flags":
            break
    if "flags" not in fields:
        return None
    flags = set(fields["flags"].split())
    family = fields.get("cpu family", "")
    if fields.get("vendor_id") == "AuthenticAMD" and family.isdigit() and int(family) >= _ZEN_FAMILY:
        flags.add("zen")
    return frozenset(flags)


@functools.cache
def features() -> frozenset[str] | None:
    """The ISA features of this CPU, or None where they cannot be read (another architecture,
    no /proc)."""
    arch = machine_arch()
    if arch == "aarch64":
        return _arm_features()
    if arch == "x86_64":
        return _x86_features()
    return None


def has(feature: str) -> bool:
    return feature in (features() or ())


def usable_cpus() -> int:
    return len(os.sched_getaffinity(0))


def max_threads() -> int:
    """The most worker threads qwc starts. TVM's pool spins while it waits, so every thread past
    the cores slows a step down (16 threads on 2 cores: many times slower; 256 never finish)."""
    return max(8, 4 * usable_cpus())


TVM_SPIN_COUNT = 300000   # TVM's own default spin of an idle pool worker (src/runtime/thread_pool.cc)


def pool_spin_count(poll: int) -> int:
    """llama.cpp's --poll level (0-100, default 50) as TVM's worker spin count: 50 is TVM's
    default, 0 no spin. An idle worker spins on sched_yield, and an EEVDF kernel (Linux 6.6 on)
    pushes a yielding thread's deadline back a slice each time, so beside another busy program
    a worker that spun runs late once its work comes (docs/history/serving.md); 0 sleeps at
    once, which costs each kernel launch a wake-up on a quiet machine."""
    if not is_int(poll) or not 0 <= poll <= 100:
        raise QwcError(f"poll {poll!r}: must be an integer from 0 to 100")
    return poll * TVM_SPIN_COUNT // 50
