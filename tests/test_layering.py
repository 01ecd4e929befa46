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
    # a trainer reads plans (planner.plan_reader) and may plan online (planner.planning); it never writes one
    ("flashcp.runtime", ("flashcp.planner.plan_writer", "flashcp.planner.pipeline", "flashcp.planner.compare")),
    ("flashcp.train", ("flashcp.planner.plan_writer", "flashcp.planner.pipeline", "flashcp.planner.compare")),
    ("flashcp.integrations", ("flashcp.planner.plan_writer", "flashcp.planner.pipeline",
                              "flashcp.planner.compare")),
    ("flashcp.costmodel", ("torch",)),  # the bottom floor prices plans with numpy and numba alone
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


LAYERS: list[tuple[str, ...]] = [
    ("flashcp.costmodel",),
    ("flashcp.data", "flashcp.planner"),
    ("flashcp.runtime", "flashcp.models"),
    ("flashcp.train", "flashcp.integrations"),
    ("flashcp.bench",),
    ("flashcp.engines",),
    ("flashcp.cli",),
]
"""The layer order, bottom first: a module imports flashcp's shared modules (``errors``, ``fileio``,
``outputs``, ``_numba``, the version) and packages of its own layer or below, never one above."""


def _layer(module: str) -> int | None:
    if module == "flashcp.__main__":  # ``python -m flashcp``: the command line
        return len(LAYERS) - 1
    return next((i for i, layer in enumerate(LAYERS) if any(_within(module, p) for p in layer)), None)


def test_every_package_has_a_layer():
    packages = {module_name(path.parent / "__init__.py") for path in PACKAGE.glob("*/__init__.py")}
    assert packages == {p for layer in LAYERS for p in layer}


def test_no_import_runs_upward():
    broken = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = module_name(path)
        own = _layer(module)
        if own is None:  # flashcp's shared modules import only each other
            own = -1
        for line, name in imports_of(path.read_text(encoding="utf-8"), module, path.name == "__init__.py"):
            target = _layer(name) if name.startswith("flashcp.") else None
            if target is not None and target > own:
                broken.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {name} "
                              f"(layer {LAYERS[target][0]} above {LAYERS[own][0] if own >= 0 else 'flashcp'})")
    assert not broken, "imports that run upward:\n" + "\n".join(broken)


def test_the_cost_model_imports_only_numpy_numba_and_errors():
    allowed = ("flashcp.costmodel", "flashcp._numba", "flashcp.errors", "numpy", "numba", "__future__",
               "dataclasses", "functools", "math", "json", "importlib", "pathlib", "typing")
    broken = [f"{path.name}:{line} imports {name}"
              for path in sorted((PACKAGE / "costmodel").rglob("*.py"))
              for line, name in imports_of(path.read_text(encoding="utf-8"), module_name(path),
                                           path.name == "__init__.py")
              if not any(_within(name, ok) for ok in allowed)]
    assert not broken, "\n".join(broken)


def test_cost_model_modules_import_each_other_in_one_direction():
    """No two cost-model modules import each other (the attention curve lives in ``curve``, below both the
    profile and the objective)."""
    imports = {module_name(path): {name for _, name in imports_of(path.read_text(encoding="utf-8"),
                                                                   module_name(path))}
               for path in sorted((PACKAGE / "costmodel").glob("*.py")) if path.name != "__init__.py"}
    pairs = sorted((a, b) for a in imports for b in imports[a] if a < b and a in imports.get(b, ()))
    assert not pairs, pairs


