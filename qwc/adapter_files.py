"""LoRA adapters read from disk and checked against a base model: PEFT directories and
llama.cpp's GGUF adapters.

A PEFT directory (what `peft`'s `save_pretrained` writes) holds `adapter_config.json`, read
with peft's own `LoraConfig`, and `adapter_model.safetensors` with, per adapted linear,
`base_model.model.<module>.lora_A.weight` [r, in] and `.lora_B.weight` [out, r]. The merged
weight is W + s·B·A with s = alpha / r (alpha / sqrt(r) with rsLoRA), times the user's scale.

A GGUF adapter (llama.cpp's `convert_lora_to_gguf.py`) holds `general.type = adapter`,
`adapter.type = lora`, `adapter.lora.alpha` and tensors `blk.N.attn_q.weight.lora_a` /
`.lora_b`; llama.cpp scales by alpha / r (1 where alpha is 0). A `llama` adapter's q and k
B rows are permuted for llama.cpp's rotary layout, as its base weights are: put back here.

A QA-LoRA adapter is a PEFT directory with `use_qalora` and `qalora_group_size` (peft's own
fields). Its A is [r, in / G] and reads the input pooled the way peft's QA-LoRA variant pools
it: the mean of each group of G inputs times in / G. So for output row n and input block b
the adapter adds s·(B·A)[n, b]·(in / G) / G times the block's sum: the same number for every
weight of the block, which is exactly a move of that block's Q4_1 minimum (models/lora_merge.py).

Every check runs before anything is written and fails in one line naming the file and tensor.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from qwc import field_checks
from qwc.config import ModelConfig
from qwc.errors import QwcError
from qwc.text import read_json_object

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
BLOCK_OF = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
             "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"
MARKER = "qwc_adapter.json"   # beside an adapter qwc lora wrote: how, and (QA-LoRA) the 4-bit base it trained on
QA_GROUP = 32                 # QA-LoRA pools inputs over the base's 4-bit blocks
# peft's keys: base_model.model.model.layers.3.self_attn.q_proj.lora_A[.default].weight
_PEFT_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")
_GGUF_KEY = re.compile(r"^blk\.(?P<layer>\d+)\.(?P<t>\w+)\.weight\.lora_(?P<ab>[ab])$")
_GGUF_LINEARS = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj",
                 "ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}


def weight_name(layer: int, linear: str) -> str:
    return f"model.layers.{layer}.{BLOCK_OF[linear]}.{linear}.weight"


def linear_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """Every adaptable weight of a Qwen2 model of `cfg`, [out, in] (HF naming)."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    dims = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}
    return {weight_name(n, lin): dims[lin] for n in range(cfg.num_hidden_layers) for lin in LINEARS}


@dataclass
class LoraPair:
    a: np.ndarray        # [r, in] (QA-LoRA: [r, in / group])
    b: np.ndarray        # [out, r]
    scale: float         # alpha / r (or rsLoRA's), times the user's scale

    def delta(self) -> np.ndarray:
        """s·B·A in float32, [out, in] (QA-LoRA: [out, in / group])."""
        return (self.b.astype(np.float32) * np.float32(self.scale)) @ self.a.astype(np.float32)


@dataclass
class Adapter:
    path: str
    kind: str                                   # "lora" or "qalora"
    pairs: dict[str, LoraPair] = field(default_factory=dict)   # HF weight name -> its pair
    group: int | None = None                    # QA-LoRA: inputs pooled a group
    alpha: float = 0.0
    base_sha256: str | None = None              # QA-LoRA by qwc lora: the 4-bit base's fingerprint

    @property
    def rank(self) -> int:
        return max(p.a.shape[0] for p in self.pairs.values())

    @property
    def nbytes(self) -> int:
        return sum(p.a.nbytes + p.b.nbytes for p in self.pairs.values())

    @property
    def modules(self) -> list[str]:
        return sorted({n.split(".")[-2] for n in self.pairs}, key=LINEARS.index)

    def describe(self) -> str:
        qa = f" QA-LoRA (groups of {self.group})" if self.kind == "qalora" else ""
        return (f"{Path(self.path).name}:{qa} rank {self.rank}, alpha {self.alpha:g}, {len(self.pairs)} linears "
                f"({', '.join(self.modules)})")


