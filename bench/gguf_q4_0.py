"""Write a qwc-loaded model as a llama.cpp GGUF with Q4_0 weights (embedding and tied lm_head
included, as in the contest runs), so llama.cpp runs the same weights as qwc.

Token ids are fed directly in the benchmark; the vocabulary is the preset's byte-level one,
padded with unused entries to the embedding's row count (llama.cpp wants them equal)."""

from __future__ import annotations

from pathlib import Path

from gguf import GGMLQuantizationType, TokenType
from gguf.quants import quantize

from qwc.models.gguf_writer import write_gguf

MOSTLY_Q4_0 = 2


def write_gguf_q4_0(lm, path: Path, head_bits: int = 4) -> Path:
    """Every linear Q4_0; the (tied) embedding / output Q4_0 or, with head_bits 8, Q8_0 (what
    llama.cpp's own quantizer keeps for a tied output by default)."""
    cfg = lm.config
    head = GGMLQuantizationType.Q4_0 if head_bits == 4 else GGMLQuantizationType.Q8_0
    vocab = sorted(lm.tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    pad = cfg.vocab_size - len(vocab)
    tokens = [t for t, _ in vocab] + [f"[PAD{i}]" for i in range(pad)]
    types = [TokenType.CONTROL if t.startswith("<|") else TokenType.NORMAL for t, _ in vocab]
    types += [TokenType.UNUSED] * pad
    tensors = {}
    for name, t in lm.model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        a = t.detach().float().numpy()
        kind = head if name in ("model.embed_tokens.weight", "lm_head.weight") else GGMLQuantizationType.Q4_0
        tensors[name] = (quantize(a, kind), kind) if a.ndim == 2 else (a, None)
    # llama.cpp refuses a BPE vocabulary without merges, even when ids are fed directly.
    return write_gguf(path, "qwen2", cfg, tokens, types, tensors, merges=["\u0120 \u0120"], file_type=MOSTLY_Q4_0)