def test_cost_model_names_others_import_are_in_all():
    """Every name another module imports from a cost-model module is in that module's ``__all__``."""
    import importlib

    missing = []
    for root in ("flashcp", "tests", "scripts", "examples"):
        for path in sorted((PACKAGE.parent / root).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("flashcp.costmodel."):
                    exported = importlib.import_module(node.module).__all__
                    missing += [f"{path.name}:{node.lineno} {node.module}.{alias.name}" for alias in node.names
                                if alias.name not in exported and module_name(path) != node.module]
    assert not missing, "\n".join(missing)


KERNEL_LIBRARIES = {"flash_attn": "flashcp.runtime.kernels.fa2", "flash_attn.cute": "flashcp.runtime.kernels.fa4",
                    "flash_attn_interface": "flashcp.runtime.kernels.fa3"}
"""Each attention library (flash-attn-4 installs as ``flash_attn.cute``) and the one module that imports it."""


def test_each_attention_library_is_imported_in_its_one_module():
    broken = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = module_name(path)
        for line, name in imports_of(path.read_text(encoding="utf-8"), module, path.name == "__init__.py"):
            library = max((lib for lib in KERNEL_LIBRARIES if _within(name, lib)), key=len, default=None)
            if library is not None and module != KERNEL_LIBRARIES[library]:
                broken.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {name}")
    assert not broken, "only the library's own module may import it:\n" + "\n".join(broken)


RECURRENT_LIBRARIES = ("fla", "mamba_ssm", "causal_conv1d")
"""The recurrent kernel libraries; ``flashcp.runtime.recurrent.backends`` is the one module that imports them."""


def test_recurrent_libraries_are_imported_in_the_backends_module_only():
    broken = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = module_name(path)
        for line, name in imports_of(path.read_text(encoding="utf-8"), module, path.name == "__init__.py"):
            if any(_within(name, lib) for lib in RECURRENT_LIBRARIES) and \
                    module != "flashcp.runtime.recurrent.backends":
                broken.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {name}")
    assert not broken, "only flashcp.runtime.recurrent.backends may import them:\n" + "\n".join(broken)


def test_importing_the_runtime_loads_no_planning_kernel():
    """A training process reads plans and the cost model; it never imports a strategy kernel or the batch
    planner (nor, through them, compiles or loads their machine code)."""
    import subprocess
    import sys

    code = ("import sys, flashcp.runtime, flashcp.train\n"
            "print('\\n'.join(m for m in sys.modules if m.startswith('flashcp.planner')))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            cwd=PACKAGE.parent).stdout.split()
    assert "flashcp.planner.plan" in loaded and "flashcp.planner.plan_reader" in loaded
    kernels = [m for m in loaded if m.startswith(("flashcp.planner.strategies", "flashcp.planner.batch",
                                                  "flashcp.planner.check", "flashcp.planner.registry",
                                                  "flashcp.planner.ilp", "flashcp.planner.pipeline"))]
    assert not kernels, kernels


def test_no_planner_modules_import_each_other():
    """The planner's modules import one another in one direction only (no circle, of any length): params and
    batch below the registry, the registry below planning, planning below compare and the pipeline."""
    modules = {module_name(path): path for path in sorted((PACKAGE / "planner").rglob("*.py"))}
    edges = {module: {name for _, name in imports_of(path.read_text(encoding="utf-8"), module,
                                                     path.name == "__init__.py")
                      if name in modules and name != module and not module.startswith(name + ".")}
             for module, path in modules.items()}
    done: set[str] = set()

    def circle_from(module: str, path: list[str]) -> list[str] | None:
        if module in path:
            return path[path.index(module):] + [module]
        if module in done:
            return None
        for name in sorted(edges[module]):
            found = circle_from(name, path + [module])
            if found:
                return found
        done.add(module)
        return None

    circles = [c for c in (circle_from(module, []) for module in sorted(modules)) if c]
    assert not circles, "planner modules that import each other: " + " -> ".join(circles[0])


TESTS = PACKAGE.parent / "tests"


def test_no_test_module_imports_another_test_module():
    """What tests share lives in helper modules (tests/naive.py, plans.py, dist.py, equivalence.py, ...): a
    ``test_*.py`` imported by another would run its tests twice and tie the two files' fixtures together."""
    test_modules = {".".join(path.relative_to(TESTS.parent).with_suffix("").parts)
                    for path in TESTS.rglob("test_*.py")}
    broken = []
    for path in sorted(TESTS.rglob("*.py")):
        module = ".".join(path.relative_to(TESTS.parent).with_suffix("").parts)
        for line, name in imports_of(path.read_text(encoding="utf-8"), module, path.name == "__init__.py"):
            if name in test_modules and name != module:
                broken.append(f"{path.relative_to(TESTS.parent)}:{line} imports {name}")
    assert not broken, "test modules imported by other modules (move what they share to a helper):\n" + \
        "\n".join(broken)


def _cannot_fail(test: ast.expr) -> bool:
    """An assert whose outcome the test's own text decides: a constant, an f-string or a tuple (always true), a
    comparison of literals only, or of an expression with itself."""
    if isinstance(test, (ast.Constant, ast.JoinedStr, ast.Tuple)):
        return True
    if isinstance(test, ast.Compare):
        sides = [test.left, *test.comparators]
        if all(isinstance(side, ast.Constant) for side in sides):
            return True
        return any(ast.dump(a) == ast.dump(b) for a, b in zip(sides, sides[1:]))
    return False


def test_every_assert_in_the_tests_can_fail():
    broken = [f"{path.relative_to(TESTS.parent)}:{node.lineno} assert {ast.unparse(node.test)[:80]}"
              for path in sorted(TESTS.rglob("*.py"))
              for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
              if isinstance(node, ast.Assert) and _cannot_fail(node.test)]
    assert not broken, "asserts that cannot fail:\n" + "\n".join(broken)


def test_the_assert_check_can_fail():
    cannot = ["assert 'some words'", "assert (x, 'message')", "assert x == x", "assert 1 < 2", "assert f'{x}'"]
    can = ["assert x == 1", "assert a < b", "assert f(x) == f(y)"]
    assert [_cannot_fail(ast.parse(s).body[0].test) for s in cannot + can] == [True] * 5 + [False] * 3


def test_no_two_modules_import_each_other():
    """A module and the one it imports are never the other way round too (a package and its own modules aside)."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        name = module_name(path)
        modules[name] = {imported for _, imported in imports_of(path.read_text(), name, path.name == "__init__.py")}
    pairs = sorted({tuple(sorted((a, b))) for a, imported in modules.items() for b in imported
                    if b in modules and b != a and a in modules[b] and not _within(a, b) and not _within(b, a)})
    assert not pairs, f"modules importing each other: {pairs}"
