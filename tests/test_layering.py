"""The import rules between flashcp's packages, checked on the AST of every module under ``flashcp/``.

``RULES`` is a table of ``(package, forbidden imports)``: no module of the package (or of its sub-packages)
may import a forbidden module or anything under it, at the top of the file, inside a function, or through
``importlib.import_module("...")`` with a literal name. Add a row to add a rule.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "flashcp"

RULES: list[tuple[str, tuple[str, ...]]] = [
    ("flashcp", ("tests",)),  # the test suite is not shipped: no package module may need it
    ("flashcp.train", ("flashcp.cli", "flashcp.integrations")),  # integrations build on train, not back
    ("flashcp.runtime", ("flashcp.cli",)),
    ("flashcp.integrations", ("flashcp.cli",)),
    ("flashcp.data", ("flashcp.cli",)),
    ("flashcp.planner", ("flashcp.cli",)),
    ("flashcp.models", ("flashcp.train",)),  # a model knows nothing of its training loss
]
"""``(package, forbidden)``: modules of ``package`` import nothing in ``forbidden``."""


def module_name(path: Path) -> str:
    """``flashcp/a/b.py`` -> ``flashcp.a.b``; a package's ``__init__.py`` is the package."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(source: str, module: str, is_package: bool = False) -> list[tuple[int, str]]:
    """``(line, imported module)`` of every import in ``source``, the module ``module``; relative ones resolved.

    ``from a import b`` counts as importing ``a`` and ``a.b`` (``b`` may be a module).
    """
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names if alias.name != "*"]
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str) and _is_import_module(node.func)):
            found.append((node.lineno, node.args[0].value))
    return found


def _is_import_module(func: ast.expr) -> bool:
    return (isinstance(func, ast.Attribute) and func.attr == "import_module") or \
        (isinstance(func, ast.Name) and func.id == "import_module")


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_the_checker_sees_every_kind_of_import():
    source = ("import tests.naive\nfrom flashcp.cli import console\nfrom ..cli.console import progress\n"
              "def f():\n    import importlib\n    return importlib.import_module('flashcp.integrations.hf')\n")
    names = [name for _, name in imports_of(source, "flashcp.train.loop")]
    assert names == ["tests.naive", "flashcp.cli", "flashcp.cli.console", "flashcp.cli.console",
                     "flashcp.cli.console.progress", "importlib", "flashcp.integrations.hf"]
    assert [name for _, name in imports_of("from . import loss\n", "flashcp.train", is_package=True)] == [
        "flashcp.train", "flashcp.train.loss"]


def test_every_rule_names_a_package_that_exists():
    for package, _ in RULES:
        assert (PACKAGE.parent / package.replace(".", "/") / "__init__.py").is_file(), package


@pytest.mark.parametrize("package, forbidden", RULES, ids=[package for package, _ in RULES])
def test_imports_follow_the_layers(package, forbidden):
    broken = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = module_name(path)
        if not _within(module, package):
            continue
        for line, name in imports_of(path.read_text(encoding="utf-8"), module, path.name == "__init__.py"):
            if any(_within(name, bad) for bad in forbidden):
                broken.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {name}")
    assert not broken, f"{package} must not import {', '.join(forbidden)}:\n" + "\n".join(broken)
