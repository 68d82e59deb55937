"""Export in bounded memory: the float ONNX graph written straight from a checkpoint, one
tensor at a time.

torch's exporter needs the whole model in float32 and its constant folding adds a transposed
copy of every linear: about 8 bytes a parameter, 60 GB for a 7B. This writer builds the graph
the passes' fusions make of the exporter's graph (SimplifiedLayerNormalization, RotaryEmbedding,
GroupQueryAttention, MatMul [+ bias Add] per linear, SiLU as Sigmoid·Mul, the tied lm_head as
MatMul(x, Transpose(embedding))), so `qwc optimize` takes it as it takes a fused export, and
writes each weight to the external data file as it is read, transposed to the exporter's [in,
out]. Peak memory is about the largest tensor in float32 plus its source copy (the 152k x 3584
embedding of a 7B: ~3.3 GB).

A GGUF's quantized weights are written as the canonical graph's ops, not as float:
MatMulNBits (and GatherBlockQuantized for the embedding) on the file's own blocks where they
are Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, Q4_K, Q5_K or Q6_K (models/gguf_blocks.py; each node marked
with its format's record, qwc/weight_formats.py; a Q6_K one has 8-bit blocks of 16; a Q5_1 /
Q5_K one adds its block minimums through a small term beside it), or on
`--requant`'s blocks for a type qwc has no kernel for. The passes quantize only what is still float, so these reach the artifact
bit for bit; the graph still runs in onnxruntime.

Node names follow the module paths ("/model/layers/0/self_attn/q_proj/MatMul"), which is how
passes/naming.py names linears, so options like `--keep-float` and the quantized weights'
names are the same as for a torch export.
"""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path
from typing import NamedTuple

import numpy as np
import onnx
from onnx import TensorProto, helper

from qwc import half_floats, progress, weight_formats
from qwc.atomic import publish, staging_dir
from qwc.config import foreign_graph_files, sidecar_paths
from qwc.errors import QwcError
from qwc.rotary import model_rotary_caches
from qwc.weight_file import WeightFile

from . import gguf_blocks
from .checkpoint import Checkpoint, expected_tensors

OPSET = 20
MS_DOMAIN = "com.microsoft"
INLINE_BYTES = 1024    # smaller tensors (the two int64 constants) stay in the graph


class _Quantized(NamedTuple):
    """A GGUF-quantized weight's MatMulNBits inputs by name (zero_points: a float zero points'
    input, or an embedding's block offsets, or ""), how its minimums come back (mins:
    gguf_blocks.block_mins' form, or "offsets"), and a Q5_1 / Q5_K weight's block minimums
    [K/32, N] for the term beside the node (else "")."""
    codes: str
    scales: str
    zero_points: str
    bits: int
    mins: str
    block: int
    minimums: str
    fmt: str


class _Writer:
    """The graph's initializers: each weight appended to its data file as it comes
    (qwc/weight_file.py, recorded by the file's name beside the graph), the two int64
    constants inline."""

    def __init__(self, data_path: Path, location: str):
        self.file = WeightFile(data_path, location=location)
        self.inits: list[TensorProto] = []
        self.bytes = 0

    def add(self, name: str, a: np.ndarray, narrow: str | None = None) -> str:
        """`a` may be a transposed view: it is written in row chunks, never copied whole (a
        7B's lm_head is 2.2 GB in float32). `narrow` ("BF16", "F16"): float32 values that are
        that type's, written in it (qwc/half_floats.py)."""
        if a.nbytes <= INLINE_BYTES:
            if narrow:
                self.inits.append(helper.make_tensor(name, half_floats.KINDS[narrow][0], a.shape,
                                                     half_floats.to_bits(a, narrow).tobytes(), raw=True))
            else:
                self.inits.append(onnx.numpy_helper.from_array(np.ascontiguousarray(a), name))
            return name
        self.inits.append(self.file.add(a, name, narrow=narrow))
        self.bytes += a.size * 2 if narrow else a.nbytes
        return name

    def close(self) -> None:
        self.file.close(sync=True)


