"""The model-size table: for each Qwen2.5 size, every stage's wall time and peak RSS, the
artifact's size, and what running it costs, on random weights of the exact shapes.

    .venv/bin/python bench/scale.py [--sizes 1.5b,3b,7b] [--targets host,arm-yitian]
        [--workdir build/scale] [--bench [--threads 2] [--rounds 2]] [--only-bench] [--json F] [--keep]
    .venv/bin/python bench/scale.py --gguf --sizes qwen2.5-32b [--workdir D] [--keep]

Per size: bench/make_checkpoint.py writes a hub-style bf16 checkpoint (once, kept in
--workdir; a Qwen3 preset such as qwen3-32b-2layers is made in code instead, no checkpoint on
disk), then `qwc export` (streamed), `qwc optimize`, `qwc compile` for each target and,
on the host artifact, `qwc run` (peak RSS of answering a prompt). With --bench, pp512 / tg128
of `qwc bench` against llama.cpp's llama-bench on a Q4_0 GGUF of the same checkpoint
(bench/gguf_q4_0.py), in alternating rounds; --only-bench does only that, on the artifacts an
earlier run left in --workdir. Each stage is its own process; its peak RSS is that process's, read with
wait4. Intermediate files are deleted after each size unless --keep (the float graph as soon
as it is optimized). Disk: a 7B needs ~42 GB free while it runs (checkpoint 15 GB, its float
graph in bf16 15 GB, the Q4_0 graph and two artifacts 12 GB); a 14B ~68 GB at its peak
(checkpoint and float graph 30 GB each, the Q4_0 graph 8 GB), then the compile's scratch, about
three times its artifact; the checkpoints stay in --workdir for the next run.

--gguf is the route for sizes whose float checkpoint would not fit the disk (a 32B's is 65 GB):
the preset's Q4_0 GGUF is written a tensor at a time, exported, compiled for the host and run
for 32 tokens (`one_gguf`); the GGUF is deleted once exported, so a 32B needs ~40 GB free.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from qwc.bench.llamacpp import VERSION

HERE = Path(__file__).resolve().parent
QWC = [sys.executable, "-m", "qwc"]


def _status_kib(pid: int) -> dict[str, int]:
    """/proc/PID/status's RssAnon and RssFile (KiB); empty once the process is gone."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    return {k: int(v.split()[0]) for k, v in (ln.split(":", 1) for ln in lines if ln.startswith(("RssAnon", "RssFile")))}


def run(cmd: list[str], log: Path) -> tuple[float, float, float, float]:
    """Wall seconds, peak RSS (GiB), and the largest anonymous and file-backed resident memory
    sampled every 0.1 s (GiB: mapped weights are file-backed, so peak RSS alone would count
    them) of one process; its output goes to `log`."""
    t0 = time.perf_counter()
    anon = file_ = 0
    with open(log, "a") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
        while True:
            pid, status, ru = os.wait4(p.pid, os.WNOHANG)
            if pid:
                break
            kib = _status_kib(p.pid)
            anon, file_ = max(anon, kib.get("RssAnon", 0)), max(file_, kib.get("RssFile", 0))
            time.sleep(0.1)
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode:
        raise SystemExit(f"scale: {' '.join(cmd[:4])} ... failed ({p.returncode}); see {log}")
    return time.perf_counter() - t0, ru.ru_maxrss / 2**20, anon / 2**20, file_ / 2**20


def size_of(path: Path) -> float:
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files) / 2**30


def one_size(size: str, targets: list[str], work: Path, bench: bool, keep: bool, threads: int = 2,
             rounds: int = 2) -> dict:
    from qwc.models.presets import is_checkpoint_preset

    log = work / f"{size}.log"
    ckpt = work / f"qwen2.5-{size}"
    preset = is_checkpoint_preset(size)
    if not preset and not (ckpt / "config.json").exists():
        subprocess.run([sys.executable, str(HERE / "make_checkpoint.py"), size, "-o", str(ckpt)], check=True)
    r = {"size": size, "checkpoint_gib": 0.0 if preset else size_of(ckpt), "stages": {}}
    onnx_, q4 = work / f"{size}.onnx", work / f"{size}.q4.onnx"
    r["stages"]["export"] = run(QWC + ["export", size if preset else str(ckpt), "-o", str(onnx_)], log)
    r["float_graph_gib"] = size_of(onnx_) + size_of(onnx_.with_name(onnx_.name + ".data"))
    r["stages"]["optimize"] = run(QWC + ["optimize", str(onnx_), "-o", str(q4)], log)
    if not keep:
        for p in work.glob(f"{size}.onnx*"):
            p.unlink()
    for t in targets:
        art = work / f"{size}-{t}.qwc"
        shutil.rmtree(art, ignore_errors=True)
        r["stages"][f"compile {t}"] = run(QWC + ["compile", str(q4), "--target", t, "-o", str(art)], log)
        r[f"artifact_gib {t}"] = size_of(art)
    if "host" in targets:
        art = work / f"{size}-host.qwc"
        r["stages"]["run"] = run(QWC + ["run", str(art), "--prompt", "The capital of France is",
                                        "--max-new-tokens", "16", "--ctx", "512"], log)
        if bench:
            r["speed"] = speed(size if preset else ckpt, art, work, threads, rounds)
    if not keep:
        for p in list(work.glob(f"{size}.q4.onnx*")) + list(work.glob(f"{size}.q4.*.json")):
            p.unlink()
    return r


