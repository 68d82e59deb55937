"""A small mutable view over an onnx.GraphProto: producers, consumers, constants, names.

Passes match patterns by walking producers/consumers and edit the node list directly; they
call `Graph.commit()` at the end, which drops dead nodes and initializers and re-sorts the
nodes topologically, so a pass may append replacement nodes anywhere.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
from collections import defaultdict
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from qwc import half_floats
from qwc.errors import QwcError
from qwc.weight_file import WeightFile, external_location

MS_DOMAIN = "com.microsoft"


def tensor_array(t: onnx.TensorProto) -> np.ndarray:
    """An initializer's value, read from its external file now if it has one (see
    passes/pipeline.py: load_graph(lazy=True), which makes the file paths absolute)."""
    if t.data_location != onnx.TensorProto.EXTERNAL:
        return numpy_helper.to_array(t)
    info = {e.key: e.value for e in t.external_data}
    count = int(np.prod(t.dims, dtype=np.int64))
    with open(info["location"], "rb") as f:
        f.seek(int(info.get("offset", 0)))
        if kind := half_floats.stored_as(t):
            a = half_floats.read_widened(f, count, kind)
        else:
            a = np.fromfile(f, dtype=helper.tensor_dtype_to_np_dtype(t.data_type), count=count)
    if a.size != count:
        raise QwcError(f"initializer {t.name}: its external data file {info['location']} is truncated")
    return a.reshape(tuple(t.dims))


def tensor_view(t: onnx.TensorProto) -> np.ndarray:
    """An initializer's value without reading it all: a read-only memory map of its external
    data (pages are read as they are touched), or the in-memory array."""
    if t.data_location != onnx.TensorProto.EXTERNAL:
        return numpy_helper.to_array(t)
    info = {e.key: e.value for e in t.external_data}
    if kind := half_floats.stored_as(t):
        return half_floats.WidenedView(np.memmap(info["location"], dtype=np.uint16, mode="r",
                                                 offset=int(info.get("offset", 0)), shape=tuple(t.dims)), kind)
    return np.memmap(info["location"], dtype=helper.tensor_dtype_to_np_dtype(t.data_type), mode="r",
                     offset=int(info.get("offset", 0)), shape=tuple(t.dims))


def tensor_bytes(t: onnx.TensorProto) -> int:
    """An initializer's payload size as it is read (float32 for one stored narrow), without
    reading external data."""
    if t.data_location == onnx.TensorProto.EXTERNAL:
        return int(np.prod(t.dims, dtype=np.int64)) * helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
    return len(t.raw_data) if t.raw_data else numpy_helper.to_array(t).nbytes


# Initializers at least this big are weights: the passes write them to the active weight file
# (below) instead of into the message, and the compiler passes them to TVM by reference.
LARGE_TENSOR_BYTES = 1 << 16
_weights: contextvars.ContextVar[WeightFile | None] = contextvars.ContextVar("qwc_weight_file", default=None)


@contextlib.contextmanager
def weights_to(path: Path):
    """While active, new large initializers (`new_tensor`) go to a WeightFile at `path`."""
    wf = WeightFile(path)
    token = _weights.set(wf)
    try:
        yield wf
    finally:
        _weights.reset(token)
        wf.close()


def active_weight_file() -> WeightFile | None:
    return _weights.get()


def weight_file_offset(t) -> int | None:
    """Where in the active weight file tensor `t` lies (None: elsewhere, or not a TensorProto)."""
    wf = _weights.get()
    if wf is None or not isinstance(t, onnx.TensorProto) or external_location(t) != str(wf.path):
        return None
    return int(next(e.value for e in t.external_data if e.key == "offset"))


def release_unused_weights(model: onnx.ModelProto) -> int:
    """Release (WeightFile.release) every tensor of the active weight file that no initializer
    of `model` refers to: those the passes and rewrites made and then replaced. Returns the
    bytes released."""
    wf = _weights.get()
    if wf is None:
        return 0
    used = {weight_file_offset(t) for t in model.graph.initializer}
    return wf.release(wf.held() - used)


def new_tensor(array: np.ndarray, name: str) -> onnx.TensorProto:
    """An initializer holding `array`: in the active weight file if large, else in the message."""
    wf = _weights.get()
    if wf is not None and array.nbytes >= LARGE_TENSOR_BYTES:
        return wf.add(array, name)
    return numpy_helper.from_array(np.ascontiguousarray(array), name)


def materialize(model: onnx.ModelProto, max_bytes: int | None = None) -> None:
    """Read still-external initializers into the graph (the few float tensors the passes left:
    norm gains, biases, rotary tables), so the model saves and checks like any other.
    `max_bytes`: only those smaller than that (the compiler reads the rest by reference).
    With a weight file active, large ones from other files are copied into it instead."""
    wf = _weights.get()
    for t in model.graph.initializer:
        loc = external_location(t)
        if loc is None or (wf is not None and loc == str(wf.path)):
            continue
        if max_bytes is not None and tensor_bytes(t) >= max_bytes:
            continue
        if wf is not None and tensor_bytes(t) >= LARGE_TENSOR_BYTES:
            t.CopyFrom(wf.copy_in(t))
            continue
        a = tensor_array(t)
        t.raw_data = a.tobytes()
        t.data_location = onnx.TensorProto.DEFAULT
        del t.external_data[:]


def widen_half_weights(model: onnx.ModelProto) -> int:
    """Each Cast to float32 of a bf16 or fp16 initializer (a narrow checkpoint's matrices as the
    streamed export writes them, qwc/half_floats.py) made a float32 initializer of the Cast's
    output name: the graph the passes see is the float32 export's. An external one keeps its
    narrow bytes on disk, marked, and is widened as it is read; one in the message is widened
    now. Returns how many."""
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    uses: dict[str, int] = defaultdict(int)
    for n in g.node:
        for i in n.input:
            uses[i] += 1
    outputs = {o.name for o in g.output}
    casts = {}
    for n in g.node:
        t = inits.get(n.input[0]) if n.op_type == "Cast" and n.domain in ("", "ai.onnx") and n.input else None
        if (t is not None and half_floats.kind_of_type(t.data_type) and uses[t.name] == 1
                and n.output[0] not in outputs
                and any(a.name == "to" and a.i == onnx.TensorProto.FLOAT for a in n.attribute)):
            casts[t.name] = n
    if not casts:
        return 0
    for t in g.initializer:
        if t.name not in casts:
            continue
        t.name = casts[t.name].output[0]
        if t.data_location == onnx.TensorProto.EXTERNAL:
            half_floats.mark(t)
        else:
            a = half_floats.widen(half_floats.inline_bits(t), half_floats.kind_of_type(t.data_type))
            t.ClearField("int32_data")
            t.data_type, t.raw_data = onnx.TensorProto.FLOAT, a.tobytes()
    widened = {n.output[0] for n in casts.values()}
    kept = [n for n in g.node if not (n.op_type == "Cast" and n.output[0] in widened)]
    del g.node[:]
    g.node.extend(kept)
    return len(casts)


class Graph:
    def __init__(self, model: onnx.ModelProto):
        self.model = model
        self.g = model.graph
        self._counter = itertools.count()
        self.reindex()

    # -- indexes --------------------------------------------------------------------------
    def reindex(self) -> None:
        self.producer: dict[str, onnx.NodeProto] = {}
        self.consumers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
        for n in self.g.node:
            self._index(n)
        self.inits = {t.name: t for t in self.g.initializer}
        self.graph_inputs = {i.name for i in self.g.input}
        self.graph_outputs = {o.name for o in self.g.output}
        # Types and shapes known from shape inference (value_info wins over the graph's I/O).
        self.value_infos = {v.name: v for v in list(self.g.output) + list(self.g.input) + list(self.g.value_info)}
        self._names = {n.name for n in self.g.node} | set(self.producer) | set(self.inits) | self.graph_inputs

    def fresh(self, base: str) -> str:
        while True:
            name = f"{base}_{next(self._counter)}"
            if name not in self._names:
                self._names.add(name)
                return name

    # -- constants ------------------------------------------------------------------------
    def const(self, name: str) -> np.ndarray | None:
        """The value of an initializer or Constant-node output, else None."""
        if name in self.inits:
            return tensor_array(self.inits[name])
        n = self.producer.get(name)
        if n is not None and n.op_type == "Constant" and n.domain in ("", "ai.onnx"):
            for a in n.attribute:
                if a.name == "value":
                    return numpy_helper.to_array(a.t)
                if a.name == "value_float":
                    return np.array(a.f, np.float32)
                if a.name == "value_floats":
                    return np.array(a.floats, np.float32)
                if a.name == "value_int":
                    return np.array(a.i, np.int64)
                if a.name == "value_ints":
                    return np.array(a.ints, np.int64)
        return None

    def scalar(self, name: str) -> float | None:
        v = self.const(name)
        if v is None or v.size != 1:
            return None
        return float(v.reshape(()))

    def elem_type(self, name: str) -> int | None:
        if name in self.inits:
            return self.inits[name].data_type
        vi = self.value_infos.get(name)
        return (vi.type.tensor_type.elem_type or None) if vi is not None else None

    def static_dims(self, name: str) -> list[int | None] | None:
        """Known dimensions of `name` (None for a symbolic one), or None if its shape is unknown."""
        vi = self.value_infos.get(name)
        if vi is not None:
            if not vi.type.tensor_type.HasField("shape"):
                return None
            return [d.dim_value if d.HasField("dim_value") else None for d in vi.type.tensor_type.shape.dim]
        if name in self.inits:
            return list(self.inits[name].dims)
        return None

    def add_init(self, array: np.ndarray, base: str) -> str:
        name = self.fresh(base)
        self.g.initializer.append(new_tensor(np.asarray(array), name))
        t = self.g.initializer[-1]
        self.inits[name] = t
        return name

    # -- structure ------------------------------------------------------------------------
    def node(self, op_type: str, inputs, outputs, name: str | None = None, domain: str = "", **attrs):
        n = helper.make_node(op_type, list(inputs), list(outputs),
                             name=name or self.fresh(op_type), domain=domain, **attrs)
        self.g.node.append(n)
        n = self.g.node[-1]  # the graph holds a copy: index and return that one
        self._index(n)
        return n

    def add_node(self, n: onnx.NodeProto) -> onnx.NodeProto:
        """Append a node made elsewhere (indexed as node() indexes its own)."""
        self.g.node.append(n)
        n = self.g.node[-1]
        self._index(n)
        return n

    def _index(self, n: onnx.NodeProto) -> None:
        for o in n.output:
            if o:
                self.producer[o] = n
        for i in n.input:
            if i:
                self.consumers[i].append(n)

    def only_consumer(self, name: str) -> onnx.NodeProto | None:
        c = self.consumers.get(name, [])
        if len(c) == 1 and name not in self.graph_outputs:
            return c[0]
        return None

    def rename_uses(self, old: str, new: str, skip: set[int] = frozenset()) -> None:
        """Make every consumer of `old` (except nodes whose id() is in `skip`) read `new`.
        Graph outputs keep their names: a pass that replaces one removes its producer and
        names the new producer's output after it."""
        if old in self.graph_outputs:
            raise QwcError(f"internal: cannot rename uses of graph output {old}")
        for n in list(self.consumers.get(old, [])):
            if id(n) in skip:
                continue
            for k, i in enumerate(n.input):
                if i == old:
                    n.input[k] = new
            self.consumers[new].append(n)
        self.consumers[old] = [n for n in self.consumers.get(old, []) if id(n) in skip]

    def remove_node(self, n: onnx.NodeProto) -> None:
        """Remove `n` now (needed when a replacement must produce one of its output names)."""
        for k, m in enumerate(self.g.node):
            if list(m.output) == list(n.output) and m.op_type == n.op_type:
                del self.g.node[k]
                break
        for o in n.output:
            if self.producer.get(o) is n:
                del self.producer[o]
        for i in n.input:
            self.consumers[i] = [c for c in self.consumers.get(i, []) if c is not n]

    def attr(self, node: onnx.NodeProto, name: str, default=None):
        for a in node.attribute:
            if a.name == name:
                return helper.get_attribute_value(a)
        return default

    # -- clean-up -------------------------------------------------------------------------
    def commit(self) -> None:
        """Drop nodes and initializers nothing needs, sort nodes topologically, reindex."""
        nodes = list(self.g.node)
        prod = {o: n for n in nodes for o in n.output if o}
        live: set[str] = set()
        kept: set[int] = set()
        work = list(self.graph_outputs)
        while work:  # order-independent: passes append replacement nodes at the end
            name = work.pop()
            if name in live:
                continue
            live.add(name)
            n = prod.get(name)
            if n is not None and id(n) not in kept:
                kept.add(id(n))
                work.extend(i for i in n.input if i)
        # Delete dead initializers in place: rebuilding the list would copy every weight
        # (protobuf keeps removed messages' memory until the model itself is freed).
        for k in range(len(self.g.initializer) - 1, -1, -1):
            if self.g.initializer[k].name not in live:
                del self.g.initializer[k]
        self.inits = {t.name: t for t in self.g.initializer}
        self._toposort([n for n in nodes if id(n) in kept])
        # Drop value_info of tensors that no longer exist; shape inference refills it.
        names = live | {o for n in self.g.node for o in n.output}
        vi = [v for v in self.g.value_info if v.name in names]
        del self.g.value_info[:]
        self.g.value_info.extend(vi)
        self.reindex()

    def _toposort(self, nodes: list[onnx.NodeProto]) -> None:
        available = set(self.inits) | self.graph_inputs | {""}
        prod = {o: n for n in nodes for o in n.output}
        order, placed, visiting = [], set(), set()

        def visit(n):
            if id(n) in placed:
                return
            if id(n) in visiting:
                raise QwcError(f"graph has a cycle through node {n.name} ({n.op_type})")
            visiting.add(id(n))
            for i in n.input:
                if i in available or i not in prod:
                    continue
                visit(prod[i])
            visiting.discard(id(n))
            placed.add(id(n))
            order.append(n)

        for n in nodes:
            visit(n)
        for n in order:
            for i in n.input:
                if i and i not in available and i not in prod:
                    raise QwcError(f"node {n.name} ({n.op_type}) reads {i!r}, which nothing produces "
                                   "(a missing initializer?)")
        del self.g.node[:]
        self.g.node.extend(order)


