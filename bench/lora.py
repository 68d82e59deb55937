"""Fine-tuning SmolLM2-135M on one Austen novel: LoRA, QA-LoRA and the 4-bit routes, in one table.

    .venv/bin/python bench/lora.py [--steps 200] [--rank 16] [--lr 4e-4] [--novel prideprejudice] [--rows a,b]

The novel is split by lines: the first nine tenths are the training text, the last tenth is held out and
scored (perplexity, ctx 512, every whole chunk). Rows, each through `qwc` commands:
  base            the GGUF's weights (Q4_1 dequantized), exported float, onnxruntime
  base-ptq        the base through qwc's best PTQ (`qwc optimize --awq --gptq --lm-head-bits 8`,
                  calibrated on Emma; the tied embedding at Q8_0, as the GGUF has it)
  lora            `qwc lora` (float LoRA on the base), merged by `qwc export --lora`, float graph
  lora-ptq        the same merged model through the best PTQ: the route QA-LoRA replaces
  qalora          `qwc lora --qa` on the GGUF's own Q4_1 blocks, merged by `qwc export --lora`:
                  every linear Q4_1 with the file's codes and scales
  qalora-qwc      the same optimized and compiled for this host (W4A8 kernels), scored by qwc's runtime
The GGUF's Q4_1 blocks are the best 4-bit base there is for this model (its own source, and
better than qwc's or llama.cpp's Q4_0 PTQ of it: docs/figures.md), so QA-LoRA starts from them.
Intermediate files are cached in ~/.cache/qwc/lora-bench; delete it to start over.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

QWC = [sys.executable, "-m", "qwc"]


def qwc(*args: str) -> str:
    t0 = time.perf_counter()
    r = subprocess.run([*QWC, *args], text=True, capture_output=True)
    if r.returncode != 0:
        sys.exit(f"lora bench: `qwc {' '.join(args)}` failed: {r.stderr.strip()[-600:]}")
    print(f"  qwc {' '.join(args)}  ({time.perf_counter() - t0:.0f}s)", file=sys.stderr, flush=True)
    return r.stdout


def made(path: Path, *args: str) -> Path:
    if not path.exists():
        qwc(*args)
    return path


def perplexity(model: Path, text: Path, work: Path) -> dict:
    out = work / f"ppl-{model.name}.json"   # keyed by what is scored: a changed route is scored anew
    if not out.exists():
        out.write_text(qwc("-q", "eval", str(model), "--ppl", str(text), "--ctx", "512", "--json"))
    return json.loads(out.read_text())["perplexity"]


def split(novel: str, work: Path) -> tuple[Path, Path]:
    from qwc.eval.data import novel as novel_path

    train, held = work / f"{novel}-train.txt", work / f"{novel}-heldout.txt"
    if not held.exists():
        lines = novel_path(novel).read_text(encoding="utf-8").splitlines(keepends=True)
        cut = int(len(lines) * 0.9)
        train.write_text("".join(lines[:cut]), encoding="utf-8")
        held.write_text("".join(lines[cut:]), encoding="utf-8")
    return train, held


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--lr", type=float, default=4e-4)
    ap.add_argument("--novel", default="prideprejudice")
    ap.add_argument("--rows", default="base,base-ptq,lora,lora-ptq,qalora,qalora-qwc")
    ap.add_argument("--work", type=Path, default=Path.home() / ".cache" / "qwc" / "lora-bench")
    a = ap.parse_args()
    from qwc.eval.data import smollm2_path

    src = str(smollm2_path())
    w = a.work
    w.mkdir(parents=True, exist_ok=True)
    train, held = split(a.novel, w)
    tag = f"{a.novel}-r{a.rank}-s{a.steps}-lr{a.lr:g}"
    opts = ["--data", str(train), "--rank", str(a.rank), "--steps", str(a.steps), "--lr", str(a.lr)]

    def base() -> Path:
        return made(w / "base.onnx", "-q", "export", src, "--exporter", "torch", "-o", str(w / "base.onnx"))

    def ptq(graph: Path, name: str) -> Path:   # the tied embedding at Q8_0, as the GGUF and llama.cpp keep it
        out = w / f"{name}.q4e8.onnx"
        return made(out, "-q", "optimize", str(graph), "--awq", "--gptq", "--lm-head-bits", "8", "-o", str(out))

    def compiled(graph: Path, name: str) -> Path:   # what is deployed: the passes, then the host's W4A8 kernels
        q4 = made(w / f"{name}.opt.onnx", "-q", "optimize", str(graph), "-o", str(w / f"{name}.opt.onnx"))
        return made(w / f"{name}.qwc", "-q", "compile", str(q4), "--act-bits", "8", "-o", str(w / f"{name}.qwc"))

    def lora_merged() -> Path:
        ad = made(w / f"lora-{tag}", "-q", "lora", src, *opts, "-o", str(w / f"lora-{tag}"))
        return made(w / f"lora-{tag}.onnx", "-q", "export", src, "--exporter", "torch", "--lora", str(ad),
                    "-o", str(w / f"lora-{tag}.onnx"))

    def qalora_merged() -> Path:
        ad = made(w / f"qalora-{tag}", "-q", "lora", src, "--qa", *opts, "-o", str(w / f"qalora-{tag}"))
        return made(w / f"qalora-{tag}.onnx", "-q", "export", src, "--lora", str(ad), "-o", str(w / f"qalora-{tag}.onnx"))

    rows = {
        "base": lambda: base(),
        "base-ptq": lambda: ptq(base(), "base"),
        "lora": lambda: lora_merged(),
        "lora-ptq": lambda: ptq(lora_merged(), f"lora-{tag}"),
        "qalora": lambda: qalora_merged(),
        "qalora-qwc": lambda: compiled(qalora_merged(), f"qalora-{tag}"),
    }
    what = {"base": "the GGUF's weights, float", "base-ptq": "base, `--awq --gptq --lm-head-bits 8` (Q4_0)",
            "lora": "LoRA merged, float", "lora-ptq": "LoRA merged, then `--awq --gptq --lm-head-bits 8` (Q4_0)",
            "qalora": "QA-LoRA merged: the file's Q4_1 codes and scales, moved minimums",
            "qalora-qwc": "the same through `qwc optimize` and `qwc compile --act-bits 8` (host), qwc's runtime"}
    results = {}
    for name in a.rows.split(","):
        results[name] = perplexity(rows[name](), held, w)
    print(f"\nSmolLM2-135M, trained on the first 90% of {a.novel} ({a.steps} steps, rank {a.rank}, lr {a.lr:g}), "
          "perplexity on the last 10% (ctx 512):\n")
    print("| row | model | perplexity | vs base |")
    print("| --- | --- | ---: | ---: |")
    b = results.get("base", {}).get("ppl")
    for name, p in results.items():
        rel = f"{100 * (p['ppl'] / b - 1):+.1f}%" if b else "-"
        print(f"| {name} | {what[name]} | {p['ppl']:.2f} ± {p['ppl_err']:.2f} | {rel} |")


if __name__ == "__main__":
    main()
