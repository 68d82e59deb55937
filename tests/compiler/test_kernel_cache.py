"""compiler/kernels/kernel_cache.py: a kernel built once is read back from disk as the same TIR,
keyed by its arguments; a broken entry is rebuilt; `QWC_KERNEL_CACHE=off` writes nothing."""

from __future__ import annotations

import pytest

from qwc.compiler.kernels import kernel_cache
from qwc.compiler.kernels.kernel_cache import CACHE_ENV, cached_kernel


def _counting_builder():
    from qwc.compiler.kernels.kv_cache import kv_cache_write

    calls = []

    def write(key_tiles: bool, head_dim: int):
        calls.append((key_tiles, head_dim))
        return kv_cache_write.__wrapped__(key_tiles, False, "float16", head_dim)

    return cached_kernel(write), calls


def test_a_kernel_is_built_once_and_read_back_as_the_same_tir(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    build, calls = _counting_builder()
    first = build(True, 64)
    assert build(True, 64) is first and len(calls) == 1          # the process's memo
    build.cache_clear()                                            # as a new process would start
    again = build(True, 64)
    assert len(calls) == 1 and again.script() == first.script()   # from disk, not rebuilt
    assert dict(again.attrs) == dict(first.attrs)
    build(False, 64)                                               # other arguments: another entry
    assert len(calls) == 2 and len(list(tmp_path.glob("write-*.json"))) == 2


def test_a_broken_entry_is_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    build, calls = _counting_builder()
    first = build(True, 32)
    (entry,) = tmp_path.glob("write-*.json")
    entry.write_text(entry.read_text()[:100])                      # a partial copy
    build.cache_clear()
    assert build(True, 32).script() == first.script() and len(calls) == 2
    assert len(entry.read_text()) > 100                            # and written again whole


def test_off_writes_nothing_and_unplain_arguments_skip_the_disk(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, "off")
    assert kernel_cache.cache_dir() is None
    build, calls = _counting_builder()
    build(True, 16)
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    build.cache_clear()
    build(True, 16)
    assert len(calls) == 2 and len(list(tmp_path.iterdir())) == 1
    assert kernel_cache._entry(build.__wrapped__, (object(),), {}) is None


@pytest.mark.parametrize("edit", ["source", "tvm"])
def test_the_key_changes_with_the_compiler_sources_and_tvm(tmp_path, monkeypatch, edit):
    import tvm

    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    build, _ = _counting_builder()
    before = kernel_cache._entry(build.__wrapped__, (True, 64), {})
    kernel_cache._sources_digest.cache_clear()
    if edit == "tvm":
        monkeypatch.setattr(tvm, "__version__", tvm.__version__ + "-other")
    else:
        monkeypatch.setattr(kernel_cache, "_COMPILER", tmp_path)   # another set of compiler files
    try:
        assert kernel_cache._entry(build.__wrapped__, (True, 64), {}) != before
    finally:
        kernel_cache._sources_digest.cache_clear()


def test_prune_drops_the_least_recently_used_entries_and_nothing_else(tmp_path, monkeypatch):
    import os
    import time

    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    now = time.time()
    entries = {f"k{i}-{i:032x}.{ext}": now - 100 * (10 - i) for i, ext in enumerate(["json", "o", "o.json", "json"])}
    for name, mtime in {**entries, "notes.txt": now - 10_000, ".tmp-abc.o": now - 2 * 86400,
                        ".tmp-new.o": now}.items():
        (tmp_path / name).write_bytes(b"x" * 1000)
        os.utime(tmp_path / name, (mtime, mtime))
    assert kernel_cache.prune(limit=2000) == 3000   # the dead writer's temp file, then the two oldest
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted([".tmp-new.o", "notes.txt", "k2-" + "2".zfill(32) + ".o.json", "k3-" + "3".zfill(32) + ".json"])
    assert kernel_cache.prune(limit=2000) == 0
