"""The many-thread critical path of a decode step and of a prefill on ARM, qwc against
llama.cpp, in guest instructions under qemu (which runs each guest thread as a vCPU of its
own, so counts per vCPU are counts per thread, whatever the host's 2 cores do).

    .venv/bin/python bench/arm_threads.py model.qwc [--threads 1,8,32,64,128]
        [--engines qwc,llama.cpp] [--peer-builds repack,kleidiai-omp] [--only decode|prefill|mixed]
        [--gguf FILE] [--json F] [--plot F.png]

Per token, at each thread count T (figures of waiting left out, see below):
- work: every thread's instructions;
- critical path: per parallel launch the busiest thread's instructions, summed, plus the
  serial work between launches (which every other thread waits for);
- launches: parallel launches (qwc) / barriers (llama.cpp) per token, each a fork-join that
  costs time no instruction count shows (the N2 model below charges it);
- serial: instructions while one thread works and the others wait;
- efficiency: work / (T x critical path): 1 when every thread is busy all the time.
Per token = the difference of two runs over their difference in tokens, so start-up cancels:
decode a 4-token prompt with 2 and 6 steps; prefill a PREFILL-token prompt once and twice (each
from an empty cache: llama-bench -r 1 and -r 2), so the difference is exactly one prefill
call, its launches included. qwc's runner keeps only the last logits (run_engine.py's
"last"), as llama-bench keeps none: stacking every step's logits is the harness's work.

How threads and launches are seen (bench/icount/phases.c):
- qwc (TVM's pool): a launch begins where the main thread enters TVMBackendParallelLaunch
  (a global epoch: every thread's counts go to the launch in progress) and ends where it
  is back in the kernel that called it (the `*_compute_` functions of lib.so, or the exported
  `__tvm_ffi_*` kernels where LLVM inlined those: their parallel
  bodies are unnamed code after them). A thread's work in a launch is its instructions in
  lib.so; the pool's own code (queues, waking and waiting) is left out. The main thread's
  instructions outside launches (the VM, serial kernels, the Engine's Python) are serial.
  The pool's spin count is 0 (TVM_THREAD_POOL_SPIN_COUNT, Engine(oversubscribe=True)), so
  idle workers sleep instead of spinning for the host's cores; no count depends on it.
- llama.cpp (OpenMP, one parallel region per graph): every thread's own epoch advances at
  each GOMP_barrier (ggml_barrier's body) and at the start of its part of a region, and
  every thread passes the same barriers in the same order. Waiting is left out by symbol:
  GOMP_*/gomp_* (barriers, futexes, the region's fork), ggml_barrier, sched_yield. Its
  matrix kernels hand out row chunks dynamically (ggml_threadpool_chunk_add), which under
  emulation follows the host's scheduler, not the work: their instructions are spread
  evenly over the T threads in each epoch (the best a dynamic schedule can do: a lower
  bound on llama.cpp's critical path, so a win against it is not an artefact); everything
  else counts as each thread ran it. OMP_WAIT_POLICY=passive.

`--only mixed` (qwc; an artifact of --max-batch >= 8): a server's step with a prompt chunk
to run while 7 sequences decode, as one Engine.step call ("mixed") and as decode_batch then
prefill ("separate"); per step = the difference of runs of MIXED[2] and MIXED[1] such steps,
over their difference (scripts/arm64/run_engine.py: mixed_and_separate).

llama.cpp's rows come from its aarch64 builds (--peer-builds: bench/llamacpp.sh arm64, with the
Q4_0 repack and OpenMP, and arm64-kleidiai-omp, with Arm's KleidiAI kernels and OpenMP, by
default; arm64-kleidiai, the same kernels on ggml's own thread pool, on request: its spinning
workers keep a 128-thread run from finishing under emulation, and at 64 threads its critical
path is longer than the OpenMP build's, docs/history/arm.md) on a GGUF of the same preset's
weights, every linear and the output Q4_0 (as qwc's default); -t T. In the pool build a thread's epoch advances at
ggml_barrier, at each copy of it clang inlined into ggml_graph_compute_thread, and at that
function's entry; the inlined copies' spin loops and the idle workers' polling are waiting. --plot F.png also writes F-n2.png, the model of Neoverse-N2 time
(bench/n2_model.py) whose table follows the measured one.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
from qwc.bench import (
    emulation,
    n2_model,
)
from qwc.bench.arm_icount import (
    CACHE,
    MATRIX_RE,
    PEER_BUILDS,
    Attributor,
    _segments,
    _symbols,
    arm_manifest,
    peer_tools,
    plugin,
)
from qwc.bench.llamacpp import VERSION

THREADS = (1, 8, 32, 64, 128)
DECODE = (4, 2, 6)          # prompt, steps a, steps b
PREFILL = 48                # prompt tokens of the prefill call
MIXED = (32, 1, 3)          # chunk tokens, steps a, steps b (7 decoding sequences beside the chunk)
SHAPE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_key_value_heads", "head_dim")
RECORD = np.dtype([("vcpu", "<u4"), ("epoch", "<u4"), ("phase", "<u4"), ("pad", "<u4"),
                   ("vaddr", "<u8"), ("count", "<u8")])
# ggml's own pool (no OpenMP): its workers poll for the next graph in
# ggml_graph_compute_secondary_thread, and sleep on a condition variable
LLAMA_WAIT = re.compile(r"^(GOMP_|gomp_|ggml_barrier|sched_yield|__sched_yield|futex|__futex|__lll_|"
                        r"pthread_cond|__pthread_cond|___pthread_cond|syscall|__GI___|nanosleep|__nanosleep|"
                        r"clock_nanosleep|ggml_graph_compute_secondary_thread)")
# llama.cpp's chunked matrix kernels (dynamic over threads; KleidiAI's too: kleidiai.cpp hands
# out column chunks with ggml_threadpool_chunk_add)
LLAMA_DYNAMIC = re.compile(r"(ggml_gemv_|ggml_gemm_|vec_dot_|forward_mul_mat_one_chunk|mul_mat_one_chunk|kai_run_matmul)")
METRICS = ("work", "critical", "launches", "serial", "waiting")


def file_offset(elf: str, vaddr: int) -> int:
    seg = next((s for s in _segments(elf) if s[1] <= vaddr < s[1] + s[2]), None)
    if seg is None:
        sys.exit(f"arm_threads: {vaddr:#x} is in no loaded segment of {elf}")
    return vaddr - seg[1] + seg[0]


def _dynamic_symbol(elf: str, name: str) -> int:
    out = subprocess.run(["aarch64-linux-gnu-nm", "-D", "--defined-only", elf], capture_output=True,
                         text=True, check=True).stdout
    for line in out.splitlines():
        f = line.split()
        if len(f) == 3 and f[2] == name:
            return int(f[0], 16)
    sys.exit(f"arm_threads: {elf} does not define {name}")


# --- qwc ----------------------------------------------------------------------------------------

def qwc_marks(lib: str, env: dict) -> list[str]:
    """A launch at TVMBackendParallelLaunch's entry; a return in every function that calls it:
    the `*_compute_` functions, and the exported `__tvm_ffi_*` kernels, into which LLVM may
    inline them (it did once the module had a verify entry point: no `*_compute_` symbol was
    left but the VM's, and every launch would have run on to the next)."""
    runtime = Path(env["QWC_ARM64_SITE"]) / "tvm" / "lib" / "libtvm_runtime.so"
    entry = file_offset(str(runtime), _dynamic_symbol(str(runtime), "TVMBackendParallelLaunch"))
    marks = [f"launch:{runtime.name}:{entry:#x}"]
    for start, size, name in _symbols(lib):
        if (name.endswith("_compute_") or name.startswith("__tvm_ffi_")) and size:
            lo = file_offset(lib, start)
            marks.append(f"return:{Path(lib).name}:{lo:#x}-{lo + size:#x}")
    return marks


def run_qwc(env, plug, marks, artifact, steps, threads, out: Path) -> np.ndarray:
    env = dict(env, TVM_NUM_THREADS=str(threads), QWC_DUMP_MAPS=str(out.with_suffix(".maps")))
    spec = ",".join([f"{plug}", f"out={out.with_suffix('.rec')}"] + [f"mark={m}" for m in marks])
    cmd = emulation.engine_command(env, artifact, out.with_suffix(".npy"), json.dumps(steps), plugin=spec)
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=6 * 3600)
    if r.returncode != 0 or "qwc-icount:" not in r.stderr:
        sys.exit(f"arm_threads: the emulated qwc run failed: {r.stderr.strip().splitlines()[-3:]}")
    used = int(r.stdout.split()[2])
    if used != threads:
        sys.exit(f"arm_threads: qwc ran its kernels on {used} threads, not {threads}")
    return np.fromfile(out.with_suffix(".rec"), RECORD)


