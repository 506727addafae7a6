"""The package's shape: the solvers import without torch; every module sits in a room of
docs/design.md and imports only from its own room or those below (inside functions too), without
cycles; and no function grows past a screen without saying why."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import networkx as nx
import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "fxopt"
DESIGN = PACKAGE.parent / "docs" / "design.md"

TORCH_FREE = ("fxopt.errors", "fxopt.budget", "fxopt.units", "fxopt.cache", "fxopt._quiet", "fxopt")

BLOCK_TORCH = """
import builtins, importlib, sys
real = builtins.__import__
def guarded(name, *args, **kwargs):
    if name == "torch" or name.startswith("torch."):
        raise ImportError(f"torch is blocked (import of {name})")
    return real(name, *args, **kwargs)
builtins.__import__ = guarded
for name in sys.argv[1:]:
    importlib.import_module(name)
import fxopt
assert fxopt.__version__
assert not [m for m in sys.modules if m == "torch" or m.startswith("torch.")]
"""


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def test_solvers_import_without_torch():
    """The solvers take plain numbers: importing every module of fxopt/solvers/ (found on disk,
    so a new or split module is covered) and the basics they use, and fxopt itself (whose
    public names load on first use), must not import torch."""
    solvers = [m for m in MODULES if m == "fxopt.solvers" or m.startswith("fxopt.solvers.")]
    assert {"fxopt.solvers.stages", "fxopt.solvers.stage_plan"} <= set(solvers)
    done = subprocess.run([sys.executable, "-c", BLOCK_TORCH, *solvers, *TORCH_FREE], capture_output=True,
                          text=True, cwd=PACKAGE.parent, timeout=120)
    assert done.returncode == 0, done.stderr


def imports_in(source: str, name: str, is_package: bool = False) -> dict[str, int]:
    """The fxopt modules that the module ``name`` (its ``source``) imports, each with the line of
    its first import: at module level and inside functions, ``from a import b`` as the module
    ``a.b`` where that is one, and ``importlib.import_module("...")`` with a literal name."""
    package = name if is_package else name.rpartition(".")[0]
    found: dict[str, int] = {}

    def add(target: str, line: int) -> None:
        if target == "fxopt" or target.startswith("fxopt."):
            found.setdefault(target, line)

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                add(submodule if submodule in MODULES else base, node.lineno)
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"):
            add(node.args[0].value, node.lineno)
    return found


def import_graph() -> nx.DiGraph:
    """fxopt's modules and who imports whom (edge attribute ``line``: where). Importing
    ``a.b.c`` also runs ``a/__init__`` and ``a/b/__init__`` (except a module's own packages)."""
    graph = nx.DiGraph()
    graph.add_nodes_from(MODULES)
    for name, path in MODULES.items():
        for target, line in imports_in(path.read_text(), name, path.name == "__init__.py").items():
            parts = target.split(".")
            for k in range(1, len(parts) + 1):
                module = ".".join(parts[:k])
                if module in MODULES and module != name and not name.startswith(module + "."):
                    graph.add_edge(name, module, line=line)
    return graph


def rooms() -> dict[str, tuple[int, str]]:
    """Each module's room, from the table under "The order of the rooms" in docs/design.md:
    ``module -> (rank, room)``, rank 0 the top room."""
    text = DESIGN.read_text()
    section = text.split("## The order of the rooms", 1)[1].split("\n## ", 1)[0]
    found: dict[str, tuple[int, str]] = {}
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith(("| room", "| ---"))]
    for rank, row in enumerate(rows):
        room, modules = [cell.strip() for cell in row.strip("|").split("|")[:2]]
        for path in re.findall(r"`([^`]+\.py)`", modules):
            assert path not in found, f"{path} is in two rooms of docs/design.md"
            found[_module_name(PACKAGE / path)] = (rank, room.strip("*"))
    return found


def test_every_module_is_in_a_room_of_the_design():
    """docs/design.md names every module under fxopt/ in the order of the rooms, and nothing else."""
    placed = rooms()
    assert not set(MODULES) - set(placed), f"not in docs/design.md's rooms: {sorted(set(MODULES) - set(placed))}"
    assert not set(placed) - set(MODULES), f"in docs/design.md but not in fxopt/: {sorted(set(placed) - set(MODULES))}"


def upward_imports(graph: nx.DiGraph, placed: dict[str, tuple[int, str]]) -> list[str]:
    return [f"{MODULES[a].relative_to(PACKAGE.parent)}:{graph.edges[a, b]['line']} imports {b}: "
            f"{placed[a][1]} -> {placed[b][1]}"
            for a, b in sorted(graph.edges) if a in placed and b in placed and placed[b][0] < placed[a][0]]


