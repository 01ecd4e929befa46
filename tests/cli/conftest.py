"""Fixtures of the command-line tests."""

import pytest

from tests.cli import run


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli") / "data"
    result = run("synth", root, "--dist", "wlb", "--num-seqs", 24, "--context-len", 4099, "--seed", 3,
                 "--vocab-size", 1000)
    assert result.exit_code == 0, result.output
    assert "24 sequences x 4,099 tokens" in result.output
    return root