def ensure_ms_opset(model: onnx.ModelProto) -> None:
    if not any(o.domain == MS_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))


def node_label(n: onnx.NodeProto) -> str:
    """A readable name for error messages: the node name and op."""
    return f"node {n.name or '<unnamed>'} ({n.domain + '::' if n.domain else ''}{n.op_type})"


# compiler/repack.py marks a Q4_1 MatMulNBits whose zero points it replaced by block offsets
# (m + 8 d: the weights are then Q4_0's d (q - 8) plus that a block), an input the Q4_0 kernels
# and one small term take.
BLOCK_OFFSETS_ATTR = "qwc_block_offsets"
# ... and a Q8_0 one it split into two Q4_0 halves (repack.q8_0_nibble_halves).
NIBBLE_HALVES_ATTR = "qwc_nibble_halves"
# ... and a Q6_K one repacked for its own kernel (compiler/repack_q6_k.py): inputs (x, codes,
# sub-block scales sc, "", "", bias or "", super-block scales d).
Q6_K_ATTR = "qwc_q6_k"
# ... and a Q4_K one whose codes, scales and block offsets it wrote in the W4A8 kernels' compact
# Q4_K form (compiler/repack_q4_k.py; also marked BLOCK_OFFSETS_ATTR): inputs (x, codes in row
# groups, sc and mn [G, NB, 32] uint8, d and dmin [G, NB/8, 32] float16, ...).
Q4_K_SCALES_ATTR = "qwc_q4_k_scales"
# ... and a Q5_0 / Q5_1 / Q5_K one whose codes it stored at five bits (compiler/repack_five_bit.py;
# also marked BLOCK_OFFSETS_ATTR): inputs (x, codes [G, NB, 5, 64], scales, block offsets, ...).
FIVE_BIT_ATTR = "qwc_five_bit"
# ... and an IQ4_NL / IQ4_XS one whose codes it stored as 4-bit indices into the book, in the
# row groups Q4_0's nibbles take (compiler/repack_iq4.py): inputs (x, indices [G, NB, 4, 64], scales, ...).
IQ4_ATTR = "qwc_iq4"
# ... and a Q4_0 / Q8_0 one whose prefill takes activations with a scale and zero point a token
# (compiler/row_activations.py): input 6 is then each weight row's sum of its values [N].
ROW_ACTIVATIONS_ATTR = "qwc_row_activations"
# Graph metadata: the linears (by weight name, comma-separated) `qwc optimize --act-scale`
# chose per-token activations for (passes/act_scale.py); compile marks them where the target
# has the kernel.
ROW_ACTIVATIONS_KEY = "qwc.row_activation_linears"
# ... and the op it puts in a float MatMul's place, its weight in blocks of columns: (a [..., K],
# w [N / cols, K, cols]) -> [..., N] (repack.float_column_blocks, kernels/f32_matmul.py).
COLUMN_BLOCKS_OP = "QwcMatMulColumnBlocks"
# Graph metadata: the passes that scaled some linear's input channels (the weights' rows
# scaled back), comma-separated (passes/awq.py, fold_norm_scales.py). A LoRA adapter's A reads
# the checkpoint's input, so adapters served unmerged need it unscaled (compiler/lora_slots.py).
RESCALED_INPUTS_KEY = "qwc.rescaled_linear_inputs"


