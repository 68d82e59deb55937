"""`qwc compile`: canonical graph (or an exported one, run through the passes first) ->
built module for a target -> the `model.qwc/` artifact."""

from __future__ import annotations

import time
from pathlib import Path

import onnx

from qwc import progress
from qwc.atomic import check_destination
from qwc.config import load_for_graph, tokenizer_for_graph
from qwc.errors import QwcError
from qwc.kv_formats import KV_TYPES
from qwc.limits import MAX_BATCH, MAX_LORA_RANK
from qwc.manifest import Functions, LoraSlots, Quantization
from qwc.passes.last_position import hidden_state_nodes, last_position_logits, prefill_nodes, step_nodes
from qwc.passes.pipeline import load_canonical

from .artifact import foreign_files
from .targets import TARGET_NAMES, default_act_bits, default_kv_dtype, get_target


def compile_memory(model: onnx.ModelProto) -> int:
    """Estimated peak bytes of compiling the canonical `model`: the weights the graph holds in
    memory (passed to TVM by reference), the largest one on disk read and repacked (two copies),
    and TVM's import and LLVM's build (measured ~1.4 GB at 1.5B: docs/history/README.md, "Model sizes")."""
    from qwc.passes.graph import tensor_bytes

    held = sum(len(t.raw_data) for t in model.graph.initializer)
    largest = max((tensor_bytes(t) for t in model.graph.initializer), default=0)
    return held * 5 // 4 + 2 * largest + 3 * 2**29


def compile_file(src, target_name: str, out, options=None, act_bits: int | None = None, tuning_db=None,
                 max_batch: int = 1, memory_check: bool = True, kv_type: str | None = None,
                 max_lora_rank: int = 0, embeddings: bool = False) -> dict:
    """`act_bits` None: the target's default (targets.default_act_bits). `max_batch` >= 2 adds
    the decode_batch entry point (compiler/build.py) for up to that many sequences. `kv_type`:
    the KV cache's element type by its KV_TYPES name (None: targets.default_kv_dtype).
    `max_lora_rank` >= 1: adapter slots for LoRA adapters of up to that rank, served unmerged
    (compiler/lora_slots.py). `embeddings`: the embed entry points (and embed_step with
    `max_batch` >= 2) for /v1/embeddings."""
    if target_name not in TARGET_NAMES:
        get_target(target_name)   # the unknown target's one line
    if act_bits not in (None, 8, 32):
        raise QwcError(f"--act-bits {act_bits} is not supported (8 or 32)")
    if kv_type is not None and kv_type not in KV_TYPES:
        raise QwcError(f"--kv-dtype {kv_type!r} is not supported ({' or '.join(KV_TYPES)})")
    if not isinstance(max_batch, int) or not 1 <= max_batch <= MAX_BATCH:
        raise QwcError(f"--max-batch {max_batch!r}: must be an integer from 1 to {MAX_BATCH}")
    if not isinstance(max_lora_rank, int) or not 0 <= max_lora_rank <= MAX_LORA_RANK:
        raise QwcError(f"--max-lora-rank {max_lora_rank!r}: must be an integer from 1 to {MAX_LORA_RANK} (0: no slots)")
    check_destination(out, folder=True, foreign=foreign_files)
    config = load_for_graph(src)   # cheap checks first: TVM takes seconds to import
    if kv_type == "q8_0" and config.head_dim % 32:
        raise QwcError(f"--kv-dtype q8_0 needs a head_dim that is a multiple of 32 (the model's is {config.head_dim})")
    target = get_target(target_name)   # the host's asks LLVM for the CPU's name: TVM is imported here
    from qwc.atomic import staging_dir
    from qwc.passes.graph import weights_to

    # The weights the passes and the repacking make go to a scratch file beside the output,
    # written as they are made and read back one at a time for params.bin.
    with staging_dir(Path(out), folder=True, foreign=foreign_files) as scratch, weights_to(scratch / "weights.bin"):
        times = _compile(src, target, out, config, options, act_bits, tuning_db, max_batch, memory_check,
                         KV_TYPES[kv_type] if kv_type else default_kv_dtype(target), max_lora_rank, embeddings)
    from .kernels.kernel_cache import prune
    prune()   # the kernel cache's folder within its limit, its least recently used entries dropped
    return times


def _functions(config, cache: list[str], max_batch: int, kv_dtype: str, lora: LoraSlots | None,
               embeddings: bool = False) -> Functions:
    """The library's entry points and what the runtime hands them (the manifest's functions)."""
    from .build import MAX_TOKENS_PER_CALL, VERIFY_TOKENS
    from .kernels.kv_cache import KEY_TILE, supports

    entries = {"prefill": "any number of new tokens", "decode": "one new token",
               "score": "prefill returning every position's logits",
               "verify": f"score of up to {VERIFY_TOKENS} tokens, each token's logits its decode step's"}
    if embeddings:
        entries["embed"] = "score returning every position's final-norm state [1, seq, hidden] (embeddings)"
    if max_batch > 1:
        entries["decode_batch"] = "one new token of each of B sequences, B <= max_batch, cache rows [B, ...]"
        entries["step"] = ("segments of B sequences' next tokens in one call (decode tokens and a prompt chunk), "
                           "the logits of the tokens named")
        if embeddings:
            entries["embed_step"] = "step returning the final-norm states [1, L, hidden] of the tokens named"
    # The fast attention reads K in key tiles of 16 (kernels/kv_cache.py): the runtime rounds
    # the buffers' capacity up to a multiple of this.
    tiles = supports(config.head_dim)
    return Functions(entries, tuple(cache), ("1", config.num_key_value_heads, "ctx", config.head_dim),
                     ("logits [1, 1, vocab] (last position; score: [1, seq, vocab])",
                      *(c.replace("past_key_values", "present") for c in cache)),
                     cache_capacity_multiple=KEY_TILE if tiles else 1,
                     k_cache_layout=f"key_tiles_{KEY_TILE}" if tiles else "rows", cache_dtype=kv_dtype,
                     max_batch=max_batch, max_tokens_per_call=MAX_TOKENS_PER_CALL, verify_tokens=VERIFY_TOKENS,
                     lora=lora)


