"""The package's shape, read with ``ast``: layers, cycles, private names, function length, Ray.

The layers are the table of docs/architecture.md, read from there: each folder
may import its own modules, the folders its row names and what those may import
in turn. An import the table does not allow, a folder it does not name and an
import cycle (between files or between folders) fail here.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import mixrl

PKG = Path(mixrl.__file__).resolve().parent
ARCHITECTURE = PKG.parents[1] / "docs" / "architecture.md"

# Private names still imported across modules, as (importing file, module, name); only shrinks.
PRIVATE_ALLOWED: set[tuple[str, str, str]] = set()

# Functions still over MAX_LINES outside lab/, as (file, qualified name); only shrinks.
MAX_LINES = 80
LONG_ALLOWED: set[tuple[str, str]] = set()

# Imports of mixrl modules inside functions, in the product (outside lab/); only shrinks.
NESTED_IMPORTS_MAX = 54


Modules = dict[str, ast.Module]
Table = dict[str, list[str]]  # folder -> the folders its row names, in the table's order


def package_modules() -> Modules:
    """Every module of the package by its path relative to the package."""
    return {p.relative_to(PKG).as_posix(): ast.parse(p.read_text(), str(p)) for p in sorted(PKG.rglob("*.py"))}


def read_table(text: str) -> Table:
    """The rows of the layer table (``| `folder/` | concept | may import |``), lowest first."""
    table: Table = {}
    for line in text.splitlines():
        m = re.match(r"\|\s*`([a-z_]+)/`\s*\|[^|]*\|([^|]*)\|\s*$", line)
        if not m:
            continue
        cell = m.group(2).strip()
        table[m.group(1)] = list(table) if cell == "everything above" else re.findall(r"`([a-z_]+)`", cell)
    return table


def table_errors(table: Table) -> list[str]:
    """A row that names a folder below it (or itself, or none that exists) breaks the order."""
    errors, seen = [], []
    for folder, deps in table.items():
        errors += [f"{folder}: may import {d!r}, which is not a row above it" for d in deps if d not in seen]
        seen.append(folder)
    return errors


def allowed(table: Table) -> dict[str, set[str]]:
    """folder -> every folder it may import: its row's, and theirs in turn (itself included)."""
    out: dict[str, set[str]] = {}
    for folder, deps in table.items():
        out[folder] = {folder}.union(*(out.get(d, {d}) for d in deps))
    return out


def _dotted(rel: str) -> str:
    parts = ["mixrl", *Path(rel).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(rel: str, tree: ast.Module) -> list[tuple[str, list[str], dict[str, str]]]:
    """(absolute module, imported names, local name -> what it is bound to) of every import,
    nested ones included."""
    package = _dotted(rel) if rel.endswith("__init__.py") else _dotted(rel).rpartition(".")[0]
    out: list[tuple[str, list[str], dict[str, str]]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, [], {a.asname or a.name.split(".")[0]: a.name if a.asname else a.name.split(".")[0]})
                    for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            out.append((module, [a.name for a in node.names],
                        {a.asname or a.name: f"{module}.{a.name}" for a in node.names}))
    return out


def _named_modules(tree: ast.Module) -> list[str]:
    """Module names written as whole strings (``importlib.import_module`` targets, dispatch
    tables, preload lists): what a dynamic import loads. A name after ``"-m"`` starts a new
    interpreter (``python -m mixrl.commands.main``): no import."""
    after_m = {id(b) for n in ast.walk(tree) if isinstance(n, ast.List | ast.Tuple)
               for a, b in zip(n.elts, n.elts[1:], strict=False) if isinstance(a, ast.Constant) and a.value == "-m"}
    return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and re.fullmatch(r"mixrl(\.[a-z_0-9]+)+", n.value) and id(n) not in after_m]


def _folder(rel: str) -> str:
    return rel.split("/")[0].removesuffix(".py")


def _resolve(target: str, modules: Modules) -> str | None:
    """The file of the longest module prefix of ``target`` (``mixrl.a.b.name`` -> ``a/b.py``)."""
    files = {_dotted(rel): rel for rel in modules}
    while target and target not in files:
        target = target.rpartition(".")[0]
    return files.get(target)


def import_edges(modules: Modules) -> set[tuple[str, str]]:
    """(importing file, imported file) of every import between two of the package's files, the
    ones inside functions and the dynamic ones included (``from mixrl import x`` reaches ``x``)."""
    edges = set()
    for rel, tree in modules.items():
        targets = _named_modules(tree)
        for module, names, _ in _imports(rel, tree):
            if module == "mixrl" or module.startswith("mixrl."):
                targets += [f"{module}.{n}" for n in names] if names else [module]
        for t in targets:
            dst = _resolve(t, modules)
            if dst is not None and dst != rel and dst != "__init__.py":
                edges.add((rel, dst))
    return edges