def parse_spec(spec: str) -> tuple[str, float]:
    """`PATH[:SCALE]` -> (path, scale). A path that itself holds a colon is taken whole when
    what follows its last colon is not a number."""
    path, sep, tail = spec.rpartition(":")
    if sep and path:
        try:
            scale = float(tail)
        except ValueError:
            return spec, 1.0
        if not math.isfinite(scale):
            raise QwcError(f"--lora {spec}: scale {tail} is not a finite number")
        return path, scale
    return spec, 1.0


def read_adapter(spec: str, cfg: ModelConfig) -> Adapter:
    """The adapter at `spec` (`PATH[:SCALE]`: a PEFT directory or a GGUF adapter file), checked
    against a base of `cfg`: every tensor paired, of the base's shapes, finite."""
    path, user_scale = parse_spec(spec)
    p = Path(path)
    if p.is_dir():
        ad = _read_peft(p, user_scale)
    elif p.is_file() and p.suffix.lower() == ".gguf":
        ad = _read_gguf(p, cfg, user_scale)
    elif p.exists():
        raise QwcError(f"{path}: not a PEFT adapter directory or a GGUF adapter file")
    else:
        raise QwcError(f"{path}: no such adapter")
    check_adapter(ad, cfg)
    return ad


def _peft_config(folder: Path):
    from peft import LoraConfig, PeftType

    cfg_path = folder / PEFT_CONFIG
    if not cfg_path.is_file():
        raise QwcError(f"{folder}: not a PEFT adapter directory (no {PEFT_CONFIG})")
    raw = read_json_object(cfg_path)
    peft_type = field_checks.string(cfg_path, "peft_type", raw.get("peft_type", PeftType.LORA.value))
    if peft_type != PeftType.LORA.value:
        raise QwcError(f"{cfg_path}: a {field_checks.shown(peft_type)} adapter; qwc takes LoRA")
    check_lora_fields(raw, cfg_path)
    try:
        c = LoraConfig.from_pretrained(str(folder))
    except (TypeError, ValueError) as e:
        raise QwcError(f"{cfg_path}: peft rejects it ({str(e).splitlines()[0]})") from None
    if c.use_dora:
        raise QwcError(f"{cfg_path}: DoRA adapters are not supported (use_dora)")
    if c.fan_in_fan_out:
        raise QwcError(f"{cfg_path}: fan_in_fan_out is for GPT-2's Conv1D layers; Qwen2's linears are not")
    if c.bias != "none" or c.lora_bias:
        raise QwcError(f"{cfg_path}: adapters that train biases (bias={c.bias!r}) are not supported")
    if c.modules_to_save:
        raise QwcError(f"{cfg_path}: modules_to_save ({', '.join(c.modules_to_save)}) holds whole trained "
                       "modules, not low-rank adapters; qwc takes LoRA pairs only")
    if not isinstance(c.r, int) or c.r < 1:
        raise QwcError(f"{cfg_path}: rank r={c.r!r} must be a positive integer")
    return c


def check_lora_fields(raw: dict, where) -> None:
    """The fields of a PEFT LoRA config qwc computes with, by type and range, before peft's
    LoraConfig (which trusts them) or any arithmetic sees them. A field that is absent takes
    peft's default; a present one must be of its type (null only where peft means "none")."""
    if "r" in raw:
        field_checks.integer(where, "r", raw["r"])
    if "lora_alpha" in raw:
        field_checks.positive_number(where, "lora_alpha", raw["lora_alpha"])
    for key in ("use_rslora", "fan_in_fan_out", "use_dora", "use_qalora"):
        if key in raw:
            field_checks.flag(where, key, raw[key])
    if raw.get("use_qalora"):
        field_checks.integer(where, "qalora_group_size", raw.get("qalora_group_size"))
    for key, check in (("rank_pattern", field_checks.integer), ("alpha_pattern", field_checks.positive_number)):
        patterns = raw.get(key)
        if patterns is None:
            continue
        if not isinstance(patterns, dict):
            raise QwcError(f"{where}: {key} {field_checks.shown(patterns)} must be a mapping of module name "
                           "patterns to values")
        for name, value in patterns.items():
            field_checks.pattern(where, f"{key} key", name)
            check(where, f"{key}[{name!r}]", value)
    targets = raw.get("target_modules")
    if targets is not None:
        if isinstance(targets, str):
            field_checks.pattern(where, "target_modules", targets)
        elif not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
            raise QwcError(f"{where}: target_modules {field_checks.shown(targets)} must be a list of module names "
                           "or one regular expression")


