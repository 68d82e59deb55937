"""Every package folder's code stays in pieces a reader can hold: no function over
FUNCTION_LINES and no module over MODULE_LINES. A TVMScript prim_func is exempt (its body is the
kernel); a kernel builder counts without the prim_funcs and macros nested in it, and each macro
counts on its own."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("qwc", "models", "passes", "compiler", "runtime", "eval", "bench")
FUNCTION_LINES = 150
MODULE_LINES = 800


def _decorators(fn) -> list[str]:
    return [ast.unparse(d.func if isinstance(d, ast.Call) else d) for d in fn.decorator_list]


def _is_tvmscript(fn, kinds=("prim_func", "macro")) -> bool:
    return any(d.endswith(kinds) for d in _decorators(fn))


def own_lines(fn) -> int:
    """fn's lines, less those of the TVMScript functions nested in it (counted on their own)."""
    nested = 0

    def visit(node):
        nonlocal nested
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) and _is_tvmscript(child):
                nested += child.end_lineno - child.lineno + 1
            else:
                visit(child)
    visit(fn)
    return fn.end_lineno - fn.lineno + 1 - nested


def long_functions(source: str, where: str) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _is_tvmscript(node, ("prim_func",)):
            n = own_lines(node)
            if n > FUNCTION_LINES:
                out.append(f"{where}:{node.lineno} {node.name} ({n} lines)")
    return out


def _sources():
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            yield path.relative_to(ROOT), path.read_text()


def test_no_function_over_the_limit():
    assert [bad for rel, text in _sources() for bad in long_functions(text, str(rel))] == []


def test_no_module_over_the_limit():
    assert [f"{rel} ({n} lines)" for rel, text in _sources() if (n := len(text.splitlines())) > MODULE_LINES] == []


def test_the_counter_exempts_prim_funcs_and_counts_macros_alone():
    body = "\n".join(f"        x{i} = {i}" for i in range(FUNCTION_LINES))
    source = (f"def builder():\n    @T.prim_func\n    def kernel():\n{body}\n"
              f"    @T.macro\n    def step():\n{body}\n    return kernel\n")
    assert long_functions(source, "k.py") == [f"k.py:{FUNCTION_LINES + 5} step ({FUNCTION_LINES + 1} lines)"]
