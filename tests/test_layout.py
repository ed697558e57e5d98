"""The architecture rules, checked statically: every module is parsed with ``ast``, none is
imported (so a rule breaks here even where a module would fail to import).

What counts as an import: the ``import`` and ``from ... import`` statements that run when a
module is loaded, i.e. module-level and class-level statements, including those nested in
module-level ``if``/``try``/``with``/``for``/``while`` blocks. Not counted:

- imports inside a function or method body: they run at call time, not at load time, and
  are the standard way to break a load-time cycle or to keep a heavy dependency lazy
  (``gnosis_daemon/cli.py`` imports the supervisor, station and host this way, so ``cli.py``
  needs no exception to the ground-floor rule);
- imports under ``if TYPE_CHECKING:`` (their ``else:`` branch does count): they never run.

``from a.b import c`` is an import of the module ``a.b.c`` when that is a module or package
of the project, else of ``a.b``; relative imports are resolved against the importer's
package. The layer rules look at the module named. The cycle check also follows the
packages Python initialises on the way (``import a.b.c`` runs ``a/__init__.py`` and
``a/b/__init__.py``), except the importer's own enclosing packages, which are already
initialising by the time it runs.
"""

from __future__ import annotations

import ast
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("gnosis_daemon", "station", "host", "supervisor", "bench")
MAX_LINES = 400
# the station's rooms that hold tensors or run the model (everything but the core, the socket
# side and the entry)
TORCH_SIDE = ("station.model", "station.kernels", "station.forward", "station.plan",
              "station.sampling", "station.tier", "station.engine")


@dataclass(frozen=True)
class Import:
    importer: str  # module name
    file: str  # the importer's path, relative to the tree's root
    line: int
    target: str  # module name, resolved as the module docstring says

    def where(self) -> str:
        return f"{self.file}:{self.line}"


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules(root: Path = REPO) -> dict[str, Path]:
    """Module name -> file, for every ``.py`` under the project's packages."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            if "__pycache__" not in path.parts:
                modules[module_name(path, root)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _load_time_statements(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """The statements that run when the module is loaded: module and class bodies and the
    blocks nested in them, not function bodies, not ``if TYPE_CHECKING:`` bodies."""
    for stmt in body:
        yield stmt
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if isinstance(stmt, ast.If) and _is_type_checking(stmt.test):
            yield from _load_time_statements(stmt.orelse)
            continue
        for block in ("body", "orelse", "finalbody"):
            yield from _load_time_statements(getattr(stmt, block, None) or [])
        for handler in getattr(stmt, "handlers", None) or []:
            yield from _load_time_statements(handler.body)
        for case in getattr(stmt, "cases", None) or []:
            yield from _load_time_statements(case.body)


def imports_of(name: str, path: Path, root: Path, modules: Collection[str]) -> list[Import]:
    """The load-time imports of one module, each resolved to a module name."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    file = str(path.relative_to(root))
    found = []
    for stmt in _load_time_statements(tree.body):
        if isinstance(stmt, ast.Import):
            found += [Import(name, file, stmt.lineno, alias.name) for alias in stmt.names]
        elif isinstance(stmt, ast.ImportFrom):
            if stmt.level:  # relative: level 1 is the importer's own package
                parts = package.split(".")
                parts = parts[:len(parts) - (stmt.level - 1)]
                base = ".".join(parts + ([stmt.module] if stmt.module else []))
            else:
                base = stmt.module or ""
            for alias in stmt.names:
                candidate = f"{base}.{alias.name}"
                target = candidate if alias.name != "*" and candidate in modules else base
                found.append(Import(name, file, stmt.lineno, target))
    return found


def all_imports(modules: dict[str, Path], root: Path) -> list[Import]:
    return [imp for name, path in modules.items() for imp in imports_of(name, path, root, modules)]


@cache
def _project() -> tuple[dict[str, Path], tuple[Import, ...]]:
    modules = project_modules()
    return modules, tuple(all_imports(modules, REPO))


