"""The artifact's `manifest.json`: its format version, schema and typed form (`Manifest`),
shared by the writer (compiler/artifact.py builds a Manifest and writes its to_dict) and the
runtime (reads it back through the same checks, before anything is loaded).

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
from qwc.limits import KV_TYPES, MAX_BATCH, MAX_LORA_RANK, is_int

FORMAT_VERSION = 1
ALIGN = 64                       # every parameter's offset in params.bin
DTYPES = {"float32", "float16", "int8", "uint8", "int32", "int64"}
CACHE_DTYPES = tuple(KV_TYPES.values())   # the KV cache formats (`qwc compile --kv-dtype`)
REQUIRED_FILES = ("lib.so", "params.bin")
# The step entry point's own inputs, after Functions.inputs (compiler/build.py: step):
# segments [G, 3] (cache row, first token, count) and the tokens whose logits it returns [L]
STEP_INPUTS = ("qwc_step_segments", "qwc_step_logit_tokens")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_FILE_NAME = re.compile(r"[A-Za-z0-9_.-]+")


@dataclass(frozen=True)
class ArtifactTarget:
    """What the library was built for: the runtime refuses a machine without `features`."""
    name: str
    arch: str
    triple: str
    mcpu: str
    features: tuple[str, ...] = ()
    mattr: tuple[str, ...] = ()


@dataclass(frozen=True)
class Param:
    """One parameter's place in params.bin (64-byte aligned, in the library's argument order)."""
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


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


@dataclass(frozen=True)
class Functions:
    """The library's entry points and what the runtime must hand them."""
    entry_points: dict                   # name -> what it does ("prefill", "decode", ...)
    inputs: tuple[str, ...]              # input_ids, attention_mask, position_ids
    cache: tuple[str, ...]               # a key and a value per layer, in argument order
    cache_shape: tuple                   # ("1", kv_heads, "ctx", head_dim)
    cache_capacity_multiple: int = 1     # the K layout's key tile: capacities round up to it
    cache_dtype: str = "float32"         # the cache format (CACHE_DTYPES; q8_0 buffers hold int8: limits.cache_row)
    max_batch: int = 1                   # sequences a decode_batch step takes (1: no such step)
    max_tokens_per_call: int | None = None   # prefill / score; the runtime chunks longer input
    verify_tokens: int | None = None         # the verify entry point's; None: no such entry point
    lora: LoraSlots | None = None            # adapter slots; None: adapters only merged (`qwc export --lora`)
    extra: dict = field(default_factory=dict)   # descriptive fields (outputs, cache layout)


