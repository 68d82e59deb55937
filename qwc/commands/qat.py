"""`qwc qat`: quantization-aware fine-tuning with exact Q4_0 fake quantization."""

from __future__ import annotations

import argparse

from qwc import progress
from qwc.atomic import check_destination
from qwc.errors import QwcError

from .options import nonnegative, thread_count

SELF = "\0self"   # `qwc qat --teacher` with no value: the source model itself


def register(sub) -> None:
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
    q.add_argument("--teacher", nargs="?", const=SELF, metavar="SOURCE",
                   help="distil from this model's logits (alone: the float SOURCE being trained)")
    q.add_argument("--kd-weight", type=float, default=None,
                   help="with --teacher: loss = (1 - w) CE + w KD (default 0.5)")
    q.add_argument("--kd-temperature", type=float, default=None, help="with --teacher: softmax temperature (default 1)")
    q.add_argument("--bf16", action="store_true",
                   help="bf16 autocast for the forward matmuls (about 2x faster on CPUs with AMX or AVX512-BF16); "
                        "the saved weights are exact Q4_0 either way")
    q.add_argument("--save-every", type=int, default=50, help="checkpoint interval in steps")
    q.add_argument("--seed", type=nonnegative, default=0)
    q.add_argument("--threads", type=thread_count, default=None)
    q.add_argument("-o", "--output", required=True, help="output HF directory")
    q.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
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
    s.teacher = None if args.teacher is None else (source if args.teacher == SELF else resolve_model(args.teacher))
    lm = load_source(source)
    r = train(lm, source, texts, s, args.output, threads=args.threads)
    progress.info(f"[qwc] {r['trained_steps']} steps in {r['seconds']:.0f}s, loss {r['first_loss']:.3f} -> "
                  f"{r['final_loss']:.3f}; wrote {args.output}")

