"""GPTQ before Q4_0 (Frantar et al., 2022), as a graph pass: `qwc optimize --gptq`.

Round-to-nearest quantizes each weight on its own. GPTQ quantizes a linear's input channels
one at a time and moves each one's rounding error onto the channels not yet quantized, weighted
by how the calibration activations X correlate them (the Hessian H = X^T X of the layer's
squared output error): the output error || X W - X Q ||^2 is what it minimises, not the weights'
own error. Per Q4_0 block of 32 input channels the scale is taken from the block's weights as
they stand when GPTQ reaches the block (after the earlier blocks' error has been moved onto
them): Q4_0's rule, shrunk where that rounds the block better by the Hessian's diagonal
(block_scale); the codes then follow column by column.

The result is ordinary Q4_0: this pass writes each linear's MatMulNBits itself (codes and
scales; `quantize_q4_0` again on the result could pick other scales, since a block's largest
weight may have moved before its turn), so no kernel changes. It runs after AWQ (`--awq
--gptq`: the activation-aware scales first, then GPTQ on the scaled graph) and before the plain
quantization, which takes what is left (the embedding, --q8 / --keep-float linears).
Activations are the float graph's, run in onnxruntime on calibration text (one Hessian per
input tensor, shared by q/k/v and by gate/up); the lm_head stays with the embedding's pass.
"""

from __future__ import annotations

import fnmatch

import numpy as np
import onnx

from qwc import progress
from qwc.q4 import pack_nibbles, quantize_q4_0

from .graph import Graph
from .naming import module_name
from .options import PassOptions
from .quantize_linears import check_quantizable, emit_matmul_nbits

DAMP = 0.01        # of the Hessian's mean diagonal, added to it: GPTQ's default
BLOCK = 32         # Q4_0's
LAZY = 128         # columns whose updates are batched (GPTQ's lazy batch)
WINDOW = 512       # tokens per calibration prefill
SHRINK = tuple(1 - i / 40 for i in range(9))   # block scale factors searched, 1 (Q4_0's rule) to 0.8


def hessians(model: onnx.ModelProto, tensors: list[str], ids: np.ndarray, options: PassOptions) -> dict:
    """X^T X / tokens of each tensor over prefills of WINDOW tokens of `ids`, in onnxruntime."""
    from .verify import calibration_windows

    cfg = options.require_config("GPTQ calibration")
    h = {t: 0.0 for t in tensors}
    count = 0
    for outs in calibration_windows(model, tensors, ids, cfg, WINDOW, "GPTQ calibration"):
        for t, x in outs.items():
            x = x.astype(np.float64)
            h[t] = h[t] + x.T @ x
        count += len(next(iter(outs.values())))
    return {t: (v / count) for t, v in h.items()}


def block_scale(wb: np.ndarray, importance: np.ndarray) -> np.ndarray:
    """Each row's Q4_0 scale for its block wb [N, 32]: Q4_0's rule (d = m / -8, m the element of
    largest magnitude) shrunk by the factor in SHRINK that leaves the smallest round-to-nearest
    error weighted by the channels' importance (the Hessian's diagonal), as llama.cpp's
    importance-matrix quantizer searches its scales."""
    _, d0 = quantize_q4_0(wb.astype(np.float32), BLOCK)
    best, best_err = d0[:, 0], None
    for f in SHRINK:
        d = (d0[:, 0] * np.float32(f)).astype(np.float16).astype(np.float32).astype(np.float64)
        inv = np.where(d != 0, 1 / np.where(d != 0, d, 1), 0)
        q = np.clip(np.floor(wb * inv[:, None] + 8.5), 0, 15) - 8
        err = ((wb - q * d[:, None]) ** 2 * importance).sum(axis=1)
        if best_err is None:
            best_err = err
            continue
        better = err < best_err
        best = np.where(better, d.astype(np.float32), best)
        best_err = np.where(better, err, best_err)
    return best


