"""models/prune.py and `qwc prune`: SLEB removes the block whose removal costs the calibration
text least, ShortGPT the block that changes its input least; the pruned directory exports,
compiles and runs like any other model."""

from __future__ import annotations

import copy
import json
import math

import numpy as np
import pytest
import torch

from qwc.cli import main
from qwc.models.load import load_source
from qwc.models.prune import _keep_only, _nll, prune, shortgpt


def _windows(n=2, t=64, seed=0):
    return np.random.default_rng(seed).integers(0, 259, (n, t))


def _bigger_tiny(tiny_lm, layers=4):
    """The tiny preset with `layers` blocks (copies of its two, perturbed), so there is a choice."""
    lm = copy.deepcopy(tiny_lm)
    model = lm.model
    rng = torch.Generator().manual_seed(0)
    blocks = [copy.deepcopy(model.model.layers[i % 2]) for i in range(layers)]
    with torch.no_grad():
        for b in blocks:
            for p in b.parameters():
                p.add_(0.02 * torch.randn(p.shape, generator=rng))
    model.model.layers = torch.nn.ModuleList(blocks)
    for i, b in enumerate(blocks):
        b.self_attn.layer_idx = i
        for sub in b.modules():   # deepcopy gave each block its own config: share the model's
            if hasattr(sub, "config"):
                sub.config = model.config
    model.config.num_hidden_layers = lm.config.num_hidden_layers = layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = [model.config.layer_types[0]] * layers
    return lm


def test_sleb_removes_the_cheapest_block(tiny_lm):
    lm = _bigger_tiny(tiny_lm)
    w = torch.from_numpy(_windows())
    costs = []
    for drop in range(4):
        trial = copy.deepcopy(lm.model)
        _keep_only(trial, [i for i in range(4) if i != drop])
        costs.append(_nll(trial, w))
    r = prune(lm, _windows(), 1, "sleb")
    assert r["removed_blocks"] == [int(np.argmin(costs))]
    assert len(lm.model.model.layers) == 3 and lm.model.config.num_hidden_layers == 3
    assert [layer.self_attn.layer_idx for layer in lm.model.model.layers] == [0, 1, 2]
    assert math.isclose(math.log(r["calibration_ppl_after"]), min(costs), rel_tol=1e-5)


def test_shortgpt_removes_the_least_influential_blocks(tiny_lm):
    lm = _bigger_tiny(tiny_lm)
    removed, influence = shortgpt(lm.model, torch.from_numpy(_windows()), 2)
    assert len(influence) == 4 and all(0 <= x <= 1 for x in influence)
    assert sorted(removed) == sorted(np.argsort(influence)[:2].tolist())


@pytest.mark.slow
def test_cli_prune_then_export_compile_run(tiny_lm, tmp_path, capsys):
    text = tmp_path / "calib.txt"
    text.write_text("She was the youngest of the two daughters of a most affectionate, indulgent father. " * 30)
    out = tmp_path / "pruned"
    assert main(["prune", "tiny", "--remove", "1", "--calib", str(text), "--calib-tokens", "512",
                 "-o", str(out)]) in (0, None)
    record = json.loads((out / "qwc_prune.json").read_text())
    assert record["blocks"] == 1 and len(record["removed_blocks"]) == 1
    kept = 1 - record["removed_blocks"][0]
    pruned = load_source(str(out))
    assert pruned.config.num_hidden_layers == 1
    for a, b in zip(pruned.model.model.layers[0].parameters(), tiny_lm.model.model.layers[kept].parameters()):
        assert torch.equal(a, b)
    onnx_path, art = tmp_path / "p.onnx", tmp_path / "p.qwc"
    assert main(["-q", "export", str(out), "-o", str(onnx_path)]) in (0, None)
    assert main(["-q", "compile", str(onnx_path), "--target", "host", "-o", str(art)]) in (0, None)
    capsys.readouterr()
    assert main(["-q", "run", str(art), "--prompt", "She was", "--max-new-tokens", "4"]) in (0, None)
    assert capsys.readouterr().out.strip()


def _exit_code(argv) -> int:
    try:
        return main(argv) or 0
    except SystemExit as e:     # argparse's own refusals
        return e.code


@pytest.mark.parametrize("args, expect", [
    (["--remove", "2"], "remove 1 to 1"),
    (["--remove", "0"], "must be at least 1"),
    (["--remove", "1", "--method", "magic"], "invalid choice"),
])
def test_cli_prune_refuses_bad_options(tmp_path, capsys, args, expect):
    assert _exit_code(["prune", "tiny", *args, "-o", str(tmp_path / "out")]) == 2
    assert expect in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