@dataclass(frozen=True)
class Manifest:
    """manifest.json, checked and typed: built by compiler/artifact.py, read by the runtime."""
    target: ArtifactTarget
    model: ModelConfig
    functions: Functions
    params: tuple[Param, ...]
    files: dict                          # file name -> sha256 hex digest
    quantization: dict                   # descriptive: scheme, bits, layouts (qwc info)
    qwc_version: str | None = None
    format_version: int = FORMAT_VERSION

    @property
    def weight_bytes(self) -> int:
        return sum(p.nbytes for p in self.params)

    @classmethod
    def from_dict(cls, m, where: str = "manifest.json") -> Manifest:
        """The manifest of the JSON object `m`, or one QwcError line naming what is wrong."""
        config = check_manifest(m, where)
        t, f = m["target"], m["functions"]
        known = {"entry_points", "inputs", "cache", "cache_shape", "cache_capacity_multiple", "cache_dtype",
                 "max_batch", "max_tokens_per_call", "verify_tokens", "lora"}
        lora = f.get("lora")
        return cls(
            target=ArtifactTarget(t["name"], t["arch"], t["triple"], t["mcpu"], tuple(t.get("features", [])),
                                  tuple(t.get("mattr", []))),
            model=config,
            functions=Functions(dict(f["entry_points"]), tuple(f["inputs"]), tuple(f["cache"]),
                                tuple(f["cache_shape"]), f.get("cache_capacity_multiple", 1),
                                f.get("cache_dtype", "float32"), f.get("max_batch", 1),
                                f.get("max_tokens_per_call"), f.get("verify_tokens"),
                                None if lora is None else LoraSlots(
                                    lora["max_rank"], lora["chunk"], lora["slot_input"],
                                    tuple((d["name"], d["in"], d["out"]) for d in lora["linears"])),
                                {k: v for k, v in f.items() if k not in known}),
            params=tuple(Param(p["name"], p["dtype"], tuple(p["shape"]), p["offset"], p["nbytes"]) for p in m["params"]),
            files=dict(m["files"]), quantization=dict(m["quantization"]), qwc_version=m.get("qwc_version"),
            format_version=m["format_version"])

    def to_dict(self) -> dict:
        """The JSON object manifest.json holds (from_dict's input)."""
        f = self.functions
        functions = {"entry_points": f.entry_points, "inputs": list(f.inputs), "cache": list(f.cache),
                     "cache_shape": list(f.cache_shape), "cache_capacity_multiple": f.cache_capacity_multiple,
                     "cache_dtype": f.cache_dtype, "max_batch": f.max_batch, **f.extra}
        if f.max_tokens_per_call is not None:
            functions["max_tokens_per_call"] = f.max_tokens_per_call
        if f.verify_tokens is not None:
            functions["verify_tokens"] = f.verify_tokens
        if f.lora is not None:
            functions["lora"] = {"max_rank": f.lora.max_rank, "chunk": f.lora.chunk, "slot_input": f.lora.slot_input,
                                 "linears": [{"name": n, "in": k, "out": o} for n, k, o in f.lora.linears]}
        t = self.target
        return {"format_version": self.format_version, "qwc_version": self.qwc_version,
                "target": {"name": t.name, "arch": t.arch, "triple": t.triple, "mcpu": t.mcpu,
                           "mattr": list(t.mattr), "features": list(t.features)},
                "model": json.loads(self.model.to_json()), "quantization": self.quantization,
                "functions": functions,
                "params": [{"name": p.name, "dtype": p.dtype, "shape": list(p.shape), "offset": p.offset,
                            "nbytes": p.nbytes} for p in self.params],
                "files": self.files}


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


def _is_str_list(v) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


