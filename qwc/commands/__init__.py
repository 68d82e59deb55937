"""The subcommands of `qwc`, a module each: `register(sub)` adds its parser and arguments, and
`run(args)` is what it does. COMMANDS is the order `qwc --help` lists them in: the pipeline's
stages first, then the tools around them."""

from __future__ import annotations

import importlib

COMMANDS = ("export", "optimize", "compile", "tune", "targets", "run", "serve", "bench", "data", "qat", "lora",
            "prune", "eval")


def register_all(sub) -> None:
    """Every command's parser on `sub` (argparse's subparsers). A command's module imports only
    argparse-level names at the top: its work's modules load when it runs."""
    for name in COMMANDS:
        importlib.import_module(f"{__name__}.{name}").register(sub)
