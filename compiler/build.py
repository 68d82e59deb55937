"""Lower the canonical graph to one Relax module with three entry points sharing the weights,
and build it for a target.

    prefill(input_ids [1, seq], attention_mask [1, total], position_ids [1, seq],
            past_key_values.* [1, kv_heads, cache_len, head_dim] ..., params ...)
    decode(the same with seq = 1)
    score(the same as prefill, returning the logits of every position: `qwc eval`)
    verify(score for up to VERIFY_TOKENS tokens, each attending as its decode step would:
           a speculative verify call whose logits are the decode steps' to the bit)
    decode_batch(input_ids [B, 1], attention_mask [B, total], position_ids [B, 1],
                 past_key_values.* [B, kv_heads, cache_len, head_dim] ...): one new token of
                 each of B sequences, row b of the cache buffers being sequence b's cache and
                 row b of the mask its length (ones, then zeros); `qwc compile --max-batch`
    step(input_ids [1, t], attention_mask [1, total] (not read), position_ids [1, t],
         segments [G, 3], logit_tokens [L], past_key_values.* [B, ...] ...): t tokens of G
         segments (cache row, first token, count; each a row's next tokens, as prefill takes
         them), their positions, and the logits of the L tokens named [1, L, vocab]: a
         scheduler step's decode tokens and a prompt chunk in one call (with decode_batch)
    embed(score's inputs): every position's final-norm state [1, seq, hidden] in place of
         the logits (embeddings: runtime/embeddings.py)
    embed_step(step's inputs): the states [1, L, hidden] of the L tokens named (with step)

All return (logits, present.*); the presents alias the cache buffers they were given (the
cache is written in place), so the runtime never copies the cache.
"""

from __future__ import annotations

import contextlib

import onnx
import tvm
from tvm import relax

from qwc.manifest import STEP_INPUTS
from qwc.passes.graph import LARGE_TENSOR_BYTES

from .frontend import import_graph
from .targets import Target

N_INPUTS_BEFORE_CACHE = 3   # input_ids, attention_mask, position_ids
# The most new tokens a prefill or score call takes (the runtime feeds longer prompts in chunks
# of at most this). With a bound on the symbolic sizes (this, and decode_batch's B) TVM's
# memory planner gives every intermediate one buffer of its largest size, reused by every call;
# unbounded, each distinct size gets buffers of its own that the VM's pool keeps for good (a
# server seeing 16 batch sizes and 16 chunk lengths grew by 530 MB on the 0.5B shape).
MAX_TOKENS_PER_CALL = 256
# The most tokens a verify call takes (the last token and up to 15 drafted; the runtime splits
# longer ones, each token's logits being the same whatever call it is in).
VERIFY_TOKENS = 16


# Initializers of at least this size enter the import as typed inputs without their data:
# TVM's importer copies every initializer into a tensor of its own, for each entry point (four
# copies of a 7B's 4 GB). Their values are read once, as params.bin is written (from the graph's
# data file, where the passes and the repacking leave them: qwc/weight_file.py).
BY_REFERENCE_BYTES = LARGE_TENSOR_BYTES


