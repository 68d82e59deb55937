"""TVMScript's macro calls, without reading source files: a macro finds the parser that called
it with `inspect.getouterframes`, which reads the source line of every frame on the stack, and
for a file it has not seen scans every module in sys.modules to name it. In a process that has
imported torch (tests, `qwc optimize`'s calibration, a notebook) that was most of parsing a
kernel: a cold build of one test's kernels took minutes. The parser is found the same way, by
the first frame outward whose globals hold it, walking the frames themselves.

`install()` replaces `ScriptMacro._find_parser_def` once; kernels/__init__.py calls it, before
any kernel module is imported.
"""

from __future__ import annotations

import sys


def _find_parser_def(self):
    from tvm.script.parser.core.parser import ScriptMacro

    frame = sys._getframe(1)
    while frame is not None:
        parser = frame.f_globals.get(ScriptMacro.parser_object_name)
        if parser is not None:
            return parser
        frame = frame.f_back
    raise RuntimeError(f"{ScriptMacro.parser_object_name} not available")


def install() -> None:
    from tvm.script.parser.core.parser import ScriptMacro

    ScriptMacro._find_parser_def = _find_parser_def
