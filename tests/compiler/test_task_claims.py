"""compiler/kernels/task_claims.py: a launch's tasks handed out as threads come for them."""

from __future__ import annotations

import numpy as np
import pytest

from qwc.compiler.targets import get_target


def _counting_kernel(tasks: int):
    """y[t] += 1 for each task t some thread takes: a launch of `tasks` tasks."""
    from tvm.script.ir_builder import IRBuilder
    from tvm.script.ir_builder import tirx as T

    from qwc.compiler.kernels import task_claims

    with IRBuilder() as ib:
        with T.prim_func():
            T.func_name("main")
            T.func_attr({"tir.noalias": True, "global_symbol": "main"})
            y = T.arg("y", T.buffer((tasks,), "int32"))
            with task_claims.launch(T, tasks) as task:
                T.buffer_store(y, y[task] + 1, [task])
    return ib.get()


@pytest.mark.parametrize("tasks", [1, 2, 3, 7, 64, 501])
def test_every_task_runs_once_a_launch(tasks):
    """However the threads meet, each task runs exactly once in each of many launches: none
    twice (a flag taken without an atomic exchange) and none left out (a walk that stops short)."""
    import tvm

    lib = tvm.compile(tvm.IRModule({"main": _counting_kernel(tasks)}), target={"kind": "llvm"})
    y = tvm.runtime.tensor(np.zeros(tasks, np.int32))
    for _ in range(200):
        lib["main"](y)
    assert (y.numpy() == 200).all()


@pytest.mark.parametrize("kernel", ["decode_gemv", "q4_matmul", "q6_k_matmul"])
def test_x86_decode_kernels_take_their_tasks(kernel):
    """The x86 kernels a decode step's GEMVs run (the multi-output GEMV, the one-token GEMM of
    o_proj, down and the lm_head, Q6_K's one-token form) take their tasks with an atomic
    exchange; the one-token forms allocate nothing (the walk's task index stays an expression,
    not a buffer; q4_matmul's prefill tiles allocate theirs, as before)."""
    import tvm

    from qwc.compiler.kernels.x86 import q6_k, vnni

    func = {"decode_gemv": lambda: vnni.decode_gemv(((256, True, False), (32, True, False)), 8, "float16"),
            "q4_matmul": lambda: vnni.q4_matmul(256, 8, "float16"),
            "q6_k_matmul": lambda: q6_k.q6_k_matmul(256, 8, m=1)}[kernel]()
    code = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}),
                       target=get_target("x86-zen").tvm_target()).mod.inspect_source("s")
    assert "xchg" in code
    assert kernel == "q4_matmul" or "TVMBackendAllocWorkspace@GOTPCREL" not in code
