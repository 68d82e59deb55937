"""Every kernel's TIR, hashed: what a refactor of the kernel builders must leave unchanged.

Runs `qwc compile`'s steps up to the build for each target, KV cache format and batch setting,
and hashes each PrimFunc's `script()` instead of building it. With `--compare OLD.json` it
prints the kernels whose TIR differs from a run on another revision (none: the refactor changed
no kernel).

    .venv/bin/python bench/kernel_hashes.py ~/.cache/qwc/bench/q.q4.onnx -o /tmp/after.json \
        --compare /tmp/before.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path
from unittest import mock

TARGETS = ("host", "arm-yitian")
KV_TYPES = ("f32", "f16", "q8_0")
BATCHES = (1, 4)


class _Hashed(Exception):
    """Raised in place of the build, once the module's kernels are hashed."""


def kernel_hashes(graph: Path, target: str, kv: str, max_batch: int) -> dict[str, str]:
    import tvm

    from qwc.compiler import compile as compile_mod

    out: dict[str, str] = {}

    def hash_instead_of_build(mod, _target):
        for gv, fn in mod.functions_items():
            if isinstance(fn, tvm.tirx.PrimFunc):
                out[gv.name_hint] = hashlib.sha256(fn.script().encode()).hexdigest()[:16]
        raise _Hashed

    with mock.patch("qwc.compiler.build.build_for_artifact", hash_instead_of_build), tempfile.TemporaryDirectory() as d:
        try:
            compile_mod.compile_file(graph, target, Path(d) / "x.qwc", max_batch=max_batch, kv_type=kv,
                                     memory_check=False)
        except _Hashed:
            return out
    raise RuntimeError("the compile finished without reaching the build")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("graph", type=Path, help="a canonical graph (qwc optimize's output)")
    ap.add_argument("-o", "--out", type=Path, required=True, help="where to write the hashes (JSON)")
    ap.add_argument("--compare", type=Path, help="hashes from another revision")
    a = ap.parse_args()
    from qwc import progress

    progress.set_quiet(True)
    hashes = {}
    print("| target | KV cache | max batch | kernels |\n| --- | --- | ---: | ---: |")
    for target in TARGETS:
        for kv in KV_TYPES:
            for batch in BATCHES:
                key = f"{target}/{kv}/b{batch}"
                hashes[key] = kernel_hashes(a.graph, target, kv, batch)
                print(f"| {target} | {kv} | {batch} | {len(hashes[key])} |", flush=True)
    a.out.write_text(json.dumps(hashes, indent=1, sort_keys=True) + "\n")
    if a.compare is None:
        return 0
    old = json.loads(a.compare.read_text())
    differ = [f"{k} {name}" for k in sorted(set(old) | set(hashes))
              for name in sorted(set(old.get(k, {})) | set(hashes.get(k, {})))
              if old.get(k, {}).get(name) != hashes.get(k, {}).get(name)]
    total = sum(len(v) for v in hashes.values())
    print(f"\n{total} kernels compared with {a.compare}: {len(differ)} differ")
    for line in differ:
        print("  " + line)
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
