"""Numba kernels of the baseline strategies and of Algorithm 1, on contiguous int64 arrays.

The rules are documented in flashcp/planner/strategies.py; tests/naive.py holds plain-Python references that
must produce identical plans. Every kernel takes one sequence's ``lens`` (num_docs,) and returns the four
shard arrays (doc, start, len, rank) sorted by (rank, doc, start), with touching shards of one document on one
rank merged.

Shared building blocks:

- a piece buffer: parallel arrays ``pdoc, pstart, plen, prank`` with a count, filled by the strategies;
- ``_finish``: drop empty pieces, sort, merge;
- ``_zigzag_sizes``: the Per-Doc chunk sizes with the round-robin remainder rule;
- ``_ratio``: the imbalance ratio computed the same way in kernels and references (float64).
"""

from __future__ import annotations

import numpy as np

from flashcp._numba import njit
from flashcp.planner._sort import sort_range
from flashcp.planner.cost import _order_of, workload


@njit(cache=True)
def _quotas(context_len, cp):
    quotas = np.empty(cp, np.int64)
    for r in range(cp):
        quotas[r] = context_len // cp + (1 if r < context_len % cp else 0)
    return quotas


@njit(cache=True)
def _ratio(max_work, total_work, cp):
    """``max / mean`` as float64, the one way kernels and references compute it (1.0 when all is zero)."""
    if total_work == 0:
        return 1.0
    return float(max_work) / (float(total_work) / float(cp))


@njit(cache=True)
def _doc_offsets(lens):
    offsets = np.zeros(lens.shape[0] + 1, np.int64)
    for i in range(lens.shape[0]):
        offsets[i + 1] = offsets[i] + lens[i]
    return offsets


@njit(cache=True)
def _finish(pdoc, pstart, plen, prank, count, lens):
    """Sort pieces by (rank, position in the sequence), drop empty ones, merge touching ones of one doc.

    Pieces never overlap, so the order is unique: a counting sort by rank, then each rank's pieces sorted by
    position (as ``position << bits | piece`` values, so the piece comes back from the value).
    """
    offsets = _doc_offsets(lens)
    keep = 0
    num_ranks = 0
    for i in range(count):
        if plen[i] > 0:
            keep += 1
            num_ranks = max(num_ranks, prank[i] + 1)
    first = np.zeros(num_ranks + 1, np.int64)
    for i in range(count):
        if plen[i] > 0:
            first[prank[i] + 1] += 1
    for r in range(num_ranks):
        first[r + 1] += first[r]
    fill = first[:num_ranks].copy()
    bits = 1
    while (1 << bits) < count:
        bits += 1
    mask = (1 << bits) - 1
    packed = np.empty(keep, np.int64)
    for i in range(count):
        if plen[i] > 0:
            packed[fill[prank[i]]] = ((offsets[pdoc[i]] + pstart[i]) << bits) | i
            fill[prank[i]] += 1
    for r in range(num_ranks):
        sort_range(packed, first[r], first[r + 1])
    out_doc = np.empty(keep, np.int64)
    out_start = np.empty(keep, np.int64)
    out_len = np.empty(keep, np.int64)
    out_rank = np.empty(keep, np.int64)
    m = 0
    for j in range(keep):
        i = packed[j] & mask
        if (m > 0 and out_rank[m - 1] == prank[i] and out_doc[m - 1] == pdoc[i]
                and out_start[m - 1] + out_len[m - 1] == pstart[i]):
            out_len[m - 1] += plen[i]
        else:
            out_doc[m] = pdoc[i]
            out_start[m] = pstart[i]
            out_len[m] = plen[i]
            out_rank[m] = prank[i]
            m += 1
    return out_doc[:m], out_start[:m], out_len[:m], out_rank[:m]


@njit(cache=True)
def _finish_within(pdoc, pstart, plen, prank, count, lens, cp, limit):
    """``_finish``, or no shards (empty arrays) when the ranks' workloads miss imbalance ``limit``: known
    before sorting, as a shard's workload is the sum of its pieces'."""
    if limit < np.inf:
        work = np.zeros(cp, np.int64)
        for i in range(count):
            if plen[i] > 0:
                work[prank[i]] += workload(pstart[i], plen[i])
        if _ratio(work.max(), work.sum(), cp) > limit:
            return pdoc[:0], pstart[:0], plen[:0], prank[:0]
    return _finish(pdoc, pstart, plen, prank, count, lens)