def _recorded_base(folder: Path) -> str | None:
    try:
        return json.loads((folder / MARKER).read_text()).get("qa_base_sha256")
    except (OSError, ValueError, AttributeError):
        return None


def _pattern_value(patterns: dict, module: str, default):
    """peft's rank_pattern / alpha_pattern: the value of the longest key the module path ends with."""
    hits = [k for k in patterns if re.match(rf"(.*\.)?({k})$", module)]
    return patterns[max(hits, key=len)] if hits else default


def _read_peft(folder: Path, user_scale: float) -> Adapter:
    from safetensors import SafetensorError, safe_open

    c = _peft_config(folder)
    weights = folder / PEFT_WEIGHTS
    if not weights.is_file():
        if (folder / "adapter_model.bin").is_file():
            raise QwcError(f"{folder}: adapter_model.bin (pickle) is not read; save the adapter with safetensors")
        raise QwcError(f"{folder}: no {PEFT_WEIGHTS}")
    tensors: dict[str, np.ndarray] = {}
    try:
        with safe_open(str(weights), framework="pt") as h:
            for k in h.keys():
                tensors[k] = h.get_tensor(k).float().numpy()
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise QwcError(f"{weights}: corrupt or truncated safetensors file ({str(e).splitlines()[0]})") from None
    halves: dict[str, dict[str, np.ndarray]] = {}
    for k, t in tensors.items():
        m = _PEFT_KEY.match(k)
        if m is None:
            raise QwcError(f"{weights}: tensor {k} is not a LoRA A or B weight")
        halves.setdefault(m["module"], {})[m["ab"]] = t
    ad = Adapter(str(folder), "qalora" if c.use_qalora else "lora", alpha=float(c.lora_alpha),
                 group=int(c.qalora_group_size) if c.use_qalora else None, base_sha256=_recorded_base(folder))
    for module, ab in halves.items():
        if set(ab) != {"A", "B"}:
            raise QwcError(f"{weights}: {module} has lora_{'A' if 'A' in ab else 'B'} but no "
                           f"lora_{'B' if 'A' in ab else 'A'}")
        r = int(_pattern_value(c.rank_pattern or {}, module, c.r))
        alpha = float(_pattern_value(c.alpha_pattern or {}, module, c.lora_alpha))
        if ab["A"].ndim != 2 or ab["A"].shape[0] != r:
            raise QwcError(f"{weights}: {module}.lora_A has shape {tuple(ab['A'].shape)}; the config's rank is {r}")
        scale = alpha / math.sqrt(r) if c.use_rslora else alpha / r
        ad.pairs[_hf_weight(module, weights)] = LoraPair(ab["A"], ab["B"], scale * user_scale)
    return ad


def _hf_weight(module: str, where) -> str:
    """peft's module path -> the HF weight name; anything but a Qwen2 linear is refused."""
    m = re.fullmatch(r"model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)", module)
    if m is None or m[3] not in LINEARS or BLOCK_OF[m[3]] != m[2]:
        raise QwcError(f"{where}: adapts {module}, which a Qwen2 model does not have as a linear "
                       f"(qwc adapts {', '.join(LINEARS)})")
    return module + ".weight"