def check_manifest(m, where: str = "manifest.json") -> ModelConfig:
    """The schema of manifest.json's JSON object (Manifest.from_dict's checks); returns the
    model config it parsed on the way."""
    def bad(what: str):
        raise QwcError(f"{where}: {what} (corrupt artifact; recompile it)")

    if not isinstance(m, dict):
        bad("not a JSON object")
    if m.get("format_version") != FORMAT_VERSION:
        raise QwcError(f"{where}: artifact format version {m.get('format_version')!r} is not supported by "
                       f"this runtime (expected {FORMAT_VERSION}); recompile it")
    for key, kind in (("target", dict), ("model", dict), ("functions", dict), ("params", list),
                      ("files", dict), ("quantization", dict)):
        if not isinstance(m.get(key), kind):
            bad(f"{key!r} is missing or not a JSON {'object' if kind is dict else 'list'}")

    t = m["target"]
    for key in ("name", "arch", "triple", "mcpu"):
        if not isinstance(t.get(key), str):
            bad(f"target.{key} is missing or not a string")
    if not _is_str_list(t.get("features", [])) or not _is_str_list(t.get("mattr", [])):
        bad("target.features / target.mattr must be lists of strings")

    try:
        cfg = ModelConfig.from_dict(m["model"])
    except (QwcError, TypeError) as e:
        bad(f"model: {e}")

    f = m["functions"]
    entries = f.get("entry_points")
    if not isinstance(entries, dict) or not {"prefill", "decode"} <= set(entries):
        bad("functions.entry_points must name prefill and decode")
    cache = f.get("cache")
    if not _is_str_list(cache) or len(cache) != 2 * cfg.num_hidden_layers:
        bad(f"functions.cache must list {2 * cfg.num_hidden_layers} cache tensors (a key and a value per layer)")
    if f.get("inputs") != ["input_ids", "attention_mask", "position_ids"]:
        bad("functions.inputs must be input_ids, attention_mask, position_ids")
    if f.get("cache_shape") != ["1", cfg.num_key_value_heads, "ctx", cfg.head_dim]:
        bad(f"functions.cache_shape {f.get('cache_shape')!r} does not match the model "
            f"(1, {cfg.num_key_value_heads} KV heads, ctx, head_dim {cfg.head_dim})")
    mult = f.get("cache_capacity_multiple", 1)
    if not is_int(mult, 1) or mult > 4096:
        bad(f"functions.cache_capacity_multiple {mult!r} must be an integer in [1, 4096]")
    if f.get("cache_dtype", "float32") not in CACHE_DTYPES:   # absent: an artifact from before float16 caches
        bad(f"functions.cache_dtype {f.get('cache_dtype')!r} must be one of {', '.join(CACHE_DTYPES)}")
    # the runtime sizes its batch rows and prefill chunks by these: a library built for fewer
    # would be handed inputs past the bounds its memory plan was made for
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

    _check_lora(f.get("lora"), bad)

    end, names = 0, set()
    for i, p in enumerate(m["params"]):
        if not isinstance(p, dict) or not isinstance(p.get("name"), str):
            bad(f"params[{i}] has no name")
        name = p["name"]
        if name in names:
            bad(f"parameter {name} is listed twice")
        names.add(name)
        if p.get("dtype") not in DTYPES:
            bad(f"parameter {name}: dtype {p.get('dtype')!r} is not one of {', '.join(sorted(DTYPES))}")
        shape = p.get("shape")
        if not isinstance(shape, list) or not all(is_int(d, 1) for d in shape):
            bad(f"parameter {name}: shape {shape!r} must be a list of positive integers")
        off, nbytes = p.get("offset"), p.get("nbytes")
        if not is_int(off) or off % ALIGN or off < end:
            bad(f"parameter {name}: offset {off!r} must be a multiple of {ALIGN} past the previous parameter")
        size = int(np.prod(shape, dtype=np.int64)) * np.dtype(p["dtype"]).itemsize
        if nbytes != size:
            bad(f"parameter {name}: nbytes {nbytes!r} is not the {size} of its shape and dtype")
        end = off + nbytes

    files = m["files"]
    for name in REQUIRED_FILES:
        if name not in files:
            bad(f"files lacks {name}")
    for name, digest in files.items():
        if not _FILE_NAME.fullmatch(name) or name in (".", ".."):
            bad(f"file name {name!r} is not a plain file name")
        if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
            bad(f"the hash of {name} is not a sha256 hex digest")
    return cfg


def _check_lora(lora, bad) -> None:
    if lora is None:
        return
    if not isinstance(lora, dict) or not isinstance(lora.get("slot_input"), str):
        bad("functions.lora must be an object naming its slot_input")
    chunk, rank = lora.get("chunk"), lora.get("max_rank")
    if not is_int(chunk, 1) or not is_int(rank, 1) or rank % chunk or rank > MAX_LORA_RANK:
        bad(f"functions.lora: max_rank {rank!r} must be a positive multiple of chunk {chunk!r}, at most {MAX_LORA_RANK}")
    linears = lora.get("linears")
    if not isinstance(linears, list) or not linears or not all(
            isinstance(d, dict) and isinstance(d.get("name"), str) and is_int(d.get("in"), 1) and is_int(d.get("out"), 1)
            for d in linears):
        bad("functions.lora.linears must list objects with a name and positive in and out sizes")


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
