"""qwc against llama.cpp on one GGUF per weight format, the Qwen2.5-0.5B shape (random weights):

    .venv/bin/python bench/formats.py [--formats q4_0,q4_1,q8_0] [--threads 2] [--rounds 3] [--json out.json]
    .venv/bin/python bench/formats.py --gguf FILE [--threads 2] [--rounds 3]

For each format a GGUF holds every linear in it (the tied embedding / output in Q8_0 for Q4_1
and Q8_0, Q4_0 for Q4_0), written by gguf-py's quantizers (llama.cpp's reference ones). qwc
exports that very file (its weights kept as they are: models/gguf_blocks.py) and compiles it
for the host; llama.cpp (its strongest build here, bench/llamacpp.sh x86) reads it as it is.
pp512 and tg128 from an empty cache, llama-bench's definition, qwc and llama.cpp alternating
round by round (the machine is shared); the table has medians and ratios.

--gguf FILE benches a GGUF made elsewhere instead (llama-quantize's K-quant mixes, which gguf-py
cannot write: bench/kquant_error.py's 1.5B-shaped cut, say). A byte-level test vocabulary
carries one placeholder merge for llama.cpp's loader, which the tokenizers library refuses:
qwc exports a copy without it (without_merges), the same tensors byte for byte.

--mix q4_k_m --size 1.5b makes such a file at a whole model's shape: bench/make_checkpoint.py's
random weights written as F16, then llama-quantize's mix (llama.cpp's x86 tools,
bench/llamacpp.sh).

    .venv/bin/python bench/formats.py --mix q4_k_m --size 1.5b [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from qwc.bench.artifacts import chain
from qwc.bench.llamacpp import VERSION

HERE = Path(__file__).resolve().parent
QWC = [sys.executable, "-m", "qwc"]
PRESET = "qwen2.5-0.5b"


def prepare(fmt: str, work: Path) -> tuple[Path, Path]:
    """(the GGUF, the host artifact compiled from it)."""
    from gguf import GGMLQuantizationType

    from qwc.bench.gguf_q4_0 import write_gguf_q4_0
    from qwc.models.presets import load_preset

    work.mkdir(parents=True, exist_ok=True)
    gguf = work / f"{fmt}.gguf"
    if not gguf.exists():
        kind = GGMLQuantizationType[fmt.upper()]
        write_gguf_q4_0(load_preset(PRESET), gguf.with_suffix(".partial"), head_bits=4 if fmt == "q4_0" else 8,
                        linears=kind)
        gguf.with_suffix(".partial").rename(gguf)
    return gguf, chain(gguf, work, fmt, optimize=None, fresh=("onnx", "qwc"))["qwc"]


def without_merges(src: Path, dst: Path) -> Path:
    """`src` with its tokenizer.ggml.merges entry removed, the tensor data unchanged: the header
    is rewritten (one key fewer, padded to the file's alignment) and the data section copied."""
    from gguf import GGUFReader

    r = GGUFReader(src)
    field = r.fields.get("tokenizer.ggml.merges")
    if field is None:
        return src
    raw = src.read_bytes()
    start = field.offset
    end = start + sum(p.nbytes for p in field.parts)
    last = r.tensors[-1].field
    infos_end = last.offset + sum(p.nbytes for p in last.parts)
    align = int(r.fields["general.alignment"].parts[-1][0]) if "general.alignment" in r.fields else 32
    n_kv = int.from_bytes(raw[16:24], "little") - 1
    head = raw[:16] + n_kv.to_bytes(8, "little") + raw[24:start] + raw[end:infos_end]
    head += bytes(-len(head) % align)
    dst.write_bytes(head + raw[r.data_offset:])
    return dst


def prepare_file(src: Path, work: Path) -> tuple[Path, Path]:
    """(the GGUF for llama.cpp, the host artifact qwc compiles from it: --gguf)."""
    work.mkdir(parents=True, exist_ok=True)
    mine = without_merges(src, work / f"{src.stem}.qwc.gguf")
    return src, chain(mine, work, src.stem, optimize=None, fresh=("onnx", "qwc"))["qwc"]


def quantized_file(mix: str, size: str, work: Path, layers: int | None = None) -> Path:
    """llama-quantize's `mix` (Q4_K_M, ...) of a random checkpoint of Qwen2.5-`size`'s shapes
    (bench/make_checkpoint.py; `layers`: its first N layers only), or of a Qwen3 preset's
    (`size` its name: qwen3-0.6b, qwen3-8b-2layers, ...), written as F16 first."""
    from qwc.bench.gguf_q4_0 import write_gguf_q4_0_checkpoint
    from qwc.bench.llamacpp import tools as llamacpp_tools
    from qwc.models.hf import open_hf_dir
    from qwc.models.presets import is_checkpoint_preset, preset_checkpoint

    work.mkdir(parents=True, exist_ok=True)
    preset = is_checkpoint_preset(size)
    if preset and layers is not None:
        sys.exit(f"formats: --layers cuts Qwen2.5's checkpoints; {size} is a preset (its cuts are presets of their own)")
    stem = size if preset else f"qwen2.5-{size}" + (f"-{layers}layers" if layers is not None else "")
    out = work / f"{stem}-{mix}.gguf"
    if out.exists():
        return out
    ckpt, f16 = work / stem, work / f"{stem}-f16.gguf"
    if not preset and not (ckpt / "config.json").exists():
        cut = ["--layers", str(layers)] if layers is not None else []
        subprocess.run([sys.executable, str(HERE / "make_checkpoint.py"), size, "-o", str(ckpt), *cut], check=True)
    if not f16.exists():
        write_gguf_q4_0_checkpoint(preset_checkpoint(size) if preset else open_hf_dir(ckpt), f16.with_suffix(".partial"),
                                   f16=True)
        f16.with_suffix(".partial").rename(f16)
    quantize = llamacpp_tools("x86") / f"llama-quantize-{VERSION}"
    subprocess.run([str(quantize), str(f16), str(out.with_suffix(".partial")), mix.upper()], check=True,
                   stdout=subprocess.DEVNULL)
    out.with_suffix(".partial").rename(out)
    f16.unlink()   # 3 GB at 1.5B, 15 GB at 7B
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--formats", default="q4_0,q4_1,q8_0")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workdir", type=Path, default=Path.home() / ".cache" / "qwc" / "formats")
    p.add_argument("--json", type=Path)
    p.add_argument("--gguf", type=Path, help="bench this GGUF (any formats) instead of --formats' files")
    p.add_argument("--mix", choices=("q4_0", "q4_k_m", "q4_k_s", "q5_k_m", "q6_k", "iq4_nl", "iq4_xs"),
                   help="bench llama-quantize's mix of a random model (--size) instead")
    p.add_argument("--size", default="1.5b", help="with --mix: Qwen2.5's size (bench/make_checkpoint.py's: 0.5b, 1.5b, "
                                                 "7b), or a Qwen3 preset (qwen3-0.6b, qwen3-8b-2layers, ...)")
    p.add_argument("--layers", type=int, help="with --mix: the model's first N layers only (7b: 4, the 7B cut)")
    a = p.parse_args()
    if a.mix:
        a.gguf = quantized_file(a.mix, a.size, a.workdir, a.layers)
    from qwc.bench.scale import alternating
    formats = [f.strip() for f in a.formats.split(",") if f.strip()]
    unknown = [f for f in formats if f not in ("q4_0", "q4_1", "q8_0")]
    if unknown:
        sys.exit(f"formats: unknown format {unknown[0]!r} (q4_0, q4_1, q8_0)")
    results = {}
    if a.gguf:
        gguf, art = prepare_file(a.gguf, a.workdir)
        results[a.gguf.stem] = alternating(art, gguf, a.threads, a.rounds)
    for fmt in [] if a.gguf else formats:
        gguf, art = prepare(fmt, a.workdir)
        results[fmt] = alternating(art, gguf, a.threads, a.rounds)
    shape = a.gguf.name if a.gguf else f"{PRESET} shape"
    print(f"\n{shape}, {a.threads} threads, medians of {a.rounds} alternating rounds\n")
    print("| weights | qwc pp512 | llama.cpp pp512 | ratio | qwc tg128 | llama.cpp tg128 | ratio |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for fmt, r in results.items():
        q, lc = r["qwc"], r["llama.cpp"]
        print(f"| {fmt.upper()} | {q['pp512']:.1f} | {lc['pp512']:.1f} | {q['pp512'] / lc['pp512']:.2f}x"
              f" | {q['tg128']:.2f} | {lc['tg128']:.2f} | {q['tg128'] / lc['tg128']:.2f}x |")
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
