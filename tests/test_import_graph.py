"""Dependencies point one way: the runtime stands alone, the oracle and the gate stand on it.

h3direct/ imports neither oracle, parity_tests nor benchmarks; oracle/ and parity_tests/ do not import benchmarks,
and oracle/ does not import parity_tests. Every import is
checked, wherever it stands (module level, inside a function, under `if TYPE_CHECKING`), relative imports
resolved, and `importlib.import_module("…")` / `__import__("…")` calls with a literal name included.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

FORBIDDEN = {  # package -> packages it must never import
    "h3direct": ("oracle", "parity_tests", "benchmarks"),
    "oracle": ("parity_tests", "benchmarks"),
    "parity_tests": ("benchmarks",),
}


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path, root: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file at `path` (a module under `root`)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = _module_name(path, root).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # from . import x / from ..a import b
                base = package[:len(package) - node.level + 1]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            found.append((node.lineno, stem))
            found += [(node.lineno, f"{stem}.{alias.name}") for alias in node.names if alias.name != "*"]
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and ((isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                   or (isinstance(node.func, ast.Name) and node.func.id in ("__import__", "import_module")))):
            found.append((node.lineno, node.args[0].value))
    return found


def violations(root: Path, forbidden: dict[str, tuple[str, ...]] = FORBIDDEN) -> list[str]:
    """'file:line imports module' for every import that breaks the direction rules."""
    out = []
    for package, banned in forbidden.items():
        for path in sorted((root / package).rglob("*.py")):
            for line, module in imported_modules(path, root):
                top = module.split(".")[0]
                if top in banned:
                    out.append(f"{path.relative_to(root)}:{line} imports {module} ({package} must not import {top})")
    return sorted(set(out))


def test_runtime_and_oracle_import_one_way():
    bad = violations(REPO)
    assert not bad, "imports against the dependency direction:\n" + "\n".join(bad)


def test_checked_packages_exist():
    for package in FORBIDDEN:
        assert list((REPO / package).rglob("*.py")), f"{package}/ has no Python files: is REPO right ({REPO})?"


@pytest.mark.parametrize("source, expected", [
    ("import oracle.traces\n", "oracle.traces"),
    ("from parity_tests.discovery import x\n", "parity_tests.discovery"),
    ("def f():\n    from oracle import record\n    return record\n", "oracle"),  # lazy, inside a function
    ("import importlib\nm = importlib.import_module('parity_tests.budgets')\n", "parity_tests.budgets"),
    ("from ...oracle import traces\n", "oracle"),  # relative, climbing out of h3direct
    ("def f():\n    from benchmarks import quality\n    return quality\n", "benchmarks"),  # the benchmarks too
], ids=["import", "from", "lazy", "import_module", "relative", "benchmarks"])
def test_checker_catches_a_forbidden_import(tmp_path, source, expected):
    pkg = tmp_path / "h3direct" / "sub"
    pkg.mkdir(parents=True)
    (tmp_path / "h3direct" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "mod.py").write_text("from h3direct.errors import H3Error\n" + source)
    bad = violations(tmp_path)
    assert bad and all(b.startswith("h3direct/sub/mod.py:") for b in bad), bad
    assert any(f"imports {expected}" in b for b in bad), bad


def test_checker_allows_the_right_direction(tmp_path):
    for package, source in (("oracle", "import h3direct.traces.format\nfrom h3direct import errors\n"),
                            ("h3direct", "from . import errors\nimport torch\n")):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
        (tmp_path / package / "mod.py").write_text(source)
    assert violations(tmp_path) == []


# ---- no circles: the project's modules import in layers ----------------------------------------------------------

PROJECT = ("h3direct", "oracle", "parity_tests", "benchmarks")


def import_graph(root: Path, packages: tuple[str, ...] = PROJECT) -> dict[str, dict[str, str]]:
    """{module: {project module it imports: 'file:line' of the first such import}} over every import of
    `imported_modules` (lazy ones included). An imported name means the longest project module it starts with
    (`from a.b import c` is a.b's name c, or the module a.b.c); `from pkg import sub` names the module pkg.sub, not
    the package pkg as well. A module importing itself is no edge."""
    modules = {_module_name(p, root): p for package in packages for p in sorted((root / package).rglob("*.py"))}

    def owner(name: str) -> str | None:
        parts = name.split(".")
        return next((m for m in (".".join(parts[:i]) for i in range(len(parts), 0, -1)) if m in modules), None)

    graph: dict[str, dict[str, str]] = {m: {} for m in modules}
    for module, path in modules.items():
        by_line: dict[int, list[str]] = {}
        for line, name in imported_modules(path, root):
            by_line.setdefault(line, []).append(name)
        for line, names in by_line.items():
            targets = {n: owner(n) for n in names}
            for name, target in targets.items():
                deeper = any(t and t.startswith(f"{name}.") for t in targets.values())
                if target and target != module and not (name == target and deeper):
                    graph[module].setdefault(target, f"{path.relative_to(root)}:{line}")
    return graph


def circles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module, sorted: the import circles."""
    def reach(start: str) -> set[str]:
        seen, todo = set(), list(graph[start])
        while todo:
            m = todo.pop()
            if m not in seen:
                seen.add(m)
                todo += graph.get(m, {})
        return seen

    reachable = {m: reach(m) for m in graph}
    found: list[list[str]] = []
    for m in sorted(graph):
        if m in reachable[m] and not any(m in c for c in found):
            found.append(sorted(n for n in reachable[m] if m in reachable[n]))
    return found


def describe_circle(graph: dict[str, dict[str, str]], circle: list[str]) -> str:
    edges = [f"    {a} -> {b} ({graph[a][b]})" for a in circle for b in circle if b in graph[a]]
    return " <-> ".join(circle) + "\n" + "\n".join(edges)


def test_no_import_circles():
    graph = import_graph(REPO)
    assert len(graph) > 100, f"found {len(graph)} modules: is REPO right ({REPO})?"
    found = circles(graph)
    assert not found, "import circles (break each by moving what both sides need below both):\n" + "\n".join(
        describe_circle(graph, c) for c in found)


def _package(root: Path, files: dict[str, str]) -> Path:
    for name, source in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(source)
    return root


@pytest.mark.parametrize("files, expected", [
    ({"a.py": "from h3direct.b import f\n", "b.py": "def f():\n    from h3direct import a\n    return a\n"},
     ["h3direct.a", "h3direct.b"]),  # one side lazy, the other `from pkg import module`
    ({"a.py": "from .b import f\n", "b.py": "import h3direct.c.g\n", "c.py": "from .a import x\n"},
     ["h3direct.a", "h3direct.b", "h3direct.c"]),  # three modules, relative imports
    ({"__init__.py": "from h3direct.a import f\n", "a.py": "from h3direct import NAME\n"},
     ["h3direct", "h3direct.a"]),  # a module taking a name from its package's __init__, which imports it
], ids=["lazy-pair", "three", "package"])
def test_circle_detector_catches_a_planted_circle(tmp_path, files, expected):
    files = {"__init__.py": "", "errors.py": "", **files, "d.py": "from h3direct import a\nfrom . import d\n"}
    graph = import_graph(_package(tmp_path / "h3direct", files).parent, ("h3direct",))
    assert circles(graph) == [expected]
    assert "h3direct.d" not in graph["h3direct.d"] and "h3direct.d" not in circles(graph)[0]


def test_circle_detector_allows_layers(tmp_path):
    """One way through a package's __init__, `from pkg import module` from a sibling, self-imports: no circle."""
    files = {"__init__.py": "from h3direct.a import f\n", "a.py": "from h3direct import b\nimport h3direct.a\n",
             "b.py": "def g():\n    from h3direct.c import h\n", "c.py": "import torch\n"}
    graph = import_graph(_package(tmp_path / "h3direct", files).parent, ("h3direct",))
    assert graph["h3direct.a"] == {"h3direct.b": "h3direct/a.py:1"} and circles(graph) == []


# ---- paths: the runtime reads no harness file either ------------------------------------------------------------

# folder names of the harness and of what sits beside the checkout; a runtime string naming one is a path into them
HARNESS_PATHS = re.compile(r"(^|[/\\])(parity_tests|fixtures|benchmarks|oracle)([/\\]|$)|(^|[/\\])\.\.[/\\]shared"
                           r"|shared[/\\]oracle")
HARNESS_NAMES = {"parity_tests", "fixtures", "benchmarks", "oracle", "shared"}


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the string constants that are docstrings (documentation, not reads)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value,
                                                                                                    str):
                out.add(id(first.value))
    return out


