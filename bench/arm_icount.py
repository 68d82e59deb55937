"""qwc against llama.cpp on ARM, in guest instructions per token under qemu (one thread, the
same QEMU CPU and the same counting plugin): the deterministic proxy for ARM work where
emulated wall time means nothing.

    .venv/bin/python bench/arm_icount.py model.qwc [--peer [--peer-builds repack,kleidiai,kleidiai-omp]] [--attribution]
        [--mca] [--json F]

Per token = difference of two runs divided by the difference in tokens, so start-up cancels:
- decode: a 4-token prompt with 2 and with 6 decode steps; with --depth N also with N
  positions before it (decode_dN: attention over N cached tokens, in the artifact's cache type
  against llama.cpp's default f16 cache). Neither engine emulates the N-token prefill (its
  instructions cancel in the difference of the two runs, and emulating it took ~45 min for
  qwc, over an hour for llama-bench): qwc's runner counts N positions of its cache as filled
  and prefills the 4 tokens (scripts/arm64/run_engine.py "fill"); llama.cpp's
  llama-completion loads the state (its f16 cache) the native x86 build saved after the same
  N + 4 tokens (`--prompt-cache`), replays the last one and decodes (--parallel runs each
  metric's two runs at once);
- prefill: prompts of 4 and 12 tokens (the protocol the project's ARM issue states), and of 24
  and 48 (steady state: longer prompts amortise per-call costs in both engines); with
  --long N also prefill_N, tokens N / 2 + 1 .. N of an N-token prompt (where attention over
  the earlier tokens counts): the first N / 2 filled as for decode at depth, then prompts of 1
  and of N / 2 more tokens (llama.cpp: its saved state of N / 2 tokens, then the rest of
  prompts of N / 2 + 1 and N tokens).

--peer adds llama.cpp's rows: llama-bench cross-built for the Yitian's ISA, in three builds
(--peer-builds): `repack` (bench/llamacpp.sh arm64: static, armv9-a+sve2+i8mm+dotprod, Q4_0
repack on), `kleidiai` (arm64-kleidiai: the same with Arm's KleidiAI kernels, whose source
KLEIDIAI_SRC names, built by clang on ggml's own pool) and `kleidiai-omp` (the same kernels
built by GCC with OpenMP), and a last row against the strongest of them per metric; run on GGUFs
written from the same random weights as the artifact's preset (every linear Q4_0; the tied
embedding/output Q4_0, as qwc's default, and Q8_0, as llama.cpp's own quantizer keeps it).
The artifact must be compiled from that preset (`qwc export qwen2.5-0.5b`); its shapes are
checked against it. With --checkpoint DIR (a checkpoint bench/make_checkpoint.py wrote, as
bench/scale.py keeps them: the 1.5B or 7B shapes) the peer reads that checkpoint's weights
instead, every matrix Q4_0, and the artifact must be compiled from it. With --gguf FILE the peer
runs FILE itself, and the artifact must be compiled from `qwc export FILE` (which keeps its Q4_0,
Q4_1 or Q8_0 weights as they are): the weight formats' comparison (bench/formats.py writes one
GGUF per format).

--attribution splits each engine's decode and prefill tokens over functions (the plugin's
per-block counts mapped to ELF symbols), with instructions per multiply-add for the matrix
kernels. --mca adds llvm-mca's Neoverse-N2 estimate (Debian's llvm-19, 5-wide dispatch: bench/n2_model.py) of cycles per
iteration of each matrix kernel's hottest loop, and per multiply-add (the loop's sdot x 16 +
smmla x 32): a throughput proxy the counts do not see (both engines' loops are bound by N2's
two vector pipes, where instructions are not all one cycle).
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
from qwc.bench import emulation
from qwc.bench.llamacpp import VERSION
from qwc.bench.llamacpp import tools as peer_tools

CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "qwc" / "bench"
PRESET = "qwen2.5-0.5b"
DECODE = (4, 2, 6)                     # prompt, steps a, steps b
PREFILL = {"prefill": (4, 12), "prefill_steady": (24, 48)}
# One emulated run at most: llama-bench's prefill of a 4,100-token prompt (--depth 4096) under
# the counting plugin took more than an hour (2026-11-27), and was cut at the hour it had.
RUN_TIMEOUT = 4 * 3600
# llama.cpp's matrix kernels on this build (4x8 repack: dotprod GEMV, i8mm GEMM) and the
# quantizer of its activations; the Q8_0 output runs through the generic vec-dot
MATRIX_RE = re.compile(r"(q[458]_gemv|q[458]_gemm|q6_k_matmul|ggml_gemv_|ggml_gemm_|vec_dot_q\d_|kai_run_matmul)")
# llama.cpp's aarch64 builds (bench/llamacpp.sh): the Q4_0 repack's (GCC, OpenMP), and KleidiAI's
# kernels on ggml's own pool (clang) or on OpenMP (GCC)
PEER_BUILDS = {"repack": "arm64", "kleidiai": "arm64-kleidiai", "kleidiai-omp": "arm64-kleidiai-omp"}


# --- running under the plugin -------------------------------------------------------------

def plugin(name: str = "icount") -> str:
    """The path of bench/icount's plugin `name` (icount, phases), built once."""
    out = subprocess.run(["bash", str(REPO / "bench" / "icount" / "build.sh")], check=True,
                         capture_output=True, text=True).stdout.strip().splitlines()[-1]
    return f"{out}/libqwc_{name}.so"


