"""bench/arm_threads.py: the critical-path arithmetic on hand-made per-thread counts, and the
measurement end to end on the tiny model under qemu (the phases plugin, the launch marks,
TVM's pool at the asked thread count)."""

from __future__ import annotations

import numpy as np
import pytest

from qwc.bench import arm_threads

LIB = (0x10000, 0x20000)   # where the "lib.so" of the hand-made records is mapped


def _records(rows):
    """rows: (vcpu, epoch, phase, vaddr, count)."""
    rec = np.zeros(len(rows), arm_threads.RECORD)
    for i, (v, e, p, a, c) in enumerate(rows):
        rec[i] = (v, e, p, 0, a, c)
    return rec


def _maps(tmp_path, lib):
    maps = tmp_path / "maps"
    maps.write_text(f"{LIB[0]:x}-{LIB[1]:x} r-xp 00000000 08:01 1 {lib}\n"
                    "30000-40000 r-xp 00000000 08:01 2 /usr/lib/libtvm_runtime.so\n")
    return maps


def test_qwc_critical_path_is_the_busiest_thread_per_launch_plus_the_serial_work(tmp_path):
    lib = str(tmp_path / "lib.so")
    in_lib, pool = 0x10100, 0x30100
    rec = _records([
        (0, 0, 0, 0x50000, 7),        # start-up on the main thread: serial
        (0, 1, 1, in_lib, 10),        # launch 1: main's task 0
        (0, 1, 1, pool, 99),          # ... its launching and waiting: left out
        (1, 1, 0, in_lib, 30),        # ... worker 1: the busiest
        (1, 1, 0, pool, 50),          # ... worker 1 waiting: left out
        (0, 1, 0, in_lib, 5),         # after launch 1, a serial kernel
        (0, 2, 1, in_lib, 20),        # launch 2: main the busiest
        (1, 2, 0, in_lib, 20),
    ])
    f = arm_threads.qwc_figures(rec, lib, _maps(tmp_path, lib), threads=2)
    assert f == {"work": 92.0, "critical": 30 + 20 + 7 + 5, "launches": 2, "serial": 12.0, "waiting": 149.0}
    assert arm_threads.efficiency(f, 2) == pytest.approx(92 / (2 * 62))


def test_llama_dynamic_chunks_are_spread_evenly_and_one_thread_epochs_are_serial():
    rec = _records([
        (0, 0, 0, 0x100, 40), (1, 0, 0, 0x100, 10),    # epoch 0: static, thread 0 the busiest
        (0, 1, 0, 0x200, 90), (1, 1, 0, 0x200, 10),    # epoch 1: dynamic chunks, 100 in all
        (0, 2, 0, 0x100, 50), (1, 2, 0, 0x100, 1),     # epoch 2: one thread's node (serial)
        (1, 2, 0, 0x300, 500),                         # waiting in a barrier: left out
    ])
    static = np.isin(rec["vaddr"], [0x100])
    dynamic = rec["vaddr"] == 0x200
    f = arm_threads._combine(rec, static, dynamic, None, threads=2, launches=2, lone_is_serial=True)
    assert f["work"] == 40 + 10 + 100 + 51
    assert f["critical"] == 40 + 100 / 2 + 50
    assert f["serial"] == 40 + 50        # epochs 0 and 2: one thread did at least half
    assert f["waiting"] == 500


def test_per_token_is_the_difference_of_two_runs():
    a = {m: 10.0 for m in arm_threads.METRICS}
    b = {m: 30.0 for m in arm_threads.METRICS}
    assert arm_threads.per_token(a, b, 4) == {m: 5.0 for m in arm_threads.METRICS}


@pytest.mark.slow
@pytest.mark.arm
def test_tiny_decode_under_qemu_splits_the_same_work_over_four_threads(tiny_q4, tmp_path):
    """Both the phases plugin and the launch marks on a real artifact: the work a token is the
    same at 1 and 4 threads, every launch is seen at both, and 4 threads shorten the path
    without beating a perfect split."""
    from qwc.bench import emulation
    from qwc.compiler.compile import compile_file

    art = tmp_path / "tiny-yitian.qwc"
    compile_file(tiny_q4, "arm-yitian", art)
    env = emulation.arm64_env()
    env.update(PYTHONHASHSEED="0", OPENBLAS_NUM_THREADS="1")
    lib = str((art / "lib.so").resolve())
    marks = arm_threads.qwc_marks(lib, env)
    plug = arm_threads.plugin("phases")
    per = {}
    for t in (1, 4):
        figs = []
        for steps in (1, 3):
            out = tmp_path / f"run_{t}_{steps}"
            rec = arm_threads.run_qwc(env, plug, marks, str(art), [[72, 101, 108]] + [5] * steps, t, out)
            figs.append(arm_threads.qwc_figures(rec, lib, out.with_suffix(".maps"), t))
        per[t] = arm_threads.per_token(*figs, 2)
    one, four = per[1], per[4]
    assert one["launches"] == four["launches"] > 0
    assert one["critical"] == one["work"]
    assert four["work"] == pytest.approx(one["work"], rel=0.05)
    assert four["work"] / 4 < four["critical"] < one["critical"]
    assert 0 < four["serial"] < four["critical"]


# objdump's text of ggml_graph_compute_thread's node loop in llama.cpp's KleidiAI build (clang
# 14, ggml's own pool): the copy of ggml_barrier inlined after a node, as the disassembler
# prints it
POOL_LOOP = """
  935f90:\tb.eq\t935ef4 <ggml_graph_compute_thread+0x18c>  // b.none
  935f94:\tadd\tx11, x8, #0x80
  935f98:\tldr\tw9, [x8, #192]
  935f9c:\tldaddal\tw23, w11, [x11]
  935fa0:\tcmp\tw11, w10
  935fa4:\tb.ne\t935fb8 <ggml_graph_compute_thread+0x250>  // b.any
  935fa8:\tadd\tx9, x8, #0xc0
  935fac:\tstr\twzr, [x8, #128]
  935fb0:\tldaddal\tw23, w8, [x9]
  935fb4:\tb\t935ef4 <ggml_graph_compute_thread+0x18c>
  935fb8:\tldr\tw10, [x8, #192]
  935fbc:\tcmp\tw10, w9
  935fc0:\tb.ne\t935ef0 <ggml_graph_compute_thread+0x188>  // b.any
  935fc4:\tyield
  935fc8:\tb\t935fb8 <ggml_graph_compute_thread+0x250>
  935fcc:\tldrb\tw12, [x28, #48]
"""


def test_the_inlined_pool_barrier_is_found_with_its_spin_loop():
    """The block that enters the barrier (after the last branch before its arrival `ldaddal`)
    advances a thread's epoch; its spin loop, up to and with the `b` back after `yield`, is
    waiting. The departing `ldaddal` (no cmp / b.ne after it) is no barrier of its own."""
    assert arm_threads.barrier_sites(POOL_LOOP) == [(0x935f94, (0x935fb8, 0x935fcc))]
    assert arm_threads.barrier_sites(POOL_LOOP.replace("yield", "nop")) == []   # an atomic add, no barrier
