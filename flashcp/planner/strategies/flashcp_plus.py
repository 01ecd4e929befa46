"""Numba kernel of ``flashcp+``, the improved strategy (rules in flashcp.planner.strategies).

Non-zigzag pieces live in a buffer ``pdoc, pstart, plen, prank`` (count); zigzag documents (the heads of the
popped documents) live in ``early``/``late`` ((num_rows, cp) int64, rows in document order) and are emitted
at the end. Other arrays as flashcp.planner.strategies describes them.
"""

from __future__ import annotations

import numpy as np

from flashcp._numba import njit
from flashcp.costmodel.sort import order_of
from flashcp.costmodel.workload import max_over_mean, token_quotas_kernel, workload
from flashcp.planner.strategies.pieces import (
    add_piece,
    argmin_work,
    descending_order,
    emit_zigzag,
    finish_pieces,
    lightest_under,
    lightest_with_room,
    most_over,
    move_head,
    new_pieces,
    new_rank_totals,
    zigzag_sizes,
)

__all__ = ["flashcp_plus_bounded", "flashcp_plus_kernel"]


@njit(cache=True)
def _tail_len(length, load, mean, room, cp):
    """Longest tail ``t`` a rank with workload ``load`` and ``room`` free tokens can anchor.

    The largest t in [0, length] with ``W(h, t) + W(0, h) // cp <= mean - load`` and
    ``t + ceil(h / cp) <= room`` where ``h = length - t`` (both sides grow with t, so bisection works).
    """
    lo = 0
    hi = length
    while lo < hi:
        t = (lo + hi + 1) // 2
        h = length - t
        if workload(h, t) + workload(0, h) // cp <= mean - load and t + (h + cp - 1) // cp <= room:
            lo = t
        else:
            hi = t - 1
    return lo


@njit(cache=True)
def _add_counted(doc, start, length, rank, pdoc, pstart, plen, prank, count, work, tokens):
    """``add_piece``, its workload and tokens added to its rank's ``work`` and ``tokens``."""
    work[rank] += workload(start, length)
    tokens[rank] += length
    return add_piece(doc, start, length, rank, pdoc, pstart, plen, prank, count)


@njit(cache=True)
def _repair_tokens(lens, cp, quotas, work, tokens, pdoc, pstart, plen, prank, count):
    """Equal tokens: whole documents first (best fit), then heads cut from the longest piece."""
    while True:
        over = most_over(tokens, quotas, cp)
        if over < 0:
            return count
        excess = tokens[over] - quotas[over]
        best = -1
        best_u = -1
        for i in range(count):
            length = plen[i]
            if prank[i] != over or length != lens[pdoc[i]] or length > excess:
                continue
            for u in range(cp):
                if tokens[u] >= quotas[u] or length > quotas[u] - tokens[u]:
                    continue
                if (best < 0 or length > plen[best] or (length == plen[best] and (
                        pdoc[i] < pdoc[best] or (pdoc[i] == pdoc[best] and work[u] < work[best_u])))):
                    best = i
                    best_u = u
        if best >= 0:  # a whole document (start 0) moves whole
            count, _ = move_head(best, plen[best], over, best_u, pdoc, pstart, plen, prank, count, work, tokens)
            continue
        under = lightest_under(tokens, quotas, work, cp)
        # the longest whole document on `over`, else its longest piece (ties: lower doc, then lower start)
        piece = -1
        piece_whole = False
        for i in range(count):
            if prank[i] != over or plen[i] == 0:
                continue
            whole = plen[i] == lens[pdoc[i]]
            if piece < 0 or (whole and not piece_whole):
                better = True
            elif whole != piece_whole:
                better = False
            else:
                better = plen[i] > plen[piece] or (plen[i] == plen[piece] and (
                    pdoc[i] < pdoc[piece] or (pdoc[i] == pdoc[piece] and pstart[i] < pstart[piece])))
            if better:
                piece = i
                piece_whole = whole
        moved = min(excess, quotas[under] - tokens[under], plen[piece])
        count, _ = move_head(piece, moved, over, under, pdoc, pstart, plen, prank, count, work, tokens)


