"""The runtime on a host artifact: the Engine (chunked prefill, generation, memory, views), the
artifact's self-checks (the typed manifest, hashes, architecture) and `qwc run` / `qwc bench`."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from qwc import progress
from qwc.cli import main
from qwc.runtime.engine import Engine

from conftest import copy_artifact, edit_manifest, one_line


def test_chunked_prefill_equals_one_shot(tiny_host_artifact, monkeypatch):
    import qwc.runtime.engine as E

    ids = list(np.random.default_rng(3).integers(0, 259, 40))
    a = Engine(tiny_host_artifact, ctx=64).prefill(ids)
    monkeypatch.setattr(E, "PREFILL_CHUNK", 16)
    b = Engine(tiny_host_artifact, ctx=64).prefill(ids)
    assert np.abs(a - b).max() < 1e-4


def test_generate_streams_text_and_stops(tiny_host_artifact):
    eng = Engine(tiny_host_artifact, ctx=64)
    pieces = list(eng.generate("Hi", max_new_tokens=8))
    assert eng.pos <= 2 + 8
    assert all(isinstance(p, str) for p in pieces)
    eng.reset()
    first = list(eng.generate([72, 105], max_new_tokens=5))
    eng.reset()
    assert list(eng.generate([72, 105], max_new_tokens=5)) == first   # greedy is deterministic


def _greedy(eng, parts, n):
    """n greedy tokens after `parts` fed in turn from an empty cache (a list: one prefill call;
    an int: one decode step), by the engine's own calls."""
    eng.reset()
    for part in parts:
        logits = eng.decode(part) if isinstance(part, int) else eng.prefill(part)
    out = []
    for _ in range(n):
        out.append(int(logits[:eng.sample_limit].argmax()))   # ids the tokenizer has, as the sampler
        logits = eng.decode(out[-1])
    return out


def test_generate_reuses_what_its_last_call_left_in_the_cache(tiny_host_artifact):
    """generate runs the server's loop in the engine's own sequence: a prompt that continues
    the last one and its reply (a chat's next turn) prefills only what is new, and gives the
    tokens an empty cache gives; a sequence written in between (prefill) is not reused."""
    eng = Engine(tiny_host_artifact, ctx=64)
    first = [72, 105, 33, 10]
    list(eng.generate(first, max_new_tokens=6, stop=set()))   # no end token: 6 tokens
    said = eng.generated_cache
    assert said[:4] == first and len(said) == eng.pos == 4 + 6 - 1   # the last token is not fed
    turn = said + [7, 8, 9]
    pieces = list(eng.generate(turn, max_new_tokens=5, stop=set()))
    assert eng.stats["cached_tokens"] == len(said) and eng.stats["generated"] == 5
    # the same calls on a fresh engine: the first prompt, the first reply's steps, the new turn
    fresh = Engine(tiny_host_artifact, ctx=64)
    want = _greedy(fresh, [first, *said[4:], [7, 8, 9]], 5)
    assert eng.generated_cache == turn + want[:4]   # all but the last token went into the cache
    # the text, but for a last partial UTF-8 sequence, held back as the stream holds it
    assert fresh.tokenizer.decode(want).startswith("".join(pieces)) and "".join(pieces)
    eng.prefill([3, 4])   # the sequence moves on outside generate
    assert eng.generated_cache == []
    list(eng.generate(turn, max_new_tokens=2, stop=set()))
    assert eng.stats["cached_tokens"] == 0 and eng.stats["generated"] == 2