# -- the checks, shared by the rules and by the checker's own tests below
def long_modules(modules: dict[str, Path], root: Path) -> list[str]:
    too_long = []
    for path in modules.values():
        with path.open() as f:
            n = sum(1 for _ in f)
        if n > MAX_LINES:
            too_long.append(f"{path.relative_to(root)}: {n} lines")
    return too_long


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def layer_violations(edges: Iterable[Import], importers: str,
                     forbidden: tuple[str, ...]) -> list[str]:
    """``file:line: importer imports target`` for each load-time import by a module under
    ``importers`` of a module under one of ``forbidden``."""
    return [f"{imp.where()}: {imp.importer} imports {imp.target}" for imp in edges
            if _within(imp.importer, importers) and any(_within(imp.target, f) for f in forbidden)]


def _with_parent_packages(edges: Iterable[Import]) -> Iterator[Import]:
    """Each import, and one to each package that loading its target initialises first
    (not the importer's own enclosing packages: those are initialising already)."""
    for imp in edges:
        parts = imp.target.split(".")
        for i in range(1, len(parts)):
            parent = ".".join(parts[:i])
            if not _within(imp.importer, parent):
                yield replace(imp, target=parent)
        yield imp


def find_cycle(edges: Iterable[Import]) -> list[Import] | None:
    """One load-time import cycle among the modules, as its imports in order, or None.
    (A module importing itself, e.g. ``from . import name`` in a package's ``__init__``,
    is no cycle.)"""
    graph: dict[str, list[Import]] = {}
    for imp in _with_parent_packages(edges):
        if imp.target != imp.importer:
            graph.setdefault(imp.importer, []).append(imp)
    done: set[str] = set()
    stack: list[str] = []  # the modules on the current path; path[i] is imported by stack[i]
    path: list[Import] = []

    def visit(node: str) -> list[Import] | None:
        stack.append(node)
        for imp in graph.get(node, []):
            if imp.target in stack:
                return path[stack.index(imp.target):] + [imp]
            if imp.target in graph and imp.target not in done:
                path.append(imp)
                cycle = visit(imp.target)
                if cycle:
                    return cycle
                path.pop()
        stack.pop()
        done.add(node)
        return None

    for node in sorted(graph):
        if node not in done:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def describe_cycle(cycle: list[Import]) -> str:
    steps = "\n".join(f"  {imp.importer} -> {imp.target}  ({imp.where()})" for imp in cycle)
    return f"import cycle at load time through {len(cycle)} module(s):\n{steps}"


# -- the rules
def test_no_module_is_over_400_lines():
    modules, _ = _project()
    too_long = long_modules(modules, REPO)
    assert not too_long, (f"modules over {MAX_LINES} lines (split them by concept):\n"
                          + "\n".join(too_long))


def test_no_import_cycle_among_the_project_modules():
    _, edges = _project()
    cycle = find_cycle(edges)
    assert cycle is None, describe_cycle(cycle)


def test_the_ground_floor_imports_no_worker():
    """``gnosis_daemon/`` is what the supervisor, station and host share, so it knows none
    of them at load time. ``cli.py``, the one place that knows all three, imports each
    inside ``main`` (at call time), so it needs no exception."""
    _, edges = _project()
    bad = layer_violations(edges, "gnosis_daemon", ("station", "host", "supervisor"))
    assert not bad, "gnosis_daemon/ imports a worker at load time:\n" + "\n".join(bad)


def test_station_core_imports_nothing_above_it():
    _, edges = _project()
    bad = layer_violations(edges, "station.core", TORCH_SIDE + ("station.serving",
                                                   "station.main", "host", "supervisor"))
    assert not bad, "station/core/ imports above itself:\n" + "\n".join(bad)


def test_the_torch_side_imports_no_socket_side():
    _, edges = _project()
    bad = [b for room in TORCH_SIDE
           for b in layer_violations(edges, room, ("station.serving", "station.main"))]
    assert not bad, "the station's torch side imports the socket side or the entry:\n" + "\n".join(bad)


def test_the_host_imports_no_station_or_supervisor():
    _, edges = _project()
    bad = layer_violations(edges, "host", ("station", "supervisor"))
    assert not bad, "host/ imports another process's code:\n" + "\n".join(bad)


def test_the_supervisor_imports_no_station_or_host():
    _, edges = _project()
    bad = layer_violations(edges, "supervisor", ("station", "host"))
    assert not bad, "supervisor/ imports a child's code:\n" + "\n".join(bad)


# -- the checker itself, on planted trees
def _plant(root: Path, files: dict[str, str]) -> tuple[dict[str, Path], list[Import]]:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    modules = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    return modules, all_imports(modules, root)