def _read_gguf(path: Path, cfg: ModelConfig, user_scale: float) -> Adapter:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from qwc.rotary import unpermute_rotary_rows

    try:
        reader = GGUFReader(path)
    except (ValueError, IndexError, KeyError, OSError) as e:
        raise QwcError(f"{path}: corrupt or truncated GGUF file ({e})") from None

    def meta(key):
        f = reader.fields.get(key)
        return None if f is None else f.contents()

    if meta("general.type") != "adapter" or meta("adapter.type") != "lora":
        raise QwcError(f"{path}: not a LoRA adapter (general.type {meta('general.type')!r}, "
                       f"adapter.type {meta('adapter.type')!r}); a base model goes first, adapters in --lora")
    arch = meta("general.architecture")
    if arch not in ("llama", "qwen2", "qwen3"):
        raise QwcError(f"{path}: an adapter for a {arch!r} model; qwc adapts qwen2, qwen3 and llama")
    alpha = meta("adapter.lora.alpha")
    if alpha is None:
        raise QwcError(f"{path}: GGUF adapter lacks adapter.lora.alpha")
    alpha = field_checks.positive_number(path, "adapter.lora.alpha", alpha, allow_zero=True)   # 0: llama.cpp's scale 1
    halves: dict[str, dict[str, np.ndarray]] = {}
    for t in reader.tensors:
        m = _GGUF_KEY.match(t.name)
        if m is None or m["t"] not in _GGUF_LINEARS:
            raise QwcError(f"{path}: tensor {t.name} is not a LoRA pair of a Qwen2 linear")
        try:
            data = np.asarray(dequantize(t.data, t.tensor_type), np.float32)
        except (NotImplementedError, ValueError) as e:
            raise QwcError(f"{path}: cannot read {t.name} ({t.tensor_type.name}: {e})") from None
        data = data.reshape([int(d) for d in reversed(t.shape)])
        halves.setdefault(weight_name(int(m["layer"]), _GGUF_LINEARS[m["t"]]), {})[m["ab"]] = data
    ad = Adapter(str(path), "lora", alpha=float(alpha))
    for name, ab in halves.items():
        if set(ab) != {"a", "b"}:
            raise QwcError(f"{path}: {name} has only lora_{''.join(ab)}")
        a, b = ab["a"], ab["b"]
        if a.ndim != 2 or b.ndim != 2:
            raise QwcError(f"{path}: {name}'s LoRA tensors are not matrices")
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            if b.shape[0] % (2 * heads) == 0:
                b = unpermute_rotary_rows(b, heads)
        r = a.shape[0]
        ad.pairs[name] = LoraPair(a, b, (float(alpha) / r if alpha else 1.0) * user_scale)
    return ad


def check_adapter(ad: Adapter, cfg: ModelConfig) -> None:
    """Shapes against the base, a rank of at least 1, finite values, QA-LoRA's group."""
    if not ad.pairs:
        raise QwcError(f"{ad.path}: the adapter holds no LoRA weights")
    shapes = linear_shapes(cfg)
    if ad.kind == "qalora" and ad.group != QA_GROUP:
        raise QwcError(f"{ad.path}: QA-LoRA groups of {ad.group} inputs; the base's 4-bit blocks are {QA_GROUP} "
                       f"(qalora_group_size must be {QA_GROUP})")
    for name, p in sorted(ad.pairs.items()):
        if name not in shapes:
            layer = name.split(".")[2]
            raise QwcError(f"{ad.path}: adapts layer {layer}, but the base has {cfg.num_hidden_layers} layers "
                           "(an adapter for another model?)")
        out, k = shapes[name]
        r = p.a.shape[0]
        if r < 1:
            raise QwcError(f"{ad.path}: {name} has rank 0")
        cols = k // ad.group if ad.kind == "qalora" else k
        if p.a.shape != (r, cols) or p.b.shape != (out, r):
            what = f"[{r}, {cols}] and [{out}, {r}]"
            raise QwcError(f"{ad.path}: {name}: A {list(p.a.shape)} and B {list(p.b.shape)} do not fit the base's "
                           f"{out} x {k} weight (expected {what}; an adapter for another model?)")
        for ab, t in (("A", p.a), ("B", p.b)):
            if not np.isfinite(t).all():
                raise QwcError(f"{ad.path}: {name}'s lora_{ab} holds NaN or infinity")
        if not math.isfinite(p.scale):
            raise QwcError(f"{ad.path}: {name}'s scale {p.scale} is not finite")
