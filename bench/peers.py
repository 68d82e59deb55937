"""qwc against its peers on the Qwen2.5-0.5B shape (random weights: speed does not depend on
the values), same thread count, one run:

    .venv/bin/python bench/peers.py [--threads 2] [--json out.json] [--png out.png]

Systems (keys of --json): qwc (the host artifact, W4A8), ort_int4 (onnxruntime on the canonical
graph, MatMulNBits accuracy_level 4), ort_int4_acc0 (accuracy_level 0), ort_fp32 (onnxruntime
on the exported fp32 graph), torch_fp32 (transformers, the contest reports' baseline),
llamacpp_q4_0 (llama.cpp's llama-bench, Q4_0 with a 4-bit tied embedding, the strongest build on
this CPU: clang, -march=native, AMX where the CPU has it), llamacpp_q4_0_gcc (GCC 12 native
without AMX). The llama.cpp builds come from bench/llamacpp.sh (built on first use, ~20 min each,
cached); where the CPU has AMX the row checks in llama-bench's log that AMX really ran.

For each: prefill tok/s at 128 and 512 prompt tokens (the median of three prefills), decode
tok/s over 128 tokens after a 512-token prompt, peak RSS of the process. Every system runs in
its own process so RSS is its own. Artifacts are built once into --workdir (default
~/.cache/qwc/bench).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from qwc import cpu
from qwc.bench.artifacts import chain
from qwc.bench.llamacpp import VERSION, llama_bench
from qwc.bench.llamacpp import tools as llamacpp_tools

SYSTEMS = ["qwc", "ort_int4", "ort_int4_acc0", "ort_fp32", "torch_fp32", "llamacpp_q4_0", "llamacpp_q4_0_gcc"]
LLAMACPP_BUILDS = {"llamacpp_q4_0": "x86", "llamacpp_q4_0_gcc": "x86-gcc"}
PRESET = "qwen2.5-0.5b"
CTX = 640


def _tokens(n: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 4096, n)]


# --- preparing the models ----------------------------------------------------------------

def prepare(workdir: Path, max_batch: int = 1, kv_dtype: str | None = None) -> dict[str, Path]:
    """The model's files; the artifact with decode_batch for `max_batch` sequences if >= 2, its
    KV cache of `kv_dtype` ("f32" / "f16" / "q8_0"; None: qwc's default)."""
    name = "q" + (f"-b{max_batch}" if max_batch > 1 else "") + (f"-kv{kv_dtype}" if kv_dtype else "")
    # The artifact is what is measured: always rebuilt, so it has this checkout's kernels.
    options = ("--act-bits", "8", "--max-batch", str(max_batch)) + (("--kv-dtype", kv_dtype) if kv_dtype else ())
    paths = chain(PRESET, workdir, "q", compile_=options, artifact=name)
    paths["gguf"] = Path(workdir) / "q.q4_0.gguf"
    if not paths["gguf"].exists():
        from qwc.bench.gguf_q4_0 import write_gguf_q4_0
        from qwc.models.presets import load_preset

        write_gguf_q4_0(load_preset(PRESET), paths["gguf"])
    return paths


# --- one system per process ----------------------------------------------------------------

class Runner:
    """prefill(tokens) from an empty cache, then step(token) one token at a time."""

    def reset(self): ...
    def prefill(self, tokens): ...
    def step(self, token): ...


class QwcRunner(Runner):
    def __init__(self, paths, threads):
        os.environ.setdefault("TVM_USE_RUNTIME_LIB", "1")  # what `qwc run` loads: the runtime alone
        from qwc.runtime.engine import Engine

        self.eng = Engine(paths["qwc"], ctx=CTX, threads=threads)

    def reset(self):
        self.eng.reset()

    def prefill(self, tokens):
        return self.eng.prefill(tokens)

    def step(self, token):
        return self.eng.decode(token)


class OrtRunner(Runner):
    def __init__(self, path, threads, accuracy_level=None, buffer=True):
        import onnx
        import onnxruntime as ort

        from qwc.config import load_for_graph

        self.cfg = load_for_graph(path)
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.log_severity_level = 3
        if accuracy_level is not None:
            m = onnx.load(str(path))
            for n in m.graph.node:
                if n.op_type == "MatMulNBits":
                    n.attribute.append(onnx.helper.make_attribute("accuracy_level", accuracy_level))
            self.sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
        else:
            self.sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        self.buffer = buffer
        self.names = [o.name for o in self.sess.get_outputs()]
        self.reset()

    def reset(self):
        c = self.cfg
        length = CTX if self.buffer else 0
        self.kv = {f"past_key_values.{i}.{k}": np.zeros((1, c.num_key_value_heads, length, c.head_dim), np.float32)
                   for i in range(c.num_hidden_layers) for k in ("key", "value")}
        self.pos = 0

    def _run(self, ids):
        s = len(ids)
        feeds = {"input_ids": np.array([ids], np.int64), "attention_mask": np.ones((1, self.pos + s), np.int64),
                 "position_ids": np.arange(self.pos, self.pos + s, dtype=np.int64)[None], **self.kv}
        out = dict(zip(self.names, self.sess.run(None, feeds)))
        self.kv = {k.replace("present", "past_key_values"): v for k, v in out.items() if k.startswith("present")}
        self.pos += s
        return out["logits"][0, -1]

    def prefill(self, tokens):
        return self._run(tokens)

    def step(self, token):
        return self._run([token])


class TorchRunner(Runner):
    def __init__(self, threads):
        import torch

        from qwc.models.presets import load_preset

        torch.set_num_threads(threads)
        self.torch = torch
        self.model = load_preset(PRESET).model
        self.reset()

    def reset(self):
        from transformers.cache_utils import DynamicCache

        self.cache = DynamicCache(config=self.model.config)
        self.pos = 0

    def _run(self, ids):
        t = self.torch
        with t.no_grad():
            out = self.model(input_ids=t.tensor([ids]), past_key_values=self.cache, use_cache=True,
                             position_ids=t.arange(self.pos, self.pos + len(ids))[None], logits_to_keep=1)
        self.pos += len(ids)
        return out.logits[0, -1].numpy()

    def prefill(self, tokens):
        return self._run(tokens)

    def step(self, token):
        return self._run([token])


def measure_llama_bench(build: str, paths, threads: int, reps=3) -> dict:
    """llama.cpp's own llama-bench on the same GGUF: pp128 and pp512 from an empty cache, tg128
    after 512 tokens of context (-d 512), the median of `reps` runs each, as `measure` does."""
    bench = llamacpp_tools(build) / f"llama-bench-{VERSION}"
    out, log = {}, ""
    for args in (["-p", "128,512", "-n", "0"], ["-p", "0", "-n", "128", "-d", "512"]):
        rates, said = llama_bench(bench, paths["gguf"], threads, ["-v", *args], reps)
        log += said
        for test, tps in rates.items():   # pp128, pp512, "tg128 @ d512"
            out["decode" if test.startswith("tg") else "prefill_" + test[2:]] = tps
    # the worker's waited-for children are the llama-bench runs: their peak RSS
    out["rss_mib"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    out["amx"] = "AMX" in log
    if cpu.has("amx_int8") and build == "x86" and not out["amx"]:
        raise SystemExit("the clang build did not use AMX on this AMX CPU (no AMX buffer in llama-bench's log)")
    return out


def make_runner(system, paths, threads) -> Runner:
    if system == "qwc":
        return QwcRunner(paths, threads)
    if system == "ort_int4":
        return OrtRunner(paths["q4"], threads, accuracy_level=4)
    if system == "ort_int4_acc0":
        return OrtRunner(paths["q4"], threads, accuracy_level=0)
    if system == "ort_fp32":
        return OrtRunner(paths["onnx"], threads, buffer=False)
    if system == "torch_fp32":
        return TorchRunner(threads)
    raise ValueError(system)


def measure(system: str, paths, threads: int, prompts=(128, 512), decode=128, reps=3) -> dict:
    r = make_runner(system, paths, threads)
    r.prefill(_tokens(16, 9))          # warm-up: first-call initialisation is not speed
    r.reset()
    out = {}
    for p in prompts:   # the median of `reps` prefills: one 128-token prefill swung widely
        times = []
        for _ in range(reps):
            r.reset()
            t0 = time.perf_counter()
            r.prefill(_tokens(p, p))
            times.append(time.perf_counter() - t0)
        out[f"prefill_{p}"] = p / sorted(times)[len(times) // 2]
    r.reset()
    r.prefill(_tokens(512, 1))
    toks = _tokens(decode, 2)
    t0 = time.perf_counter()
    for t in toks:
        r.step(t)
    out["decode"] = decode / (time.perf_counter() - t0)
    out["rss_mib"] = peak_rss_mib()
    return out


def peak_rss_mib() -> float:
    """This process's peak RSS (VmHWM). Not getrusage: Linux carries ru_maxrss across exec,
    so a worker would report its parent's peak."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


# --- orchestration -------------------------------------------------------------------------

def run_all(args) -> dict:
    prepare(Path(args.workdir))
    results = {}
    for system in args.systems:
        print(f"[bench] {system} ...", file=sys.stderr, flush=True)
        env = dict(os.environ, TVM_NUM_THREADS=str(args.threads), OMP_NUM_THREADS=str(args.threads))
        r = subprocess.run([sys.executable, __file__, "--worker", system, "--threads", str(args.threads),
                            "--workdir", args.workdir], capture_output=True, text=True, env=env)
        if r.returncode == 0:
            results[system] = json.loads(r.stdout.strip().splitlines()[-1])
        else:
            lines = (r.stderr or r.stdout).strip().splitlines()
            results[system] = {"error": lines[-1] if lines else f"exit {r.returncode}"}
    return results


def table(results: dict) -> str:
    base = results.get("qwc", {})
    cols = ["prefill_128", "prefill_512", "decode", "rss_mib"]
    lines = [f"{'system':16s} {'pp128 tok/s':>12s} {'pp512 tok/s':>12s} {'tg128 tok/s':>12s} {'RSS MiB':>9s}"
             f"   {'qwc/pp512':>9s} {'qwc/tg':>7s}"]
    for name, r in results.items():
        if "error" in r:
            lines.append(f"{name:16s} not measured: {r['error']}")
            continue
        ratios = ""
        if "decode" in base and "error" not in base:
            ratios = f"   {base['prefill_512'] / r['prefill_512']:9.2f} {base['decode'] / r['decode']:7.2f}"
        lines.append(f"{name:16s} {r[cols[0]]:12.1f} {r[cols[1]]:12.1f} {r[cols[2]]:12.1f} {r[cols[3]]:9.0f}"
                     + ratios)
    return "\n".join(lines)


def plot(results: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n, r in results.items() if "error" not in r]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, key, title in zip(axes, ["prefill_512", "decode", "rss_mib"],
                              ["prefill, 512-token prompt (tok/s)", "decode after 512 (tok/s)", "peak RSS (MiB)"]):
        vals = [results[n][key] for n in names]
        ax.barh(names, vals, color=["tab:red" if n == "qwc" else "tab:gray" for n in names])
        ax.set_title(title)
        for i, v in enumerate(vals):
            ax.text(v, i, f" {v:.0f}", va="center")
    fig.suptitle("Qwen2.5-0.5B shape, random weights, same threads")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--workdir", default=str(Path.home() / ".cache" / "qwc" / "bench"))
    p.add_argument("--systems", nargs="+", default=SYSTEMS, choices=SYSTEMS)
    p.add_argument("--json", help="write the results as JSON")
    p.add_argument("--png", help="draw a bar chart")
    p.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        paths = {"onnx": Path(args.workdir) / "q.onnx", "q4": Path(args.workdir) / "q.q4.onnx",
                 "qwc": Path(args.workdir) / "q.qwc", "gguf": Path(args.workdir) / "q.q4_0.gguf"}
        if args.worker in LLAMACPP_BUILDS:
            print(json.dumps(measure_llama_bench(LLAMACPP_BUILDS[args.worker], paths, args.threads)))
        else:
            print(json.dumps(measure(args.worker, paths, args.threads)))
        return
    results = run_all(args)
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    if args.png:
        plot(results, args.png)


if __name__ == "__main__":
    main()
