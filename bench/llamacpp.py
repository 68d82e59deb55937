"""llama.cpp as the peer: its tools built once by bench/llamacpp.sh from the llama-cpp-python
sdist of VERSION (the shell script reads the version from this file: it is written once), found
by build name, and llama-bench run and read one way (`qwc bench`'s test names, the median of
its runs)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

VERSION = "0.3.36"   # llama-cpp-python's sdist: the llama.cpp every peer row is measured against
HERE = Path(__file__).resolve().parent


def tools(build: str) -> Path:
    """The folder of `build`'s tools (bench/llamacpp.sh: x86, x86-gcc, arm64, arm64-kleidiai, ...),
    built on first use and cached."""
    r = subprocess.run(["bash", str(HERE / "llamacpp.sh"), build], stdout=subprocess.PIPE, text=True)
    if r.returncode != 0:
        hint = " (set KLEIDIAI_SRC, or choose the repack build)" if build.startswith("arm64-kleidiai") else ""
        raise SystemExit(f"{Path(sys.argv[0]).stem}: bench/llamacpp.sh {build} failed{hint}")
    return Path(r.stdout.strip().splitlines()[-1])


def tool(build: str, name: str) -> Path:
    """llama.cpp's `llama-NAME` ("bench", "server", "quantize", "perplexity", ...) of `build`."""
    return tools(build) / f"llama-{name}-{VERSION}"


def test_name(row: dict) -> str:
    """A llama-bench JSON row's test as `qwc bench` names it: pp512, tg128, "tg32 @ d4096"."""
    kind, n = ("tg", row["n_gen"]) if row["n_gen"] else ("pp", row["n_prompt"])
    return f"{kind}{n}" + (f" @ d{row['n_depth']}" if row.get("n_depth") else "")


def rate(row: dict) -> float:
    """A row's tokens a second: the median of its runs, the statistic of every peer table."""
    samples = sorted(row["samples_ts"])
    return samples[len(samples) // 2]


def llama_bench(bench: Path, gguf: Path, threads: int, args: list[str], reps: int = 1) -> tuple[dict[str, float], str]:
    """({test: tok/s}, its log) of one llama-bench run on `gguf`: `args` its tests (-p, -n, -d,
    cache types ...), `reps` runs of each."""
    cmd = [str(bench), "-m", str(gguf), "-t", str(threads), "-r", str(reps), "-o", "json", *args]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{Path(bench).name} exited {r.returncode}: {(r.stderr or r.stdout).strip().splitlines()[-1:]}")
    return {test_name(t): rate(t) for t in json.loads(r.stdout)}, r.stderr
