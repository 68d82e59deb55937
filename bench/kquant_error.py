"""qwc's K-quant search (`qwc optimize --format q4_k_m`, qwc/kquants.py) against llama.cpp's
own quantizer, tensor by tensor, with the same importance matrix: one table per model.

    .venv/bin/python bench/kquant_error.py [--models smollm2,cut] [--threads 2]

For each model both tools start from the same float weights and the same importance matrix
(`llama-imatrix` on Emma, 8 windows of 512 tokens, the calibration text of
bench/accuracy.py), and write the same format per tensor (llama-quantize Q4_K_M with
--tensor-type overrides putting Q8_0 where Q4_K_M has Q6_K, which qwc has no kernels for).
The figure per tensor is the importance-weighted relative error of the weights,

    sum_ij imp_j (w_q - w)_ij^2 / sum_ij imp_j w_ij^2,

the expected relative error of the linear's output if its inputs' channels were independent;
the table gives its mean per format and the ratio qwc / llama.cpp (below 1: qwc's is smaller).

Models:
  smollm2  SmolLM2-135M (`qwc data fetch`), its Q4_1 GGUF dequantized as the float source:
           rows of 576 and 1536, so Q5_0 for most linears and Q4_K for down_proj. Its q/k
           rows are permuted by the llama-architecture export, so those two are left out.
  cut      a Qwen2.5-1.5B-shaped cut (hidden 1536, intermediate 8960, 2 layers, byte-level
           vocabulary), random float32 weights with heavy tails (Student t, 5 degrees of
           freedom): rows of whole super-blocks, so Q4_K everywhere Q4_K_M puts it.
llama.cpp's tools: bench/llamacpp.sh x86 (cached). Files: ~/.cache/qwc/kquant_error.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

from qwc.bench.llamacpp import VERSION
from qwc.bench.llamacpp import tools as llamacpp_tools

WORK = Path.home() / ".cache" / "qwc" / "kquant_error"
QWC = [sys.executable, "-m", "qwc", "-q"]


def run(cmd: list[str], what: str) -> None:
    r = subprocess.run(cmd, text=True, capture_output=True)
    if r.returncode != 0:
        sys.exit(f"kquant_error: {what} failed: {(r.stdout + r.stderr).strip()[-600:]}")


def make_cut(path: Path, for_qwc: Path) -> None:
    """The cut twice, the same weights: `path` for llama.cpp, which refuses a BPE vocabulary
    without merges (the byte-level one needs none, so it gets one harmless pair), and `for_qwc`
    without, since tokenizers refuses a merge whose result is not in the vocabulary."""
    from qwc.config import ModelConfig
    from qwc.models.checkpoint import expected_tensors
    from qwc.models.gguf_writer import write_gguf
    from qwc.models.tokenizer import SPECIAL_TOKENS, byte_level_tokenizer

    tok = byte_level_tokenizer()
    cfg = ModelConfig(name="qwen2.5-1.5b-cut", vocab_size=tok.get_vocab_size(), hidden_size=1536,
                      intermediate_size=8960, num_hidden_layers=2, num_attention_heads=12, num_key_value_heads=2,
                      head_dim=128, rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=4096,
                      tie_word_embeddings=True, bos_token_id=256, eos_token_ids=[258], chat_template="{{ messages }}")
    rng = np.random.default_rng(0)
    tensors = {}
    for name, shape in expected_tensors(cfg).items():
        if len(shape) > 1:
            v = 0.02 * rng.standard_t(5, shape)
        elif name.endswith("norm.weight"):
            v = rng.uniform(0.5, 1.5, shape)
        else:
            v = 0.02 * rng.standard_normal(shape)
        tensors[name] = (v.astype(np.float32), None)
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    from gguf import TokenType
    types = [TokenType.CONTROL if t in SPECIAL_TOKENS else TokenType.NORMAL for t, _ in vocab]
    write_gguf(path, "qwen2", cfg, [t for t, _ in vocab], types, tensors, merges=["\u0120 \u0120"])
    write_gguf(for_qwc, "qwen2", cfg, [t for t, _ in vocab], types, tensors)


def q6_k_overrides(src: Path) -> list[str]:
    """llama-quantize options giving every ffn_down the type qwc's mix gives it (Q8_0 in Q6_K's
    places): overriding only those would shift llama.cpp's layer counter for the others."""
    from gguf import GGUFReader

    from qwc.passes.kquant_mix import more_bits

    fields = GGUFReader(src).fields
    layers = int(fields[next(k for k in fields if k.endswith(".block_count"))].parts[-1][0])
    up = "|".join(str(i) for i in range(layers) if more_bits(i, layers))
    keep = "|".join(str(i) for i in range(layers) if not more_bits(i, layers))
    out = ["--tensor-type", rf"blk\.({up})\.ffn_down=q8_0"]
    return out + (["--tensor-type", rf"blk\.({keep})\.ffn_down=q4_K"] if keep else [])