def run_qwc(env, plug, artifact, steps, out: Path) -> int:
    """Guest instructions of one Engine run; per-block counts to out.counts, maps to out.maps."""
    env = dict(env, QWC_DUMP_MAPS=str(out.with_suffix(".maps")))
    cmd = emulation.engine_command(env, artifact, out.with_suffix(".npy"), json.dumps(steps),
                                   plugin=f"{plug},out={out.with_suffix('.counts')}")
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT)
    if r.returncode != 0 or "qwc-icount:" not in r.stderr:
        sys.exit(f"arm_icount: the emulated qwc run failed: {r.stderr.strip().splitlines()[-1:]}")
    return block_total(out)


def _emulated_llama(env, plug, tool, gguf, args, out: Path) -> str:
    """Run llama.cpp's `tool` on `gguf` under the counting plugin, one thread (counts to
    out.counts); its stderr."""
    cmd = ["qemu-aarch64", "-cpu", env["QEMU_CPU"], "-plugin", f"{plug},out={out.with_suffix('.counts')}",
           "-d", "plugin", tool, "-m", str(gguf), *args, "--no-warmup", "-t", "1"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT)
    if r.returncode != 0 or "qwc-icount:" not in r.stderr:
        sys.exit(f"arm_icount: the emulated {Path(tool).name} run failed: "
                 f"{(r.stderr or r.stdout).strip().splitlines()[-1:]}")
    return r.stderr


def run_llama(env, plug, bench, gguf, args, out: Path) -> int:
    _emulated_llama(env, plug, bench, gguf, [*args, "-r", "1"], out)
    return block_total(out)