class _GraphBuilder:
    """The graph's nodes as they are made, each weight written as its node needs it."""

    def __init__(self, ckpt: Checkpoint, w: _Writer, requant: str):
        self.ckpt, self.cfg, self.w, self.requant = ckpt, ckpt.config, w, requant
        self.nodes: list[onnx.NodeProto] = []
        self.bar = progress.bar(total=len(expected_tensors(self.cfg)), desc="writing weights", unit="tensor")
        self.constants: set[str] = set()
        self.formats = Counter()   # what the quantized weights were written as: (GGUF type, kept or written)

    def node(self, op, inputs, outputs, name, domain="", **attrs) -> str:
        self.nodes.append(helper.make_node(op, inputs, outputs, name=name, domain=domain, **attrs))
        return outputs[0]

    def weight(self, hf: str, transpose: bool = False) -> str:
        """The weight's name in the graph. A matrix the checkpoint holds in bf16 or fp16 is
        written in that type behind a Cast to float32 of that name: the same values in half the
        disk."""
        a = self.ckpt.tensor(hf)
        if transpose:
            a = a.T           # nn.Linear's [out, in] -> MatMul's [in, out], as the exporter folds it
        name = hf if not transpose else hf + ".T"
        if a.ndim == 2 and (narrow := self.ckpt.stored.get(hf)) in half_floats.KINDS:
            stored = self.w.add(f"{name}.{narrow.lower()}", a, narrow=narrow)
            out = self.node("Cast", [stored], [name], f"/{name}/Cast", to=TensorProto.FLOAT)
        else:
            out = self.w.add(name, a)
        del a
        self.bar.update(1)
        return out

    def constant(self, name: str, a: np.ndarray) -> str:
        """A small constant several nodes share, written once."""
        if name not in self.constants:
            self.constants.add(name)
            self.w.add(name, a)
        return name

    def blocks(self, hf: str, embedding: bool = False) -> _Quantized | None:
        """A GGUF-quantized weight as MatMulNBits inputs: kept as it is, or in `requant` where
        qwc has no kernel for its type. None: a float weight, which the passes quantize. An
        embedding with minimums (GatherBlockQuantized has neither float zero points nor
        minimums): untied, a Q4_1 / Q4_K one's zero points become the block offsets c = m + 8 d
        [V, K/32, 1] that the gather's d (q - 8) is added to, and a Q5_1 / Q5_K one's
        minimums are those offsets as they are (the gather gives d (u - 128)); tied, the head's
        MatMulNBits shares its bytes, and it is written in `requant`."""
        kind = self.ckpt.quant_types.get(hf)
        if kind is None:
            return None
        tied = embedding and self.cfg.tie_word_embeddings
        b = self.ckpt.blocks(hf) if not (tied and kind in ("Q4_1", "Q4_K", *gguf_blocks.WITH_MINIMUMS)) else None
        if b is None:
            b = gguf_blocks.requantize(self.ckpt.tensor(hf), self.requant)
        self.formats[kind, b.fmt] += 1
        stem = hf.removesuffix(".weight")
        codes, scales = self.w.add(stem + ".qweight", b.codes), self.w.add(stem + ".scales", b.scales)
        out = _Quantized(codes, scales, *_minimums_inputs(self.w, b, stem, embedding), b.fmt)
        del b
        self.bar.update(1)
        return out

    def matmul_nbits(self, x: str, q: _Quantized, n: int, k: int, out: str, path: str, bias: str | None = None) -> str:
        inputs = [x, q.codes, q.scales] + ([q.zero_points] if q.zero_points or bias else []) + (["", bias] if bias else [])
        y = self.node("MatMulNBits", inputs, [out if not q.minimums else out + ".codes_term"], path + "/MatMulNBits",
                      domain=MS_DOMAIN, K=k, N=n, bits=q.bits, block_size=q.block)
        weight_formats.mark(self.nodes[-1], q.fmt)
        if not q.minimums:
            return y
        # Q5_1 / Q5_K: plus each block's minimum times the block's sum of x (onnxruntime's
        # MatMulNBits takes no float zero points on 8-bit codes); compile time folds these
        # nodes into the kernels' block offsets (compiler/block_minimums.py)
        shape, axis = (self.constant(name, a) for name, a in gguf_blocks.minimums_constants(k).items())
        self.nodes.extend(gguf_blocks.minimums_term(x, y, q.minimums, shape, axis, out, path + "/block_minimums"))
        return out

    def linear(self, x: str, module: str, bias: bool = False) -> str:
        path = "/" + module.replace(".", "/")
        # a Llama file has no q/k/v biases (Checkpoint.zero_biases): no add of zeros, which
        # the few-token GEMMs would run as kernels of their own (3 launches a layer)
        bias = bias and not (self.ckpt.zero_biases and module + ".bias" not in self.ckpt.shapes)
        q = self.blocks(module + ".weight")
        if q is not None:
            n, k = self.ckpt.shapes[module + ".weight"]
            return self.matmul_nbits(x, q, n, k, module + ".out", path, self.weight(module + ".bias") if bias else None)
        y = self.node("MatMul", [x, self.weight(module + ".weight", transpose=True)], [module + ".out"], path + "/MatMul")
        if bias:
            y = self.node("Add", [y, self.weight(module + ".bias")], [module + ".biased"], path + "/Add")
        return y

    def embedding(self) -> tuple[str, str | None, _Quantized | None]:
        """(the hidden states, the float table's name or None, the quantized table or None)."""
        embed_q = self.blocks("model.embed_tokens.weight", embedding=True)
        if embed_q is None:
            embed = self.weight("model.embed_tokens.weight")
            return self.node("Gather", [embed, "input_ids"], ["embedding"], "/model/embed_tokens/Gather", axis=0), \
                embed, None
        # as passes/quantize_embedding.py writes it
        q, node = embed_q, self.node
        scales3 = node("Unsqueeze", [q.scales, self.w.add("axis_two", np.array([2], np.int64))],
                       ["embed_tokens.scales3"], "/model/embed_tokens/Unsqueeze")
        blocks_out = node("GatherBlockQuantized", [q.codes, "input_ids", scales3], ["embedding_blocks"],
                          "/model/embed_tokens/GatherBlockQuantized", domain=MS_DOMAIN, gather_axis=0,
                          quantize_axis=2, block_size=q.block, bits=q.bits)
        weight_formats.mark(self.nodes[-1], q.fmt)   # (compile time keeps an untied Q4_K table compact)
        if q.zero_points:   # an untied Q4_1 / Q4_K table: d (q - 8) + c (Q5_1 / Q5_K: d q + m), a block's c added to its 32
            # (c [V, K/32, 1]: three axes, so that passes/quantize_embedding.py, which takes a
            # float Gather of a [V, H] table for the embedding, leaves this one alone)
            row_offsets = node("Gather", [q.zero_points, "input_ids"], ["embedding_block_offsets"],
                               "/model/embed_tokens/Gather_offsets", axis=0)
            blocks_out = node("Add", [blocks_out, row_offsets], ["embedding_blocks_offset"],
                              "/model/embed_tokens/Add_offsets")
        shape = self.w.add("embedding_shape", np.array([0, 0, self.cfg.hidden_size], np.int64))
        return node("Reshape", [blocks_out, shape], ["embedding"], "/model/embed_tokens/Reshape"), None, embed_q

    def lengths(self) -> tuple[str, str]:
        """GroupQueryAttention's lengths: seqlens_k = sum(mask) - 1, total = mask's width (int32)."""
        node, one = self.node, self.w.add("one", np.array([1], np.int64))
        msum = node("ReduceSum", ["attention_mask", one], ["mask_sum"], "/lengths/ReduceSum", keepdims=0)
        seqlens = node("Cast", [node("Sub", [msum, one], ["seqlens_k_i64"], "/lengths/Sub")], ["seqlens_k"],
                       "/lengths/Cast", to=TensorProto.INT32)
        total = node("Cast", [node("Shape", ["attention_mask"], ["total_seq_len_i64"], "/lengths/Shape", start=1, end=2)],
                     ["total_seq_len"], "/lengths/Cast_1", to=TensorProto.INT32)
        return seqlens, total

    def layer(self, i: int, x: str, rotary: tuple[str, str], lengths: tuple[str, str], residual: str) -> tuple[str, str]:
        """Layer i from its normed input `x`: (the MLP's output, the running sum after attention)."""
        cfg, node, p = self.cfg, self.node, f"model.layers.{i}"
        cos, sin = rotary
        bias = cfg.attention_bias
        q = self.linear(x, f"{p}.self_attn.q_proj", bias=bias)
        k = self.linear(x, f"{p}.self_attn.k_proj", bias=bias)
        v = self.linear(x, f"{p}.self_attn.v_proj", bias=bias)
        pp = "/" + p.replace(".", "/") + "/self_attn"
        if cfg.qk_norm:
            q = self.head_norm(q, f"{p}.self_attn.q_norm", cfg.num_attention_heads)
            k = self.head_norm(k, f"{p}.self_attn.k_norm", cfg.num_key_value_heads)
        k = node("RotaryEmbedding", [k, "position_ids", cos, sin], [f"{p}.k_rot"], pp + "/k_rotary",
                 domain=MS_DOMAIN, interleaved=0, num_heads=cfg.num_key_value_heads)
        q = node("RotaryEmbedding", [q, "position_ids", cos, sin], [f"{p}.q_rot"], pp + "/q_rotary",
                 domain=MS_DOMAIN, interleaved=0, num_heads=cfg.num_attention_heads)
        attn = node("GroupQueryAttention",
                    [q, k, v, f"past_key_values.{i}.key", f"past_key_values.{i}.value", *lengths],
                    [f"{p}.attn", f"present.{i}.key", f"present.{i}.value"], pp + "/GroupQueryAttention",
                    domain=MS_DOMAIN, kv_num_heads=cfg.num_key_value_heads, num_heads=cfg.num_attention_heads)
        o = self.linear(attn, f"{p}.self_attn.o_proj")
        x, residual = _skip_norm(node, residual, o, self.weight(f"{p}.post_attention_layernorm.weight"),
                                 p, "post_attention_layernorm", float(cfg.rms_norm_eps))
        mlp = f"/{p.replace('.', '/')}/mlp"
        gate = self.linear(x, f"{p}.mlp.gate_proj")
        silu = node("Mul", [gate, node("Sigmoid", [gate], [f"{p}.gate_sigmoid"], mlp + "/Sigmoid")],
                    [f"{p}.silu"], mlp + "/Mul")
        up = self.linear(x, f"{p}.mlp.up_proj")
        act = node("Mul", [silu, up], [f"{p}.act"], mlp + "/Mul_1")
        return self.linear(act, f"{p}.mlp.down_proj"), residual

    def head_norm(self, x: str, module: str, heads: int) -> str:
        """Qwen3's QK-norm: an RMSNorm over each head of x [B, S, heads x head_dim], as
        Reshape -> SimplifiedLayerNormalization -> Reshape (the form passes/fuse_rmsnorm.py
        makes of the torch exporter's graph)."""
        node, path = self.node, "/" + module.replace(".", "/")
        per_head = self.constant(f"heads_shape_{heads}", np.array([0, 0, heads, self.cfg.head_dim], np.int64))
        flat = self.constant(f"flat_shape_{heads}", np.array([0, 0, heads * self.cfg.head_dim], np.int64))
        y = node("Reshape", [x, per_head], [module + ".heads"], path + "/Reshape")
        y = node("SimplifiedLayerNormalization", [y, self.weight(module + ".weight")], [module + ".out"],
                 path + "/SimplifiedLayerNormalization", axis=-1, epsilon=float(self.cfg.rms_norm_eps), stash_type=1)
        return node("Reshape", [y, flat], [module + ".flat"], path + "/Reshape_1")

    def lm_head(self, x: str, embed: str | None, embed_q: _Quantized | None) -> None:
        cfg, node = self.cfg, self.node
        if cfg.tie_word_embeddings and embed_q is not None:
            self.matmul_nbits(x, embed_q, cfg.vocab_size, cfg.hidden_size, "logits", "/lm_head")
        elif not cfg.tie_word_embeddings and (head_q := self.blocks("lm_head.weight")) is not None:
            self.matmul_nbits(x, head_q, cfg.vocab_size, cfg.hidden_size, "logits", "/lm_head")
        elif cfg.tie_word_embeddings:
            head = node("Transpose", [embed], ["lm_head.weight.T"], "/lm_head/Transpose", perm=[1, 0])
            node("MatMul", [x, head], ["logits"], "/lm_head/MatMul")
        else:
            node("MatMul", [x, self.weight("lm_head.weight", transpose=True)], ["logits"], "/lm_head/MatMul")

    def report(self) -> None:
        if self.formats:
            said = ", ".join(f"{c} {a}" + (f" -> {b}" if a != b else _EXACT_AS.get(a, ""))
                             for (a, b), c in sorted(self.formats.items()))
            progress.info(f"[qwc] quantized weights as the file gives them: {said}"
                          + ("" if all(a == b for a, b in self.formats) else f" (--requant {self.requant})"))

    def model(self) -> onnx.ModelProto:
        cfg, kv, hd = self.cfg, self.cfg.num_key_value_heads, self.cfg.head_dim
        f32, i64 = TensorProto.FLOAT, TensorProto.INT64
        inputs = [helper.make_tensor_value_info("input_ids", i64, ["batch", "seq"]),
                  helper.make_tensor_value_info("attention_mask", i64, ["batch", "total"]),
                  helper.make_tensor_value_info("position_ids", i64, ["batch", "seq"])]
        outputs = [helper.make_tensor_value_info("logits", f32, ["batch", "seq", cfg.vocab_size])]
        for i in range(cfg.num_hidden_layers):
            for kind in ("key", "value"):
                inputs.append(helper.make_tensor_value_info(f"past_key_values.{i}.{kind}", f32,
                                                            ["batch", kv, "cache_len", hd]))
                outputs.append(helper.make_tensor_value_info(f"present.{i}.{kind}", f32,
                                                             ["batch", kv, "present_len", hd]))
        graph = helper.make_graph(self.nodes, "qwen2", inputs, outputs, initializer=self.w.inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(MS_DOMAIN, 1)],
                                  producer_name="qwc", ir_version=10)
        # passes/pipeline.py: STREAM_EXPORT_KEY (models/ does not import passes/)
        helper.set_model_props(model, {"qwc.stream_export": "1"})
        return model


