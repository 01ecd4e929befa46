"""``flashcp+`` and Algorithm 1 with a bound on the documents they zigzag: ``flashcp2``'s candidates.

Both search ``k = 0, 1, 2, ...`` documents to cut into 2N chunks until the target imbalance is met; a
zigzagged document gives every rank two more shards, so a plan of k of them holds about ``2 k`` shards per
rank beyond one per document. On some sequences (wlb at 512K x cp 64) the target needs k in the hundreds:
tens of thousands of shards, tens of milliseconds of planning, and a plan that receives most of the K/V.
The bounded kernels stop at ``max_zigzag`` documents and build exactly the plans the plain kernels build for
``k <= max_zigzag``. Rules in flashcp/planner/strategies.py; references in ``tests/naive.py``.
"""

from __future__ import annotations

import numpy as np

from flashcp._numba import njit
from flashcp.planner._kernels import (
    _alg1_whole_doc,
    _descending_order,
    _emit_zigzag,
    _finish,
    _finish_within,
    _quotas,
    _ratio,
    _zigzag_sizes,
)
from flashcp.planner._plus import _build
from flashcp.planner._sort import sort_range
from flashcp.planner.cost import workload

__all__ = ["flashcp_bounded", "flashcp_plus_bounded"]


@njit(cache=True)
def flashcp_plus_bounded(lens, cp, target, max_zigzag):
    """``flashcp_plus_kernel`` whose search for the target stops at ``max_zigzag`` zigzagged documents.

    Its first candidate (the heavy documents tail-anchored) is always built; the plan is the first candidate
    within the target, else the most balanced one built, as in ``flashcp+``. Equal to ``flashcp+`` whenever
    ``flashcp+`` meets the target with at most ``max_zigzag`` documents zigzagged.
    """
    num_docs = lens.shape[0]
    quotas = _quotas(lens.sum(), cp)
    order = _descending_order(lens)
    total = 0
    for doc in range(num_docs):
        total += workload(0, lens[doc])
    mean = total // cp
    num_heavy = 0
    for doc in range(num_docs):
        if workload(0, lens[doc]) > mean:
            num_heavy += 1
    capacity = num_docs * (2 * cp + 2) + 16 * cp + 16
    pdoc = np.empty(capacity, np.int64)
    pstart = np.empty(capacity, np.int64)
    plen = np.empty(capacity, np.int64)
    prank = np.empty(capacity, np.int64)
    ratio, count = _build(lens, cp, quotas, order, num_heavy, True, mean, target, pdoc, pstart, plen, prank)
    best = _finish(pdoc, pstart, plen, prank, count, lens)
    if ratio <= target:
        return best
    best_ratio = ratio
    for num_popped in range(max(1, num_heavy), min(num_docs, max_zigzag) + 1):
        ratio, count = _build(lens, cp, quotas, order, num_popped, False, mean, target, pdoc, pstart, plen,
                              prank)
        if ratio < best_ratio:
            best_ratio = ratio
            best = _finish(pdoc, pstart, plen, prank, count, lens)
        if ratio <= target:
            break
    return best


@njit(cache=True)
def flashcp_bounded(lens, cp, target, limit, max_zigzag):
    """Algorithm 1 (``flashcp_within``), or no shards when it needs more than ``max_zigzag`` Per-Doc
    documents to meet ``target`` or its plan misses imbalance ``limit``."""
    num_docs = lens.shape[0]
    quotas = _quotas(lens.sum(), cp)
    order = _descending_order(lens)
    capacity = num_docs * (2 * cp + 1) + 4 * cp + 4
    pdoc = np.empty(capacity, np.int64)
    pstart = np.empty(capacity, np.int64)
    plen = np.empty(capacity, np.int64)
    prank = np.empty(capacity, np.int64)
    early = np.empty((num_docs, cp), np.int64)
    late = np.empty((num_docs, cp), np.int64)
    for num_perdoc in range(min(num_docs, max_zigzag) + 1):
        perdoc = order[:num_perdoc].copy()
        sort_range(perdoc, 0, num_perdoc)
        _zigzag_sizes(lens[perdoc], cp, early, late)
        work = np.zeros(cp, np.int64)
        tokens = np.zeros(cp, np.int64)
        count = 0
        for j in range(num_perdoc):
            first = count
            count = _emit_zigzag(perdoc[j], 0, early[j], late[j], cp, pdoc, pstart, plen, prank, count)
            for i in range(first, count):
                work[prank[i]] += workload(pstart[i], plen[i])
                tokens[prank[i]] += plen[i]
        count = _alg1_whole_doc(lens, cp, quotas, order, num_perdoc, work, tokens, pdoc, pstart, plen, prank,
                                count)
        if _ratio(work.max(), work.sum(), cp) <= target or num_perdoc == num_docs:
            return _finish_within(pdoc, pstart, plen, prank, count, lens, cp, limit)
    return _finish(pdoc, pstart, plen, prank, 0, lens)