def prompt_file(tokens: int, work: Path) -> Path:
    """A prompt of `tokens` characters, a prefix of every longer one (tokens, in the preset's
    byte-level vocabulary: llama_session checks)."""
    path = work / f"prompt-{tokens}.txt"
    path.write_text(("the " * (tokens // 4 + 1))[:tokens])
    return path


def completion_args(prompt: Path, steps: int, ctx: int) -> list[str]:
    """llama-completion's settings where it saves a state and where it loads one: the same
    context, flash attention on (the saved V cache's layout depends on it), greedy, no chat."""
    return ["-f", str(prompt), "-n", str(steps), "-c", str(ctx), "-fa", "on", "-no-cnv", "--temp", "0"]


def llama_session(x86_tools: Path, gguf: Path, tokens: int, ctx: int, work: Path) -> tuple[Path, Path]:
    """(prompt file, session file): a prompt of `tokens` tokens (characters: the preset's GGUF
    has a byte-level vocabulary; checked) and llama.cpp's saved state after it (its KV cache,
    f16, flash attention on), made by the native x86 build in seconds where the emulated one
    takes hours. The state is the cache's bytes, the same on both ISAs: the emulated
    llama-completion loads it instead of prefilling."""
    prompt, session = prompt_file(tokens, work), work / f"session-{gguf.stem}-{tokens}.bin"
    if not session.is_file():
        cmd = [str(x86_tools / f"llama-completion-{VERSION}"), "-m", str(gguf), *completion_args(prompt, 1, ctx),
               "--no-warmup", "-t", str(len(os.sched_getaffinity(0))), "--verbose-prompt", "--prompt-cache", str(session)]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT)
        if r.returncode != 0 or not session.is_file():
            sys.exit(f"arm_icount: llama-completion could not save a session: {r.stderr.strip().splitlines()[-1:]}")
        got = re.search(r"number of tokens in prompt = (\d+)", r.stderr)
        if not got or int(got.group(1)) != tokens:
            sys.exit(f"arm_icount: {gguf.name} reads the {tokens}-character prompt as "
                     f"{got.group(1) if got else 'an unknown number of'} tokens (a byte-level vocabulary is assumed)")
    return prompt, session


def run_llama_from_session(env, plug, completion, gguf, prompt: Path, session: Path, tokens: int, ctx: int,
                           steps: int, out: Path, prompt_tokens: int | None = None) -> int:
    """Guest instructions of llama-completion loading `session` (a `tokens`-token prompt's
    state) and generating `steps` tokens greedily, one thread: after replaying the session's
    last token where `prompt` is that prompt, else (`prompt_tokens` of which the session holds
    the first `tokens`) after prefilling the rest of it."""
    log = _emulated_llama(env, plug, completion, gguf, [*completion_args(prompt, steps, ctx), "--ignore-eos",
                                                        "--prompt-cache", str(session), "--prompt-cache-ro"], out)
    loaded = re.search(r"loaded a session with prompt size of (\d+) tokens", log)
    took = ("exact match for prompt" if prompt_tokens in (None, tokens)
            else f"session file matches {tokens} / {prompt_tokens} tokens of prompt")
    if not loaded or int(loaded.group(1)) != tokens or took not in log:
        sys.exit(f"arm_icount: llama-completion did not take the {tokens}-token session whole")
    return block_total(out)


def block_total(out: Path) -> int:
    """All instructions of a run, as the sum of the plugin's per-block counts: the figure the
    per-function tables split (the plugin's own total is taken a moment earlier)."""
    return sum(int(line.split()[1]) for line in out.with_suffix(".counts").read_text().splitlines())


# --- attribution ------------------------------------------------------------------------------

def _symbols(elf: str):
    out = subprocess.run(["aarch64-linux-gnu-nm", "-S", "--defined-only", elf], capture_output=True,
                         text=True, check=True).stdout
    syms = sorted((int(f[0], 16), int(f[1], 16), f[3]) for f in (line.split() for line in out.splitlines())
                  if len(f) == 4 and f[2] in "tTwW")
    return syms


def _segments(elf: str):
    out = subprocess.run(["aarch64-linux-gnu-readelf", "-lW", elf], capture_output=True, text=True, check=True).stdout
    return [(int(f[1], 16), int(f[2], 16), int(f[4], 16)) for f in (line.split() for line in out.splitlines())
            if f and f[0] == "LOAD"]


def parallel_bodies(lib: str) -> list[tuple[int, int, str]]:
    """TVM's parallel loop bodies in an artifact's lib.so: unnamed functions, which LLVM may
    place together after every named one. Each kernel hands its body's address to
    TVMBackendParallelLaunch (adrp + add): the body is named after the kernel, as
    "KERNEL (parallel body)", so its instructions count as that kernel's."""
    out = subprocess.run(["aarch64-linux-gnu-objdump", "-d", "--no-show-raw-insn", lib], capture_output=True,
                         text=True, check=True).stdout
    syms = _symbols(lib)
    covered = [(a, a + n) for a, n, _ in syms if n]
    text = next((v, v + sz) for _, v, sz in _segments(lib) if v <= covered[0][0] < v + sz)
    bodies: dict[int, str] = {}
    func, pages = None, {}
    for line in out.splitlines():
        head = re.match(r"^[0-9a-f]+ <([^>+]+)>:$", line)
        if head:
            func, pages = head.group(1), {}
            continue
        if not func or not (func.startswith("__tvm_ffi_") or func.endswith("_compute_")):
            continue
        m = re.match(r"^[ \t]*[0-9a-f]+:[ \t]+adrp[ \t]+(x\d+), ([0-9a-f]+)", line)
        if m:
            pages[m.group(1)] = int(m.group(2), 16)
            continue
        m = re.match(r"^[ \t]*[0-9a-f]+:[ \t]+add[ \t]+x\d+, (x\d+), #(0x[0-9a-f]+)$", line)
        if m and m.group(1) in pages:
            target = pages[m.group(1)] + int(m.group(2), 16)
            if text[0] <= target < text[1] and not any(lo <= target < hi for lo, hi in covered):
                bodies.setdefault(target, func)
    return [(a, 0, f"{name} (parallel body)") for a, name in bodies.items()]


class Attributor:
    """Per-function instruction counts of one ELF (the artifact's lib.so, or the static
    llama-bench), everything else grouped per mapped file."""

    def __init__(self, elf: str, static: bool):
        self.elf, self.static = elf, static
        self.syms = _symbols(elf) if static else sorted(_symbols(elf) + parallel_bodies(elf))
        self.starts = [s[0] for s in self.syms]
        self.segs = _segments(elf)

    def _name(self, vaddr: int) -> str:
        """The symbol at or before vaddr (unnamed code after a symbol is its own: TVM's
        parallel lambdas follow their kernel)."""
        i = bisect.bisect_right(self.starts, vaddr) - 1
        return self.syms[i][2] if i >= 0 else "?"

    def functions(self, counts: Path) -> tuple[dict[str, int], dict[int, int]]:
        """({function or file: instructions}, {ELF address of a block start: instructions})."""
        maps = []
        if not self.static:
            for line in counts.with_suffix(".maps").read_text().splitlines():
                f = line.split()
                lo, hi = (int(x, 16) for x in f[0].split("-"))
                maps.append((lo, hi, int(f[2], 16), f[5] if len(f) > 5 else "[anon]"))
        maps.sort()
        lows, elf = [m[0] for m in maps], str(Path(self.elf).resolve())
        per: dict[str, int] = defaultdict(int)
        blocks: dict[int, int] = defaultdict(int)
        for line in counts.read_text().splitlines():
            a, n = line.split()
            va, n = int(a, 16), int(n)
            if self.static:
                per[self._name(va)] += n
                blocks[va] += n
                continue
            j = bisect.bisect_right(lows, va) - 1
            if j < 0 or va >= maps[j][1]:
                per["runtime: [unmapped]"] += n
                continue
            lo, hi, off, name = maps[j]
            if name == elf:
                foff = va - lo + off
                ev = next((foff - o + v for o, v, sz in self.segs if o <= foff < o + sz), None)
                per[self._name(ev) if ev is not None else "?"] += n
                if ev is not None:
                    blocks[ev] += n
            else:
                per["runtime: " + Path(name).name] += n
        return per, blocks

    def hottest_loop(self, func: str, blocks: dict[int, int]) -> list[str] | None:
        """The instructions of the loop around func's most executed block in `blocks` (the
        innermost backward branch that spans it), as llvm-mca input."""
        i = next((i for i, s in enumerate(self.syms) if s[2] == func), None)
        if i is None:
            return None
        # up to the next symbol: TVM's parallel lambdas are unnamed code after their kernel
        lo = self.syms[i][0]
        hi = next((s[0] for s in self.syms[i + 1:] if s[0] > lo), lo + max(self.syms[i][1], 4))
        inside = {a: n for a, n in blocks.items() if lo <= a < hi}
        if not inside:
            return None
        hot = max(inside, key=inside.get)
        asm = subprocess.run(["aarch64-linux-gnu-objdump", "-d", "--no-show-raw-insn", f"--start-address={lo}",
                              f"--stop-address={hi}", self.elf], capture_output=True, text=True, check=True).stdout
        insts = []
        for line in asm.splitlines():
            m = re.match(r"\s+([0-9a-f]+):\s+(\S.*)$", line)
            if m:
                insts.append((int(m.group(1), 16), m.group(2).split("//")[0].strip()))
        best = None
        for addr, text in insts:
            m = re.match(r"(b\.\w+|b|cbn?z|tbn?z)\s+.*?([0-9a-f]+) <", text)
            if m and addr >= hot and int(m.group(2), 16) <= hot:
                start = int(m.group(2), 16)
                if best is None or addr - start < best[1] - best[0]:
                    best = (start, addr)
        if best is None:
            return None
        return [re.sub(r"\s+<[^>]*>", "", t).replace("\t", " ") for a, t in insts if best[0] <= a <= best[1]]


def mca(loop: list[str]) -> tuple[float, int, int] | None:
    """(cycles, instructions, multiply-adds) per iteration of a loop body on Neoverse-N2
    (bench/n2_model.py's llvm-mca call); the multiply-adds from its dot instructions (sdot 16,
    smmla 32)."""
    from qwc.bench.n2_model import mca_cycles

    cycles = mca_cycles(loop)
    macs = sum(16 if t.startswith("sdot") else 32 if t.startswith("smmla") else 0 for t in loop)
    return (cycles, len(loop), macs) if cycles is not None else None


# --- model shapes -----------------------------------------------------------------------------

def linear_macs(cfg) -> dict[tuple[int, int], int]:
    """(N, K) -> multiply-adds per token of every linear of that shape (the lm_head listed
    separately under key 'head': prefill computes it for the last token only)."""
    h, kv = cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim
    shapes = defaultdict(int)
    for n, k in ((h, h), (kv, h), (kv, h), (h, h), (cfg.intermediate_size, h), (cfg.intermediate_size, h),
                 (h, cfg.intermediate_size)):
        shapes[n, k] += cfg.num_hidden_layers * n * k
    return dict(shapes)


def qwc_kernel_macs(name: str, shapes, head_macs: tuple[int, int, int], decode: bool) -> int | None:
    m = re.search(r"q[48]_(?:gemv|gemm)\w*?_(\d+)x(\d+)_", name)
    if not m:
        return None
    n, k = int(m.group(1)), int(m.group(2)) * 32
    total = sum(v for (sn, sk), v in shapes.items() if sn == n and abs(sk - k) < 32)
    if (n, k) == (head_macs[0], head_macs[1]):
        total += head_macs[2] if decode else 0
    return total or None


# --- main -----------------------------------------------------------------------------------

def arm_manifest(art: Path, tool: str) -> dict:
    """The manifest of an aarch64 artifact, or the tool's one-line exit."""
    try:
        manifest = json.loads((art / "manifest.json").read_text())
    except (OSError, ValueError) as e:
        sys.exit(f"{tool}: {art} is not a qwc artifact ({getattr(e, 'strerror', None) or e})")
    target = manifest.get("target", {})
    if target.get("arch") != "aarch64":
        sys.exit(f"{tool}: {art} is built for {target.get('name')!r}, not an aarch64 target")
    return manifest


def measure(label, run, prefill=PREFILL, decode=None, parallel=False):
    """{metric: instructions per token} and the per-function splits, for one engine; the
    splits also keep, under "blocks", each metric's block counts (its hot loops). `decode`:
    {metric: (prompt, steps a, steps b, filled positions)} (default: "decode", DECODE).
    `parallel`: a metric's two runs at once (the counts do not depend on timing)."""
    from concurrent.futures import ThreadPoolExecutor

    res, splits = {}, {"blocks": {}}
    plans = {m: (p, a, b, fill, True) for m, (p, a, b, fill) in (decode or {"decode": (*DECODE, 0)}).items()}
    plans.update({m: (0, v[0], v[1], v[2] if len(v) > 2 else 0, False) for m, v in prefill.items()})
    for metric, (p, x, y, fill, steps) in plans.items():
        runs = [(f"{metric}_{ab}", p if steps else n, n if steps else 0, fill) for ab, n in (("a", x), ("b", y))]
        with ThreadPoolExecutor(2 if parallel else 1) as pool:
            cx, cy = pool.map(lambda r: run(*r), runs)
        res[metric] = (cy[0] - cx[0]) / (y - x)
        splits[metric] = {k: (cy[1].get(k, 0) - cx[1].get(k, 0)) / (y - x) for k in set(cx[1]) | set(cy[1])}
        splits["blocks"][metric] = cy[2]
    print(f"  {label}: " + ", ".join(f"{k} {v:,.0f}" for k, v in res.items()), file=sys.stderr)
    return res, splits


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("artifact")
    p.add_argument("--peer", action="store_true", help="llama.cpp's rows beside qwc's (builds it once, ~20 min)")
    p.add_argument("--attribution", action="store_true", help="per-function tables")
    p.add_argument("--mca", action="store_true", help="llvm-mca Neoverse-N2 cycles of each matrix kernel's hottest loop")
    p.add_argument("--json", help="write every figure here")
    p.add_argument("--checkpoint", type=Path, help="the HF checkpoint the artifact was compiled from (not the preset)")
    p.add_argument("--gguf", type=Path, help="the GGUF the artifact was exported from (`qwc export FILE`, its weights "
                                            "kept as given: bench/formats.py writes one per format): llama.cpp runs it")
    p.add_argument("--long", type=int, default=0,
                   help="also prefill_N: the second half of an N-token prompt, after its first half (a long prompt's "
                        "attention; N = 2048: tens of minutes)")
    p.add_argument("--depth", type=int, default=0,
                   help="also decode_dN: decode steps after N cached positions (attention over them; "
                        "N = 4096: minutes; llama.cpp's state is made by its native x86 build)")
    p.add_argument("--only-depth", action="store_true",
                   help="with --depth: only decode_dN, not the short decode and prefill metrics")
    p.add_argument("--parallel", action="store_true",
                   help="each metric's two runs at once, on two cores (the counts do not change)")
    p.add_argument("--peer-builds", default="repack,kleidiai,kleidiai-omp",
                   help="llama.cpp's aarch64 builds to count (bench/llamacpp.sh arm64, arm64-kleidiai, "
                        "arm64-kleidiai-omp; KleidiAI's source: KLEIDIAI_SRC); the strongest per metric is the peer")
    p.add_argument("--only-q4-output", action="store_true",
                   help="llama.cpp with the Q4_0 output only (qwc's default), not also the Q8_0 one")
    args = p.parse_args()
    if not set(args.peer_builds.split(",")) <= set(PEER_BUILDS):
        p.error(f"--peer-builds {args.peer_builds!r}: a comma-separated list of {', '.join(PEER_BUILDS)}")
    if args.long and args.long < 2:
        p.error("--long must be at least 2")
    if args.depth < 0:
        p.error("--depth must be at least 0")
    if args.only_depth and not args.depth:
        p.error("--only-depth needs --depth")
    if args.mca and (args.depth or args.long) and args.peer:
        p.error("--mca reads llama-bench's loops, and --depth / --long run llama-completion: run them apart")
    # --long N: tokens N / 2 + 1 .. N of an N-token prompt, after the first N / 2 (filled, as
    # decode at depth is): a prompt of 1 token and one of N / 2 after them
    prefill = {**PREFILL, **({f"prefill_{args.long}": (1, args.long // 2, args.long // 2)} if args.long else {})}
    decode = {"decode": (*DECODE, 0), **({f"decode_d{args.depth}": (*DECODE, args.depth)} if args.depth else {})}
    if args.only_depth:
        prefill, decode = {}, {f"decode_d{args.depth}": decode[f"decode_d{args.depth}"]}

    art = Path(args.artifact)
    manifest = arm_manifest(art, "arm_icount")
    plug = plugin()
    env = emulation.arm64_env(single_thread=True)
    env["PYTHONHASHSEED"] = "0"   # hash randomisation moved the count a token between runs
    # numpy's OpenBLAS threads would spin while the plugin writes its counts: time-dependent
    env["OPENBLAS_NUM_THREADS"] = env["OMP_NUM_THREADS"] = "1"
    work = Path(tempfile.mkdtemp(prefix="qwc-icount-"))
    lib = str((art / "lib.so").resolve())
    qwc_attr = Attributor(lib, static=False)
    rows, splits, attributors = {}, {}, {"qwc": qwc_attr}

    def qwc_run(tag, prompt, steps, fill=0):
        out = work / f"qwc_{tag}"
        run = [list(range(100, 100 + prompt))] + [5] * steps
        n = run_qwc(env, plug, str(art), {"steps": run, "fill": fill} if fill else run, out)
        return (n, *qwc_attr.functions(out.with_suffix(".counts")))

    print("counting qwc ...", file=sys.stderr)
    rows["qwc"], splits["qwc"] = measure("qwc", qwc_run, prefill, decode, args.parallel)

    if args.peer:
        count_peers(args, env, plug, work, manifest, prefill, decode, (rows, splits, attributors))

    report = {"artifact": str(art), "per_token": rows}
    print_main(rows)
    if args.attribution or args.mca:
        report["attribution"] = attribution_tables(manifest, rows, splits, attributors, args.mca)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    shutil.rmtree(work, ignore_errors=True)


def count_peers(args, env, plug, work: Path, manifest, prefill, decode, tables) -> None:
    """llama.cpp's rows, one per build of --peer-builds and per output format, into `tables`
    (rows, splits, attributors)."""
    rows, splits, attributors = tables
    x86_tools = peer_tools("x86") if args.depth or args.long else None
    ggufs = ({"file": args.gguf} if args.gguf else checkpoint_gguf(manifest, args.checkpoint) if args.checkpoint
             else peer_ggufs(manifest))
    for build in args.peer_builds.split(","):
        tools = peer_tools(PEER_BUILDS[build])
        bench, completion = str(tools / f"llama-bench-{VERSION}"), str(tools / f"llama-completion-{VERSION}")
        l_attr, c_attr = Attributor(bench, static=True), Attributor(completion, static=True)
        for head, gguf in ggufs.items():
            if args.only_q4_output and head != "Q4_0":
                continue
            name = f"llama.cpp {build} ({head} output)" if head != "file" else f"llama.cpp {build} ({args.gguf.name})"
            attributors[name] = l_attr

            def l_run(tag, prompt, steps, fill=0, gguf=gguf, head=head, build=build, bench=bench,
                      completion=completion, c_attr=c_attr, l_attr=l_attr):
                out = work / f"llama_{build}_{head}_{tag}"
                if fill and steps:   # decode at depth: from a saved state (llama_session), as qwc's runner fills
                    tokens = fill + prompt
                    ctx = tokens + DECODE[2] + 64
                    text, session = llama_session(x86_tools, gguf, tokens, ctx, work)
                    n = run_llama_from_session(env, plug, completion, gguf, text, session, tokens, ctx, steps, out)
                    return (n, *c_attr.functions(out.with_suffix(".counts")))
                if fill:   # prefill at depth: the state of `fill` tokens, then `prompt` more
                    ctx = fill + prompt + 64
                    _, session = llama_session(x86_tools, gguf, fill, ctx, work)
                    n = run_llama_from_session(env, plug, completion, gguf, prompt_file(fill + prompt, work), session,
                                               fill, ctx, 1, out, fill + prompt)
                    return (n, *c_attr.functions(out.with_suffix(".counts")))
                a = (["-p", "0", "-n", "0", "-pg", f"{fill + prompt},{steps}"] if steps
                     else ["-p", str(prompt), "-n", "0"])
                n = run_llama(env, plug, bench, gguf, a, out)
                return (n, *l_attr.functions(out.with_suffix(".counts")))

            print(f"counting {name} ...", file=sys.stderr)
            rows[name], splits[name] = measure(name, l_run, prefill, decode, args.parallel)


def peer_ggufs(manifest) -> dict[str, Path]:
    """The preset's weights as llama.cpp GGUFs, Q4_0 and Q8_0 output, written once (cached)."""
    from qwc.bench.gguf_q4_0 import write_gguf_q4_0
    from qwc.models.presets import load_preset

    out = {"Q4_0": CACHE / f"{PRESET}-q4_0.gguf", "Q8_0": CACHE / f"{PRESET}-q4_0-q8out.gguf"}
    lm = None
    for head, path in out.items():
        if not path.is_file():
            CACHE.mkdir(parents=True, exist_ok=True)
            lm = lm or load_preset(PRESET)
            cfg = manifest.get("model", {})
            if cfg and (cfg.get("hidden_size"), cfg.get("num_hidden_layers")) != (
                    lm.config.hidden_size, lm.config.num_hidden_layers):
                sys.exit(f"arm_icount: the artifact is not the {PRESET} preset's shape; --peer compares the same weights")
            tmp = path.with_suffix(".partial")
            write_gguf_q4_0(lm, tmp, head_bits=4 if head == "Q4_0" else 8)
            tmp.rename(path)
    return out


def checkpoint_gguf(manifest, ckpt: Path) -> dict[str, Path]:
    """The checkpoint's weights as a Q4_0 GGUF (Q4_0 output, qwc's default), written once."""
    from qwc.bench.gguf_q4_0 import write_gguf_q4_0_checkpoint
    from qwc.models.hf import open_hf_dir

    c = open_hf_dir(ckpt)
    cfg = manifest.get("model", {})
    if (cfg.get("hidden_size"), cfg.get("num_hidden_layers")) != (c.config.hidden_size, c.config.num_hidden_layers):
        sys.exit(f"arm_icount: the artifact is not {ckpt}'s shape; --peer compares the same weights")
    path = ckpt.parent / f"{ckpt.name}.q4_0.gguf"   # the name bench/scale.py gives it
    if not path.is_file():
        write_gguf_q4_0_checkpoint(c, path.with_suffix(".partial"))
        path.with_suffix(".partial").rename(path)
    return {"Q4_0": path}


def print_main(rows):
    q = rows["qwc"]
    metrics = list(q)
    print("\n| engine | " + " | ".join(f"{m}, instructions/token" for m in metrics) + " |")
    print("| --- |" + " ---: |" * len(metrics))
    for name, r in rows.items():
        print(f"| {name} | " + " | ".join(f"{r[m]:,.0f}" for m in metrics) + " |")
    for name, r in rows.items():
        if name != "qwc":
            print(f"| qwc / {name} | " + " | ".join(f"{q[m] / r[m]:.3f}x" for m in metrics) + " |")
    peers = [r for name, r in rows.items() if name != "qwc"]
    if len(peers) > 1:   # the peer of every ARM criterion: the fewest instructions per metric
        print("| qwc / the stronger llama.cpp | " + " | ".join(f"{q[m] / min(r[m] for r in peers):.3f}x"
                                                            for m in metrics) + " |")


def attribution_tables(manifest, rows, splits, attributors, with_mca: bool):
    from qwc.config import ModelConfig

    cfg = ModelConfig(**{k: v for k, v in manifest["model"].items() if k in ModelConfig.__dataclass_fields__})
    shapes = linear_macs(cfg)
    head = (cfg.vocab_size, cfg.hidden_size, cfg.vocab_size * cfg.hidden_size)
    total_macs = {"decode": sum(shapes.values()) + head[2], "prefill": sum(shapes.values()),
                  "prefill_steady": sum(shapes.values())}
    out = {}
    # decode, decode at depth (--depth) and the steady prefill, those that were measured
    for metric in [m for m in rows["qwc"] if m.startswith("decode") or m == "prefill_steady"]:
        decode = metric.startswith("decode")
        total_macs.setdefault(metric, total_macs["decode"])
        print(f"\n### {metric}: per function (instructions per token; per multiply-add for matrix kernels)\n")
        print("| engine | function | instructions/token | share | instr/MAC | hot loop: instr / MACs / "
              "N2 cycles (mca) | N2 cycles/MAC |")
        print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
        for name, split in splits.items():
            total = rows[name][metric]
            items = sorted(split[metric].items(), key=lambda kv: -kv[1])
            shown, table = 0, []
            for fn, n in items:
                if n < 0.004 * total:
                    break
                shown += n
                macs = None
                if name == "qwc":
                    macs = qwc_kernel_macs(fn, shapes, head, decode)
                elif "ggml_gem" in fn or "kai_run_matmul" in fn:   # every linear; the output too where it is Q4_0 (decode)
                    macs = total_macs[metric] - (head[2] if decode and "Q8_0" in name else 0)
                cyc = None
                if with_mca and MATRIX_RE.search(fn):
                    loop = attributors[name].hottest_loop(fn, split["blocks"][metric])
                    cyc = mca(loop) if loop else None
                per_mac = cyc[0] / cyc[2] if cyc and cyc[2] else None
                table.append({"function": fn, "per_token": n, "per_mac": n / macs if macs else None,
                              "loop": {"instructions": cyc[1], "macs": cyc[2], "n2_cycles": cyc[0]} if cyc else None,
                              "n2_cycles_per_mac": per_mac})
                print(f"| {name} | {fn} | {n:,.0f} | {100 * n / total:.1f}% | "
                      f"{'' if not macs else f'{n / macs:.3f}'} | "
                      f"{'' if not cyc else f'{cyc[1]} / {cyc[2]} / {cyc[0]:.1f}'} | "
                      f"{'' if not per_mac else f'{per_mac:.4f}'} |")
            print(f"| {name} | (the rest) | {total - shown:,.0f} | {100 * (total - shown) / total:.1f}% | | | |")
            out.setdefault(metric, {})[name] = table
    return out


if __name__ == "__main__":
    main()