def one_gguf(size: str, work: Path, keep: bool, tokens: int = 32) -> dict:
    """The large-model route without a float checkpoint on disk: the preset's Q4_0 GGUF written
    a tensor at a time (bench/gguf_q4_0.py), `qwc export` of the GGUF, `qwc compile` for the
    host, and `qwc run` of `tokens` tokens. The GGUF is deleted once exported unless `keep`
    (a 32B's is 18 GB)."""
    log, gguf = work / f"{size}.gguf.log", work / f"{size}.q4_0.gguf"
    onnx_, art = work / f"{size}.gguf.onnx", work / f"{size}.gguf-host.qwc"
    r: dict = {"size": size, "route": "gguf", "stages": {}}
    if not gguf.exists():
        r["stages"]["write gguf"] = run([sys.executable, str(HERE / "gguf_q4_0.py"), size, "-o", str(gguf)], log)
    r["gguf_gib"] = size_of(gguf)
    r["stages"]["export"] = run(QWC + ["export", str(gguf), "-o", str(onnx_)], log)
    r["graph_gib"] = size_of(onnx_) + sum(size_of(p) for p in work.glob(f"{onnx_.name}.*"))
    if not keep:
        gguf.unlink()
    shutil.rmtree(art, ignore_errors=True)
    r["stages"]["compile host"] = run(QWC + ["compile", str(onnx_), "-o", str(art)], log)
    r["artifact_gib host"] = size_of(art)
    if not keep:
        for p in work.glob(f"{onnx_.name}*"):
            p.unlink()
    r["stages"]["run"] = run(QWC + ["run", str(art), "--prompt", "The capital of France is",
                                    "--max-new-tokens", str(tokens), "--ctx", "512"], log)
    r["run_output"] = log.read_text().rsplit("$ ", 1)[-1]
    return r


def speed(ckpt: Path | str, art: Path, work: Path, threads: int, rounds: int) -> dict:
    """pp512 and tg128 (from an empty cache, llama-bench's definition) of the host artifact and
    of llama.cpp (its strongest build here, bench/llamacpp.sh x86) on a Q4_0 GGUF of the same
    weights (`ckpt`: a checkpoint folder, or a Qwen3 preset's name), in alternating rounds
    (qwc, llama.cpp, qwc, ...): the machine is shared."""
    from qwc.bench.gguf_q4_0 import write_gguf_q4_0_checkpoint
    from qwc.models.hf import open_hf_dir
    from qwc.models.presets import preset_checkpoint

    gguf = work / f"{Path(ckpt).name}.q4_0.gguf"
    if not gguf.exists():
        source = preset_checkpoint(ckpt) if isinstance(ckpt, str) else open_hf_dir(ckpt)
        write_gguf_q4_0_checkpoint(source, gguf.with_suffix(".partial"))
        gguf.with_suffix(".partial").rename(gguf)
    return alternating(art, gguf, threads, rounds)