def test_run_speculates_by_prompt_lookup_and_by_a_draft_model(tiny_host_artifact, capsys):
    """`qwc run --speculate ngram` and `--draft` (the artifact drafting for itself: every draft
    is kept) print what plain greedy decoding prints; both at once are refused."""
    args = ["-q", "run", str(tiny_host_artifact), "--prompt", "abcabcabcabc", "--max-new-tokens", "24",
            "--threads", "1"]
    assert main(args) in (0, None)
    plain = capsys.readouterr().out
    try:
        for extra in (["--speculate", "ngram", "--lookup-min", "1"], ["--draft", str(tiny_host_artifact)]):
            assert main(args[1:] + extra) in (0, None)   # not quiet: the counts are in the timings line
            out = capsys.readouterr()
            assert out.out == plain
            kept, drafted = map(int, re.search(r"(\d+) of (\d+) draft tokens kept", out.err).groups())
            assert drafted > 0 and (kept == drafted if "--draft" in extra else kept <= drafted)
    finally:
        progress.set_quiet(True)
    assert main(args + ["--speculate", "ngram", "--draft", str(tiny_host_artifact)]) == 2
    err = capsys.readouterr().err
    assert "two ways of drafting" in err and err.count("\n") == 1


def test_run_takes_the_openai_penalties(tiny_host_artifact, capsys):
    assert main(["-q", "run", str(tiny_host_artifact), "--prompt", "ab", "--max-new-tokens", "4",
                 "--presence-penalty", "-1", "--frequency-penalty", "2"]) in (0, None)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["-q", "run", str(tiny_host_artifact), "--prompt", "a", "--presence-penalty", "3"])
    assert e.value.code == 2 and "--presence-penalty: 3 is not in [-2, 2]" in capsys.readouterr().err


def test_run_follows_a_grammar_and_refuses_bad_ones(tiny_host_artifact, capsys, tmp_path):
    """`qwc run --grammar-file` / `--json-schema` (llama.cpp's options): even the random tiny
    model's text follows the grammar; bad schemas and grammars end in one line."""
    g = tmp_path / "yn.gbnf"
    g.write_text('root ::= "yes" | "no"\n')
    assert main(["-q", "run", str(tiny_host_artifact), "--prompt", "Q:", "--grammar-file", str(g)]) in (0, None)
    assert capsys.readouterr().out in ("Q:yes\n", "Q:no\n")
    schema = '{"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], ' \
             '"additionalProperties": false}'
    assert main(["-q", "run", str(tiny_host_artifact), "--prompt", "Q:", "--json-schema", schema,
                 "--max-new-tokens", "200"]) in (0, None)
    out = capsys.readouterr().out
    assert json.loads(out[2:])["ok"] in (True, False)
    g.write_text("root ::= (")
    for extra, words in [(["--json-schema", "{bad"], "--json-schema is not JSON"),
                         (["--json-schema", '{"type": "nonsense"}'], "--json-schema cannot be used"),
                         (["--grammar-file", str(g)], "GBNF"),
                         (["--grammar-file", str(tmp_path / "none.gbnf")], "--grammar-file"),
                         (["--json-schema", "{}", "--grammar-file", str(g)], "not both")]:
        assert main(["-q", "run", str(tiny_host_artifact), "--prompt", "Q:", *extra]) == 2
        err = capsys.readouterr().err
        assert words in err and err.count("\n") == 1, err


def test_prompt_longer_than_ctx(tiny_host_artifact, capsys):
    code = main(["-q", "run", str(tiny_host_artifact), "--prompt", "x" * 40, "--ctx", "16"])
    one_line(capsys, code, "the context holds 16")


def test_wrong_format_version(tiny_host_artifact, tmp_path, capsys):
    art = copy_artifact(tiny_host_artifact, tmp_path)
    edit_manifest(art, lambda m: m.update(format_version=99))
    one_line(capsys, main(["-q", "run", str(art), "--prompt", "a"]), "format version 99 is not supported")


def test_corrupt_manifest(tiny_host_artifact, tmp_path, capsys):
    art = copy_artifact(tiny_host_artifact, tmp_path)
    (art / "manifest.json").write_text("{ not json")
    one_line(capsys, main(["-q", "run", str(art), "--prompt", "a"]), "corrupt manifest")


