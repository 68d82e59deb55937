"""Run under the emulated aarch64 python with the aarch64 TVM wheel's compiler: builds the W4A8
prefill GEMM that `--target host` selects on this (emulated) CPU, with the host target's own
LLVM target, and prints the target's features, the GEMM's name and its matrix instructions.

    host_gemm_under_qemu.py REPO
"""

import re
import sys
from pathlib import Path

REPO = Path(sys.argv[1])
sys.path.insert(0, str(REPO / "scripts" / "arm64"))
from run_engine import _load_package  # noqa: E402

_load_package("qwc", REPO / "qwc")
_load_package("qwc.compiler", REPO / "compiler")

import tvm  # noqa: E402

from qwc.compiler.kernels import w4a8_gemm  # noqa: E402
from qwc.compiler.targets import get_target, kernels_for  # noqa: E402

target = get_target("host")
w = kernels_for(target.features).int_dots
if w is None:
    print(",".join(sorted(target.features)), "none")
    sys.exit(0)
gemm = w4a8_gemm(w.prefill, 64, 4, "float16").with_attr("global_symbol", "main")
lib = tvm.compile(tvm.IRModule({"main": gemm}), target=target.tvm_target())
asm = lib.mod.inspect_source("asm") if hasattr(lib, "mod") else lib.inspect_source("asm")
found = sorted({m for m in re.findall(r"\b(smmla|sdot)\b", asm)})
print(",".join(sorted(target.features)), w.prefill, ",".join(found))