def _compile(src, target, out, config, options, act_bits, tuning_db, max_batch, memory_check, kv_dtype,
             max_lora_rank, embeddings) -> dict:
    from .artifact import write_artifact
    from .build import build_for_artifact, to_relax

    if act_bits is None:
        act_bits = default_act_bits(target.features)
    tuned = {}
    if tuning_db is not None:
        from .tuning import tuned_knobs
        family = "q4_f32_" if act_bits == 32 else "q4_a8_"   # the kernels this artifact uses
        tuned = {k: v for k, v in tuned_knobs(Path(tuning_db), target).items() if k.startswith(family)}
        progress.info(f"[qwc] tuning database {tuning_db}: {len(tuned)} of this artifact's kernels "
                      f"(--act-bits {act_bits}) tuned faster than the hand schedule")
    times = {}
    t0 = time.perf_counter()
    model = load_canonical(src, config, options, memory_check=memory_check, by_reference=True)
    times["passes"] = time.perf_counter() - t0
    if max_lora_rank:
        from .lora_slots import check_inputs_unscaled
        check_inputs_unscaled(model, src)
    from qwc import memory_check as mc
    mc.check(f"compiling {Path(src).name}", compile_memory(model), "free some memory", skip=not memory_check,
             held=sum(len(t.raw_data) for t in model.graph.initializer))
    from .pipeline import weights
    w = weights(model, act_bits, target)
    quant = Quantization(w.formats, act_bits, w.embedding_bits, weight_layout=w.layout, tuned_kernels=tuned,
                         row_activations=w.row_linears)
    # `score` keeps every position's logits: the nodes as they are (copies: the rewrites below
    # edit nodes in place). Nodes only; every entry point shares the one model's weights.
    full = onnx.GraphProto()
    full.node.extend(model.graph.node)
    prefill = prefill_nodes(model)
    step = step_nodes(model, list(full.node)) if max_batch > 1 else None
    model = last_position_logits(model)
    score = list(full.node)
    embed = hidden_state_nodes(score) if embeddings else None
    embed_step = hidden_state_nodes(step) if embeddings and step is not None else None
    lora = None
    if max_lora_rank:
        from qwc.adapter_files import linear_shapes

        from .kernels.lora import CHUNK
        from .lora_slots import LORA_SLOT, add_slot_inputs, with_slots
        shapes = linear_shapes(config)
        linears = add_slot_inputs(model, shapes)
        score = with_slots(score, linears, shapes)
        prefill = with_slots(prefill, linears, shapes) if prefill is not None else None
        step = with_slots(step, linears, shapes) if step is not None else None
        embed = with_slots(embed, linears, shapes) if embed is not None else None
        embed_step = with_slots(embed_step, linears, shapes) if embed_step is not None else None
        decode = with_slots(list(model.graph.node), linears, shapes)
        del model.graph.node[:]
        model.graph.node.extend(decode)
        lora = LoraSlots(-(-max_lora_rank // CHUNK) * CHUNK, CHUNK, LORA_SLOT,
                         tuple((d["name"], d["in"], d["out"]) for d in linears))
    t0 = time.perf_counter()
    with progress.stage("importing into TVM Relax"):
        mod, names, params = to_relax(model, act_bits=act_bits, features=target.features,
                                      score_nodes=score, prefill_nodes=prefill, tuned=tuned,
                                      max_batch=max_batch, kv_dtype=kv_dtype, step_nodes=step,
                                      lora_chunks=lora.max_rank // lora.chunk if lora else 0,
                                      embed_nodes=embed, embed_step_nodes=embed_step)
    times["import"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    with progress.stage(f"building for {target.name} ({target.triple}, {target.mcpu})"):
        built = build_for_artifact(mod, target)
    if built.kernels:
        progress.info(f"[qwc] {built.kernels} kernels: {built.from_cache} from the cache, "
                      f"{built.kernels - built.from_cache} built")
    times["build"] = time.perf_counter() - t0
    cache = [i.name for i in model.graph.input if i.name.startswith("past_key_values.")]
    functions = _functions(config, cache, max_batch, kv_dtype, lora, embeddings)
    t0 = time.perf_counter()
    from .pack_at_rest import plan
    with progress.stage(f"writing {out}"):
        write_artifact(Path(out), executable=built.executable, link_options=built.link_options, target=target,
                       at_rest=plan(model), config=config, param_names=names,
                       params=params, tokenizer=tokenizer_for_graph(src), functions=functions, quantization=quant)
    times["write"] = time.perf_counter() - t0
    return times
