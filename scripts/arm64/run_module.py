"""Runs under the emulated arm64 python (qemu-aarch64): every function of a compiled Relax
library on the inputs of an .npz, outputs saved to another .npz (tests/compiler/test_kernels.py runs
the ARM kernels this way).

    run_module.py LIB.so IN.npz OUT.npz      (IN holds "<function>/<i>" arrays, i = arg index)
"""

import platform
import sys

import numpy as np


def main() -> None:
    import tvm
    from tvm.runtime.vm import VirtualMachine  # runtime-only: works with TVM_USE_RUNTIME_LIB=1

    lib, src, out = sys.argv[1:4]
    vm = VirtualMachine(tvm.runtime.load_module(lib), tvm.cpu())
    inputs = np.load(src)
    funcs = sorted({k.split("/")[0] for k in inputs.files})
    results = {}
    for f in funcs:
        args = [tvm.runtime.tensor(inputs[f"{f}/{i}"]) for i in range(sum(k.startswith(f + "/") for k in inputs.files))]
        results[f] = vm[f](*args).numpy()
    np.savez(out, **results)
    print(platform.machine(), len(results))


if __name__ == "__main__":
    main()