def mark_rescaled_inputs(model, by: str) -> None:
    """Record in `model`'s metadata that the pass `by` scaled linear inputs."""
    props = {p.key: p for p in model.metadata_props}
    if RESCALED_INPUTS_KEY in props:
        have = props[RESCALED_INPUTS_KEY].value.split(",")
        if by not in have:
            props[RESCALED_INPUTS_KEY].value = ",".join(have + [by])
        return
    p = model.metadata_props.add()
    p.key, p.value = RESCALED_INPUTS_KEY, by


def has_block_offsets(n: onnx.NodeProto) -> bool:
    return any(a.name == BLOCK_OFFSETS_ATTR and a.i for a in n.attribute)


def has_zero_points(n: onnx.NodeProto) -> bool:
    """A MatMulNBits with explicit zero points (float ones: llama.cpp's Q4_1, models/gguf_blocks.py)
    that compile-time repacking has not turned into block offsets."""
    return len(n.input) > 3 and bool(n.input[3]) and not has_block_offsets(n)


def matmul_nbits_dims(n: onnx.NodeProto) -> tuple[int, int, int, int]:
    """A MatMulNBits node's (K, N, block_size, bits), as onnxruntime defines them."""
    a = {x.name: helper.get_attribute_value(x) for x in n.attribute}
    try:
        return int(a["K"]), int(a["N"]), int(a["block_size"]), int(a.get("bits", 4))
    except KeyError as e:
        raise QwcError(f"{node_label(n)} lacks its {e.args[0]} attribute") from None
