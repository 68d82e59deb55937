"""One interface over every stage's model: logits of every position of a token sequence.

    torch        a HF directory, a .gguf file or a preset (models/)
    onnxruntime  an .onnx graph, exported or canonical (with its .config.json beside it)
    qwc          a compiled `model.qwc/` artifact (runtime/, its `score` entry point)

Each call scores a fresh context (the cache is emptied first), so backends are interchangeable.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from qwc.errors import QwcError


class Scorer:
    backend = ""
    max_ctx = 0

    def __init__(self, path: str):
        self.path = path
        self.tokenizer = None

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def logits(self, ids: list[int]) -> np.ndarray:
        """[len(ids), vocab] float32 logits, position i predicting token i + 1."""
        raise NotImplementedError


class TorchScorer(Scorer):
    backend = "torch"

    def __init__(self, path: str, threads: int | None = None):
        super().__init__(path)
        import torch

        from qwc.models.load import load_source

        if threads:
            torch.set_num_threads(threads)
        lm = load_source(path)
        self._torch = torch
        self.model, self.tokenizer = lm.model.eval(), lm.tokenizer
        self.max_ctx = lm.config.context_length

    def logits(self, ids):
        with self._torch.inference_mode():
            out = self.model(self._torch.tensor([list(ids)], dtype=self._torch.long)).logits
        return out[0].float().numpy()


class OrtScorer(Scorer):
    backend = "onnxruntime"

    def __init__(self, path: str, threads: int | None = None):
        super().__init__(path)
        import onnxruntime as ort
        from tokenizers import Tokenizer

        from qwc.config import load_for_graph, tokenizer_for_graph

        self.config = load_for_graph(Path(path))
        tok = tokenizer_for_graph(Path(path))
        if tok is None:
            raise QwcError(f"{path}: no tokenizer beside the graph")
        self.tokenizer = Tokenizer.from_file(str(tok))
        so = ort.SessionOptions()
        so.log_severity_level = 3
        if threads:
            so.intra_op_num_threads = threads
        try:
            self.sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        except Exception as e:  # onnxruntime raises its own exception types
            raise QwcError(f"{path}: onnxruntime cannot load the graph ({str(e).splitlines()[0]})") from None
        self.max_ctx = self.config.context_length

    def logits(self, ids):
        from qwc.passes.verify import run_steps

        x = np.asarray(ids, np.int64)[None]
        return run_steps(self.sess, self.config, [x], ctx=x.shape[1])[0][0].astype(np.float32)


class QwcScorer(Scorer):
    backend = "qwc"

    def __init__(self, path: str, threads: int | None = None, ctx: int = 2048, map_weights: bool = True):
        super().__init__(path)
        from qwc.manifest import read_manifest
        from qwc.runtime.engine import Engine

        max_ctx = read_manifest(Path(path)).model.context_length
        self.engine = Engine(path, ctx=min(ctx, max_ctx), threads=threads, map_weights=map_weights)
        if self.engine.tokenizer is None:
            raise QwcError(f"{path}: artifact has no tokenizer")
        self.tokenizer = self.engine.tokenizer
        self.max_ctx = self.engine.ctx

    def logits(self, ids):
        self.engine.reset()
        return self.engine.score(ids)


def open_scorer(path: str, threads: int | None = None, ctx: int = 2048, map_weights: bool = True) -> Scorer:
    """The backend a model's form implies (`map_weights`: an artifact's, Engine's)."""
    p = Path(path)
    if p.is_dir() and (p / "manifest.json").is_file():
        return QwcScorer(path, threads, ctx, map_weights)
    if p.suffix.lower() == ".onnx":
        if not p.is_file():
            raise QwcError(f"{path}: no such file")
        return OrtScorer(path, threads)
    return TorchScorer(path, threads)