def alternating(art: Path, gguf: Path, threads: int, rounds: int) -> dict:
    """pp512 and tg128 of `qwc bench` on the artifact and of llama-bench (bench/llamacpp.sh x86)
    on the GGUF, round by round in turn; medians per system and test, and every run."""
    from qwc.bench.llamacpp import llama_bench as peer_bench
    from qwc.bench.llamacpp import tools as llamacpp_tools

    llama_bench = llamacpp_tools("x86") / f"llama-bench-{VERSION}"
    env = dict(os.environ, TVM_NUM_THREADS=str(threads))
    got: dict[str, dict[str, list[float]]] = {"qwc": {}, "llama.cpp": {}}
    for _ in range(rounds):
        out = subprocess.run(QWC + ["bench", str(art), "-p", "512", "-n", "128", "-r", "1", "--threads", str(threads),
                                    "--json"], check=True, capture_output=True, text=True, env=env).stdout
        for row in json.loads(out)["results"]:
            got["qwc"].setdefault(row["test"], []).append(row["tps"])
        for test, tps in peer_bench(llama_bench, gguf, threads, ["-p", "512", "-n", "128"])[0].items():
            got["llama.cpp"].setdefault(test, []).append(tps)
    return {sys_: {t: sorted(v)[len(v) // 2] for t, v in tests.items()} | {"runs": tests}
            for sys_, tests in got.items()}


def speed_table(results: list[dict]) -> str:
    rows = ["| size | qwc pp512 | llama.cpp pp512 | ratio | qwc tg128 | llama.cpp tg128 | ratio |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in results:
        if "speed" not in r:
            continue
        q, l = r["speed"]["qwc"], r["speed"]["llama.cpp"]
        rows.append(f"| {r['size']} | {q['pp512']:.1f} | {l['pp512']:.1f} | {q['pp512'] / l['pp512']:.2f}x"
                    f" | {q['tg128']:.2f} | {l['tg128']:.2f} | {q['tg128'] / l['tg128']:.2f}x |")
    return "\n".join(rows)


def _cell(stage: tuple) -> str:
    """Wall time, peak RSS and, of that, the largest anonymous part (file-backed pages are
    mapped weights or the page cache, shared and reclaimable)."""
    return f"{stage[0]:.0f} s, {stage[1]:.2f} GiB ({stage[2]:.2f} anon)"


def table(results: list[dict]) -> str:
    stages = list(dict.fromkeys(s for r in results for s in r["stages"]))
    first = [("checkpoint", "checkpoint_gib"), ("float graph", "float_graph_gib")]
    if any(r.get("route") == "gguf" for r in results):
        first = [("GGUF", "gguf_gib"), ("graph", "graph_gib")]
    rows = ["| size | " + " | ".join(h for h, _ in first) + " | " + " | ".join(stages) + " |",
            "| --- | " + " | ".join("---:" for _ in first + stages) + " |"]
    for r in results:
        cells = [f"{r[k]:.2f} GiB" if k in r else "-" for _, k in first]
        cells += [_cell(r["stages"][s]) if s in r["stages"] else "-" for s in stages]
        rows.append(f"| {r['size']} | " + " | ".join(cells) + " |")
    arts = [(r["size"], k.split(" ", 1)[1], v) for r in results for k, v in r.items() if k.startswith("artifact_gib")]
    rows.append("")
    rows.append("artifacts: " + ", ".join(f"{s} {t} {v:.2f} GiB" for s, t, v in arts))
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1.5b,3b,7b")
    p.add_argument("--targets", default="host,arm-yitian")
    p.add_argument("--workdir", type=Path, default=Path("build/scale"))
    p.add_argument("--bench", action="store_true",
                   help="also pp512 / tg128 of the host artifact against llama.cpp on the same weights")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds of the speed comparison")
    p.add_argument("--only-bench", action="store_true",
                   help="only the speed comparison, on the host artifacts an earlier run left")
    p.add_argument("--keep", action="store_true", help="keep the float and canonical graphs (and the GGUF)")
    p.add_argument("--gguf", action="store_true",
                   help="sizes are checkpoint presets (qwen2.5-32b, ...): their Q4_0 GGUF written a tensor at a "
                        "time, then export, compile for the host and a 32-token run; no float checkpoint on disk")
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    a.workdir.mkdir(parents=True, exist_ok=True)
    results = []
    for size in a.sizes.split(","):
        if a.gguf:
            results.append(one_gguf(size, a.workdir, a.keep))
        elif a.only_bench:
            from qwc.models.presets import is_checkpoint_preset

            ckpt = size if is_checkpoint_preset(size) else a.workdir / f"qwen2.5-{size}"
            art = a.workdir / f"{size}-host.qwc"
            results.append({"size": size, "speed": speed(ckpt, art, a.workdir, a.threads, a.rounds)})
        else:
            results.append(one_size(size, a.targets.split(","), a.workdir, a.bench, a.keep, a.threads, a.rounds))
        print(f"scale: {size} done: {json.dumps(results[-1].get('stages', results[-1].get('speed')))}",
              file=sys.stderr, flush=True)
        if a.json:
            a.json.write_text(json.dumps(results, indent=1))
    if not a.only_bench:
        print("stage cells: wall time, peak RSS of the process (one process per stage), its largest anonymous part")
        print(table(results))
    if any("speed" in r for r in results):
        print(f"\nspeed, {a.threads} threads, tok/s (median of {a.rounds} alternating rounds); ratio = qwc / llama.cpp")
        print(speed_table(results))


if __name__ == "__main__":
    main()
