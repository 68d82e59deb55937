"""Shared fixtures: the tiny preset and its ONNX export, built once per test session."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qwc.models.export import export_onnx
from qwc.models.presets import load_preset
from qwc import progress


@pytest.fixture(scope="session", autouse=True)
def _quiet():
    progress.set_quiet(True)


@pytest.fixture(scope="session")
def tiny_lm():
    return load_preset("tiny")


@pytest.fixture(scope="session")
def tiny_onnx(tiny_lm, tmp_path_factory):
    return export_onnx(tiny_lm, tmp_path_factory.mktemp("tiny") / "tiny.onnx")


def torch_kv_logits(model, prompt: np.ndarray, steps: list[np.ndarray]) -> list[np.ndarray]:
    """Reference: transformers' own cache handling, prefill then one token per step."""
    from transformers.cache_utils import DynamicCache

    cache = DynamicCache(config=model.config)
    outs, ids, past = [], torch.from_numpy(prompt), 0
    with torch.no_grad():
        for step in [None] + steps:
            if step is not None:
                ids = torch.from_numpy(step)
            b, s = ids.shape
            pos = torch.arange(past, past + s).unsqueeze(0).expand(b, s)
            mask = torch.ones(b, past + s, dtype=torch.int64)
            out = model(input_ids=ids, attention_mask=mask, position_ids=pos,
                        past_key_values=cache, use_cache=True)
            outs.append(out.logits.numpy())
            past += s
    return outs


def ort_kv_logits(onnx_path, cfg, prompt: np.ndarray, steps: list[np.ndarray]) -> list[np.ndarray]:
    """onnxruntime on the exported graph, feeding present.* back as past_key_values.*."""
    import onnxruntime as ort

    sess = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    b = prompt.shape[0]
    kv = {f"past_key_values.{i}.{k}": np.zeros((b, cfg.num_key_value_heads, 0, cfg.head_dim), np.float32)
          for i in range(cfg.num_hidden_layers) for k in ("key", "value")}
    outs, ids, past = [], prompt, 0
    for step in [None] + steps:
        if step is not None:
            ids = step
        s = ids.shape[1]
        feeds = {"input_ids": ids.astype(np.int64),
                 "attention_mask": np.ones((b, past + s), np.int64),
                 "position_ids": np.broadcast_to(np.arange(past, past + s), (b, s)).astype(np.int64),
                 **kv}
        res = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
        outs.append(res["logits"])
        kv = {f"past_key_values.{i}.{k}": res[f"present.{i}.{k}"]
              for i in range(cfg.num_hidden_layers) for k in ("key", "value")}
        past += s
    return outs
