"""`qwc export`: a preset, Hugging Face directory or GGUF to an ONNX graph with a KV cache
(adapters merged with --lora)."""

from __future__ import annotations

import argparse
import sys
import time

from qwc import memory_check, progress
from qwc.atomic import check_destination
from qwc.errors import QwcError

from .options import NO_MEMORY_CHECK

PRESETS_EPILOG = "presets (random weights of the named shapes, made in code):"


class _PresetsHelp(argparse.HelpFormatter):
    """Help that lists the presets when it is shown, not when the parser is built: every qwc
    command builds this parser, and a runtime-only install has no qwc.models."""

    def add_text(self, text):
        if text == PRESETS_EPILOG:
            try:
                from qwc.models.presets import PRESET_NAMES
            except ImportError:
                text += " this install lacks the exporter (pip install 'qwc[compile]')"
            else:
                text += " " + ", ".join(PRESET_NAMES)
        super().add_text(text)


def register(sub) -> None:
    e = sub.add_parser("export", help="export a model to ONNX with a KV cache",
                       epilog=PRESETS_EPILOG, formatter_class=_PresetsHelp,
                       description="Export a Qwen2, Qwen2.5 or Qwen3 model (a preset, a Hugging Face directory "
                                   "or a .gguf file) to ONNX with KV-cache inputs and outputs.")
    e.add_argument("source", help="preset name (`qwc export --help` lists them below), HF model directory, "
                                  "or .gguf file")
    e.add_argument("-o", "--output", required=True, help="output .onnx path")
    e.add_argument("--legacy-exporter", action="store_true",
                   help="use torch's TorchScript exporter (dynamo=False), as older toolchains did")
    e.add_argument("--exporter", choices=("auto", "torch", "stream"), default="auto",
                   help="torch: trace the float32 model with torch.export (the generic graph; ~8 bytes "
                        "a parameter of memory). stream: write the fused float graph straight from the "
                        "checkpoint a tensor at a time (bounded memory; HF directories and .gguf files; a "
                        "bf16 or fp16 checkpoint's matrices stay so, exactly, in half the disk). "
                        "auto (default): stream checkpoints of 1B parameters and more, and GGUF files with "
                        "quantized weights (which only the streaming writer keeps)")
    e.add_argument("--requant", choices=("q8_0", "q4_0"), default="q8_0",
                   help="a GGUF's weights in a type qwc does not keep (Q2_K, Q3_K, IQ types but IQ4_NL / IQ4_XS) "
                        "are written in this one (default q8_0, the one that loses least); Q4_0, Q4_1, Q8_0, Q5_0, "
                        "Q5_1, Q4_K, Q5_K, Q6_K, IQ4_NL and IQ4_XS are kept exactly")
    e.add_argument("--lora", action="append", metavar="ADAPTER[:SCALE]",
                   help="merge a LoRA adapter before quantization (repeatable): a PEFT directory or a llama.cpp "
                        "GGUF adapter; a QA-LoRA adapter merges exactly into 4-bit blocks (Q4_1). SCALE: default 1")
    e.add_argument("--no-memory-check", action="store_true", help=NO_MEMORY_CHECK)
    e.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    from qwc.config import foreign_graph_files
    from qwc.eval.data import resolve_model
    from qwc.models.load import STREAM_FROM_PARAMS, open_checkpoint
    from qwc.models.presets import PRESET_NAMES, is_checkpoint_preset
    from qwc.vocab import mismatch, token_span

    check_destination(args.output, foreign=foreign_graph_files)
    if args.legacy_exporter and args.exporter == "stream":
        raise QwcError("--legacy-exporter is torch's older exporter; it does not go with --exporter stream")
    t0 = time.perf_counter()
    source = resolve_model(args.source)
    if args.lora:
        return export_merged(args, source, t0)
    if source in PRESET_NAMES and not is_checkpoint_preset(source):
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
        if warning and source not in PRESET_NAMES:   # a preset's byte-level tokenizer is its own
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


def export_merged(args: argparse.Namespace, source: str, t0: float) -> None:
    """`qwc export BASE --lora A[:S] ...`: the adapters merged into the base a tensor at a time."""
    from qwc.adapter_files import read_adapter
    from qwc.models.load import open_checkpoint
    from qwc.models.lora_merge import checkpoint_of, merge
    from qwc.models.presets import PRESET_NAMES, is_checkpoint_preset
    from qwc.models.stream_export import export_streaming, stream_memory

    if source in PRESET_NAMES and not is_checkpoint_preset(source):
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

