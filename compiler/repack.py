"""Compile-time weight repacking: store each MatMulNBits weight in the layout its target's
kernel reads, so nothing is repacked when an artifact loads.

Today that is the W4A8 kernels' row-group layout (kernels/row_groups.py), x86 and ARM, with
Q4_1's block offsets beside the scales, Q8_0's row groups for the W8A8 kernels
(row_groups.pack_int8), and the two rewrites that let the other weight formats take the Q4_0
kernels with their values exact: Q4_1 as Q4_0 plus block offsets (q4_1_block_offsets), Q8_0 as
two nibble halves where the target has no W8A8 kernels (q8_0_nibble_halves); both run before
repack_weights. Float linears (`--keep-float`) get their weights in blocks of columns
(float_column_blocks, kernels/f32_matmul.py). The
decision which kernel a matmul takes is `targets.q4_0_path`, the same one the importer makes,
so the two cannot disagree. A tied embedding keeps reading the same (repacked) bytes: its
GatherBlockQuantized is pointed at the repacked scales and imported with a gather for that
layout. A weight that anything else reads gets a repacked copy of its own instead. An untied
embedding's scales are stored as fp16 when every one is exactly an fp16 (always for Q4_0, as in
a GGUF): a 152k x 3584 table's are 65 MB in float32.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from qwc.passes.graph import (
    BLOCK_OFFSETS_ATTR,
    COLUMN_BLOCKS_OP,
    NIBBLE_HALVES_ATTR,
    Graph,
    has_block_offsets,
    has_zero_points,
    matmul_nbits_dims,
    new_tensor,
    tensor_array,
)
from qwc.q4 import pack_nibbles

from .repack_five_bit import is_five_bit
from .repack_iq4 import is_iq4
from .repack_q4_k import is_compact_q4_k
from .targets import q4_0_path, q8_0_path


def repack_weights(model: onnx.ModelProto, act_bits: int, features) -> int:
    """Repack in place; returns the number of matmuls whose weights were repacked."""
    from .kernels import row_groups

    graph = Graph(model)
    g, inits, consumers, producer = model.graph, graph.inits, graph.consumers, graph.producer
    done: dict[tuple[str, str], tuple[str, str]] = {}
    offsets_done: set[str] = set()
    count = 0
    for node in g.node:
        if (node.op_type != "MatMulNBits" or len(node.input) < 3 or is_compact_q4_k(node) or is_five_bit(node)
                or is_iq4(node)):
            continue   # (a compact Q4_K, five-bit codes or IQ4's indices are already in their kernels' layout)
        _, _, block, bits = matmul_nbits_dims(node)
        int8 = q8_0_path(block, bits, act_bits, features) if not has_zero_points(node) else None
        if not int8 and q4_0_path(block, bits, act_bits, features, has_zero_points(node)) in (None, "f32"):
            continue   # not an integer-dot kernel: the plain layout
        wname, sname = node.input[1], node.input[2]
        if wname not in inits or sname not in inits:
            continue  # computed weights are not ours to repack (the importer will say so)
        if has_block_offsets(node):   # Q4_1's offsets c: the kernels read them beside the scales
            cname = node.input[3]
            if cname in inits and cname not in offsets_done:
                inits[cname].CopyFrom(new_tensor(row_groups.pack_offsets(tensor_array(inits[cname])), cname))
                offsets_done.add(cname)
        if (wname, sname) in done:
            node.input[1], node.input[2] = done[wname, sname]
            count += 1
            continue
        wp, s = tensor_array(inits[wname]), tensor_array(inits[sname])
        pw, ps = row_groups.pack_int8(wp, s, signed=int8 == "arm") if int8 else row_groups.pack(wp, s)
        gathers = _tied_gathers(consumers.get(wname, []), sname, s, producer, inits, bits=8 if int8 else 4)
        plain_readers = [c for c in consumers.get(wname, []) if c.op_type != "MatMulNBits" and c not in (gathers or [])]
        plain_readers += [c for c in consumers.get(sname, []) if c.op_type != "MatMulNBits"
                          and not (c.op_type == "Unsqueeze" and gathers
                                   and all(x in gathers for x in consumers.get(c.output[0], [])))]
        if gathers is None or plain_readers:
            # Something else reads the plain layout: give the matmuls a repacked copy.
            new = (wname + ".qwc_packed", sname + ".qwc_packed")
            g.initializer.extend([new_tensor(pw, new[0]), new_tensor(ps, new[1])])
        else:
            new = (wname, sname)
            inits[wname].CopyFrom(new_tensor(pw, wname))   # into the compile's weight file
            inits[sname].CopyFrom(new_tensor(ps, sname))
            for gq in gathers:
                own = gq.input[2]
                gq.input[2] = sname   # the repacked scales directly; an Unsqueeze is left unread
                if own in inits and not any(own in c.input for c in g.node):
                    g.initializer.remove(inits.pop(own))   # its own (folded) copy of the scales
        node.input[1], node.input[2] = new
        done[wname, sname] = new
        count += 1
    return count


def q8_0_nibble_halves(model: onnx.ModelProto, act_bits: int, features) -> int:
    """Give each Q8_0 MatMulNBits (8-bit codes u = q + 128, block 32) the Q4_0 kernels where the
    target has them: u = 16 h + l with h, l in 0..15, so

        d q = 16 d (h - 8) + d (l - 8) + 8 d

    a Q4_0 matmul on the high nibbles (scales 16 d) plus one on the low nibbles (scales d): the
    same integer-dot kernels (VNNI, AVX2, sdot, smmla), the same 32 bytes of codes a block as
    Q8_0's, the values exactly. The low half's d (l - 8) + 8 d = d l is the W4A8 kernel started
    from a zero offset instead of the quantizer's -8 x sum(a) (frontend: `zero_offset`); W4A32's
    kernel subtracts the 8 itself, so there the low half takes block offsets 8 d
    (q4_1_block_offsets' form). The node stays one (the head and the passes that find it by its
    output see what they saw), marked graph.NIBBLE_HALVES_ATTR, with inputs (x, high codes, 16 d,
    8 d or "", "", bias, low codes, d), each half in its kernel's layout. A tied embedding keeps
    reading the 8-bit bytes. A Q5_1 / Q5_K node (8-bit codes u - 128 = q and block offsets m:
    block_minimums.py) splits the same way, its low half taking block offsets m + 8 d (rounded
    once) on either path, since the W4A8 kernels' offsets term reads the quantizer's sums that
    `zero_offset` would zero. Returns the nodes split."""
    from .kernels import row_groups

    inits = Graph(model).inits
    count = 0
    for node in model.graph.node:
        minimums = has_block_offsets(node)   # Q5_1 / Q5_K (block_minimums.py): u - 128 = q, plus m
        if node.op_type != "MatMulNBits" or (len(node.input) > 3 and node.input[3] and not minimums):
            continue
        k, n, block, bits = matmul_nbits_dims(node)
        path = q4_0_path(block, 4, act_bits, features)
        if bits != 8 or path is None or node.input[1] not in inits or node.input[2] not in inits:
            continue
        if q8_0_path(block, bits, act_bits, features) is not None:
            continue   # the target's W8A8 kernels take the codes as they are (repack_weights)
        u, d = tensor_array(inits[node.input[1]]), tensor_array(inits[node.input[2]]).astype(np.float32)
        if u.shape != (n, k // block, block) or not np.isfinite(16 * d).all():
            continue
        halves = []
        for codes, scales in ((u >> 4, 16 * d), (u & 15, d)):
            w, s = pack_nibbles(codes), scales
            if path != "f32":   # the W4A8 kernels' row groups, as repack_weights writes Q4_0
                w, s = row_groups.pack(w, s)
            halves.append((w, s))
        stem = node.input[1]
        names = [stem + ".qwc_hi", stem + ".qwc_hi_scales", stem + ".qwc_lo", stem + ".qwc_lo_scales"]
        for name, a in zip(names, [x for half in halves for x in half]):
            model.graph.initializer.append(new_tensor(a, name))
        offsets = ""
        if path == "f32" or minimums:
            c = 8 * d.astype(np.float64)
            if minimums:
                c += tensor_array(inits[node.input[3]]).astype(np.float64)
            c = c.astype(np.float32)
            offsets = stem + ".qwc_lo_offsets"
            model.graph.initializer.append(new_tensor(row_groups.pack_offsets(c) if path != "f32" else c, offsets))
        bias = node.input[5] if len(node.input) > 5 else ""
        old = list(node.input[1:3]) + ([node.input[3]] if minimums else [])
        del node.input[1:]
        node.input.extend([names[0], names[1], offsets, "", bias, names[2], names[3]])
        node.attribute.append(helper.make_attribute(NIBBLE_HALVES_ATTR, 1))
        if minimums:   # the offsets are the low half's now (the frontend reads the halves first)
            kept = [a for a in node.attribute if a.name != BLOCK_OFFSETS_ATTR]
            del node.attribute[:]
            node.attribute.extend(kept)
        for name in old:
            if not any(name in nd.input for nd in model.graph.node):   # no tied gather reads it
                model.graph.initializer.remove(inits.pop(name))
        count += 1
    return count


def q4_1_block_offsets(model: onnx.ModelProto, act_bits: int, features) -> int:
    """Give each MatMulNBits with float zero points (4-bit codes, block 32: Q4_1, Q4_K's
    sub-blocks) the Q4_0 kernels' form: w = d q + m = d (q - 8) + (m + 8 d), so the codes and
    scales are read as Q4_0 and each block adds its offset c = m + 8 d times the activations'
    block sum (frontend: MatMulNBits.q4_0_matmul with `offsets`: one FMA a block inside the W4A8
    kernels). The zero points' input becomes c (float32, [N, K/32]; repack_weights lays it out
    in row groups for the W4A8 kernels) and the node is marked (graph.BLOCK_OFFSETS_ATTR).
    m comes back from (d, zp) in the node's form (gguf_blocks.block_mins). A Q4_1 tensor whose
    c is not exact in float32 for every block keeps the generic kernels, which read m itself;
    a Q4_K one always converts (the generic kernels know only Q4_1's form), its c within half
    an ulp of m + 8 d. Returns the nodes converted."""
    from qwc import weight_formats
    from qwc.models.gguf_blocks import block_mins

    inits = Graph(model).inits
    count = 0
    for node in model.graph.node:
        if node.op_type != "MatMulNBits" or not has_zero_points(node):
            continue
        _, _, block, bits = matmul_nbits_dims(node)
        form = weight_formats.format_of(node).mins
        if q4_0_path(block, bits, act_bits, features) is None and form == "fp16":
            continue
        if node.input[2] not in inits or node.input[3] not in inits:
            continue
        d, zp = tensor_array(inits[node.input[2]]).astype(np.float32), tensor_array(inits[node.input[3]])
        m = block_mins(d, zp, form)
        c = (m.astype(np.float64) + 8 * d.astype(np.float64)).astype(np.float32)
        if form == "fp16" and not np.array_equal(c.astype(np.float64), m.astype(np.float64) + 8 * d.astype(np.float64)):
            continue
        old, name = node.input[3], node.input[3] + ".qwc_offsets"
        model.graph.initializer.append(new_tensor(c, name))
        node.input[3] = name
        if not any(old in n.input for n in model.graph.node):
            model.graph.initializer.remove(inits.pop(old))
        node.attribute.append(helper.make_attribute(BLOCK_OFFSETS_ATTR, 1))
        count += 1
    return count


def half_gather_scales(model: onnx.ModelProto) -> int:
    """Store each GatherBlockQuantized's float32 scales (an initializer, directly or through an
    Unsqueeze) as fp16 where that is exact and nothing else reads them; the gather kernels
    widen them as they read. Returns the number of tensors converted."""
    graph = Graph(model)
    inits, consumers, producer = graph.inits, graph.consumers, graph.producer
    count = 0
    for node in list(model.graph.node):
        if node.op_type != "GatherBlockQuantized" or len(node.input) < 3:
            continue
        src = producer.get(node.input[2])
        name = src.input[0] if src is not None and src.op_type == "Unsqueeze" else node.input[2]
        t = inits.get(name)
        if t is None or t.data_type != onnx.TensorProto.FLOAT:
            continue
        readers = consumers.get(name, [])
        if not all(r is node or (r is src and all(c.op_type == "GatherBlockQuantized"
                                                 for c in consumers.get(src.output[0], [])))
                   for r in readers):
            continue
        s = tensor_array(t)
        half = s.astype(np.float16)
        if not np.array_equal(half.astype(np.float32), s):
            continue
        t.CopyFrom(new_tensor(half, name))
        count += 1
    return count


def float_column_blocks(model: onnx.ModelProto, features) -> int:
    """Give each float32 MatMul by a weight [K, N] the float kernel (kernels/f32_matmul.py): the
    weight stored in blocks of columns, the node made a COLUMN_BLOCKS_OP. A weight that
    anything else reads gets a packed copy of its own. A MatMul whose N is no multiple of the
    target's vector stays for TVM's generic rule. Returns the nodes rewritten."""
    from .kernels import f32_matmul
    from .targets import vector_registers

    graph = Graph(model)
    inits, consumers = graph.inits, graph.consumers
    registers = vector_registers(features)
    packed: dict[str, str] = {}
    count = 0
    for node in model.graph.node:
        if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx") or node.input[1] not in inits:
            continue
        t = inits[node.input[1]]
        if t.data_type != onnx.TensorProto.FLOAT or len(t.dims) != 2:
            continue
        cols = f32_matmul.columns(int(t.dims[1]), registers)
        if cols is None:
            continue
        name = node.input[1]
        if name not in packed:
            w = f32_matmul.pack(tensor_array(t), cols)
            if all(c.op_type == "MatMul" and c.input[1] == name and name not in c.input[:1]
                   for c in consumers.get(name, [])):
                inits[name].CopyFrom(new_tensor(w, name))   # into the compile's weight file
                packed[name] = name
            else:
                packed[name] = name + ".qwc_column_blocks"
                model.graph.initializer.append(new_tensor(w, packed[name]))
        node.input[1] = packed[name]
        node.op_type = COLUMN_BLOCKS_OP
        count += 1
    return count


def _tied_gathers(nodes, sname: str, scales, producer, inits, bits: int = 4) -> list | None:
    """The GatherBlockQuantized nodes among `nodes` (`bits`, block 32: they then read the
    repacked codes, generic.gather_q4_row_groups / gather_q8_row_groups) that read the matmul's
    scales `sname` as [V, nb, 1]: through an Unsqueeze, as passes/quantize_embedding.py emits
    them, or as a constant-folded copy. None if one of them reads anything else."""
    out = []
    for c in nodes:
        if c.op_type != "GatherBlockQuantized":
            continue
        a = {x.name: helper.get_attribute_value(x) for x in c.attribute}
        if int(a.get("bits", 4)) != bits or int(a.get("block_size", 0)) != 32 or int(a.get("gather_axis", 0)) != 0:
            return None
        src = producer.get(c.input[2])
        if src is not None:
            if src.op_type != "Unsqueeze" or src.input[0] != sname:
                return None
        elif c.input[2] not in inits or not np.array_equal(tensor_array(inits[c.input[2]]), scales[..., None]):
            return None
        out.append(c)
    return out
