"""The plan validator: check many plans in one call and recompute their metrics.

Every plan's coverage and equal-token quotas (or token-slack window) are checked and its metrics recomputed
with the cost model; the error codes become sentences in ``flashcp.planner.pipeline``.
"""

from __future__ import annotations

import numpy as np

from flashcp._numba import njit
from flashcp.costmodel.comm import CONTRIBUTED, RECEIVED, exchange_volumes_kernel
from flashcp.costmodel.sort import order_of
from flashcp.costmodel.workload import (
    max_over_mean,
    offsets_of,
    rank_workloads_kernel,
    slack_tokens,
    token_quotas_kernel,
)

# error codes of check_batch; flashcp.planner.pipeline turns them into sentences
OK, NO_SHARDS, BAD_LENGTH, BAD_RANK, BAD_DOC, BAD_COVERAGE, BAD_QUOTA = range(7)


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
    offsets = offsets_of(lens)
    position = np.empty(num_shards, np.int64)
    for i in range(num_shards):
        position[i] = offsets[doc[i]] + start[i]
    order = order_of(position)  # positions are unique in a valid plan; a repeated one fails below either way
    expected = 0
    for j in range(num_shards):
        i = order[j]
        if position[i] != expected:
            return BAD_COVERAGE
        expected += length[i]
    if expected != offsets[-1]:
        return BAD_COVERAGE
    quotas = token_quotas_kernel(offsets[-1], cp)
    tokens = np.zeros(cp, np.int64)
    for i in range(num_shards):
        tokens[rank[i]] += length[i]
    for r in range(cp):
        if tokens[r] != quotas[r]:
            return BAD_QUOTA
    return OK


@njit(cache=True)
def _check_window(lens, length, rank, cp, window):
    """OK when every rank's tokens are within ``window`` of its quota, else BAD_QUOTA."""
    quotas = token_quotas_kernel(lens.sum(), cp)
    tokens = np.zeros(cp, np.int64)
    for i in range(length.shape[0]):
        tokens[rank[i]] += length[i]
    for q in range(cp):
        if abs(tokens[q] - quotas[q]) > window:
            return BAD_QUOTA
    return OK


@njit(cache=True)
def check_batch(row_offsets, doc_lens, shard_offsets, doc, start, length, rank, cp, slack):
    """Check every row's plan (coverage, equal tokens) and recompute its metrics with the cost model.

    With token ``slack`` > 0 (0.0: exact quotas) a rank may hold ``slack_tokens(slack, C, N)`` tokens more or
    fewer than its quota. Returns (error code per row, imbalance, all-gather critical path, exact-need critical path);
    metrics of a row with an error are left at 0.
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
        if errors[row] == BAD_QUOTA and slack > 0:  # every other check passed; the quotas get the window
            errors[row] = _check_window(lens, n, r, cp, slack_tokens(slack, lens.sum(), cp))
        if errors[row] != OK:
            continue
        work = rank_workloads_kernel(s, n, r, cp)
        imbalance[row] = max_over_mean(work.max(), work.sum(), cp)
        volumes = exchange_volumes_kernel(d, s, n, r, cp, 0)
        ag[row] = volumes[CONTRIBUTED].max()
        a2a[row] = volumes[RECEIVED].max()
    return errors, imbalance, ag, a2a
