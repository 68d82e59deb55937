"""Ctrl-C, remembered: TVM turns a KeyboardInterrupt raised inside one of its passes into its own
error type, so the CLI asks here whether the user interrupted rather than trusting the type.

After a Ctrl-C the process has one thing left to say ("qwc: interrupted"), but native code
unwinding from it may log first (TVM's BlockBuilder warns from its C++ destructor when a pass
is cut mid-function, before Python's handler runs). So the first Ctrl-C points fd 2 at
/dev/null, and `restore_stderr()` gives it back for the CLI's last line.

Once a command starts renaming its finished output into place (qwc.atomic), a Ctrl-C is too
late to leave the old output as it was: it is held, the command finishes, and the CLI says so
(exit 0). `qwc: interrupted` (exit 130) thus always means the old output is untouched. New
work after that (the next stage) makes a held Ctrl-C take effect."""

from __future__ import annotations

import contextlib
import os
import signal
import sys

_seen = False
_saved_stderr: int | None = None   # a dup of fd 2 from before it was silenced
_in_place: list[str] = []   # outputs renamed into place since the last stage began
_held = False   # a Ctrl-C that came after that


def _on_sigint(signum, frame):
    global _held
    if _in_place:
        _held = True
        return
    _interrupt()


def _interrupt():
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
    global _seen, _held
    _seen = _held = False
    _in_place.clear()
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _on_sigint)


@contextlib.contextmanager
def placing(output):
    """Around the renames that put a finished `output` in place. A Ctrl-C swallowed before
    takes effect first; from the first rename on, one is held (module docstring). If the
    renames fail, the output is not in place: a held Ctrl-C takes effect with the error."""
    check()
    _in_place.append(str(output))
    try:
        yield
    except BaseException:
        _in_place.remove(str(output))
        if _held:
            _interrupt()
        raise


def new_work() -> None:
    """A stage begins: Ctrl-C stops the command again, and a held one takes effect now."""
    _in_place.clear()
    if _held:
        _interrupt()
    check()


def held() -> list[str]:
    """The outputs put in place before a Ctrl-C that was held (empty: none was)."""
    return list(_in_place) if _held else []


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
