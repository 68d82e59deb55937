"""ONNX export of a Qwen2 model with its KV cache, in optimum / onnxruntime-genai naming.

Inputs:  input_ids [batch, seq] int64, attention_mask [batch, total] int64,
         position_ids [batch, seq] int64,
         past_key_values.{i}.key|value [batch, kv_heads, past, head_dim] float32
Outputs: logits [batch, seq, vocab] float32,
         present.{i}.key|value [batch, kv_heads, past + seq, head_dim] float32
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import torch
from transformers.cache_utils import DynamicCache

from qwc import progress
from qwc.atomic import publish, staging_dir
from qwc.config import foreign_graph_files, sidecar_paths
from qwc.errors import QwcError

from .qwen2 import LoadedModel

OPSET = 20
# protobuf refuses messages over 2 GiB; leave headroom for the graph itself.
EXTERNAL_DATA_THRESHOLD = 1_900_000_000


def torch_export_memory(n_params: int) -> int:
    """Estimated peak bytes of exporting a model of `n_params` through torch: the float32 model
    and the exporter's folded, transposed copy of each linear, ~8.8 bytes a parameter measured
    at 1.5B (docs/history/README.md, "Model sizes"), and the interpreter."""
    return 9 * n_params + 2**30


def input_names(n_layers: int) -> list[str]:
    return ["input_ids", "attention_mask", "position_ids"] + [
        f"past_key_values.{i}.{kv}" for i in range(n_layers) for kv in ("key", "value")]


def output_names(n_layers: int) -> list[str]:
    return ["logits"] + [f"present.{i}.{kv}" for i in range(n_layers) for kv in ("key", "value")]


class KVCacheWrapper(torch.nn.Module):
    """Flat tensors in and out, so the graph's signature is the KV-cache contract above."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.n_layers = model.config.num_hidden_layers

    def forward(self, input_ids, attention_mask, position_ids, past):
        cache = DynamicCache(config=self.model.config)
        for i in range(self.n_layers):
            cache.update(past[2 * i], past[2 * i + 1], i)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask,
                         position_ids=position_ids, past_key_values=cache, use_cache=True)
        present = []
        for layer in out.past_key_values.layers[: self.n_layers]:
            present += [layer.keys, layer.values]
        return (out.logits, *present)


def example_inputs(lm: LoadedModel, batch: int = 2, seq: int = 3, past: int = 4):
    cfg = lm.config
    ids = torch.randint(0, min(cfg.vocab_size, 256), (batch, seq))
    mask = torch.ones(batch, past + seq, dtype=torch.int64)
    pos = torch.arange(past, past + seq).unsqueeze(0).expand(batch, seq).contiguous()
    kv = tuple(torch.zeros(batch, cfg.num_key_value_heads, past, cfg.head_dim)
               for _ in range(2 * cfg.num_hidden_layers))
    return ids, mask, pos, kv


class _FlatArgs(torch.nn.Module):
    """TorchScript export wants the cache as separate positional tensors."""

    def __init__(self, wrapper: KVCacheWrapper):
        super().__init__()
        self.wrapper = wrapper

    def forward(self, input_ids, attention_mask, position_ids, *past):
        return self.wrapper(input_ids, attention_mask, position_ids, past)


def _export_dynamo(wrapper: KVCacheWrapper, lm: LoadedModel, staged: Path, external: bool) -> None:
    n = lm.config.num_hidden_layers
    batch, seq, past, total = (torch.export.Dim(d) for d in ("batch", "seq", "past", "total"))
    dynamic = ({0: batch, 1: seq}, {0: batch, 1: total}, {0: batch, 1: seq},
               tuple({0: batch, 2: past} for _ in range(2 * n)))
    program = torch.onnx.export(
        wrapper, example_inputs(lm), None, dynamo=True, opset_version=OPSET,
        input_names=input_names(n), output_names=output_names(n),
        dynamic_shapes=dynamic, verbose=False, optimize=True)
    # The data file name is stored inside the graph: staged under its final name.
    program.save(staged, external_data=external)


def _export_legacy(wrapper: KVCacheWrapper, lm: LoadedModel, staged: Path) -> None:
    n = lm.config.num_hidden_layers
    ids, mask, pos, kv = example_inputs(lm)
    axes = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "total"},
            "position_ids": {0: "batch", 1: "seq"}, "logits": {0: "batch", 1: "seq"}}
    axes.update({name: {0: "batch", 2: "past"} for name in input_names(n)[3:]})
    axes.update({name: {0: "batch", 2: "past + seq"} for name in output_names(n)[1:]})
    torch.onnx.export(_FlatArgs(wrapper), (ids, mask, pos, *kv), str(staged), dynamo=False,
                      opset_version=17, input_names=input_names(n), output_names=output_names(n),
                      dynamic_axes=axes)


def export_onnx(lm: LoadedModel, out: Path, dynamo: bool = True) -> Path:
    """Write `out` (+ `out.data` when large), `<stem>.config.json`, `<stem>.tokenizer.json`.
    `dynamo=False` uses torch's older TorchScript exporter (opset 17), whose graphs the passes
    also accept; it is meant for small models."""
    out = Path(out)
    if out.suffix != ".onnx":
        raise QwcError(f"output {out} must end in .onnx")
    wrapper = KVCacheWrapper(lm.model).eval()
    cfg_path, tok_path = sidecar_paths(out)
    param_bytes = sum(p.numel() * p.element_size() for p in lm.model.parameters())
    external = param_bytes > EXTERNAL_DATA_THRESHOLD
    with staging_dir(out, foreign=foreign_graph_files) as tmp:
        staged = tmp / out.name
        how = "torch.export" if dynamo else "the TorchScript exporter"
        with progress.stage(f"tracing the model with {how} and writing {out.name} "
                            f"({param_bytes / 2**20:.0f} MiB of weights{', external data' if external else ''})"), \
                _quiet_torch_onnx(), torch.no_grad():
            try:
                if dynamo:
                    _export_dynamo(wrapper, lm, staged, external)
                else:
                    _export_legacy(wrapper, lm, staged)
            except QwcError:
                raise
            except Exception as e:  # torch raises many types; report the first line
                raise QwcError(f"ONNX export failed: {str(e).strip().splitlines()[0]}") from e
        (tmp / cfg_path.name).write_text(lm.config.to_json() + "\n")
        lm.tokenizer.save(str(tmp / tok_path.name))
        moves = [(tmp / cfg_path.name, cfg_path), (tmp / tok_path.name, tok_path)]
        if (tmp / (out.name + ".data")).exists():
            moves.append((tmp / (out.name + ".data"), out.with_name(out.name + ".data")))
        publish(moves + [(staged, out)], foreign=foreign_graph_files)
    return out


class _quiet_torch_onnx:
    """torch.onnx logs its own progress and warnings (e.g. torchvision not installed);
    qwc reports stages itself."""

    def __enter__(self):
        self._loggers = [logging.getLogger(n) for n in ("torch.onnx", "torch.export", "torch._dynamo",
                                                          "onnxscript", "torch.fx.experimental.symbolic_shapes")]
        self._levels = [lg.level for lg in self._loggers]
        for lg in self._loggers:
            lg.setLevel(logging.ERROR)
        self._warn = warnings.catch_warnings()
        self._warn.__enter__()
        warnings.simplefilter("ignore")
        return self

    def __exit__(self, *exc):
        self._warn.__exit__(*exc)
        for lg, lvl in zip(self._loggers, self._levels):
            lg.setLevel(lvl)
        return False
