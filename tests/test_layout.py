"""The architecture rules, checked statically: every module is parsed with ``ast``, none is
imported (so a rule breaks here even where a module would fail to import).

Every ``import`` and ``from ... import`` statement is an edge, tagged by when it runs:

- ``load``: module-level and class-level statements, including those nested in module-level
  ``if``/``try``/``with``/``for``/``while`` blocks (and the ``else:`` of ``if TYPE_CHECKING:``);
- ``type``: under ``if TYPE_CHECKING:``: never run, but the importer's annotations name the target;
- ``call``: inside a function or method body: run at call time.

The cycle rule counts every edge: a cycle hidden behind a type-only or a function-level import
is still two modules that each need the other, so the shared thing moves down to a module both
can import. A function-level import stays right for a heavy dependency kept lazy (torch,
transformers) and where ``gnosis_daemon/cli.py`` starts the supervisor, station and host. The
layer rules count the ``load`` edges only: what a module pulls in when it is loaded (so
``cli.py`` needs no exception to the ground-floor rule).

``from a.b import c`` is an import of the module ``a.b.c`` when that is a module or package
of the project, else of ``a.b``; relative imports are resolved against the importer's
package. The layer rules look at the module named. The cycle check also follows the
packages Python initialises on the way (``import a.b.c`` runs ``a/__init__.py`` and
``a/b/__init__.py``), except the importer's own enclosing packages, which are already
initialising by the time it runs.

A module over 400 lines is a signal to look, not a reason to cut a concept in two:
``LONG_MODULES`` names the few that may be longer, each with a one-line reason.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path
from typing import Literal

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("gnosis_daemon", "station", "host", "supervisor", "bench")
MAX_LINES = 400
# path (relative to the repository) -> why its one concept needs more than MAX_LINES lines
LONG_MODULES: dict[str, str] = {
    "station/tier/store/store.py": "the KV store is one class whose every change on disk holds "
                                   "one lock; its crash-safety contract is its docstring",
    "station/tier/disk_tier.py": "the tier's engine side is one queue of write and load jobs "
                                 "and the answers that drain it, under one lock",
}
# the station's rooms that hold tensors or run the model (everything but the core, the socket
# side and the entry)
TORCH_SIDE = ("station.model", "station.kernels", "station.forward", "station.plan",
              "station.sampling", "station.tier", "station.engine")


When = Literal["load", "type", "call"]


@dataclass(frozen=True)
class Import:
    importer: str  # module name
    file: str  # the importer's path, relative to the tree's root
    line: int
    target: str  # module name, resolved as the module docstring says
    when: When  # load, type or call, as the module docstring says

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


def _statements(body: list[ast.stmt], when: When = "load") -> Iterator[tuple[ast.stmt, When]]:
    """Every statement, with when it runs: ``load`` for module and class bodies and the blocks
    nested in them, ``type`` under ``if TYPE_CHECKING:``, ``call`` in a function body (an
    enclosing ``type`` wins: such a body never runs)."""
    for stmt in body:
        yield stmt, when
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield from _statements(stmt.body, "type" if when == "type" else "call")
            continue
        if isinstance(stmt, ast.If) and _is_type_checking(stmt.test):
            yield from _statements(stmt.body, "type")
            yield from _statements(stmt.orelse, when)
            continue
        for block in ("body", "orelse", "finalbody"):
            yield from _statements(getattr(stmt, block, None) or [], when)
        for handler in getattr(stmt, "handlers", None) or []:
            yield from _statements(handler.body, when)
        for case in getattr(stmt, "cases", None) or []:
            yield from _statements(case.body, when)


def imports_of(name: str, path: Path, root: Path, modules: Collection[str]) -> list[Import]:
    """Every import of one module, each resolved to a module name and tagged by when it runs."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    file = str(path.relative_to(root))
    found = []
    for stmt, when in _statements(tree.body):
        if isinstance(stmt, ast.Import):
            found += [Import(name, file, stmt.lineno, alias.name, when) for alias in stmt.names]
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
                found.append(Import(name, file, stmt.lineno, target, when))
    return found


def all_imports(modules: dict[str, Path], root: Path) -> list[Import]:
    return [imp for name, path in modules.items() for imp in imports_of(name, path, root, modules)]


def load_time(edges: Iterable[Import]) -> list[Import]:
    return [imp for imp in edges if imp.when == "load"]


