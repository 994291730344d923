"""The package's shape, read with ``ast``: layers, private names, function length, Ray.

Layers (lowest first) follow the folder table of the design: each folder may
import only its own layer and the layers below it. ``config`` is the typed
settings every layer reads; ``envs`` and ``data`` form one layer (a task source
builds ``Task`` records, a dataset env reads a source); ``envs`` sits below
``models`` and ``sampling`` because both format prompts with its chat template;
``observe`` reads checkpoints for its studies and sits under ``runtime``, which
writes to its sinks; ``serve`` and ``bench`` start whole runtimes; the CLI is the top.
"""

from __future__ import annotations

import ast
from pathlib import Path

import mixrl

PKG = Path(mixrl.__file__).resolve().parent

LAYERS: list[set[str]] = [
    {"config"},
    {"corrections", "numerics"},
    {"envs", "data"},
    {"models"},
    {"sampling"},
    {"rollout"},
    {"fleet"},
    {"train"},
    {"observe"},
    {"runtime"},
    {"serve"},
    {"bench"},
    {"cli", "__init__"},
]
RANK = {folder: i for i, layer in enumerate(LAYERS) for folder in layer}

# Upward imports that remain, as (importing file, imported module); this list only shrinks.
UPWARD_ALLOWED: set[tuple[str, str]] = set()

# Private names still imported across modules, as (importing file, module, name); only shrinks.
PRIVATE_ALLOWED: set[tuple[str, str, str]] = set()

# Functions still over MAX_LINES outside bench/, as (file, qualified name); only shrinks.
MAX_LINES = 80
LONG_ALLOWED: set[tuple[str, str]] = set()


Modules = dict[str, ast.Module]


def package_modules() -> Modules:
    """Every module of the package by its path relative to the package."""
    return {p.relative_to(PKG).as_posix(): ast.parse(p.read_text(), str(p)) for p in sorted(PKG.rglob("*.py"))}


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


def _folder(rel: str) -> str:
    return rel.split("/")[0].removesuffix(".py")


def _targets(module: str, names: list[str]) -> list[str]:
    """The mixrl modules an import reaches (``from mixrl import x`` reaches ``mixrl.x``)."""
    if module == "mixrl":
        return [f"mixrl.{n}" for n in names]
    return [module] if module.startswith("mixrl.") else []


def upward_imports(modules: Modules) -> set[tuple[str, str]]:
    found = set()
    for rel, tree in modules.items():
        for module, names, _ in _imports(rel, tree):
            for target in _targets(module, names):
                if RANK[target.split(".")[1]] > RANK[_folder(rel)]:
                    found.add((rel, target))
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
    """Functions (methods and nested ones included) over ``MAX_LINES`` lines, outside bench/."""
    found = {}
    for rel, tree in modules.items():
        if rel.startswith("bench/"):
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


def test_every_folder_has_a_layer() -> None:
    assert {_folder(rel) for rel in package_modules()} <= set(RANK)


def test_no_import_from_a_lower_layer_to_a_higher_one() -> None:
    found = upward_imports(package_modules())
    assert found <= UPWARD_ALLOWED, f"new upward imports: {sorted(found - UPWARD_ALLOWED)}"
    assert found >= UPWARD_ALLOWED, f"fixed, remove from UPWARD_ALLOWED: {sorted(UPWARD_ALLOWED - found)}"


def test_no_private_name_crosses_modules() -> None:
    found = private_imports(package_modules())
    assert found <= PRIVATE_ALLOWED, f"private names imported across modules: {sorted(found - PRIVATE_ALLOWED)}"
    assert found >= PRIVATE_ALLOWED, f"fixed, remove from PRIVATE_ALLOWED: {sorted(PRIVATE_ALLOWED - found)}"


def test_no_function_over_80_lines_outside_bench() -> None:
    found = long_functions(package_modules())
    assert set(found) <= LONG_ALLOWED, f"functions over {MAX_LINES} lines: {found}"
    assert set(found) >= LONG_ALLOWED, f"fixed, remove from LONG_ALLOWED: {sorted(LONG_ALLOWED - set(found))}"


def test_ray_is_imported_only_in_runtime_backends() -> None:
    found = {rel for rel, tree in package_modules().items() for module, _, _ in _imports(rel, tree)
             if module.split(".")[0] == "ray" and not rel.startswith("runtime/backends/")}
    assert not found, f"ray imported outside runtime/backends: {sorted(found)}"


def test_the_checks_see_what_they_look_for() -> None:
    """Each check flags planted violations and passes their clean twins (a check that cannot fail is no check)."""
    bad = {
        "numerics/fake.py": ast.parse("from mixrl.system.quiet import quiet\n"),
        "rollout/fake.py": ast.parse("from ..train import batch\n"),
        "serve/fake.py": ast.parse("from mixrl.rollout.session import _x\nimport mixrl.train._hidden\n"
                                   "import mixrl.train.trainer as t\nfrom mixrl.train.trainer import Trainer\n"
                                   "t._f()\nTrainer._forward(None)\n"),
        "envs/fake.py": ast.parse("class A:\n    def f(self):\n" + "        pass\n" * MAX_LINES),
    }
    assert upward_imports(bad) == {("numerics/fake.py", "mixrl.system.quiet"), ("rollout/fake.py", "mixrl.train")}
    assert private_imports(bad) == {("serve/fake.py", "mixrl.rollout.session", "_x"),
                                    ("serve/fake.py", "mixrl.train._hidden", "_hidden"),
                                    ("serve/fake.py", "mixrl.train.trainer", "_f"),
                                    ("serve/fake.py", "mixrl.train.trainer.Trainer", "_forward")}
    assert long_functions(bad) == {("envs/fake.py", "A.f"): MAX_LINES + 1}
    good = {
        "runtime/fake.py": ast.parse("from mixrl.numerics import quant\nfrom . import quiet\nself._x = 1\n"
                                     "def f():\n" + "    pass\n" * (MAX_LINES - 1)),
        "bench/fake.py": ast.parse("def f():\n" + "    pass\n" * 200),
    }
    assert not upward_imports(good) and not private_imports(good) and not long_functions(good)
