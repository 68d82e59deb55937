"""Adapters merged into a base checkpoint before export, a tensor at a time.

- LoRA: W' = W + s·B·A in float32, before any quantization. A GGUF base's quantized weight that
  an adapter touches becomes float (the passes quantize it); the others stay as the file has them.
- QA-LoRA: the base is its 4-bit blocks (a GGUF's Q4_0 / Q4_1, or qwc's Q4_0 of a float
  weight: `qa_base_blocks`, what `qwc lora --qa` trained against). The adapter adds one number
  to every weight of a block (qwc/adapter_files.py), so the merge moves each block's minimum m of
  w = d·q + m and nothing else: the codes and scales stay byte for byte and every adapted linear
  is Q4_1. A Q4_0 block is the Q4_1 block with m = -8·d (exact in float16: a power-of-two
  multiple of d). The new m is rounded to float16, as Q4_1 stores it: the merge's only loss.

The result is a Checkpoint like any other, so the streaming exporter writes it unchanged.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import TYPE_CHECKING

import numpy as np

from qwc import progress
from qwc.adapter_files import QA_GROUP, Adapter, linear_shapes
from qwc.errors import QwcError
from qwc.q4 import pack_nibbles, quantize_q4_0

from .checkpoint import Checkpoint, expected_tensors
from .gguf_blocks import Blocks, dequantize, q4_1_mins

if TYPE_CHECKING:
    from .qwen2 import LoadedModel


def checkpoint_of(lm: LoadedModel, source: str) -> Checkpoint:
    """A model built in torch (a preset) as a Checkpoint, so adapters merge the same way."""
    state = lm.model.state_dict()
    names = expected_tensors(lm.config)
    return Checkpoint(lm.config, lm.tokenizer, source, {k: tuple(state[k].shape) for k in names},
                      lambda name: state[name].detach().float().numpy().copy())


def qa_base_blocks(ckpt: Checkpoint, name: str) -> Blocks:
    """The 4-bit blocks QA-LoRA trains against and merges into: the file's own Q4_0 / Q4_1, or
    qwc's Q4_0 of a float weight (the blocks `qwc optimize` writes by default)."""
    kind = ckpt.quant_types.get(name)
    if kind is None:
        q, d = quantize_q4_0(ckpt.tensor(name), QA_GROUP)
        return Blocks("Q4_0", pack_nibbles(q), d)
    if kind not in ("Q4_0", "Q4_1"):
        raise QwcError(f"{ckpt.source}: {name} is {kind}; QA-LoRA needs a 4-bit base of Q4_0 or Q4_1 blocks "
                       "(a GGUF whose linears are Q4_0 or Q4_1, or a float checkpoint)")
    return ckpt.blocks(name)


def base_fingerprint(ckpt: Checkpoint, names) -> str:
    """sha256 of the 4-bit blocks of `names`: a QA adapter merges only into the base it trained on."""
    h = hashlib.sha256()
    for name in sorted(names):
        b = qa_base_blocks(ckpt, name)
        for a in (b.codes, b.scales, b.zero_points):
            if a is not None:
                h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def block_minimums(b: Blocks) -> np.ndarray:
    """m of w = d·q + m for every block, float32 (exact float16 values)."""
    if b.fmt == "Q4_0":
        return (-8 * b.scales).astype(np.float32)
    if b.fmt == "Q4_1":
        return q4_1_mins(b.scales, b.zero_points)
    raise QwcError(f"{b.fmt} blocks have no minimum to move")


