"""The `qwc` command line. Each subcommand parses its flags and calls one stage."""

from __future__ import annotations

import argparse
import sys
import time

from . import __version__, progress
from .atomic import check_destination
from .errors import QwcError


def _cmd_export(args: argparse.Namespace) -> None:
    from qwc.models.export import export_onnx
    from qwc.models.load import load_source

    check_destination(args.output)
    t0 = time.perf_counter()
    lm = load_source(args.source)
    out = export_onnx(lm, args.output)
    c = lm.config
    progress.info(f"[qwc] exported {c.name}: {c.num_hidden_layers} layers, hidden {c.hidden_size}, "
                  f"vocab {c.vocab_size} -> {out} in {time.perf_counter() - t0:.1f}s")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qwc", description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--version", action="version", version=f"qwc {__version__}")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    e = sub.add_parser("export", help="export a model to ONNX with a KV cache",
                       description="Export a Qwen2 model (a preset, a Hugging Face directory or a "
                                   ".gguf file) to ONNX with KV-cache inputs and outputs.")
    e.add_argument("source", help="preset name (tiny, qwen2.5-0.5b), HF model directory, or .gguf file")
    e.add_argument("-o", "--output", required=True, help="output .onnx path")
    e.set_defaults(func=_cmd_export)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    progress.set_quiet(args.quiet)
    try:
        args.func(args)
    except QwcError as e:
        print(f"qwc: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("qwc: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
