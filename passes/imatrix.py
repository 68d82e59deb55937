"""Importance matrices for the K-quant search (qwc/kquants.py): per linear, the mean square of
each input channel's activations on calibration text. Two sources, keyed alike by module name
("model.layers.0.self_attn.q_proj"):

- `from_calibration`: qwc's own, from the fused float graph run in onnxruntime on `--calib`
  text (the windows passes/awq.py and passes/gptq.py calibrate on); linears reading the same
  tensor (q/k/v, gate/up) share one;
- `read_llamacpp`: a file written by llama.cpp's `llama-imatrix`, in either of its formats
  (GGUF, its default for a `.gguf` name: `<tensor>.in_sum2` and `<tensor>.counts`; the legacy
  binary one: entries of name, call count and the values), by GGUF tensor name.

Only each channel's relative weight within a linear matters to the search, so the two
formats' different normalisations (a mean, or a mean times a call count) are equivalent.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import onnx

from qwc.errors import QwcError

WINDOW = 512   # tokens per calibration prefill


def from_calibration(model: onnx.ModelProto, tensors: list[str], ids: np.ndarray, options) -> dict[str, np.ndarray]:
    """{tensor: mean of x^2 per channel [K]} over prefills of WINDOW tokens of `ids`."""
    from .verify import calibration_windows

    cfg = options.require_config("the importance matrix's calibration")
    sums = {t: 0.0 for t in tensors}
    count = 0
    for outs in calibration_windows(model, tensors, ids, cfg, WINDOW, "importance matrix"):
        for t, x in outs.items():
            sums[t] = sums[t] + np.square(x.astype(np.float64)).sum(axis=0)
        count += len(next(iter(outs.values())))
    return {t: v / max(count, 1) for t, v in sums.items()}


def read_llamacpp(path: str | Path) -> dict[str, np.ndarray]:
    """{module name: importance [K]} from llama-imatrix's file (GGUF or legacy)."""
    path = Path(path)
    if path.is_dir():
        raise QwcError(f"--imatrix {path}: a directory, not an importance matrix file (llama-imatrix writes one "
                       "file: imatrix.gguf or imatrix.dat)")
    if not path.is_file():
        raise QwcError(f"--imatrix {path}: no such file")
    with path.open("rb") as f:
        magic = f.read(4)
    try:
        raw = _read_gguf(path) if magic == b"GGUF" else _read_legacy(path)
    except (ValueError, struct.error, UnicodeDecodeError, IndexError) as e:
        raise QwcError(f"--imatrix {path}: not an importance matrix llama-imatrix wrote ({e})") from None
    from qwc.models.gguf_loader import hf_name

    out = {}
    for name, v in raw.items():
        hf = hf_name(name)
        if hf is None or not hf.endswith(".weight"):
            continue
        if not np.isfinite(v).all() or (v < 0).any():
            raise QwcError(f"--imatrix {path}: {name} holds negative, NaN or infinite values")
        out[hf.removesuffix(".weight")] = v.astype(np.float64)
    if not out:
        raise QwcError(f"--imatrix {path}: no entry names a Qwen2 / Llama linear (blk.N.attn_q.weight, ...)")
    return out


def _read_gguf(path: Path) -> dict[str, np.ndarray]:
    from gguf import GGUFReader

    r = GGUFReader(path)
    tensors = {t.name: np.asarray(t.data, np.float64).reshape(-1) for t in r.tensors}
    out = {}
    for name, sums in tensors.items():
        if not name.endswith(".in_sum2"):
            continue
        stem = name.removesuffix(".in_sum2")
        counts = tensors.get(stem + ".counts")
        if counts is None or counts.size != 1:
            raise ValueError(f"{stem} has no single .counts entry (an expert-split matrix?)")
        out[stem] = sums / max(float(counts[0]), 1.0)
    return out


def _read_legacy(path: Path) -> dict[str, np.ndarray]:
    data = path.read_bytes()
    at = 0

    def take(fmt: str):
        nonlocal at
        vals = struct.unpack_from(fmt, data, at)
        at += struct.calcsize(fmt)
        return vals

    (entries,) = take("<i")
    if not 0 < entries < 1 << 20:
        raise ValueError(f"{entries} entries")
    out = {}
    for _ in range(entries):
        (length,) = take("<i")
        if not 0 < length < 1024:
            raise ValueError(f"a name of {length} bytes")
        name = data[at:at + length].decode()
        at += length
        _ncall, nval = take("<ii")
        if not 0 < nval < 1 << 24 or at + 4 * nval > len(data):
            raise ValueError(f"{name}: {nval} values past the end of the file")
        out[name] = np.frombuffer(data, "<f4", nval, at).astype(np.float64)
        at += 4 * nval
    return out