def build(ckpt: Checkpoint, w: _Writer, requant: str = "q8_0") -> onnx.ModelProto:
    """The whole graph, in the order the torch exporter's fused graph has it."""
    g, cfg = _GraphBuilder(ckpt, w, requant), ckpt.config
    hidden, embed, embed_q = g.embedding()
    cos, sin = model_rotary_caches(cfg)
    rotary = (w.add("rotary_cos_cache", cos), w.add("rotary_sin_cache", sin))
    lengths = g.lengths()
    eps = float(cfg.rms_norm_eps)
    residual, branch = None, None   # the running sum (None before the first layer); the last sublayer's output
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        gain = g.weight(f"{p}.input_layernorm.weight")
        if residual is None:
            x = g.node("SimplifiedLayerNormalization", [hidden, gain], [f"{p}.in_norm"],
                       f"/{p.replace('.', '/')}/input_layernorm", axis=-1, epsilon=eps, stash_type=1)
            residual = hidden
        else:
            x, residual = _skip_norm(g.node, residual, branch, gain, p, "input_layernorm", eps)
        branch, residual = g.layer(i, x, rotary, lengths, residual)
    x, _ = _skip_norm(g.node, residual, branch, g.weight("model.norm.weight"), "model", "norm", eps)
    g.lm_head(x, embed, embed_q)
    g.bar.close()
    g.report()
    return g.model()


