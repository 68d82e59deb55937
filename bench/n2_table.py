"""The N2 model's table across model sizes: predicted pp512 and tg128 tokens a second on a
Yitian 710 (128 Neoverse-N2 cores) for qwc and llama.cpp's aarch64 builds, at every thread
count bench/arm_threads.py measured, beside the published llama.cpp figures on Arm servers
that would calibrate it. A model, labelled so (bench/n2_model.py says what it leaves out).

    .venv/bin/python bench/n2_table.py SIZE=[LABEL@]RUN.json[,...] ... [--json OUT]

SIZE is a published Qwen2.5 shape (bench/make_checkpoint.py: 0.5b, 1.5b, 3b, 7b); each RUN is
`bench/arm_threads.py ART --json RUN` of an artifact of that shape or of a cut of it (the
`qwen2.5-7b-4layers` preset: the 7B's layers, 4 of 28). Several runs of one size merge (qwc's
in one, the peers' in another); LABEL@ names a qwc build ("qwc auto") beside another.

From a run's per-token figures (critical path, launches; 48-token prefill calls and decode
steps) to a full model's pp512 and tg128, per engine and thread count:
- the head (vocab x hidden multiply-adds, once a call) and the layers are split by their
  multiply-adds; the layers' part scales by full / measured layers, the head's by the call's
  tokens (48 / 512 for pp512). Splitting by multiply-adds puts the head's share of a prefill at
  the GEMM's cost a multiply-add, where its GEMV costs several times more: the 7B cut's 48-token prefill
  gets a smaller share of its instructions as head than pp512, which the scaling then overstates
  by a few percent, the same for every engine. Attention's growth from 48 to 512 positions
  (a small share of a 7B layer's multiply-adds at 256 positions) is left out.
- decode bytes: the run's bytes a token, plus the missing layers' weights at the run's bytes a
  weight.
- time per token: bench/n2_model.seconds_per_token at a 2 us barrier cost per launch.

Two columns per step:
- model: n2_model's own inputs (hot-loop CPI, min(T x 20 GB/s, 281.6 GB/s));
- calibrated: prefill x PREFILL_FACTOR (PR 13886's 147.8 tok/s over the model's llama.cpp 7B
  at 64 threads, scaled by Llama-3-8B's multiply-adds a token over Qwen2.5-7B's), and decode
  with the socket's bandwidth at the 120 GB/s both decode anchors imply. Where no 7B llama.cpp
  row at 64 threads is given, the prefill calibration is left out.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from qwc.bench import n2_model
from qwc.bench.make_checkpoint import SHAPES

PP, TG = 512, 128
BARRIER_US = 2.0
CALL_TOKENS = {"prefill": 48, "decode": 1}   # bench/arm_threads.py: PREFILL, one decode step
EFFECTIVE_SOCKET_GBS = 120.0   # both decode anchors below: 24.3 x 4.92 GB and 31.6 x 3.83 GB
# Llama-3-8B (32 layers, hidden 4096, kv 1024, intermediate 14336) over Qwen2.5-7B (28 x ...):
# multiply-adds a token in the layers
LLAMA3_8B_LAYER_MACS = 32 * (2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 14336 * 4096)
ANCHORS = [
    ("llama.cpp PR 13886: Neoverse-N2, 64 threads, Llama-3-8B Q4_K_M, prefill", 147.8, "prefill",
     "the prefill factor (the model's CPI leaves out memory and synchronisation)"),
    ("the same, decode", 24.3, "decode", "the socket's effective bandwidth: 24.3 x 4.92 GB = 120 GB/s"),
    ("llama.cpp PR 5780: Graviton3, 64 vCPUs, Llama-2-7B Q4_0, decode", 31.6, "decode",
     "the same: 31.6 x 3.83 GB = 121 GB/s"),
]


def layer_macs(h: int, inter: int, kv: int) -> int:
    return 2 * h * h + 2 * kv * h + 3 * inter * h


def shape(size: str) -> dict:
    h, inter, layers, heads, kv_heads, vocab, _ = SHAPES[size]
    return {"hidden": h, "layers": layers, "vocab": vocab, "layer_macs": layer_macs(h, inter, kv_heads * h // heads)}


def run_config(run: dict, path: Path) -> dict:
    """The measured model's shape: the run's own record, else its artifact's manifest."""
    cfg = run.get("config")
    if cfg is None:
        try:
            cfg = json.loads((Path(run["artifact"]) / "manifest.json").read_text())["model"]
        except (OSError, KeyError, ValueError) as e:
            sys.exit(f"n2_table: {path} records no model shape and its artifact is unreadable ({e})")
    h = cfg["hidden_size"]
    return {"hidden": h, "layers": cfg["num_hidden_layers"], "vocab": cfg["vocab_size"],
            "layer_macs": layer_macs(h, cfg["intermediate_size"], cfg["num_key_value_heads"] * cfg["head_dim"])}