def shift_minimums(b: Blocks, per_weight: np.ndarray, name: str) -> Blocks:
    """`b` as Q4_1 with `per_weight` [N, K/32] added to each block's minimum."""
    if (b.scales == 0).any():
        raise QwcError(f"{name}: a block with scale 0 cannot carry a moved minimum in Q4_1's (d, zero point) form")
    m = (block_minimums(b) + per_weight).astype(np.float16)
    if not np.isfinite(m).all():
        raise QwcError(f"{name}: a merged block minimum overflows float16 (the adapter's scale is too large)")
    m = m.astype(np.float32)
    zp = (-m / b.scales).astype(np.float32)
    back = q4_1_mins(b.scales, zp)
    bad = back.view(np.uint32) != m.view(np.uint32)
    if bad.any():   # the nearest float32 zero point misses by an ulp: step it until d·zp rounds to m
        zp[bad] = np.nextafter(zp[bad], np.where(back[bad] > m[bad], np.inf, -np.inf).astype(np.float32))
        if (q4_1_mins(b.scales, zp).view(np.uint32) != m.view(np.uint32)).any():
            raise QwcError(f"{name}: merged block minimums do not survive as float zero points")
    return Blocks("Q4_1", b.codes, b.scales, zp)


def qa_per_weight(ad_pairs, k: int) -> np.ndarray:
    """What QA-LoRA pairs add to each weight of each block: peft pools a block as its mean times
    the number of blocks, so a block's sum is weighed by (K / G) / G."""
    nb = k // QA_GROUP
    return sum(p.delta() for p in ad_pairs) * np.float32(nb / QA_GROUP)


def check_bases(ckpt: Checkpoint, qa_adapters: list[Adapter]) -> None:
    """A QA adapter that qwc lora trained records its 4-bit base; it merges into that base only
    (another quantization of the same weights would move other blocks' minimums)."""
    recorded = {ad.base_sha256 for ad in qa_adapters} - {None}
    if not recorded:
        return
    have = base_fingerprint(ckpt, linear_shapes(ckpt.config))
    for ad in qa_adapters:
        if ad.base_sha256 not in (None, have):
            raise QwcError(f"{ad.path}: this QA-LoRA adapter was trained on other 4-bit blocks than {ckpt.source}'s "
                           "(another base, or another quantization of it)")


def merge(ckpt: Checkpoint, adapters: list[Adapter]) -> Checkpoint:
    """`ckpt` with every adapter merged; nothing is read until the exporter asks."""
    shapes = linear_shapes(ckpt.config)
    float_pairs: dict[str, list] = {}
    qa_pairs: dict[str, list] = {}
    for ad in adapters:
        into = qa_pairs if ad.kind == "qalora" else float_pairs
        for name, p in ad.pairs.items():
            into.setdefault(name, []).append(p)
    both = sorted(set(float_pairs) & set(qa_pairs))
    if both:
        raise QwcError(f"{both[0]} has both a LoRA and a QA-LoRA adapter; QA-LoRA merges into 4-bit blocks, "
                       "LoRA into float weights: merge one kind at a time")
    check_bases(ckpt, [ad for ad in adapters if ad.kind == "qalora"])
    for ad in adapters:
        progress.info(f"[qwc] merging {ad.describe()}")
    read_base, blocks_base = ckpt.tensor, ckpt.blocks
    # with QA-LoRA every linear is the 4-bit base it trained against, adapted or not
    as_trained = {n for n in shapes if n not in qa_pairs and n not in ckpt.quant_types} if qa_pairs else set()
    quant = {k: v for k, v in ckpt.quant_types.items() if k not in float_pairs}
    quant.update({k: "Q4_1" for k in qa_pairs})
    quant.update({k: "Q4_0" for k in as_trained})

    def read_blocks(name: str) -> Blocks:
        if name in qa_pairs:
            return shift_minimums(qa_base_blocks(ckpt, name), qa_per_weight(qa_pairs[name], shapes[name][1]), name)
        if name in as_trained:
            return qa_base_blocks(ckpt, name)
        return blocks_base(name)

    def read(name: str) -> np.ndarray:
        if name in qa_pairs or name in as_trained:
            return dequantize(read_blocks(name))
        w = read_base(name)
        for p in float_pairs.get(name, ()):
            w = w + p.delta()
        return w

    return dataclasses.replace(ckpt, read=read, quant_types=quant,
                               read_blocks=read_blocks if (qa_pairs or ckpt.read_blocks) else None)