def _minimums_inputs(w: _Writer, b: gguf_blocks.Blocks, stem: str, embedding: bool) -> tuple[str, int, str, int, str]:
    """_Quantized's (zero_points, bits, mins, block, minimums) for blocks `b`, their tensors
    written: an embedding's block offsets (Q4_1 / Q4_K: c = m + 8 d; Q5_1 / Q5_K: m itself),
    a linear's float zero points, or a Q5_1 / Q5_K linear's minimums [K/32, N] for its term."""
    zp, mins, minimums = "", b.mins, ""
    if embedding and b.zero_points is not None:   # the gather's block offsets c = m + 8 d
        c = gguf_blocks.block_mins(b.scales, b.zero_points, b.mins).astype(np.float64) + 8 * b.scales.astype(np.float64)
        zp, mins = w.add(stem + ".block_offsets", c.astype(np.float32)[..., None]), "offsets"
    elif embedding and b.minimums is not None:
        zp, mins = w.add(stem + ".block_offsets", b.minimums[..., None]), "offsets"
    elif b.zero_points is not None:
        zp = w.add(stem + ".zero_points", b.zero_points)
    elif b.minimums is not None:   # the term's MatMul weight (a view: written in row chunks)
        minimums = w.add(stem + ".block_minimums.T", b.minimums.T)
    return zp, b.bits, mins, b.block, minimums


