"""Runs under the emulated arm64 python (qemu-aarch64): every function of a compiled Relax
library on the inputs of an .npz, outputs saved to another .npz (tests/compiler/test_kernels.py runs
the ARM kernels this way).

    run_module.py LIB.so IN.npz OUT.npz                (IN holds "<function>/<i>" arrays, i = arg index)
    run_module.py LIB.so IN.npz OUT{t}.npz 1,3,8,64    (once at each thread count, one process)

With thread counts the process starts with the largest (TVM_NUM_THREADS, set by the caller)
and TVM's pool is configured down to each count in turn, the number of tasks its parallel
loops split into: starting the emulated python and TVM once costs more than most kernels' runs.
"""

import platform
import sys

import numpy as np


def main() -> None:
    import tvm
    from tvm.runtime.vm import VirtualMachine  # runtime-only: works with TVM_USE_RUNTIME_LIB=1

    lib, src, out = sys.argv[1:4]
    threads = [int(t) for t in sys.argv[4].split(",")] if len(sys.argv) > 4 else [None]
    vm = VirtualMachine(tvm.runtime.load_module(lib), tvm.cpu())
    inputs = np.load(src)
    funcs = sorted({k.split("/")[0] for k in inputs.files})
    for t in threads:
        if t is not None:
            tvm.get_global_func("runtime.config_threadpool")(1, t)   # 1: the pool's default mode
            if tvm.get_global_func("runtime.NumThreads")() != t:
                sys.exit(f"run_module.py: TVM's pool did not take {t} threads")
        results = {}
        for f in funcs:
            args = [tvm.runtime.tensor(inputs[f"{f}/{i}"]) for i in range(sum(k.startswith(f + "/") for k in inputs.files))]
            results[f] = vm[f](*args).numpy()
        np.savez(out.replace("{t}", str(t)), **results)
        print(platform.machine(), len(results))


if __name__ == "__main__":
    main()
