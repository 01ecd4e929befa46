"""Where compiled kernels are cached, how they are named, and the one-line notice of a first compile."""

from __future__ import annotations

import numpy as np
from numba.core import bytecode

from flashcp import _numba
from flashcp.planner import batch, check
from flashcp.planner.registry import get_strategy


def test_function_numbers_are_random_so_two_processes_never_share_a_name():
    ids = [next(bytecode.FunctionIdentity._unique_ids) for _ in range(1000)]
    assert isinstance(bytecode.FunctionIdentity._unique_ids, _numba._RandomIds)
    assert len(set(ids)) == len(ids)
    assert all(1 << 62 <= i < 1 << 63 for i in ids)


def test_every_kernel_module_is_in_the_cache_key():
    names = {p.relative_to(_numba.PACKAGE).as_posix() for p in _numba.kernel_sources()}
    assert {"planner/strategies/baselines.py", "planner/strategies/flashcp2.py", "costmodel/comm.py",
            "costmodel/objective.py", "planner/batch.py", "planner/check.py",
            "data/synth.py", "engines/_layout.py", "planner/registry.py"} <= names  # the registry links
    # a kernel module is one that takes njit from flashcp._numba, never from numba itself
    for path in _numba.PACKAGE.rglob("*.py"):
        assert "from numba import njit" not in path.read_text(), path


def test_kernels_cache_in_the_keyed_folder():
    folder = _numba.cache_folder()
    assert folder.name.endswith(_numba.cache_key())
    assert (folder / _numba.MARKER).is_file()
    cache_path = check.check_batch._cache._cache_path
    assert cache_path == str(folder / "planner")


def test_a_changed_kernel_source_changes_the_key(tmp_path, monkeypatch):
    package = tmp_path / "flashcp"
    (package / "planner").mkdir(parents=True)
    kernel = package / "planner" / "k.py"
    kernel.write_text("from flashcp._numba import njit\n")
    (package / "other.py").write_text("x = 1\n")
    monkeypatch.setattr(_numba, "PACKAGE", package)
    _numba.cache_key.cache_clear()
    try:
        first = _numba.cache_key()
        (package / "other.py").write_text("x = 2\n")  # not a kernel module: same key
        _numba.cache_key.cache_clear()
        assert _numba.cache_key() == first
        kernel.write_text("from flashcp._numba import njit\n# changed\n")
        _numba.cache_key.cache_clear()
        second = _numba.cache_key()
        assert second != first
        registry = package / "planner" / "registry.py"  # decides which kernel a strategy name links
        registry.write_text("ring = 'ring_kernel'\n")
        _numba.cache_key.cache_clear()
        third = _numba.cache_key()
        assert third != second
        registry.write_text("ring = 'llama3_kernel'\n")
        _numba.cache_key.cache_clear()
        assert _numba.cache_key() not in (first, second, third)
    finally:
        _numba.cache_key.cache_clear()


def test_older_keys_are_removed_only_when_flashcp_made_them(tmp_path):
    pycache = tmp_path / "__pycache__"
    current, old, foreign = pycache / "numba-new", pycache / "numba-old", pycache / "numba-users"
    for folder in (current, old, foreign):
        folder.mkdir(parents=True)
    (old / _numba.MARKER).write_text("")
    (foreign / "notes.txt").write_text("mine")
    _numba._remove_older_keys(current)
    assert current.is_dir() and not old.exists() and (foreign / "notes.txt").read_text() == "mine"


def test_no_compile_notice_once_the_kernels_are_compiled():
    offsets, lens = np.array([0, 3], np.int64), np.array([3, 5, 8], np.int64)
    plans = batch.plan_batch(offsets, lens, 2, get_strategy("llama3"))
    errors = check.check_batch(offsets, lens, *plans, 2, 0.0)[0]
    assert errors.tolist() == [0]
    assert not batch.needs_compile(get_strategy("llama3"))


def test_the_command_line_skips_numbas_blas_probe(tmp_path):
    """``flashcp`` processes never import scipy.linalg (numba's BLAS probe, ~0.4 s of start-up); a library
    user's process keeps numba's own probe."""
    import subprocess
    import sys

    from click.testing import CliRunner

    from flashcp.cli import cli

    data = tmp_path / "d"
    assert CliRunner().invoke(cli, ["synth", str(data), "--dist", "wlb", "--num-seqs", "2", "--context-len", "4096",
                                    "--no-tokens"]).exit_code == 0
    command = ("import sys\nfrom flashcp.cli import main\n"
               f"sys.argv = ['flashcp', 'plan', {str(data)!r}, '--cp', '4', '--strategy', 'llama3', '-q']\n"
               "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
               "print('scipy.linalg' in sys.modules, 'numba.np.arraymath' in sys.modules)")
    library = ("import sys\nfrom flashcp.planner import plan_sequence\nplan_sequence('llama3', [5, 9], 2)\n"
               "print('scipy.linalg' in sys.modules, 'numba.np.arraymath' in sys.modules)")
    run = lambda code: subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,  # noqa: E731
                                      check=True).stdout.split()[-2:]
    assert run(command) == ["False", "True"]
    try:
        import scipy.linalg  # noqa: F401
    except ImportError:
        return  # no scipy: numba's probe finds none either way
    assert run(library) == ["True", "True"]