# How the export's summary line names a type kept in a form other than its own blocks
_EXACT_AS = {"Q5_0": " (exact, as 8-bit codes)", "Q5_1": " (exact, as 8-bit codes and block minimums)",
             "Q5_K": " (exact, as 8-bit codes and block minimums)", "Q6_K": " (exact, 8-bit blocks of 16)",
             "IQ4_NL": " (exact, as 8-bit codes)", "IQ4_XS": " (exact, as 8-bit codes)"}


def _skip_norm(node, residual: str, branch: str, gain: str, prefix: str, which: str, eps: float):
    """SkipSimplifiedLayerNormalization: (normalized residual + branch, the sum)."""
    y, s = f"{prefix}.{which}.out", f"{prefix}.{which}.sum"
    node("SkipSimplifiedLayerNormalization", [residual, branch, gain], [y, "", "", s],
         f"/{prefix.replace('.', '/')}/{which}", domain=MS_DOMAIN, epsilon=eps)
    return y, s


def stream_memory(ckpt: Checkpoint) -> int:
    """Estimated peak bytes of export_streaming: the largest tensor as read (bf16, 2 bytes an
    element, at most) and in float32 (transposed tensors are written in chunks, not copied);
    torch, the graph and the interpreter."""
    largest = max(int(np.prod(s)) for s in expected_tensors(ckpt.config).values())
    return 6 * largest + 2**30


