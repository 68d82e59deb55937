"""Prefill and decode with a long context in the cache: qwc against llama.cpp's strongest build
on this machine, the Qwen2.5-0.5B shape (the artifact and GGUF of bench/peers.py), one run:

    .venv/bin/python bench/depth.py [--depths 0,4096] [--prompt 512] [--gen 32] [--long 4096]
                                    [--threads 1,2] [--kv f16,f32,q8_0] [--rounds 2] [--json out.json]
                                    [--plot tg_depth.svg] [--from-json out.json]

Per KV cache type, thread count and depth D, llama-bench's tests (`-d D`: D tokens prefilled,
not timed): pp{prompt} @ dD and tg{gen} @ dD, qwc through `qwc bench -d D` on an artifact
compiled with `--kv-dtype T`, llama.cpp through its `llama-bench -d D -ctk T -ctv T` (flash
attention auto): both engines at the same cache type. llama-bench has no f32 cache: qwc's f32
rows are against its f16, its default and fastest.
With --long N, also one N-token prompt from an empty cache (pp{N}): what a user pasting a long
document waits for. The two engines alternate, round after round (this machine is shared), and
the table gives each engine's best round and the ratio qwc / llama.cpp. --plot draws the tg rows
against depth (docs/tg_depth.svg is `--depths 0,1024,2048,4096,8192,16384 --prompt 0`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from qwc.bench.llamacpp import VERSION, llama_bench
from qwc.bench.llamacpp import tools as llamacpp_tools
from qwc.bench.peers import prepare


def _ints(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a comma-separated list of integers") from None
    if not vals or min(vals) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a comma-separated list of integers >= 0")
    return vals


def _kv_types(text: str) -> list[str]:
    vals = [x.strip() for x in text.split(",") if x.strip()]
    if not vals or any(v not in ("f16", "f32", "q8_0") for v in vals):
        raise argparse.ArgumentTypeError(f"{text!r}: a comma-separated list of f16, f32, q8_0")
    return vals


def qwc_bench(art: Path, threads: int, depth: int, prompt: int, gen: int, reps: int) -> dict[str, float]:
    """{test: tok/s} from `qwc bench --json` (its mean over `reps`)."""
    cmd = [sys.executable, "-m", "qwc", "-q", "bench", str(art), "-p", str(prompt), "-n", str(gen), "-d", str(depth),
           "-r", str(reps), "--threads", str(threads), "--json"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"qwc bench failed: {(r.stderr or r.stdout).strip().splitlines()[-1:]}")
    return {row["test"]: row["tps"] for row in json.loads(r.stdout)["results"]}


def peer_bench(tool: Path, gguf: Path, threads: int, depth: int, prompt: int, gen: int, reps: int,
               kv: str = "f16") -> dict[str, float]:
    """{test: tok/s} of llama-bench at `depth` with a `kv` cache (bench/llamacpp.py reads it)."""
    args = ["-p", str(prompt), "-n", str(gen), "-d", str(depth), "-ctk", kv, "-ctv", kv]
    return llama_bench(tool, gguf, threads, args, reps)[0]


def run(args) -> list[dict]:
    tool = llamacpp_tools("x86") / f"llama-bench-{VERSION}"
    plans = [(d, args.prompt, args.gen) for d in args.depths] + ([(0, args.long, 0)] if args.long else [])
    arts = {kv: prepare(Path(args.workdir), kv_dtype=kv) for kv in args.kv}
    rows = []
    for kv, paths in arts.items():
        for threads in args.threads:
            for depth, prompt, gen in plans:
                best: dict[str, dict[str, float]] = {"qwc": {}, "llama.cpp": {}}
                for rnd in range(args.rounds):
                    print(f"[depth] {kv} KV, {threads} threads, d{depth}, pp{prompt} tg{gen}: "
                          f"round {rnd + 1}/{args.rounds}", file=sys.stderr, flush=True)
                    got = {"qwc": qwc_bench(paths["qwc"], threads, depth, prompt, gen, args.reps),
                           "llama.cpp": peer_bench(tool, paths["gguf"], threads, depth, prompt, gen, args.reps,
                                                    "f16" if kv == "f32" else kv)}
                    for engine, tests in got.items():
                        for test, tps in tests.items():
                            best[engine][test] = max(best[engine].get(test, 0.0), tps)
                for test in best["qwc"]:
                    q, ll = best["qwc"][test], best["llama.cpp"].get(test)
                    rows.append({"kv": kv, "llamacpp_kv": "f16" if kv == "f32" else kv, "threads": threads,
                                 "depth": depth, "test": test, "qwc": q, "llamacpp": ll,
                                 "ratio": q / ll if ll else None})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| KV qwc / llama.cpp | threads | test | qwc tok/s | llama.cpp tok/s | qwc / llama.cpp |",
             "| --- | ---: | --- | ---: | ---: | ---: |"]
    for r in rows:
        ll = f"{r['llamacpp']:,.1f}" if r["llamacpp"] else "-"
        ratio = f"{r['ratio']:.2f}x" if r["ratio"] else "-"
        lines.append(f"| {r['kv']} / {r['llamacpp_kv']} | {r['threads']} | {r['test']} | {r['qwc']:,.1f} | {ll} | {ratio} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    """tg tok/s against depth, both engines, a line per engine, KV type and thread count."""
    import matplotlib
    matplotlib.use("Agg")   # a file, no display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    series: dict[tuple, list[tuple[int, float, float | None]]] = {}
    for r in rows:
        if r["test"].startswith("tg"):
            series.setdefault((r["kv"], r["llamacpp_kv"], r["threads"]), []).append((r["depth"], r["qwc"], r["llamacpp"]))
    for (kv, llkv, threads), pts in series.items():
        pts.sort()
        depth = [d for d, _, _ in pts]
        ax.plot(depth, [q for _, q, _ in pts], "o-", label=f"qwc, {kv} KV, {threads} threads")
        ax.plot(depth, [ll or float("nan") for _, _, ll in pts], "s--", label=f"llama.cpp, {llkv} KV, {threads} threads")
    ax.set_xlabel("cached tokens (depth)")
    ax.set_ylabel("decode tokens / s")
    ax.set_ylim(bottom=0)
    ax.set_title("Qwen2.5-0.5B shape, Q4_0: decode speed against depth")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--depths", type=_ints, default=[0, 4096], help="cached tokens before each test (default 0,4096)")
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens of the pp test at each depth (default 512)")
    p.add_argument("--gen", type=int, default=32, help="tokens of the tg test at each depth (default 32)")
    p.add_argument("--long", type=int, default=0, help="also one prompt of this many tokens from empty (0: none)")
    p.add_argument("--threads", type=_ints, default=[len(os.sched_getaffinity(0))], help="thread counts (default: all)")
    p.add_argument("--kv", type=_kv_types, default=["f16"],
                   help="KV cache types, both engines at each (f16, f32, q8_0; default f16: both defaults)")
    p.add_argument("--rounds", type=int, default=2, help="alternated rounds; the best of each engine is kept")
    p.add_argument("--reps", type=int, default=1, help="repetitions inside each round (default 1)")
    p.add_argument("--workdir", default=str(Path.home() / ".cache" / "qwc" / "bench"))
    p.add_argument("--json", help="write the rows as JSON")
    p.add_argument("--plot", help="draw tg against depth into this file (.svg, .png; needs qwc[bench]: matplotlib)")
    p.add_argument("--from-json", help="no runs: the rows of an earlier --json (with --plot, redraw it)")
    args = p.parse_args()
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            p.error("--plot needs matplotlib: pip install -e '.[bench]'")
        if Path(args.plot).suffix.lower() not in (".svg", ".png", ".pdf"):
            p.error(f"--plot {args.plot}: a .svg, .png or .pdf file")
    if args.from_json:
        try:
            rows = json.loads(Path(args.from_json).read_text())
        except (OSError, ValueError) as e:
            p.error(f"--from-json {args.from_json}: {e}")
    else:
        rows = run(args)
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if args.plot:
        plot(rows, Path(args.plot))


if __name__ == "__main__":
    main()