def test_the_checker_counts_load_time_imports_only(tmp_path):
    _, edges = _plant(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/sub/__init__.py": "from . import leaf\n",
        "pkg/sub/leaf.py": "from .. import sub\nfrom ..sub import leaf as me\n",
        "pkg/a.py": (
            "from typing import TYPE_CHECKING\n"
            "import pkg.sub\n"  # 2: pkg.sub
            "from pkg.sub import leaf, name\n"  # 3: pkg.sub.leaf and pkg.sub
            "from .sub.leaf import thing\n"  # 4: pkg.sub.leaf
            "if TYPE_CHECKING:\n    import pkg.b\nelse:\n    import pkg.c\n"  # 8: pkg.c only
            "try:\n    import pkg.d\nexcept ImportError:\n    import pkg.e\n"  # 10, 12
            "class K:\n    import pkg.f\n"  # 14: a class body runs at load time
            "def f():\n    import pkg.g\n"  # call time: not counted
            "class L:\n    def m(self):\n        import pkg.h\n"),  # call time: not counted
    })
    assert {(imp.importer, imp.where(), imp.target) for imp in edges} == {
        ("pkg.sub", "pkg/sub/__init__.py:1", "pkg.sub.leaf"),
        ("pkg.sub.leaf", "pkg/sub/leaf.py:1", "pkg.sub"),
        ("pkg.sub.leaf", "pkg/sub/leaf.py:2", "pkg.sub.leaf"),
        ("pkg.a", "pkg/a.py:1", "typing"), ("pkg.a", "pkg/a.py:2", "pkg.sub"),
        ("pkg.a", "pkg/a.py:3", "pkg.sub.leaf"), ("pkg.a", "pkg/a.py:3", "pkg.sub"),
        ("pkg.a", "pkg/a.py:4", "pkg.sub.leaf"), ("pkg.a", "pkg/a.py:8", "pkg.c"),
        ("pkg.a", "pkg/a.py:10", "pkg.d"), ("pkg.a", "pkg/a.py:12", "pkg.e"),
        ("pkg.a", "pkg/a.py:14", "pkg.f")}


def test_the_checker_reports_a_planted_cycle_breach_and_long_module(tmp_path):
    modules, edges = _plant(tmp_path, {
        "station/__init__.py": "",
        "station/core/__init__.py": "",
        "station/core/w.py": "import station.core.x\n",
        "station/core/x.py": "from station.core import y\n",
        "station/core/y.py": "import os\nimport station.core.z\n",
        "station/core/z.py": "from station.core.x import thing\nfrom station.runtime import e\n",
        "station/runtime/__init__.py": "",
        "station/runtime/e.py": "def f():\n    import station.core.w\n" + "\n" * MAX_LINES,
    })
    cycle = find_cycle(edges)
    assert cycle is not None and describe_cycle(cycle) == (
        "import cycle at load time through 3 module(s):\n"
        "  station.core.x -> station.core.y  (station/core/x.py:1)\n"
        "  station.core.y -> station.core.z  (station/core/y.py:2)\n"
        "  station.core.z -> station.core.x  (station/core/z.py:1)")
    assert find_cycle([imp for imp in edges if imp.importer != "station.core.z"]) is None
    assert layer_violations(edges, "station.core", ("station.runtime", "host")) == [
        "station/core/z.py:2: station.core.z imports station.runtime.e"]
    assert layer_violations(edges, "station.runtime", ("station.core",)) == []  # call time
    assert long_modules(modules, tmp_path) == [f"station/runtime/e.py: {MAX_LINES + 2} lines"]


def test_the_checker_follows_the_packages_an_import_initialises(tmp_path):
    _, edges = _plant(tmp_path, {
        "pkg/__init__.py": "from other import helper\n",
        "pkg/leaf.py": "import pkg.sub.deep\n",  # pkg is its own package: no edge to it
        "pkg/sub/__init__.py": "",
        "pkg/sub/deep.py": "",
        "other.py": "import pkg.leaf\n",  # runs pkg/__init__.py first, which imports other
    })
    assert describe_cycle(find_cycle(edges)) == (
        "import cycle at load time through 2 module(s):\n"
        "  other -> pkg  (other.py:1)\n"
        "  pkg -> other  (pkg/__init__.py:1)")
    assert find_cycle([imp for imp in edges if imp.importer != "other"]) is None