@pytest.mark.parametrize("field, value, expect", [
    ("max_batch", "4", "functions.max_batch '4' must be an integer"),
    ("max_batch", 8, "above 1 exactly when there is a decode_batch"),     # this library has none
    ("max_batch", 0, "functions.max_batch 0 must be"),
    ("max_tokens_per_call", -3, "functions.max_tokens_per_call -3 must be"),
    ("max_tokens_per_call", 2.5, "functions.max_tokens_per_call 2.5 must be"),
    ("verify_tokens", 0, "functions.verify_tokens 0 must be an integer in [1, 256]"),
    ("verify_tokens", None, "functions.verify_tokens None must be"),   # the library has a verify entry point
    ("cache_dtype", "int4", "functions.cache_dtype 'int4' must be one of float32, float16, q8_0"),
    ("cache_dtype", "q8_0", "the library refused its inputs"),   # a float32 cache's library
])
def test_manifest_limits_are_checked(tiny_host_artifact, tmp_path, capsys, field, value, expect):
    art = copy_artifact(tiny_host_artifact, tmp_path)
    edit_manifest(art, lambda m: m["functions"].update({field: value}))
    one_line(capsys, main(["-q", "run", str(art), "--prompt", "a"]), expect)


def test_the_manifest_is_typed_and_round_trips(tiny_host_artifact):
    """qwc.manifest.Manifest: the file is what to_dict writes, from_dict(to_dict) is the same
    manifest, and the runtime reads typed fields (no string keys, no defaults at the reader)."""
    from qwc.config import ModelConfig
    from qwc.manifest import Manifest, read_manifest

    raw = json.loads((tiny_host_artifact / "manifest.json").read_text())
    m = read_manifest(tiny_host_artifact)
    assert m.to_dict() == raw and Manifest.from_dict(m.to_dict()) == m
    assert isinstance(m.model, ModelConfig) and m.functions.max_batch == 1
    assert m.functions.cache_capacity_multiple == 16 and m.functions.k_cache_layout == "key_tiles_16"
    assert [p.name for p in m.params] == [p["name"] for p in raw["params"]]
    assert m.weight_bytes == sum(p["nbytes"] for p in raw["params"]) and isinstance(m.params[0].shape, tuple)
    eng = Engine(tiny_host_artifact, ctx=16)
    assert eng.manifest == m and eng.model.vocab_size == raw["model"]["vocab_size"]


def test_edited_hash_or_truncated_params(tiny_host_artifact, tmp_path, capsys):
    art = copy_artifact(tiny_host_artifact, tmp_path)
    p = art / "params.bin"
    p.write_bytes(p.read_bytes()[:1000])
    one_line(capsys, main(["-q", "run", str(art), "--prompt", "a"]), "params.bin does not match its hash")
    with pytest.raises(Exception, match="params.bin is truncated"):
        Engine(art, verify_hashes=False)


def test_params_and_cache_are_aligned_slices_of_zeroed_arenas(tiny_host_artifact):
    """runtime/memory.py: the parameters are params.bin's bytes, in place in one mapping
    (64-byte aligned, in manifest order, no gaps beyond alignment); the cache starts zeroed."""
    from qwc.runtime.memory import ALIGN, Arena

    eng = Engine(tiny_host_artifact, ctx=40)
    manifest = json.loads((tiny_host_artifact / "manifest.json").read_text())
    raw = (tiny_host_artifact / "params.bin").read_bytes()
    ptrs = [t.data_ptr() for t in eng.params]
    assert all(p % ALIGN == 0 for p in ptrs)
    for spec, t, p, nxt in zip(manifest["params"], eng.params, ptrs, ptrs[1:] + [None]):
        got = t.numpy()
        assert got.tobytes() == raw[spec["offset"]:spec["offset"] + spec["nbytes"]]
        if nxt is not None:
            assert p + spec["nbytes"] <= nxt < p + spec["nbytes"] + ALIGN
    assert eng.seq.cache[0].shape[2] == 48   # ctx rounded up to the attention's multiple of 16
    assert eng.seq.capacity == 40
    assert all(not c.numpy().any() for c in eng.seq.cache)
    other = eng.sequence()                    # a second stream: its own cache, the same shape
    assert other.cache[0].data_ptr() != eng.seq.cache[0].data_ptr() and other.cache[0].shape[2] == 48

    arena = Arena(200)
    a, b = arena.take((3,), "float16"), arena.take((5,), "int32")
    assert b.ctypes.data - a.ctypes.data == ALIGN and not b.any()
    with pytest.raises(ValueError, match="cannot hold"):
        arena.take((40,), "float32")


