"""The package's floors read straight down: no import cycle, no import up a floor, no module over 500 lines,
no function over 80 lines.

Every module under ``src/torchspan`` is read with ``ast`` (never imported): top-level and
function-level imports count, relative imports are resolved, and ``if TYPE_CHECKING:`` imports
count for floors but not for cycles (they never run). A new package gets its floor in ``FLOORS``.

Usage: ``python -m pytest -q tests/test_layering.py``.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest

# module prefix -> floor; a module may import only from its own floor or lower ones.
# The longest matching prefix wins, so a package and its submodules share one row.
FLOORS: dict[str, int] = {
    "torchspan.schedule": 0,
    "torchspan.hardware": 0,
    "torchspan.files": 0,
    "torchspan.temporaries": 0,
    "torchspan.layers": 1,
    "torchspan.profiler": 2,
    "torchspan.planner": 3,
    "torchspan.diagnosis": 4,
    "torchspan.runtime": 5,
    "torchspan.parity": 6,
    "torchspan.parity_ranks": 6,
    "torchspan.parity_strategies": 6,
    "torchspan.launch": 6,
    "torchspan.pictures": 7,
    "torchspan.progress": 7,
    "torchspan.training": 7,
    "torchspan.lightning": 7,
    "torchspan.hf": 7,
    "torchspan.demo": 8,
    "torchspan.commands": 9,
    "torchspan.cli": 9,
    "torchspan.__main__": 9,
}
# The lazy public façade: it may name anything, and anything may import ``__version__`` from it.
EXEMPT = {"torchspan"}
# importer prefix -> (the only modules it may take from the restricted package, modules excused)
ONLY_FROM: dict[str, tuple[str, frozenset[str], frozenset[str]]] = {
    # the planner is pure data: profile *data* types only, except plan() which measures
    "torchspan.planner": (
        "torchspan.profiler",
        frozenset({"torchspan.profiler.costs"}),
        frozenset({"torchspan.planner.api"}),
    ),
}
MAX_LINES = 500
MAX_FUNCTION_LINES = 80  # from the ``def`` line to the last line: docstring and nested functions included
SRC = Path(__file__).resolve().parents[1] / "src" / "torchspan"


@dataclass
class Module:
    """What the checker needs to know about one module."""

    name: str
    lines: int = 0
    imports: set[str] = field(default_factory=set)  # every import, TYPE_CHECKING ones included
    runtime_imports: set[str] = field(default_factory=set)  # the ones that run


def _package_of(name: str, is_package: bool) -> str:
    return name if is_package else name.rpartition(".")[0]


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _dynamic_import(node: ast.AST) -> str | None:
    """``importlib.import_module("a.b")`` -> ``"a.b"``; ``import_module(f"a.b.{x}")`` -> ``"a.b.*"``."""
    if not (isinstance(node, ast.Call) and node.args):
        return None
    func = node.func
    if not (getattr(func, "attr", None) == "import_module" or getattr(func, "id", None) == "import_module"):
        return None
    arg = node.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
        prefix = str(arg.values[0].value)
        return prefix + "*" if prefix.endswith(".") else None
    return None


Found = list[tuple["ast.Import | ast.ImportFrom | str", bool]]


def _raw_imports(tree: ast.Module) -> Found:
    """Every import (statement or ``import_module`` name) with whether it sits under ``if TYPE_CHECKING:``."""
    found: Found = []

    def visit(node: ast.AST, typing_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            dynamic = _dynamic_import(child)
            if dynamic is not None:
                found.append((dynamic, typing_only))
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append((child, typing_only))
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    visit_stmt(stmt, True)
                for stmt in child.orelse:
                    visit_stmt(stmt, typing_only)
            else:
                visit(child, typing_only)

    def visit_stmt(stmt: ast.stmt, typing_only: bool) -> None:
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            found.append((stmt, typing_only))
        else:
            visit(stmt, typing_only)

    visit(tree, False)
    return found


def _targets(
    node: ast.Import | ast.ImportFrom | str, importer: str, is_package: bool, known: set[str]
) -> list[str]:
    """The torchspan modules one import loads (``from a import b`` names ``a.b`` when it is a module)."""
    if isinstance(node, str):  # import_module(...): a name, or every module under a prefix
        if node.split(".")[0] != "torchspan":
            return []
        if node.endswith(".*"):
            return sorted(k for k in known if k.startswith(node[:-1]))
        return [node]
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name.split(".")[0] == "torchspan"]
    if node.level:
        base = _package_of(importer, is_package)
        for _ in range(node.level - 1):
            base = base.rpartition(".")[0]
        source = f"{base}.{node.module}" if node.module else base
    else:
        source = node.module or ""
    if source.split(".")[0] != "torchspan":
        return []
    out = []
    for alias in node.names:
        sub = f"{source}.{alias.name}"
        out.append(sub if sub in known else source)
    return out


def read_package(root: Path = SRC) -> dict[str, Module]:
    """Every module under ``root`` (named ``torchspan.…``) with its line count and torchspan imports."""
    files = {}
    for path in sorted(root.rglob("*.py")):
        parts = ("torchspan",) + path.relative_to(root).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        files[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    known = set(files)
    modules: dict[str, Module] = {}
    for name, (path, is_package) in files.items():
        text = path.read_text(encoding="utf-8")
        mod = Module(name, lines=len(text.splitlines()))
        for node, typing_only in _raw_imports(ast.parse(text, filename=str(path))):
            for target in _targets(node, name, is_package, known):
                if target != name:
                    mod.imports.add(target)
                    if not typing_only:
                        mod.runtime_imports.add(target)
        modules[name] = mod
    return modules


def floor_of(name: str, floors: Mapping[str, int] = FLOORS) -> int | None:
    best = None
    for prefix, floor in floors.items():
        if (name == prefix or name.startswith(prefix + ".")) and (best is None or len(prefix) > len(best[0])):
            best = (prefix, floor)
    return None if best is None else best[1]


def find_cycles(modules: Mapping[str, Module]) -> list[list[str]]:
    """One path per strongly connected group of modules that import each other (runtime imports only)."""
    graph = {name: sorted(t for t in mod.runtime_imports if t in modules) for name, mod in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def connect(v: str) -> None:  # Tarjan; the package is small enough for recursion
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return [_cycle_path(graph, set(group)) for group in groups]


def _cycle_path(graph: Mapping[str, list[str]], group: set[str]) -> list[str]:
    """A concrete cycle ``a -> b -> … -> a`` inside one strongly connected group."""
    start = min(group)
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:  # breadth-first back to start gives the shortest loop through it
        nxt = []
        for v in frontier:
            for w in graph[v]:
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return list(reversed(path)) + [start]
                if w in group and w not in previous:
                    previous[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(
        f"no cycle through {start} in {sorted(group)}"
    )  # pragma: no cover - Tarjan guarantees one


def upward_imports(modules: Mapping[str, Module], floors: Mapping[str, int] = FLOORS) -> list[str]:
    """``a.b (floor 3) imports c.d (floor 5)`` for every import up a floor, plus modules without a floor."""
    problems = []
    for name, mod in sorted(modules.items()):
        if name in EXEMPT:
            continue
        own = floor_of(name, floors)
        if own is None:
            problems.append(f"{name} has no floor; add its package to FLOORS in tests/test_layering.py")
            continue
        for target in sorted(mod.imports):
            if target in EXEMPT:
                continue
            if target not in modules:
                problems.append(f"{name} imports {target}, which is not a module of the package")
                continue
            theirs = floor_of(target, floors)
            if theirs is not None and theirs > own:
                problems.append(f"{name} (floor {own}) imports {target} (floor {theirs})")
    return problems


def restricted_imports(
    modules: Mapping[str, Module], rules: Mapping[str, tuple[str, frozenset[str], frozenset[str]]] = ONLY_FROM
) -> list[str]:
    problems = []
    for name, mod in sorted(modules.items()):
        for prefix, (package, allowed, excused) in rules.items():
            if not (name == prefix or name.startswith(prefix + ".")) or name in excused:
                continue
            for target in sorted(mod.imports):
                if (target == package or target.startswith(package + ".")) and target not in allowed:
                    problems.append(
                        f"{name} imports {target}; {prefix} may take only {sorted(allowed)} from {package}"
                    )
    return problems


def long_functions(root: Path = SRC, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """``path:line name has N lines`` for every function (methods and nested ones too) longer than
    ``limit``."""
    problems = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > limit:
                    problems.append(
                        f"{path.relative_to(root)}:{node.lineno} {node.name} has {lines} lines (limit "
                        f"{limit}); cut it into named steps"
                    )
    return problems


def long_modules(modules: Mapping[str, Module], limit: int = MAX_LINES) -> list[str]:
    return [
        f"{name} has {mod.lines} lines (limit {limit}); cut it by concept"
        for name, mod in sorted(modules.items())
        if mod.lines > limit
    ]


# ------------------------------------------------------------------------------------------ the package


@pytest.fixture(scope="module")
def package() -> dict[str, Module]:
    return read_package()


def test_the_package_is_read(package: dict[str, Module]) -> None:
    assert "torchspan.cli" in package and "torchspan.runtime.spanned" in package
    assert package["torchspan.cli"].imports, "the reader found no imports in cli.py"


def test_no_import_cycle(package: dict[str, Module]) -> None:
    cycles = find_cycles(package)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_every_import_goes_down_a_floor(package: dict[str, Module]) -> None:
    problems = upward_imports(package) + restricted_imports(package)
    assert not problems, "layering violations:\n" + "\n".join(problems)


def test_no_module_over_the_line_limit(package: dict[str, Module]) -> None:
    problems = long_modules(package)
    assert not problems, "\n".join(problems)


def test_no_function_over_the_line_limit() -> None:
    problems = long_functions()
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------------------------------ the checker


def _synthetic(tmp_path: Path, files: Mapping[str, str]) -> dict[str, Module]:
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return read_package(tmp_path)


def test_checker_finds_a_cycle_through_function_level_and_relative_imports(tmp_path: Path) -> None:
    modules = _synthetic(
        tmp_path,
        {
            "__init__.py": "",
            "planner/__init__.py": "",
            "planner/a.py": "from .b import x\n",
            "planner/b.py": "def f():\n    from . import c\n",
            "planner/c.py": "import torchspan.planner.a\n",
            "planner/d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import y\n",
            "cli.py": "import importlib\ndef f(n):\n    importlib.import_module(f'torchspan.planner.{n}')\n",
        },
    )
    assert find_cycles(modules) == [
        ["torchspan.planner.a", "torchspan.planner.b", "torchspan.planner.c", "torchspan.planner.a"]
    ]
    assert "torchspan.planner.a" in modules["torchspan.planner.d"].imports
    assert "torchspan.planner.a" not in modules["torchspan.planner.d"].runtime_imports
    assert modules["torchspan.cli"].runtime_imports == {f"torchspan.planner.{m}" for m in "abcd"}


def test_checker_finds_an_upward_import_and_a_missing_floor(tmp_path: Path) -> None:
    modules = _synthetic(
        tmp_path,
        {
            "__init__.py": "",
            "planner/__init__.py": "",
            "planner/solver.py": "def go():\n    from ..runtime.spanned import span\n",
            "runtime/__init__.py": "",
            "runtime/spanned.py": "from ..planner import solver\nfrom .. import __version__\n",
            "newthing.py": "",
        },
    )
    assert find_cycles(modules) == [
        ["torchspan.planner.solver", "torchspan.runtime.spanned", "torchspan.planner.solver"]
    ]
    assert upward_imports(modules) == [
        "torchspan.newthing has no floor; add its package to FLOORS in tests/test_layering.py",
        "torchspan.planner.solver (floor 3) imports torchspan.runtime.spanned (floor 5)",
    ]


def test_checker_finds_a_long_function_and_counts_nested_ones_in_it(tmp_path: Path) -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(75))
    (tmp_path / "a.py").write_text(
        "def short():\n    return 1\n\n\ndef outer():\n    def inner():\n        pass\n" + body
    )
    assert long_functions(tmp_path, limit=77) == [
        "a.py:5 outer has 78 lines (limit 77); cut it into named steps"
    ]
    assert long_functions(tmp_path, limit=78) == []


def test_checker_finds_the_planner_taking_measuring_code_and_long_modules(tmp_path: Path) -> None:
    modules = _synthetic(
        tmp_path,
        {
            "__init__.py": "",
            "profiler/__init__.py": "",
            "profiler/costs.py": "",
            "profiler/measure.py": "",
            "planner/__init__.py": "",
            "planner/cost.py": "from ..profiler.costs import Profile\nfrom ..profiler.measure import "
            "profile\n",
            "planner/api.py": "from ..profiler.measure import profile\n" + "\n" * 501,
        },
    )
    assert restricted_imports(modules) == [
        "torchspan.planner.cost imports torchspan.profiler.measure; torchspan.planner may take only "
        "['torchspan.profiler.costs'] from torchspan.profiler"
    ]
    assert long_modules(modules) == ["torchspan.planner.api has 502 lines (limit 500); cut it by concept"]
    assert upward_imports(modules) == []
