"""Comments and docstrings say what the code does and why, not which tracker thread asked for
it: no comment or docstring in the project's packages names an issue or pull request by its
number (the word followed by a number, or a number after ``#``). Read as tokens, so strings the
code uses (a choice id such as ``"g#1"``, an HTTP status) are never looked at."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("station", "host", "gnosis_daemon", "supervisor", "bench", "tests")

# the word, then its number: "Issue N", "issue #N", "PR N", "pull request N", "ticket N"
NAMED = re.compile(r"\b(?:issues?|tickets?|pull requests?|PRs?)\s*#?\s*\d+\b", re.IGNORECASE)
# a bare reference: "(#N)", "see #N"; not a choice id ("g#" and a number) nor an HTML entity
HASHED = re.compile(r"(?<![\w&#/])#\d+\b")


def _sources() -> list[Path]:
    return sorted(path for package in PACKAGES for path in (REPO / package).rglob("*.py")
                  if "__pycache__" not in path.parts)


def remarks(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment (its leading ``#`` taken off) and every docstring."""
    found = [(tok.start[0], tok.string.lstrip("#"))
             for tok in tokenize.generate_tokens(io.StringIO(source).readline)
             if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                found.append((node.body[0].lineno, doc))
    return found


def numbered(text: str) -> list[str]:
    named = [m.group(0) for m in NAMED.finditer(text)]
    return named + HASHED.findall(NAMED.sub(" ", text))


def test_numbered_finds_references_and_nothing_else():
    word = "iss" + "ue"  # spelled apart, so this file passes its own test
    assert numbered(f"{word} 13 in the engine") == [f"{word} 13"]
    assert numbered(f"the {word.title()} #7 fix, PR 12, (#40)") == [f"{word.title()} #7", "PR 12", "#40"]
    assert numbered('choices "g#1" and "h#2", &#13;, a 404 for a bad body') == []
    assert numbered(f"what the {word} asks for, {word}s of a frame: 3 of them") == []


def test_remarks_reads_comments_and_docstrings_only():
    source = ('"""Module doc 1."""\nX = "#5"  # a comment 2\n'
              'def f():\n    """Doc 3."""\n    return "issue 4"\n')
    assert [text.strip() for _, text in remarks(source)] == ["a comment 2", "Module doc 1.", "Doc 3."]


@pytest.mark.parametrize("package", PACKAGES)
def test_no_comment_or_docstring_names_an_issue_number(package):
    found = []
    for path in _sources():
        if path.relative_to(REPO).parts[0] != package:
            continue
        for line, text in remarks(path.read_text()):
            for hit in numbered(text):
                found.append(f"{path.relative_to(REPO)}:{line}: {hit!r}")
    assert not found, "say what the code does instead of naming the issue:\n" + "\n".join(found)
