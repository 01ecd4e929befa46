"""mypy over the whole package, as configured in pyproject.toml (``[tool.mypy]``)."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_package_type_checks():
    api = pytest.importorskip("mypy.api", reason="mypy comes with the dev extra: pip install -e '.[dev]'")
    stdout, stderr, status = api.run(["--config-file", str(ROOT / "pyproject.toml"), str(ROOT / "flashcp")])
    assert status == 0, stdout + stderr