def path_references(root: Path, package: str = "h3direct") -> list[str]:
    """'file:line names PATH' for every string in `package`'s code (not its docstrings) that names a harness folder:
    a path fragment (`"parity_tests/budgets.toml"`, `"../shared/oracle"`) or a bare path component joined onto a
    path (`Path(__file__).parents[2] / "fixtures"`, `os.path.join(root, "benchmarks")`)."""
    out = []
    for path in sorted((root / package).rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        docs = _docstrings(tree)
        joined = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
                joined.update(id(n) for n in (node.left, node.right))
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") in ("join", "joinpath"):
                joined.update(id(a) for a in node.args)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Constant) and isinstance(node.value, str)) or id(node) in docs:
                continue
            s = node.value
            if HARNESS_PATHS.search(s) and ("/" in s or "\\" in s) or (id(node) in joined and s in HARNESS_NAMES):
                out.append(f"{path.relative_to(root)}:{node.lineno} names {s!r}")
    return out


def test_runtime_reads_no_harness_path():
    bad = path_references(REPO)
    assert not bad, "the runtime reaches into the harness by path:\n" + "\n".join(bad)


@pytest.mark.parametrize("source", [
    'from pathlib import Path\nTABLE = Path(__file__).resolve().parents[2] / "parity_tests" / "budgets.toml"\n',
    'import os\nROOT = os.path.join(os.path.dirname(__file__), "..", "fixtures")\n',
    'SHARED = "../shared/oracle"\n',
    'def f(root):\n    return root / "benchmarks/results"\n',
    'from pathlib import Path\nR = Path(__file__).parents[1] / "oracle"\n',
], ids=["parents-join", "os-path-join", "relative-string", "fragment", "oracle-join"])
def test_path_checker_catches_a_harness_path(tmp_path, source):
    (tmp_path / "h3direct").mkdir()
    (tmp_path / "h3direct" / "mod.py").write_text('"""Reads fixtures/ in its docstring only: allowed."""\n' + source)
    bad = path_references(tmp_path)
    assert bad and all(b.startswith("h3direct/mod.py:") for b in bad), bad


def test_path_checker_allows_documentation_and_unrelated_strings(tmp_path):
    (tmp_path / "h3direct").mkdir()
    (tmp_path / "h3direct" / "mod.py").write_text(
        '"""See fixtures/README.md and ../shared/oracle for the traces."""\n'
        'def f():\n    """benchmarks/ measures this."""\n    return "a fixtures list", "oracle"\n')
    assert path_references(tmp_path) == []


# ---- the oracle uses the runtime's public names only --------------------------------------------------------------

def private_imports(root: Path, package: str = "oracle") -> list[str]:
    out = []
    for path in sorted((root / package).rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("h3direct",
                                                                                                  "parity_tests"):
                out += [f"{path.relative_to(root)}:{node.lineno} imports {node.module}.{a.name}" for a in node.names
                        if a.name.startswith("_")]
    return out


def test_oracle_uses_public_names_only(tmp_path):
    assert private_imports(REPO) == []
    (tmp_path / "oracle").mkdir()
    (tmp_path / "oracle" / "mod.py").write_text("from h3direct.traces.pairing import _rel\n")
    assert private_imports(tmp_path) == ["oracle/mod.py:1 imports h3direct.traces.pairing._rel"]
