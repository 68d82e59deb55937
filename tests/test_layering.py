"""The package's import graph, read from the sources (every import, at module level or inside a
function): no module imports itself through others, and the stages import only earlier ones,
so a runtime-only install needs none of the compiler's dependencies and nothing of the CLI."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _modules() -> dict[str, Path]:
    dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    out = {}
    for pkg, d in dirs.items():
        for f in (ROOT / d).rglob("*.py"):
            rel = f.relative_to(ROOT / d).with_suffix("").parts
            parts = [p for p in rel if p != "__init__"]
            out[".".join([pkg, *parts])] = f
    return out


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    graph = {}
    for name, f in mods.items():
        here = name.split(".") if f.name == "__init__.py" else name.split(".")[:-1]
        deps = set()
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(here[:len(here) - node.level + 1] + ([base] if base else []))
                deps.update(f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names)
        graph[name] = {d for d in deps if d in mods and d != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while (w := stack.pop()) != v:
                comp.append(w)
            if comp:
                out.append(sorted([v, *comp]))
    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_module_imports_itself_through_others():
    graph = import_graph(_modules())
    assert len(graph) > 100 and "qwc.runtime.scheduler" in graph["qwc.runtime.engine"]   # the graph was read
    assert cycles(graph) == []


def test_a_planted_cycle_is_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_stages_import_only_earlier_ones():
    """models/ and passes/ import no compiler, runtime or CLI; runtime/ imports no compiler,
    models, passes or CLI (what it runs was compiled elsewhere)."""
    graph = import_graph(_modules())
    later = {"qwc.models": ("qwc.compiler", "qwc.runtime", "qwc.cli", "qwc.eval"),
             "qwc.passes": ("qwc.compiler", "qwc.runtime", "qwc.cli", "qwc.eval"),
             "qwc.runtime": ("qwc.compiler", "qwc.models", "qwc.passes", "qwc.cli", "qwc.eval")}
    wrong = sorted((m, d) for m, deps in graph.items() for stage, banned in later.items()
                   if m.startswith(stage + ".") for d in deps if d.startswith(banned))
    assert wrong == []


def test_only_the_kernel_registry_names_an_isa_folder():
    """compiler/kernels/arm and x86 are imported by nothing but themselves: shared modules find
    an ISA's kernels and constants through the registry (compiler/kernels/__init__.py), by the
    names the target table gives, so a new ISA or format adds a folder and table entries, not
    imports across the compiler."""
    graph = import_graph(_modules())
    isa = ("qwc.compiler.kernels.arm", "qwc.compiler.kernels.x86")
    assert "qwc.compiler.kernels.arm.dotprod" in graph   # the graph was read
    # (a benchmark of one ISA's kernel, qwc.bench, reads that kernel by its module)
    wrong = sorted((m, d) for m, deps in graph.items() if not m.startswith((*isa, "qwc.bench"))
                   for d in deps if d.startswith(isa))
    assert wrong == []


def test_every_package_folder_is_installed():
    """pyproject.toml lists the packages one by one (the stage folders install under qwc.): a
    new folder of modules (an ISA's kernels, say) must be listed there, or an installed qwc
    lacks it while the tests, run from the checkout, still pass."""
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(tool["packages"])
    folders = {".".join([pkg, *f.parent.relative_to(ROOT / d).parts])
               for pkg, d in tool["package-dir"].items() for f in (ROOT / d).rglob("*.py")}
    assert folders - listed == set()


def test_building_the_cli_imports_only_qwc_and_the_runtime():
    """Every command builds the whole parser: a runtime-only install (no qwc.models, no compiler)
    must be able to, and a start pays for no stage it does not run."""
    import json
    import subprocess
    import sys

    code = ("import json, sys; from qwc.cli import build_parser; build_parser(); "
            "print(json.dumps(sorted({m.split('.')[1] for m in sys.modules if m.startswith('qwc.')})))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = set(json.loads(r.stdout))
    assert not loaded & {"models", "passes", "compiler", "eval", "bench"}, loaded
