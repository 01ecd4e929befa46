"""Where compiled planner kernels go, and the one-line notice of a first compile."""

from __future__ import annotations

import os

import numpy as np

from flashcp.planner import _batch, _numba_cache
from flashcp.planner.strategies import get_strategy


def test_a_writable_package_or_user_cache_is_left_to_numba(tmp_path):
    assert _numba_cache.fallback_cache_dir(tmp_path / "pkg", tmp_path / "user") is None


def test_read_only_package_and_home_fall_back_to_a_temporary_folder(tmp_path, monkeypatch):
    read_only = {tmp_path / "pkg" / "__pycache__", tmp_path / "user"}
    monkeypatch.setattr(_numba_cache, "_writable", lambda folder: folder not in read_only)
    folder = _numba_cache.fallback_cache_dir(tmp_path / "pkg", tmp_path / "user")
    assert folder is not None and folder.name.startswith("flashcp-numba-cache-")
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    monkeypatch.setattr(_numba_cache, "_user_cache_dir", lambda: tmp_path / "user")
    monkeypatch.setattr(_numba_cache, "__file__", str(tmp_path / "pkg" / "_numba_cache.py"))
    import numba

    before = numba.config.CACHE_DIR
    try:
        _numba_cache.use_writable_cache()
        assert os.environ["NUMBA_CACHE_DIR"] == str(folder) == numba.config.CACHE_DIR
    finally:
        numba.config.CACHE_DIR = before


def test_no_compile_notice_once_the_kernels_are_compiled():
    code = get_strategy("llama3").code
    offsets, lens = np.array([0, 3], np.int64), np.array([3, 5, 8], np.int64)
    plans = _batch.plan_batch(offsets, lens, 2, code, 1.0)
    errors = _batch.check_batch(offsets, lens, *plans, 2, 0.0)[0]
    assert errors.tolist() == [0]
    assert not _batch.needs_compile(code)
