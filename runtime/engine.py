"""Runs a compiled `model.qwc/` artifact: owns the KV cache, prefills, decodes, samples.

Imports only TVM's runtime, numpy and tokenizers (no torch, no onnx), so it runs where the
compiler does not, e.g. on an ARM board with the aarch64 TVM wheel.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import numpy as np

from qwc import cpu, params_at_rest
from qwc.checksum import remembered_sha256
from qwc.cpu import max_threads
from qwc.errors import QwcError
from qwc.kv_formats import KV_TYPES, cache_row
from qwc.limits import is_int
from qwc.manifest import Manifest, check_library, read_manifest
from qwc.vocab import mismatch, token_span

from . import memory
from .context_size import kv_bytes_per_token
from .prefill_chunks import next_chunk
from .sampling import SamplingParams

PREFILL_CHUNK = 256
OVERSUBSCRIBED_THREADS = 1024   # Engine(oversubscribe=True): emulated many-core runs
SPIN = "TVM_THREAD_POOL_SPIN_COUNT"   # an idle pool worker's spin (qwc.cpu.pool_spin_count)
COLD_BYTES = 64 << 20   # params.bin bytes outside the page cache worth telling the user about


class Sequence:
    """One stream's KV cache (a key and a value tensor per layer) and how many positions of it
    are filled. The engine has one of its own; a server makes a pool of them (Engine.pool),
    where `row` is the sequence's row of the pool's buffers."""

    def __init__(self, cache: list, capacity: int, pool: "Pool | None" = None, row: int = 0):
        self.cache, self.capacity, self.pos = cache, capacity, 0
        self.pool, self.row = pool, row
        self.adapter = 0   # its adapter's slot (runtime/adapters.py); 0: the base
        self.writes = 0   # calls that wrote it (Engine.generate: is what it last left still there?)


class Pool:
    """The KV caches of `slots` sequences as rows of one buffer per cache tensor [slots, ...],
    so that any first `rows` of them are one [rows, ...] tensor for decode_batch, and the
    inputs' memory for such a step."""

    def __init__(self, arrays: list, inputs: tuple, capacity: int, to_tensor, tile: int = 1):
        self.arrays, self.capacity, self._to_tensor = arrays, capacity, to_tensor
        self.tile = tile    # the K layout's key tile (manifest cache_capacity_multiple)
        # [slots, 1], [slots, 1], flat: slots * (ctx + 1), each row's adapter slot [slots, 1]
        self.ids, self.positions, self.mask, self.adapter_slots = inputs
        self.seqs = tuple(Sequence([to_tensor(a[r:r + 1]) for a in arrays], capacity, self, r)
                          for r in range(arrays[0].shape[0]))
        self._views: dict[int, list] = {}

    def _tiles(self, n: int) -> int:
        """Cache rows that hold positions [0, n): K interleaves a key tile's positions, so
        whole tiles move (the positions past n in the last one are past the row's end, to be
        written before they are read)."""
        return -(-n // self.tile) * self.tile

    def copy_row(self, src: int, dst: int, n: int) -> None:
        """Positions [0, n) of row `src`'s caches into row `dst`."""
        n = self._tiles(n)
        for a in self.arrays:
            a[dst, :, :n] = a[src, :, :n]

    def swap_rows(self, r: int, s: int, n: int) -> None:
        """Exchange positions [0, n) of two rows' caches."""
        n = self._tiles(n)
        for a in self.arrays:
            a[[r, s], :, :n] = a[[s, r], :, :n]

    def cache(self, rows: int) -> list:
        """The first `rows` rows of every cache buffer, as tensors (made once per row count)."""
        if rows not in self._views:
            self._views[rows] = [self._to_tensor(a[:rows]) for a in self.arrays]
        return self._views[rows]


def _import_tvm():
    """TVM, loaded without torch where the process has not loaded either. TVM's FFI package
    imports torch whenever it is installed (to accept torch tensors, which the engine never
    passes): with the compiler's torch in the environment that is 0.9-1.4 s of start and ~200 MiB
    of peak RSS. torch stays importable afterwards; TVM then just does not convert its tensors."""
    if "tvm" in sys.modules or "torch" in sys.modules:
        import tvm
        return tvm
    sys.modules["torch"] = None   # `import torch` raises ImportError, which TVM's FFI expects
    try:
        import tvm
    finally:
        del sys.modules["torch"]
    return tvm


# lib.so files this process loaded, by path: the (device, inode) each path held then
_LOADED_LIBRARIES: dict[str, tuple[int, int]] = {}


def _library_path(lib: Path) -> tuple[str, bool]:
    """The path to dlopen `lib` by, and whether it is an alias to unlink once loaded. The dynamic loader hands back the library it already loaded
    from a path, so an artifact replaced at the same path (`qwc compile -o` over it) would run its
    old code against its new manifest; a file that is not the one loaded from that path before is
    loaded through a link of its own name (unlinked once loaded: the mapping keeps the file)."""
    key, st = str(lib.resolve()), lib.stat()
    held = _LOADED_LIBRARIES.setdefault(key, (st.st_dev, st.st_ino))
    if held == (st.st_dev, st.st_ino):
        return key, False
    import tempfile

    fd, alias = tempfile.mkstemp(suffix=".so", prefix="qwc-lib-")
    os.close(fd)
    os.unlink(alias)
    try:
        os.link(lib, alias)
    except OSError:   # another file system than the temp folder's
        import shutil

        shutil.copyfile(lib, alias)
    return alias, True


def check_runs_here(manifest: Manifest) -> None:
    t = manifest.target
    here = cpu.machine_arch()
    if t.arch != here:
        raise QwcError(f"artifact was compiled for {t.name} ({t.arch}); this machine is {here}")
    have = cpu.features()
    missing = sorted(f for f in t.features if have is not None and f not in have and f not in cpu.HINTS)
    if missing:
        raise QwcError(f"artifact for {t.name} needs CPU features this machine lacks: {', '.join(missing)}")
    if "amx_tile" in t.features:   # its prefill GEMMs use AMX (compiler/kernels/x86/amx.py)
        try:
            cpu.enable_amx()
        except OSError as e:
            raise QwcError(f"artifact for {t.name} uses AMX: {e.strerror}") from None


class Engine:
    def __init__(self, path, ctx: int = 512, threads: int | None = None, verify_hashes: bool = True,
                 oversubscribe: bool = False, map_weights: bool = True, poll: int | None = None):
        """`oversubscribe` lifts the bound on threads (4 per usable CPU) to OVERSUBSCRIBED_THREADS,
        for emulation, where the guest's threads are many more than the host's cores and are
        counted, not timed (bench/arm_threads.py); waiting threads then sleep instead of spin.
        `map_weights`: the parameters are params.bin's pages, mapped (runtime/memory.py:
        MappedFile); False reads them into memory of the process's own (`--no-mmap`). `poll`: llama.cpp's --poll (cpu.pool_spin_count)."""
        self.path = Path(path)
        cap = OVERSUBSCRIBED_THREADS if oversubscribe else max_threads()
        what = "threads"
        if threads is None and os.environ.get("TVM_NUM_THREADS"):
            what, threads = "TVM_NUM_THREADS", os.environ["TVM_NUM_THREADS"]
            threads = int(threads) if threads.strip().isdigit() else threads
        if threads is not None and (not is_int(threads) or not 1 <= threads <= cap):
            raise QwcError(f"{what} {threads!r}: must be an integer from 1 to {cap}"
                           + ("" if oversubscribe else " (4 per usable CPU, at least 8)"))
        if not is_int(ctx) or ctx < 1:
            raise QwcError(f"ctx {ctx!r}: must be a positive integer")
        self.manifest = read_manifest(self.path)
        check_runs_here(self.manifest)
        self.uncached_bytes = memory.uncached_bytes(self.path / "params.bin")   # before the hash check reads it in
        if verify_hashes:
            for name, digest in self.manifest.files.items():
                f = self.path / name
                if not f.is_file():
                    raise QwcError(f"{self.path}: {name} is missing")
                if remembered_sha256(f) != digest:
                    raise QwcError(f"{self.path}: {name} does not match its hash in the manifest (corrupt artifact)")
        # TVM creates a thread's pool with TVM_NUM_THREADS workers (else half the logical CPUs:
        # one on a 2-vCPU VM) but uses no more of them than the cores it detects; _size_pool
        # then sets the number used. Default: every usable core.
        self.threads = int(threads or len(os.sched_getaffinity(0)))
        os.environ["TVM_NUM_THREADS"] = str(self.threads)
        if poll is not None or oversubscribe:   # read once, when the first pool starts (emulated: no spin)
            os.environ[SPIN] = str(cpu.pool_spin_count(poll)) if poll is not None else os.environ.get(SPIN, "0")
        self._pool_sized: set[int] = set()   # the threads whose TVM pool _size_pool has set
        tvm = _import_tvm()
        from tvm.runtime.vm import VirtualMachine  # runtime-only: works with TVM_USE_RUNTIME_LIB=1

        self._tvm = tvm
        self._config_pool = tvm.get_global_func("runtime.config_threadpool")
        self.model = self.manifest.model   # config.ModelConfig
        max_ctx = self.model.context_length   # YaRN: the original positions x its factor
        if ctx > max_ctx:
            raise QwcError(f"ctx {ctx} exceeds the model's {max_ctx} positions")
        self.ctx = int(ctx)
        self.device = tvm.cpu()
        try:
            path, alias = _library_path(self.path / "lib.so")
            try:
                lib = tvm.runtime.load_module(path)
            finally:
                if alias:
                    os.unlink(path)
            self.vm = VirtualMachine(lib, self.device)
        except Exception as e:  # TVM's error types: not an ELF, wrong arch, missing symbols
            raise QwcError(f"{self.path}: lib.so cannot be loaded ({str(e).strip().splitlines()[-1]})") from None
        check_library(self.vm._get_function_arity, self.vm._get_function_param_name, self.manifest, str(self.path))
        self._prefill, self._decode = self.vm["prefill"], self.vm["decode"]
        functions = self.manifest.functions
        entries = functions.entry_points
        self._score = self.vm["score"] if "score" in entries else None
        self._verify = self.vm["verify"] if "verify" in entries else None
        self._decode_batch = self.vm["decode_batch"] if "decode_batch" in entries else None
        self._step = self.vm["step"] if "step" in entries and self._decode_batch else None
        self._embed = self.vm["embed"] if "embed" in entries else None
        self._embed_step = self.vm["embed_step"] if "embed_step" in entries and self._step else None
        # sequences one decode_batch step takes (`qwc compile --max-batch`); 1: no such step
        self.max_batch = functions.max_batch if self._decode_batch else 1
        # new tokens a prefill / score call takes at most (the library's memory is planned for it)
        self._chunk = min(PREFILL_CHUNK, functions.max_tokens_per_call or PREFILL_CHUNK)
        self.params = self._load_params(map_weights)
        self._kv_heads, self._head_dim = self.model.num_key_value_heads, self.model.head_dim
        self._n_cache = 2 * self.model.num_hidden_layers   # a key and a value per layer
        # `qwc compile --kv-dtype`: the format, and the buffers' element type and row width
        self._kv_format = functions.cache_dtype
        element, self._cache_width = cache_row(self._kv_format, self._head_dim)
        self._kv_dtype = np.dtype(element)
        # The inputs' memory, reused: a step builds its inputs as views of it, where fresh
        # tensors a step cost a visible share of a small model's decode step.
        rows = self.max_batch
        arena = memory.arena_for([((1, self.ctx), np.int64)] * 5 + [((rows, 3), np.int64), ((rows,), np.int64)])
        self._ids, self._mask, self._positions, self._adapter_slots = (arena.take((1, self.ctx), np.int64)
                                                                       for _ in range(4))
        self._named = arena.take((1, self.ctx), np.int64)[0]   # the tokens an embed_step call names
        self._segments, self._logit_tokens = arena.take((rows, 3), np.int64), arena.take((rows,), np.int64)
        self._mask[:] = 1
        self.seq = self.sequence()
        self.stats: dict = {}   # the last generate's token counts and times
        # generate's scheduler (one slot: self.seq), kept for the tokens its cache holds, and
        # the sequence's write count when it last ran
        self._driver, self._driver_writes = None, 0
        self.tokenizer = None
        tok = self.path / "tokenizer.json"
        if tok.is_file():
            from tokenizers import Tokenizer
            try:
                self.tokenizer = Tokenizer.from_file(str(tok))
            except Exception as e:  # tokenizers raises a bare Exception on bad files
                raise QwcError(f"{self.path}: tokenizer.json cannot be read ({str(e).splitlines()[0]})") from None
        self.vocab_size = self.model.vocab_size
        self.eos = set(self.model.eos_token_ids or [])
        self.adapters = None   # runtime/adapters.py: AdapterSlots, where the artifact has slots
        if functions.lora is not None:
            self.load_adapters([])
        self._probe()
        # Ids the tokenizer has: the only ones sampled (qwc/vocab.py). After the probe: a
        # corrupt artifact gets its one error line, not a warning first.
        self.sample_limit = self.vocab_size
        if self.tokenizer is not None:
            span = token_span(self.tokenizer)
            self.sample_limit = max(1, min(self.vocab_size, span))
            warning = mismatch(self.vocab_size, span)
            if warning:
                print(f"qwc: warning: {self.path.name}: {warning}", file=sys.stderr, flush=True)

    def load_adapters(self, adapters: list, max_rank: int | None = None) -> None:
        """Serve `adapters` ((name, adapter_files.Adapter), from runtime/adapters.load_adapters)
        unmerged, in the artifact's adapter slots; each sequence picks one by its `adapter`
        slot (AdapterSlots.slot_of). Replaces what was loaded before."""
        from .adapters import AdapterSlots

        spec = self.manifest.functions.lora
        if spec is None:
            raise QwcError(f"{self.path}: the artifact has no adapter slots (compile it with "
                           "qwc compile --max-lora-rank R to serve adapters unmerged, or merge one with "
                           "qwc export --lora)")
        self.adapters = AdapterSlots(spec, adapters, max_rank, self._tvm.runtime.from_dlpack)

    def adapter_slot(self, name: str | None) -> int:
        """The slot of the loaded adapter `name` (None: the base, 0)."""
        if name is None:
            return 0
        if self.adapters is None or name not in self.adapters.names:
            have = ", ".join(self.adapters.names) if self.adapters and self.adapters.names else "none"
            raise QwcError(f"no adapter named {name!r} is loaded (loaded: {have})")
        return self.adapters.slot_of(name)

    def _adapter_args(self, slots: np.ndarray) -> list:
        """The library's adapter inputs: each token's slot (`slots`, shaped as input_ids), then
        every linear's A and B (none where the artifact has no slots)."""
        if self.adapters is None:
            return []
        return [self._tvm.runtime.from_dlpack(slots), *self.adapters.tensors]

    def sequence(self, ctx: int | None = None) -> Sequence:
        """A new, empty KV cache for `ctx` positions (default: the engine's), in huge pages as
        the parameters, its capacity rounded up to the multiple the attention kernel's key
        tiles need."""
        ctx = self.ctx if ctx is None else ctx
        if not 1 <= ctx <= self.ctx:
            raise QwcError(f"a sequence of {ctx} positions does not fit the engine's context of {self.ctx}")
        mult = self.manifest.functions.cache_capacity_multiple
        shape = (1, self._kv_heads, -(-ctx // mult) * mult, self._cache_width)
        arena = memory.arena_for([(shape, self._kv_dtype)] * self._n_cache)   # TVM takes 64-byte aligned data
        return Sequence([self._tvm.runtime.from_dlpack(arena.take(shape, self._kv_dtype))
                         for _ in range(self._n_cache)], capacity=ctx)

    def pool(self, slots: int, ctx: int | None = None, commit: bool = False) -> Pool:
        """`slots` empty sequences of `ctx` positions each (default: the engine's) whose caches
        are rows of shared buffers, for decode_many. Each buffer keeps one position past the
        capacity, where a row that is not decoding in a batched step gets its placeholder token
        written (its real positions are never touched). `commit`: write every page now, so the
        memory is taken at once rather than as the sequences grow."""
        ctx = self.ctx if ctx is None else ctx
        if not 1 <= ctx <= self.ctx:
            raise QwcError(f"a sequence of {ctx} positions does not fit the engine's context of {self.ctx}")
        if not is_int(slots, lo=1):
            raise QwcError(f"a pool takes at least one slot, not {slots!r}")
        mult = self.manifest.functions.cache_capacity_multiple
        shape = (slots, self._kv_heads, -(-(ctx + 1) // mult) * mult, self._cache_width)
        inputs = [((slots, 1), np.int64)] * 2 + [((slots * (ctx + 1),), np.int64), ((slots, 1), np.int64)]
        arena = memory.arena_for([(shape, self._kv_dtype)] * self._n_cache + inputs)
        arrays = [arena.take(shape, self._kv_dtype) for _ in range(self._n_cache)]
        ins = tuple(arena.take(s, d) for s, d in inputs)
        if commit:
            arena.commit()
        return Pool(arrays, ins, ctx, self._tvm.runtime.from_dlpack, mult)

    @property
    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes one position takes: a key and a value per layer in the cache's format."""
        return kv_bytes_per_token(self.manifest)

    def kv_summary(self, ctx: int | None = None) -> str:
        """The cache's format and memory per sequence of `ctx` positions (default: the engine's),
        for `qwc run` and `qwc serve` at start."""
        ctx = self.ctx if ctx is None else ctx
        name = next(k for k, v in KV_TYPES.items() if v == self._kv_format)
        return (f"KV cache {name}, {self.kv_bytes_per_token / 1024:g} KiB a token, "
                f"{self.kv_bytes_per_token * ctx / 2**20:.1f} MiB a sequence of {ctx}")

    @property
    def pos(self) -> int:
        """Positions filled in the engine's own sequence."""
        return self.seq.pos

    def _probe(self) -> None:
        """One decode step at load: the library must accept these parameters and this cache (its
        own shape checks), and its logits must span the manifest's vocabulary, which bounds the
        token ids the embedding gather is given."""
        # A cache of its own (one key tile): the real one stays untouched, and zero.
        n = self._run(self._decode, np.zeros((1, 1), np.int64), self.sequence(1)).shape[-1]
        if n != self.vocab_size:
            raise QwcError(f"{self.path}: the manifest's vocab_size {self.vocab_size} is not the library's {n} "
                           "(corrupt artifact; recompile it)")

    def _load_params(self, map_weights: bool):
        """The parameters as TVM tensors, in the manifest's order. Mapped: each is a view of
        params.bin's mapping, except those stored at rest in a smaller form (and any not 64-byte
        aligned), unpacked into an arena. Copied: each read straight into its place in one
        huge-page arena (runtime/memory.py), so the peak memory is the parameters once.
        `self.mapped_bytes` / `self.copied_bytes` say which took what."""
        path = self.path / "params.bin"
        size = path.stat().st_size
        specs = self.manifest.params
        for p in specs:   # before anything is mapped or read
            if p.offset + p.nbytes > size:
                raise QwcError(f"{self.path}: params.bin is truncated ({p.name} ends at byte {p.offset + p.nbytes}, "
                               f"file has {size})")
        mapped = memory.MappedFile(path) if map_weights and size else None
        in_file = {p.name for p in specs if mapped is not None and p.at_rest is None and p.offset % memory.ALIGN == 0}
        arena = memory.arena_for((p.shape, p.dtype) for p in specs if p.name not in in_file)
        arrays = {}
        for p in specs:
            if p.name in in_file:
                self._check_size(p, np.dtype(p.dtype).itemsize * int(np.prod(p.shape, dtype=np.int64)))
                arrays[p.name] = mapped.view(p.offset, p.shape, p.dtype)
            else:
                arrays[p.name] = arena.take(p.shape, p.dtype)
        with open(path, "rb") as f:
            # an offsets' scales first: its unpacking reads them (qwc/params_at_rest.py)
            for p in sorted(specs, key=lambda p: bool(p.at_rest and p.at_rest["form"] == "q4_k_offsets")):
                if p.name not in in_file:
                    self._read_param(f, p, arrays, mapped)
        self.reread = mapped is not None and mapped.reread
        self.mapped_bytes = sum(p.nbytes for p in specs if p.name in in_file)
        self.copied_bytes = sum(arrays[p.name].nbytes for p in specs if p.name not in in_file)
        return [self._tvm.runtime.from_dlpack(arrays[p.name]) for p in specs]

    def describe_weights(self) -> str:
        """Where the parameters are: mapped from params.bin, in memory of the process's own, or
        both; and, when much of params.bin was not in the page cache, that the load read it from
        the disk (a cold start's time is the disk's, not qwc's)."""
        gib = (lambda n: f"{n / 2**30:.2f} GiB")
        cold = self.uncached_bytes or 0
        from_disk = (f"; {gib(cold)} of it not in the page cache, read from disk"
                     if cold > max(COLD_BYTES, (self.mapped_bytes + self.copied_bytes) // 20) else "")
        if not self.mapped_bytes:
            return f"{gib(self.copied_bytes)} of weights read into memory{from_disk}"
        copied = f", {gib(self.copied_bytes)} unpacked into memory" if self.copied_bytes else ""
        reread = "; read again from disk in 2 MiB pages, as the page cache held 4 KiB ones" if self.reread else ""
        return f"{gib(self.mapped_bytes)} of weights mapped from params.bin{copied}{from_disk}{reread}"

    def _check_size(self, p, nbytes: int) -> None:
        if p.at_rest is None and nbytes != p.nbytes:
            raise QwcError(f"{self.path}: {p.name} is {p.nbytes} bytes in the manifest, "
                           f"not the {nbytes} of its shape and dtype (corrupt artifact)")

    def _read_param(self, f, p, arrays: dict, mapped: memory.MappedFile | None) -> None:
        """Read `p` into its place in `arrays`, unpacked if it is stored at rest (from the
        mapping where there is one: its stored bytes are not copied first)."""
        a = arrays[p.name]
        self._check_size(p, a.nbytes)
        if p.at_rest is not None and mapped is not None:
            into = mapped.bytes[p.offset:p.offset + p.nbytes]
        else:
            into = a if p.at_rest is None else np.empty(p.nbytes, np.uint8)
            f.seek(p.offset)
            if f.readinto(memoryview(into.reshape(-1)).cast("B")) != into.nbytes:
                raise QwcError(f"{self.path}: params.bin ended while reading {p.name}")
        if p.at_rest is not None:
            params_at_rest.unpack(p.at_rest["form"], into, a, arrays.get(p.at_rest.get("scales")))

    # -- the model -----------------------------------------------------------------------
    def reset(self, seq: Sequence | None = None) -> None:
        """Empty the cache (its memory is reused; stale slots are never read)."""
        (seq or self.seq).pos = 0

    def _size_pool(self) -> None:
        """Size the calling thread's TVM pool (TVM keeps one per thread) to the engine's threads.
        Left to itself the pool uses at most the cores it detects: under qemu on a 2-core host,
        2 guest threads whatever was asked; on a board, its default affinity. Mode 1 (TVM's
        "big cores") pins worker i to a core as TVM orders them; TVM_BIND_THREADS=0 turns
        pinning off."""
        me = threading.get_ident()
        if me not in self._pool_sized:
            self._config_pool(1, self.threads)
            self._pool_sized.add(me)

    def threads_in_use(self) -> int:
        """The workers the calling thread's TVM pool runs a parallel kernel on."""
        self._size_pool()
        return int(self._tvm.get_global_func("runtime.NumThreads")())

    def _call(self, fn, *args):
        """fn(*args) on the library, TVM's own errors (its checks of shapes and dtypes) as one line."""
        try:
            return fn(*args)
        except Exception as e:   # TVM's own error types
            raise QwcError(f"{self.path}: the library refused its inputs "
                           f"({str(e).strip().splitlines()[0][:200]}; corrupt artifact?)") from None

    def _run(self, fn, tokens: np.ndarray, seq: Sequence) -> np.ndarray:
        tvm = self._tvm
        self._size_pool()
        s, pos = tokens.shape[1], seq.pos
        if pos + s > seq.capacity:
            raise QwcError(f"{pos + s} tokens do not fit the context of {seq.capacity} (use a larger --ctx)")
        self._ids[0, :s] = tokens[0]
        self._positions[0, :s] = np.arange(pos, pos + s)
        args = [tvm.runtime.from_dlpack(x) for x in (self._ids[:, :s], self._mask[:, :pos + s], self._positions[:, :s])]
        slots = self._adapter_slots[:, :s]
        slots[:] = seq.adapter
        out = self._call(fn, *args, *seq.cache, *self._adapter_args(slots), *self.params)
        seq.pos += s
        seq.writes += 1
        return np.from_dlpack(out[0])[0]   # a view: the logits are not copied

    def prefill(self, tokens, seq: Sequence | None = None) -> np.ndarray:
        """Feed `tokens` after what the cache holds; returns the last position's logits."""
        seq = seq or self.seq
        tokens = self._token_ids(tokens, "prefill")
        if seq.pos + tokens.shape[1] > seq.capacity:
            raise QwcError(f"prompt of {tokens.shape[1]} tokens (after {seq.pos} cached) does not fit "
                           f"the context of {seq.capacity}")
        logits, i = None, 0
        while i < tokens.shape[1]:
            n = next_chunk(tokens.shape[1] - i, self._chunk)
            logits = self._run(self._prefill if n > 1 else self._decode, tokens[:, i:i + n], seq)[-1]
            i += n
        return logits

    def decode(self, token: int, seq: Sequence | None = None) -> np.ndarray:
        if isinstance(token, np.ndarray) and token.ndim == 0:
            token = token.item()
        if not is_int(token, lo=None):
            raise QwcError(f"decode takes one token id (an integer), not {type(token).__name__}")
        if not 0 <= token < self.vocab_size:
            raise QwcError(f"decode: token id {token} is outside the vocabulary [0, {self.vocab_size})")
        return self._run(self._decode, np.array([[token]], np.int64), seq or self.seq)[-1]

    def decode_many(self, tokens, seqs: list) -> list[np.ndarray]:
        """One new token for each of `seqs`; their logits, in order. When the artifact has
        decode_batch and the sequences are rows of one pool (Engine.pool), one step reads the
        weights once for all of them (the rows between them that are not decoding run a
        placeholder token past their last position); else one decode after another."""
        if len(tokens) != len(seqs):
            raise QwcError(f"decode_many: {len(tokens)} tokens for {len(seqs)} sequences")
        pool = seqs[0].pool if seqs else None
        rows = max((s.row for s in seqs), default=-1) + 1
        if (len(seqs) < 2 or self._decode_batch is None or pool is None or rows > self.max_batch
                or any(s.pool is not pool for s in seqs) or len({s.row for s in seqs}) != len(seqs)):
            return [self.decode(t, s) for t, s in zip(tokens, seqs)]
        for t, s in zip(tokens, seqs):
            if not is_int(t, lo=0) or t >= self.vocab_size:
                raise QwcError(f"decode: token id {t!r} is not in the vocabulary [0, {self.vocab_size})")
            if s.pos + 1 > s.capacity:
                raise QwcError(f"{s.pos + 1} tokens do not fit the context of {s.capacity} (use a larger --ctx)")
        tvm = self._tvm
        self._size_pool()
        ids, positions = pool.ids[:rows], pool.positions[:rows]
        ids[:] = 0
        slots = pool.adapter_slots[:rows]
        slots[:] = 0
        lens = np.array([pool.seqs[r].pos for r in range(rows)], np.int64)
        for t, s in zip(tokens, seqs):
            ids[s.row, 0] = t
            slots[s.row, 0] = s.adapter
        positions[:, 0] = lens
        total = int(lens.max()) + 1
        mask = pool.mask[:rows * total].reshape(rows, total)
        np.less_equal(np.arange(total), lens[:, None], out=mask, casting="unsafe")   # row b: lens[b] + 1 ones
        args = [tvm.runtime.from_dlpack(x) for x in (ids, mask, positions)]
        out = self._call(self._decode_batch, *args, *pool.cache(rows), *self._adapter_args(slots), *self.params)
        logits = np.from_dlpack(out[0])
        for s in seqs:
            s.pos += 1
        return [logits[s.row, -1] for s in seqs]

    @property
    def max_tokens_per_call(self) -> int:
        """Tokens one prefill, score or step call takes at most (longer input goes in chunks)."""
        return min(self._chunk, self.ctx)

    @property
    def verifies_drafts(self) -> bool:
        """Whether verify() can check a draft: the library has the verify entry point, or the
        score one that older artifacts verify with (verifies_exactly)."""
        return self._score is not None

    @property
    def verifies_exactly(self) -> bool:
        """Whether verify() gives the decode step's logits to the bit (the verify entry point):
        score's rounding differs, so a greedy reply could part from the one without drafts."""
        return self._verify is not None

    @property
    def mixes_steps(self) -> bool:
        """Whether step() takes several sequences' tokens in one call (the library has the
        step entry point: artifacts compiled with --max-batch >= 2)."""
        return self._step is not None

    def step(self, parts: list) -> list[np.ndarray]:
        """Each (sequence, tokens) of `parts` takes its tokens after what its cache holds, all
        in one call: the running sequences' decode tokens and a prompt's chunk together, the
        weights read once for all of them. The logits of each part's last token, in order
        (views the next call overwrites). One call needs the step entry point (mixes_steps),
        the sequences rows of one pool, each once, up to max_batch of them, and at most
        max_tokens_per_call tokens; otherwise each part runs on its own."""
        tokens = [self._token_ids(t, "step") for _, t in parts]
        seqs = [s for s, _ in parts]
        for s, t in zip(seqs, tokens):
            if s.pos + t.shape[1] > s.capacity:
                raise QwcError(f"{s.pos + t.shape[1]} tokens do not fit the context of {s.capacity} (use a larger --ctx)")
        if not self._one_call(self._step, seqs, tokens):
            return [self.prefill(t[0], seq=s) for s, t in zip(seqs, tokens)]
        segments = self._pack_segments(seqs, tokens)
        last = self._logit_tokens[:len(parts)]
        np.add(segments[:, 1], segments[:, 2] - 1, out=last)
        return list(self._segments_call(self._step, seqs, tokens, last))

    def _one_call(self, fn, seqs: list, tokens: list) -> bool:
        """Whether `fn` (step, embed_step: None where the library lacks it) takes these
        sequences' tokens in one call: rows of one pool, each once, up to max_batch of them,
        and at most max_tokens_per_call tokens."""
        pool = seqs[0].pool if seqs else None
        return (fn is not None and pool is not None and max(s.row for s in seqs) + 1 <= self.max_batch
                and sum(t.shape[1] for t in tokens) <= self.max_tokens_per_call
                and all(s.pool is pool for s in seqs) and len({s.row for s in seqs}) == len(seqs))

    def _pack_segments(self, seqs: list, tokens: list) -> np.ndarray:
        """The sequences' tokens, positions and adapters in the input arena, one after another;
        returns the segments (row, first token, count) [G, 3], a view of the arena."""
        segments, at = self._segments[:len(seqs)], 0
        for g, (s, t) in enumerate(zip(seqs, tokens)):
            n = t.shape[1]
            self._ids[0, at:at + n], self._adapter_slots[0, at:at + n] = t[0], s.adapter
            self._positions[0, at:at + n] = np.arange(s.pos, s.pos + n)
            segments[g] = s.row, at, n
            at += n
        return segments

    def _segments_call(self, fn, seqs: list, tokens: list, named: np.ndarray) -> np.ndarray:
        """One call of `fn` (step, embed_step) on what _pack_segments laid out, returning the
        rows of the tokens `named` [L, ...] (a view the next call overwrites); the sequences
        move past their tokens."""
        tvm = self._tvm
        self._size_pool()
        total = sum(t.shape[1] for t in tokens)
        arrays = (self._ids[:, :total], self._mask[:, :1], self._positions[:, :total], self._segments[:len(seqs)], named)
        args = [tvm.runtime.from_dlpack(x) for x in arrays]
        cache = seqs[0].pool.cache(max(s.row for s in seqs) + 1)
        out = self._call(fn, *args, *cache, *self._adapter_args(self._adapter_slots[:, :total]), *self.params)
        for s, t in zip(seqs, tokens):
            s.pos += t.shape[1]
            s.writes += 1
        return np.from_dlpack(out[0])[0]

    @property   # -- embeddings (runtime/embeddings.py)
    def embeds(self) -> bool:
        """Whether the library has the embed entry point (`qwc compile --embeddings`)."""
        return self._embed is not None

    @property
    def embeds_in_batches(self) -> int:
        """How many sequences' chunks one embedding call takes (embed_step: max_batch; else 1)."""
        return self.max_batch if self._embed_step is not None else 1

    def embed_parts(self, parts: list) -> list[np.ndarray]:
        """Each (sequence, tokens, positions) of `parts` takes its tokens after what its cache
        holds; returns each part's final-norm states at `positions` (indices into its tokens),
        float32 [len(positions), hidden] copies. Several parts go in one embed_step call where
        the library has it and they fit one (as step's); otherwise each runs on embed."""
        if self._embed is None:
            raise QwcError(f"{self.path}: artifact has no embed entry point (compile it with --embeddings)")
        tokens = [self._token_ids(t, "embed") for _, t, _ in parts]
        seqs = [s for s, _, _ in parts]
        for s, t in zip(seqs, tokens):
            if s.pos + t.shape[1] > s.capacity:
                raise QwcError(f"{s.pos + t.shape[1]} tokens do not fit the context of {s.capacity}")
        if len(parts) < 2 or not self._one_call(self._embed_step, seqs, tokens):
            out = []
            for (seq, _, rows), t in zip(parts, tokens):
                picked = []
                for i in range(0, t.shape[1], self._chunk):   # each call's rows copied before the next
                    states = self._run(self._embed, t[:, i:i + self._chunk], seq)
                    picked += [states[r - i].copy() for r in rows if i <= r < i + self._chunk]
                out.append(np.stack(picked) if picked else np.zeros((0, self.model.hidden_size), np.float32))
            return out
        return self._embed_batch(parts, tokens)

    def _embed_batch(self, parts: list, tokens: list) -> list[np.ndarray]:
        """embed_parts' one embed_step call: the parts as step's segments, the positions asked for named."""
        seqs = [s for s, _, _ in parts]
        segments = self._pack_segments(seqs, tokens)
        named = [int(segments[g, 1]) + r for g, (_, _, rows) in enumerate(parts) for r in rows]
        picked = self._named[:max(len(named), 1)]   # (the arena's: the library takes 64-byte aligned data)
        picked[:] = named or [0]
        states = self._segments_call(self._embed_step, seqs, tokens, picked)
        bounds = np.cumsum([0] + [len(rows) for _, _, rows in parts])
        return [states[a:b].copy() for a, b in zip(bounds, bounds[1:])]

    def embed(self, inputs, pooling: str = "last") -> np.ndarray:
        """Each input's (token ids, or text where the artifact has a tokenizer) final-norm state
        pooled by `pooling` ("last", "mean", "cls") and L2-normalized: [inputs, hidden] float32.
        Runs in the engine's own sequence, one input after another (`qwc serve` batches them:
        runtime/scheduler.py)."""
        from .embeddings import EmbeddingJob

        ids = [self.encode(x) if isinstance(x, str) else list(self._token_ids(x, "embed")[0]) for x in inputs]
        job = EmbeddingJob(ids, pooling)
        while not job.finished:
            parts = job.plan([self.seq.row], self.max_tokens_per_call, 1)
            if parts[0].start == 0:
                self.reset()
            job.add(parts, self.embed_parts([(self.seq, p.tokens, p.rows) for p in parts]))
        return job.vectors

    def _token_ids(self, tokens, what: str) -> np.ndarray:
        """`tokens` as a [1, n] int64 array, refusing anything that is not a non-empty flat
        sequence of ids in the vocabulary: the embedding gather does not bound its index."""
        if isinstance(tokens, (str, bytes)):
            raise QwcError(f"{what} takes token ids; encode text first (Engine.encode)")
        try:
            a = np.asarray(tokens)
        except (TypeError, ValueError):
            a = np.asarray(None)
        if a.ndim != 1:
            raise QwcError(f"{what} takes a flat sequence of token ids, not an array of {a.ndim} dimensions")
        if a.size == 0:
            raise QwcError(f"{what} needs at least one token")
        if a.dtype.kind not in "iu":
            raise QwcError(f"{what}: token ids must be integers (got {a.dtype})")
        lo, hi = int(a.min()), int(a.max())
        if lo < 0 or hi >= self.vocab_size:
            raise QwcError(f"{what}: token id {lo if lo < 0 else hi} is outside the vocabulary [0, {self.vocab_size})")
        return a.astype(np.int64).reshape(1, -1)

    def score(self, tokens, seq: Sequence | None = None) -> np.ndarray:
        """Feed `tokens` after what the cache holds; returns every position's logits [n, vocab]
        (a copy). Setting `seq.pos` back afterwards forgets the positions past it: speculative
        decoding verifies a draft this way (runtime/scheduler.py: Scheduler._verify)."""
        if self._score is None:
            raise QwcError(f"{self.path}: artifact has no score entry point (compiled by an older qwc)")
        seq = seq or self.seq
        tokens = self._token_ids(tokens, "score")
        if seq.pos + tokens.shape[1] > seq.capacity:
            raise QwcError(f"{tokens.shape[1]} tokens (after {seq.pos} cached) do not fit the context of {seq.capacity}")
        return np.concatenate([self._run(self._score, tokens[:, i:i + self._chunk], seq)
                               for i in range(0, tokens.shape[1], self._chunk)])

    def verify(self, tokens, seq: Sequence | None = None) -> np.ndarray:
        """score() whose logits are, to the bit, those decode steps one token at a time would
        give (the verify entry point; in calls of up to its bound, each token's logits being
        the same in whichever call it is): a greedy reply with drafts is the reply without.
        (On x86; on ARM the attention is decode's to the bit, the GEMM's sums are not: ~1e-6.)
        Artifacts compiled before it existed fall back to score, whose logits differ from the
        decode steps' by rounding."""
        if self._verify is None:
            return self.score(tokens, seq)
        seq = seq or self.seq
        tokens = self._token_ids(tokens, "verify")
        if seq.pos + tokens.shape[1] > seq.capacity:
            raise QwcError(f"{tokens.shape[1]} tokens (after {seq.pos} cached) do not fit the context of {seq.capacity}")
        n = self.manifest.functions.verify_tokens
        return np.concatenate([self._run(self._verify, tokens[:, i:i + n], seq) for i in range(0, tokens.shape[1], n)])

    # -- text ----------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise QwcError(f"{self.path}: artifact has no tokenizer")
        if not isinstance(text, str):
            raise QwcError(f"encode takes a string, not {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise QwcError("the text is not valid UTF-8 (it holds lone surrogates)") from None
        return self.tokenizer.encode(text).ids

    def generate(self, prompt: str | list[int], max_new_tokens: int = 32,
                 sampling: SamplingParams | None = None, stop: set[int] | None = None,
                 constraint=None, speculate=None, adapter: str | None = None) -> Iterator[str]:
        """Stream decoded text pieces for `prompt`, in the engine's own sequence, through the
        server's loop (runtime/scheduler.py: Scheduler.drive): with a `constraint`
        (runtime/grammar.py) only what its grammar allows, ending where it does; with
        `speculate` (a drafter factory, as `qwc serve` takes) drafts verified in one call. The
        cache is reused where it holds the prompt's beginning from the last generate (a
        chat's earlier turns), unless the sequence was written since; `stats` gives counts and
        times, as llama.cpp prints them. `adapter`: the name of a LoRA adapter loaded with
        load_adapters (None: the base)."""
        from .scheduler import Request, Scheduler

        if not is_int(max_new_tokens):
            raise QwcError(f"max_new_tokens {max_new_tokens!r}: must be an integer >= 0")
        if sampling is not None and not isinstance(sampling, SamplingParams):
            raise QwcError("sampling must be a SamplingParams")
        ids = self.encode(prompt) if isinstance(prompt, str) else self._token_ids(prompt, "generate")[0].tolist()
        if not ids:
            raise QwcError("generate needs at least one prompt token")
        slot = self.adapter_slot(adapter)
        self.stats = {"prompt_tokens": len(ids), "cached_tokens": 0, "prompt_s": 0.0, "generated": 0,
                      "generate_s": 0.0, "draft_tokens": 0, "draft_tokens_kept": 0}
        if max_new_tokens == 0:
            t0 = time.perf_counter()
            self.reset()
            self.prefill(ids)
            self.stats["prompt_s"] = time.perf_counter() - t0
            return
        if self._driver is None or self._driver.speculate is not speculate:
            old = self._driver
            self._driver = Scheduler(self, max_running=1, max_queue=0, prefill_chunk=self.ctx, min_reuse=1,
                                     speculate=speculate, slots=[self.seq])
            if old is not None:
                self._driver.prefix_cache = old.prefix_cache
        if self.seq.writes != self._driver_writes:   # written outside generate: what it held is gone
            self._driver.prefix_cache.forget()
        req = Request(ids, max_new_tokens, sampling or SamplingParams(), None,
                      stop_tokens=None if stop is None else frozenset(stop), constraint=constraint, adapter=slot)
        drafts = (self._driver.drafted, self._driver.accepted)
        try:
            for kind, value in self._driver.drive(req):
                if kind == "text":
                    self._update_stats(req, drafts)
                    if value:
                        yield value
        finally:
            self._driver_writes = self.seq.writes
            self._update_stats(req, drafts)

    @property
    def generated_cache(self) -> list[int]:
        """The tokens the last generate left in the engine's own cache, which the next one reuses
        where its prompt begins with them ([] where the sequence was written since)."""
        if self._driver is None or self.seq.writes != self._driver_writes:
            return []
        return list(self._driver.prefix_cache.held(self.seq.row))

    def _update_stats(self, req, drafts: tuple[int, int]) -> None:
        """`drafts`: the driver's draft counts (made, kept) when this generate began."""
        done = req.t_prompt
        self.stats.update(draft_tokens=self._driver.drafted - drafts[0],
                          draft_tokens_kept=self._driver.accepted - drafts[1],
                          cached_tokens=req.cached_tokens, generated=len(req.generated),
                          prompt_s=(done - req.t_submit) if done else 0.0,
                          generate_s=(req.token_times[-1] - done) if done and req.token_times else 0.0)