def quantize(w_nk: np.ndarray, hessian: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """GPTQ of W [N, K] with H [K, K] -> Q4_0 codes q (0..15) [N, K/32, 32] and scales [N, K/32]."""
    n, k = w_nk.shape
    scales = np.zeros((n, k // BLOCK), np.float32)

    def start(col, ahead, importance):   # a block: its scale from its weights as they stand now
        scales[:, col // BLOCK] = block_scale(ahead, importance)

    def round_column(col, x):
        d = scales[:, col // BLOCK].astype(np.float64)
        inv = np.where(d != 0, 1 / np.where(d != 0, d, 1), 0)
        q = np.clip(np.floor(x * inv + 8.5), 0, 15)          # Q4_0's rounding
        return q, (q - 8) * d

    codes = _columns(w_nk, hessian, BLOCK, start, round_column)
    return codes.reshape(n, k // BLOCK, BLOCK).astype(np.uint8), scales


def quantize_k(w_nk: np.ndarray, hessian: np.ndarray, fmt: str) -> np.ndarray:
    """GPTQ of W [N, K] with H [K, K] into a K-quant mix's format ("Q4_K" or "Q5_0") -> the
    GGUF bytes [N, ...] (qwc/kquants.py). A group's parameters are searched when GPTQ reaches
    it, from its weights as they stand then, with the Hessian's diagonal as the importance (a
    Q4_K super-block of 256 columns: the 8 sub-blocks' steps and minimums; a Q5_0 block of 32:
    its scale); the codes then follow column by column."""
    from qwc import kquants

    n, k = w_nk.shape
    params: list[tuple] = []
    steps: list[np.ndarray] = []   # the current Q4_K super-block's steps and minimums, [N, 8] each

    def start(col, ahead, importance):
        if fmt == "Q4_K":
            params.append(kquants.q4_k_params(ahead, importance))
            steps[:] = [a.reshape(n, 8) for a in kquants.q4_k_steps(*params[-1])]
        else:
            params.append((kquants.q5_0_scales(ahead, importance),))

    def round_column(col, x):
        if fmt == "Q4_K":
            sub = (col % kquants.SUPER) // BLOCK
            s, m = steps[0][:, sub], steps[1][:, sub]
            q = np.where(s > 0, np.clip(np.rint((x + m) / np.where(s > 0, s, 1)), 0, 15), 0)
            return q, q * s - m
        d = params[-1][0]
        q = np.where(d != 0, np.clip(np.rint(x / np.where(d != 0, d, 1)), -16, 15), 0)
        return q, q * d

    codes = _columns(w_nk, hessian, kquants.SUPER if fmt == "Q4_K" else BLOCK, start, round_column)
    if fmt == "Q4_K":
        d, dmin, sc, mn = (np.stack([p[j] for p in params], axis=1) for j in range(4))   # [N, S(, 8)]
        raw = kquants.pack_q4_k(d.reshape(-1), dmin.reshape(-1), sc.reshape(-1, 8), mn.reshape(-1, 8),
                                codes.reshape(-1, kquants.SUPER))
    else:
        d = np.stack([p[0] for p in params], axis=1)   # [N, K/32]
        raw = kquants.pack_q5_0(d.reshape(-1), codes.reshape(-1, BLOCK))
    return raw.reshape(n, -1)


def _columns(w_nk: np.ndarray, hessian: np.ndarray, group: int, start, round_column) -> np.ndarray:
    """GPTQ's column loop, in lazy batches of LAZY columns: at each group's first column
    `start(col, its weights [N, group] as they stand now, their importance [group])`; each
    column's codes and values from `round_column(col, x [N]) -> (q, dequantized)`, and its
    rounding error moved onto the columns not yet quantized. Returns the codes [N, K]."""
    w, h, hinv = _prepared(w_nk, hessian)
    n, k = w.shape
    diag = np.diag(h)
    codes = np.zeros((n, k), np.int16)
    for c0 in range(0, k, LAZY):
        c1 = min(c0 + LAZY, k)
        wb = w[:, c0:c1].copy()
        err = np.zeros_like(wb)
        for i in range(c1 - c0):
            col = c0 + i
            if col % group == 0:
                ahead = np.concatenate([wb[:, i:], w[:, c1:col + group]], axis=1)[:, :group]
                start(col, ahead, diag[col:col + group])
            q, deq = round_column(col, wb[:, i])
            codes[:, col] = q
            e = (wb[:, i] - deq) / hinv[col, col]
            wb[:, i + 1:] -= np.outer(e, hinv[col, col + 1:c1])
            err[:, i] = e
        w[:, c1:] -= err @ hinv[c0:c1, c1:]
    return codes


def _prepared(w_nk: np.ndarray, hessian: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """W as float64 with the channels calibration never saw zeroed, H damped, and the upper
    Cholesky factor of H^-1 (row i: how channel i's error spreads to the later ones)."""
    w = w_nk.astype(np.float64).copy()
    h = hessian.astype(np.float64).copy()
    dead = np.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    h[np.diag_indices(len(h))] += DAMP * np.mean(np.diag(h))
    return w, h, np.linalg.cholesky(np.linalg.inv(h)).T


def run(model: onnx.ModelProto, options: PassOptions | None = None) -> onnx.ModelProto:
    options = options or PassOptions()
    if options.gptq_calibration is None or options.format != "q4_0":
        return model   # a K-quant mix runs its GPTQ as it quantizes (quantize_kquants.py)
    g = Graph(model)
    todo = []
    for n in g.g.node:
        if n.op_type != "MatMul" or n.domain not in ("", "ai.onnx") or g.const(n.input[0]) is not None:
            continue
        w = g.const(n.input[1])
        name = module_name(n)
        if (w is None or w.ndim != 2 or w.shape[0] % BLOCK or name == "lm_head" or options.bits == 8
                or any(fnmatch.fnmatch(name, p) for p in options.keep_float + options.q8)):
            continue
        todo.append((n, name))
    if not todo:
        return model
    hs = hessians(model, sorted({n.input[0] for n, _ in todo}), options.gptq_calibration, options)
    for n, name in progress.bar(todo, desc="GPTQ", unit="linear"):
        w = g.const(n.input[1]).T                        # [N, K]
        check_quantizable(w, name)
        q, d = quantize(w, hs[n.input[0]])
        packed = g.add_init(pack_nibbles(q), f"{name}.qweight")
        scales = g.add_init(d, f"{name}.scales")
        emit_matmul_nbits(g, n, w, BLOCK, name, packed=packed, scales=scales)
    progress.info(f"[qwc]   GPTQ: {len(todo)} linears from {len(hs)} Hessians")
    g.commit()
    return model
