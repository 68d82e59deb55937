"""Adapters served unmerged against their merged builds, on real weights: SmolLM2-135M with the
LoRA and QA-LoRA adapters bench/lora.py trains on Pride and Prejudice.

    .venv/bin/python bench/lora_replies.py [--prompts 6] [--tokens 8]

One `qwc serve` of the base (the GGUF's Q4_1 blocks, compiled with --max-lora-rank 16 and
--max-batch 4) with both adapters loaded (`--lora lora=DIR --lora qalora=DIR`); and each
adapter's merged build served alone: `qwc export GGUF --lora DIR`, `qwc optimize`, `qwc
compile` (the QA-LoRA merge keeps the file's codes and scales, every linear Q4_1; the float
LoRA's adapted linears are quantized again by the passes). Each model gets the same prompts
(the first sentences of chapters of Emma, a novel the adapters never saw), greedy, through the
`openai` client; the table counts, per prompt, the positions of the first `--tokens` generated
tokens where the served reply's token is the merged build's, and whether it differs from the
base's. A greedy reply that leaves the merged build's at one token goes on from another text,
so the table also counts, teacher-forced, the positions where the served adapter's greedy
choice after the merged build's own prefix is the merged build's token. Artifacts are cached
in bench/lora.py's work dir.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

HERE = Path(__file__).parent


def prompts(n: int) -> list[str]:
    from qwc.eval.data import novel

    text = novel("emma").read_text(encoding="utf-8")
    out = []
    for m in re.finditer(r"CHAPTER [IVXL]+\s+(.{40,300}?[.!?])\s", text, re.S):
        out.append(" ".join(m[1].split()))
        if len(out) == n:
            break
    return out


def replies(url: str, models: list[str], texts: list[str], tokens: int) -> dict:
    import openai

    client = openai.OpenAI(base_url=url, api_key="unused")
    out = {}
    for m in models:
        out[m] = [client.completions.create(model=m, prompt=t, max_tokens=tokens, temperature=0, logprobs=0,
                                            extra_body={"ignore_eos": True}).choices[0].logprobs.tokens
                  for t in texts]
    return out


def served(art: Path, models: list[str], texts: list[str], tokens: int, *extra: str) -> dict:
    from qwc.bench.serve import start, stop, wait_ready

    proc, line = start([sys.executable, "-m", "qwc", "serve", str(art), "--port", "0", "--max-batch", "4",
                        "--model-name", "base", *extra], r"serving .* at http://")
    url = re.search(r"(http://[^ ]+/v1)", line)[1]
    try:
        wait_ready(url.removesuffix("/v1"), proc)
        return replies(url, models, texts, tokens)
    finally:
        stop(proc)


def teacher_forced(slots: Path, merged: Path, adapter: Path | None, texts: list[str], tokens: int) -> list[int]:
    """Per prompt, at how many of `merged`'s first `tokens` greedy tokens the artifact `slots`
    with `adapter` served (None: as it is) chooses the same token given the same prefix (the
    Engine in this process, the server's arithmetic: tests/serve/test_serve_lora.py)."""
    import numpy as np

    from qwc.runtime.adapters import load_adapters
    from qwc.runtime.engine import Engine

    ref = Engine(merged, ctx=512)
    eng = Engine(slots, ctx=512)
    if adapter is not None:
        eng.load_adapters(load_adapters([("a", str(adapter))], eng.model))
    out = []
    for text in texts:
        ids = ref.encode(text)
        ref.reset()
        logits, said = ref.prefill(ids), []
        for _ in range(tokens):
            said.append(int(np.argmax(logits[:ref.sample_limit])))
            logits = ref.decode(said[-1])
        eng.reset()
        eng.seq.adapter = 0 if adapter is None else 1
        got = eng.score(ids + said[:-1])[len(ids) - 1:, :eng.sample_limit].argmax(-1)
        out.append(int(sum(int(g) == w for g, w in zip(got, said))))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--work", type=Path, default=Path.home() / ".cache" / "qwc" / "lora-bench")
    a = ap.parse_args()
    from qwc.bench.lora import made
    from qwc.eval.data import smollm2_path

    gguf, w = str(smollm2_path()), a.work
    ads = {k: w / f"{k}-prideprejudice-r16-s200-lr0.0004" for k in ("lora", "qalora")}
    for d in ads.values():
        if not d.is_dir():
            sys.exit(f"lora replies: {d} is missing: run bench/lora.py first (it trains both adapters)")

    def build(name: str, *export: str, graph: str = "", optimize_opts=(), compile_opts=()) -> Path:
        graph = graph or name
        onnx = made(w / f"{graph}.onnx", "-q", "export", gguf, *export, "-o", str(w / f"{graph}.onnx"))
        opt = made(w / f"{name}.opt.onnx", "-q", "optimize", str(onnx), *optimize_opts,
                   "-o", str(w / f"{name}.opt.onnx"))
        return made(w / f"{name}.qwc", "-q", "compile", str(opt), "--act-bits", "8", *compile_opts,
                    "-o", str(w / f"{name}.qwc"))

    slots = build("gguf-slots", compile_opts=("--max-lora-rank", "16", "--max-batch", "4"))
    merged = {k: build(f"gguf-merged-{k}", "--lora", str(d)) for k, d in ads.items()}
    # The float LoRA merged with its adapted linears at 8 bits (`qwc optimize --bits 8`), the
    # GGUF's Q4_1 blocks elsewhere: the merge then adds s·B·A to the same base the served adapter
    # runs on, and only rounds the sum finely, where Q4_0 re-quantizes the whole linear.
    merged["lora, merged at 8 bits"] = build("gguf-merged-lora-q8", "--lora", str(ads["lora"]),
                                             graph="gguf-merged-lora", optimize_opts=("--bits", "8"))
    texts = prompts(a.prompts)
    got = served(slots, ["base", *ads], texts, a.tokens, *(f"--lora={k}={d}" for k, d in ads.items()))
    got["lora, merged at 8 bits"] = got["lora"]
    want = {k: served(m, ["base"], texts, a.tokens)["base"] for k, m in merged.items()}
    print(f"\nSmolLM2-135M (its Q4_1 GGUF), greedy, {a.tokens} tokens after each of {len(texts)} prompts from Emma; "
          "served = `qwc serve BASE --lora`, merged = the adapter's merged build served alone\n")
    forced = {k: teacher_forced(slots, merged[k], d, texts, a.tokens) for k, d in ads.items()}
    forced["lora, merged at 8 bits"] = teacher_forced(slots, merged["lora, merged at 8 bits"], ads["lora"],
                                                      texts, a.tokens)
    # the float LoRA without 4-bit: the base's and the merged model's linears all in float
    # (`--keep-float '*'`), so the served product and the merge differ by rounding only
    def float_build(name: str, graph: str, *compile_opts: str) -> Path:
        if not (w / graph).is_file():
            sys.exit(f"lora replies: {w / graph} is missing: run bench/lora.py first")
        opt = made(w / f"{name}.opt.onnx", "-q", "optimize", str(w / graph), "--keep-float", "*",
                   "-o", str(w / f"{name}.opt.onnx"))
        return made(w / f"{name}.qwc", "-q", "compile", str(opt), "--act-bits", "32", *compile_opts,
                    "-o", str(w / f"{name}.qwc"))

    fl = {"float-slots": float_build("float-slots", "base.onnx", "--max-lora-rank", "16"),
          "float-merged-lora": float_build("float-merged-lora", f"{ads['lora'].name}.onnx")}
    forced["lora, float"] = teacher_forced(fl["float-slots"], fl["float-merged-lora"], ads["lora"], texts, a.tokens)
    # which 4-bit route stays closer to the float LoRA model itself
    forced["served vs float"] = teacher_forced(slots, fl["float-merged-lora"], ads["lora"], texts, a.tokens)
    forced["merged vs float"] = teacher_forced(merged["lora"], fl["float-merged-lora"], None, texts, a.tokens)
    print("| adapter | prompt | served reply's tokens = merged build's | the same, each given the merged build's prefix "
          "| served differs from the base |")
    print("| --- | ---: | ---: | ---: | --- |")
    for k in merged:
        for i in range(len(texts)):
            same = sum(x == y for x, y in zip(got[k][i], want[k][i]))
            print(f"| {k} | {i + 1} | {same} of {a.tokens} | {forced[k][i]} of {a.tokens} | "
                  f"{'yes' if got[k][i] != got['base'][i] else 'no'} |")
    for i in range(len(texts)):
        print(f"| lora, every linear float | {i + 1} | - | {forced['lora, float'][i]} of {a.tokens} | - |")
    print(f"\nThe float LoRA model's own greedy tokens (every linear float, merged), teacher-forced: of "
          f"{a.tokens * len(texts)}, the 4-bit base serving the adapter chooses {sum(forced['served vs float'])}, "
          f"the adapter's merged and re-quantized build {sum(forced['merged vs float'])}")
    for i, t in enumerate(texts):
        print(f"\nprompt {i + 1}: {t[:80]}...\n  base:   {''.join(got['base'][i])!r}"
              + "".join(f"\n  {k}: {''.join(got[k][i])!r} (merged: {''.join(want[k][i])!r})" for k in ads))


if __name__ == "__main__":
    main()