def qwc_figures(rec: np.ndarray, lib: str, maps: Path, threads: int) -> dict:
    """Per run: work, critical path, launches, serial and left-out instructions."""
    lib = str(Path(lib).resolve())
    spans = [tuple(int(x, 16) for x in line.split()[0].split("-")) for line in maps.read_text().splitlines()
             if line.split()[-1] == lib]
    in_lib = np.zeros(len(rec), bool)
    for lo, hi in spans:
        in_lib |= (rec["vaddr"] >= lo) & (rec["vaddr"] < hi)
    main = rec["vcpu"] == 0
    parallel = in_lib & (~main | (rec["phase"] == 1))
    serial = main & (rec["phase"] == 0)
    return _combine(rec, parallel, np.zeros(len(rec), bool), serial, threads,
                    launches=int(rec["epoch"].max()))


def elf_blocks(rec: np.ndarray, elf: str, maps: Path | None) -> dict[int, int]:
    """{ELF address of a block start: instructions, every thread} for the blocks of `elf` (a
    shared library placed by `maps`, or, without maps, a static executable)."""
    vaddr, count = rec["vaddr"], rec["count"].astype(np.int64)
    if maps is not None:
        path = str(Path(elf).resolve())
        lines = [line.split() for line in maps.read_text().splitlines()]
        spans = [(*(int(x, 16) for x in f[0].split("-")), int(f[2], 16)) for f in lines if f[-1] == path]
        segs = _segments(elf)
        out: dict[int, int] = {}
        for lo, hi, off in spans:
            m = (vaddr >= lo) & (vaddr < hi)
            for va, n in zip(vaddr[m], count[m]):
                foff = int(va) - lo + off
                ev = next((foff - o + v for o, v, sz in segs if o <= foff < o + sz), None)
                if ev is not None:
                    out[ev] = out.get(ev, 0) + int(n)
        return out
    keys, inv = np.unique(vaddr, return_inverse=True)
    return dict(zip(map(int, keys), map(int, np.bincount(inv, weights=count))))