@cache
def _project() -> tuple[dict[str, Path], tuple[Import, ...]]:
    modules = project_modules()
    return modules, tuple(all_imports(modules, REPO))


# -- the checks, shared by the rules and by the checker's own tests below
def long_modules(modules: dict[str, Path], root: Path,
                 allowed: Collection[str] = ()) -> list[str]:
    """``path: n lines`` for each module over MAX_LINES whose path is not in ``allowed``."""
    too_long = []
    for path in modules.values():
        with path.open() as f:
            n = sum(1 for _ in f)
        rel = str(path.relative_to(root))
        if n > MAX_LINES and rel not in allowed:
            too_long.append(f"{rel}: {n} lines")
    return too_long


def packages_without_purpose(root: Path, packages: Iterable[str]) -> list[str]:
    """``dir: why`` for each directory holding ``.py`` files under ``packages`` whose
    ``__init__.py`` is missing, or whose docstring does not open with one sentence on a line
    of its own (ending in a full stop, the next line blank or none)."""
    bad = []
    for package in packages:
        for d in sorted({p.parent for p in (root / package).rglob("*.py")
                         if "__pycache__" not in p.parts}):
            rel = d.relative_to(root)
            init = d / "__init__.py"
            if not init.exists():
                bad.append(f"{rel}: no __init__.py")
                continue
            doc = ast.get_docstring(ast.parse(init.read_text())) or ""
            lines = doc.splitlines() or [""]
            first = lines[0].strip()
            if not first.endswith("."):
                bad.append(f"{rel}: the docstring's first line is not a sentence: {first!r}")
            elif re.search(r"[.!?]\s+[A-Z`]", first) or (len(lines) > 1 and lines[1].strip()):
                bad.append(f"{rel}: the docstring's first line is not one sentence: {first!r}")
            elif len(first.split()) < 3:
                bad.append(f"{rel}: the docstring's first line states no purpose: {first!r}")
    return bad


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
    """One import cycle among the modules, as its imports in order, or None.
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
    steps = "\n".join(f"  {imp.importer} -> {imp.target}  ({imp.where()}, {imp.when})"
                      for imp in cycle)
    return f"import cycle through {len(cycle)} module(s):\n{steps}"


# -- the rules
def test_no_module_is_over_400_lines_but_the_named_exceptions():
    modules, _ = _project()
    too_long = long_modules(modules, REPO, LONG_MODULES)
    assert not too_long, (f"modules over {MAX_LINES} lines (look at their concept: split it, "
                          "or name the module in LONG_MODULES with why):\n" + "\n".join(too_long))


def test_each_named_long_module_exists_and_is_long():
    """An exception that no longer applies is dropped, not left to cover a later file."""
    modules, _ = _project()
    paths = {str(p.relative_to(REPO)) for p in modules.values()}
    stale = [path for path in LONG_MODULES if path not in paths or not long_modules(
        {path: REPO / path}, REPO)]
    assert not stale, "LONG_MODULES names modules that are not over the limit:\n" + "\n".join(stale)
    assert all(reason.strip() and "\n" not in reason for reason in LONG_MODULES.values())


def test_each_package_states_its_purpose_in_one_line():
    bad = packages_without_purpose(REPO, PACKAGES)
    assert not bad, "packages whose __init__ docstring does not open with their purpose:\n" + (
        "\n".join(bad))


def test_no_import_cycle_among_the_project_modules():
    """Counting type-only and function-level imports too."""
    _, edges = _project()
    cycle = find_cycle(edges)
    assert cycle is None, describe_cycle(cycle)


def test_the_ground_floor_imports_no_worker():
    """``gnosis_daemon/`` is what the supervisor, station and host share, so it knows none
    of them at load time. ``cli.py``, the one place that knows all three, imports each
    inside ``main`` (at call time), so it needs no exception."""
    edges = load_time(_project()[1])
    bad = layer_violations(edges, "gnosis_daemon", ("station", "host", "supervisor"))
    assert not bad, "gnosis_daemon/ imports a worker at load time:\n" + "\n".join(bad)


def test_station_core_imports_nothing_above_it():
    edges = load_time(_project()[1])
    bad = layer_violations(edges, "station.core", TORCH_SIDE + ("station.serving",
                                                   "station.main", "host", "supervisor"))
    assert not bad, "station/core/ imports above itself:\n" + "\n".join(bad)


def test_the_torch_side_imports_no_socket_side():
    edges = load_time(_project()[1])
    bad = [b for room in TORCH_SIDE
           for b in layer_violations(edges, room, ("station.serving", "station.main"))]
    assert not bad, "the station's torch side imports the socket side or the entry:\n" + "\n".join(bad)


def test_the_host_imports_no_station_or_supervisor():
    edges = load_time(_project()[1])
    bad = layer_violations(edges, "host", ("station", "supervisor"))
    assert not bad, "host/ imports another process's code:\n" + "\n".join(bad)


def test_the_supervisor_imports_no_station_or_host():
    edges = load_time(_project()[1])
    bad = layer_violations(edges, "supervisor", ("station", "host"))
    assert not bad, "supervisor/ imports a child's code:\n" + "\n".join(bad)


# -- the checker itself, on planted trees
def _plant(root: Path, files: dict[str, str]) -> tuple[dict[str, Path], list[Import]]:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    modules = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    return modules, all_imports(modules, root)


def test_the_checker_tags_each_import_by_when_it_runs(tmp_path):
    _, edges = _plant(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/sub/__init__.py": "from . import leaf\n",
        "pkg/sub/leaf.py": "from .. import sub\nfrom ..sub import leaf as me\n",
        "pkg/a.py": (
            "from typing import TYPE_CHECKING\n"
            "import pkg.sub\n"  # 2: pkg.sub
            "from pkg.sub import leaf, name\n"  # 3: pkg.sub.leaf and pkg.sub
            "from .sub.leaf import thing\n"  # 4: pkg.sub.leaf
            "if TYPE_CHECKING:\n    import pkg.b\nelse:\n    import pkg.c\n"  # 6 type, 8 load
            "try:\n    import pkg.d\nexcept ImportError:\n    import pkg.e\n"  # 10, 12
            "class K:\n    import pkg.f\n"  # 14: a class body runs at load time
            "def f():\n    import pkg.g\n"  # 16: call time
            "class L:\n    def m(self):\n        import pkg.h\n"  # 19: call time
            "if TYPE_CHECKING:\n    def g():\n        import pkg.i\n"),  # 22: never runs
    })
    assert {(imp.importer, imp.where(), imp.target, imp.when) for imp in edges} == {
        ("pkg.sub", "pkg/sub/__init__.py:1", "pkg.sub.leaf", "load"),
        ("pkg.sub.leaf", "pkg/sub/leaf.py:1", "pkg.sub", "load"),
        ("pkg.sub.leaf", "pkg/sub/leaf.py:2", "pkg.sub.leaf", "load"),
        ("pkg.a", "pkg/a.py:1", "typing", "load"), ("pkg.a", "pkg/a.py:2", "pkg.sub", "load"),
        ("pkg.a", "pkg/a.py:3", "pkg.sub.leaf", "load"), ("pkg.a", "pkg/a.py:3", "pkg.sub", "load"),
        ("pkg.a", "pkg/a.py:4", "pkg.sub.leaf", "load"), ("pkg.a", "pkg/a.py:6", "pkg.b", "type"),
        ("pkg.a", "pkg/a.py:8", "pkg.c", "load"), ("pkg.a", "pkg/a.py:10", "pkg.d", "load"),
        ("pkg.a", "pkg/a.py:12", "pkg.e", "load"), ("pkg.a", "pkg/a.py:14", "pkg.f", "load"),
        ("pkg.a", "pkg/a.py:16", "pkg.g", "call"), ("pkg.a", "pkg/a.py:19", "pkg.h", "call"),
        ("pkg.a", "pkg/a.py:22", "pkg.i", "type")}
    assert {imp.target for imp in load_time(edges)} == {
        "typing", "pkg.sub", "pkg.sub.leaf", "pkg.c", "pkg.d", "pkg.e", "pkg.f"}


def test_the_checker_reports_a_planted_cycle_breach_and_long_module(tmp_path):
    modules, edges = _plant(tmp_path, {
        "station/__init__.py": "",
        "station/core/__init__.py": "",
        "station/core/w.py": "import station.core.x\n",
        "station/core/x.py": "from station.core import y\n",
        "station/core/y.py": "import os\nimport station.core.z\n",
        "station/core/z.py": "from station.core.x import thing\nfrom station.runtime import e\n",
        "station/core/leaf.py": "",
        "station/runtime/__init__.py": "",
        "station/runtime/e.py": "def f():\n    import station.core.leaf\n" + "\n" * MAX_LINES,
        "station/runtime/long.py": "\n" * (MAX_LINES + 1),
    })
    cycle = find_cycle(edges)
    assert cycle is not None and describe_cycle(cycle) == (
        "import cycle through 3 module(s):\n"
        "  station.core.x -> station.core.y  (station/core/x.py:1, load)\n"
        "  station.core.y -> station.core.z  (station/core/y.py:2, load)\n"
        "  station.core.z -> station.core.x  (station/core/z.py:1, load)")
    assert find_cycle([imp for imp in edges if imp.importer != "station.core.z"]) is None
    assert layer_violations(edges, "station.core", ("station.runtime", "host")) == [
        "station/core/z.py:2: station.core.z imports station.runtime.e"]
    assert layer_violations(load_time(edges), "station.runtime", ("station.core",)) == []
    assert long_modules(modules, tmp_path) == [f"station/runtime/e.py: {MAX_LINES + 2} lines",
                                               f"station/runtime/long.py: {MAX_LINES + 1} lines"]
    assert long_modules(modules, tmp_path, {"station/runtime/long.py": "one concept"}) == [
        f"station/runtime/e.py: {MAX_LINES + 2} lines"]


def test_the_checker_counts_a_type_only_cycle(tmp_path):
    _, edges = _plant(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/engine.py": "from pkg.forks import fork\n",
        "pkg/forks.py": ("from typing import TYPE_CHECKING\n"
                         "if TYPE_CHECKING:\n    from pkg.engine import Engine\n"),
    })
    assert describe_cycle(find_cycle(edges)) == (
        "import cycle through 2 module(s):\n"
        "  pkg.engine -> pkg.forks  (pkg/engine.py:1, load)\n"
        "  pkg.forks -> pkg.engine  (pkg/forks.py:3, type)")
    assert find_cycle(load_time(edges)) is None


def test_the_checker_counts_a_function_level_cycle(tmp_path):
    _, edges = _plant(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/server.py": "from pkg import registry\n",
        "pkg/registry.py": "from pkg.ops import OPS\n",
        "pkg/ops.py": "class Op:\n    def run(self):\n        from pkg.server import serve\n",
    })
    assert describe_cycle(find_cycle(edges)) == (
        "import cycle through 3 module(s):\n"
        "  pkg.ops -> pkg.server  (pkg/ops.py:3, call)\n"
        "  pkg.server -> pkg.registry  (pkg/server.py:1, load)\n"
        "  pkg.registry -> pkg.ops  (pkg/registry.py:1, load)")
    assert find_cycle(load_time(edges)) is None


def test_the_checker_follows_the_packages_an_import_initialises(tmp_path):
    _, edges = _plant(tmp_path, {
        "pkg/__init__.py": "from other import helper\n",
        "pkg/leaf.py": "import pkg.sub.deep\n",  # pkg is its own package: no edge to it
        "pkg/sub/__init__.py": "",
        "pkg/sub/deep.py": "",
        "other.py": "import pkg.leaf\n",  # runs pkg/__init__.py first, which imports other
    })
    assert describe_cycle(find_cycle(edges)) == (
        "import cycle through 2 module(s):\n"
        "  other -> pkg  (other.py:1, load)\n"
        "  pkg -> other  (pkg/__init__.py:1, load)")
    assert find_cycle([imp for imp in edges if imp.importer != "other"]) is None


def test_the_checker_wants_each_package_to_open_with_its_purpose(tmp_path):
    _plant(tmp_path, {
        "app/__init__.py": '"""The app: what serves the requests."""\n',
        "app/good/__init__.py": '"""The good room: it does one thing (see ``x``).\n\nMore here.\n"""\n',
        "app/good/x.py": "",
        "app/bare/__init__.py": "",
        "app/named/__init__.py": '"""named package."""\n',
        "app/two/__init__.py": '"""The two room holds things. It also holds others."""\n',
        "app/wrapped/__init__.py": '"""The wrapped room, whose first sentence\ngoes on."""\n',
        "app/missing/y.py": "",
        "app/data/notes.txt": "",
    })
    assert packages_without_purpose(tmp_path, ["app"]) == [
        "app/bare: the docstring's first line is not a sentence: ''",
        "app/missing: no __init__.py",
        "app/named: the docstring's first line states no purpose: 'named package.'",
        "app/two: the docstring's first line is not one sentence: "
        "'The two room holds things. It also holds others.'",
        "app/wrapped: the docstring's first line is not a sentence: 'The wrapped room, whose first "
        "sentence'"]
