"""The `qwc` command line: the parser, and the one place a command's failure becomes one line
on stderr and an exit status. Each subcommand lives in qwc/commands/."""

from __future__ import annotations

import argparse
import errno
import os
import sys

from . import __version__, interrupts, progress
from .errors import QwcError

# transformers (configs, tokenizers) advises at import that it found no torch, which an install
# without the torch extra is meant to be: its advice is not qwc's users' business.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors in the one-line form every other qwc error has."""

    def error(self, message: str):
        self.exit(2, f"qwc: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from .commands import register_all

    p = _Parser(prog="qwc", description="The qwc command line: a Qwen2 model compiled for ARM server CPUs and x86")
    p.add_argument("--version", action="version", version=f"qwc {__version__}")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    register_all(p.add_subparsers(dest="command", required=True, metavar="COMMAND"))
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
    if argv is None:
        # As a program: end now, outputs are already cleaned up. Left to the interpreter's exit,
        # TVM's objects left mid-pass log warnings from their C++ destructors after the one line,
        # and a Ctrl-C in torch.export's tracing, caught and reported here, now and then still
        # ended the process by SIGINT rather than 130 (tests/fuzz: sigint-export, about one run
        # in forty on a warm machine).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)
    return 130


if __name__ == "__main__":
    sys.exit(main())
