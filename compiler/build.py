"""Lower the canonical graph to one Relax module with two entry points sharing the weights,
and build it for a target.

    prefill(input_ids [1, seq], attention_mask [1, total], position_ids [1, seq],
            past_key_values.* [1, kv_heads, cache_len, head_dim] ..., params ...)
    decode(the same with seq = 1)

Both return (logits, present.*); the presents alias the cache buffers they were given (the
cache is written in place), so the runtime never copies the cache.
"""

from __future__ import annotations

import onnx
import tvm
from tvm import relax

from .frontend import import_graph
from .targets import Target

N_INPUTS_BEFORE_CACHE = 3   # input_ids, attention_mask, position_ids


def to_relax(model: onnx.ModelProto, act_bits: int = 32, features=frozenset()) -> tuple[tvm.IRModule, list[str], dict[str, "tvm.runtime.Tensor"]]:
    """The two-function module, the param names in call order, and the param values."""
    n_cache = sum(1 for i in model.graph.input if i.name.startswith("past_key_values."))
    n_inputs = N_INPUTS_BEFORE_CACHE + n_cache
    funcs = {}
    params = None
    for name, seq in (("prefill", None), ("decode", 1)):
        mod = import_graph(model, seq, prefix=name, act_bits=act_bits, features=features)
        mod, detached = relax.frontend.detach_params(mod)
        for gv, fn in mod.functions_items():
            if gv.name_hint == "main":
                fn = fn.with_attr("global_symbol", name).with_attr("num_input", n_inputs)
                funcs[tvm.ir.GlobalVar(name)] = fn
                if params is None:
                    names = [p.name for p in fn.params[n_inputs:]]
                    params = dict(zip(names, detached["main"]))
            else:
                funcs[gv] = fn  # kernels keep their GlobalVar: the functions refer to it
    out = tvm.IRModule(funcs)
    return out, list(params), params


def build(mod: tvm.IRModule, target: Target):
    from .schedule import cpu_pipeline

    t = target.tvm_target()
    return tvm.compile(mod, target=t, relax_pipeline=cpu_pipeline(t))
