"""An artifact's size against the GGUF it was compiled from (issue 67's size criterion):

    .venv/bin/python bench/artifact_size.py model.qwc model.gguf

Prints one table: the GGUF's tensor bytes by type, the artifact's params.bin (what is stored
and shipped: parameters at rest in their stored form, qwc/params_at_rest.py) and the same
parameters in memory as the library reads them after loading, each as a ratio to the GGUF's
tensor bytes; then the parameters stored at rest, by form.
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path

DERIVED = ("rotary_cos_cache", "rotary_sin_cache")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("artifact", type=Path)
    p.add_argument("gguf", type=Path)
    a = p.parse_args()

    import gguf

    from qwc.manifest import read_manifest

    reader = gguf.GGUFReader(str(a.gguf))
    by_type = collections.Counter()
    for t in reader.tensors:
        by_type[t.tensor_type.name] += int(t.n_bytes)
    tensors = sum(by_type.values())
    m = read_manifest(a.artifact)
    stored = (a.artifact / "params.bin").stat().st_size
    memory = m.weight_bytes
    print(f"{a.artifact} ({m.target.name}) against {a.gguf.name}")
    print()
    print("| what | bytes | / GGUF tensors |")
    print("| --- | ---: | ---: |")
    for name, n in sorted(by_type.items(), key=lambda kv: -kv[1]):
        print(f"| GGUF {name} tensors | {n:,} | {n / tensors:.3f} |")
    print(f"| GGUF tensors | {tensors:,} | 1.000 |")
    print(f"| params.bin (stored) | {stored:,} | {stored / tensors:.3f}x |")
    print(f"| parameters in memory | {memory:,} | {memory / tensors:.3f}x |")
    # tables the compiler derives (rotary cos / sin), which no GGUF tensor holds
    derived = sum(q.memory_bytes for q in m.params if q.name.startswith(DERIVED))
    print(f"| weights in memory (less {derived:,} bytes of rotary tables) | {memory - derived:,} "
          f"| {(memory - derived) / tensors:.3f}x |")
    forms = collections.Counter()
    saved = collections.Counter()
    for q in m.params:
        if q.at_rest:
            forms[q.at_rest["form"]] += 1
            saved[q.at_rest["form"]] += q.memory_bytes - q.nbytes
    print()
    print("| at-rest form | parameters | bytes saved |")
    print("| --- | ---: | ---: |")
    for f, n in sorted(forms.items()):
        print(f"| {f} | {n} | {saved[f]:,} |")
    if not forms:
        print("| (none) | 0 | 0 |")


if __name__ == "__main__":
    main()