def hot_loop_cpi(attributor: Attributor, blocks: dict[int, int]) -> float | None:
    """N2 cycles per instruction of the hottest loop of the busiest matrix kernel."""
    per: dict[str, int] = {}
    for a, n in blocks.items():
        name = attributor._name(a)
        if MATRIX_RE.search(name):
            per[name] = per.get(name, 0) + n
    if not per:
        return None
    return n2_model.mca_cpi(attributor.hottest_loop(max(per, key=per.get), blocks))


# --- llama.cpp ------------------------------------------------------------------------------------

def llama_marks(bench: str) -> list[str]:
    """Where each llama.cpp thread's epoch advances: OpenMP's barrier and the start of a
    thread's part of the graph's parallel region; or, in a build on ggml's own pool (no OpenMP:
    the KleidiAI build), ggml_barrier's entry, each copy of it inlined in
    ggml_graph_compute_thread (the block that enters it) and that function's entry."""
    syms = {name: start for start, _, name in _symbols(bench)}
    name = Path(bench).name
    if "GOMP_barrier" in syms:
        return [f"barrier:{name}:{file_offset(bench, syms[s]):#x}" for s in ("GOMP_barrier", "ggml_graph_compute._omp_fn.0")]
    starts = [syms["ggml_barrier"], syms["ggml_graph_compute_thread"]] + [b for b, _ in inlined_barriers(bench)]
    return [f"barrier:{name}:{file_offset(bench, a):#x}" for a in starts]


def inlined_barriers(bench: str) -> list[tuple[int, tuple[int, int]]]:
    """ggml_barrier's copies inlined in ggml_graph_compute_thread (ggml's own pool), as (the
    start of the block that enters it, [start, end) of its spin-wait loop). Its shape: an
    `ldaddal` on the arrival count, `cmp`, and a `b.ne` to a loop that ends in `yield; b`."""
    start, size = next((a, n) for a, n, name in _symbols(bench) if name == "ggml_graph_compute_thread")
    out = subprocess.run(["aarch64-linux-gnu-objdump", "-d", "--no-show-raw-insn", f"--start-address={start:#x}",
                          f"--stop-address={start + size:#x}", bench], capture_output=True, text=True, check=True).stdout
    found = barrier_sites(out)
    if not found:
        sys.exit(f"arm_threads: no inlined ggml_barrier found in {bench}'s ggml_graph_compute_thread")
    return found


