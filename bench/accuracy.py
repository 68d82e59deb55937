"""SmolLM2-135M on Jane Austen: float, llama.cpp's Q4_0, qwc's PTQ, AWQ, QAT, QAT with
distillation and depth pruning, in one table.

    .venv/bin/python bench/accuracy.py [--qat-steps 200] [--lr 5e-5] [--chunks 40] [--items 200] [--rows a,b]

Rows (every one through `qwc` commands or llama.cpp's own tools, so the table is what a user gets):
  float          the GGUF's weights dequantized (Q4_1 -> fp32), torch
  llamacpp-float the same GGUF scored by llama.cpp's `llama-perplexity` (the protocol check)
  llamacpp-q4_0  `llama-quantize --allow-requantize ... Q4_0` (its default output type), scored by
                 `llama-perplexity`; llamacpp-q4_0-q4out with the output / tied embedding at Q4_0
  llamacpp-q4_0-imatrix  the same with an importance matrix (`llama-imatrix` on the calibration
                 text qwc's calibrated rows use: Emma, 8 windows of 512 tokens), llama.cpp's strongest
                 PTQ for Q4_0; llamacpp-q4_0-imatrix-q4out with the output at Q4_0
  ptq            `qwc optimize` of the float export (Q4_0 linears and 4-bit embedding), onnxruntime
  ptq-emb8       the same with the embedding / tied lm_head at Q8_0 (`--lm-head-bits 8`)
  fold, fold-emb8  the same two with the norm gains folded into the weights first (`--fold-norm-gains`)
  awq, awq-emb8    the same two with activation-aware scales (`--awq`, calibrated on Emma)
  gptq, gptq-emb8, awq-gptq, awq-gptq-emb8  GPTQ (`--gptq`, the same calibration), alone and after AWQ
  bits8          `--bits 8 --lm-head-bits 8`: every matrix Q8_0
  llamacpp-q4_k_m  `llama-quantize ... Q4_K_M`; -imatrix with the importance matrix above; -imatrix-q8
                 the same with Q8_0 where Q4_K_M has Q6_K (qwc's mix until it wrote Q6_K)
  q4_k_m         `qwc optimize --format q4_k_m` (the same mix, Q6_K included, searched
                 block scales); -imatrix with `--imatrix calib` (computed on Emma, as --awq's);
                 -llama-imatrix with llama-imatrix's file, the one llama.cpp's rows use; -gptq
                 GPTQ in those formats (`--gptq`), awq-q4_k_m-gptq after AWQ's scales
  ft             control: float fine-tune on the training text and steps, scored in float (torch):
                 what fine-tuning on Austen gains by itself; ft+ptq the same, then PTQ
  qat            `qwc qat --quantize-embedding`, then `qwc optimize` (lossless), onnxruntime
  qat-kd         the same with `--teacher` (distillation from the float model)
  slebN          `qwc prune --remove N` (SLEB, calibrated on Emma; N = 2, 4, 6), scored in float;
                 slebN+ptq-emb8 the same through PTQ; slebN+qat-kd recovered by QAT with distillation
and, for the quantized rows, the compiled host artifact (`--act-bits 8`, the fast path) beside it.
Training text: Emma and Mansfield Park. Perplexity: Pride and Prejudice, llama.cpp's protocol
(first `--chunks` x 512 tokens). Multiple choice: `--items` next-sentence items from Persuasion,
PMI accuracy (not for llama.cpp's rows). Both scored texts are held out of training.
llama.cpp's tools are built by bench/llamacpp.sh x86 (cached). Intermediate files are cached
in ~/.cache/qwc/accuracy; delete it to start over.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from qwc.bench.kquant_error import q6_k_overrides
from qwc.bench.llamacpp import VERSION
from qwc.bench.llamacpp import tools as llamacpp_tools

QWC = [sys.executable, "-m", "qwc"]


def qwc(*args: str, capture: bool = False) -> str:
    # stdout is the table's: the commands' own reports are kept off it
    r = (subprocess.run([*QWC, *args], text=True, capture_output=True) if capture
         else subprocess.run([*QWC, *args], text=True, stdout=subprocess.DEVNULL))
    if r.returncode != 0:
        sys.exit(f"accuracy: `qwc {' '.join(args)}` failed" + (f": {r.stderr.strip()[-400:]}" if capture else ""))
    return r.stdout if capture else ""


def ensure(path: Path, *args: str) -> Path:
    if not path.exists():
        qwc(*args)
    return path


def evaluate(model: Path | str, work: Path, a, choices: Path, tag: str) -> dict:
    out = work / f"eval-{tag}-c{a.chunks}-i{a.items}.json"
    if not out.is_file():
        mc = ["--choices", str(choices), "--items", str(a.items)] if a.items else []
        text = qwc("-q", "eval", str(model), "--ppl", "austen:prideprejudice", "--ctx", "512",
                   "--chunks", str(a.chunks), *mc, "--threads", str(a.threads), "--json", capture=True)
        out.write_text(text)
    return json.loads(out.read_text())


def llamacpp_eval(tools: Path, gguf: Path, work: Path, a, tag: str) -> dict:
    """llama-perplexity on the same text and chunks, in `qwc eval --json`'s shape."""
    out = work / f"eval-{tag}-c{a.chunks}.json"
    if not out.is_file():
        from qwc.eval.data import novel

        cmd = [str(tools / f"llama-perplexity-{VERSION}"), "-m", str(gguf), "-f", str(novel("prideprejudice")),
               "-c", "512", "--chunks", str(a.chunks), "-t", str(a.threads), "-b", "512"]
        r = subprocess.run(cmd, text=True, capture_output=True)
        m = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", r.stdout + r.stderr)
        if r.returncode != 0 or not m:
            sys.exit(f"accuracy: {' '.join(cmd)} failed: {(r.stdout + r.stderr).strip()[-400:]}")
        out.write_text(json.dumps({"backend": "llama.cpp", "perplexity": {"ppl": float(m[1]), "ppl_err": float(m[2])}}))
    return json.loads(out.read_text())