def _params_mappings(art) -> list[dict[str, int]]:
    """This process's mappings of `art`'s params.bin, each its smaps fields in kB."""
    blocks = re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", open("/proc/self/smaps").read())
    target = str((art / "params.bin").resolve())
    return [{k: int(v) for k, v in re.findall(r"^(\w+):\s+(\d+) kB", b, re.M)}
            for b in blocks if b.splitlines()[0].endswith(" " + target)]


def test_a_file_cached_in_small_pages_is_read_again_in_huge_ones(tmp_path):
    """Small writes leave a file's page cache in 4 KiB folios, which a mapping maps 4 KiB a page.
    Where the file system keeps 2 MiB folios (a file written in one go maps in 2 MiB pages),
    MappedFile drops and reads it again in them, once: the next mapping finds them cached.
    Elsewhere nothing is read again. The bytes are the file's either way."""
    from qwc.runtime import memory

    data = np.random.default_rng(0).integers(0, 256, 16 << 20, dtype=np.uint8).tobytes()
    probe = tmp_path / "probe.bin"
    probe.write_bytes(data[:8 << 20])
    m = memory.MappedFile._mapped(probe)
    capable = bool(memory.pmd_mapped_share(m))
    m.close()
    path = tmp_path / "params.bin"
    with open(path, "wb", buffering=0) as f:
        for at in range(0, len(data), 4096):
            f.write(data[at:at + 4096])
    m = memory.MappedFile._mapped(path)
    assert memory.pmd_mapped_share(m) < memory.HUGE_SHARE
    m.close()
    first = memory.MappedFile(path)
    assert first.reread == capable and first.bytes.tobytes() == data
    share = memory.pmd_mapped_share(first._map)
    assert share >= memory.HUGE_SHARE if capable else share < memory.HUGE_SHARE
    second = memory.MappedFile(path)
    assert not second.reread and memory.pmd_mapped_share(second._map) == share


def test_a_reread_that_stays_in_small_pages_is_not_tried_again(tmp_path, monkeypatch):
    """Where a reread leaves the file below the share wanted (memory too fragmented for 2 MiB
    folios, say; here a share no mapping reaches), MappedFile remembers the file by its identity
    and the next load does not read it again; a changed file is tried again."""
    from qwc.runtime import memory

    monkeypatch.setenv(memory.FUTILE_ENV, str(tmp_path / "rereads"))
    monkeypatch.setattr(memory, "HUGE_SHARE", 1.01)
    path = tmp_path / "params.bin"

    def write(seed):
        data = np.random.default_rng(seed).integers(0, 256, 8 << 20, dtype=np.uint8).tobytes()
        with open(path, "wb", buffering=0) as f:
            for at in range(0, len(data), 4096):
                f.write(data[at:at + 4096])
        return data

    data = write(0)
    first = memory.MappedFile(path)
    capable = first.reread   # the file system keeps 2 MiB folios (see the test above)
    assert first.bytes.tobytes() == data and memory._futile_before(path) == capable
    assert not memory.MappedFile(path).reread
    del first
    time.sleep(0.01)
    data = write(1)   # new bytes, a new modification time
    again = memory.MappedFile(path)
    assert again.reread == capable and again.bytes.tobytes() == data


def test_checksum_reads_through_a_huge_page_mapping(tmp_path, monkeypatch):
    """qwc/checksum.py hashes a file through mappings a window at a time (here 4 MiB windows, the
    last a part), so that a first load's hash leaves its page cache as the engine's mapping
    wants it (read(2) leaves it partly in small folios)."""
    import hashlib

    from qwc import checksum
    from qwc.runtime import memory

    monkeypatch.setattr(checksum, "WINDOW", 4 << 20)
    data = np.random.default_rng(1).integers(0, 256, 9 << 20, dtype=np.uint8).tobytes()
    path = tmp_path / "params.bin"
    path.write_bytes(data)
    memory.drop_cached(path)
    assert checksum.sha256(path) == hashlib.sha256(data).hexdigest()
    assert not memory.MappedFile(path).reread
    (tmp_path / "empty").write_bytes(b"")
    assert checksum.sha256(tmp_path / "empty") == hashlib.sha256(b"").hexdigest()


