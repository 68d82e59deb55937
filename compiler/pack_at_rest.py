"""Which parameters params.bin stores at rest, smaller than the kernels read them, and their
stored bytes (the forms and the runtime's unpacking: qwc/params_at_rest.py).

The candidates are read off the graph: the sub-block scales and block offsets of a linear with
block offsets (a Q4_K's on ARM's sdot / smmla kernels where it keeps the expanded float32
form: compiler/repack_q4_k.py). Whether one is stored at rest is decided by its values: it is
packed, unpacked again as the runtime will, and kept so only if that gives back every bit
(else it is written as it is, and nothing else changes). Q6_K's codes are no longer a
candidate: every Q6_K kernel reads them at six bits (compiler/repack_q6_k.py); the runtime
still unpacks `six_bit` for artifacts compiled before.
"""

from __future__ import annotations

import numpy as np
import onnx

from qwc import weight_formats
from qwc.params_at_rest import FREE, ROWS, SUPER, stored_nbytes, unpack
from qwc.passes.graph import has_block_offsets


def _names(name: str) -> tuple[str, str]:
    """An initializer's names as the library's signature may have them: its own (a small one
    the importer keeps as a constant, then detached) or TVM's ONNX importer's sanitized one
    (a graph input: the large ones). One it had to make unique again is not found, and is
    written as it is."""
    clean = name.replace(".", "_")
    return name, clean if clean[:1].isalpha() or clean[:1] == "_" else "input_" + clean


def plan(model: onnx.ModelProto) -> dict[str, dict]:
    """Library parameter name -> its candidate at-rest form ({"form": ..., "scales": ...})."""
    out = {}
    for node in model.graph.node:
        if node.op_type != "MatMulNBits":
            continue
        if has_block_offsets(node) and weight_formats.format_of(node).name == "Q4_K" and len(node.input) > 3 and node.input[3]:
            for scales, offsets in zip(_names(node.input[2]), _names(node.input[3])):
                out[scales] = {"form": "q4_k_scales"}
                out[offsets] = {"form": "q4_k_offsets", "scales": scales}
    return out


def pack(spec: dict, value: np.ndarray, scales: np.ndarray | None = None) -> np.ndarray | None:
    """`value` in the at-rest form `spec` as uint8 bytes, or None where the form does not hold
    it to the bit (`scales`: an offsets' s, as the runtime will have loaded it)."""
    form = spec["form"]
    if stored_nbytes(form, str(value.dtype), value.shape) is None:
        return None
    if form == "q4_k_offsets":
        if scales is None or scales.dtype != np.float32 or scales.shape != value.shape:
            return None
        stored = _offsets_factored(value, scales)
    else:
        stored = _factored(value)
        if stored is None and (value == 1).any():   # free blocks among others
            stored = _factored(value, free=value == 1)
    if stored is None:
        return None
    back = np.empty_like(value)
    unpack(form, stored, back, scales)
    return stored if np.array_equal(back.view(np.uint8), value.view(np.uint8)) else None


def _super_rows(v: np.ndarray) -> np.ndarray:
    """[G, B, 16] -> [G 16, B/8, 8]: each row's super-blocks."""
    g, b, r = v.shape
    return np.ascontiguousarray(v.reshape(g, b // SUPER, SUPER, r).transpose(0, 3, 1, 2).reshape(g * r, b // SUPER, SUPER))


def _from_super_rows(q: np.ndarray, f: np.ndarray, shape) -> np.ndarray:
    """The integers [G 16, B/8, 8] and factors [G 16, B/8] -> the stored bytes (sc or mn
    uint8 [G, B, 16], then d or dmin float16 [G, B/8, 16])."""
    g, b, r = shape
    q = q.reshape(g, r, b // SUPER, SUPER).transpose(0, 2, 3, 1).reshape(g, b, r)
    f = f.reshape(g, r, b // SUPER).transpose(0, 2, 1).astype(np.float16)
    return np.concatenate([np.ascontiguousarray(q).reshape(-1), np.ascontiguousarray(f).reshape(-1).view(np.uint8)])


def _factored(v: np.ndarray, free: np.ndarray | None = None) -> np.ndarray | None:
    """float32 [G, B, 16], each row's super-blocks of eight a float16 times 0..63 -> its
    stored bytes (_from_super_rows), or None where some super-block has no such pair. `free`
    blocks are left out of the search and marked FREE."""
    from qwc.models.gguf_blocks import six_bit_factors

    assert v.shape[2] == ROWS
    f, q = six_bit_factors(_super_rows(v if free is None else np.where(free, np.float32(0), v)))
    if f is None:
        return None
    if free is not None:
        q = np.where(_super_rows(free), np.uint8(FREE), q)
    return _from_super_rows(q, f, v.shape)


def _offsets_factored(c: np.ndarray, s: np.ndarray) -> np.ndarray | None:
    """Offsets c = m + 8 s rounded once, float32 [G, B, 16] -> the stored bytes of m = -dmin mn
    (_from_super_rows), or None. m is c - 8 s only up to that rounding (a free block's c is
    m + 8), so each super-block's dmin is sought as an fp16 of its largest -m over 63, 62, ...
    with each mn the nearest integer, until c comes back to the bit."""
    cs, ss = _super_rows(c).reshape(-1, SUPER), _super_rows(s).reshape(-1, SUPER).astype(np.float64)
    v = -(cs.astype(np.float64) - 8 * ss)
    top = v.max(-1)
    f, q = np.zeros(top.shape, np.float32), np.zeros(v.shape, np.uint8)
    todo = np.arange(top.size)   # the super-blocks not found yet
    for j in range(63, 0, -1):
        cand = np.where(top[todo] > 0, top[todo] / j, 0).astype(np.float16).astype(np.float32)[:, None]
        n = np.clip(np.rint(np.divide(v[todo], cand, out=np.zeros(v[todo].shape), where=cand > 0)), 0, 63)
        ok = ((-(cand.astype(np.float64) * n) + 8 * ss[todo]).astype(np.float32) == cs[todo]).all(-1)
        f[todo[ok]], q[todo[ok]] = cand[ok, 0], n[ok].astype(np.uint8)
        todo = todo[~ok]
        if not todo.size:
            g, b, r = c.shape
            return _from_super_rows(q.reshape(g * r, b // SUPER, SUPER), f.reshape(g * r, b // SUPER), c.shape)
    return None
