"""Ctrl-C, remembered: TVM turns a KeyboardInterrupt raised inside one of its passes into its own
error type, so the CLI asks here whether the user interrupted rather than trusting the type."""

from __future__ import annotations

import signal

_seen = False


def _on_sigint(signum, frame):
    global _seen
    _seen = True
    raise KeyboardInterrupt


def install() -> None:
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _on_sigint)


def seen() -> bool:
    return _seen


def check() -> None:
    """Raise KeyboardInterrupt if a Ctrl-C came and was swallowed by the code it interrupted."""
    if _seen:
        raise KeyboardInterrupt


def ignore() -> None:
    """The work is done and reported: a late Ctrl-C would only kill the interpreter as it exits
    (status -2 instead of the command's own)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
