"""The weight formats qwc keeps, one record each: the one place a format is described.

A format is llama.cpp's (ggml's `type_traits`, ggml-quants.c): its GGUF type id, how many
weights a block (a super-block for the K-quants) holds and in how many bytes. The canonical
graph holds every one as onnxruntime's MatMulNBits, so that the graph still runs there
(models/gguf_blocks.py says how, bit for bit): codes of `graph_bits` in blocks of `graph_block`,
each block's offset from zero either implied (Q4_0's 8, 8-bit codes' 128), float zero points
(Q4_1, Q4_K; `mins` says how their minimum comes back) or minimums added beside the node
(Q5_1, Q5_K). A node says which record it is in one marker (MARKER, node metadata: onnxruntime
ignores metadata it does not know), written by every writer of a quantized linear
(models/stream_export.py, passes/quantize_linears.py).

What a format takes at compile time is the record's `rewrites` (the weights phase of
compiler/pipeline.py runs each on the linears whose format names it), its kernels per ISA are
found through the kernel registry (compiler/kernels/registry.py), and where ARM keeps it at rest
in a form other than the kernels' it is `at_rest` (compiler/pack_at_rest.py). This module
imports nothing but numpy-free Python, so the runtime, the exporter and the passes read it alike.
"""

from __future__ import annotations

from dataclasses import dataclass

MARKER = "qwc.weight_format"   # node metadata: the record's name


@dataclass(frozen=True)
class WeightFormat:
    name: str                 # llama.cpp's type name ("Q4_K")
    gguf_type: int            # its GGMLQuantizationType id
    block: int                # weights a block in the file (a super-block's for the K-quants)
    block_bytes: int          # its bytes in the file
    graph_bits: int           # MatMulNBits' bits in the canonical graph
    graph_block: int          # MatMulNBits' block_size (a sub-block's weights)
    offsets: str              # a block's offset: "none" (implied), "zero_points" or "minimums"
    code_span: int            # distinct codes a weight takes (16, 32, 64, 256)
    rewrites: tuple[str, ...] = ()   # the weights phase's rewrites for it (compiler/pipeline.py)
    # the int8 activations its integer-dot kernels take; ARM's compact Q4_K GEMV takes them scaled
    # by super-blocks ("q8_k": compiler/kernels/act_quant.py), which the target, not the format, decides
    activations: str = "q8_0"
    at_rest: str | None = None      # ARM's stored form where it differs from the kernels'
    quantizer: str | None = None    # qwc.kquants' function making it from float (`--format` mixes)
    fallback: str | None = None     # what llama-quantize writes for a row not of whole super-blocks
    mins: str = "fp16"              # zero points: how a minimum comes back (gguf_blocks.block_mins)
    code_book: tuple[int, ...] | None = None   # the int8 values 4-bit indices stand for (IQ4), or None

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.block_bytes / self.block

    @property
    def super_block(self) -> bool:
        return self.block > 32


# llama.cpp's IQ4 code book (kvalues_iq4nl): a 4-bit index stands for one of these int8 values
IQ4_BOOK = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
# The rewrites every integer-dot linear takes last: its codes and scales into the row groups
# its kernels read (compiler/repack.py)
_ROW_GROUPS = ("repack_weights",)

