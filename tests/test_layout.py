"""The package's shape: the solvers import without torch, modules import each other without
cycles, and no function grows past a screen without saying why."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import networkx as nx

PACKAGE = Path(__file__).resolve().parent.parent / "fxopt"

BLOCK_TORCH = """
import builtins, sys
real = builtins.__import__
def guarded(name, *args, **kwargs):
    if name == "torch" or name.startswith("torch."):
        raise ImportError(f"torch is blocked (import of {name})")
    return real(name, *args, **kwargs)
builtins.__import__ = guarded
import fxopt.solvers, fxopt.solvers.graph, fxopt.solvers.schedule, fxopt.solvers.heuristics
import fxopt.solvers.instant, fxopt.solvers.ilp, fxopt.solvers.mip, fxopt.solvers.plan
import fxopt.errors, fxopt.budget, fxopt.units, fxopt.cache
import fxopt
assert fxopt.__version__
assert not [m for m in sys.modules if m == "torch" or m.startswith("torch.")]
"""


def test_solvers_import_without_torch():
    """The solvers take plain numbers: importing them (and fxopt itself, whose public names load
    on first use) must not import torch."""
    done = subprocess.run([sys.executable, "-c", BLOCK_TORCH], capture_output=True, text=True,
                          cwd=PACKAGE.parent, timeout=120)
    assert done.returncode == 0, done.stderr


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports_at_import_time(path: Path) -> set[str]:
    """fxopt modules ``path`` imports when it is imported (module level; imports inside
    functions run later and cannot form an import cycle)."""
    tree = ast.parse(path.read_text())
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    found = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}
    return {m for m in found if m == "fxopt" or m.startswith("fxopt.")}


def import_graph() -> nx.DiGraph:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for name, path in modules.items():
        for target in _imports_at_import_time(path):
            if target in modules and target != name:
                graph.add_edge(name, target)
                # importing a.b.c runs a/__init__ and a/b/__init__ first
                parts = target.split(".")
                for k in range(1, len(parts)):
                    parent = ".".join(parts[:k])
                    if parent in modules and parent != name and not name.startswith(parent + "."):
                        graph.add_edge(name, parent)
    return graph


def test_no_import_cycles():
    cycles = list(nx.simple_cycles(import_graph()))
    assert not cycles, f"import cycles: {cycles}"


def test_the_cycle_check_sees_a_cycle():
    """The check above would fail on a cycle (so it is not vacuous)."""
    graph = import_graph()
    assert graph.has_edge("fxopt.budget", "fxopt.errors")
    graph.add_edge("fxopt.errors", "fxopt.budget")
    assert list(nx.simple_cycles(graph))


MAX_FUNCTION_LINES = 80


def long_functions() -> list[str]:
    """Functions longer than MAX_FUNCTION_LINES whose docstring does not say why (a line starting
    with "Long because")."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                doc = ast.get_docstring(node) or ""
                if lines > MAX_FUNCTION_LINES and "Long because" not in doc:
                    found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_functions_fit_on_a_screen():
    assert not long_functions(), "split these along their phases, or say why in the docstring:\n" + "\n".join(long_functions())


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
