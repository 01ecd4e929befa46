"""Numba kernels of ``flashcp2`` (portfolio + local search under the step-time objective) and the batch
planner of the strategies defined beyond ``_kernels``/``_plus`` (``magi``, ``ptrr``, ``flashcp2``).

Rules in flashcp/planner/strategies.py; ``tests/naive.py`` holds the plain-Python reference of the search.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from flashcp.planner._kernels import _finish, flashcp_kernel, llama3_kernel
from flashcp.planner._peers import magi_kernel, ptrr_kernel
from flashcp.planner._plus import flashcp_plus_kernel
from flashcp.planner.cost import _rank_workloads
from flashcp.planner.objective import step_seconds

__all__ = ["FLASHCP2", "MAGI", "PTRR", "flashcp2_kernel", "local_search", "plan_batch", "plan_one"]

MAGI, PTRR, FLASHCP2 = 5, 6, 7
"""Strategy codes this module plans (registry ``Strategy.code``)."""
PORTFOLIO_CHUNKS = (512, 1024, 2048)
"""Chunk sizes of the chunked-assignment (``magi``) candidates."""
EVALS_PER_EFFORT = 48
"""Objective evaluations of the local search per unit of ``effort``."""
STEPS = (1024, 256, 64, 16)
"""Boundary shifts the local search tries, largest first."""


@njit(cache=True)
def _imbalance(start, length, rank, cp):
    work = _rank_workloads(start, length, rank, cp)
    total = work.sum()
    if total == 0:
        return 1.0
    return float(work.max()) / (float(total) / float(cp))


@njit(cache=True)
def _boundaries(doc, start, length):
    """Pairs ``(left, right)`` of shard indices that touch inside one document on different ranks."""
    n = doc.shape[0]
    order = np.argsort(doc * (1 << 40) + start)
    left = np.empty(n, np.int64)
    right = np.empty(n, np.int64)
    m = 0
    for j in range(1, n):
        a = order[j - 1]
        b = order[j]
        if doc[a] == doc[b] and start[a] + length[a] == start[b]:
            left[m] = a
            right[m] = b
            m += 1
    return left[:m], right[:m]


@njit(cache=True)
def _shift(left, right, delta, start, length):
    """Move the boundary between touching shards ``left`` and ``right`` by ``delta`` tokens (> 0: right)."""
    length[left] += delta
    start[right] += delta
    length[right] -= delta


@njit(cache=True)
def local_search(doc, start, length, rank, cp, model, target, budget):
    """Improve a plan in place by paired boundary moves; returns (step seconds, evaluations used).

    A move shifts two document boundaries at once by the same ``delta`` so that tokens go from rank x to
    rank y at the first and back at the second (every rank keeps its tokens). Moves are tried for every pair
    of boundaries between the same two ranks, shifts from ``STEPS`` (largest first), and kept when the step
    time drops and the imbalance stays within ``target``; a pass over all moves repeats while it improves,
    until ``budget`` objective evaluations are spent.
    """
    best = step_seconds(doc, start, length, rank, cp, model)
    used = 0
    left, right = _boundaries(doc, start, length)
    nb = left.shape[0]
    improved = True
    while improved and used < budget:
        improved = False
        for step in STEPS:
            for i in range(nb):
                a_l, a_r = left[i], right[i]
                for j in range(i + 1, nb):
                    b_l, b_r = left[j], right[j]
                    # boundary i: +d moves rank(a_r) -> rank(a_l); boundary j must move it back
                    x, y = rank[a_r], rank[a_l]
                    if rank[b_l] == x and rank[b_r] == y:
                        sign_j = 1
                    elif rank[b_l] == y and rank[b_r] == x:
                        sign_j = -1
                    else:
                        continue
                    for sign_i in (1, -1):
                        d_i = sign_i * step
                        d_j = sign_i * sign_j * step
                        if d_i > 0 and length[a_r] <= d_i or d_i < 0 and length[a_l] <= -d_i:
                            continue
                        if d_j > 0 and length[b_r] <= d_j or d_j < 0 and length[b_l] <= -d_j:
                            continue
                        if used >= budget:
                            return best, used
                        _shift(a_l, a_r, d_i, start, length)
                        _shift(b_l, b_r, d_j, start, length)
                        used += 1
                        got = step_seconds(doc, start, length, rank, cp, model)
                        if got < best and _imbalance(start, length, rank, cp) <= target:
                            best = got
                            improved = True
                            break
                        _shift(b_l, b_r, -d_j, start, length)
                        _shift(a_l, a_r, -d_i, start, length)
    return best, used


@njit(cache=True)
def flashcp2_kernel(lens, cp, target, effort, model):
    """Portfolio of candidate plans, the best under the step time, then local search (see strategies.py)."""
    best_doc, best_start, best_len, best_rank = flashcp_plus_kernel(lens, cp, target)
    best_time = step_seconds(best_doc, best_start, best_len, best_rank, cp, model)
    # the imbalance every candidate must meet: the target, or flashcp+'s own when it misses the target
    limit = max(target, _imbalance(best_start, best_len, best_rank, cp))
    for c in range(2 + len(PORTFOLIO_CHUNKS)):
        if c == 0:
            doc, start, length, rank = flashcp_kernel(lens, cp, 1.05)
        elif c == 1:
            doc, start, length, rank = llama3_kernel(lens, cp)
        else:
            doc, start, length, rank = magi_kernel(lens, cp, PORTFOLIO_CHUNKS[c - 2])
        t = step_seconds(doc, start, length, rank, cp, model)
        if t < best_time and _imbalance(start, length, rank, cp) <= limit:
            best_doc, best_start, best_len, best_rank, best_time = doc, start, length, rank, t
    if effort > 0:
        start = best_start.copy()
        length = best_len.copy()
        local_search(best_doc, start, length, best_rank, cp, model, limit, effort * EVALS_PER_EFFORT)
        return _finish(best_doc, start, length, best_rank, best_doc.shape[0], lens)
    return best_doc, best_start, best_len, best_rank


@njit(cache=True)
def plan_one(lens, cp, code, target, chunk, effort, model):
    """One sequence with strategy ``code`` (MAGI, PTRR or FLASHCP2)."""
    if code == MAGI:
        return magi_kernel(lens, cp, chunk)
    if code == PTRR:
        return ptrr_kernel(lens, cp, chunk)
    return flashcp2_kernel(lens, cp, target, effort, model)


@njit(cache=True)
def plan_batch(row_offsets, doc_lens, cp, code, target, chunk, effort, model):
    """Plan every row; returns (shard_offsets, doc, start, len, rank) like ``_batch.plan_batch``."""
    rows = row_offsets.shape[0] - 1
    shard_offsets = np.zeros(rows + 1, np.int64)
    capacity = 2 * doc_lens.shape[0] + 4 * cp * rows + 16
    out = np.empty((4, capacity), np.int64)
    size = 0
    for row in range(rows):
        lens = np.ascontiguousarray(doc_lens[row_offsets[row]:row_offsets[row + 1]])
        doc, start, length, rank = plan_one(lens, cp, code, target, chunk, effort, model)
        m = doc.shape[0]
        if size + m > out.shape[1]:
            grown = np.empty((4, max(2 * out.shape[1], size + m, (size + m) * rows // (row + 1) + 16)),
                             np.int64)
            grown[:, :size] = out[:, :size]
            out = grown
        out[0, size:size + m] = doc
        out[1, size:size + m] = start
        out[2, size:size + m] = length
        out[3, size:size + m] = rank
        size += m
        shard_offsets[row + 1] = size
    return (shard_offsets, out[0, :size].copy(), out[1, :size].copy(), out[2, :size].copy(),
            out[3, :size].copy())

