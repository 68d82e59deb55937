"""The artifact's `manifest.json`: its format version, schema and typed form (`Manifest`),
shared by the writer (compiler/compile.py and compiler/artifact.py build a Manifest and write
its to_dict) and the runtime (reads it back through the same checks, before anything is
loaded). Each part (target, model, functions, params, files, quantization) checks its own
fields as from_dict reads it.

The manifest is not covered by its own hashes: a hand-edited one must fail here in one line,
not as a shape error inside the library or as reads outside params.bin.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from qwc.config import ModelConfig
from qwc.errors import QwcError
from qwc.kv_formats import KV_TYPES
from qwc.limits import MAX_BATCH, MAX_LORA_RANK, is_int
from qwc.params_at_rest import FORMS, stored_nbytes

# 2: parameters may be stored at rest (qwc/params_at_rest.py); an artifact without any is
# written as 1, which runtimes before that read too.
FORMAT_VERSION = 2
AT_REST_VERSION = 2
FORMAT_VERSIONS = (1, 2)
ALIGN = 64                       # every parameter's offset in params.bin
DTYPES = {"float32", "float16", "int8", "uint8", "int32", "int64"}
CACHE_DTYPES = tuple(KV_TYPES.values())   # the KV cache formats (`qwc compile --kv-dtype`)
REQUIRED_FILES = ("lib.so", "params.bin")
# The step entry point's own inputs, after Functions.inputs (compiler/build.py: step):
# segments [G, 3] (cache row, first token, count) and the tokens whose logits it returns [L]
STEP_INPUTS = ("qwc_step_segments", "qwc_step_logit_tokens")
INPUTS = ("input_ids", "attention_mask", "position_ids")   # every entry point's first inputs
_SHA256 = re.compile(r"[0-9a-f]{64}")
_FILE_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def _str_list(v) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


def _object(v, what: str, bad) -> dict:
    if not isinstance(v, dict):
        bad(f"{what} is missing or not a JSON object")
    return v


@dataclass(frozen=True)
class ArtifactTarget:
    """What the library was built for: the runtime refuses a machine without `features`."""
    name: str
    arch: str
    triple: str
    mcpu: str
    features: tuple[str, ...] = ()
    mattr: tuple[str, ...] = ()

    @classmethod
    def from_dict(cls, t, bad) -> ArtifactTarget:
        t = _object(t, "'target'", bad)
        for key in ("name", "arch", "triple", "mcpu"):
            if not isinstance(t.get(key), str):
                bad(f"target.{key} is missing or not a string")
        if not _str_list(t.get("features", [])) or not _str_list(t.get("mattr", [])):
            bad("target.features / target.mattr must be lists of strings")
        return cls(t["name"], t["arch"], t["triple"], t["mcpu"], tuple(t.get("features", [])), tuple(t.get("mattr", [])))

    def to_dict(self) -> dict:
        return {"name": self.name, "arch": self.arch, "triple": self.triple, "mcpu": self.mcpu,
                "mattr": list(self.mattr), "features": list(self.features)}


@dataclass(frozen=True)
class Param:
    """One parameter's place in params.bin (64-byte aligned, in the library's argument order).
    `at_rest`: stored in a smaller form the runtime unpacks at load (qwc/params_at_rest.py:
    {"form": ...} and, for q4_k_offsets, {"scales": the parameter of its s}); `nbytes` are
    then the stored bytes."""
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    at_rest: dict | None = None

    @property
    def memory_bytes(self) -> int:
        """Its bytes as the library reads it (loaded, unpacked)."""
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize

    @classmethod
    def from_dict(cls, p, i: int, end: int, bad) -> Param:
        """params[i], which must start at or past `end` (the previous one's end)."""
        if not isinstance(p, dict) or not isinstance(p.get("name"), str):
            bad(f"params[{i}] has no name")
        name = p["name"]
        if p.get("dtype") not in DTYPES:
            bad(f"parameter {name}: dtype {p.get('dtype')!r} is not one of {', '.join(sorted(DTYPES))}")
        shape = p.get("shape")
        if not isinstance(shape, list) or not all(is_int(d, 1) for d in shape):
            bad(f"parameter {name}: shape {shape!r} must be a list of positive integers")
        off, nbytes = p.get("offset"), p.get("nbytes")
        if not is_int(off) or off % ALIGN or off < end:
            bad(f"parameter {name}: offset {off!r} must be a multiple of {ALIGN} past the previous parameter")
        at_rest = p.get("at_rest")
        if at_rest is None:
            size = int(np.prod(shape, dtype=np.int64)) * np.dtype(p["dtype"]).itemsize
        else:
            if not isinstance(at_rest, dict) or at_rest.get("form") not in FORMS:
                bad(f"parameter {name}: at_rest {at_rest!r} names no form this runtime knows ({', '.join(FORMS)})")
            size = stored_nbytes(at_rest["form"], p["dtype"], tuple(shape))
            if size is None:
                bad(f"parameter {name}: at-rest form {at_rest['form']} cannot hold {p['dtype']} {shape}")
            if at_rest["form"] == "q4_k_offsets" and not isinstance(at_rest.get("scales"), str):
                bad(f"parameter {name}: at-rest form q4_k_offsets names no scales parameter")
        if nbytes != size:
            how = "its shape and dtype" if at_rest is None else f"its shape and dtype in {at_rest['form']}"
            bad(f"parameter {name}: nbytes {nbytes!r} is not the {size} of {how}")
        return cls(name, p["dtype"], tuple(shape), off, nbytes, at_rest)

    def to_dict(self) -> dict:
        out = {"name": self.name, "dtype": self.dtype, "shape": list(self.shape), "offset": self.offset,
               "nbytes": self.nbytes}
        if self.at_rest is not None:
            out["at_rest"] = dict(self.at_rest)
        return out


def _params(ps, bad) -> tuple[Param, ...]:
    if not isinstance(ps, list):
        bad("'params' is missing or not a JSON list")
    out, end = [], 0
    for i, p in enumerate(ps):
        out.append(Param.from_dict(p, i, end, bad))
        end = out[-1].offset + out[-1].nbytes
    names = [p.name for p in out]
    if len(set(names)) != len(names):
        bad(f"parameter {next(n for n in names if names.count(n) > 1)} is listed twice")
    by_name = {p.name: p for p in out}
    for p in out:   # an offsets' s: a float32 parameter of its shape, stored whole or as q4_k_scales
        if p.at_rest is not None and p.at_rest["form"] == "q4_k_offsets":
            s = by_name.get(p.at_rest["scales"])
            if s is None or s.dtype != "float32" or s.shape != p.shape or s.at_rest and s.at_rest["form"] != "q4_k_scales":
                bad(f"parameter {p.name}: its scales {p.at_rest['scales']!r} are not a float32 parameter of its shape")
    return tuple(out)


@dataclass(frozen=True)
class LoraSlots:
    """Adapter slots (`qwc compile --max-lora-rank`, compiler/lora_slots.py): after the cache
    the library takes each token's slot (shaped as input_ids), then A [S, in, C, chunk] and
    B [S, C, chunk, out] of every adapted linear, for any S slots and C <= max_rank / chunk."""
    max_rank: int
    chunk: int
    slot_input: str
    linears: tuple[tuple[str, int, int], ...]   # (HF weight name, in, out), in argument order

    def input_names(self) -> list[str]:
        return [self.slot_input] + [f"qwc_lora_{ab}_{i}" for i in range(len(self.linears)) for ab in "ab"]

    @classmethod
    def from_dict(cls, lora, bad) -> LoraSlots:
        if not isinstance(lora, dict) or not isinstance(lora.get("slot_input"), str):
            bad("functions.lora must be an object naming its slot_input")
        chunk, rank = lora.get("chunk"), lora.get("max_rank")
        if not is_int(chunk, 1) or not is_int(rank, 1) or rank % chunk or rank > MAX_LORA_RANK:
            bad(f"functions.lora: max_rank {rank!r} must be a positive multiple of chunk {chunk!r}, "
                f"at most {MAX_LORA_RANK}")
        linears = lora.get("linears")
        if not isinstance(linears, list) or not linears or not all(
                isinstance(d, dict) and isinstance(d.get("name"), str) and is_int(d.get("in"), 1)
                and is_int(d.get("out"), 1) for d in linears):
            bad("functions.lora.linears must list objects with a name and positive in and out sizes")
        return cls(rank, chunk, lora["slot_input"], tuple((d["name"], d["in"], d["out"]) for d in linears))

    def to_dict(self) -> dict:
        return {"max_rank": self.max_rank, "chunk": self.chunk, "slot_input": self.slot_input,
                "linears": [{"name": n, "in": k, "out": o} for n, k, o in self.linears]}


ENTRY_POINTS = ("prefill", "decode", "score", "verify", "decode_batch", "step", "embed", "embed_step")


@dataclass(frozen=True)
class Functions:
    """The library's entry points and what the runtime must hand them."""
    entry_points: dict[str, str]         # ENTRY_POINTS' name -> what it does, for a reader
    cache: tuple[str, ...]               # a key and a value per layer, in argument order
    cache_shape: tuple                   # ("1", kv_heads, "ctx", head_dim)
    outputs: tuple[str, ...]             # what the entry points return, for a reader
    inputs: tuple[str, ...] = INPUTS
    cache_capacity_multiple: int = 1     # the K layout's key tile: capacities round up to it
    k_cache_layout: str = "rows"         # "rows", or f"key_tiles_{cache_capacity_multiple}"
    cache_dtype: str = "float32"         # the cache format (CACHE_DTYPES; q8_0 buffers hold int8: kv_formats.cache_row)
    max_batch: int = 1                   # sequences a decode_batch step takes (1: no such step)
    max_tokens_per_call: int | None = None   # prefill / score; the runtime chunks longer input
    verify_tokens: int | None = None         # the verify entry point's; None: no such entry point
    lora: LoraSlots | None = None            # adapter slots; None: adapters only merged (`qwc export --lora`)

    @classmethod
    def from_dict(cls, f, cfg: ModelConfig, bad) -> Functions:
        f = _object(f, "'functions'", bad)
        entries = f.get("entry_points")
        if (not isinstance(entries, dict) or not {"prefill", "decode"} <= set(entries)
                or not set(entries) <= set(ENTRY_POINTS) or not all(isinstance(v, str) for v in entries.values())):
            bad(f"functions.entry_points must name prefill and decode, and only {', '.join(ENTRY_POINTS)}, "
                f"each with a description")
        cache = f.get("cache")
        if not _str_list(cache) or len(cache) != 2 * cfg.num_hidden_layers:
            bad(f"functions.cache must list {2 * cfg.num_hidden_layers} cache tensors (a key and a value per layer)")
        if f.get("inputs") != list(INPUTS):
            bad(f"functions.inputs must be {', '.join(INPUTS)}")
        if f.get("cache_shape") != ["1", cfg.num_key_value_heads, "ctx", cfg.head_dim]:
            bad(f"functions.cache_shape {f.get('cache_shape')!r} does not match the model "
                f"(1, {cfg.num_key_value_heads} KV heads, ctx, head_dim {cfg.head_dim})")
        if not _str_list(f.get("outputs", [])):
            bad("functions.outputs must be a list of strings")
        mult = f.get("cache_capacity_multiple", 1)
        if not is_int(mult, 1) or mult > 4096:
            bad(f"functions.cache_capacity_multiple {mult!r} must be an integer in [1, 4096]")
        layout = f.get("k_cache_layout", "rows")
        if layout not in ("rows", f"key_tiles_{mult}"):
            bad(f"functions.k_cache_layout {layout!r} must be rows or key_tiles_{mult}")
        if f.get("cache_dtype", "float32") not in CACHE_DTYPES:   # absent: an artifact from before float16 caches
            bad(f"functions.cache_dtype {f.get('cache_dtype')!r} must be one of {', '.join(CACHE_DTYPES)}")
        cls._check_bounds(f, entries, bad)
        lora = f.get("lora")
        return cls(dict(entries), tuple(cache), tuple(f["cache_shape"]), tuple(f.get("outputs", [])), INPUTS, mult,
                   layout, f.get("cache_dtype", "float32"), f.get("max_batch", 1), f.get("max_tokens_per_call"),
                   f.get("verify_tokens"), None if lora is None else LoraSlots.from_dict(lora, bad))

    @staticmethod
    def _check_bounds(f: dict, entries: dict, bad) -> None:
        """The runtime sizes its batch rows and prefill chunks by these: a library built for
        fewer would be handed inputs past the bounds its memory plan was made for."""
        batch = f.get("max_batch", 1)
        if not is_int(batch, 1) or batch > MAX_BATCH or (batch > 1) != ("decode_batch" in entries):
            bad(f"functions.max_batch {batch!r} must be an integer in [1, {MAX_BATCH}], above 1 exactly when "
                f"there is a decode_batch entry point")
        chunk = f.get("max_tokens_per_call")
        if chunk is not None and (not is_int(chunk, 1) or chunk > 65536):
            bad(f"functions.max_tokens_per_call {chunk!r} must be an integer in [1, 65536]")
        verify = f.get("verify_tokens")
        if (verify is not None or "verify" in entries) and (not is_int(verify, 1) or verify > 256
                                                             or "verify" not in entries):
            bad(f"functions.verify_tokens {verify!r} must be an integer in [1, 256], given exactly when there is a "
                f"verify entry point")

    def to_dict(self) -> dict:
        out = {"entry_points": self.entry_points, "inputs": list(self.inputs), "cache": list(self.cache),
               "cache_shape": list(self.cache_shape), "cache_capacity_multiple": self.cache_capacity_multiple,
               "k_cache_layout": self.k_cache_layout, "cache_dtype": self.cache_dtype, "max_batch": self.max_batch,
               "outputs": list(self.outputs)}
        if self.max_tokens_per_call is not None:
            out["max_tokens_per_call"] = self.max_tokens_per_call
        if self.verify_tokens is not None:
            out["verify_tokens"] = self.verify_tokens
        if self.lora is not None:
            out["lora"] = self.lora.to_dict()
        return out


@dataclass(frozen=True)
class LinearFormat:
    """How many linears hold one weight format (llama.cpp's name: q4_0, q4_1, q8_0)."""
    bits: int
    block: int
    format: str
    count: int


@dataclass(frozen=True)
class Quantization:
    """What the weights and activations are, for a reader (`qwc info`, `qwc bench`'s report);
    the runtime does not act on it."""
    linears: tuple[LinearFormat, ...]
    activation_bits: int                      # 8: int8 blocks (W4A8), 32: float activations
    embedding_bits: int | None = None         # the quantized embedding's (None: float)
    scheme: str = "q4_0"
    weight_layout: dict[str, int] = field(default_factory=dict)    # repacked layout -> tensors in it
    tuned_kernels: dict[str, dict] = field(default_factory=dict)   # kernel -> the knobs `qwc tune` chose
    # linears whose prefill takes int8 activations with a scale and zero point a token (the
    # others: a scale a block of 32; compiler/row_activations.py)
    row_activations: int = 0

    @classmethod
    def from_dict(cls, q, bad) -> Quantization:
        q = _object(q, "'quantization'", bad)
        linears = q.get("linears")
        if not isinstance(linears, list) or not all(
                isinstance(d, dict) and is_int(d.get("bits"), 1) and is_int(d.get("block"), 1)
                and isinstance(d.get("format"), str) and is_int(d.get("count"), 1) for d in linears):
            bad("quantization.linears must list objects with bits, block, format and count")
        if q.get("activation_bits") not in (8, 32) or isinstance(q.get("activation_bits"), bool):
            bad(f"quantization.activation_bits {q.get('activation_bits')!r} must be 8 or 32")
        emb = q.get("embedding_bits")
        if emb is not None and not is_int(emb, 1):
            bad(f"quantization.embedding_bits {emb!r} must be a positive integer or null")
        if not isinstance(q.get("scheme", "q4_0"), str):
            bad("quantization.scheme must be a string")
        layout, tuned = q.get("weight_layout", {}), q.get("tuned_kernels", {})
        if not isinstance(layout, dict) or not all(is_int(v) for v in layout.values()):
            bad("quantization.weight_layout must map layouts to tensor counts")
        if not isinstance(tuned, dict) or not all(isinstance(v, dict) for v in tuned.values()):
            bad("quantization.tuned_kernels must map kernels to their knobs")
        rows = q.get("row_activations", 0)
        if not is_int(rows):
            bad(f"quantization.row_activations {rows!r} must be a count")
        return cls(tuple(LinearFormat(d["bits"], d["block"], d["format"], d["count"]) for d in linears),
                   q["activation_bits"], emb, q.get("scheme", "q4_0"), dict(layout), dict(tuned), rows)

    def to_dict(self) -> dict:
        out = {"scheme": self.scheme, "linears": [{"bits": f.bits, "block": f.block, "format": f.format,
                                                   "count": f.count} for f in self.linears],
               "embedding_bits": self.embedding_bits, "activation_bits": self.activation_bits}
        if self.weight_layout:
            out["weight_layout"] = self.weight_layout
        if self.tuned_kernels:
            out["tuned_kernels"] = self.tuned_kernels
        if self.row_activations:
            out["row_activations"] = self.row_activations
        return out


def _files(files, bad) -> dict[str, str]:
    """file name -> sha256 hex digest: plain names (nothing outside the folder), the required
    files among them."""
    files = _object(files, "'files'", bad)
    for name in REQUIRED_FILES:
        if name not in files:
            bad(f"files lacks {name}")
    for name, digest in files.items():
        if not _FILE_NAME.fullmatch(name) or name in (".", ".."):
            bad(f"file name {name!r} is not a plain file name")
        if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
            bad(f"the hash of {name} is not a sha256 hex digest")
    return dict(files)


@dataclass(frozen=True)
class Manifest:
    """manifest.json, checked and typed: built by the compiler (compiler/compile.py,
    compiler/artifact.py), read by the runtime. Each part checks its own fields as it is read."""
    target: ArtifactTarget
    model: ModelConfig
    functions: Functions
    params: tuple[Param, ...]
    files: dict[str, str]                # file name -> sha256 hex digest
    quantization: Quantization
    qwc_version: str | None = None
    format_version: int = FORMAT_VERSION

    @property
    def weight_bytes(self) -> int:
        """The parameters' bytes in memory, as the library reads them."""
        return sum(p.memory_bytes for p in self.params)

    @classmethod
    def from_dict(cls, m, where: str = "manifest.json") -> Manifest:
        """The manifest of the JSON object `m`, or one QwcError line naming what is wrong."""
        def bad(what: str):
            raise QwcError(f"{where}: {what} (corrupt artifact; recompile it)")

        if not isinstance(m, dict):
            bad("not a JSON object")
        if m.get("format_version") not in FORMAT_VERSIONS:
            raise QwcError(f"{where}: artifact format version {m.get('format_version')!r} is not supported by "
                           f"this runtime (expected {' or '.join(map(str, FORMAT_VERSIONS))}); recompile it")
        target = ArtifactTarget.from_dict(m.get("target"), bad)
        model_json = _object(m.get("model"), "'model'", bad)
        try:
            model = ModelConfig.from_dict(model_json)
        except (QwcError, TypeError) as e:
            bad(f"model: {e}")
        functions = Functions.from_dict(m.get("functions"), model, bad)
        params = _params(m.get("params"), bad)
        if m["format_version"] < AT_REST_VERSION and any(p.at_rest for p in params):
            bad(f"format version {m['format_version']} has no parameters at rest")
        files = _files(m.get("files"), bad)
        version = m.get("qwc_version")
        if version is not None and not isinstance(version, str):
            bad("qwc_version must be a string")
        return cls(target, model, functions, params, files, Quantization.from_dict(m.get("quantization"), bad),
                   version, m["format_version"])

    def to_dict(self) -> dict:
        """The JSON object manifest.json holds (from_dict's input)."""
        return {"format_version": self.format_version, "qwc_version": self.qwc_version,
                "target": self.target.to_dict(), "model": json.loads(self.model.to_json()),
                "quantization": self.quantization.to_dict(), "functions": self.functions.to_dict(),
                "params": [p.to_dict() for p in self.params], "files": self.files}


def read_manifest(path: Path) -> Manifest:
    """The checked manifest of the artifact folder `path`."""
    path = Path(path)
    if not path.is_dir():
        raise QwcError(f"{path}: not a compiled artifact (expected a model.qwc folder)")
    mf = path / "manifest.json"
    try:
        manifest = json.loads(mf.read_text())
    except FileNotFoundError:
        raise QwcError(f"{path}: no manifest.json (not a qwc artifact)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise QwcError(f"{mf}: corrupt manifest ({e})") from None
    except OSError as e:
        raise QwcError(f"{mf}: cannot read ({e.strerror})") from None
    return Manifest.from_dict(manifest, where=str(mf))


def check_library(vm_arity, vm_param_name, manifest: Manifest, where: str) -> None:
    """The library's own signature (the parameter names its entry points were compiled with)
    must be the manifest's inputs, cache and parameters, in order."""
    f = manifest.functions
    lora = f.lora.input_names() if f.lora else []
    rest = [c.replace(".", "_") for c in f.cache] + lora + [p.name for p in manifest.params]
    for fn in ("prefill", "decode", "score", "verify", "decode_batch", "step"):
        if fn not in f.entry_points:
            continue
        want = list(f.inputs) + (list(STEP_INPUTS) if fn == "step" else []) + rest
        try:
            n = vm_arity(fn)
            got = [vm_param_name(fn, i) for i in range(n)]
        except Exception as e:  # TVM's error types; a library without the function
            raise QwcError(f"{where}: lib.so has no usable {fn} entry point ({str(e).splitlines()[0]})") from None
        if got != want:
            first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            raise QwcError(f"{where}: lib.so's {fn} takes {len(got)} arguments, the manifest lists {len(want)}; "
                           f"they first differ at #{first} "
                           f"({got[first] if first < len(got) else '-'} vs {want[first] if first < len(want) else '-'})")