def disallowed_imports(modules: Modules, table: Table) -> set[tuple[str, str]]:
    ok = allowed(table)
    return {(a, b) for a, b in import_edges(modules)
            if _folder(a) in ok and _folder(b) not in ok[_folder(a)]}


def unnamed_folders(modules: Modules, table: Table) -> set[str]:
    return {_folder(rel) for rel in modules if rel != "__init__.py"} - set(table)


def cycles(edges: set[tuple[str, str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan, iterative)."""
    graph: dict[str, list[str]] = {}
    for a, b in sorted(edges):
        graph.setdefault(a, []).append(b)
        graph.setdefault(b, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            v, i = work.pop()
            if i == 0:
                index[v] = low[v] = len(index)
                stack.append(v)
                on.add(v)
            if i < len(graph[v]):
                work.append((v, i + 1))
                w = graph[v][i]
                if w not in index:
                    work.append((w, 0))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[v])
    return found


def folder_edges(edges: set[tuple[str, str]]) -> set[tuple[str, str]]:
    return {(_folder(a), _folder(b)) for a, b in edges if _folder(a) != _folder(b)}


def nested_imports(modules: Modules) -> set[tuple[str, int]]:
    """(file, line) of each import of a mixrl module inside a function, outside lab/."""
    found = set()
    for rel, tree in modules.items():
        if rel.startswith("lab/"):
            continue
        for fn in ast.walk(tree):
            if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                for node in ast.walk(fn):
                    module = (node.module or "") if isinstance(node, ast.ImportFrom) else (
                        node.names[0].name if isinstance(node, ast.Import) else "")
                    if module == "mixrl" or module.startswith("mixrl."):
                        found.add((rel, node.lineno))
    return found


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_imports(modules: Modules) -> set[tuple[str, str, str]]:
    """Private names taken from another mixrl module: imported by name (or as a module), or
    read as an attribute of an imported name (``Trainer._forward``, ``engine._clean``)."""
    found = set()
    for rel, tree in modules.items():
        imported: dict[str, str] = {}  # local name -> the mixrl object it is bound to
        for module, names, bound in _imports(rel, tree):
            if module.split(".")[0] != "mixrl" or module == _dotted(rel):
                continue
            found |= {(rel, module, n) for n in names if _is_private(n)}
            found |= {(rel, module, part) for part in module.split(".") if _is_private(part)}
            imported.update(bound)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and _is_private(node.attr) and isinstance(node.value, ast.Name)
                    and node.value.id in imported):
                found.add((rel, imported[node.value.id], node.attr))
    return found


def long_functions(modules: Modules) -> dict[tuple[str, str], int]:
    """Functions (methods and nested ones included) over ``MAX_LINES`` lines, outside lab/."""
    found = {}
    for rel, tree in modules.items():
        if rel.startswith("lab/"):
            continue
        todo: list[tuple[ast.AST, str]] = [(tree, "")]
        while todo:
            node, prefix = todo.pop()
            for child in ast.iter_child_nodes(node):
                if not isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    todo.append((child, prefix))
                    continue
                name = prefix + child.name
                n = child.end_lineno - child.lineno + 1
                if not isinstance(child, ast.ClassDef) and n > MAX_LINES:
                    found[(rel, name)] = n
                todo.append((child, name + "."))
    return found


def test_the_layer_table_is_ordered_and_names_every_folder() -> None:
    table = read_table(ARCHITECTURE.read_text())
    modules = package_modules()
    assert len(table) >= 10, f"no layer table found in {ARCHITECTURE}"
    assert not table_errors(table), table_errors(table)
    assert not unnamed_folders(modules, table), f"folders docs/architecture.md does not name: {unnamed_folders(modules, table)}"
    assert not set(table) - {_folder(r) for r in modules}, f"rows without a folder: {set(table) - {_folder(r) for r in modules}}"


def test_every_import_is_one_the_table_allows() -> None:
    found = disallowed_imports(package_modules(), read_table(ARCHITECTURE.read_text()))
    assert not found, f"imports docs/architecture.md does not allow: {sorted(found)}"


def test_no_import_cycle_between_files_or_folders() -> None:
    edges = import_edges(package_modules())
    assert not cycles(edges), f"import cycles between files: {cycles(edges)}"
    assert not cycles(folder_edges(edges)), f"import cycles between folders: {cycles(folder_edges(edges))}"


def test_nothing_outside_the_lab_and_the_commands_imports_the_lab() -> None:
    found = {(a, b) for a, b in import_edges(package_modules())
             if b.startswith("lab/") and _folder(a) not in ("lab", "commands")}
    assert not found, sorted(found)


def test_nested_imports_only_shrink() -> None:
    n = len(nested_imports(package_modules()))
    assert n <= NESTED_IMPORTS_MAX, f"{n} imports of mixrl modules inside functions (at most {NESTED_IMPORTS_MAX})"


def test_import_mixrl_is_light_and_changes_nothing() -> None:
    """A fresh interpreter: ``import mixrl`` loads no heavy library and none of the package's
    layers, and leaves the environment, the warning filters and the loggers as they were."""
    code = (
        "import logging, os, sys, warnings\n"
        "env, filters = dict(os.environ), list(warnings.filters)\n"
        "loggers = set(logging.root.manager.loggerDict)\n"
        "before = set(sys.modules)\n"
        "import mixrl\n"
        "new = sorted(m for m in set(sys.modules) - before if m != 'mixrl')\n"
        "assert not new, new\n"
        "assert dict(os.environ) == env and list(warnings.filters) == filters\n"
        "assert set(logging.root.manager.loggerDict) == loggers\n"
        "print(mixrl.__version__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_no_private_name_crosses_modules() -> None:
    found = private_imports(package_modules())
    assert found <= PRIVATE_ALLOWED, f"private names imported across modules: {sorted(found - PRIVATE_ALLOWED)}"
    assert found >= PRIVATE_ALLOWED, f"fixed, remove from PRIVATE_ALLOWED: {sorted(PRIVATE_ALLOWED - found)}"


def test_no_function_over_80_lines_outside_the_lab() -> None:
    found = long_functions(package_modules())
    assert set(found) <= LONG_ALLOWED, f"functions over {MAX_LINES} lines: {found}"
    assert set(found) >= LONG_ALLOWED, f"fixed, remove from LONG_ALLOWED: {sorted(LONG_ALLOWED - set(found))}"


def test_ray_is_imported_only_in_runtime_backends() -> None:
    found = {rel for rel, tree in package_modules().items() for module, _, _ in _imports(rel, tree)
             if module.split(".")[0] == "ray" and not rel.startswith("runtime/backends/")}
    assert not found, f"ray imported outside runtime/backends: {sorted(found)}"


def test_the_checks_see_what_they_look_for() -> None:
    """Each check flags planted violations and passes their clean twins (a check that cannot fail is no check)."""
    table = read_table("| `low/` | x | — |\n| `mid/` | x | `low` |\n| `top/` | x | everything above |\n"
                       "| folder | concept | may import |\n")
    assert table == {"low": [], "mid": ["low"], "top": ["low", "mid"]}
    assert table_errors({"low": ["mid"], "mid": []}) == ["low: may import 'mid', which is not a row above it"]
    bad = {
        "low/a.py": ast.parse("def f():\n    from mixrl.mid import b\n"),  # nested imports count too
        "low/c.py": ast.parse("import importlib\nimportlib.import_module('mixrl.top.d')\n"),  # and dynamic ones
        "mid/__init__.py": ast.parse(""),
        "mid/b.py": ast.parse("from ..low import a\n"),
        "top/__init__.py": ast.parse(""),
        "top/d.py": ast.parse("from mixrl.low.c import x\nfrom mixrl.mid.b import _x\nimport mixrl.mid._hidden\n"
                              "import mixrl.mid.b as t\nfrom mixrl.mid.b import B\nt._f()\nB._forward(None)\n"),
        "odd/e.py": ast.parse("class A:\n    def f(self):\n" + "        pass\n" * MAX_LINES),
        "low/__init__.py": ast.parse(""),
    }
    assert disallowed_imports(bad, table) == {("low/a.py", "mid/b.py"), ("low/c.py", "top/d.py")}
    assert unnamed_folders(bad, table) == {"odd"}
    assert sorted(cycles(import_edges(bad))) == [["low/a.py", "mid/b.py"], ["low/c.py", "top/d.py"]]
    assert cycles(folder_edges(import_edges(bad))) == [["low", "mid", "top"]]
    assert nested_imports(bad) == {("low/a.py", 2)}
    assert private_imports(bad) == {("top/d.py", "mixrl.mid.b", "_x"),
                                    ("top/d.py", "mixrl.mid._hidden", "_hidden"),
                                    ("top/d.py", "mixrl.mid.b", "_f"),
                                    ("top/d.py", "mixrl.mid.b.B", "_forward")}
    assert long_functions(bad) == {("odd/e.py", "A.f"): MAX_LINES + 1}
    good = {
        "low/a.py": ast.parse("x = 1\n"),
        "mid/b.py": ast.parse("from mixrl.low import a\nfrom . import c\nself._x = 1\n"
                              "def f():\n" + "    pass\n" * (MAX_LINES - 1)),
        "top/d.py": ast.parse("import importlib\nimportlib.import_module('mixrl.mid.b')\n"),
        "low/c.py": ast.parse("cmd = ['python', '-m', 'mixrl.top.d']\n"),
        "lab/f.py": ast.parse("def f():\n    from mixrl.mid import b\n" + "    pass\n" * 200),
    }
    edges = import_edges(good)
    assert not disallowed_imports(good, table) and not cycles(edges) and not cycles(folder_edges(edges))
    assert not private_imports(good) and not long_functions(good) and not nested_imports(good)
