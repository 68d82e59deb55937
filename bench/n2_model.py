"""A model of a token's time on a Yitian 710 (128 Neoverse-N2 cores) from the figures that
emulation can measure: labelled a model, not a measurement. bench/arm_threads.py prints it
beside its critical-path table; its inputs are printed with it.

time per token = max(compute, memory), compute = critical-path instructions x CPI / clock
                                                 + launches x barrier cost
- critical-path instructions and launches per token: bench/arm_threads.py, under qemu;
- CPI: llvm-mca's Neoverse-N2 cycles per instruction of the engine's hottest matrix loop
  (`-mcpu=neoverse-n2 -dispatch=5`: LLVM's N2 model dispatches 10 a cycle where Arm's
  Neoverse-N2 software optimization guide gives 5, LLVM issue 136374), applied to every
  critical-path instruction (the matrix loops are most of them);
- barrier cost per launch: a parameter, shown at 1, 2 and 5 us (a fork-join across 64-128
  cores costs microseconds; not measurable here);
- memory (decode): the bytes a token reads (the weights: the artifact's params.bin / the
  GGUF, less the tables a step reads one row of: an untied embedding and qwc's rotary
  tables; plus the KV cache, small at these lengths) over min(T x per-core bandwidth, the
  socket's). Socket: 8 channels of DDR5-4400 (Alibaba's public Yitian 710 figures) x 8 bytes
  = 281.6 GB/s peak. Per core: a parameter (default 20 GB/s, an assumption: one N2 core's
  share of a stream, not a published figure). Prefill reads each weight once per call for
  many tokens and is taken as compute-bound.
- clock: 2.75 GHz (a parameter; the Yitian 710's published all-core figure is 2.75-3.2 GHz).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

MCA = "/usr/lib/llvm-19/bin/llvm-mca"
SOCKET_GBS = 8 * 4400e6 * 8 / 1e9        # 8 x DDR5-4400, 8 bytes a transfer
PER_CORE_GBS = 20.0
GHZ = 2.75
BARRIER_US = (1.0, 2.0, 5.0)


def mca_cycles(loop: list[str]) -> float | None:
    """N2 cycles per iteration of a loop body (llvm-mca, 5-wide dispatch); None without llvm-19."""
    if not Path(MCA).is_file():
        import sys
        print(f"n2_model: {MCA} is missing (bench/setup.sh installs Debian's llvm-19): no CPI, no "
              "predicted table", file=sys.stderr)
        return None
    if not loop:
        return None
    body = [re.sub(r"\s+\S+$", " .Lloop", t) if re.match(r"(b\.\w+|b|cbn?z|tbn?z)\s", t) else t for t in loop]
    r = subprocess.run([MCA, "-mtriple=aarch64", "-mcpu=neoverse-n2", "-dispatch=5", "-iterations=100"],
                       input=".Lloop:\n" + "\n".join(body) + "\n", capture_output=True, text=True)
    m = re.search(r"Total Cycles:\s+(\d+)", r.stdout)
    return int(m.group(1)) / 100 if m else None


def mca_cpi(loop: list[str]) -> float | None:
    """N2 cycles per instruction of a loop body."""
    cycles = mca_cycles(loop)
    return cycles / len(loop) if cycles is not None else None


def qwc_decode_bytes(artifact: Path) -> int:
    """Bytes of the loaded parameters a decode step reads (in memory, as the library reads
    them: a parameter stored at rest counts unpacked): all but the tables it reads one row of
    (the rotary cos/sin tables, and the embedding where the head has weights of its own)."""
    import json

    import numpy as np

    from qwc.manifest import read_manifest

    manifest = json.loads((Path(artifact) / "manifest.json").read_text())
    tied = manifest["model"].get("tie_word_embeddings", True)
    total = read_manifest(Path(artifact)).weight_bytes
    for p in manifest["params"]:
        name = p["name"]
        if name.startswith("rotary_") or (not tied and "embed_tokens" in name):
            nbytes = int(np.prod(p["shape"])) * np.dtype(p["dtype"]).itemsize
            total -= nbytes - nbytes // p["shape"][0]
    return total


def gguf_decode_bytes(path: Path) -> int:
    """Bytes of a GGUF a decode step reads: all but token_embd where output.weight exists."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    sizes = {t.name: (int(t.n_bytes), int(t.shape[-1])) for t in reader.tensors}   # shape: ne0 first
    total = Path(path).stat().st_size
    if "output.weight" in sizes and "token_embd.weight" in sizes:
        nbytes, rows = sizes["token_embd.weight"]
        total -= nbytes - nbytes // rows
    return total