def llamacpp_imatrix(tools: Path, src: Path, out: Path, threads: int) -> Path:
    """llama-imatrix on Emma, the calibration text of qwc's --awq / --gptq rows (4096 tokens)."""
    if not out.exists():
        from qwc.eval.data import novel

        tmp = out.with_suffix(".partial.dat")
        cmd = [str(tools / f"llama-imatrix-{VERSION}"), "-m", str(src), "-f", str(novel("emma")), "-c", "512",
               "--chunks", "8", "-t", str(threads), "-o", str(tmp)]
        r = subprocess.run(cmd, text=True, capture_output=True)
        if r.returncode != 0 or not tmp.exists():
            sys.exit(f"accuracy: {' '.join(cmd)} failed: {(r.stdout + r.stderr).strip()[-400:]}")
        tmp.replace(out)
    return out


def llamacpp_quantized(tools: Path, src: Path, out: Path, *opt: str, kind: str = "Q4_0") -> Path:
    if not out.exists():
        tmp = out.with_suffix(".partial")
        cmd = [str(tools / f"llama-quantize-{VERSION}"), "--allow-requantize", *opt, str(src), str(tmp), kind]
        r = subprocess.run(cmd, text=True, capture_output=True)
        if r.returncode != 0:
            sys.exit(f"accuracy: {' '.join(cmd)} failed: {r.stderr.strip()[-400:]}")
        tmp.replace(out)
    return out


PRUNED = (2, 4, 6)   # blocks removed of SmolLM2's 30
ROWS = ("float", "llamacpp-float", "llamacpp-q4_0", "llamacpp-q4_0-q4out", "llamacpp-q4_0-imatrix",
        "llamacpp-q4_0-imatrix-q4out", "ptq", "ptq-emb8", "fold", "fold-emb8", "awq", "awq-emb8", "gptq", "gptq-emb8",
        "awq-gptq", "awq-gptq-emb8", "bits8", "llamacpp-q4_k_m", "llamacpp-q4_k_m-imatrix",
        "llamacpp-q4_k_m-imatrix-q8", "q4_k_m", "q4_k_m-imatrix", "q4_k_m-llama-imatrix", "q4_k_m-gptq",
        "awq-q4_k_m-gptq", "ft", "ft+ptq", "qat", "qat-kd",
        *(f"sleb{n}{how}" for n in PRUNED for how in ("", "+ptq-emb8", "+qat-kd")))