def barrier_sites(disassembly: str) -> list[tuple[int, tuple[int, int]]]:
    """inlined_barriers' search, in objdump's text of one function."""
    insns = [(int(m.group(1), 16), m.group(2), m.group(3)) for m in
             re.finditer(r"^[ \t]*([0-9a-f]+):[ \t]+(\S+)[ \t]*(.*)$", disassembly, re.M)]
    branch = re.compile(r"^(b|b\..*|bl|blr|br|ret|cbn?z|tbn?z)$")
    found = []
    for i, (_, op, _) in enumerate(insns):
        if op != "ldaddal" or i + 2 >= len(insns) or insns[i + 1][1] != "cmp" or insns[i + 2][1] != "b.ne":
            continue
        j = i
        while j > 0 and not branch.match(insns[j - 1][1]):
            j -= 1
        spin = int(insns[i + 2][2].split()[0], 16)
        k = next((k for k, ins in enumerate(insns) if ins[0] == spin), None)
        loop = [] if k is None else [n for n in range(k, min(k + 8, len(insns) - 1)) if insns[n][1] == "yield"]
        if loop:   # the spin: from the b.ne's target to the `b` back after its `yield`
            found.append((insns[j][0], (spin, insns[loop[0] + 1][0] + 4)))
    return found


def run_llama(env, plug, marks, bench, gguf, args, threads, out: Path) -> np.ndarray:
    """llama-bench under the phases plugin; `args` its test and repetitions (-r)."""
    spec = ",".join([plug, f"out={out.with_suffix('.rec')}"] + [f"mark={m}" for m in marks])
    cmd = ["qemu-aarch64", "-cpu", env["QEMU_CPU"], "-plugin", spec, "-d", "plugin", bench, "-m", str(gguf),
           *args, "--no-warmup", "-t", str(threads)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=6 * 3600,
                       env=dict(os.environ, OMP_WAIT_POLICY="passive"))
    if r.returncode != 0 or "qwc-icount:" not in r.stderr:
        sys.exit(f"arm_threads: the emulated llama-bench run failed: {(r.stderr or r.stdout).strip().splitlines()[-3:]}")
    return np.fromfile(out.with_suffix(".rec"), RECORD)


def llama_runner(build: str, env, plug, gguf: Path):
    """run(kind, n, threads, out) for llama.cpp's aarch64 `build` (bench/llamacpp.sh)."""
    bench = str(peer_tools(build) / f"llama-bench-{VERSION}")
    classes, lmarks, lattr = SymbolClasses(bench), llama_marks(bench), Attributor(bench, static=True)
    # ggml's own pool: idle workers sleep between graphs instead of polling (the OpenMP build's
    # OMP_WAIT_POLICY=passive); polling is waiting either way, left out of every figure, but
    # under emulation it takes the host's cores from the threads that work
    poll = [] if "GOMP_barrier" in {name for _, _, name in _symbols(bench)} else ["--poll", "0"]

    def llama_run(kind, n, t, out):
        a = poll + (["-p", "0", "-n", "0", "-pg", f"{DECODE[0]},{n}", "-r", "1"] if kind == "decode"
                    else ["-p", str(PREFILL), "-n", "0", "-r", str(n)])
        rec = run_llama(env, plug, lmarks, bench, gguf, a, t, out)
        return llama_figures(rec, classes, t), lambda: hot_loop_cpi(lattr, elf_blocks(rec, bench, None))

    return llama_run


