"""Lower the canonical graph to one Relax module with three entry points sharing the weights,
and build it for a target.

    prefill(input_ids [1, seq], attention_mask [1, total], position_ids [1, seq],
            past_key_values.* [1, kv_heads, cache_len, head_dim] ..., params ...)
    decode(the same with seq = 1)
    score(the same as prefill, returning the logits of every position: `qwc eval`)
    decode_batch(input_ids [B, 1], attention_mask [B, total], position_ids [B, 1],
                 past_key_values.* [B, kv_heads, cache_len, head_dim] ...): one new token of
                 each of B sequences, row b of the cache buffers being sequence b's cache and
                 row b of the mask its length (ones, then zeros); `qwc compile --max-batch`

All return (logits, present.*); the presents alias the cache buffers they were given (the
cache is written in place), so the runtime never copies the cache.
"""

from __future__ import annotations

import contextlib

import onnx
import tvm
from tvm import relax

from .frontend import import_graph
from .targets import Target

N_INPUTS_BEFORE_CACHE = 3   # input_ids, attention_mask, position_ids
# The most new tokens a prefill or score call takes (the runtime feeds longer prompts in chunks
# of at most this). With a bound on the symbolic sizes (this, and decode_batch's B) TVM's
# memory planner gives every intermediate one buffer of its largest size, reused by every call;
# unbounded, each distinct size gets buffers of its own that the VM's pool keeps for good (a
# server seeing 16 batch sizes and 16 chunk lengths grew by 530 MB on the 0.5B shape).
MAX_TOKENS_PER_CALL = 256


def to_relax(model: onnx.ModelProto, act_bits: int = 32, features=frozenset(),
             score_model: onnx.ModelProto | None = None, tuned: dict | None = None,
             max_batch: int = 1, prefill_nodes: list | None = None) -> tuple[tvm.IRModule, list[str], dict[str, "tvm.runtime.Tensor"]]:
    """The module, the param names in call order, and the param values. `model` gives prefill
    and decode (and, with `max_batch` >= 2, decode_batch for up to that many sequences);
    `score_model` (the same graph with every position's logits and the same initializers)
    gives `score`; `prefill_nodes`, where given, replace model's nodes for prefill
    (passes/last_position.py: prefill_nodes)."""
    n_cache = sum(1 for i in model.graph.input if i.name.startswith("past_key_values."))
    n_inputs = N_INPUTS_BEFORE_CACHE + n_cache
    funcs = {}
    params = None
    entries = [("prefill", None, model, False), ("decode", 1, model, False)]
    if score_model is not None:
        entries.append(("score", None, score_model, False))
    if max_batch > 1:
        entries.append(("decode_batch", 1, model, True))
    bounds = {"prefill": {"seq": MAX_TOKENS_PER_CALL}, "score": {"seq": MAX_TOKENS_PER_CALL},
              "decode_batch": {"batch": max_batch}}
    for name, seq, graph, batched in entries:
        with _nodes_swapped(graph, prefill_nodes if name == "prefill" else None):
            mod = import_graph(graph, seq, prefix=name, act_bits=act_bits, features=features, tuned=tuned,
                               batched=batched)
        mod, detached = relax.frontend.detach_params(mod)
        for gv, fn in mod.functions_items():
            if gv.name_hint == "main":
                got = [p.name for p in fn.params[n_inputs:]]
                if params is not None and got != list(params):
                    raise ValueError(f"entry point {name} takes different parameters than prefill")
                fn = fn.with_attr("global_symbol", name).with_attr("num_input", n_inputs)
                if name in bounds:
                    fn = fn.with_attr("tir_var_upper_bound", bounds[name])
                funcs[tvm.ir.GlobalVar(name)] = fn
                if params is None:
                    names = [p.name for p in fn.params[n_inputs:]]
                    params = dict(zip(names, detached["main"]))
            else:
                funcs[gv] = fn  # kernels keep their GlobalVar: the functions refer to it
    out = tvm.IRModule(funcs)
    return out, list(params), params


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
    from .schedule import cpu_pipeline

    t = target.tvm_target()
    return tvm.compile(mod, target=t, relax_pipeline=cpu_pipeline(t))
