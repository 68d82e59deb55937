"""`qwc lora`: a LoRA or QA-LoRA adapter trained on CPU, written as a PEFT directory."""

from __future__ import annotations

import argparse

from qwc import memory_check, progress
from qwc.atomic import check_destination

from .options import NO_MEMORY_CHECK, float_in, int_at_least, nonnegative, positive, thread_count


def register(sub) -> None:
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
    lo.add_argument("--rank", type=positive, default=16, help="LoRA rank r (default 16)")
    lo.add_argument("--alpha", type=float_in(0, 1e6, lo_open=True), default=None,
                    help="LoRA alpha; the update is scaled by alpha / r (default 2 x rank)")
    lo.add_argument("--target", metavar="MODULES", help="comma-separated linears to adapt (default: all seven, "
                    "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj)")
    lo.add_argument("--steps", type=positive, default=200, help="optimizer steps (default 200)")
    lo.add_argument("--lr", type=float_in(0, 1, lo_open=True), default=2e-4, help="peak learning rate (default 2e-4)")
    lo.add_argument("--seq-len", type=int_at_least(2), default=256, help="tokens a sequence (default 256)")
    lo.add_argument("--batch", type=positive, default=4, help="sequences a step (default 4)")
    lo.add_argument("--qa", action="store_true", help="QA-LoRA: adapters on the 4-bit base, pooled over its blocks")
    lo.add_argument("--save-every", type=positive, default=50, help="checkpoint interval in steps (default 50)")
    lo.add_argument("--resume", action="store_true", help="continue the checkpoint an interrupted run left in OUTPUT.ckpt")
    lo.add_argument("--seed", type=nonnegative, default=0)
    lo.add_argument("--threads", type=thread_count, default=None)
    lo.add_argument("--no-memory-check", action="store_true", help=NO_MEMORY_CHECK)
    lo.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
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

