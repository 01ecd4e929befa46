"""The suite's Numba cache: one folder of its own, empty when the run starts, shared by every process.

flashcp's kernels are cached on disk (``flashcp._numba``). The suite points ``NUMBA_CACHE_DIR`` at a fresh
temporary folder before flashcp is imported, so that every run compiles from nothing, as a new user's first
run does, whatever earlier runs left in the checkout. The first-contact tests run first
(``tests/test_first_contact.py``): the README's main job, each command a process of its own, compiles into
this empty folder, and every later test, in this process or in the ranks and commands it starts, loads what
those processes cached. Kernels loaded from the cache by another process are so exercised by the whole suite.
The folder is removed at the end of the run. ``FLASHCP_TEST_NUMBA_CACHE=DIR`` keeps one across runs instead
(faster when running a few tests again and again; the first-contact tests then take folders of their own).
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

KEPT = os.environ.get("FLASHCP_TEST_NUMBA_CACHE")
SUITE_CACHE = KEPT or tempfile.mkdtemp(prefix="flashcp-suite-numba-")
os.environ["NUMBA_CACHE_DIR"] = SUITE_CACHE

FIRST = "tests.test_first_contact"


def pytest_collection_modifyitems(config, items):
    """The first-contact tests first (they need the suite's cache still empty); the rest keep their order.

    Tests marked ``gpu`` are skipped where torch sees no CUDA device.
    """
    items.sort(key=lambda item: getattr(item.module, "__name__", "") != FIRST)
    import torch

    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA device")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


def pytest_sessionfinish(session, exitstatus):
    if not KEPT:
        shutil.rmtree(SUITE_CACHE, ignore_errors=True)
