"""qwc against llama.cpp on a real ARM board, side by side at each thread count, as one table:
`qwc bench` on the artifact and llama.cpp's `llama-bench` on a GGUF of the same model, the
two alternating (which goes first swaps at each thread count) on the machine they run on.

    python3 scripts/arm64/board_bench.py model.qwc model.gguf [--threads 1,8,32,64,128]
        [-p 512] [-n 128] [-r 3] [--qwc "qwc"] [--llama-bench llama-bench] [--json F]

--qwc and --llama-bench are the commands to run (split as a shell would), e.g. a venv's
`.venv/bin/qwc`, or a llama-bench built with `-DGGML_NATIVE=ON` on the board (the strongest
build there: check its own log line for the SVE, i8mm and repack paths). Standard library
only, so it runs wherever qwc's runtime does. Under qemu it runs as in the tests (correctness
only: emulated time is not a board's).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys


def run_json(cmd: list[str], what: str):
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        last = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["no output"]
        sys.exit(f"board_bench: {what} failed ({r.returncode}): {last[0]}")
    try:
        return json.loads(r.stdout)
    except ValueError:
        sys.exit(f"board_bench: {what} printed no JSON")


def qwc_rates(qwc: list[str], model: str, t: int, p: int, n: int, reps: int) -> dict[str, float]:
    """{"pp": tok/s, "tg": tok/s} from `qwc bench --json` (tests named pp<P>, tg<N>)."""
    out = run_json([*qwc, "-q", "bench", model, "--threads", str(t), "-p", str(p), "-n", str(n),
                    "-r", str(reps), "--json"], f"qwc bench --threads {t}")
    return {r["test"][:2]: float(r["tps"]) for r in out["results"]}


def llama_rates(bench: list[str], gguf: str, t: int, p: int, n: int, reps: int) -> dict[str, float]:
    """{"pp": tok/s, "tg": tok/s} from `llama-bench -o json` (a prompt row, a generation row)."""
    out = run_json([*bench, "-m", gguf, "-t", str(t), "-p", str(p), "-n", str(n), "-r", str(reps), "-o", "json"],
                   f"llama-bench -t {t}")
    rates = {}
    for r in out:
        rates["pp" if r["n_gen"] == 0 else "tg"] = float(r["avg_ts"])
    return rates


def table(rows: list[dict], p: int, n: int) -> str:
    lines = [f"| threads | qwc pp{p} | llama.cpp pp{p} | qwc / llama.cpp | qwc tg{n} | llama.cpp tg{n} | qwc / llama.cpp |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        cells = [str(r["threads"])]
        for test in ("pp", "tg"):
            q, ll = r["qwc"].get(test), r["llama.cpp"].get(test)
            cells += [f"{q:,.2f}" if q else "-", f"{ll:,.2f}" if ll else "-", f"{q / ll:.2f}x" if q and ll else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="the qwc artifact (model.qwc)")
    ap.add_argument("gguf", help="the same model as a GGUF for llama.cpp")
    ap.add_argument("--threads", default="1,8,32,64,128")
    ap.add_argument("-p", type=int, default=512, help="prompt tokens (pp test)")
    ap.add_argument("-n", type=int, default=128, help="generated tokens (tg test)")
    ap.add_argument("-r", type=int, default=3, help="repetitions of each test")
    ap.add_argument("--qwc", default="qwc", help="the qwc command (default: qwc)")
    ap.add_argument("--llama-bench", default="llama-bench", help="the llama-bench command")
    ap.add_argument("--json", help="write the rows here too")
    a = ap.parse_args(argv)
    try:
        threads = [int(t) for t in a.threads.split(",")]
    except ValueError:
        ap.error(f"--threads {a.threads!r}: a comma-separated list of integers")
    if any(t < 1 for t in threads) or a.p < 1 or a.n < 1 or a.r < 1:
        ap.error("threads, -p, -n and -r must be positive")
    qwc, bench = shlex.split(a.qwc), shlex.split(a.llama_bench)
    rows = []
    for i, t in enumerate(threads):
        row = {"threads": t}
        runs = [("qwc", lambda t=t: qwc_rates(qwc, a.model, t, a.p, a.n, a.r)),
                ("llama.cpp", lambda t=t: llama_rates(bench, a.gguf, t, a.p, a.n, a.r))]
        for name, run in runs if i % 2 == 0 else runs[::-1]:   # alternate who goes first
            row[name] = run()
            print(f"board_bench: T={t} {name}: " + ", ".join(f"{k} {v:,.2f} tok/s" for k, v in row[name].items()),
                  file=sys.stderr)
        rows.append(row)
    print(table(rows, a.p, a.n))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