def test_imports_point_down():
    """Every import, inside a function too, goes to the importer's own room or one below it."""
    found = upward_imports(import_graph(), rooms())
    assert not found, "imports that point up (move what they need down):\n" + "\n".join(found)


def test_no_import_cycles():
    """No module reaches itself through imports, inside functions included (within a room too)."""
    cycles = list(nx.simple_cycles(import_graph()))
    assert not cycles, f"import cycles: {cycles}"


@pytest.mark.slow
def test_the_checks_see_function_level_imports_cycles_and_upward_arrows():
    """The checks above are not vacuous: they read imports inside functions and literal
    ``import_module`` names, and they would fail on an upward import and on a cycle."""
    source = ("import fxopt.units\nfrom . import errors\ndef f():\n    from fxopt import cache, solvers\n"
              "    importlib.import_module('fxopt.api')\n")
    assert set(imports_in(source, "fxopt.budget")) == {"fxopt.units", "fxopt.errors", "fxopt.cache",
                                                       "fxopt.solvers", "fxopt.api"}
    graph, placed = import_graph(), rooms()
    assert graph.has_edge("fxopt.budget", "fxopt.errors")
    assert not upward_imports(graph, placed)
    graph.add_edge("fxopt.solvers.graph", "fxopt.api", line=1)
    assert upward_imports(graph, placed) == [
        f"fxopt/solvers/graph.py:1 imports fxopt.api: {placed['fxopt.solvers.graph'][1]} -> {placed['fxopt.api'][1]}"]
    graph.add_edge("fxopt.errors", "fxopt.budget", line=1)
    assert list(nx.simple_cycles(graph))


MAX_FUNCTION_LINES = 80
MAX_CLASS_LINES = 200


def long_definitions(source: str) -> list[tuple[int, str, int]]:
    """The functions longer than MAX_FUNCTION_LINES and the classes longer than MAX_CLASS_LINES in
    ``source`` whose docstring does not say why (a line starting with "Long because"): (line,
    name, lines) each."""
    found = []
    for node in ast.walk(ast.parse(source)):
        limit = {ast.FunctionDef: MAX_FUNCTION_LINES, ast.AsyncFunctionDef: MAX_FUNCTION_LINES,
                 ast.ClassDef: MAX_CLASS_LINES}.get(type(node))
        if limit is not None:
            lines = node.end_lineno - node.lineno + 1
            if lines > limit and "Long because" not in (ast.get_docstring(node) or ""):
                found.append((node.lineno, node.name, lines))
    return found


def too_long() -> list[str]:
    return [f"{path.relative_to(PACKAGE.parent)}:{line} {name} ({lines} lines)"
            for path in sorted(PACKAGE.rglob("*.py")) for line, name, lines in long_definitions(path.read_text())]


def test_functions_fit_on_a_screen():
    """No function over MAX_FUNCTION_LINES, no class over MAX_CLASS_LINES, without a "Long because"."""
    assert not too_long(), "split these along their phases, or say why in the docstring:\n" + "\n".join(too_long())


def test_the_length_check_sees_functions_and_classes():
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    method = "    def f(self):\n" + body.replace("    ", "        ")
    assert long_definitions("def f():\n" + body) == [(1, "f", MAX_FUNCTION_LINES + 1)]
    assert long_definitions('def f():\n    """Long because one table."""\n' + body) == []
    methods = "".join(method.replace("def f", f"def f{k}") for k in range(3))  # each 81 lines: 244 in all
    assert [name for _, name, _ in long_definitions("class C:\n" + methods)] == ["C", "f0", "f1", "f2"]
    said = long_definitions('class C:\n    """Long because one state machine."""\n' + methods)
    assert [name for _, name, _ in said] == ["f0", "f1", "f2"]  # the class says why; its methods do not


def _declared() -> dict[str, list[str]]:
    import re
    import tomllib

    project = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["project"]
    name = lambda req: re.split(r"[<>=!~\[; ]", req, maxsplit=1)[0].lower()  # noqa: E731
    groups = {"": project["dependencies"], **project.get("optional-dependencies", {})}
    return {group: [name(r) for r in reqs] for group, reqs in groups.items()}


def _third_party_imports() -> set[str]:
    found = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                found.add(node.module.split(".")[0])
    return {m for m in found if m != "fxopt" and m not in sys.stdlib_module_names}


def test_dependencies_are_the_imports():
    """Every package fxopt imports is declared (a required dependency, or an extra for the
    optional features: plots, DOT files), and every required dependency is imported by fxopt."""
    declared = _declared()
    imported = _third_party_imports()
    anywhere = {d for reqs in declared.values() for d in reqs}
    assert imported <= anywhere, f"imported but not declared: {sorted(imported - anywhere)}"
    assert set(declared[""]) <= imported, f"declared but never imported: {sorted(set(declared[''])- imported)}"