def to_relax(model: onnx.ModelProto, act_bits: int = 32, features=frozenset(),
             score_nodes: list | None = None, tuned: dict | None = None,
             max_batch: int = 1, prefill_nodes: list | None = None,
             kv_dtype: str = "float32", step_nodes: list | None = None,
             lora_chunks: int = 0, embed_nodes: list | None = None,
             embed_step_nodes: list | None = None) -> tuple[tvm.IRModule, list[str], dict]:
    """The module, the param names in call order, and the param values (numpy arrays or, for
    the large ones, the model's TensorProtos: compiler/artifact.py reads each as it writes it).
    `model` gives prefill and decode (and, with `max_batch` >= 2, decode_batch for up to that
    many sequences); `score_nodes`, where given, are the nodes of `score` (every position's
    logits) and of `verify`; `prefill_nodes`, where given, replace model's nodes for prefill
    (passes/last_position.py: prefill_nodes); `kv_dtype` the cache buffers' element type;
    `step_nodes`, with `max_batch` >= 2, the step entry point's (last_position.step_nodes).
    `embed_nodes` / `embed_step_nodes`, where given, those of embed and embed_step (the head
    taken off: last_position.hidden_state_nodes).
    `lora_chunks` >= 1: the graph has adapter slots (compiler/lora_slots.py) of up to that many
    chunks of ranks, inputs after the cache."""
    n_cache = sum(1 for i in model.graph.input if i.name.startswith("past_key_values."))
    n_lora = sum(1 for i in model.graph.input if i.name.startswith("qwc_lora_"))
    n_inputs = N_INPUTS_BEFORE_CACHE + n_cache + n_lora
    skeleton, by_ref = _by_reference(model)
    funcs = {}
    names = params = signature = None
    entries = [("prefill", None, prefill_nodes, False), ("decode", 1, None, False)]
    if score_nodes is not None:
        entries += [("score", None, score_nodes, False), ("verify", None, score_nodes, False)]
    if embed_nodes is not None:
        entries.append(("embed", None, embed_nodes, False))
    if max_batch > 1:
        entries.append(("decode_batch", 1, None, True))
        if step_nodes is not None:
            entries.append(("step", None, step_nodes, False))
        if embed_step_nodes is not None:
            entries.append(("embed_step", None, embed_step_nodes, False))
    step_bounds = {"seq": MAX_TOKENS_PER_CALL, "batch": max_batch, "segments": max_batch, "outputs": max_batch}
    bounds = {"prefill": {"seq": MAX_TOKENS_PER_CALL}, "score": {"seq": MAX_TOKENS_PER_CALL},
              "embed": {"seq": MAX_TOKENS_PER_CALL}, "verify": {"seq": VERIFY_TOKENS},
              "decode_batch": {"batch": max_batch}, "step": step_bounds,
              # an embedding call names every token of its segments (mean pooling reads them all)
              "embed_step": {**step_bounds, "outputs": MAX_TOKENS_PER_CALL}}
    if lora_chunks:   # the padded rank bounds the shrink's output: one buffer for every call
        for b in bounds.values():
            b["lora_chunks"] = lora_chunks
        for name, *_ in entries:
            bounds.setdefault(name, {"lora_chunks": lora_chunks})
    for name, seq, nodes, batched in entries:
        step = name in ("step", "embed_step")
        extra = STEP_INPUTS if step else ()
        with _nodes_swapped(skeleton, nodes), _inputs_added(skeleton, extra):
            mod = import_graph(skeleton, seq, prefix=name, act_bits=act_bits, features=features, tuned=tuned,
                               batched=batched, kv_dtype=kv_dtype, step=step, verify=name == "verify")
        mod, detached = relax.frontend.detach_params(mod)
        for gv, fn in mod.functions_items():
            if gv.name_hint == "main":
                got = [p.name for p in fn.params[n_inputs + len(extra):]]
                if signature is not None and got != signature:
                    raise ValueError(f"entry point {name} takes different parameters than prefill")
                fn = fn.with_attr("global_symbol", name).with_attr("num_input", n_inputs + len(extra))
                if name in bounds:
                    fn = fn.with_attr("tir_var_upper_bound", bounds[name])
                funcs[tvm.ir.GlobalVar(name)] = fn
                if signature is None:
                    # The by-reference weights come first (graph inputs, in _by_reference's
                    # order), then the importer's own params.
                    # (Names as the library's signature has them: the importer sanitizes
                    # input names, and the runtime checks the manifest against the library.)
                    signature = names = got
                    params = dict(zip(got, by_ref))
                    params.update(zip(got[len(by_ref):], detached.get("main", [])))
            else:
                funcs[gv] = fn  # kernels keep their GlobalVar: the functions refer to it
    out = tvm.IRModule(funcs)
    return out, names, params


def _by_reference(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[onnx.TensorProto]]:
    """The model to import: its nodes and small initializers, with each large initializer as a
    graph input of its type and shape (after the real inputs), and those initializers."""
    from qwc.passes.graph import tensor_bytes

    m = onnx.ModelProto()
    m.ir_version = model.ir_version
    m.opset_import.extend(model.opset_import)
    g = m.graph
    g.name = model.graph.name
    g.node.extend(model.graph.node)
    g.input.extend(model.graph.input)
    g.output.extend(model.graph.output)
    g.value_info.extend(model.graph.value_info)
    big = []
    for t in model.graph.initializer:
        if tensor_bytes(t) >= BY_REFERENCE_BYTES:
            big.append(t)
            g.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
        else:
            g.initializer.append(t)
    return m, big


@contextlib.contextmanager
def _inputs_added(model: onnx.ModelProto, names: tuple[str, ...]):
    """model with int64 graph inputs `names` after input_ids, attention_mask and position_ids
    for the duration: the step entry point's own (shapes from frontend.import_graph)."""
    if not names:
        yield
        return
    saved = list(model.graph.input)
    added = [onnx.helper.make_tensor_value_info(n, onnx.TensorProto.INT64, None) for n in names]
    del model.graph.input[:]
    model.graph.input.extend(saved[:N_INPUTS_BEFORE_CACHE] + added + saved[N_INPUTS_BEFORE_CACHE:])
    try:
        yield
    finally:
        del model.graph.input[:]
        model.graph.input.extend(saved)


@contextlib.contextmanager
def _nodes_swapped(model: onnx.ModelProto, nodes):
    """model with `nodes` as its graph's nodes for the duration (None: as it is)."""
    if nodes is None:
        yield
        return
    saved = onnx.GraphProto()
    saved.node.extend(model.graph.node)   # copies
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    try:
        yield
    finally:
        del model.graph.node[:]
        model.graph.node.extend(saved.node)


def build(mod: tvm.IRModule, target: Target):
    """An executable to run in this process (tests, benches, tuning)."""
    from .pipeline import lowering

    t = target.tvm_target()
    return relax.build(mod, target=t, relax_pipeline=lowering(t), exec_mode=target.vm_exec_mode)


def build_for_artifact(mod: tvm.IRModule, target: Target):
    """An executable to export as an artifact's lib.so, its kernels' objects from the cache
    (kernel_objects.py: a `Linkable`)."""
    from .kernel_objects import build_linkable

    return build_linkable(mod, target.tvm_target(), target.vm_exec_mode)
