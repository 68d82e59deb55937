"""bench/n2_table.py: a cut's per-token figures scaled to the whole model, and the table from
bench/arm_threads.py's JSON (the emulated runs themselves are the bench, not a test)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from qwc.bench import n2_table

BENCH = Path(__file__).resolve().parents[2] / "bench"

CUT = {"vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 4,
       "num_key_value_heads": 4, "head_dim": 128}


def _run(engine: str, prefill: float, decode: float, cpi: float = 0.4) -> dict:
    rows = [{"engine": engine, "kind": k, "threads": t, "work": v, "critical": v / t, "launches": 0.0,
             "serial": 0.0, "waiting": 0.0} for t in (1, 64) for k, v in (("prefill", prefill), ("decode", decode))]
    return {"artifact": "/nonexistent", "model": "qwen2.5-7b-4layers", "config": CUT, "rows": rows,
            "inputs": {engine: {"cpi": {"prefill": cpi, "decode": cpi}, "bytes": 830e6}}}


def test_the_layers_scale_by_depth_and_the_head_by_the_call():
    measured = n2_table.run_config({"config": CUT}, Path("x"))
    full = n2_table.shape("7b")
    head = 152064 * 3584
    layers = 4 * n2_table.layer_macs(3584, 18944, 512)
    # decode: the head once a token, so only the layers' share grows 7x
    got = n2_table.scaled(1000.0, "decode", measured, full, 1)
    assert got == pytest.approx(1000.0 * (head + 7 * layers) / (head + layers))
    # prefill of 512: the head's share of a 48-token call shrinks by 48 / 512
    h48 = head / 48
    got = n2_table.scaled(1000.0, "prefill", measured, full, 512)
    assert got == pytest.approx(1000.0 * (7 * layers + h48 * 48 / 512) / (h48 + layers))
    # bytes: the missing 24 layers at the run's bytes a weight
    assert n2_table.full_bytes(1000.0, measured, full) == pytest.approx(1000.0 * (head + 7 * layers) / (head + layers))


def test_table_ratios_and_calibration(tmp_path):
    qwc, peer = tmp_path / "qwc.json", tmp_path / "peer.json"
    qwc.write_text(json.dumps(_run("qwc", 70e6, 400e6)))
    peer.write_text(json.dumps(_run("llama.cpp repack", 82e6, 700e6)))
    out = tmp_path / "t.json"
    r = subprocess.run([sys.executable, str(BENCH / "n2_table.py"), f"7b=auto@{qwc},{peer}", "--json", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "| 7b | 64 | qwc auto |" in r.stdout and "PR 13886" in r.stdout
    got = json.loads(out.read_text())
    model = {(x["engine"], x["threads"]): x for x in got["model"]["7b"]}
    # same CPI, no launches: the prefill time ratio is the critical paths' (the head's share alike)
    assert model["llama.cpp repack", 64]["pp"] / model["qwc auto", 64]["pp"] == pytest.approx(70 / 82, rel=1e-3)
    # the calibration puts the peer's 7B at 64 threads on PR 13886's figure, per multiply-add
    cal = {(x["engine"], x["threads"]): x for x in got["calibrated"]["7b"]}
    per_mac = n2_table.LLAMA3_8B_LAYER_MACS / (28 * n2_table.shape("7b")["layer_macs"])
    assert cal["llama.cpp repack", 64]["pp"] == pytest.approx(147.8 * per_mac, rel=1e-6)
    # decode at 64 threads is memory-bound at the calibrated 120 GB/s for both
    assert cal["qwc auto", 64]["bound"] == "memory"


@pytest.mark.parametrize("spec, message", [("13b=x.json", "SIZE=[LABEL@]RUN.json"),
                                           ("7b=/nonexistent.json", "not a bench/arm_threads.py --json file")])
def test_bad_specs_are_one_line(spec, message):
    r = subprocess.run([sys.executable, str(BENCH / "n2_table.py"), spec], capture_output=True, text=True)
    assert r.returncode != 0 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1
