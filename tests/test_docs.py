"""The docs name what the tree holds: docs/engine.md's tree of ``station/`` lists exactly the
modules there are, every path and dotted module name a doc gives exists, every section another
file quotes by name is there, and docs/engine.md stays a reference of at most ``MAX_LINES``.

Read as text only: nothing here imports the station."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

from tests.test_comments import remarks

REPO = Path(__file__).resolve().parents[1]
ENGINE_DOC = REPO / "docs" / "engine.md"
DOCS = sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]
MAX_LINES = 600
PACKAGES = ("station", "host", "gnosis_daemon", "supervisor", "bench", "tests")
TREE_SOURCES = (".py", ".c", ".h")

# `station/core/kv_manager.py`, tests/station/tier/test_tier_layouts.py, host/session_names.py
PATH = re.compile(r"(?<![\w./-])((?:%s)/[\w/.-]*\w\.(?:py|c|h|sh))\b" % "|".join(PACKAGES))
# station.main._TorchThread, station.tier.io.worker: a module, then perhaps one of its names
DOTTED = re.compile(r"(?<![\w./-])((?:station|host|gnosis_daemon)(?:\.\w+)+)")
# files beside a station's socket, not modules: station.sock, station.key, station.key_secret
NOT_MODULES = {"sock", "key", "key_secret", "log", "json", "lock", "pid", "toml"}
# docs/engine.md, "The disk tier" / `docs/engine.md`, "Attention per layer"
SECTION_REF = re.compile(r"(?:docs/)?(\w+)\.md`?,?\s+\(?\"([^\"]+)\"")


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO))


def _tree_block(text: str) -> list[str]:
    """The code block under ``## The tree``: the lines of the ``station/`` listing."""
    section = text.split("\n## The tree", 1)[1]
    block = section.split("```", 2)[1]
    return [line for line in block.splitlines()[1:] if line.strip()]


def tree_paths(text: str) -> set[str]:
    """Every file the tree names, as repo paths: a line is ``<indent><name> <what it is>``,
    a name ending in ``/`` opens a directory, ``a.py, .c`` names ``a.py`` and ``a.c``."""
    paths: set[str] = set()
    stack: list[tuple[int, str]] = []
    for line in _tree_block(text):
        indent = len(line) - len(line.lstrip())
        names = re.match(r"\s*([\w./]+(?:, \.\w+)*)", line).group(1)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        base = "/".join(name.rstrip("/") for _, name in stack)
        first, *others = names.split(", ")
        if first.endswith("/"):
            stack.append((indent, first))
            continue
        stem = first.rsplit(".", 1)[0]
        for name in [first, *(stem + ext for ext in others)]:
            paths.add(f"{base}/{name}" if base else name)
    return paths


def station_sources() -> set[str]:
    return {_rel(path) for path in (REPO / "station").rglob("*")
            if path.suffix in TREE_SOURCES and path.name != "__init__.py"
            and "__pycache__" not in path.parts}


@functools.cache
def _top_level_names(source: Path) -> frozenset[str]:
    """What a module defines or imports at its top level (its classes, functions, names)."""
    names: set[str] = set()
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for target in targets for n in ast.walk(target)
                         if isinstance(n, ast.Name))
    return frozenset(names)


def _module_exists(dotted: str) -> bool:
    """``dotted`` is a module or package, or a module followed by a name it defines (and
    perhaps that name's attribute: ``Class.method``)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        base = REPO.joinpath(*parts[:cut])
        source = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
        if not source.exists():
            continue
        rest = parts[cut:]
        return not rest or (len(rest) <= 2 and rest[0] in _top_level_names(source))
    return False


def _headings(doc: Path) -> list[str]:
    """A doc's sections: its headings, and the bold leads that open a paragraph (``**Why.**``)."""
    lines = doc.read_text().splitlines()
    headings = [line.lstrip("#").strip() for line in lines if line.startswith("#")]
    leads = [line[2:].split("**", 1)[0] for line in lines if line.startswith("**")]
    return [text.replace("`", "") for text in headings + leads]


def test_engine_doc_is_a_reference_of_at_most_600_lines():
    lines = ENGINE_DOC.read_text().count("\n")
    assert lines <= MAX_LINES, f"docs/engine.md has {lines} lines (at most {MAX_LINES})"


