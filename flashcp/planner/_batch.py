"""Batch kernels: plan many sequences in one call, and check many plans in one call.

Sequences come as flat arrays: ``row_offsets`` (rows + 1,) indexes ``doc_lens`` by row. Plans come back the
same way: ``shard_offsets`` (rows + 1,) indexes the flat shard arrays.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from flashcp.planner._kernels import (
    _doc_offsets,
    _quotas,
    _ratio,
    flashcp_kernel,
    llama3_kernel,
    perdoc_kernel,
)
from flashcp.planner._plus import flashcp_plus_kernel
from flashcp.planner.cost import _allgather_contributions, _exact_need_received, _rank_workloads

# error codes of check_batch; flashcp.planner.pipeline turns them into sentences
OK, NO_SHARDS, BAD_LENGTH, BAD_RANK, BAD_DOC, BAD_COVERAGE, BAD_QUOTA = range(7)


@njit(cache=True)
def _plan_one(lens, cp, code, target):
    if code == 0:
        return llama3_kernel(lens, cp)
    if code == 1:
        return perdoc_kernel(lens, cp)
    if code == 2:
        return flashcp_kernel(lens, cp, target)
    return flashcp_plus_kernel(lens, cp, target)


@njit(cache=True)
def _grown(values, size, capacity):
    out = np.empty(capacity, np.int64)
    out[:size] = values[:size]
    return out


@njit(cache=True)
def plan_batch(row_offsets, doc_lens, cp, code, target):
    """Plan every row with strategy ``code``; returns (shard_offsets, doc, start, len, rank)."""
    rows = row_offsets.shape[0] - 1
    shard_offsets = np.zeros(rows + 1, np.int64)
    capacity = 2 * doc_lens.shape[0] + 4 * cp * rows + 16
    out_doc = np.empty(capacity, np.int64)
    out_start = np.empty(capacity, np.int64)
    out_len = np.empty(capacity, np.int64)
    out_rank = np.empty(capacity, np.int64)
    size = 0
    for row in range(rows):
        lens = np.ascontiguousarray(doc_lens[row_offsets[row]:row_offsets[row + 1]])
        doc, start, length, rank = _plan_one(lens, cp, code, target)
        m = doc.shape[0]
        if size + m > capacity:
            # grow by the shards per row seen so far, projected over the remaining rows
            capacity = max(2 * capacity, size + m, (size + m) * rows // (row + 1) + 16)
            out_doc = _grown(out_doc, size, capacity)
            out_start = _grown(out_start, size, capacity)
            out_len = _grown(out_len, size, capacity)
            out_rank = _grown(out_rank, size, capacity)
        out_doc[size:size + m] = doc
        out_start[size:size + m] = start
        out_len[size:size + m] = length
        out_rank[size:size + m] = rank
        size += m
        shard_offsets[row + 1] = size
    return shard_offsets, out_doc[:size], out_start[:size], out_len[:size], out_rank[:size]


@njit(cache=True)
def _check_row(lens, doc, start, length, rank, cp):
    num_shards = doc.shape[0]
    if num_shards == 0:
        return NO_SHARDS
    for i in range(num_shards):
        if length[i] < 1:
            return BAD_LENGTH
        if rank[i] < 0 or rank[i] >= cp:
            return BAD_RANK
        if doc[i] < 0 or doc[i] >= lens.shape[0]:
            return BAD_DOC
        if start[i] < 0 or start[i] + length[i] > lens[doc[i]]:
            return BAD_COVERAGE
    offsets = _doc_offsets(lens)
    position = np.empty(num_shards, np.int64)
    for i in range(num_shards):
        position[i] = offsets[doc[i]] + start[i]
    order = np.argsort(position)
    expected = 0
    for j in range(num_shards):
        i = order[j]
        if position[i] != expected:
            return BAD_COVERAGE
        expected += length[i]
    if expected != offsets[-1]:
        return BAD_COVERAGE
    quotas = _quotas(offsets[-1], cp)
    tokens = np.zeros(cp, np.int64)
    for i in range(num_shards):
        tokens[rank[i]] += length[i]
    for r in range(cp):
        if tokens[r] != quotas[r]:
            return BAD_QUOTA
    return OK


@njit(cache=True)
def check_batch(row_offsets, doc_lens, shard_offsets, doc, start, length, rank, cp):
    """Check every row's plan (coverage, equal tokens) and recompute its metrics with the cost model.

    Returns (error code per row, imbalance, all-gather critical path, exact-need critical path); metrics of
    a row with an error are left at 0.
    """
    rows = row_offsets.shape[0] - 1
    errors = np.zeros(rows, np.int64)
    imbalance = np.zeros(rows, np.float64)
    ag = np.zeros(rows, np.int64)
    a2a = np.zeros(rows, np.int64)
    for row in range(rows):
        lens = doc_lens[row_offsets[row]:row_offsets[row + 1]]
        lo = shard_offsets[row]
        hi = shard_offsets[row + 1]
        d = doc[lo:hi]
        s = start[lo:hi]
        n = length[lo:hi]
        r = rank[lo:hi]
        errors[row] = _check_row(lens, d, s, n, r, cp)
        if errors[row] != OK:
            continue
        work = _rank_workloads(s, n, r, cp)
        imbalance[row] = _ratio(work.max(), work.sum(), cp)
        ag[row] = _allgather_contributions(d, s, r, n, cp).max()
        a2a[row] = _exact_need_received(d, s, n, r, cp).max()
    return errors, imbalance, ag, a2a
