"""Run two graphs on the same inputs with onnxruntime and report how far apart they are.

Graphs of both cache conventions are driven the same way, prefill then decode steps:
exported graphs take a growing cache (present fed back as past); canonical graphs, whose
GroupQueryAttention writes a preallocated buffer, take a fixed [batch, kv_heads, ctx,
head_dim] buffer and an attention mask as long as the tokens so far.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from qwc.config import ModelConfig

_PROTO_LIMIT = 1_800_000_000


def session(model: onnx.ModelProto | str | Path):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    if isinstance(model, (str, Path)):
        return ort.InferenceSession(str(model), so, providers=["CPUExecutionProvider"])
    if model.ByteSize() < _PROTO_LIMIT:
        return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    with tempfile.TemporaryDirectory() as d:  # too large for one protobuf: go through a file
        path = os.path.join(d, "m.onnx")
        onnx.save(model, path, save_as_external_data=True, location="m.onnx.data")
        return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])


def uses_cache_buffer(sess) -> bool:
    """Canonical graphs name the cache length `cache_len` (see fuse_attention)."""
    for i in sess.get_inputs():
        if i.name.startswith("past_key_values."):
            return i.shape[2] == "cache_len"
    return False


def run_steps(sess, cfg: ModelConfig, steps: list[np.ndarray], ctx: int = 64,
              capture: dict | None = None) -> list[np.ndarray]:
    """Logits for each chunk of `steps` (int arrays [batch, n]) fed one after another;
    `capture` (a dict) gets every output of the last step by name."""
    b = steps[0].shape[0]
    buffer = uses_cache_buffer(sess)
    names = [o.name for o in sess.get_outputs()]
    n_layers = sum(1 for n in names if n.startswith("present.") and n.endswith(".key"))
    kv = {f"past_key_values.{i}.{k}": np.zeros((b, cfg.num_key_value_heads, ctx if buffer else 0, cfg.head_dim),
                                                np.float32)
          for i in range(n_layers) for k in ("key", "value")}
    outs, past = [], 0
    for ids in steps:
        s = ids.shape[1]
        feeds = {"input_ids": ids.astype(np.int64),
                 "attention_mask": np.ones((b, past + s), np.int64),
                 "position_ids": np.broadcast_to(np.arange(past, past + s), (b, s)).astype(np.int64),
                 **kv}
        res = dict(zip(names, sess.run(None, feeds)))
        outs.append(res["logits"])
        if capture is not None:
            capture.update(res)
        kv = {f"past_key_values.{i}.{k}": res[f"present.{i}.{k}"] for i in range(n_layers) for k in ("key", "value")}
        past += s
    return outs


def calibration_windows(model: onnx.ModelProto, tensors: list[str], ids: np.ndarray, cfg: ModelConfig,
                        window: int, desc: str):
    """Prefills of `window` tokens of `ids` in onnxruntime on a copy of `model` that outputs
    `tensors` too: yields each window's {tensor: [tokens, width] float32} (the calibration of
    passes/awq.py and passes/gptq.py)."""
    from qwc import progress

    from .graph import tensor_array

    m = onnx.ModelProto()
    m.CopyFrom(model)
    # onnxruntime reads external data only by paths relative to a model file; a lazily
    # loaded graph's (absolute) are read into the copy
    for t in m.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            t.CopyFrom(onnx.numpy_helper.from_array(tensor_array(t), t.name))
    known = {o.name for o in m.graph.output}
    m.graph.output.extend(onnx.helper.make_tensor_value_info(t, onnx.TensorProto.FLOAT, None)
                          for t in tensors if t not in known)
    sess = session(m)
    for w in progress.bar(range(max(1, len(ids) // window)), desc=desc, unit="window"):
        chunk = ids[w * window:(w + 1) * window][None, :]
        outs = {}
        run_steps(sess, cfg, [chunk], ctx=chunk.shape[1], capture=outs)
        yield {t: outs[t].reshape(-1, outs[t].shape[-1]) for t in tensors}


@dataclass
class Report:
    max_abs: float
    max_rel: float                 # max |a - b| / max |a|, over all steps
    greedy_equal: bool             # argmax of every position identical
    per_step: list[float] = field(default_factory=list)

    def __str__(self) -> str:
        return (f"max abs diff {self.max_abs:.3g}, max rel diff {self.max_rel:.3g}, "
                f"greedy tokens {'identical' if self.greedy_equal else 'DIFFER'}")


def random_steps(cfg: ModelConfig, batch: int = 1, prompt: int = 8, decode: int = 4, seed: int = 0):
    rng = np.random.default_rng(seed)
    hi = min(cfg.vocab_size, 4096)
    return [rng.integers(0, hi, (batch, prompt))] + [rng.integers(0, hi, (batch, 1)) for _ in range(decode)]


def compare(ref, test, cfg: ModelConfig, steps: list[np.ndarray] | None = None, ctx: int = 64) -> Report:
    steps = steps or random_steps(cfg)
    a = run_steps(session(ref), cfg, steps, ctx)
    b = run_steps(session(test), cfg, steps, ctx)
    per = [float(np.abs(x - y).max() / max(np.abs(x).max(), 1e-30)) for x, y in zip(a, b)]
    return Report(
        max_abs=max(float(np.abs(x - y).max()) for x, y in zip(a, b)),
        max_rel=max(per),
        greedy_equal=all(np.array_equal(x.argmax(-1), y.argmax(-1)) for x, y in zip(a, b)),
        per_step=per)
