"""docs/structure.md, the module map, against the tree; the width of the docs a newcomer reads first.

The map's convention (its first lines): one table row per file, the file named in the row's first cell in backticks,
a package module relative to `dflash_sglang/` (`core/speculate.py`), anything else relative to the repository root
(`scripts/setup.sh`). A package's `__init__.py` needs no row; its `__main__.py` may be covered by a row naming its
folder (`bench/gpu/train/`). Widths count characters (not bytes), outside code fences: prose lines at most 120, table
rows at most 200.
"""
from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "dflash_sglang"
STRUCTURE = ROOT / "docs" / "structure.md"
WIDE_DOCS = [STRUCTURE, ROOT / "docs" / "testing.md"]
PROSE_WIDTH, ROW_WIDTH = 120, 200
FILE_SUFFIXES = (".py", ".sh", ".md", ".cu", ".cuh", ".cpp", ".toml")
CUDA_SUFFIXES = (".cu", ".cuh", ".cpp")
TICKED = re.compile(r"`([^`]+)`")


def _lines(path: Path) -> list[tuple[int, str]]:
    """(line number, line) of a markdown file, code fences (and their fence lines) left out."""
    out, fenced = [], False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, line))
    return out


def _is_row(line: str) -> bool:
    return line.lstrip().startswith("|")


def _resolve(name: str) -> list[Path]:
    """What a backticked path names: relative to dflash_sglang/ first, else to the repository root (globs expanded)."""
    for base in (PACKAGE, ROOT):
        found = sorted(base.glob(name)) if "*" in name else [base / name] if (base / name).exists() else []
        if found:
            return found
    return []


def _entries() -> list[tuple[int, str]]:
    """(line number, backticked name) of every path in a table row's first cell."""
    out = []
    for number, line in _lines(STRUCTURE):
        if not _is_row(line):
            continue
        first = line.strip().strip("|").split("|")[0]
        out.extend((number, name) for name in TICKED.findall(first) if "/" in name or name.endswith(FILE_SUFFIXES))
    return out


def _files_of(entries: list[tuple[int, str]]) -> Counter:
    """How many rows name each file (a folder entry covers its __init__.py and __main__.py)."""
    named: Counter = Counter()
    for _, name in entries:
        for path in _resolve(name):
            if path.is_dir():
                named.update(p for p in (path / "__init__.py", path / "__main__.py") if p.exists())
            else:
                named[path] += 1
    return named


def _required() -> list[Path]:
    """Every module of the package (but __init__.py), every file under scripts/, every CUDA source."""
    modules = [p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts and p.name != "__init__.py"]
    scripts = [p for p in (ROOT / "scripts").rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    cuda = [p for p in (ROOT / "cuda").iterdir() if p.suffix in CUDA_SUFFIXES]
    return sorted(modules + scripts + cuda)


def test_every_module_script_and_kernel_has_one_row():
    named = _files_of(_entries())
    missing = [str(p.relative_to(ROOT)) for p in _required() if named[p] == 0]
    twice = [str(p.relative_to(ROOT)) for p, count in named.items() if count > 1]
    assert not missing, f"docs/structure.md has no row for: {missing}"
    assert not twice, f"docs/structure.md has more than one row for: {twice}"


def test_rows_follow_the_path_convention():
    wrong = [(n, name) for n, name in _entries() if name.startswith("dflash_sglang/")]
    unknown = [(n, name) for n, name in _entries() if not _resolve(name)]
    assert not wrong, f"name package modules relative to dflash_sglang/: {wrong}"
    assert not unknown, f"rows naming nothing in the tree (line, name): {unknown}"


def test_every_named_file_exists():
    stale = []
    for number, line in _lines(STRUCTURE):
        for ticked in TICKED.findall(line):
            stale.extend((number, word) for word in ticked.split()
                         if word.endswith(FILE_SUFFIXES) and not _resolve(word))
    assert not stale, f"docs/structure.md names files that do not exist (line, name): {stale}"


@pytest.mark.parametrize("doc", WIDE_DOCS, ids=lambda p: p.name)
def test_width(doc: Path):
    over = [(number, len(line)) for number, line in _lines(doc)
            if len(line) > (ROW_WIDTH if _is_row(line) else PROSE_WIDTH)]
    assert not over, (f"{doc.relative_to(ROOT)}: lines over {PROSE_WIDTH} characters (table rows: {ROW_WIDTH}), "
                      f"(line, characters): {over}")
