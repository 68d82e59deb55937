"""`qwc optimize`: an exported graph raised to the canonical quantized graph (the passes)."""

from __future__ import annotations

import argparse
import time

from qwc import progress

from .options import NO_MEMORY_CHECK, calibration_options


def register(sub) -> None:
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
    calibration_options(o, " for --awq, --gptq, --imatrix calib and --act-scale auto", 4096)
    o.add_argument("--untie-lm-head", action="store_true",
                   help="with --fold-norm-gains: give the lm_head its own weight so the final norm's gain folds into it")
    o.add_argument("--verify", action="store_true",
                   help="run the input and output graphs in onnxruntime and report their difference")
    o.add_argument("--no-memory-check", action="store_true", help=NO_MEMORY_CHECK)
    o.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
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

