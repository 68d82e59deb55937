"""The docs point at what exists: every repository path and every `module.name` cited in the README
and docs/ is in the tree, the README's status cells are one short sentence, and every figure they
quote stands on the current-figures page (docs/figures.md), which stays one page with a command a row."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
TOP = ("bench", "compiler", "docs", "eval", "models", "passes", "qwc", "runtime", "scripts", "tests", ".ci")
PATH = re.compile(r"(?<![\w./~$<-])((?:%s)/[\w./-]*[\w/])" % "|".join(re.escape(t) for t in TOP))
NAME = re.compile(r"`(\w+)\.(\w+)`")
EXTENSIONS = {"py", "md", "json", "txt", "so", "bin", "jsonl", "onnx", "gguf", "qwc", "sh", "svg", "data", "toml",
              "safetensors", "jinja", "ckpt", "tmp", "pt", "png", "log"}
FIGURE = re.compile(r"-?\d[\d,.]*(?:-\d[\d,.]*)?(?:x|%)")


def _modules() -> dict[str, list[Path]]:
    out: dict[str, list[Path]] = {}
    for d in ("qwc", "models", "passes", "compiler", "runtime", "eval", "bench", "scripts"):
        for f in (ROOT / d).rglob("*.py"):
            out.setdefault(f.stem, []).append(f)
    return out


def _defines(files: list[Path], name: str) -> bool:
    pattern = re.compile(r"^\s*(?:async\s+)?(?:def|class)\s+{0}\b|^\s*{0}\s*[:=]|\b{0}\s*=".format(re.escape(name)), re.M)
    return any(pattern.search(f.read_text()) for f in files)


def stale_citations(docs: list[Path]) -> list[str]:
    """`doc: what` for each cited path that is not in the tree and each `module.name` that its
    module does not define (a path may end in `.name`: `passes/verify.run_steps`)."""
    modules, bad = _modules(), []
    for doc in docs:
        text = doc.read_text()
        for m in PATH.finditer(text):
            p = m.group(1).rstrip("/.")
            if (ROOT / p).exists():
                continue
            stem, _, attr = p.rpartition(".")
            if attr not in EXTENSIONS and (ROOT / (stem + ".py")).is_file() and _defines([ROOT / (stem + ".py")], attr):
                continue
            bad.append(f"{doc.name}: {p}")
        for m in NAME.finditer(text):
            mod, name = m.groups()
            if mod in modules and name not in EXTENSIONS and not _defines(modules[mod], name):
                bad.append(f"{doc.name}: {mod}.{name}")
    return bad


def status_cells() -> list[str]:
    text = (ROOT / "README.md").read_text()
    table = text[text.index("## Status"):].split("\n\n")[1]
    return [cell.strip() for row in table.splitlines()[2:] for cell in row.strip("|").split("|")]


def test_every_cited_path_and_name_exists():
    assert stale_citations(DOCS) == []


def test_a_planted_stale_path_is_found(tmp_path):
    doc = tmp_path / "planted.md"
    doc.write_text("See `compiler/kernels/attention_old.py` and `prefill_attention.widen_part`, "
                   "beside `compiler/kernels/prefill_attention.py` and `prefill_attention.widen_span`.\n")
    assert stale_citations([doc]) == ["planted.md: compiler/kernels/attention_old.py",
                                      "planted.md: prefill_attention.widen_part"]


def test_readme_status_cells_are_short():
    cells = status_cells()
    assert len(cells) >= 20
    assert [c[:60] for c in cells if len(c) > 250] == []


def test_readme_status_figures_are_on_the_figures_page():
    figures = (ROOT / "docs" / "figures.md").read_text()
    quoted = [f for c in status_cells() for f in FIGURE.findall(c)]
    assert len(quoted) >= 8
    assert [f for f in quoted if f not in figures] == []


def test_figures_page_is_one_page_with_a_command_a_row():
    lines = (ROOT / "docs" / "figures.md").read_text().splitlines()
    assert len(lines) <= 150
    rows = [ln for ln in lines if ln.startswith("| ") and not ln.startswith("| area") and not ln.startswith("| ---")]
    assert len(rows) >= 30
    for row in rows:
        command = row.strip("|").split("|")[-1].strip()
        assert "`" in command or command == "the same", row


def _slug(heading: str) -> str:
    """A Markdown heading's anchor as GitHub makes it."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_and_its_anchor_resolves():
    headings = {d: {_slug(h) for h in re.findall(r"^#+ (.+)$", d.read_text(), re.M)} for d in DOCS}
    bad = []
    for doc in DOCS:
        for target, anchor in re.findall(r"\]\(([\w./-]*\.md)?(?:#([\w-]+))?\)", doc.read_text()):
            f = (doc.parent / target).resolve() if target else doc
            if f not in headings or (anchor and anchor not in headings[f]):
                bad.append(f"{doc.name} -> {target}#{anchor}")
    assert bad == []


# A measured figure in prose: a ratio or a share ("1.34x", "0.78-0.86x", "40%"); "4x8" and
# "0x10" are shapes and numbers, not figures
PROSE_FIGURE = re.compile(r"(?<![\w.])-?\d[\d,.]*(?:-\d[\d,.]*)?(?:x|%)(?!\w)")
CODE_FOLDERS = ("qwc", "models", "passes", "compiler", "runtime", "eval", "bench", "scripts")
DESIGN_LINES = 600


def code_prose(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring in `source`."""
    import io
    import tokenize

    toks = list(tokenize.generate_tokens(io.StringIO(source).readline))
    out = []
    for i, t in enumerate(toks):
        before = toks[i - 1].type if i else tokenize.NEWLINE
        if t.type == tokenize.COMMENT or (
                t.type == tokenize.STRING and before in (tokenize.INDENT, tokenize.NEWLINE, tokenize.NL, tokenize.DEDENT)
                and t.string.lstrip("rbuRBU").startswith(('"""', "'''"))):
            out.append((t.start[0], t.string))
    return out


def figures_in_code(paths) -> list[str]:
    return [f"{p.relative_to(ROOT) if p.is_relative_to(ROOT) else p.name}:{line}: {m.group()}" for p in paths for line, text in code_prose(p.read_text())
            for m in PROSE_FIGURE.finditer(text)]


def test_design_states_decisions_not_figures():
    """design.md holds the design and its reasons; what was measured is on figures.md and in
    history/, where a decision links (issue: docs that state the present)."""
    text = (ROOT / "docs" / "design.md").read_text()
    assert len(text.splitlines()) <= DESIGN_LINES
    assert PROSE_FIGURE.findall(text) == []


def test_code_comments_hold_no_figures():
    """A comment says why, not how fast: its figure would go stale where the docs' are replaced."""
    paths = [p for d in CODE_FOLDERS for p in sorted((ROOT / d).rglob("*.py"))]
    assert len(paths) > 100
    assert figures_in_code(paths) == []


def test_the_figure_checks_see_what_they_look_for(tmp_path):
    f = tmp_path / "k.py"
    f.write_text('"""Decode takes 0.78-0.86x the time."""\nx = "2x"  # a 4x8 tile, 40% fewer\ny = 0x10\n')
    assert [w.split(": ")[1] for w in figures_in_code([f])] == ["0.78-0.86x", "40%"]