@njit(cache=True)
def _levers(head, early_row, late_row, cp, work):
    """Balance workload along the rank chain with paired boundary moves of one zigzag document.

    Moving the boundary between the early chunks of ranks i and i+1 and the one between their late chunks by
    the same ``delta`` keeps every rank's tokens and moves exactly ``delta * gap_i`` workload from rank i to
    rank i+1, where ``gap_i`` is the distance between the two boundaries.
    """
    total = work.sum()
    lo_range = np.zeros(cp, np.int64)
    hi_range = np.zeros(cp, np.int64)
    if cp >= 2:
        lo_range[cp - 2] = -late_row[cp - 1]
        hi_range[cp - 2] = early_row[cp - 1]
    for i in range(cp - 3, -1, -1):
        lo_range[i] = lo_range[i + 1] - late_row[i + 1]
        hi_range[i] = hi_range[i + 1] + early_row[i + 1]
    deltas = np.zeros(cp, np.int64)
    gaps = np.zeros(cp, np.int64)
    left = 0
    right = head
    prev = 0
    inflow = 0
    for i in range(cp - 1):
        left += early_row[i]
        right -= late_row[i]
        gap = right - left
        surplus = work[i] * cp - total + inflow
        delta = 0
        if gap > 0:
            unit = gap * cp
            delta = (abs(surplus) + unit // 2) // unit
            if surplus < 0:
                delta = -delta
        lo = max(prev - early_row[i], lo_range[i])
        hi = min(prev + late_row[i], hi_range[i])
        delta = max(lo, min(hi, delta))
        deltas[i] = delta
        gaps[i] = gap
        inflow = delta * gap * cp
        prev = delta
    prev = 0
    prev_gap = 0
    for i in range(cp):
        early_row[i] += deltas[i] - prev
        late_row[i] -= deltas[i] - prev
        work[i] += prev * prev_gap - deltas[i] * gaps[i]
        prev = deltas[i]
        prev_gap = gaps[i]


@njit(cache=True)
def _longest_whole(rank, lens, pdoc, plen, prank, count):
    best = -1
    for i in range(count):
        if prank[i] == rank and plen[i] == lens[pdoc[i]] and (
                best < 0 or plen[i] > plen[best] or (plen[i] == plen[best] and pdoc[i] < pdoc[best])):
            best = i
    return best


@njit(cache=True)
def _window_swaps(lens, cp, target, work, tokens, pdoc, pstart, plen, prank, count):
    """Move workload from the busiest rank to a light one by swapping a whole document for a window.

    Rank ``a`` gives the window ``[p, p+t)`` of its longest whole document X to rank ``b`` and takes ``b``'s
    whole document y of ``t`` tokens: tokens stay equal and exactly ``p * t`` workload moves.
    """
    for _ in range(4 * cp):
        total = work.sum()
        a = 0
        for r in range(1, cp):
            if work[r] > work[a]:
                a = r
        if max_over_mean(work[a], total, cp) <= target:
            break
        by_work = order_of(work)
        done = False
        for idx in range(cp):
            b = by_work[idx]
            if b == a or work[b] * cp >= total:
                break
            need = min(work[a] * cp - total, total - work[b] * cp) // cp
            x = _longest_whole(a, lens, pdoc, plen, prank, count)
            if x < 0:
                continue
            best = -1
            best_cost = 0
            best_p = 0
            for i in range(count):
                if prank[i] != b or plen[i] != lens[pdoc[i]]:
                    continue
                t = plen[i]
                p = need // t
                if p < 1 or p + t > plen[x]:
                    continue
                cost = max(p, t)
                if best < 0 or cost < best_cost or (cost == best_cost and pdoc[i] < pdoc[best]):
                    best = i
                    best_cost = cost
                    best_p = p
            if best < 0:
                continue
            t = plen[best]
            length = plen[x]
            plen[x] = best_p
            count = add_piece(pdoc[x], best_p, t, b, pdoc, pstart, plen, prank, count)
            if best_p + t < length:
                count = add_piece(pdoc[x], best_p + t, length - best_p - t, a, pdoc, pstart, plen, prank, count)
            prank[best] = a
            work[a] -= best_p * t
            work[b] += best_p * t
            done = True
            break
        if not done:
            break
    return count


@njit(cache=True)
def _build(lens, cp, quotas, order, num_popped, anchored, mean, target, pdoc, pstart, plen, prank):
    """One candidate plan; returns (imbalance ratio, piece count) with all pieces in the buffer."""
    num_docs = lens.shape[0]
    work, tokens = new_rank_totals(cp)
    estimate = np.zeros(cp, np.int64)
    head = np.zeros(num_docs, np.int64)
    count = 0
    for j in range(num_popped):
        doc = order[j]
        length = lens[doc]
        tail = 0
        if anchored:
            anchor = argmin_work(estimate, cp)
            tail = _tail_len(length, estimate[anchor], mean, quotas[anchor] - tokens[anchor], cp)
            if tail > 0:
                count = _add_counted(doc, length - tail, tail, anchor, pdoc, pstart, plen, prank, count, work,
                                     tokens)
                estimate[anchor] += workload(length - tail, tail)
        head[doc] = length - tail
        for r in range(cp):
            estimate[r] += workload(0, length - tail) // cp
    # zigzag rows: popped documents with a head, in document order
    row_of = np.full(num_docs, -1, np.int64)
    num_rows = 0
    for doc in range(num_docs):
        if head[doc] > 0:
            row_of[doc] = num_rows
            num_rows += 1
    zig_docs = np.empty(num_rows, np.int64)
    for doc in range(num_docs):
        if row_of[doc] >= 0:
            zig_docs[row_of[doc]] = doc
    early = np.empty((num_rows, cp), np.int64)
    late = np.empty((num_rows, cp), np.int64)
    zigzag_sizes(head[zig_docs], cp, early, late)
    for row in range(num_rows):
        start = 0
        for i in range(cp):
            work[i] += workload(start, early[row, i])
            tokens[i] += early[row, i]
            start += early[row, i]
        for i in range(cp - 1, -1, -1):
            work[i] += workload(start, late[row, i])
            tokens[i] += late[row, i]
            start += late[row, i]
    # greedy: least workload among ranks with room for the whole document, else least workload
    for j in range(num_popped, num_docs):
        doc = order[j]
        rank = lightest_with_room(tokens, quotas, work, lens[doc], cp)
        if rank < 0:
            rank = argmin_work(work, cp)
        count = _add_counted(doc, 0, lens[doc], rank, pdoc, pstart, plen, prank, count, work, tokens)
    count = _repair_tokens(lens, cp, quotas, work, tokens, pdoc, pstart, plen, prank, count)
    for j in range(num_popped):
        row = row_of[order[j]]
        if row >= 0:
            _levers(head[order[j]], early[row], late[row], cp, work)
    count = _window_swaps(lens, cp, target, work, tokens, pdoc, pstart, plen, prank, count)
    for row in range(num_rows):
        count = emit_zigzag(zig_docs[row], 0, early[row], late[row], cp, pdoc, pstart, plen, prank, count)
    return max_over_mean(work.max(), work.sum(), cp), count


@njit(cache=True)
def flashcp_plus_kernel(lens, cp, target):
    """``flashcp+``: its search over zigzagged documents runs to the last document if it must."""
    return flashcp_plus_bounded(lens, cp, target, lens.shape[0])


@njit(cache=True)
def flashcp_plus_bounded(lens, cp, target, max_zigzag):
    """``flashcp_plus_kernel`` whose search for the target stops at ``max_zigzag`` zigzagged documents.

    Its first candidate (the heavy documents tail-anchored) is always built; the plan is the first candidate
    within the target, else the most balanced one built, as in ``flashcp+``. Equal to ``flashcp+`` whenever
    ``flashcp+`` meets the target with at most ``max_zigzag`` documents zigzagged.
    """
    num_docs = lens.shape[0]
    quotas = token_quotas_kernel(lens.sum(), cp)
    order = descending_order(lens)
    total = 0
    for doc in range(num_docs):
        total += workload(0, lens[doc])
    mean = total // cp
    num_heavy = 0
    for doc in range(num_docs):
        if workload(0, lens[doc]) > mean:
            num_heavy += 1
    capacity = num_docs * (2 * cp + 2) + 16 * cp + 16
    pdoc, pstart, plen, prank = new_pieces(capacity)
    ratio, count = _build(lens, cp, quotas, order, num_heavy, True, mean, target, pdoc, pstart, plen, prank)
    best = finish_pieces(pdoc, pstart, plen, prank, count, lens)
    if ratio <= target:
        return best
    best_ratio = ratio
    for num_popped in range(max(1, num_heavy), min(num_docs, max_zigzag) + 1):
        ratio, count = _build(lens, cp, quotas, order, num_popped, False, mean, target, pdoc, pstart, plen,
                              prank)
        if ratio < best_ratio:
            best_ratio = ratio
            best = finish_pieces(pdoc, pstart, plen, prank, count, lens)
        if ratio <= target:
            break
    return best
