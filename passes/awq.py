"""Activation-aware scales before Q4_0 (AWQ: Lin et al., 2023), as a graph pass.

A linear's error after quantization is what its input makes of the weight's error: input
channels that carry large activations turn small weight errors into large output errors. For
a group of linears that read one input X (q, k and v after the input norm; gate and up after
the post-attention norm; down after up, whose input is silu(gate) * up) this pass picks per
input channel c a scale s_c = mean|x_c|^alpha, multiplies row c of every weight in the group
by s_c and divides the producer of X by it (the norm's gain, or up's output column c), so
the float model computes the same thing. Quantizing diag(s) W then spends the Q4_0 grid where
the activations are large. alpha is searched on a grid per group, minimising the group's
output error on calibration text:

    || X W - (X / s) Q4_0(diag(s) W) ||^2

alpha = 0 is plain quantization, so no group gets worse on the calibration text. The result is
ordinary Q4_0 (the scales live in the norm gains and the up weights): no kernel changes.

A group whose weights already sit on the Q4_0 grid (a QAT checkpoint) is left alone: scaling
it would move trained weights off the grid. Runs after the fusions (the graph's norms are
SimplifiedLayerNormalization / SkipSimplifiedLayerNormalization) and before quantization;
the calibration runs the float graph in onnxruntime.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx

from qwc import progress
from qwc.q4 import fake_quantize_q4_0

from .graph import Graph, mark_rescaled_inputs
from .options import PassOptions

ALPHAS = tuple(i / 10 for i in range(11))   # the search grid (the AWQ paper searches 20 points)
LOSS_ROWS = 512                              # calibration tokens the error is measured on, per group
WINDOW = 512                                 # tokens per calibration prefill
_NORMS = {("", "SimplifiedLayerNormalization"): 1, ("com.microsoft", "SkipSimplifiedLayerNormalization"): 2}


@dataclass
class _Group:
    x: str                              # the tensor every linear of the group reads
    linears: list[onnx.NodeProto]       # MatMul(x, W [K, N] constant)
    # where 1/s goes: ("gain", norm node, input index) or ("columns", up MatMul node)
    producer: tuple


def _linear_weight(g: Graph, n: onnx.NodeProto, x: str) -> np.ndarray | None:
    if n.op_type != "MatMul" or n.domain not in ("", "ai.onnx") or n.input[0] != x:
        return None
    w = g.const(n.input[1])
    return w if w is not None and w.ndim == 2 and w.dtype == np.float32 else None


def _readers(g: Graph, x: str) -> list[onnx.NodeProto] | None:
    """The MatMuls with constant weights that read x, or None if anything else reads it."""
    out = []
    for c in g.consumers.get(x, []):
        if c.op_type in ("Shape", "Size"):
            continue
        if _linear_weight(g, c, x) is None:
            return None
        out.append(c)
    return out if out and x not in g.graph_outputs else None


def _up_of_down(g: Graph, down: onnx.NodeProto) -> onnx.NodeProto | None:
    """The up MatMul when down's input is Mul(silu(gate), up) with up a constant-weight
    MatMul read by nothing else, else None."""
    mul = g.producer.get(down.input[0])
    if mul is None or mul.op_type != "Mul":
        return None
    for name in mul.input:
        up = g.producer.get(name)
        if up is not None and _linear_weight(g, up, up.input[0]) is not None and len(g.consumers.get(name, [])) == 1:
            other = next(i for i in mul.input if i != name)
            gate_side = g.producer.get(other)
            if gate_side is not None and gate_side.op_type == "Mul":   # silu(gate) = gate * sigmoid(gate)
                return up
    return None


def groups(g: Graph) -> list[_Group]:
    """The linear groups AWQ scales, in graph order."""
    out = []
    for n in g.g.node:
        k = _NORMS.get((n.domain, n.op_type))
        if k is not None and len(n.input) > k and g.const(n.input[k]) is not None:
            readers = _readers(g, n.output[0])
            if readers:
                out.append(_Group(n.output[0], readers, ("gain", n, k)))
        elif n.op_type == "MatMul" and _linear_weight(g, n, n.input[0]) is not None:
            up = _up_of_down(g, n)
            if up is not None and _readers(g, n.input[0]) == [n]:
                out.append(_Group(n.input[0], [n], ("columns", up)))
    return out


def _on_grid(w: np.ndarray, block: int) -> bool:
    """Whether W [K, N] is already a Q4_0 weight (a QAT checkpoint's)."""
    fq = fake_quantize_q4_0(w.T, block)
    return bool(np.allclose(fq, w.T, rtol=0, atol=1e-6 * max(float(np.abs(w).max()), 1e-30)))


def calibrate(model: onnx.ModelProto, tensors: list[str], ids: np.ndarray, options: PassOptions, seed: int = 0):
    """(mean |x| per channel, LOSS_ROWS sampled rows) of each tensor over prefills of WINDOW
    tokens of `ids`, run in onnxruntime on the graph as it is."""
    from .verify import calibration_windows

    windows = max(1, len(ids) // WINDOW)
    rng = np.random.default_rng(seed)
    sums = {t: 0.0 for t in tensors}
    rows = {t: [] for t in tensors}
    cfg = options.require_config("AWQ calibration")
    per_window = -(-LOSS_ROWS // windows)
    for outs in calibration_windows(model, tensors, ids, cfg, WINDOW, "AWQ calibration"):
        for t in tensors:
            x = outs[t]
            sums[t] = sums[t] + np.abs(x).sum(axis=0)
            rows[t].append(x[rng.choice(len(x), min(per_window, len(x)), replace=False)])
    count = windows * min(WINDOW, len(ids))
    return {t: (sums[t] / count, np.concatenate(rows[t])[:LOSS_ROWS]) for t in tensors}


def search(x_rows: np.ndarray, mean_abs: np.ndarray, weights: list[np.ndarray], block: int):
    """(alpha, s) minimising the group's output error after Q4_0, and the errors per alpha."""
    x = x_rows.astype(np.float32)
    w = np.concatenate(weights, axis=1)                  # [K, sum N]
    ref = x @ w
    best, errors = None, []
    for alpha in ALPHAS:
        s = np.power(np.maximum(mean_abs, 1e-8), alpha).astype(np.float32)
        s = s / np.sqrt(s.max() * s.min())               # centred around 1 (AWQ's normalisation)
        q = fake_quantize_q4_0((w * s[:, None]).T, block).T
        err = float(np.mean((ref - (x / s) @ q) ** 2))
        errors.append(err)
        if best is None or err < best[0]:
            best = (err, alpha, s)
    return best[1], best[2], errors


def run(model: onnx.ModelProto, options: PassOptions | None = None) -> onnx.ModelProto:
    options = options or PassOptions()
    if options.awq_calibration is None:
        return model
    g = Graph(model)
    todo = []
    for grp in groups(g):
        ws = [g.const(n.input[1]) for n in grp.linears]
        if all(_on_grid(w, options.block_size) for w in ws):
            continue   # QAT'd: already quantized, scaling would move it off the grid
        todo.append((grp, ws))
    if not todo:
        progress.info("[qwc]   AWQ: every linear is already on the Q4_0 grid (a QAT checkpoint): nothing to scale")
        return model
    stats = calibrate(model, [grp.x for grp, _ in todo], options.awq_calibration, options)
    chosen = []
    for grp, ws in progress.bar(todo, desc="AWQ search", unit="group"):
        mean_abs, rows = stats[grp.x]
        alpha, s, _ = search(rows, mean_abs, ws, options.block_size)
        chosen.append(alpha)
        if alpha == 0:
            continue
        for n, w in zip(grp.linears, ws):
            n.input[1] = g.add_init((w * s[:, None]).astype(np.float32), n.input[1] + "_awq")
        if grp.producer[0] == "gain":
            _, norm, k = grp.producer
            norm.input[k] = g.add_init((g.const(norm.input[k]) / s).astype(np.float32), norm.input[k] + "_awq")
        else:
            up = grp.producer[1]
            up.input[1] = g.add_init((g.const(up.input[1]) / s[None, :]).astype(np.float32), up.input[1] + "_awq")
    progress.info(f"[qwc]   AWQ: {len(chosen)} groups scaled, alpha median {np.median(chosen):.1f} "
                  f"(0 for {chosen.count(0)} of them)")
    g.commit()
    if any(chosen):
        mark_rescaled_inputs(model, "awq")
    return model
