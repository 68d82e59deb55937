"""qwc's files for a benchmark, each made once: `qwc` run as a user runs it, and the
export -> optimize -> compile chain of a model kept in a work folder (the artifact rebuilt on
request, so that it has this checkout's kernels)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

QWC = [sys.executable, "-m", "qwc"]


def qwc(*args: str, capture: bool = False, **kw) -> str:
    """`qwc ARGS` in a process of its own; its stdout where `capture`. A failure stops the benchmark."""
    r = subprocess.run([*QWC, *args], check=True, text=True, stdout=subprocess.PIPE if capture else None, **kw)
    return r.stdout if capture else ""


def made(path: Path, *args: str) -> Path:
    """`path`, running `qwc ARGS` (which writes it) when it is not there yet."""
    if not Path(path).exists():
        qwc(*args)
    return Path(path)


def chain(source: str, workdir: Path, name: str, export: tuple = (), optimize: tuple | None = (),
          compile_: tuple = (), target: str = "host", fresh: tuple = ("qwc",),
          artifact: str | None = None) -> dict[str, Path]:
    """{"onnx", "q4", "qwc"}: `source` exported, optimized (None: compiled from the export, as a
    GGUF's kept weights are) and compiled for `target` under `workdir` as NAME.onnx, NAME.q4.onnx
    and ARTIFACT.qwc (default NAME, or NAME-TARGET); each made once and kept between runs, but
    for those `fresh` names ("onnx", "q4", "qwc": made again, so they are this checkout's)."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    art = workdir / f"{artifact or (name if target == 'host' else f'{name}-{target}')}.qwc"
    paths = {"onnx": workdir / f"{name}.onnx", "q4": workdir / f"{name}.q4.onnx" if optimize is not None else None,
             "qwc": art}
    for kind in fresh:
        if paths.get(kind) is not None:
            if kind == "qwc":
                shutil.rmtree(art, ignore_errors=True)
            else:
                paths[kind].unlink(missing_ok=True)
    made(paths["onnx"], "-q", "export", str(source), *export, "-o", str(paths["onnx"]))
    if optimize is None:
        paths["q4"] = paths["onnx"]
    else:
        made(paths["q4"], "-q", "optimize", str(paths["onnx"]), *optimize, "-o", str(paths["q4"]))
    made(art, "-q", "compile", str(paths["q4"]), "--target", target, *compile_, "-o", str(art))
    return paths