def stream_disk(ckpt: Checkpoint, requant: str = "q8_0") -> int:
    """Estimated bytes of the graph's weight file: float32 for a float tensor (2 bytes for a
    matrix the checkpoint holds in bf16 or fp16), a kept GGUF type's own block bytes, `requant`'s for
    another quantized one. A lower bound, so that a disk it refuses could not have held the
    graph."""
    requant_bytes = gguf_blocks.KEPT[requant.upper()]
    total = 0
    for name, shape in expected_tensors(ckpt.config).items():
        n, kind = int(np.prod(shape)), ckpt.quant_types.get(name)
        if kind is None:
            total += (2 if len(shape) == 2 and ckpt.stored.get(name) in half_floats.KINDS else 4) * n
        else:
            block, nbytes = gguf_blocks.KEPT.get(kind, requant_bytes)
            total += n // block * nbytes
    return total


def _check_disk(ckpt: Checkpoint, out: Path, requant: str) -> None:
    """Refuse up front, in one line, a graph the disk cannot hold: a 32B's float graph is
    131 GB, and running out hours in would waste the export."""
    need, free = stream_disk(ckpt, requant), shutil.disk_usage(out.resolve().parent).free
    if need > free:
        raise QwcError(f"cannot write {out}: its weights need about {need / 2**30:.1f} GiB of disk, "
                       f"{free / 2**30:.1f} GiB is free there")


def export_streaming(ckpt: Checkpoint, out: Path, requant: str = "q8_0") -> Path:
    """Write `out`, `out.data`, `<stem>.config.json`, `<stem>.tokenizer.json` (atomically, as
    models/export.py does), reading the checkpoint one tensor at a time."""
    out = Path(out)
    if out.suffix != ".onnx":
        raise QwcError(f"output {out} must end in .onnx")
    ckpt.check()
    _check_disk(ckpt, out, requant)
    cfg_path, tok_path = sidecar_paths(out)
    data_name = out.name + ".data"
    with staging_dir(out, foreign=foreign_graph_files) as tmp:
        w = _Writer(tmp / data_name, data_name)
        try:
            model = build(ckpt, w, requant)
        finally:
            w.close()
        staged = tmp / out.name
        with progress.stage(f"writing {out.name} ({w.bytes / 2**20:.0f} MiB of weights in {data_name})"):
            onnx.save(model, str(staged))
        (tmp / cfg_path.name).write_text(ckpt.config.to_json() + "\n")
        ckpt.tokenizer.save(str(tmp / tok_path.name))
        publish([(tmp / cfg_path.name, cfg_path), (tmp / tok_path.name, tok_path),
                 (tmp / data_name, out.with_name(data_name)), (staged, out)], foreign=foreign_graph_files)
    return out