FORMATS: dict[str, WeightFormat] = {f.name: f for f in (
    WeightFormat("Q4_0", 2, 32, 18, 4, 32, "none", 16, ("row_activations", *_ROW_GROUPS)),
    WeightFormat("Q4_1", 3, 32, 20, 4, 32, "zero_points", 16, ("q4_1_block_offsets", *_ROW_GROUPS)),
    WeightFormat("Q5_0", 6, 32, 22, 8, 32, "none", 32, ("q8_0_nibble_halves", "five_bit_codes", *_ROW_GROUPS),
                 quantizer="quantize_q5_0"),
    WeightFormat("Q5_1", 7, 32, 24, 8, 32, "minimums", 32,
                 ("block_minimums", "q8_0_nibble_halves", "five_bit_codes", *_ROW_GROUPS), quantizer="quantize_q5_1"),
    WeightFormat("Q8_0", 8, 32, 34, 8, 32, "none", 256, ("row_activations", "q8_0_nibble_halves", *_ROW_GROUPS)),
    WeightFormat("Q4_K", 12, 256, 144, 4, 32, "zero_points", 16,
                 ("q4_k_compact", "q4_1_block_offsets", *_ROW_GROUPS), at_rest="q4_k_factors",
                 quantizer="quantize_q4_k", fallback="Q5_0", mins="q4_k"),
    WeightFormat("Q5_K", 13, 256, 176, 8, 32, "minimums", 32,
                 ("block_minimums", "q8_0_nibble_halves", "five_bit_codes", *_ROW_GROUPS),
                 quantizer="quantize_q5_k", fallback="Q5_1"),
    WeightFormat("Q6_K", 14, 256, 210, 8, 16, "none", 64, ("q6_k_linears",),
                 quantizer="quantize_q6_k", fallback="Q8_0"),
    # IQ4: each block's values book[q] are 8-bit codes book[q] + 128 in the graph, with the
    # block's scale (IQ4_XS: d times the sub-block's 6-bit scale less 32, exact in float32), so
    # that the graph runs in onnxruntime. Where the target has kernels for them they become the
    # file's 4-bit indices again, looked up in the book by a byte shuffle (compiler/repack_iq4.py;
    # on ARM IQ4_XS's scales its d and 6-bit ls again, read on Q8_K activations);
    # elsewhere they run exactly on the W8A8 kernels as Q8_0 does
    WeightFormat("IQ4_NL", 20, 32, 18, 8, 32, "none", 16,
                 ("iq4_indices", "row_activations", "q8_0_nibble_halves", *_ROW_GROUPS), code_book=IQ4_BOOK),
    WeightFormat("IQ4_XS", 23, 256, 136, 8, 32, "none", 16,
                 ("iq4_indices", "row_activations", "q8_0_nibble_halves", *_ROW_GROUPS), fallback="IQ4_NL",
                 code_book=IQ4_BOOK),
)}

# GGUF type names whose blocks the exporter keeps as they are (others are requantized)
KEPT = tuple(FORMATS)


def get(name: str) -> WeightFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise KeyError(f"no weight format {name!r} (qwc keeps {', '.join(FORMATS)})") from None


def mark(node, name: str) -> None:
    """Write the marker naming `name`'s record on a MatMulNBits node (replacing one it had)."""
    get(name)
    for p in node.metadata_props:
        if p.key == MARKER:
            p.value = name
            return
    p = node.metadata_props.add()
    p.key, p.value = MARKER, name


def marked(node) -> WeightFormat | None:
    """The record a node's marker names, or None where it has none."""
    name = next((p.value for p in node.metadata_props if p.key == MARKER), None)
    return None if name is None else get(name)


# Before markers, a Q4_K node said how its minimums come back, and a Q5_1 / Q5_K one its format,
# in these metadata keys: read for graphs written then (format_of)
LEGACY_MINS_KEY = "qwc.block_mins"
LEGACY_MINIMUMS_KEY = "qwc.block_minimums"


def format_of(node) -> WeightFormat:
    """A MatMulNBits node's record: its marker's, or for a graph written before markers the one
    its form implies (Q5_0's codes look like Q8_0's there, and run as Q8_0's, exactly)."""
    fmt = marked(node)
    if fmt is not None:
        return fmt
    attrs = {a.name: a.i for a in node.attribute}
    meta = {p.key: p.value for p in node.metadata_props}
    bits, block = attrs.get("bits", 4), attrs.get("block_size", 32)
    if bits == 8:
        return FORMATS["Q6_K"] if block == 16 else FORMATS.get(meta.get(LEGACY_MINIMUMS_KEY, ""), FORMATS["Q8_0"])
    if not (len(node.input) > 3 and node.input[3]):
        return FORMATS["Q4_0"]
    return FORMATS["Q4_K"] if meta.get(LEGACY_MINS_KEY) == "q4_k" else FORMATS["Q4_1"]


def with_offsets(kind: str) -> tuple[str, ...]:
    """The names of the formats whose block offsets are held as `kind` ("zero_points", "minimums")."""
    return tuple(f.name for f in FORMATS.values() if f.offsets == kind)