class SymbolClasses:
    """Each block address of a static binary as waiting / dynamic-chunk kernel / other. In a
    build on ggml's own pool, the spin loops of the barriers inlined in
    ggml_graph_compute_thread are waiting too (pseudo-symbols over their address ranges)."""

    def __init__(self, elf: str):
        syms = _symbols(elf)
        if not any(name == "GOMP_barrier" for _, _, name in syms):
            for _, (lo, hi) in inlined_barriers(elf):
                syms += [(lo, hi - lo, "ggml_barrier.inlined_spin"), (hi, 0, "ggml_graph_compute_thread")]
            syms.sort()
        self.starts = np.array([s[0] for s in syms], np.uint64)
        self.names = [s[2] for s in syms]
        self.wait = np.array([bool(LLAMA_WAIT.match(n)) for n in self.names])
        self.dynamic = np.array([bool(LLAMA_DYNAMIC.search(n)) for n in self.names])

    def classify(self, vaddr: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        i = np.searchsorted(self.starts, vaddr, side="right") - 1
        i = np.clip(i, 0, len(self.names) - 1)
        return self.wait[i], self.dynamic[i]


def llama_figures(rec: np.ndarray, classes: SymbolClasses, threads: int) -> dict:
    wait, dynamic = classes.classify(rec["vaddr"])
    work = ~wait
    return _combine(rec, work & ~dynamic, work & dynamic, None, threads,
                    launches=int(rec["epoch"][rec["vcpu"] == 0].max()), lone_is_serial=True)


# --- the arithmetic both share -------------------------------------------------------------------

def _per_epoch(rec, mask, reduce: str) -> np.ndarray:
    """Per epoch: the largest per-thread sum ("max") or the sum over threads ("sum")."""
    n = int(rec["epoch"].max()) + 1
    e, v, c = rec["epoch"][mask].astype(np.int64), rec["vcpu"][mask].astype(np.int64), rec["count"][mask].astype(np.float64)
    if reduce == "sum":
        return np.bincount(e, weights=c, minlength=n)
    keys, inv = np.unique(e * 8192 + v, return_inverse=True)
    sums = np.bincount(inv, weights=c)
    out = np.zeros(n)
    np.maximum.at(out, keys // 8192, sums)
    return out


def _combine(rec, static, dynamic, serial, threads: int, launches: int, lone_is_serial: bool = False) -> dict:
    """static: each thread's work as it ran; dynamic: work a dynamic schedule spreads evenly
    over the threads of its epoch; serial (qwc): the main thread's work between launches.
    With lone_is_serial (llama.cpp), an epoch where one thread did at least half the work is
    serial too: a node of one task (the others only pass through it), the graph's set-up."""
    counts = rec["count"].astype(np.float64)
    if serial is None:
        serial = np.zeros(len(rec), bool)
    busiest_static = _per_epoch(rec, static, "max")
    busiest = busiest_static + _per_epoch(rec, dynamic, "sum") / threads
    total = _per_epoch(rec, static | dynamic, "sum")
    lone = (busiest_static >= 0.5 * total) & (total > 0) if lone_is_serial and threads > 1 else np.zeros(len(total), bool)
    return {"work": float(counts[static | dynamic | serial].sum()),
            "critical": float(busiest.sum() + counts[serial].sum()),
            "launches": launches,
            "serial": float(counts[serial].sum() + busiest_static[lone].sum()),
            "waiting": float(counts[~(static | dynamic | serial)].sum())}


def per_token(a: dict, b: dict, tokens: int) -> dict:
    return {m: (b[m] - a[m]) / tokens for m in METRICS}


# --- main -------------------------------------------------------------------------------------------

def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("artifact")
    p.add_argument("--threads", default=",".join(map(str, THREADS)), help="thread counts (default 1,8,32,64,128)")
    p.add_argument("--engines", default="qwc,llama.cpp", help="qwc, llama.cpp or both (default)")
    p.add_argument("--peer-builds", default="repack,kleidiai-omp",
                   help="llama.cpp's aarch64 builds (bench/llamacpp.sh arm64, arm64-kleidiai-omp, arm64-kleidiai; "
                        "KleidiAI's source: KLEIDIAI_SRC); qwc's ratio is to the stronger at each row")
    p.add_argument("--only", choices=("decode", "prefill", "mixed"),
                   help="one of the two measurements, or (qwc) mixed steps against separate calls")
    p.add_argument("--gguf", type=Path, help="the peer runs this GGUF (the artifact compiled from `qwc export FILE`: "
                                              "a llama-quantize K-quant mix, say) instead of the preset's Q4_0 one")
    p.add_argument("--json", help="write every figure here")
    p.add_argument("--plot", help="efficiency against threads, as a PNG")
    args = p.parse_args()

    art = Path(args.artifact)
    manifest = arm_manifest(art, "arm_threads")
    try:
        threads = [int(t) for t in args.threads.split(",")]
    except ValueError:
        sys.exit(f"arm_threads: --threads {args.threads!r}: a comma-separated list of integers")
    if any(not 1 <= t <= 1024 for t in threads):
        sys.exit("arm_threads: --threads: each count from 1 to 1024")
    if not set(args.peer_builds.split(",")) <= set(PEER_BUILDS):
        sys.exit(f"arm_threads: --peer-builds {args.peer_builds!r}: a comma-separated list of {', '.join(PEER_BUILDS)}")

    if args.only == "mixed" and ("step" not in manifest.get("functions", {}).get("entry_points", {})
                                 or manifest["functions"].get("max_batch", 1) < 8):
        sys.exit(f"arm_threads: --only mixed needs an artifact compiled with --max-batch 8 or more ({art} is not)")
    plug = plugin("phases")
    env = emulation.arm64_env()
    env.update(PYTHONHASHSEED="0", OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    work = Path(tempfile.mkdtemp(prefix="qwc-threads-"))
    lib = str((art / "lib.so").resolve())
    marks = qwc_marks(lib, env)
    kinds = {"mixed": ["mixed", "separate"], None: ["decode", "prefill"]}.get(args.only, [args.only])
    engines = args.engines.split(",") if args.only != "mixed" else ["qwc"]
    if not engines or set(engines) - {"qwc", "llama.cpp"}:
        sys.exit(f"arm_threads: --engines {args.engines!r}: qwc, llama.cpp or both")
    runners, inputs = {}, {}
    if "qwc" in engines:
        attr = Attributor(lib, static=False)

        def qwc_run(kind, n, t, out):
            """decode: n steps after a 4-token prompt; prefill: the prompt n times; mixed and
            separate: n chunks of a prompt beside 7 decoding sequences."""
            ids = list(range(100, 100 + (DECODE[0] if kind == "decode" else PREFILL)))
            # only the last logits kept (run_engine.py: "last"): the harness's copies are not qwc's
            if kind in ("mixed", "separate"):
                steps = {"mixed": [[100 + i, 7, 8, 9] for i in range(7)] + [list(range(200, 200 + MIXED[0] * n))],
                         "chunk": MIXED[0], "mode": kind, "last": True}
            elif kind == "decode":
                steps = {"steps": [ids] + [5] * n, "last": True}
            else:
                steps = {"prefill": ids, "repeat": n, "last": True}
            rec = run_qwc(env, plug, marks, str(art), steps, t, out)
            maps = out.with_suffix(".maps")
            return qwc_figures(rec, lib, maps, t), lambda: hot_loop_cpi(attr, elf_blocks(rec, lib, maps))

        runners["qwc"] = qwc_run
        inputs["qwc"] = {"cpi": {}, "bytes": n2_model.qwc_decode_bytes(art)}
    if "llama.cpp" in engines:
        gguf = args.gguf or peer_gguf(manifest)
        for build in args.peer_builds.split(","):
            runners[f"llama.cpp {build}"] = llama_runner(PEER_BUILDS[build], env, plug, gguf)
            inputs[f"llama.cpp {build}"] = {"cpi": {}, "bytes": n2_model.gguf_decode_bytes(gguf)}

    rows: dict = {}
    for engine, run in runners.items():
        for t in threads:
            for kind in kinds:
                # decode: 2 and 6 steps; prefill: one call and two; mixed, separate: per step
                na, nb, tokens = {"decode": (DECODE[1], DECODE[2], DECODE[2] - DECODE[1]), "prefill": (1, 2, PREFILL)}.get(
                    kind, (MIXED[1], MIXED[2], MIXED[2] - MIXED[1]))
                out = work / f"{engine.replace('.', '').replace(' ', '_')}_{kind}_{t}"   # no dot: Path.with_suffix
                fa, _ = run(kind, na, t, out.with_name(out.name + "_a"))
                fb, cpi = run(kind, nb, t, out.with_name(out.name + "_b"))
                if kind not in inputs[engine]["cpi"]:
                    inputs[engine]["cpi"][kind] = cpi()
                rows[engine, kind, t] = per_token(fa, fb, tokens)
                print(f"  {engine} {kind} T={t}: " + _fmt(rows[engine, kind, t]), file=sys.stderr)
                for f in work.glob(f"{out.name}_*"):
                    f.unlink()

    if args.only == "mixed":   # per step, not per token; no peer and no N2 model
        print_mixed(rows, threads)
        if args.json:
            Path(args.json).write_text(json.dumps({"artifact": str(art), "rows": [
                {"engine": e, "kind": k, "threads": t, **v} for (e, k, t), v in rows.items()]}, indent=1))
        shutil.rmtree(work, ignore_errors=True)
        return
    print_table(rows, threads, kinds)
    predicted = n2_model.table(rows, inputs)
    n2_model.print_table(predicted, inputs)
    name = manifest.get("model", {}).get("name", art.name)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "artifact": str(art), "model": name, "inputs": inputs, "predicted_n2": predicted,
            # the shape, for bench/n2_table.py's scaling once the artifact is gone
            "config": {k: v for k, v in manifest.get("model", {}).items() if k in SHAPE_KEYS},
            "rows": [{"engine": e, "kind": k, "threads": t, **v} for (e, k, t), v in rows.items()]}, indent=1))
    if args.plot:
        plot(rows, threads, kinds, args.plot, name)
        n2_model.plot(predicted, str(Path(args.plot).with_name(Path(args.plot).stem + "-n2.png")), name)
    shutil.rmtree(work, ignore_errors=True)


