"""Decode GEMV speed per Qwen2.5-0.5B weight shape, as GB/s of weight bytes read, against the
machine's read bandwidth measured in the same run and onnxruntime's MatMulNBits on the same
single-op graph:

    .venv/bin/python bench/gemv.py [--threads 2] [--act-bits 8] [--decode model.qwc [--runs 3]]

Weight bytes = packed 4-bit values + fp32 block scales (what the kernel must read per token).
Two figures per system: "hot" (the same call repeated: small shapes stay in cache) and "cold"
(the caches are flushed by streaming 256 MiB before each timed call, as in a real decode step
where every layer's weights come from DRAM); the median of the cold calls is reported. Both
go through a VM call with its activation quantizer, which dominates the small shapes. "qwc
strm" is the decode GEMV launch alone (the rows are the launches a step makes: q, k and v in
one, gate and up in one), called on distinct weights in huge pages that add up to a decode
step's bytes (fp16 scales, 18 bytes a block, as an artifact stores them): what the kernel
streams inside a step. The read bandwidth is read in huge pages too (read_bandwidth).

`--decode model.qwc` adds the whole decode step of an artifact (e.g. the one `bench/peers.py`
builds, ~/.cache/qwc/bench/q.qwc): tokens/s after a 512-token prompt and the GB/s that is of
the bytes a step must read (every parameter but the tables it takes one row of: an untied
model's embedding, the rotary cos / sin; for a tied model the embedding is the lm_head, read
whole; plus the K/V cache it attends over), against the same read bandwidth. A run times three
windows of 64 steps, each after a fresh 512-token prompt, and counts the best, as each reader
counts its best one-second run (the windows' mean is printed too). On a shared machine one run
says little (the reference moves within minutes), so it takes `--runs` runs (3) with the
reference measured again after each: every run is held to the higher of the readings just
before and after it, and the median share is printed with every run's.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

# (name, outputs' N, K, with silu) of the decode GEMV launches in one Qwen2.5-0.5B token (each
# once a layer, but the lm_head): q, k and v are one launch, as are gate and up with the
# silu(gate) * up that follows them and its Q8_0 blocks for the down projection
# (compiler/sibling_gemvs.py, fuse_gate_up.py: kernels.decode_gemv's silu_mul and quantize), so
# k and v are never read alone. The single-op columns take one MatMulNBits of the outputs' N
# added up: the same bytes.
SHAPES = [("q+k+v", (896, 128, 128), 896, False), ("o_proj", (896,), 896, False),
          ("gate+up, silu", (4864, 4864), 896, True), ("down_proj", (896,), 4864, False),
          ("lm_head", (151936,), 896, False)]


def gemv_graph(n: int, k: int, block: int = 32, m: int = 1) -> onnx.ModelProto:
    """onnxruntime's MatMulNBits alone: x [1, m, K] by random Q4_0-like weights [N, K]."""
    rng = np.random.default_rng(0)
    nb = (k + block - 1) // block
    w = rng.integers(0, 256, (n, nb, block // 2), dtype=np.uint8)
    s = (rng.random((n, nb), dtype=np.float32) * 0.01).astype(np.float32)
    node = helper.make_node("MatMulNBits", ["x", "w", "s"], ["y"], domain="com.microsoft", K=k, N=n, bits=4,
                            block_size=block)
    g = helper.make_graph([node], "gemv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, m, k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, m, n])],
                          [numpy_helper.from_array(w, "w"), numpy_helper.from_array(s, "s")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid("com.microsoft", 1)],
                             ir_version=10)


def weight_bytes(n, k, block=32):
    nb = (k + block - 1) // block
    return n * nb * (block // 2 + 4)


def time_call(fn, min_time=0.3) -> float:
    fn()
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < min_time:
        fn()
        reps += 1
    return (time.perf_counter() - t0) / reps


_FLUSH = None


def time_cold(fn, reps=40) -> float:
    """Median time of `fn` with the caches flushed (a 256 MiB read) before each call."""
    global _FLUSH
    if _FLUSH is None:
        _FLUSH = np.ones(1 << 26, np.float32)
    fn()
    times = []
    for _ in range(reps):
        _FLUSH.sum()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def huge_page_tensors(arrays: list[np.ndarray]) -> list:
    """`arrays` copied into one mapping advised for transparent huge pages (runtime/memory.py:
    Arena), as an artifact's parameters are held, and handed to TVM without a copy. The
    bandwidth readers and the kernels held to them then pay the same TLB misses: in 4 KiB pages
    a reader read less than the same read of huge pages (docs/history/x86-speed.md)."""
    import tvm

    from qwc.runtime.memory import Arena, aligned

    arena, out = Arena(sum(aligned(a.nbytes) for a in arrays)), []
    for a in arrays:
        held = arena.take(a.shape, a.dtype)
        held[...] = a
        out.append(tvm.runtime.from_dlpack(held))
    return out


def qwc_gemv(model, act_bits):
    import tvm
    from tvm import relax
    from tvm.runtime.vm import VirtualMachine

    from qwc.compiler.build import build
    from qwc.compiler.frontend import import_graph
    from qwc.compiler.repack import repack_weights
    from qwc.compiler.targets import get_target

    target = get_target("host")
    model = onnx.ModelProto.FromString(model.SerializeToString())
    repack_weights(model, act_bits, target.features)
    mod = import_graph(model, seq=1, act_bits=act_bits, features=target.features)
    mod, params = relax.frontend.detach_params(mod)
    vm = VirtualMachine(build(mod, target), tvm.cpu())
    x = tvm.runtime.tensor(np.random.default_rng(1).standard_normal((1, 1, model.graph.input[0].type.tensor_type.shape.dim[2].dim_value), dtype=np.float32))
    args = [x, *params["main"]]
    f = vm["main"]
    return lambda: f(*args)


def qwc_stream(outputs: tuple[int, ...], k: int, silu: bool = False, total: float = 290e6,
               rounds: int = 4) -> float | None:
    """GB/s of qwc's x86 decode GEMV launch alone (kernels.decode_gemv: VNNI or AVX2, fp16
    scales as in an artifact: 18 bytes a block, prefetched as the host target's are) of `outputs`
    (their N; `silu`: two, gate and up, written as the Q8_0 blocks of silu(gate) * up) called on
    distinct weights in huge pages (as an artifact's) that
    add up to a decode step's ~290 MB, one after another: every call reads DRAM, as in a real
    step, and nothing but the call itself sits between them. None where the host has no x86
    W4A8 kernel."""
    import tvm

    from qwc.compiler.kernels import decode_gemv
    from qwc.compiler.kernels.row_groups import groups
    from qwc.compiler.kernels.w4a8 import ZERO_POINT
    from qwc.compiler.targets import get_target, kernels_for, q4_0_path

    target = get_target("host")
    if q4_0_path(32, 4, 8, target.features) != "x86":
        return None
    nb = (k + 31) // 32
    dots = kernels_for(target.features).int_dots
    gemv = decode_gemv(tuple((n, False) for n in outputs), nb, silu_mul=silu, quantize=ZERO_POINT if silu else None,
                       dot=dots.decode, prefetch=dots.decode_prefetch)
    f = tvm.compile(tvm.IRModule({"main": gemv.with_attr("global_symbol", "main")}),
                    target=target.tvm_target())["main"]
    rng = np.random.default_rng(2)
    act = [tvm.runtime.tensor(rng.integers(-127, 128, (1, nb, 32), dtype=np.int8)),
           tvm.runtime.tensor(rng.random((1, nb), dtype=np.float32)), tvm.runtime.tensor(rng.integers(-1000, 1000, (1, nb), dtype=np.int32))]
    ys = ([tvm.runtime.tensor(np.zeros(shape, dt)) for shape, dt in (
        ((1, outputs[0] // 32, 32), np.int8), ((1, outputs[0] // 32), np.float32), ((1, outputs[0] // 32), np.int32))]
        if silu else [tvm.runtime.tensor(np.zeros((1, n), np.float32)) for n in outputs])
    per_set = sum(groups(n) for n in outputs) * nb * (256 + 32)
    count = max(2, int(total // per_set))
    held = huge_page_tensors([a for _ in range(count) for n in outputs for a in (
        rng.integers(0, 256, (groups(n), nb, 4, 64), dtype=np.uint8), (rng.random((groups(n), nb, 16)) * 0.01).astype(np.float16))])
    per = 2 * len(outputs)   # a set's weights and scales, output by output
    sets = [held[i:i + per] for i in range(0, len(held), per)]
    for weights in sets:
        f(*act, *weights, *ys)
    best = 0.0
    for _ in range(rounds):
        t0 = time.perf_counter()
        for weights in sets:
            f(*act, *weights, *ys)
        best = max(best, len(sets) * per_set / (time.perf_counter() - t0) / 1e9)
    return best


def ort_gemv(model, threads, accuracy_level, spin: bool = True):
    """A call of `model` (gemv_graph's) in onnxruntime. `spin` False: its idle threads do not
    spin after a call, taking the cores from whatever is timed next."""
    import onnxruntime as ort

    m = onnx.ModelProto()
    m.CopyFrom(model)
    m.graph.node[0].attribute.append(helper.make_attribute("accuracy_level", accuracy_level))
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.log_severity_level = 3
    if not spin:
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    x = np.random.default_rng(1).standard_normal(
        [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim], dtype=np.float32)
    return lambda: sess.run(None, {"x": x})


ROWS, COLS = 4096, 32768   # the read-bandwidth buffer: 512 MiB of int32, far past the caches


def _prefetching_reader(ahead: int, locality: int, streams: int = 1, adjacent: bool = False):
    """Sum of each row, 16 lanes at a time, prefetching `ahead` int32s ahead (LLVM locality:
    3 = L1, 2 = L2), as qwc's decode GEMV does; with `streams` > 1 each task reads that many
    rows in lockstep: far apart (rows p, ROWS/streams + p, ...), as the GEMV reads row groups,
    or `adjacent` (rows streams p, streams p + 1, ...)."""
    from tvm.script import tirx as T

    per = ROWS // streams

    def row(p, h):
        return p * streams + h if adjacent else h * per + p

    @T.prim_func
    def read(a: T.Buffer((ROWS, COLS), "int32"), s: T.Buffer((ROWS, 16), "int32")):
        T.func_attr({"tir.noalias": True})
        for p in T.parallel(per):
            acc = T.decl_buffer((streams * 16,), "int32", scope="global")
            for h in T.unroll(streams):
                acc[T.ramp(h * 16, 1, 16)] = T.broadcast(0, 16)
            for j in range(COLS // 64):
                for h in T.unroll(streams):
                    for u in T.unroll(4):   # one prefetch per 64-byte line
                        T.evaluate(T.call_llvm_intrin("void", "llvm.prefetch.p0", T.address_of(
                            a[row(p, h), j * 64 + ahead + u * 16]), T.int32(0), T.int32(locality), T.int32(1)))
                    for u in T.unroll(4):
                        acc[T.ramp(h * 16, 1, 16)] = acc[T.ramp(h * 16, 1, 16)] + a[row(p, h), T.ramp(j * 64 + u * 16, 1, 16)]
            for h in T.unroll(streams):
                s[row(p, h), T.ramp(0, 1, 16)] = acc[T.ramp(h * 16, 1, 16)]

    return read


# (ints ahead, locality, streams, adjacent) of the prefetching readers: which is fastest depends
# on what else the shared machine's memory is doing; four streams a thread beat one, and four
# adjacent rows beat four far apart in huge pages (docs/history/x86-speed.md).
READERS = ((384, 3, 1, False), (2048, 2, 1, False), (4096, 2, 1, False), (256, 3, 2, False), (128, 3, 4, False),
           (256, 3, 4, False), (2048, 2, 4, False), (128, 3, 4, True), (256, 3, 4, True))


def read_bandwidth(reps: int = 3) -> float:
    """GB/s of a parallel streaming read of 512 MiB in huge pages, built with TVM: the best of a
    plain sum and the prefetching READERS, `reps` one-second runs each. The best, and huge pages
    as decode's weights have them, because a low reading would flatter the kernels held to it."""
    import tvm
    from tvm import te

    from qwc.compiler.schedule import schedule_func

    a = te.placeholder((ROWS, COLS), "int32", name="a")
    r = te.reduce_axis((0, COLS), "r")
    s = te.compute((ROWS,), lambda i: te.sum(a[i, r], axis=r), name="s")
    target = tvm.target.Target({"kind": "llvm", "mcpu": tvm.get_global_func("target.llvm_get_system_cpu")()})
    x, = huge_page_tensors([np.ones((ROWS, COLS), np.int32)])
    best = 0.0
    for f, out in [(schedule_func(te.create_prim_func([a, s])), (ROWS,))] + [
            (_prefetching_reader(*r), (ROWS, 16)) for r in READERS]:
        lib = tvm.compile(f, target=target)
        y = tvm.runtime.tensor(np.zeros(out, np.int32))
        dt = min(time_call(lambda lib=lib, y=y: lib(x, y), 1.0) for _ in range(reps))
        best = max(best, ROWS * COLS * 4 / dt / 1e9)
    return best


# parameters a decode step gathers one row of (read_per_step): the rotary tables always, the
# embedding where it is not also the lm_head
ROW_TABLES = ("rotary_cos_cache", "rotary_sin_cache")
EMBEDDING = "model_embed_tokens_"


def read_per_step(manifest) -> int:
    """The parameter bytes a decode step reads: all of them less the tables it takes one row
    of (ROW_TABLES; an untied model's embedding), which counted whole overstate the share."""
    untied = not manifest.model.tie_word_embeddings
    return sum(p.memory_bytes for p in manifest.params
               if p.name not in ROW_TABLES and not (untied and p.name.startswith(EMBEDDING)))


def decode_window(eng, prompt, steps: int) -> float:
    """tok/s of `steps` decode steps of engine `eng` after a fresh `prompt` (and one step more,
    untimed)."""
    eng.reset()
    eng.prefill(prompt)
    eng.decode(1)
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.decode(1)
    return steps / (time.perf_counter() - t0)


def decode_step(artifact, threads, past=512, steps=64, windows=3):
    """(tok/s of each window, weight bytes, KV bytes) of `windows` runs of `steps` decode steps,
    each after a fresh `past`-token prompt (so each reads the same bytes)."""
    from qwc.runtime.engine import Engine

    eng = Engine(artifact, ctx=past + steps + 8, threads=threads)
    prompt = list(np.random.default_rng(0).integers(0, 1000, past))
    rates = [decode_window(eng, prompt, steps) for _ in range(windows)]
    weights = read_per_step(eng.manifest)   # in memory, as decode reads them
    kv = eng.kv_bytes_per_token * (past + steps // 2)   # the artifact's cache type
    return rates, weights, kv


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--act-bits", type=int, default=8, choices=(8, 32))
    p.add_argument("--decode", metavar="ARTIFACT", help="also measure this artifact's whole decode step")
    p.add_argument("--runs", type=int, default=3, help="decode runs, each between two bandwidth readings (default 3)")
    args = p.parse_args()
    if args.runs < 1:
        p.error("--runs must be at least 1")
    os.environ.setdefault("TVM_NUM_THREADS", str(args.threads))
    bw = read_bandwidth()
    print(f"read bandwidth ({args.threads} threads): {bw:.1f} GB/s")
    print(f"{'shape':14s} {'N':>7s} {'K':>5s} {'MiB':>6s} | {'qwc hot':>8s} {'ort4 hot':>8s} | "
          f"{'qwc cold':>8s} {'%bw':>4s} {'ort4 cold':>9s} {'ort0 cold':>9s} {'qwc/ort4':>8s} | "
          f"{'qwc strm':>8s} {'%bw':>4s}  (GB/s)")
    for name, outputs, k, silu in SHAPES:
        n = sum(outputs)
        g = gemv_graph(n, k)
        wb = weight_bytes(n, k)
        q, o4, o0 = qwc_gemv(g, args.act_bits), ort_gemv(g, args.threads, 4), ort_gemv(g, args.threads, 0)
        qh, o4h = wb / time_call(q) / 1e9, wb / time_call(o4) / 1e9
        qc, o4c, o0c = (wb / time_cold(f) / 1e9 for f in (q, o4, o0))
        st = qwc_stream(outputs, k, silu) if args.act_bits == 8 else None
        strm = f"{st:8.1f} {100 * st / bw:3.0f}%" if st else f"{'-':>8s} {'-':>4s}"
        print(f"{name:14s} {n:7d} {k:5d} {wb / 2**20:6.1f} | {qh:8.1f} {o4h:8.1f} | "
              f"{qc:8.1f} {100 * qc / bw:3.0f}% {o4c:9.1f} {o0c:9.1f} {qc / o4c:8.2f} | {strm}")
        sys.stdout.flush()
    if args.decode:
        print()
        shares, mean_shares = [], []
        for run in range(1, args.runs + 1):
            rates, wb, kv = decode_step(args.decode, args.threads)
            after = read_bandwidth()
            held = max(bw, after)   # the higher reading of the two next to the run: the stricter reference
            tps, mean = max(rates), float(np.mean(rates))
            gbs = tps * (wb + kv) / 1e9
            shares.append(100 * gbs / held)
            mean_shares.append(100 * mean * (wb + kv) / 1e9 / held)
            print(f"decode run {run} of {args.decode}: {tps:.1f} tok/s after 512 tokens (best of "
                  f"{', '.join(f'{r:.1f}' for r in rates)}), {wb / 1e6:.0f} MB weights + {kv / 1e6:.1f} MB K/V a "
                  f"token = {gbs:.1f} GB/s; read bandwidth {bw:.1f} before, {after:.1f} after: "
                  f"{shares[-1]:.0f}% of {held:.1f} (weights alone {100 * tps * wb / 1e9 / held:.0f}%; "
                  f"the windows' mean {mean_shares[-1]:.0f}%)")
            sys.stdout.flush()
            bw = after
        print(f"decode step: median {np.median(shares):.0f}% of the read bandwidth over {args.runs} runs "
              f"({', '.join(f'{x:.0f}%' for x in shares)}); with each run's mean window instead of its best: "
              f"median {np.median(mean_shares):.0f}% ({', '.join(f'{x:.0f}%' for x in mean_shares)})")


if __name__ == "__main__":
    main()