def test_the_engine_docs_tree_lists_exactly_the_station_modules():
    listed = tree_paths(ENGINE_DOC.read_text())
    assert "station/main.py" in listed and "station/core/kv_manager.py" in listed
    missing = sorted(listed - station_sources())
    unlisted = sorted(station_sources() - listed)
    assert not missing, f"docs/engine.md's tree names modules that do not exist: {missing}"
    assert not unlisted, f"modules missing from docs/engine.md's tree: {unlisted}"


def test_tree_paths_reads_directories_and_shared_stems():
    text = ("\n## The tree\n\n```\nstation/\n  main.py   the entry\n  kernels/   forms\n"
            "    cpu_step.py, .c   the step\n  tier/   disk\n    io/process.py   pipe\n"
            "    store/   files\n      index.py   index\n  core/   policy\n```\n")
    assert tree_paths(text) == {"station/main.py", "station/kernels/cpu_step.py",
                                "station/kernels/cpu_step.c", "station/tier/io/process.py",
                                "station/tier/store/index.py"}


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_every_path_a_doc_names_exists(doc):
    named = set(PATH.findall(doc.read_text()))
    missing = sorted(path for path in named if not (REPO / path).exists())
    assert not missing, f"{_rel(doc)} names files that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_every_dotted_module_a_doc_names_exists(doc):
    named = {name for name in DOTTED.findall(doc.read_text())
             if name.split(".")[-1] not in NOT_MODULES}
    missing = sorted(name for name in named if not _module_exists(name))
    assert not missing, f"{_rel(doc)} names modules that do not exist: {missing}"


def test_every_dotted_module_a_comment_or_docstring_names_exists():
    """A module renamed or moved leaves no comment or docstring naming it by its old name."""
    missing = []
    for path in _referring_files():
        if path.suffix != ".py":
            continue
        for line, text in remarks(path.read_text()):
            for name in DOTTED.findall(text):
                if name.split(".")[-1] not in NOT_MODULES and not _module_exists(name):
                    missing.append(f"{_rel(path)}:{line}: {name}")
    assert not missing, "modules named that do not exist:\n" + "\n".join(missing)


def _referring_files() -> list[Path]:
    files = list(DOCS)
    for package in PACKAGES:
        files += sorted((REPO / package).rglob("*.py"))
    return [path for path in files if "__pycache__" not in path.parts]


def test_every_doc_section_quoted_by_name_exists():
    """``docs/engine.md, "The disk tier"``: a heading of that doc begins with the quoted text
    (whitespace joined, so a quote broken over two comment lines counts too)."""
    broken = []
    for path in _referring_files():
        text = re.sub(r"\s*\n\s*#?\s*", " ", path.read_text())
        for doc_name, quoted in SECTION_REF.findall(text):
            doc = REPO / "docs" / f"{doc_name}.md"
            if doc_name == "README":
                doc = REPO / "README.md"
            if not doc.exists():
                continue
            if not any(heading.startswith(quoted.replace("`", "")) for heading in _headings(doc)):
                broken.append(f"{_rel(path)}: {doc_name}.md, \"{quoted}\"")
    assert not broken, "sections quoted by name that the docs do not have:\n" + "\n".join(broken)


def test_a_bench_run_keeps_the_past_measurements(tmp_path):
    """``make bench`` rewrites docs/benchmarks.md whole; the record of past measurements (and
    the fleet drill's section) are kept as they were."""
    from types import SimpleNamespace

    from bench.common import KEPT_MARKERS, Report

    begin, end = "<!-- past measurements:begin -->", "<!-- past measurements:end -->"
    assert (begin, end) in KEPT_MARKERS
    doc = (REPO / "docs" / "benchmarks.md").read_text()
    assert doc.count(begin) == doc.count(end) == 1 and doc.index(begin) < doc.index(end)
    past = begin + doc.split(begin, 1)[1].split(end, 1)[0] + end
    out = tmp_path / "benchmarks.md"
    out.write_text("# Benchmarks\n\nan old run's table\n\n" + past + "\n")
    report = Report()
    report.add("a figure", 1.0, "info", None, "measured")
    report.write(out, SimpleNamespace(model="m"),
                 SimpleNamespace(prompt_tokens=1, decode_tokens=1, streams=1))
    text = out.read_text()
    assert "an old run's table" not in text and "| a figure | 1.000 |" in text
    assert past in text
