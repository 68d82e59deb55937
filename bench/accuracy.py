"""SmolLM2-135M on Jane Austen: float vs PTQ Q4_0 vs QAT Q4_0, in one table.

    .venv/bin/python bench/accuracy.py [--qat-steps 200] [--lr 5e-5] [--chunks 40] [--items 200] [--rows a,b]

Rows (every one through `qwc` commands, so the table is what a user gets):
  float        the GGUF's weights dequantized (Q4_1 -> fp32), torch
  ptq          `qwc optimize` of the float export (Q4_0 linears and 4-bit embedding), onnxruntime
  ptq-emb8     the same with the embedding / tied lm_head at Q8_0 (`--lm-head-bits 8`)
  fold, fold-emb8  the same two with the norm gains folded into the weights first (`--fold-norm-gains`)
  awq, awq-emb8    the same two with activation-aware scales (`--awq`, calibrated on Emma)
  ft+ptq       control: float fine-tune on the same Emma data and steps, then PTQ; separates
               what QAT gains from what fine-tuning on Austen gains by itself
  qat          `qwc qat --quantize-embedding` on Emma, then `qwc optimize` (lossless), onnxruntime
and, for the quantized rows, the compiled host artifact (`--act-bits 8`, the fast path) beside it.
Perplexity: Pride and Prejudice, llama.cpp's protocol (first `--chunks` x 512 tokens). Multiple
choice: `--items` next-sentence items from Persuasion (held out of training), PMI accuracy.
Intermediate files are cached in ~/.cache/qwc/accuracy; delete it to start over.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

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
    out = work / f"eval-{tag}.json"
    if not out.is_file():
        text = qwc("-q", "eval", str(model), "--ppl", "austen:prideprejudice", "--ctx", "512",
                   "--chunks", str(a.chunks), "--choices", str(choices), "--items", str(a.items),
                   "--threads", str(a.threads), "--json", capture=True)
        out.write_text(text)
    return json.loads(out.read_text())


ROWS = ("float", "ptq", "ptq-emb8", "fold", "fold-emb8", "awq", "awq-emb8", "ft+ptq", "qat")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--qat-steps", type=int, default=200)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--chunks", type=int, default=40)
    ap.add_argument("--items", type=int, default=200)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--work", type=Path, default=Path.home() / ".cache" / "qwc" / "accuracy")
    ap.add_argument("--no-compiled", action="store_true", help="skip the compiled-artifact column")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--rows", help=f"only these rows, comma-separated (of {', '.join(ROWS)})")
    a = ap.parse_args()
    wanted = ROWS if not a.rows else a.rows.split(",")
    if set(wanted) - set(ROWS):
        sys.exit(f"accuracy: unknown rows {sorted(set(wanted) - set(ROWS))} (known: {', '.join(ROWS)})")
    w = a.work
    w.mkdir(parents=True, exist_ok=True)
    qwc("-q", "data", "fetch")
    choices = ensure(w / "persuasion.jsonl", "data", "choices", "--text", "austen:persuasion",
                     "--items", str(max(a.items, 200)), "-o", str(w / "persuasion.jsonl"))
    train = ["--data", "austen:emma", "--steps", str(a.qat_steps), "--lr", str(a.lr)]

    def trained(kind: str, *opt: str) -> str:   # a QAT or float fine-tune run, made once
        return str(ensure(w / f"{kind}-{a.qat_steps}", "qat", "smollm2", *train, *opt, "-o", str(w / f"{kind}-{a.qat_steps}")))

    def quantized(src: str, name: str, *opt: str) -> tuple[Path, Path]:
        base = Path(src).name   # one export per source model, shared by its rows
        onnx_ = ensure(w / f"{base}.onnx", "-q", "export", src, "-o", str(w / f"{base}.onnx"))
        q4 = ensure(w / f"{name}.q4.onnx", "-q", "optimize", str(onnx_), *opt, "-o", str(w / f"{name}.q4.onnx"))
        art = w / f"{name}.qwc"
        if not a.no_compiled:
            ensure(art, "-q", "compile", str(q4), "--target", "host", "--act-bits", "8", "-o", str(art))
        return q4, art

    rows = {"float": (evaluate("smollm2", w, a, choices, "float"), None)} if "float" in wanted else {}
    emb8, fold, awq = ("--lm-head-bits", "8"), ("--fold-norm-gains",), ("--awq", "--calib", "austen:emma")
    recipes = {"ptq": lambda: ("smollm2", ()), "ptq-emb8": lambda: ("smollm2", emb8),
               "fold": lambda: ("smollm2", fold), "fold-emb8": lambda: ("smollm2", fold + emb8),
               "awq": lambda: ("smollm2", awq), "awq-emb8": lambda: ("smollm2", awq + emb8),
               "ft+ptq": lambda: (trained("ft", "--fake-quant-after", str(a.qat_steps)), ()),
               "qat": lambda: (trained("qat", "--quantize-embedding"), ())}
    for name in (r for r in ROWS[1:] if r in wanted):
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
        p, c = ref["perplexity"], ref["choices"]
        cp = f"{comp['perplexity']['ppl']:.2f}" if comp else "-"
        cm = f"{comp['choices']['acc_pmi']:.3f}" if comp else "-"
        print(f"| {name} | {ref['backend']} | {p['ppl']:.2f} ± {p['ppl_err']:.2f} | {c['acc_pmi']:.3f} | "
              f"{c['acc_ll']:.3f} | {c['acc_ll_norm']:.3f} | {cp} | {cm} |")
    if a.json:
        a.json.write_text(json.dumps({k: {"reference": r, "compiled": c} for k, (r, c) in rows.items()}, indent=1))


if __name__ == "__main__":
    main()
