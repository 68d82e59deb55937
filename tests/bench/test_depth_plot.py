"""bench/depth.py's plot of tg against depth, from the JSON rows of an earlier run (the runs
themselves take minutes and a llama.cpp build: they are the bench, not a test)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

DEPTH = Path(__file__).resolve().parents[2] / "bench" / "depth.py"


def _rows():
    rows = []
    for depth, qwc, ll in ((0, 100.0, 43.0), (4096, 80.0, 10.5), (16384, 48.0, 2.1)):
        rows.append({"kv": "f16", "llamacpp_kv": "f16", "threads": 2, "depth": depth,
                     "test": "tg32" + (f" @ d{depth}" if depth else ""), "qwc": qwc, "llamacpp": ll,
                     "ratio": qwc / ll})
        rows.append({"kv": "f16", "llamacpp_kv": "f16", "threads": 2, "depth": depth,
                     "test": "pp512" + (f" @ d{depth}" if depth else ""), "qwc": 600.0, "llamacpp": 300.0,
                     "ratio": 2.0})
    return rows


def test_plot_draws_both_engines_tg_rows(tmp_path):
    src, svg = tmp_path / "rows.json", tmp_path / "tg.svg"
    src.write_text(json.dumps(_rows()))
    r = subprocess.run([sys.executable, str(DEPTH), "--from-json", str(src), "--plot", str(svg)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "| f16 / f16 | 2 | tg32 @ d16384 | 48.0 | 2.1 | 22.86x |" in r.stdout
    text = svg.read_text()
    assert text.lstrip().startswith("<?xml") and "<svg" in text
    # matplotlib marks each text it draws with a comment: the legend names a line per engine
    for label in ("qwc, f16 KV, 2 threads", "llama.cpp, f16 KV, 2 threads", "cached tokens (depth)"):
        assert f"<!-- {label} -->" in text
    assert "pp512" not in text


@pytest.mark.parametrize("args, expect", [(["--plot", "x.txt"], "a .svg, .png or .pdf file"),
                                          (["--from-json", "missing.json"], "--from-json missing.json")])
def test_plot_refuses_bad_options(tmp_path, args, expect):
    r = subprocess.run([sys.executable, str(DEPTH), "--from-json", str(tmp_path / "missing.json")] + args,
                       capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 2 and expect in r.stderr.strip().splitlines()[-1], r.stderr
