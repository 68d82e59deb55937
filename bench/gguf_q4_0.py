"""Write a qwc-loaded model as a llama.cpp GGUF with Q4_0 weights (embedding and tied lm_head
included, as in the contest runs), so llama.cpp runs the same weights as qwc.

Token ids are fed directly in the benchmark; the vocabulary is the preset's byte-level one,
padded with unused entries to the embedding's row count (llama.cpp wants them equal)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, TokenType
from gguf.quants import quantize

from qwc.models.gguf_writer import Planned, write_gguf
from qwc.q4 import row_chunks

MOSTLY_Q4_0 = 2


def _vocab(tokenizer, vocab_size: int) -> tuple[list[str], list[int]]:
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    pad = vocab_size - len(vocab)
    # the first pad is the one merge's product, so the file's tokenizer also builds (qwc export)
    tokens = [t for t, _ in vocab] + ["\u0120\u0120"][:pad] + [f"[PAD{i}]" for i in range(1, pad)]
    types = [TokenType.CONTROL if t.startswith("<|") else TokenType.NORMAL for t, _ in vocab]
    return tokens, types + [TokenType.UNUSED] * pad


# llama.cpp's file types (llama_ftype) by the linears' type
FILE_TYPES = {GGMLQuantizationType.Q4_0: 2, GGMLQuantizationType.Q4_1: 3, GGMLQuantizationType.Q8_0: 7,
              GGMLQuantizationType.F16: 1}


def write_gguf_q4_0(lm, path: Path, head_bits: int = 4, linears=GGMLQuantizationType.Q4_0) -> Path:
    """Every linear Q4_0 (or `linears`' type: Q4_1, Q8_0); the (tied) embedding / output Q4_0 or,
    with head_bits 8, Q8_0 (what llama.cpp's own quantizer keeps for a tied output by default)."""
    cfg = lm.config
    head = GGMLQuantizationType.Q4_0 if head_bits == 4 else GGMLQuantizationType.Q8_0
    tokens, types = _vocab(lm.tokenizer, cfg.vocab_size)
    tensors = {}
    for name, t in lm.model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        a = t.detach().float().numpy()
        kind = head if name in ("model.embed_tokens.weight", "lm_head.weight") else linears
        tensors[name] = (quantize(a, kind), kind) if a.ndim == 2 else (a, None)
    # llama.cpp refuses a BPE vocabulary without merges, even when ids are fed directly.
    return write_gguf(path, cfg.architecture, cfg, tokens, types, tensors, merges=["\u0120 \u0120"],
                      file_type=FILE_TYPES[linears])


def _q4_0_by_rows(a: np.ndarray) -> np.ndarray:
    """gguf-py's Q4_0 (llama.cpp's reference) a chunk of rows at a time: its temporaries are
    several times the input, and a 7B's embedding is 2.2 GB in float32."""
    out = np.empty((a.shape[0], a.shape[1] // 32 * 18), np.uint8)
    for rows in row_chunks(a):
        out[rows] = quantize(a[rows], GGMLQuantizationType.Q4_0)
    return out


def write_gguf_q4_0_checkpoint(ckpt, path: Path, f16: bool = False) -> Path:
    """The same from a checkpoint read a tensor at a time (models/checkpoint.py), every matrix
    Q4_0 (the untied head too), each quantized as it is written: what qwc's passes make of the
    same float weights (qwc.q4 is llama.cpp's Q4_0 bit for bit), for a 7B in a few GB. `f16`:
    every matrix F16 instead (llama-quantize's input: bench/formats.py --mix)."""
    cfg = ckpt.config
    tokens, types = _vocab(ckpt.tokenizer, cfg.vocab_size)
    q4, half = GGMLQuantizationType.Q4_0, GGMLQuantizationType.F16
    tensors = {}
    for name, shape in ckpt.shapes.items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if len(shape) == 2 and f16:
            tensors[name] = Planned(tuple(shape), np.dtype(np.float16), half,
                                    lambda name=name: ckpt.tensor(name).astype(np.float16))
        elif len(shape) == 2:
            tensors[name] = Planned((shape[0], shape[1] // 32 * 18), np.dtype(np.uint8), q4,
                                    lambda name=name: _q4_0_by_rows(ckpt.tensor(name)))
        else:
            tensors[name] = Planned(tuple(shape), np.dtype(np.float32), None, lambda name=name: ckpt.tensor(name))
    return write_gguf(path, cfg.architecture, cfg, tokens, types, tensors, merges=["\u0120 \u0120"],
                      file_type=FILE_TYPES[half] if f16 else MOSTLY_Q4_0)


def main() -> None:
    """Write the Q4_0 GGUF of a checkpoint folder or a preset made as a checkpoint, a tensor at
    a time: a 32B's file without its 65 GB bf16 checkpoint on disk (bench/scale.py --gguf)."""
    import argparse

    from qwc.models.load import open_checkpoint

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("source", help="a checkpoint folder, or a preset made as a checkpoint (qwen2.5-32b, qwen3-8b, ...)")
    p.add_argument("-o", "--output", type=Path, required=True)
    a = p.parse_args()
    partial = a.output.with_name(a.output.name + ".partial")
    try:
        write_gguf_q4_0_checkpoint(open_checkpoint(a.source), partial)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    partial.rename(a.output)


if __name__ == "__main__":
    main()