def test_weights_are_params_bins_pages_unless_no_mmap(tiny_host_artifact, tmp_path):
    """Mapped (the default, runtime/memory.py: MappedFile) every parameter is a page of params.bin's
    mapping, resident and none of it the process's own (anonymous); --no-mmap reads them into
    memory. The logits are the same bits either way."""
    art = copy_artifact(tiny_host_artifact, tmp_path)
    size = (art / "params.bin").stat().st_size
    mapped = Engine(art, ctx=32)
    assert mapped.mapped_bytes == mapped.manifest.weight_bytes and mapped.copied_bytes == 0
    assert "mapped from params.bin" in mapped.describe_weights()
    [vma] = _params_mappings(art)
    assert vma["Rss"] * 1024 >= size - 4096 and vma["Anonymous"] == 0
    copied = Engine(art, ctx=32, map_weights=False)
    assert copied.mapped_bytes == 0 and copied.copied_bytes == mapped.manifest.weight_bytes
    assert len(_params_mappings(art)) == 1 and "read into memory" in copied.describe_weights()
    for eng in (mapped, copied):
        eng.logits = [eng.prefill([1, 2, 3, 4])] + [eng.decode(t) for t in (5, 6, 7)]
    assert all(np.array_equal(a, b) for a, b in zip(mapped.logits, copied.logits))


def test_run_says_how_it_loaded_the_weights(tiny_host_artifact, capsys):
    for flags, said in (([], "mapped from params.bin"), (["--no-mmap"], "read into memory")):
        assert main(["run", str(tiny_host_artifact), "--prompt", "a", "--max-new-tokens", "2", *flags]) in (0, None)
        err = capsys.readouterr().err
        assert said in err and re.search(r"first token [0-9.]+s after start", err), err


def test_a_replaced_artifact_leaves_a_loaded_engine_on_its_old_weights(tiny_q4, tmp_path):
    """`qwc compile -o` over the artifact a server has mapped renames a new folder into place and
    deletes the old one: the loaded engine keeps its mapping of the old file (same logits), and a
    new Engine, in another process or in this one (runtime/engine.py: _library_path), loads the
    new artifact."""
    from qwc.compiler.compile import compile_file

    art = tmp_path / "m.qwc"
    compile_file(tiny_q4, "host", art, act_bits=32, kv_type="f32")
    old = Engine(art, ctx=32)
    before = old.prefill([1, 2, 3, 4])
    compile_file(tiny_q4, "host", art, act_bits=8, kv_type="f32")   # other weights' layout, other kernels
    old.reset()
    assert np.array_equal(old.prefill([1, 2, 3, 4]), before)
    out = tmp_path / "new.npy"
    subprocess.run([sys.executable, "-c", "import sys, numpy as np; from qwc.runtime.engine import Engine; "
                    "e = Engine(sys.argv[1], ctx=32); assert e.manifest.quantization.activation_bits == 8; "
                    "np.save(sys.argv[2], e.prefill([1, 2, 3, 4]))", str(art), str(out)], check=True)
    assert old.manifest.quantization.activation_bits == 32 and not np.array_equal(np.load(out), before)
    # this process too, whose dynamic loader holds the old lib.so under that path
    again = Engine(art, ctx=32)
    assert again.manifest.quantization.activation_bits == 8 and np.array_equal(again.prefill([1, 2, 3, 4]), np.load(out))
    old.reset()
    assert np.array_equal(old.prefill([1, 2, 3, 4]), before)


