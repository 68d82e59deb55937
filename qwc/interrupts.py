"""Ctrl-C, remembered: TVM turns a KeyboardInterrupt raised inside one of its passes into its own
error type, so the CLI asks here whether the user interrupted rather than trusting the type.

After a Ctrl-C the process has one thing left to say ("qwc: interrupted"), but native code
unwinding from it may log first (TVM's BlockBuilder warns from its C++ destructor when a pass
is cut mid-function, before Python's handler runs). So the first Ctrl-C points fd 2 at
/dev/null, and `restore_stderr()` gives it back for the CLI's last line."""

from __future__ import annotations

import os
import signal
import sys

_seen = False
_saved_stderr: int | None = None   # a dup of fd 2 from before it was silenced


def _on_sigint(signum, frame):
    global _seen
    _seen = True
    _silence_fd2()
    raise KeyboardInterrupt


def _silence_fd2() -> None:
    global _saved_stderr
    if _saved_stderr is not None:
        return
    try:   # no flush here: inside a stderr write, the handler would re-enter the writer
        _saved_stderr = os.dup(2)
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 2)
        os.close(null)
    except OSError:   # no fd 2 to begin with: nothing to silence
        pass


def restore_stderr() -> None:
    """Give fd 2 back (before the CLI's last line, and for callers that go on in-process)."""
    global _saved_stderr
    if _saved_stderr is None:
        return
    sys.stderr.flush()
    os.dup2(_saved_stderr, 2)
    os.close(_saved_stderr)
    _saved_stderr = None


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
