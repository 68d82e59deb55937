"""Depth pruning: remove whole transformer blocks, chosen on calibration text.

Two criteria:
- `sleb` (SLEB, Song et al. 2024): greedily, N times, remove the block whose removal raises the
  calibration text's perplexity least (one forward pass per remaining block and step);
- `shortgpt` (ShortGPT, Men et al. 2024): remove the N blocks that change their input least,
  by the mean angular distance between a block's input and output hidden states (one pass).

The result is an ordinary Hugging Face Qwen2 directory with fewer layers, which the rest of
the pipeline (`qwc export`, `qwc qat`) takes as it is. Each removed block is one
decode step's worth of weights less to read (1/L of the linears).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from qwc import progress
from qwc.errors import QwcError

from .qwen2 import LoadedModel

METHODS = ("sleb", "shortgpt")
PRUNE_MARKER = "qwc_prune.json"


@torch.no_grad()
def _nll(model, windows: torch.Tensor) -> float:
    """Mean next-token NLL of the model over calibration windows [n, T]."""
    total = 0.0
    for w in windows:
        total += float(model(input_ids=w[None], labels=w[None], use_cache=False).loss)
    return total / len(windows)


def _keep_only(model, keep: list[int]) -> None:
    """Make the model run only the blocks `keep` (indices into its current layers), renumbered."""
    layers = model.model.layers
    model.model.layers = torch.nn.ModuleList(layers[i] for i in keep)
    for new, layer in enumerate(model.model.layers):
        layer.self_attn.layer_idx = new          # the KV cache is indexed by it
    model.config.num_hidden_layers = len(keep)
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = [model.config.layer_types[i] for i in keep]


def sleb(model, windows: torch.Tensor, remove: int) -> tuple[list[int], list[float]]:
    """The original indices of the blocks SLEB removes, in order, and the calibration NLL after
    each removal."""
    alive = list(range(len(model.model.layers)))
    everything = model.model.layers
    removed, nlls = [], []
    for step in range(remove):
        best = None
        for cand in progress.bar(alive, desc=f"SLEB step {step + 1}/{remove}", unit="block"):
            model.model.layers = torch.nn.ModuleList(everything[i] for i in alive if i != cand)
            nll = _nll(model, windows)
            if best is None or nll < best[0]:
                best = (nll, cand)
        alive.remove(best[1])
        removed.append(best[1])
        nlls.append(best[0])
    model.model.layers = everything
    return removed, nlls


@torch.no_grad()
def shortgpt(model, windows: torch.Tensor, remove: int) -> tuple[list[int], list[float]]:
    """The original indices of the `remove` blocks with the lowest block influence (mean angular
    distance / pi between a block's input and output), and every block's influence."""
    n = len(model.model.layers)
    sums = np.zeros(n)
    count = 0
    for w in windows:
        hs = model(input_ids=w[None], output_hidden_states=True, use_cache=False).hidden_states
        for i in range(n):   # hidden_states[i] is block i's input, [i + 1] its output (the last one normed)
            a, b = hs[i][0], hs[i + 1][0]
            cos = torch.nn.functional.cosine_similarity(a, b, dim=-1).clamp(-1, 1)
            sums[i] += float(torch.arccos(cos).sum()) / math.pi
        count += w.shape[0]
    influence = (sums / count).tolist()
    return sorted(range(n), key=lambda i: influence[i])[:remove], influence


def check_remove(remove: int, blocks: int) -> None:
    if not 1 <= remove < blocks:
        raise QwcError(f"--remove {remove}: the model has {blocks} blocks; remove 1 to {blocks - 1}")


def prune(lm: LoadedModel, windows: np.ndarray, remove: int, method: str = "sleb",
          threads: int | None = None) -> dict:
    """Remove `remove` blocks from lm.model in place; returns what was removed and the
    calibration perplexity before and after."""
    n = lm.config.num_hidden_layers
    if method not in METHODS:
        raise QwcError(f"unknown pruning method {method!r} (one of {', '.join(METHODS)})")
    check_remove(remove, n)
    if threads:
        torch.set_num_threads(threads)
    model = lm.model
    model.config._attn_implementation = "sdpa"   # calibration speed; export uses eager again
    w = torch.from_numpy(np.asarray(windows, np.int64))
    before = _nll(model, w)
    if method == "sleb":
        removed, _ = sleb(model, w, remove)
    else:
        removed, _ = shortgpt(model, w, remove)
    _keep_only(model, [i for i in range(n) if i not in removed])
    model.config._attn_implementation = "eager"
    lm.config.num_hidden_layers = n - remove
    after = _nll(model, w)
    return {"method": method, "removed_blocks": removed, "blocks": n - remove,
            "calibration_ppl_before": math.exp(before), "calibration_ppl_after": math.exp(after)}


def foreign_files(folder: Path) -> str | None:
    """What in an existing `folder` is not a pruned model qwc wrote (None: nothing)."""
    from .hf import foreign_hf_files

    return foreign_hf_files(folder, PRUNE_MARKER, "qwc prune")


def save(lm: LoadedModel, out_dir: Path, record: dict) -> None:
    """The pruned model as a Hugging Face directory with its record (PRUNE_MARKER)."""
    from .hf import save_hf_dir

    save_hf_dir(lm, Path(out_dir), PRUNE_MARKER, record, "qwc prune")