def test_an_unchanged_artifact_is_not_hashed_again(tiny_host_artifact, tmp_path, monkeypatch, capsys):
    """qwc/checksum.py: a file's digest is remembered by its identity, so a second load reads
    nothing to check it; a file younger than two seconds is not remembered, and a changed one
    (new bytes: a new time) is hashed again and refused."""
    from qwc import checksum

    monkeypatch.setenv(checksum.CACHE_ENV, str(tmp_path / "verified"))
    art = copy_artifact(tiny_host_artifact, tmp_path)
    hashed = []
    real = checksum.sha256
    monkeypatch.setattr(checksum, "sha256", lambda p: hashed.append(Path(p).name) or real(p))
    for f in art.iterdir():   # (copytree kept the originals' times)
        os.utime(f)
    Engine(art, ctx=16)
    Engine(art, ctx=16)
    assert hashed.count("params.bin") == 2   # just written: not remembered
    past = time.time() - 60
    for f in art.iterdir():
        os.utime(f, (past, past))
    hashed.clear()
    Engine(art, ctx=16)
    Engine(art, ctx=16)
    assert hashed.count("params.bin") == 1 and hashed.count("lib.so") == 1
    raw = bytearray((art / "params.bin").read_bytes())
    raw[-1] ^= 1
    (art / "params.bin").write_bytes(bytes(raw))
    one_line(capsys, main(["-q", "run", str(art), "--prompt", "a"]), "params.bin does not match its hash")


def test_hashing_a_large_params_bin_is_reported(tiny_host_artifact, tmp_path, monkeypatch, capsys):
    """A 32B's first load reads 17 GiB to check it: a stage line names the file and its size,
    and the digest is the same as the quiet path's."""
    from qwc import checksum, progress

    monkeypatch.setenv(checksum.CACHE_ENV, "off")
    monkeypatch.setattr(progress, "_quiet", False)   # an earlier `qwc -q` in this process
    art = copy_artifact(tiny_host_artifact, tmp_path)
    quiet = checksum.sha256(art / "params.bin")
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(checksum, "REPORTED_BYTES", 1)
    assert checksum.sha256(art / "params.bin") == quiet
    assert "[qwc] checking params.bin against its hash (" in capsys.readouterr().err
    assert main(["run", str(art), "--prompt", "a", "--max-new-tokens", "1"]) == 0
    err = capsys.readouterr().err
    assert err.count("[qwc] checking params.bin") == 2 and err.index("done in") < err.index("[qwc] loaded")


def test_a_load_from_a_cold_page_cache_says_it_read_the_disk(tiny_host_artifact, tmp_path, monkeypatch, capsys):
    """mincore counts params.bin's cached pages (runtime/memory.py: cached_bytes): all of them
    once read, fewer once the kernel is told to drop them; `qwc run` then says the load read
    the disk, and a warm load does not."""
    from qwc.runtime import engine, memory

    art = copy_artifact(tiny_host_artifact, tmp_path)
    params = art / "params.bin"
    size = params.stat().st_size
    params.read_bytes()
    assert memory.cached_bytes(params) == size
    monkeypatch.setattr(engine, "COLD_BYTES", 0)
    for cold in (True, False):
        if cold:
            with open(params, "rb") as f:
                os.fsync(f.fileno())
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            assert memory.cached_bytes(params) < size
        assert main(["run", str(art), "--prompt", "a", "--max-new-tokens", "1"]) == 0
        said = "not in the page cache, read from disk" in capsys.readouterr().err
        assert said == cold


def test_artifact_for_another_architecture(tiny_host_artifact, tmp_path, capsys):
    art = copy_artifact(tiny_host_artifact, tmp_path)
    edit_manifest(art, lambda m: m["target"].update(name="arm-yitian", arch="aarch64"))
    one_line(capsys, main(["-q", "run", str(art), "--prompt", "a"]), "compiled for arm-yitian (aarch64)")


