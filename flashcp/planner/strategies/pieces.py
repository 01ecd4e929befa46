"""Building blocks every strategy kernel shares, on contiguous int64 arrays.

- a piece buffer: parallel arrays ``pdoc, pstart, plen, prank`` (capacity,) int64 with a count of the pieces
  filled so far, made by ``new_pieces`` and appended to by ``add_piece``; per-rank totals ``(load, tokens)``
  (``new_rank_totals``) and the rank choices of the greedy steps (``lightest_with_room``, ``lightest_under``);
- ``finish_pieces``: drop empty pieces, sort, merge (``finish_within``: the same, refusing more than
  ``limit`` shards);
- ``zigzag_sizes`` / ``emit_zigzag``: the Per-Doc chunk sizes with the round-robin remainder rule;
- the Whole-Doc moves of Algorithm 1 (``move_head`` and the rank choices it uses).

Arrays as flashcp.planner.strategies describes them; besides, ``early``/``late`` (num_rows, cp) int64 and
their rows ``early_row``/``late_row`` (cp,) int64: a zigzag document's chunk sizes, rank i's early and late
chunk.
"""

from __future__ import annotations

import numpy as np

from flashcp._numba import njit
from flashcp.costmodel.sort import order_of, sort_range
from flashcp.costmodel.workload import max_over_mean, offsets_of, workload

__all__ = [
    "add_piece",
    "argmin_work",
    "descending_order",
    "emit_span",
    "emit_zigzag",
    "finish_pieces",
    "finish_within",
    "lightest_under",
    "lightest_with_room",
    "most_over",
    "move_head",
    "new_pieces",
    "new_rank_totals",
    "zigzag_sizes",
]

@njit(cache=True)
def new_pieces(capacity):
    """An empty piece buffer of ``capacity`` pieces: ``(pdoc, pstart, plen, prank)``, int64 each."""
    return (np.empty(capacity, np.int64), np.empty(capacity, np.int64), np.empty(capacity, np.int64),
            np.empty(capacity, np.int64))


@njit(cache=True)
def add_piece(doc, start, length, rank, pdoc, pstart, plen, prank, count):
    """Append the piece ``[start, start + length)`` of document ``doc`` on ``rank`` at index ``count`` of the
    piece buffer ``pdoc, pstart, plen, prank`` ((capacity,) int64 each); returns the new count."""
    pdoc[count] = doc
    pstart[count] = start
    plen[count] = length
    prank[count] = rank
    return count + 1


@njit(cache=True)
def new_rank_totals(cp):
    """Zeroed per-rank totals ``(load, tokens)``, (cp,) int64 each: the workload (or another weight) and the
    tokens a strategy has placed on every rank so far."""
    return np.zeros(cp, np.int64), np.zeros(cp, np.int64)


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
    out_doc, out_start, out_len, out_rank = new_pieces(keep)
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
        count = add_piece(doc, start, early_row[i], i, pdoc, pstart, plen, prank, count)
        start += early_row[i]
    for i in range(cp - 1, -1, -1):
        count = add_piece(doc, start, late_row[i], i, pdoc, pstart, plen, prank, count)
        start += late_row[i]
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
        count = add_piece(doc, pos - offsets[doc], take, rank, pdoc, pstart, plen, prank, count)
        pos += take
    return doc, count


@njit(cache=True)
def argmin_work(work, cp):
    """The rank with the least ``work`` ((cp,) int64; ties: the lower rank)."""
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
def lightest_with_room(tokens, quotas, load, size, cp):
    """The rank with the least ``load`` among those with room for ``size`` more tokens under their quotas
    (ties: the lower rank), or -1 when none has; ``tokens``, ``quotas``, ``load``: (cp,) int64."""
    best = -1
    for r in range(cp):
        if quotas[r] - tokens[r] >= size and (best < 0 or load[r] < load[best]):
            best = r
    return best


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
        head = count
        count = add_piece(pdoc[piece], pstart[piece], moved, under, pdoc, pstart, plen, prank, count)
        pstart[piece] += moved
        plen[piece] -= moved
    work[over] -= shift
    work[under] += shift
    tokens[over] -= moved
    tokens[under] += moved
    return count, head
