"""Tests of flashcp.bench; ``bench_run`` runs ``flashcp bench`` in-process."""

import importlib.util
from pathlib import Path

from click.testing import CliRunner

from flashcp.cli import cli


def bench_run(*args):
    """``flashcp bench ARGS`` in this process; fails the test unless it exits 0."""
    result = CliRunner().invoke(cli, ["bench", *args])
    assert result.exit_code == 0, result.output
    return result


def bench_script(name):
    """The module of ``scripts/NAME.py`` (scripts are not a package)."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[2] / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