def test_chat_loop_reads_turns_until_eof(tiny_host_artifact):
    import sys

    r = subprocess.run([sys.executable, "-m", "qwc", "-q", "run", str(tiny_host_artifact), "--chat",
                        "--max-new-tokens", "4", "--ctx", "128"],
                       input="hello\nsecond turn\n", capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("> ") == 3          # two turns answered, then EOF at the third prompt
    assert "Traceback" not in r.stderr


def test_decode_builds_each_planned_view_once(tiny_host_artifact):
    """compiler/view_reuse.py: no two alloc_tensor instructions of the decode function build the
    same view, and the only tuple it builds is the one it returns (the logits agreeing with
    onnxruntime is the test above)."""
    import tvm
    from tvm import relax

    text = relax.VMExecutable(tvm.runtime.load_module(str(tiny_host_artifact / "lib.so"))).as_text()
    decode = text.split("@decode:")[1].split("\n@")[0]
    views = re.findall(r"call\s+vm\.builtin\.alloc_tensor in: (.*) dst:", decode)
    kernels = re.findall(r"call\s+(?!vm\.)(\S+) in:", decode)
    assert views and len(views) == len(set(views)), views
    assert len(views) < len(kernels)
    assert len(re.findall(r"vm\.builtin\.make_tuple", decode)) == 1


@pytest.mark.parametrize("entry", ["prefill", "score", "verify"])
def test_entry_points_of_any_length_build_each_view_once(tiny_host_artifact, entry):
    """compiler/view_reuse.py on symbolic shapes: a function of `seq` tokens builds each view
    (storage, offset, shape) once a call, not once a layer (a 2-token verify call of SmolLM2
    ran ~3,000 VM builtins against 511 kernels before)."""
    import tvm
    from tvm import relax

    text = relax.VMExecutable(tvm.runtime.load_module(str(tiny_host_artifact / "lib.so"))).as_text()
    body = text.split(f"@{entry}:")[1].split("\n@")[0]
    # a view's shape is a register a make_shape call filled: read it as that call's operands
    shapes = dict((dst, ins) for ins, dst in re.findall(r"vm\.builtin\.make_shape in: (.*) dst: (%\d+)", body))
    views = [tuple(shapes.get(a.strip(), a.strip()) for a in ins.split(","))
             for ins in re.findall(r"call\s+vm\.builtin\.alloc_tensor in: (.*) dst:", body)]
    assert views and any("%" in v[2] or "i" in v[2] for v in views)
    assert len(views) == len(set(views)), sorted(v for v in views if views.count(v) > 1)[:4]
    assert len(re.findall(r"vm\.builtin\.make_tuple", body)) == 1


def test_engine_loads_tvm_without_torch_and_torch_still_imports_after(tiny_host_artifact):
    """TVM's FFI imports torch when installed (~200 MiB of RSS); the engine hides it while TVM
    first loads. torch must stay importable and the engine must keep working alongside it."""
    import sys

    code = ("import sys; from qwc.runtime.engine import Engine\n"
            f"e = Engine({str(tiny_host_artifact)!r}, ctx=32); a = e.prefill([1, 2, 3])\n"
            "assert 'torch' not in sys.modules, 'torch was loaded'\n"
            "import torch; e.reset(); b = e.prefill([1, 2, 3])\n"
            "assert torch.ones(2).sum().item() == 2 and (a == b).all()\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr


def test_bench_prints_pp_and_tg_rows(tiny_host_artifact, capsys):
    import json

    assert main(["-q", "bench", str(tiny_host_artifact), "-p", "32", "-n", "8", "-r", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["test"] for r in out["results"]] == ["pp32", "tg8"]
    assert all(r["tps"] > 0 and r["reps"] == 2 for r in out["results"])
    assert main(["-q", "bench", str(tiny_host_artifact), "-p", "16", "-n", "0", "-r", "1"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert len(table) == 3 and "pp16" in table[2]


def test_bench_runs_its_tests_after_the_depth_it_is_given(tiny_host_artifact, capsys):
    """`qwc bench -d N` (llama-bench's -d): every repetition first fills N tokens of context,
    untimed, then runs the test from there; a --ctx that cannot hold depth + test is refused."""
    import json

    from qwc.runtime.bench import run_bench

    assert main(["-q", "bench", str(tiny_host_artifact), "-p", "16", "-n", "4", "-d", "40", "-r", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [(r["test"], r["depth"]) for r in out["results"]] == [("pp16 @ d40", 40), ("tg4 @ d40", 40)]
    assert all(r["tps"] > 0 for r in out["results"])
    eng = Engine(tiny_host_artifact, ctx=64)
    heard = []
    run_bench(eng, 0, 3, reps=2, depth=50, progress=heard.append)
    assert eng.pos == 53 and len(heard) == 2 and "filling 50 tokens" in heard[0]   # the cache was filled
    with pytest.raises(ValueError, match="exceed the engine's context of 64"):
        run_bench(eng, 16, 0, depth=60)
    assert main(["bench", str(tiny_host_artifact), "-p", "16", "-n", "0", "-d", "40", "--ctx", "50"]) == 2
    assert "--ctx 50 is less than the 56 tokens" in capsys.readouterr().err


def test_ids_past_the_tokenizer_are_never_sampled(tiny_host_artifact):
    """tiny pads its 259 tokens to 288 rows, as Qwen2.5 pads 151,665 to 151,936: the padding
    rows' logits are noise and decode to nothing, so the sampler never picks them."""
    from qwc.runtime.sampling import Sampler, SamplingParams
    from qwc.vocab import mismatch, token_span

    eng = Engine(tiny_host_artifact, ctx=64)
    span = token_span(eng.tokenizer)
    assert eng.sample_limit == span < eng.vocab_size
    logits = np.zeros(eng.vocab_size, np.float32)
    logits[span:] = 100.0                       # unmasked, a padding row would win every time
    assert Sampler(SamplingParams(), eng.sample_limit)(logits, []) < span
    hot = Sampler(SamplingParams(temperature=5.0, top_p=0.99, seed=1), eng.sample_limit)
    assert all(hot(logits, [span - 1]) < span for _ in range(200))
    assert mismatch(151936, 151665) is None and mismatch(152064, 151665) is None   # Qwen2.5's own padding
    assert "covers 259 of the model's 151936" in mismatch(151936, 259)
    assert "past the model's vocabulary" in mismatch(100, 259)


def test_poll_sets_the_pools_spin_and_leaves_the_tokens(tiny_host_artifact):
    """--poll is llama.cpp's level (0-100, 50 its default) as TVM's spin count (50: TVM's own
    300000, 0: workers sleep at once), set before the process's first pool reads it; the tokens
    are the same at every level. A fresh process each, since TVM reads it once."""
    from qwc.cpu import TVM_SPIN_COUNT, pool_spin_count

    assert [pool_spin_count(p) for p in (0, 1, 50, 100)] == [0, TVM_SPIN_COUNT // 50, TVM_SPIN_COUNT, 2 * TVM_SPIN_COUNT]
    for bad in (-1, 101, 2.5, "5"):
        with pytest.raises(Exception, match="poll .* must be an integer from 0 to 100"):
            pool_spin_count(bad)
    said = {}
    for level in (None, 0, 100):
        out = subprocess.run([sys.executable, "-c", "import hashlib, os, sys; from qwc.runtime.engine import Engine; "
                              "p = None if sys.argv[2] == 'None' else int(sys.argv[2]); "
                              "e = Engine(sys.argv[1], ctx=32, poll=p); "
                              "x = [e.prefill([1, 2, 3, 4])] + [e.decode(t) for t in (5, 6, 7)]; "
                              "print(os.environ.get('TVM_THREAD_POOL_SPIN_COUNT'), "
                              "hashlib.sha256(b''.join(a.tobytes() for a in x)).hexdigest())",
                              str(tiny_host_artifact), str(level)], capture_output=True, text=True, check=True)
        spin, tokens = out.stdout.strip().split(" ", 1)
        said[level] = (spin, tokens)
    assert [s for s, _ in said.values()] == ["None", "0", str(2 * TVM_SPIN_COUNT)]
    assert len({t for _, t in said.values()}) == 1
    r = subprocess.run([sys.executable, "-m", "qwc", "bench", str(tiny_host_artifact), "--poll", "101"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "--poll" in r.stderr and "101" in r.stderr