def seconds_per_token(critical: float, launches: float, cpi: float, barrier_us: float, bytes_per_token: float,
                      threads: int, ghz: float = GHZ, per_core_gbs: float = PER_CORE_GBS,
                      socket_gbs: float = SOCKET_GBS) -> tuple[float, str]:
    """(seconds, what bounds it: "compute" or "memory")."""
    compute = critical * cpi / (ghz * 1e9) + launches * barrier_us * 1e-6
    memory = bytes_per_token / (min(threads * per_core_gbs, socket_gbs) * 1e9) if bytes_per_token else 0.0
    return (compute, "compute") if compute >= memory else (memory, "memory")


def table(rows: dict, inputs: dict) -> list[dict]:
    """Predicted tokens a second per (engine, step, T) and barrier cost. rows: arm_threads'
    per-token figures; inputs: {engine: {"cpi": {step: CPI}, "bytes": decode bytes a token}}."""
    out = []
    for (engine, kind, t), r in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])):
        cpi = inputs[engine]["cpi"].get(kind)
        if cpi is None:
            continue
        per = {}
        for b in BARRIER_US:
            s, bound = seconds_per_token(r["critical"], r["launches"], cpi, b,
                                         inputs[engine]["bytes"] if kind == "decode" else 0.0, t)
            per[b] = (1.0 / s, bound)
        out.append({"engine": engine, "kind": kind, "threads": t, "cpi": cpi,
                    "tok_s": {str(b): v for b, (v, _) in per.items()},
                    "bound": {str(b): w for b, (_, w) in per.items()}})
    return out


def print_table(predicted: list[dict], inputs: dict) -> None:
    print(f"\n### Predicted Neoverse-N2 tokens a second (a model: {GHZ} GHz, memory bound at min(T x "
          f"{PER_CORE_GBS:g} GB/s, {SOCKET_GBS:.1f} GB/s); barrier cost per launch 1 / 2 / 5 us)\n")
    for engine, i in inputs.items():
        print(f"- {engine}: CPI " + ", ".join(f"{k} {v:.3f}" for k, v in i["cpi"].items() if v)
              + f" (llvm-mca -mcpu=neoverse-n2 -dispatch=5, hottest matrix loop); decode reads "
              f"{i['bytes'] / 2**20:,.0f} MiB a token")
    print("\n| engine | step | T | tok/s at 1 us | at 2 us | at 5 us | bound (2 us) |")
    print("| --- | --- | ---: | ---: | ---: | ---: | --- |")
    for p in predicted:
        ts = p["tok_s"]
        print(f"| {p['engine']} | {p['kind']} | {p['threads']} | " + " | ".join(f"{ts[str(b)]:,.1f}" for b in BARRIER_US)
              + f" | {p['bound']['2.0']} |")


def plot(predicted: list[dict], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = [k for k in ("decode", "prefill") if any(p["kind"] == k for p in predicted)]
    fig, axes = plt.subplots(1, len(kinds), figsize=(5 * len(kinds), 4), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        for engine in sorted({p["engine"] for p in predicted}):
            pts = [p for p in predicted if p["engine"] == engine and p["kind"] == kind]
            if not pts:
                continue
            ts = [p["threads"] for p in pts]
            ax.plot(ts, [p["tok_s"]["2.0"] for p in pts], marker="o", label=f"{engine} (2 us barrier)")
            ax.fill_between(ts, [p["tok_s"]["5.0"] for p in pts], [p["tok_s"]["1.0"] for p in pts], alpha=0.2)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("threads")
        ax.set_ylabel("tokens / s (model)")
        ax.set_title(f"{title}: {kind}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
