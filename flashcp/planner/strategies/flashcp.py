"""The paper's Algorithm 1 (``flashcp``; rules in flashcp.planner.strategies), and ``flashcp_bounded``, the
same search stopped at ``max_zigzag`` Per-Doc documents (a ``flashcp2`` candidate: exactly the plan of
Algorithm 1 whenever it needs no more).

Arrays as flashcp.planner.strategies describes them (the piece buffer and ``early``/``late`` as in ``pieces``).
"""

from __future__ import annotations

import numpy as np

from flashcp._numba import njit
from flashcp.costmodel.sort import sort_range
from flashcp.costmodel.workload import max_over_mean, token_quotas_kernel, workload
from flashcp.planner.strategies.pieces import (
    add_piece,
    argmin_work,
    descending_order,
    emit_zigzag,
    finish_pieces,
    finish_within,
    lightest_under,
    most_over,
    move_head,
    new_pieces,
    new_rank_totals,
    zigzag_sizes,
)

__all__ = ["flashcp_bounded", "flashcp_kernel", "flashcp_within"]


@njit(cache=True)
def _alg1_whole_doc(lens, cp, quotas, order, num_perdoc, work, tokens, pdoc, pstart, plen, prank, count):
    """Greedy whole-document placement and Whole-Doc sharding (Algorithm 1, lines 5-16).

    Pieces are kept on a stack per rank (``top``/``below``): the greedy pushes whole documents, the
    Whole-Doc step pops from the most over-filled rank and pushes the moved head onto the receiving rank.
    """
    capacity = pdoc.shape[0]
    below = np.full(capacity, -1, np.int64)
    top = np.full(cp, -1, np.int64)
    for idx in range(num_perdoc, order.shape[0]):
        doc = order[idx]
        rank = argmin_work(work, cp)
        below[count] = top[rank]
        top[rank] = count
        count = add_piece(doc, 0, lens[doc], rank, pdoc, pstart, plen, prank, count)
        work[rank] += workload(0, lens[doc])
        tokens[rank] += lens[doc]
    while True:
        over = most_over(tokens, quotas, cp)
        if over < 0:
            break
        under = lightest_under(tokens, quotas, work, cp)
        piece = top[over]
        moved = min(tokens[over] - quotas[over], quotas[under] - tokens[under], plen[piece])
        if moved == plen[piece]:
            top[over] = below[piece]
        count, head = move_head(piece, moved, over, under, pdoc, pstart, plen, prank, count, work, tokens)
        below[head] = top[under]
        top[under] = head
    return count


@njit(cache=True)
def flashcp_kernel(lens, cp, target):
    """Algorithm 1: Per-Doc for the k longest documents, the first k whose plan is within ``target``."""
    return flashcp_within(lens, cp, target, np.inf)


@njit(cache=True)
def flashcp_within(lens, cp, target, limit):
    """``flashcp_kernel``, no shards when it misses imbalance ``limit`` (``finish_within``)."""
    return flashcp_bounded(lens, cp, target, limit, lens.shape[0])


@njit(cache=True)
def flashcp_bounded(lens, cp, target, limit, max_zigzag):
    """Algorithm 1 (``flashcp_within``), or no shards when it needs more than ``max_zigzag`` Per-Doc
    documents to meet ``target`` or its plan misses imbalance ``limit``.
    """
    num_docs = lens.shape[0]
    quotas = token_quotas_kernel(lens.sum(), cp)
    order = descending_order(lens)
    capacity = num_docs * (2 * cp + 1) + 4 * cp + 4
    pdoc, pstart, plen, prank = new_pieces(capacity)
    early = np.empty((num_docs, cp), np.int64)
    late = np.empty((num_docs, cp), np.int64)
    for num_perdoc in range(min(num_docs, max_zigzag) + 1):
        perdoc = order[:num_perdoc].copy()
        sort_range(perdoc, 0, num_perdoc)
        zigzag_sizes(lens[perdoc], cp, early, late)
        work, tokens = new_rank_totals(cp)
        count = 0
        for j in range(num_perdoc):
            first = count
            count = emit_zigzag(perdoc[j], 0, early[j], late[j], cp, pdoc, pstart, plen, prank, count)
            for i in range(first, count):
                work[prank[i]] += workload(pstart[i], plen[i])
                tokens[prank[i]] += plen[i]
        count = _alg1_whole_doc(lens, cp, quotas, order, num_perdoc, work, tokens, pdoc, pstart, plen, prank,
                                count)
        if max_over_mean(work.max(), work.sum(), cp) <= target or num_perdoc == num_docs:
            return finish_within(pdoc, pstart, plen, prank, count, lens, cp, limit)
    return finish_pieces(pdoc, pstart, plen, prank, 0, lens)