@njit(cache=True)
def _zigzag_sizes(sizes, cp, early, late):
    """Per-Doc chunk sizes of documents of the given ``sizes`` (in order), written into ``early``/``late``.

    Document j of length d is cut into 2N chunks of ``d // 2N`` tokens; its ``d % 2N`` remaining tokens are
    dealt one at a time to ranks in round-robin order, the pointer starting at rank 0 and running on across
    documents. A rank's first extra token goes to its early chunk (chunk i), a second one to its late chunk
    (chunk 2N-1-i). ``early[j, i]`` / ``late[j, i]`` are rank i's chunk sizes.
    """
    pointer = 0
    for j in range(sizes.shape[0]):
        base = sizes[j] // (2 * cp)
        extra = sizes[j] % (2 * cp)
        for i in range(cp):
            early[j, i] = base
            late[j, i] = base
        for _ in range(extra):
            if early[j, pointer] == base:
                early[j, pointer] += 1
            else:
                late[j, pointer] += 1
            pointer = (pointer + 1) % cp


@njit(cache=True)
def _emit_zigzag(doc, first, early_row, late_row, cp, pdoc, pstart, plen, prank, count):
    """Append one zigzag document's 2N chunks (starting at token ``first``) to the piece buffer."""
    start = first
    for i in range(cp):
        pdoc[count] = doc
        pstart[count] = start
        plen[count] = early_row[i]
        prank[count] = i
        start += early_row[i]
        count += 1
    for i in range(cp - 1, -1, -1):
        pdoc[count] = doc
        pstart[count] = start
        plen[count] = late_row[i]
        prank[count] = i
        start += late_row[i]
        count += 1
    return count


@njit(cache=True)
def _descending_order(lens):
    """Documents by decreasing length, ties by index."""
    return _order_of(lens.max() - lens)


# ---------------------------------------------------------------------------------------------------------
# llama3 and perdoc


@njit(cache=True)
def _emit_span(offsets, doc, pos, end, rank, pdoc, pstart, plen, prank, count):
    """Append the pieces of sequence span ``[pos, end)`` (cut at document bounds) for ``rank``.

    ``doc`` is the document holding ``pos`` or an earlier one; returns the updated ``(doc, count)``.
    """
    while pos < end:
        while offsets[doc + 1] <= pos:
            doc += 1
        take = min(end, offsets[doc + 1]) - pos
        pdoc[count] = doc
        pstart[count] = pos - offsets[doc]
        plen[count] = take
        prank[count] = rank
        count += 1
        pos += take
    return doc, count


@njit(cache=True)
def llama3_kernel(lens, cp):
    return llama3_within(lens, cp, np.inf)


@njit(cache=True)
def llama3_within(lens, cp, limit):
    """``llama3_kernel``, no shards when it misses imbalance ``limit`` (``_finish_within``)."""
    offsets = _doc_offsets(lens)
    quotas = _quotas(offsets[-1], cp)
    capacity = lens.shape[0] + 2 * cp + 1
    pdoc = np.empty(capacity, np.int64)
    pstart = np.empty(capacity, np.int64)
    plen = np.empty(capacity, np.int64)
    prank = np.empty(capacity, np.int64)
    count = 0
    doc = 0
    pos = 0
    for k in range(2 * cp):
        rank = k if k < cp else 2 * cp - 1 - k
        size = quotas[rank] // 2 if k < cp else quotas[rank] - quotas[rank] // 2
        doc, count = _emit_span(offsets, doc, pos, pos + size, rank, pdoc, pstart, plen, prank, count)
        pos += size
    return _finish_within(pdoc, pstart, plen, prank, count, lens, cp, limit)


@njit(cache=True)
def ring_kernel(lens, cp):
    """Ring-Attn layout: N contiguous chunks of the equal-token quotas, chunk i on rank i."""
    offsets = _doc_offsets(lens)
    quotas = _quotas(offsets[-1], cp)
    capacity = lens.shape[0] + cp + 1
    pdoc = np.empty(capacity, np.int64)
    pstart = np.empty(capacity, np.int64)
    plen = np.empty(capacity, np.int64)
    prank = np.empty(capacity, np.int64)
    count = 0
    doc = 0
    pos = 0
    for rank in range(cp):
        doc, count = _emit_span(offsets, doc, pos, pos + quotas[rank], rank, pdoc, pstart, plen, prank, count)
        pos += quotas[rank]
    return _finish(pdoc, pstart, plen, prank, count, lens)