def float_weights(src: Path) -> dict[str, np.ndarray]:
    """{module name: [N, K] float32} of a GGUF's linears, dequantized."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from qwc.models.gguf_loader import hf_name

    out = {}
    for t in GGUFReader(src).tensors:
        hf = hf_name(t.name)
        if hf and hf.endswith("_proj.weight"):
            out[hf.removesuffix(".weight")] = dequantize(t.data, t.tensor_type).reshape(int(t.shape[1]), int(t.shape[0]))
    return out


def llama_weights(path: Path) -> dict[str, tuple[str, np.ndarray]]:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from qwc.models.gguf_loader import hf_name

    out = {}
    for t in GGUFReader(path).tensors:
        hf = hf_name(t.name)
        if hf and hf.endswith("_proj.weight"):
            w = dequantize(t.data, t.tensor_type).reshape(int(t.shape[1]), int(t.shape[0]))
            out[hf.removesuffix(".weight")] = (t.tensor_type.name, w)
    return out


def qwc_weights(graph: Path) -> dict[str, np.ndarray]:
    """{module name: the weights qwc's MatMulNBits hold, as the kernels compute with them}."""
    import onnx

    from qwc.models import gguf_blocks
    from qwc.passes.graph import tensor_array

    m = onnx.load(str(graph))
    inits = {i.name: i for i in m.graph.initializer}
    out = {}
    for n in m.graph.node:
        if n.op_type != "MatMulNBits":
            continue
        stem = re.sub(r"\.qweight(_\d+)?$", "", n.input[1])
        bits = next(a.i for a in n.attribute if a.name == "bits")
        zp = tensor_array(inits[n.input[3]]) if len(n.input) > 3 and n.input[3] else None
        fmt = ("Q4_K" if zp is not None else "Q4_0") if bits == 4 else "Q8_0"
        b = gguf_blocks.Blocks(fmt, tensor_array(inits[n.input[1]]), tensor_array(inits[n.input[2]]), zp)
        out[stem] = gguf_blocks.dequantize(b)
    return out


def weighted_error(a: np.ndarray, x: np.ndarray, imp: np.ndarray) -> float:
    """sum imp_j (a - x)_ij^2 / sum imp_j x_ij^2."""
    return float((((a - x) ** 2) * imp).sum() / ((x ** 2) * imp).sum())


def compare(name: str, src: Path, exported: Path, t: Path, threads: int, skip: tuple[str, ...]) -> None:
    from qwc.eval.data import novel
    from qwc.passes.imatrix import read_llamacpp

    d = WORK / name
    imat = d / "emma.imatrix.gguf"
    if not imat.exists():
        run([str(t / f"llama-imatrix-{VERSION}"), "-m", str(src), "-f", str(novel("emma")), "-c", "512", "--chunks", "8",
             "-t", str(threads), "-o", str(imat)], "llama-imatrix")
    lq = d / "llama-q4_k_m.gguf"
    if not lq.exists():
        run([str(t / f"llama-quantize-{VERSION}"), "--allow-requantize", "--imatrix", str(imat), *q6_k_overrides(src),
             str(src), str(lq), "Q4_K_M"], "llama-quantize")
    qg = d / "qwc-q4_k_m.onnx"
    if not qg.exists():
        run([*QWC, "optimize", str(exported), "--format", "q4_k_m", "--imatrix", str(imat), "-o", str(qg)],
            "qwc optimize --format q4_k_m")
    imp, w, theirs, ours = read_llamacpp(imat), float_weights(src), llama_weights(lq), qwc_weights(qg)
    rows: dict[str, list[tuple[float, float]]] = {}
    for mod, (fmt, wl) in sorted(theirs.items()):
        if mod.endswith(skip) or fmt not in ("Q4_K", "Q5_0") or mod not in ours:
            continue
        x, im = w[mod].astype(np.float64), imp[mod]
        rows.setdefault(fmt, []).append((weighted_error(ours[mod], x, im), weighted_error(wl, x, im)))
    print(f"\n{name}: importance-weighted relative error of the weights, mean per format")
    print("| format | tensors | qwc | llama.cpp | qwc / llama.cpp |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for fmt, v in sorted(rows.items()):
        a, b = np.mean([x for x, _ in v]), np.mean([y for _, y in v])
        print(f"| {fmt} | {len(v)} | {a:.3e} | {b:.3e} | {a / b:.3f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2,cut")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    t = llamacpp_tools("x86")
    for name in a.models.split(","):
        d = WORK / name
        d.mkdir(parents=True, exist_ok=True)
        if name == "smollm2":
            from qwc.eval.data import smollm2_path

            src, exported = smollm2_path(), d / "smollm2.onnx"
            if not exported.exists():   # the float export (the GGUF dequantized), as bench/accuracy.py's
                run([*QWC, "export", "smollm2", "--exporter", "torch", "-o", str(exported)], "qwc export")
            compare(name, Path(src), exported, t, a.threads, ("q_proj", "k_proj"))
        elif name == "cut":
            src, exported = d / "cut.gguf", d / "cut.onnx"
            if not src.exists():
                make_cut(src, d / "cut-qwc.gguf")
            if not exported.exists():
                run([*QWC, "export", str(d / "cut-qwc.gguf"), "-o", str(exported)], "qwc export")
            compare(name, src, exported, t, a.threads, ())
        else:
            sys.exit(f"kquant_error: unknown model {name!r} (smollm2, cut)")


if __name__ == "__main__":
    main()
