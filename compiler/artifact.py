"""The compiled artifact `model.qwc/`: a folder a person can inspect with standard tools.

    manifest.json   format version, qwc version, target, model config, quantization,
                    entry points and their signature, parameter index, file hashes
    lib.so          the built module (cross-linked for ARM targets)
    params.bin      every parameter, raw little-endian, 64-byte aligned, indexed in the manifest
    tokenizer.json  the model's tokenizer

Written into a temp folder beside the destination and renamed into place, so a failed
compile never leaves a half-written artifact.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import onnx

from qwc import __version__
from qwc.atomic import replace_dir, staging_dir, temp_files_in
from qwc.checksum import sha256
from qwc.config import ModelConfig
from qwc.errors import QwcError
from qwc.manifest import ALIGN, AT_REST_VERSION, ArtifactTarget, Functions, Manifest, Param, Quantization
from qwc.passes.graph import active_weight_file, tensor_array, weight_file_offset

LIB_SPACE = 64 << 20   # lib.so and its object files: ~1-6 MiB for the presets


def write_params(path: Path, names: list[str], values: dict, at_rest: dict[str, dict] | None = None) -> list[Param]:
    """Write params.bin in `names` order; `at_rest` (compiler/pack_at_rest.py: plan) names the
    parameters to store in a smaller form where that round trip is exact."""
    from .pack_at_rest import pack

    at_rest = at_rest or {}
    index, offset = [], 0
    last_read = _last_reads(names, values, at_rest)
    with open(path, "wb") as f:
        for i, name in enumerate(names):
            a = _array(values[name])
            spec, stored = at_rest.get(name), None
            if spec is not None:
                scales = _array(values[spec["scales"]]) if spec.get("scales") in values else None
                stored = pack(spec, a, scales)
            pad = -offset % ALIGN
            f.write(b"\0" * pad)
            offset += pad
            data = a if stored is None else stored
            f.write(data.tobytes())
            index.append(Param(name, str(a.dtype), tuple(a.shape), offset, data.nbytes,
                               None if stored is None else dict(spec)))
            offset += data.nbytes
            if i in last_read and (wf := active_weight_file()) is not None:
                wf.release(last_read[i])   # read for the last time: params.bin grows as the scratch file shrinks
        # The runtime maps params.bin (runtime/memory.py). Pages a write leaves in the page cache
        # are partly small folios, mapped 4 KiB a page, where the kernels' weights want 2 MiB
        # pages; written out and dropped, the file is read back at the first load in large ones.
        f.flush()
        os.fdatasync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return index


def _last_reads(names: list[str], values: dict, at_rest: dict[str, dict]) -> dict[int, list[int]]:
    """For write_params: at which parameter (its index in `names`) each tensor of the active
    weight file is read for the last time (as itself, or as the scales of one stored at rest)
    -> their offsets there."""
    last: dict[int, int] = {}
    for i, name in enumerate(names):
        spec = at_rest.get(name) or {}
        for v in (values[name], values.get(spec.get("scales"))):
            if (at := weight_file_offset(v)) is not None:
                last[at] = i
    by_index: dict[int, list[int]] = {}
    for at, i in last.items():
        by_index.setdefault(i, []).append(at)
    return by_index


def _array(v) -> np.ndarray:
    if isinstance(v, onnx.TensorProto):   # a weight passed by reference (compiler/build.py)
        v = tensor_array(v)
    return np.ascontiguousarray(v.numpy() if hasattr(v, "numpy") else v)


def write_artifact(out: Path, *, executable, target, config: ModelConfig, param_names, params,
                   tokenizer: Path | None, functions: Functions, quantization: Quantization,
                   link_options: list[str] | None = None, at_rest: dict[str, dict] | None = None) -> None:
    out = Path(out)
    with staging_dir(out, folder=True, foreign=foreign_files) as tmp:
        art = tmp / out.name
        art.mkdir()
        lib = art / "lib.so"
        index = write_params(art / "params.bin", param_names, params, at_rest)
        # LLVM ends the process (exit 1) when it cannot write its object file: refuse a nearly
        # full disk here, in one line, rather than there.
        free = shutil.disk_usage(tmp).free
        if free < LIB_SPACE:
            raise QwcError(f"cannot write {out}: no space left on the device ({free / 2**20:.0f} MiB free, "
                           f"the library needs up to {LIB_SPACE / 2**20:.0f} MiB while it is built)")
        with temp_files_in(tmp):
            options = {"options": link_options} if link_options else {}
            if target.cross_compiler:
                import tvm
                # The triple given: TVM's default asks the host's compiler, and packs the VM's
                # bytecode for it where no kernel is an LLVM module (kernel_objects.py).
                cc = tvm.support.cc.cross_compiler(target.cross_compiler, get_target_triple=lambda: target.triple)
                executable.export_library(str(lib), fcompile=cc, **options)
            else:
                executable.export_library(str(lib), **options)
        files = ["lib.so", "params.bin"]
        if tokenizer is not None:
            shutil.copyfile(tokenizer, art / "tokenizer.json")
            files.append("tokenizer.json")
        manifest = Manifest(ArtifactTarget(target.name, target.arch, target.triple, target.mcpu,
                                           tuple(sorted(target.features)), tuple(target.mattr)),
                            config, functions, tuple(index), {f: sha256(art / f) for f in files}, quantization,
                            __version__, AT_REST_VERSION if any(p.at_rest for p in index) else 1)
        # through the reader's checks: what is written is what the runtime will accept
        written = manifest.to_dict()
        if Manifest.from_dict(written, where=f"the manifest qwc wrote for {out}") != manifest:
            raise AssertionError(f"the manifest for {out} does not read back as written")
        (art / "manifest.json").write_text(json.dumps(written, indent=1) + "\n")
        replace_dir(art, out, foreign_files)


def foreign_files(folder: Path) -> str | None:
    """What in an existing `folder` is not an artifact qwc wrote (None: nothing): qwc replaces
    an artifact whose manifest lists every file in it, and nothing else (qwc.atomic)."""
    if not folder.exists():
        return None
    try:
        files = json.loads((folder / "manifest.json").read_text())["files"]
        if not isinstance(files, dict):
            raise TypeError
    except (OSError, ValueError, KeyError, TypeError):
        return "it is not a qwc artifact (no readable manifest.json)"
    extra = sorted(p.name for p in folder.iterdir() if p.name != "manifest.json" and p.name not in files)
    return f"it holds {extra[0]}, which is not part of the artifact" if extra else None