def _fmt(r: dict) -> str:
    return ", ".join(f"{m} {r[m]:,.0f}" for m in METRICS)


def efficiency(r: dict, t: int) -> float:
    return r["work"] / (t * r["critical"]) if r["critical"] else float("nan")


def print_table(rows, threads, kinds):
    """One row per engine, step and T; qwc's holds its critical path over the stronger
    llama.cpp build's there (the peer of every ARM criterion)."""
    engines = list(dict.fromkeys(e for e, _, _ in rows))
    print("\n| engine | step | T | work / token | critical path / token | launches / token | serial / token "
          "| efficiency | critical path, qwc / the stronger llama.cpp |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for kind in kinds:
        for t in threads:
            peers = [(rows[e, kind, t]["critical"], e) for e in engines if e != "qwc" and (e, kind, t) in rows]
            for engine in engines:
                r = rows.get((engine, kind, t))
                if not r:
                    continue
                ratio = (f"{r['critical'] / min(peers)[0]:.3f}x ({min(peers)[1]})" if engine == "qwc" and peers
                         else "")
                print(f"| {engine} | {kind} | {t} | {r['work']:,.0f} | {r['critical']:,.0f} | {r['launches']:,.1f} | "
                      f"{r['serial']:,.0f} | {100 * efficiency(r, t):.1f}% | {ratio} |")


def print_mixed(rows, threads):
    print("\n| T | separate: critical path / step | mixed | mixed / separate | launches / step, separate "
          "| mixed | work / step, separate | mixed |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for t in threads:
        a, b = rows["qwc", "separate", t], rows["qwc", "mixed", t]
        print(f"| {t} | {a['critical']:,.0f} | {b['critical']:,.0f} | {b['critical'] / a['critical']:.3f}x | "
              f"{a['launches']:,.1f} | {b['launches']:,.1f} | {a['work']:,.0f} | {b['work']:,.0f} |")


def plot(rows, threads, kinds, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for (engine, kind) in sorted({(e, k) for e, k, _ in rows}):
        ts = [t for t in threads if (engine, kind, t) in rows]
        ax.plot(ts, [100 * efficiency(rows[engine, kind, t], t) for t in ts], marker="o",
                linestyle="-" if engine == "qwc" else "--", label=f"{engine} {kind}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(threads, [str(t) for t in threads])
    ax.set_ylim(0, 105)
    ax.set_xlabel("threads")
    ax.set_ylabel("parallel efficiency, %")
    ax.set_title(f"{title}: work / (T x critical path), under qemu")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def peer_gguf(manifest) -> Path:
    """The artifact's preset as a llama.cpp GGUF, every linear and the output Q4_0 (cached)."""
    from qwc.bench.gguf_q4_0 import write_gguf_q4_0
    from qwc.models.presets import PRESET_NAMES, load_preset

    name = manifest.get("model", {}).get("name")
    if name not in PRESET_NAMES:
        sys.exit(f"arm_threads: llama.cpp's rows compare the same weights, so the artifact must be a preset's; {name!r} is not")
    path = CACHE / f"{name}-q4_0.gguf"
    if not path.is_file():
        CACHE.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".partial")
        write_gguf_q4_0(load_preset(name), tmp, head_bits=4)
        tmp.rename(path)
    return path


if __name__ == "__main__":
    main()