def scaled(x: float, kind: str, measured: dict, full: dict, tokens: int) -> float:
    """A per-token figure of `measured` (calls of CALL_TOKENS[kind]) as `full`'s, in calls of `tokens`."""
    call = CALL_TOKENS[kind]
    head = measured["vocab"] * measured["hidden"] / call
    layers = measured["layers"] * measured["layer_macs"]
    x_head, x_layers = x * head / (head + layers), x * layers / (head + layers)
    return x_layers * full["layers"] / measured["layers"] + x_head * call / tokens


def full_bytes(bytes_run: float, measured: dict, full: dict) -> float:
    weights = measured["layers"] * measured["layer_macs"] + measured["vocab"] * measured["hidden"]
    return bytes_run + (full["layers"] - measured["layers"]) * full["layer_macs"] * bytes_run / weights


def load(spec: str) -> tuple[str, list[tuple[Path, dict]]]:
    size, _, files = spec.partition("=")
    if size not in SHAPES or not files:
        sys.exit(f"n2_table: {spec!r}: SIZE=[LABEL@]RUN.json[,...] with SIZE one of {', '.join(SHAPES)}")
    runs = []
    for spec_file in files.split(","):
        label, _, f = spec_file.rpartition("@")
        try:
            runs.append((Path(f), json.loads(Path(f).read_text())))
        except (OSError, ValueError) as e:
            sys.exit(f"n2_table: {f}: not a bench/arm_threads.py --json file ({e})")
        run = runs[-1][1]
        if "rows" not in run or "inputs" not in run:
            sys.exit(f"n2_table: {f}: not a bench/arm_threads.py --json file (no rows / inputs)")
        if label:   # this build's qwc rows under their own name
            for r in run["rows"]:
                r["engine"] = f"qwc {label}" if r["engine"] == "qwc" else r["engine"]
            if "qwc" in run["inputs"]:
                run["inputs"][f"qwc {label}"] = run["inputs"].pop("qwc")
    return size, runs


def predict(size: str, runs: list[tuple[Path, dict]], socket_gbs: float, factor: float) -> dict:
    """(engine, T) -> {"pp": tok/s, "tg": tok/s, "bound": decode's bound}."""
    full = shape(size)
    out: dict = {}
    for path, run in runs:
        measured = run_config(run, path)
        for r in run["rows"]:
            e, kind, t = r["engine"], r["kind"], r["threads"]
            if kind not in CALL_TOKENS:
                continue
            inputs = run["inputs"][e]
            cpi = inputs["cpi"].get(kind)
            if cpi is None:
                continue
            tokens = PP if kind == "prefill" else 1
            crit = scaled(r["critical"], kind, measured, full, tokens)
            launches = scaled(r["launches"], kind, measured, full, tokens)
            nbytes = full_bytes(inputs["bytes"], measured, full) if kind == "decode" else 0.0
            s, bound = n2_model.seconds_per_token(crit, launches, cpi, BARRIER_US, nbytes, t, socket_gbs=socket_gbs)
            row = out.setdefault((e, t), {})
            if kind == "prefill":
                row["pp"] = factor / s
            else:
                row["tg"], row["bound"] = 1.0 / s, bound
    return out


