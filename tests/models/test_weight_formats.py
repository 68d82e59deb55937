"""The table of weight formats (qwc/weight_formats.py) is the one place a format is described:
every format the exporter and the passes keep has a record whose sizes are llama.cpp's (the
gguf package's own table is the reference), every rewrite a record names is one the compiler's
weights phase runs, every quantized linear a writer makes carries its record's marker, and no
module outside the table decides a format from bits, block sizes or metadata."""

from __future__ import annotations

import re
from pathlib import Path

import onnx
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from onnx import helper

from qwc import weight_formats as wf
from qwc.models import gguf_blocks

ROOT = Path(__file__).resolve().parents[2]


def test_every_kept_format_has_a_record_with_llama_cpps_sizes():
    from qwc.passes.kquant_mix import BITS, FALLBACK
    from qwc.passes.quantize_kquants import QUANTIZERS

    kept = set(gguf_blocks.KEPT) | set(QUANTIZERS) | set(BITS) | set(FALLBACK.values()) | {"Q4_0", "Q8_0"}
    assert kept <= set(wf.FORMATS), kept - set(wf.FORMATS)
    for f in wf.FORMATS.values():
        t = GGMLQuantizationType[f.name]
        assert f.gguf_type == t.value and (f.block, f.block_bytes) == GGML_QUANT_SIZES[t], f.name
        assert f.block % f.graph_block == 0 and 2 ** f.graph_bits >= f.code_span
        if f.quantizer:
            import qwc.kquants as kq
            assert callable(getattr(kq, f.quantizer)), f.quantizer
        if f.fallback:
            assert f.fallback in wf.FORMATS and wf.get(f.fallback).block == 32
    # the passes' bits a weight are the table's
    assert all(BITS[name] == pytest.approx(wf.get(name).bits_per_weight) for name in BITS)


def test_every_rewrite_a_record_names_is_the_weights_phase():
    from qwc.compiler.pipeline import weight_rewrites

    named = {r for f in wf.FORMATS.values() for r in f.rewrites}
    assert named == set(weight_rewrites())


def test_markers_and_the_graphs_written_before_them():
    node = helper.make_node("MatMulNBits", ["x", "w", "s"], ["y"], domain="com.microsoft", K=64, N=8, bits=8,
                            block_size=32)
    assert wf.marked(node) is None and wf.format_of(node).name == "Q8_0"   # an unmarked Q5_0 runs as Q8_0
    wf.mark(node, "Q5_0")
    wf.mark(node, "Q5_0")   # replaced, not added twice
    assert [p.key for p in node.metadata_props] == [wf.MARKER] and wf.format_of(node).name == "Q5_0"
    with pytest.raises(KeyError, match="no weight format 'Q3_K'"):
        wf.mark(node, "Q3_K")
    legacy = [
        (dict(bits=8, block_size=16), [], {}, "Q6_K"),
        (dict(bits=8, block_size=32), [], {wf.LEGACY_MINIMUMS_KEY: "Q5_K"}, "Q5_K"),
        (dict(bits=4, block_size=32), [], {}, "Q4_0"),
        (dict(bits=4, block_size=32), ["zp"], {}, "Q4_1"),
        (dict(bits=4, block_size=32), ["zp"], {wf.LEGACY_MINS_KEY: "q4_k"}, "Q4_K"),
    ]
    for attrs, zp, meta, want in legacy:
        n = helper.make_node("MatMulNBits", ["x", "w", "s", *zp], ["y"], domain="com.microsoft", K=64, N=8, **attrs)
        for k, v in meta.items():
            p = n.metadata_props.add()
            p.key, p.value = k, v
        assert wf.format_of(n).name == want, (attrs, meta)


def test_the_writers_mark_every_quantized_linear(tiny_q4, tmp_path):
    """qwc optimize's Q4_0 graph, and a GGUF export keeping Q8_0 blocks."""
    from test_load import _make_gguf

    from qwc.cli import main

    def linears(path):
        return [n for n in onnx.load(str(path), load_external_data=False).graph.node if n.op_type == "MatMulNBits"]

    q4 = linears(tiny_q4)
    assert q4 and all(wf.marked(n) is not None and wf.marked(n).name in ("Q4_0", "Q8_0") for n in q4)
    src, _, _ = _make_gguf(tmp_path, "qwen2")
    assert main(["-q", "export", str(src), "-o", str(tmp_path / "g.onnx")]) == 0
    kept = linears(tmp_path / "g.onnx")
    assert kept and all(wf.marked(n).name == "Q8_0" for n in kept)


# A format decided from a node's form outside the table: what the table replaced
_DECIDING = [
    re.compile(r"bits\s*==\s*8\s+and\s+block\s*==\s*16"),
    re.compile(r"block_mins_form"),
    re.compile(r"minimums_form\([^)]*\)\s*(==|in)\s*\(?\s*\"Q5"),
    re.compile(r"LEGACY_MINS_KEY"),
]
_PACKAGES = ("qwc", "models", "passes", "compiler", "runtime", "eval")


def test_no_module_outside_the_table_decides_a_format():
    found = []
    for folder in _PACKAGES:
        for f in sorted((ROOT / folder).rglob("*.py")):
            if f == ROOT / "qwc" / "weight_formats.py":
                continue
            for i, line in enumerate(f.read_text().splitlines(), 1):
                if any(p.search(line) for p in _DECIDING):
                    found.append(f"{f.relative_to(ROOT)}:{i}: {line.strip()}")
    assert found == []
    # the check sees what it looks for
    assert any(p.search('fmt = "q6_k" if bits == 8 and block == 16 else x') for p in _DECIDING)
