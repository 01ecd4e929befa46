"""The planner's sorting kernels equal numpy's sort and searchsorted."""

import numpy as np
import pytest

from flashcp.costmodel.sort import first_at_or_after, last_at_or_before, sort_range


@pytest.mark.parametrize("n", [0, 1, 5, 31, 32, 33, 64, 65, 100, 1000, 5000])
def test_sort_range_sorts_like_numpy(n):
    rng = np.random.default_rng(n)
    for high in (4, 1 << 40):
        values = rng.integers(-high, high, n).astype(np.int64)
        expected = np.sort(values)
        got = values.copy()
        sort_range(got, 0, n)
        assert np.array_equal(got, expected), f"n={n}, high={high}"


def test_sort_range_sorts_only_its_range():
    rng = np.random.default_rng(1)
    values = rng.integers(0, 1000, 300).astype(np.int64)
    for lo, hi in ((0, 0), (3, 4), (10, 200), (37, 300), (0, 300)):
        got = values.copy()
        sort_range(got, lo, hi)
        expected = values.copy()
        expected[lo:hi] = np.sort(values[lo:hi])
        assert np.array_equal(got, expected), (lo, hi)


def test_binary_searches_equal_searchsorted():
    rng = np.random.default_rng(2)
    values = np.sort(rng.integers(0, 50, 40)).astype(np.int64)
    for probe in range(-2, 53):
        assert first_at_or_after(values, probe) == np.searchsorted(values, probe, side="left")
        assert last_at_or_before(values, probe) == np.searchsorted(values, probe, side="right") - 1
    empty = np.zeros(0, np.int64)
    assert first_at_or_after(empty, 3) == 0 and last_at_or_before(empty, 3) == -1