def prefill_factor(tables: dict) -> float | None:
    """PR 13886's prefill over the model's llama.cpp 7B at 64 threads (the stronger build), per
    multiply-add of the two models' layers."""
    rows = tables.get("7b", {})
    pp = [v["pp"] for (e, t), v in rows.items() if e.startswith("llama.cpp") and t == 64 and "pp" in v]
    if not pp:
        return None
    s7 = shape("7b")
    per_mac_model = max(pp) * s7["layers"] * s7["layer_macs"]
    return ANCHORS[0][1] * LLAMA3_8B_LAYER_MACS / per_mac_model


def stronger_peer(rows: dict, t: int, key: str) -> tuple[str, float] | None:
    peers = [(e, v[key]) for (e, tt), v in rows.items() if tt == t and e.startswith("llama.cpp") and key in v]
    return max(peers, key=lambda p: p[1]) if peers else None


def print_tables(model: dict, calibrated: dict, factor: float | None) -> None:
    print(f"\n### Predicted Neoverse-N2 tokens a second (a model; {n2_model.GHZ} GHz, {BARRIER_US:g} us a launch)\n")
    print("| size | T | engine | pp512, model | tg128, model | pp512, calibrated | tg128, calibrated "
          "| qwc's time / the stronger peer's, pp512 / tg128 |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for size, rows in model.items():
        for e, t in sorted(rows, key=lambda k: (k[1], not k[0].startswith("qwc"), k[0])):
            m, c = rows[e, t], calibrated[size].get((e, t), {})
            ratio = ""
            if e.startswith("qwc"):
                parts = []
                for key in ("pp", "tg"):
                    peer = stronger_peer(rows, t, key)
                    parts.append(f"{peer[1] / m[key]:.3f}x ({peer[0].split()[-1]})" if peer and key in m else "-")
                ratio = " / ".join(parts)
            cal_pp = f"{c['pp']:,.1f}" if factor is not None and "pp" in c else "-"
            print(f"| {size} | {t} | {e} | {m.get('pp', float('nan')):,.1f} | {m.get('tg', float('nan')):,.1f} "
                  f"({m.get('bound', '-')}) | {cal_pp} | {c.get('tg', float('nan')):,.1f} | {ratio} |")
    print("\nPublished figures and what they calibrate:\n")
    print("| figure | tok/s | calibrates |")
    print("| --- | ---: | --- |")
    for name, value, _, what in ANCHORS:
        print(f"| {name} | {value} | {what} |")
    if factor is not None:
        print(f"\nprefill factor: {factor:.3f} (the model's prefill is {1 / factor:.2f}x the anchor's, per multiply-add); "
              f"decode: the socket at {EFFECTIVE_SOCKET_GBS:g} GB/s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="SIZE=[LABEL@]RUN.json[,...]")
    p.add_argument("--json", help="write both tables here")
    args = p.parse_args()
    loaded = dict(load(s) for s in args.runs)
    model = {size: predict(size, runs, n2_model.SOCKET_GBS, 1.0) for size, runs in loaded.items()}
    factor = prefill_factor(model)
    calibrated = {size: predict(size, runs, EFFECTIVE_SOCKET_GBS, factor or 1.0) for size, runs in loaded.items()}
    print_tables(model, calibrated, factor)
    if args.json:
        def rows(t):
            return {size: [{"engine": e, "threads": th, **v} for (e, th), v in r.items()] for size, r in t.items()}
        Path(args.json).write_text(json.dumps({"model": rows(model), "calibrated": rows(calibrated),
                                               "prefill_factor": factor}, indent=1))


if __name__ == "__main__":
    main()
