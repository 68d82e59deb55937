"""The pass pipeline: exported graph -> canonical int4 graph, and the check that the result
holds only what the compiler accepts."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import onnx

from qwc import progress
from qwc.errors import QwcError

from . import (
    act_scale,
    awq,
    canonicalize,
    fold_norm_scales,
    fuse_attention,
    fuse_rmsnorm,
    fuse_rotary,
    gptq,
    quantize_embedding,
    quantize_kquants,
    quantize_linears,
    schemas,
)
from .graph import (
    LARGE_TENSOR_BYTES,
    WeightFile,
    external_location,
    materialize,
    node_label,
    tensor_bytes,
    weights_to,
    widen_half_weights,
)
from .options import PassOptions

PASSES = [
    ("canonicalize", canonicalize.run),
    ("fuse RMSNorm", fuse_rmsnorm.run),
    ("fold RMSNorm scales", fold_norm_scales.run),
    ("fuse rotary", fuse_rotary.run),
    ("fuse attention", fuse_attention.run),
    ("activation-aware scales", awq.run),   # only with --awq; needs the fused float graph
    ("GPTQ", gptq.run),                     # only with --gptq; after AWQ's scales
    ("quantize embedding", quantize_embedding.run),
    ("quantize linears", quantize_linears.run),
    ("quantize linears in a K-quant mix", quantize_kquants.run),   # only with --format q4_k_m
    ("clean up", canonicalize.run),
    ("activation formats", act_scale.run),   # --act-scale row / auto: metadata compile reads
]

# models/stream_export.py marks its graphs so: they hold the fused ops already but are float,
# and still need the quantizing passes.
STREAM_EXPORT_KEY = "qwc.stream_export"

CANONICAL_OPS = {
    ("", "SimplifiedLayerNormalization"), ("com.microsoft", "SkipSimplifiedLayerNormalization"),
    ("com.microsoft", "RotaryEmbedding"), ("com.microsoft", "GroupQueryAttention"),
    ("com.microsoft", "MatMulNBits"), ("com.microsoft", "GatherBlockQuantized"),
}
# Plain ops the canonical graph may keep: elementwise math, the lengths GQA needs, the
# embedding reshape, and float MatMul / Gather / Transpose for linears kept in float.
PLAIN_OPS = {
    "Add", "Sub", "Mul", "Div", "Sigmoid", "Tanh", "Relu", "Neg", "Cast", "Shape", "ReduceSum",
    "Reshape", "Unsqueeze", "Squeeze", "MatMul", "Gather", "Transpose", "Identity", "Concat",
    "Slice",
}
_HINTS = {
    "LayerNormalization": "qwc handles RMSNorm models; LayerNorm is not supported",
    "ReduceMean": "a normalization the passes could not fuse (qwc handles RMSNorm only)",
    "Softmax": "an attention block the passes could not fuse into GroupQueryAttention",
    "Pow": "an unfused normalization",
    "Sqrt": "an unfused normalization",
}


def optimize(model: onnx.ModelProto, options: PassOptions, by_reference: bool = False) -> onnx.ModelProto:
    """The passes, in order, on `model`. `by_reference`: large float tensors the passes left
    (and large tensors kept as they came, such as a GGUF's blocks) stay in their data files
    for the compiler to read there, instead of being copied into the active weight file."""
    options.validate()
    schemas.register()
    calibrated = [flag for flag, ids in (("--awq", options.awq_calibration), ("--gptq", options.gptq_calibration))
                  if ids is not None] + ([f"--format {options.format}"] if options.format != "q4_0" else [])
    if calibrated and any(n.op_type == "MatMulNBits" for n in model.graph.node):
        raise QwcError(f"{' and '.join(calibrated)} work on float weights, and this graph's linears are quantized "
                       "already (a GGUF's weights kept as given); export it with --exporter torch for float weights")
    check_ops_known(model)
    check_float32(model)
    check_input_types(model)
    # Weights held in the message (not lazily on disk) that the passes replace stay allocated
    # until the message is re-parsed; a lazily loaded graph has none worth the copy.
    held = sum(len(t.raw_data) for t in model.graph.initializer)
    for name, fn in PASSES:
        t0 = time.perf_counter()
        model = fn(model, options)
        progress.info(f"[qwc]   {name}: {len(model.graph.node)} nodes ({time.perf_counter() - t0:.1f}s)")
    check_canonical(model)
    # The float tensors a lazily loaded graph still has on disk: read in, or with a weight file
    # active, the large ones copied into it (the output needs no file but its own; a compile
    # reads them where they are).
    materialize(model, max_bytes=LARGE_TENSOR_BYTES if by_reference else None)
    kept = [p for p in model.metadata_props if p.key != STREAM_EXPORT_KEY]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    if held > 2**26 and model.ByteSize() < 2**31 - 2**26:
        # A fresh copy releases the memory of every weight the passes replaced: protobuf
        # frees removed messages only with the message that owned them.
        model = onnx.load_from_string(model.SerializeToString())
    try:
        onnx.checker.check_model(_structure(model))   # the checker serializes what it is given
    except onnx.checker.ValidationError as e:
        raise QwcError(f"the rewritten graph is not valid ONNX ({str(e).strip().splitlines()[0]}); "
                       "is the input an exported Qwen2 graph?") from None
    return model


def _structure(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model without initializer payloads, for the checker: it copies what it is given
    (2 GB at most), and the payloads are numpy's own, with nothing in them to check."""
    m = onnx.ModelProto()     # built field by field: a CopyFrom would copy a 7B's payloads too
    m.ir_version, m.producer_name = model.ir_version, model.producer_name
    m.opset_import.extend(model.opset_import)
    g, sg = model.graph, m.graph
    sg.name = g.name
    for field in ("node", "input", "output", "value_info"):
        getattr(sg, field).extend(getattr(g, field))
    for t in g.initializer:   # as typed inputs: the checker wants an initializer's payload whole
        sg.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    return m


def check_ops_known(model: onnx.ModelProto) -> None:
    """Custom ops we do not implement fail up front, naming the node."""
    ms = {op for d, op in CANONICAL_OPS if d == "com.microsoft"}
    for n in model.graph.node:
        if n.domain in ("", "ai.onnx"):
            continue
        if n.domain == "com.microsoft" and n.op_type in ms:
            continue
        raise QwcError(f"{node_label(n)}: unsupported custom op")


_FLOAT_KINDS = {onnx.TensorProto.FLOAT16: "float16", onnx.TensorProto.BFLOAT16: "bfloat16",
                onnx.TensorProto.DOUBLE: "float64"}


def check_float32(model: onnx.ModelProto) -> None:
    """qwc's passes and kernels are float32 (with int4/int8 weights and float16 or float32 block
    scales): a graph in another float type (e.g. an fp16 export) is refused by name rather than
    failing later inside TVM."""
    g = model.graph
    # Block scales of the quantized ops may be float16 (the kernels read either)
    scales = {n.input[2] for n in g.node if n.op_type in ("MatMulNBits", "GatherBlockQuantized") and len(n.input) > 2}
    tensors = [("initializer", t.name, t.data_type) for t in g.initializer if t.name not in scales]
    tensors += [(kind, v.name, v.type.tensor_type.elem_type)
                for kind, vs in (("input", g.input), ("output", g.output)) for v in vs]
    for n in g.node:
        for a in n.attribute:
            if a.type == onnx.AttributeProto.TENSOR:
                tensors.append(("constant", n.name or n.output[0], a.t.data_type))
        if n.op_type == "Cast":
            to = next((a.i for a in n.attribute if a.name == "to"), None)
            tensors.append(("Cast to", n.name or n.output[0], to))
    for kind, name, dtype in tensors:
        if dtype in _FLOAT_KINDS:
            raise QwcError(f"{kind} {name} is {_FLOAT_KINDS[dtype]}: qwc takes float32 graphs "
                           "(export the model in float32)")


_INT64_INPUTS = ("input_ids", "attention_mask", "position_ids")


def check_input_types(model: onnx.ModelProto) -> None:
    """The runtime feeds token ids, the attention mask and positions as int64: a graph that
    declares another type would be compiled for inputs it never gets."""
    for i in model.graph.input:
        t = i.type.tensor_type.elem_type
        if i.name in _INT64_INPUTS and t != onnx.TensorProto.INT64:
            kind = onnx.TensorProto.DataType.Name(t).lower() if t else "untyped"
            raise QwcError(f"input {i.name} is {kind}: qwc feeds it as int64 (is this an exported Qwen2 graph?)")


def check_canonical(model: onnx.ModelProto) -> None:
    for n in model.graph.node:
        key = (n.domain if n.domain != "ai.onnx" else "", n.op_type)
        if key in CANONICAL_OPS or (key[0] == "" and key[1] in PLAIN_OPS):
            continue
        hint = _HINTS.get(n.op_type, "not part of the canonical graph")
        raise QwcError(f"{node_label(n)}: {hint}")


def op_counts(model: onnx.ModelProto) -> Counter:
    return Counter(n.op_type for n in model.graph.node)


def param_bytes(model: onnx.ModelProto) -> int:
    return sum(tensor_bytes(t) for t in model.graph.initializer)


# --- files -------------------------------------------------------------------------------

EXTERNAL_DATA_THRESHOLD = 1_900_000_000


def load_graph(path, lazy: bool = False) -> onnx.ModelProto:
    """The graph in `path`. `lazy`: external-data initializers stay on disk (their paths made
    absolute) and the passes read each when they need it, so a 7B float graph (30 GB) is never
    in memory at once."""
    from google.protobuf.message import DecodeError

    path = Path(path)
    if not path.is_file():
        raise QwcError(f"{path}: no such file")
    try:
        model = onnx.load(str(path), load_external_data=not lazy)
    except DecodeError:
        raise QwcError(f"{path}: not a valid ONNX model (protobuf decode failed)") from None
    except (OSError, ValueError, onnx.checker.ValidationError) as e:
        raise QwcError(f"{path}: cannot load ONNX model ({str(e).splitlines()[0]})") from None
    if not model.graph.node:
        raise QwcError(f"{path}: the graph has no nodes (an empty or non-ONNX file?)")
    if lazy:
        _resolve_external(model, path)
    widen_half_weights(model)
    return model


def _resolve_external(model: onnx.ModelProto, path) -> None:
    """Point each external initializer at its file by absolute path, checking it is there and
    long enough, so a missing or short data file is one line now, not a failure mid-pass."""
    sizes: dict[str, int] = {}
    for t in model.graph.initializer:
        if t.data_location != onnx.TensorProto.EXTERNAL:
            continue
        info = {e.key: e for e in t.external_data}
        if "location" not in info:
            raise QwcError(f"{path}: initializer {t.name} has external data without a location")
        f = (path.parent / info["location"].value).resolve()
        if str(f) not in sizes:
            if not f.is_file():
                raise QwcError(f"{path}: its external data file {info['location'].value} is missing")
            sizes[str(f)] = f.stat().st_size
        end = int(info["offset"].value if "offset" in info else 0) + tensor_bytes(t)
        if end > sizes[str(f)]:
            raise QwcError(f"{path}: initializer {t.name} lies past the end of {info['location'].value} "
                           "(a truncated data file?)")
        info["location"].value = str(f)


def save_graph(model: onnx.ModelProto, out, config, tokenizer_src) -> None:
    """Write `out` (+ external data when large) and its config / tokenizer sidecars atomically."""
    from qwc.atomic import publish, staging_dir
    from qwc.config import foreign_graph_files

    with staging_dir(Path(out), foreign=foreign_graph_files) as tmp:
        publish(stage_graph(model, Path(out), tmp, config, tokenizer_src), foreign=foreign_graph_files)


def data_file_name(out) -> str:
    return Path(out).name + ".data"


def stage_graph(model: onnx.ModelProto, out, tmp, config, tokenizer_src, weights=None) -> list:
    """Write the graph for `out` into the staging folder `tmp`; returns the (staged, final) moves
    for qwc.atomic.publish. `weights`: the WeightFile (at tmp / data_file_name(out)) the passes wrote
    the large initializers to; they are saved as external data pointing at it."""
    import shutil

    from qwc.config import sidecar_paths

    out = Path(out)
    cfg_path, tok_path = sidecar_paths(out)
    staged, data = tmp / out.name, tmp / data_file_name(out)
    elsewhere = {loc for t in model.graph.initializer if (loc := external_location(t))} - (
        {str(weights.path)} if weights is not None else set())
    if elsewhere:
        raise QwcError(f"internal: initializers still refer to {sorted(elsewhere)[0]}")
    if weights is not None:
        if weights.path != data.resolve():
            raise QwcError("internal: the weight file is not the output's data file")
        _compact(model, weights, tmp)
        for t in model.graph.initializer:
            for e in t.external_data:
                if e.key == "location":
                    e.value = data.name   # relative to the graph, as ONNX wants
        onnx.save(model, str(staged))
        external = any(external_location(t) for t in model.graph.initializer)
    else:
        external = param_bytes(model) > EXTERNAL_DATA_THRESHOLD
        onnx.save(model, str(staged), save_as_external_data=external,
                  location=data.name if external else None)
    config.save(tmp / cfg_path.name)
    moves = [(tmp / cfg_path.name, cfg_path)]
    if tokenizer_src is not None:
        shutil.copyfile(tokenizer_src, tmp / tok_path.name)
        moves.append((tmp / tok_path.name, tok_path))
    if external:
        moves.append((data, out.with_name(data.name)))
    elif data.exists():
        data.unlink()    # nothing was large enough to go there
    return moves + [(staged, out)]


def _compact(model: onnx.ModelProto, weights, tmp) -> None:
    """Rewrite the weight file without the tensors the passes wrote and later dropped (AWQ's
    scaled float copies, say), so the output's data file holds only what its graph reads."""
    import os

    live = [t for t in model.graph.initializer if external_location(t) == str(weights.path)]
    offsets = {int(next(e.value for e in t.external_data if e.key == "offset")) for t in live}
    if offsets == weights.written:
        return
    progress.info(f"[qwc]   dropping {len(weights.written) - len(offsets)} unused tensors from the data file")
    fresh = WeightFile(tmp / (weights.path.name + ".compact"))
    for t in live:
        t.CopyFrom(fresh.copy_in(t))
    fresh.close()
    os.replace(fresh.path, weights.path)
    for t in live:
        for e in t.external_data:
            if e.key == "location":
                e.value = str(weights.path)
    weights.written = {int(next(e.value for e in t.external_data if e.key == "offset")) for t in live}


def passes_memory(model: onnx.ModelProto, weight_file: bool = False) -> int:
    """Estimated peak bytes of `optimize` on `model` as loaded: the weights held in the message
    (twice: the passes' replacements live until the re-parse), the Q4_0 result (4.5 bits for
    every 32 of float) unless a weight file takes it as it is made, and the largest tensor read
    whole with its quantized row chunks; plus the interpreter and onnx."""
    sizes = [tensor_bytes(t) for t in model.graph.initializer] or [0]
    held = sum(len(t.raw_data) for t in model.graph.initializer)
    result = 0 if weight_file else sum(sizes) * 9 // 64
    return 2 * held + result + 3 * max(sizes) // 2 + 2**29


def _lazy(model: onnx.ModelProto) -> bool:
    return any(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer)


def check_passes_memory(model: onnx.ModelProto, memory_check: bool, weight_file: bool = False) -> None:
    from qwc import memory_check as mc

    mc.check("running the passes", passes_memory(model, weight_file),
             "free some memory" if _lazy(model) else
             "export with `qwc export --exporter stream`, whose graph keeps its weights on disk until a pass reads them",
             skip=not memory_check, held=sum(len(t.raw_data) for t in model.graph.initializer))


def optimize_file(src, out, options: PassOptions, verify: bool = False, memory_check: bool = True) -> dict:
    """`qwc optimize`: load, run the pipeline, write, optionally verify the written graph against
    the input with onnxruntime, publish. Returns the numbers the CLI prints.

    A graph whose weights are on disk (external data: any large one) is optimized into the
    output's own data file, each quantized weight written as it is made (passes/graph.py:
    WeightFile), so no stage holds the whole model."""
    import contextlib

    from qwc.atomic import check_destination, publish, staging_dir
    from qwc.config import foreign_graph_files, load_for_graph, tokenizer_for_graph

    from .verify import compare, random_steps

    out = Path(out)
    check_destination(out, foreign=foreign_graph_files)
    config = load_for_graph(src)
    options.config = config
    with progress.stage(f"loading {src}"):
        model = load_graph(src, lazy=True)
    lazy = _lazy(model)
    check_passes_memory(model, memory_check, weight_file=lazy)
    before_ops, before_bytes = op_counts(model), param_bytes(model)
    with staging_dir(out, foreign=foreign_graph_files) as tmp:
        with weights_to(tmp / data_file_name(out)) if lazy else contextlib.nullcontext() as wf:
            with progress.stage("running passes"):
                model = optimize(model, options)
            with progress.stage(f"writing {out}"):
                moves = stage_graph(model, out, tmp, config, tokenizer_for_graph(src), weights=wf)
        report = None
        if verify:
            with progress.stage("verifying against the input graph with onnxruntime"):
                # Both read from their files: no second in-memory copy of a large model.
                report = compare(src, tmp / out.name, config, random_steps(config, batch=1, prompt=8, decode=8))
        publish(moves, foreign=foreign_graph_files)
    return {"before_ops": before_ops, "after_ops": op_counts(model), "before_bytes": before_bytes,
            "after_bytes": param_bytes(model), "report": report}


def load_canonical(src, config, options=None, memory_check: bool = True,
                   by_reference: bool = False) -> onnx.ModelProto:
    """The canonical graph of `src`: checked as it is, or made by running the passes.
    `by_reference`: large initializers may stay in their data files (the compiler reads them
    one at a time as it writes params.bin); the passes then write theirs to the active weight
    file (compiler/compile.py opens one)."""
    from .graph import active_weight_file

    with progress.stage(f"loading {src}"):
        model = load_graph(src, lazy=True)
    check_ops_known(model)
    check_float32(model)
    check_input_types(model)
    streamed = any(p.key == STREAM_EXPORT_KEY for p in model.metadata_props)
    if any(n.op_type == "GroupQueryAttention" for n in model.graph.node) and not streamed:
        check_canonical(model)
        materialize(model, max_bytes=LARGE_TENSOR_BYTES if by_reference else None)
        return model
    check_passes_memory(model, memory_check, weight_file=active_weight_file() is not None)
    with progress.stage("running passes (the graph is not canonical yet)"):
        options = options or PassOptions()
        options.config = config
        return optimize(model, options, by_reference=by_reference)