@njit(cache=True)
def perdoc_kernel(lens, cp):
    # emitted directly in (rank, doc, start) order: rank i's early chunk of a document precedes its late
    # chunk, and only rank N-1's two chunks touch (they are merged)
    num_docs = lens.shape[0]
    early = np.empty((num_docs, cp), np.int64)
    late = np.empty((num_docs, cp), np.int64)
    _zigzag_sizes(lens, cp, early, late)
    early_start = np.empty((num_docs, cp), np.int64)
    late_start = np.empty((num_docs, cp), np.int64)
    for j in range(num_docs):
        start = 0
        for i in range(cp):
            early_start[j, i] = start
            start += early[j, i]
        for i in range(cp - 1, -1, -1):
            late_start[j, i] = start
            start += late[j, i]
    capacity = num_docs * 2 * cp
    out_doc = np.empty(capacity, np.int64)
    out_start = np.empty(capacity, np.int64)
    out_len = np.empty(capacity, np.int64)
    out_rank = np.empty(capacity, np.int64)
    m = 0
    for i in range(cp):
        for j in range(num_docs):
            if early[j, i] > 0:
                out_doc[m] = j
                out_start[m] = early_start[j, i]
                out_len[m] = early[j, i]
                out_rank[m] = i
                m += 1
            if late[j, i] > 0:
                if m > 0 and out_rank[m - 1] == i and out_doc[m - 1] == j and \
                        out_start[m - 1] + out_len[m - 1] == late_start[j, i]:
                    out_len[m - 1] += late[j, i]
                else:
                    out_doc[m] = j
                    out_start[m] = late_start[j, i]
                    out_len[m] = late[j, i]
                    out_rank[m] = i
                    m += 1
    return out_doc[:m], out_start[:m], out_len[:m], out_rank[:m]


# ---------------------------------------------------------------------------------------------------------
# flashcp: Algorithm 1


@njit(cache=True)
def _argmin_work(work, cp):
    best = 0
    for r in range(1, cp):
        if work[r] < work[best]:
            best = r
    return best


@njit(cache=True)
def _most_over(tokens, quotas, cp):
    """The rank most over its token quota (ties: the lower rank), or -1 when none is over."""
    over = -1
    for r in range(cp):
        if tokens[r] > quotas[r] and (over < 0 or tokens[r] - quotas[r] > tokens[over] - quotas[over]):
            over = r
    return over


@njit(cache=True)
def _lightest_under(tokens, quotas, work, cp):
    """The under-filled rank with the least workload (ties: the lower rank), or -1 when none is under."""
    under = -1
    for r in range(cp):
        if tokens[r] < quotas[r] and (under < 0 or work[r] < work[under]):
            under = r
    return under


@njit(cache=True)
def move_head(piece, moved, over, under, pdoc, pstart, plen, prank, count, work, tokens):
    """Move the head (first ``moved`` tokens) of ``piece`` from rank ``over`` to rank ``under``.

    The Whole-Doc move of the ``flashcp`` and ``flashcp+`` kernels: the whole piece changes rank when
    ``moved`` is its length, else its head becomes a new piece at index ``count`` and the piece keeps its
    tail. Workloads and token counts follow. Returns ``(count, index of the moved piece)``.
    """
    shift = workload(pstart[piece], moved)
    if moved == plen[piece]:
        prank[piece] = under
        head = piece
    else:
        pdoc[count] = pdoc[piece]
        pstart[count] = pstart[piece]
        plen[count] = moved
        prank[count] = under
        head = count
        count += 1
        pstart[piece] += moved
        plen[piece] -= moved
    work[over] -= shift
    work[under] += shift
    tokens[over] -= moved
    tokens[under] += moved
    return count, head


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
        rank = _argmin_work(work, cp)
        pdoc[count] = doc
        pstart[count] = 0
        plen[count] = lens[doc]
        prank[count] = rank
        below[count] = top[rank]
        top[rank] = count
        count += 1
        work[rank] += workload(0, lens[doc])
        tokens[rank] += lens[doc]
    while True:
        over = _most_over(tokens, quotas, cp)
        if over < 0:
            break
        under = _lightest_under(tokens, quotas, work, cp)
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
    return flashcp_within(lens, cp, target, np.inf)


@njit(cache=True)
def flashcp_within(lens, cp, target, limit):
    """``flashcp_kernel``, no shards when it misses imbalance ``limit`` (``_finish_within``)."""
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
    for num_perdoc in range(num_docs + 1):
        # Per-Doc sharding of the popped documents, dealt in document order
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
    return _finish(pdoc, pstart, plen, prank, 0, lens)  # unreachable
