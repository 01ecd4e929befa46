"""Sorting kernels for the planner: int64 values in place, and binary searches in sorted values.

The kernels sort with these instead of ``ndarray.sort``/``np.argsort``/``np.searchsorted``: numba builds
those from closures that every call site compiles again (and links into every kernel above it), which cost
about a tenth of a first ``flashcp plan``'s compile time; these compile once. Stable orders of keys
(``cost.order_of``) sort packed ``key << bits | index`` values with ``sort_range``.
"""

from __future__ import annotations

import numpy as np

from flashcp._numba import njit

__all__ = ["first_at_or_after", "last_at_or_before", "order_of", "sort_range"]

RUN = 32
"""Runs of this many values are insertion-sorted before merging."""


@njit(cache=True)
def _insertion_sort(values, lo, hi):
    for j in range(lo + 1, hi):
        value = values[j]
        k = j - 1
        while k >= lo and values[k] > value:
            values[k + 1] = values[k]
            k -= 1
        values[k + 1] = value


@njit(cache=True)
def sort_range(values, lo, hi):
    """Sort ``values[lo:hi]`` (int64) in place, ascending: insertion-sorted runs, then bottom-up merges."""
    n = hi - lo
    for s in range(lo, hi, RUN):
        _insertion_sort(values, s, min(s + RUN, hi))
    if n <= RUN:
        return
    src = values[lo:hi]
    dst = np.empty(n, np.int64)
    in_place = True  # whether ``src`` is the caller's array
    width = RUN
    while width < n:
        for left in range(0, n, 2 * width):
            mid = min(left + width, n)
            right = min(left + 2 * width, n)
            i, j = left, mid
            for k in range(left, right):
                if j >= right or (i < mid and src[i] <= src[j]):
                    dst[k] = src[i]
                    i += 1
                else:
                    dst[k] = src[j]
                    j += 1
        src, dst = dst, src
        in_place = not in_place
        width *= 2
    if not in_place:
        for k in range(n):
            values[lo + k] = src[k]


@njit(cache=True)
def _count_before(values, value, inclusive):
    """How many entries of ascending ``values`` are below ``value`` (at or below it with ``inclusive``)."""
    lo = 0
    hi = values.shape[0]
    while lo < hi:
        mid = (lo + hi) // 2
        if values[mid] < value or (inclusive and values[mid] == value):
            lo = mid + 1
        else:
            hi = mid
    return lo


@njit(cache=True)
def first_at_or_after(values, value):
    """The smallest ``i`` with ``values[i] >= value`` in ascending ``values`` (``searchsorted(.., 'left')``)."""
    return _count_before(values, value, False)


@njit(cache=True)
def last_at_or_before(offsets, value):
    """The largest ``i`` with ``offsets[i] <= value`` in ascending ``offsets`` (``searchsorted(.., 'right') - 1``)."""
    return _count_before(offsets, value, True) - 1


@njit(cache=True)
def order_of(key):
    """``np.argsort(key, kind="mergesort")`` of int64 keys (stable: equal keys by index).

    Sorts ``key << bits | index`` values, which is faster than sorting indices. Keys that are negative or too
    large for that are first replaced by their rank among the sorted keys (equal keys, equal rank).
    """
    n = key.shape[0]
    bits = 1
    while (1 << bits) < n:
        bits += 1
    top = 0
    low = 0
    for i in range(n):
        top = max(top, key[i])
        low = min(low, key[i])
    if low < 0 or top >= (1 << (62 - bits)):
        ranks = key.copy()
        sort_range(ranks, 0, n)
        dense = np.empty(n, np.int64)
        for i in range(n):
            dense[i] = first_at_or_after(ranks, key[i])
        key = dense
    packed = np.empty(n, np.int64)
    for i in range(n):
        packed[i] = (key[i] << bits) | i
    sort_range(packed, 0, n)
    mask = (1 << bits) - 1
    for i in range(n):
        packed[i] &= mask
    return packed
