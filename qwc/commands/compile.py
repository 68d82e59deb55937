"""`qwc compile`: a graph lowered through TVM for a target into a model.qwc artifact."""

from __future__ import annotations

import argparse
import time

from qwc import progress
from qwc.kv_formats import KV_TYPES
from qwc.limits import MAX_BATCH, MAX_LORA_RANK

from .options import NO_MEMORY_CHECK, int_in, whole_tvm


def register(sub) -> None:
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
    c.add_argument("--max-batch", type=int_in(1, MAX_BATCH), default=1, metavar="N",
                   help="N >= 2 adds a batched decode entry point (one token of each of up to N sequences "
                        "a step, reading the weights once) for `qwc serve`; costs compile time "
                        "(default 1: none)")
    c.add_argument("--kv-dtype", choices=tuple(KV_TYPES),
                   help="the KV cache's format: f16 halves its memory and the bytes a decode step reads "
                        "at depth (llama.cpp's default); q8_0 (llama.cpp's blocks of 32 int8 and a scale) takes "
                        "0.27x f32's memory; f32 for comparisons at full precision. Default: f16 where the "
                        "target converts it as it loads (every AVX2 x86, every aarch64), else f32")
    c.add_argument("--max-lora-rank", type=int_in(1, MAX_LORA_RANK), metavar="R",
                   help="adapter slots: `qwc serve --lora` and `qwc run --lora` then serve LoRA adapters of up "
                        "to rank R (rounded up to a multiple of 16) unmerged, any number of them, each request "
                        "its own (default: none; merge an adapter with `qwc export --lora` instead)")
    c.add_argument("--embeddings", action="store_true",
                   help="add the entry points `qwc serve` answers /v1/embeddings with (each position's final "
                        "hidden state; with --max-batch, several inputs a call): more compile time and library "
                        "code, so off by default, as llama-server's --embedding is")
    c.add_argument("--no-memory-check", action="store_true", help=NO_MEMORY_CHECK)
    c.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    whole_tvm("compile")
    from qwc.compiler.compile import compile_file

    t0 = time.perf_counter()
    times = compile_file(args.model, args.target, args.output, act_bits=args.act_bits, tuning_db=args.tuning_db,
                         max_batch=args.max_batch, memory_check=not args.no_memory_check, kv_type=args.kv_dtype,
                         max_lora_rank=args.max_lora_rank or 0, embeddings=args.embeddings)
    parts = ", ".join(f"{k} {v:.1f}s" for k, v in times.items())
    progress.info(f"[qwc] compiled {args.model} for {args.target} -> {args.output} in "
                  f"{time.perf_counter() - t0:.1f}s ({parts})")

