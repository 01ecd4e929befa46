"""Building blocks every strategy kernel shares, on contiguous int64 arrays.

- a piece buffer: parallel arrays ``pdoc, pstart, plen, prank`` with a count, filled by the strategies
  (``new_pieces``);
- ``finish_pieces``: drop empty pieces, sort, merge (``finish_within``: the same, refusing more than
  ``limit`` shards);
- ``zigzag_sizes`` / ``emit_zigzag``: the Per-Doc chunk sizes with the round-robin remainder rule;
- the Whole-Doc moves of Algorithm 1 (``move_head`` and the rank choices it uses).
"""

from __future__ import annotations

import numpy as np

from flashcp._numba import njit
from flashcp.costmodel.sort import order_of, sort_range
from flashcp.costmodel.workload import max_over_mean, offsets_of, workload


@njit(cache=True)
def new_pieces(capacity):
    """An empty piece buffer of ``capacity`` pieces: ``(pdoc, pstart, plen, prank)``, int64 each."""
    return (np.empty(capacity, np.int64), np.empty(capacity, np.int64), np.empty(capacity, np.int64),
            np.empty(capacity, np.int64))


@njit(cache=True)
def finish_pieces(pdoc, pstart, plen, prank, count, lens):
    """Sort pieces by (rank, position in the sequence), drop empty ones, merge touching ones of one doc.

    Pieces never overlap, so the order is unique: a counting sort by rank, then each rank's pieces sorted by
    position (as ``position << bits | piece`` values, so the piece comes back from the value).
    """
    offsets = offsets_of(lens)
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
def finish_within(pdoc, pstart, plen, prank, count, lens, cp, limit):
    """``finish_pieces``, or no shards (empty arrays) when the ranks' workloads miss imbalance ``limit``: known
    before sorting, as a shard's workload is the sum of its pieces'.
    """
    if limit < np.inf:
        work = np.zeros(cp, np.int64)
        for i in range(count):
            if plen[i] > 0:
                work[prank[i]] += workload(pstart[i], plen[i])
        if max_over_mean(work.max(), work.sum(), cp) > limit:
            return pdoc[:0], pstart[:0], plen[:0], prank[:0]
    return finish_pieces(pdoc, pstart, plen, prank, count, lens)


@njit(cache=True)
def zigzag_sizes(sizes, cp, early, late):
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
def emit_zigzag(doc, first, early_row, late_row, cp, pdoc, pstart, plen, prank, count):
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
def descending_order(lens):
    """Documents by decreasing length, ties by index."""
    return order_of(lens.max() - lens)


@njit(cache=True)
def emit_span(offsets, doc, pos, end, rank, pdoc, pstart, plen, prank, count):
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
def argmin_work(work, cp):
    best = 0
    for r in range(1, cp):
        if work[r] < work[best]:
            best = r
    return best


@njit(cache=True)
def most_over(tokens, quotas, cp):
    """The rank most over its token quota (ties: the lower rank), or -1 when none is over."""
    over = -1
    for r in range(cp):
        if tokens[r] > quotas[r] and (over < 0 or tokens[r] - quotas[r] > tokens[over] - quotas[over]):
            over = r
    return over


@njit(cache=True)
def lightest_under(tokens, quotas, work, cp):
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