DEFAULT_ROWS = tuple(r for r in ROWS if not r.startswith("fold"))   # the fold is the old default, measured once


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--qat-steps", type=int, default=200)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--chunks", type=int, default=40)
    ap.add_argument("--items", type=int, default=200, help="multiple-choice items (0: perplexity only)")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--work", type=Path, default=Path.home() / ".cache" / "qwc" / "accuracy")
    ap.add_argument("--no-compiled", action="store_true", help="skip the compiled-artifact column")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--rows", help=f"only these rows, comma-separated (of {', '.join(ROWS)}; default: all "
                                   "but the fold rows)")
    a = ap.parse_args()
    wanted = DEFAULT_ROWS if not a.rows else a.rows.split(",")
    if set(wanted) - set(ROWS):
        sys.exit(f"accuracy: unknown rows {sorted(set(wanted) - set(ROWS))} (known: {', '.join(ROWS)})")
    w = a.work
    w.mkdir(parents=True, exist_ok=True)
    qwc("-q", "data", "fetch")
    choices = ensure(w / "persuasion.jsonl", "data", "choices", "--text", "austen:persuasion",
                     "--items", str(max(a.items, 200)), "-o", str(w / "persuasion.jsonl"))
    train = ["--data", "austen:emma", "--data", "austen:mansfieldpark", "--steps", str(a.qat_steps), "--lr", str(a.lr),
             "--bf16"]

    def trained(kind: str, *opt: str, source: str = "smollm2") -> str:   # a QAT or fine-tune run, made once
        return str(ensure(w / f"{kind}-{a.qat_steps}", "qat", source, *train, *opt, "-o", str(w / f"{kind}-{a.qat_steps}")))

    def pruned(n: int) -> str:
        return str(ensure(w / f"sleb{n}", "-q", "prune", "smollm2", "--remove", str(n), "--calib", "austen:emma",
                          "-o", str(w / f"sleb{n}")))

    def quantized(src: str, name: str, *opt: str) -> tuple[Path, Path]:
        base = Path(src).name   # one export per source model, shared by its rows
        # the float export (a GGUF dequantized: `--exporter auto` would keep its Q4_1 weights)
        onnx_ = ensure(w / f"{base}.onnx", "-q", "export", src, "--exporter", "torch", "-o", str(w / f"{base}.onnx"))
        q4 = ensure(w / f"{name}.q4.onnx", "-q", "optimize", str(onnx_), *opt, "-o", str(w / f"{name}.q4.onnx"))
        art = w / f"{name}.qwc"
        if not a.no_compiled:
            ensure(art, "-q", "compile", str(q4), "--target", "host", "--act-bits", "8", "-o", str(art))
        return q4, art

    from qwc.eval.data import smollm2_path

    tools = llamacpp_tools("x86") if any(r.startswith("llamacpp") or r == "q4_k_m-llama-imatrix" for r in wanted) else None
    q4out = ("--output-tensor-type", "q4_0", "--token-embedding-type", "q4_0")
    floats = {"float": lambda: "smollm2", "ft": lambda: trained("ft", "--fake-quant-after", str(a.qat_steps)),
              **{f"sleb{n}": (lambda n=n: pruned(n)) for n in PRUNED}}
    llamacpp = {"llamacpp-float": lambda: smollm2_path(),
                "llamacpp-q4_0": lambda: llamacpp_quantized(tools, smollm2_path(), w / "llamacpp-q4_0.gguf"),
                "llamacpp-q4_0-q4out": lambda: llamacpp_quantized(tools, smollm2_path(), w / "llamacpp-q4_0-q4out.gguf",
                                                                  *q4out),
                "llamacpp-q4_0-imatrix": lambda: llamacpp_quantized(
                    tools, smollm2_path(), w / "llamacpp-q4_0-imatrix.gguf", "--imatrix", str(imatrix())),
                "llamacpp-q4_0-imatrix-q4out": lambda: llamacpp_quantized(
                    tools, smollm2_path(), w / "llamacpp-q4_0-imatrix-q4out.gguf", "--imatrix", str(imatrix()), *q4out),
                "llamacpp-q4_k_m": lambda: llamacpp_quantized(tools, smollm2_path(), w / "llamacpp-q4_k_m.gguf",
                                                              kind="Q4_K_M"),
                "llamacpp-q4_k_m-imatrix": lambda: llamacpp_quantized(
                    tools, smollm2_path(), w / "llamacpp-q4_k_m-imatrix.gguf", "--imatrix", str(imatrix()), kind="Q4_K_M"),
                "llamacpp-q4_k_m-imatrix-q8": lambda: llamacpp_quantized(
                    tools, smollm2_path(), w / "llamacpp-q4_k_m-imatrix-q8.gguf", "--imatrix", str(imatrix()),
                    *q6_k_overrides(smollm2_path()), kind="Q4_K_M")}
    emb8, fold, awq = ("--lm-head-bits", "8"), ("--fold-norm-gains",), ("--awq", "--calib", "austen:emma")
    gptq = ("--gptq", "--calib", "austen:emma")
    kfmt = ("--format", "q4_k_m")

    def imatrix() -> Path:
        return llamacpp_imatrix(tools, smollm2_path(), w / "smollm2-emma.imatrix.dat", a.threads)
    kd = ("--quantize-embedding", "--teacher")
    recipes = {"ptq": lambda: ("smollm2", ()), "ptq-emb8": lambda: ("smollm2", emb8),
               "fold": lambda: ("smollm2", fold), "fold-emb8": lambda: ("smollm2", fold + emb8),
               "awq": lambda: ("smollm2", awq), "awq-emb8": lambda: ("smollm2", awq + emb8),
               "gptq": lambda: ("smollm2", gptq), "gptq-emb8": lambda: ("smollm2", gptq + emb8),
               "awq-gptq": lambda: ("smollm2", awq + ("--gptq",)), "awq-gptq-emb8": lambda: ("smollm2", awq + ("--gptq",) + emb8),
               "bits8": lambda: ("smollm2", ("--bits", "8") + emb8),
               "q4_k_m": lambda: ("smollm2", kfmt),
               "q4_k_m-imatrix": lambda: ("smollm2", kfmt + ("--imatrix", "calib", "--calib", "austen:emma")),
               "q4_k_m-llama-imatrix": lambda: ("smollm2", kfmt + ("--imatrix", str(imatrix()))),
               "q4_k_m-gptq": lambda: ("smollm2", kfmt + gptq),
               "awq-q4_k_m-gptq": lambda: ("smollm2", kfmt + awq + ("--gptq",)),
               "ft+ptq": lambda: (trained("ft", "--fake-quant-after", str(a.qat_steps)), ()),
               "qat": lambda: (trained("qat", "--quantize-embedding"), ()),
               "qat-kd": lambda: (trained("qat-kd", *kd), ()),
               **{f"sleb{n}+ptq-emb8": (lambda n=n: (pruned(n), emb8)) for n in PRUNED},
               # the teacher is the unpruned float model: it knows what the removed blocks did
               **{f"sleb{n}+qat-kd": (lambda n=n: (trained(f"sleb{n}-qat-kd", "--quantize-embedding", "--teacher",
                                                             str(smollm2_path()), source=pruned(n)), ()))
                  for n in PRUNED}}
    rows = {}
    for name in (r for r in ROWS if r in wanted):
        if name in floats:
            rows[name] = (evaluate(floats[name](), w, a, choices, name), None)
        elif name in llamacpp:
            rows[name] = (llamacpp_eval(tools, llamacpp[name](), w, a, name), None)
        else:
            src, opt = recipes[name]()
            q4, art = quantized(src, name.replace("+", "-"), *opt)
            ref = evaluate(q4, w, a, choices, name)
            comp = None if a.no_compiled else evaluate(art, w, a, choices, name + "-qwc")
            rows[name] = (ref, comp)

    print(f"\nSmolLM2-135M-Instruct; PPL: Pride and Prejudice, {a.chunks} x 512 tokens, llama.cpp protocol; "
          f"MC: {a.items} Persuasion next-sentence items (chance 0.25)\n")
    print("| model | backend | PPL | MC PMI | MC LL | MC LL/char | compiled W4A8 PPL | compiled MC PMI |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, (ref, comp) in rows.items():
        p, c = ref["perplexity"], ref.get("choices")
        cp = f"{comp['perplexity']['ppl']:.2f}" if comp else "-"
        cm = f"{comp['choices']['acc_pmi']:.3f}" if comp and comp.get("choices") else "-"
        mc = " | ".join(f"{c[k]:.3f}" if c else "-" for k in ("acc_pmi", "acc_ll", "acc_ll_norm"))
        print(f"| {name} | {ref['backend']} | {p['ppl']:.2f} ± {p['ppl_err']:.2f} | {mc} | {cp} | {cm} |")
    if a.json:
        a.json.write_text(json.dumps({k: {"reference": r, "compiled": c} for k, (r, c) in rows.items()}, indent=1))


if __name__ == "__main__":
    main()
