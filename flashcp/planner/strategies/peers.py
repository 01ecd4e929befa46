"""Numba kernels of the peer strategies ``magi`` and ``ptrr`` (rules in flashcp.planner.strategies).

Both cut the packed sequence into equal chunks of ``chunk`` tokens (the last one shorter), give every chunk
a rank, and emit the chunk's pieces cut at document bounds. ``tests/naive.py`` holds plain-Python references
that must produce identical plans; ``tests/planner/strategies/test_peers.py`` checks ``ptrr`` against torch's
own scheduler. Arrays as flashcp.planner.strategies describes them.
"""

from __future__ import annotations

import numpy as np

from flashcp._numba import njit
from flashcp.costmodel.sort import last_at_or_before, order_of
from flashcp.costmodel.workload import offsets_of, token_quotas_kernel, workload
from flashcp.planner.strategies.pieces import (
    emit_span,
    finish_pieces,
    finish_within,
    lightest_under,
    lightest_with_room,
    new_pieces,
    new_rank_totals,
)

__all__ = ["magi_kernel", "magi_within", "place_span", "ptrr_kernel", "ptrr_process_times"]


@njit(cache=True)
def _chunk_pieces_workload(offsets, pos, end, doc):
    """Workload of the sequence span ``[pos, end)`` cut at document bounds; ``doc`` holds ``pos``."""
    total = 0
    while pos < end:
        while offsets[doc + 1] <= pos:
            doc += 1
        take = min(end, offsets[doc + 1]) - pos
        total += workload(pos - offsets[doc], take)
        pos += take
    return total


@njit(cache=True)
def _emit(offsets, pos, end, rank, pdoc, pstart, plen, prank, count):
    """``emit_span`` of ``[pos, end)`` from the document holding ``pos``; returns the updated count."""
    return emit_span(offsets, last_at_or_before(offsets, pos), pos, end, rank, pdoc, pstart, plen, prank, count)[1]


@njit(cache=True)
def _chunks(lens, chunk):
    """Chunk starts (num_chunks + 1,) and the workload of every chunk."""
    offsets = offsets_of(lens)
    context_len = offsets[-1]
    num_chunks = (context_len + chunk - 1) // chunk
    starts = np.empty(num_chunks + 1, np.int64)
    work = np.empty(num_chunks, np.int64)
    doc = 0
    for i in range(num_chunks):
        starts[i] = i * chunk
        end = min(context_len, (i + 1) * chunk)
        while offsets[doc + 1] <= i * chunk:
            doc += 1
        work[i] = _chunk_pieces_workload(offsets, i * chunk, end, doc)
    starts[num_chunks] = context_len
    return offsets, starts, work


@njit(cache=True)
def place_span(offsets, pos, end, preferred, quotas, tokens, load, weight, cp, pdoc, pstart, plen, prank, count):
    """Give ``[pos, end)`` to ``preferred`` if it has room for all of it; else split it over ranks with room.

    A rank short of room takes the head that fits; the rest goes to the rank with room and the least
    ``load`` (ties: lowest rank), again head first. ``load`` grows by each piece's ``weight`` share (its
    workload for magi, its block count for ptrr, both computed by the caller per piece).
    """
    rank = preferred
    while pos < end:
        room = quotas[rank] - tokens[rank]
        take = min(room, end - pos)
        if take > 0:
            count = _emit(offsets, pos, pos + take, rank, pdoc, pstart, plen, prank, count)
            tokens[rank] += take
            if weight < 0:
                load[rank] += _chunk_pieces_workload(offsets, pos, pos + take, last_at_or_before(offsets, pos))
            else:
                load[rank] += weight
            pos += take
        if pos < end:
            rank = lightest_under(tokens, quotas, load, cp)
    return count


@njit(cache=True)
def magi_kernel(lens, cp, chunk):
    """MagiAttention's MinHeap dispatch over ``chunk``-token chunks of the sequence."""
    return magi_within(lens, cp, chunk, np.inf)


@njit(cache=True)
def magi_within(lens, cp, chunk, limit):
    """``magi_kernel``, no shards when it misses imbalance ``limit`` (``finish_within``)."""
    offsets, starts, work = _chunks(lens, chunk)
    quotas = token_quotas_kernel(offsets[-1], cp)
    num_chunks = work.shape[0]
    # decreasing workload, ties: the later chunk first (MagiAttention reverses an ascending stable sort)
    order = order_of(work)[::-1]
    capacity = 2 * num_chunks + lens.shape[0] + 2 * cp + 4
    pdoc, pstart, plen, prank = new_pieces(capacity)
    load, tokens = new_rank_totals(cp)
    count = 0
    for i in order:
        best = lightest_with_room(tokens, quotas, load, starts[i + 1] - starts[i], cp)
        if best < 0:  # none: the least-loaded rank with any room takes the chunk's head
            best = lightest_under(tokens, quotas, load, cp)
        count = place_span(offsets, starts[i], starts[i + 1], best, quotas, tokens, load, -1, cp, pdoc, pstart,
                       plen, prank, count)
    return finish_within(pdoc, pstart, plen, prank, count, lens, cp, limit)


@njit(cache=True)
def ptrr_process_times(lens, chunk):
    """Key blocks each query block of ``chunk`` tokens reads under the document-causal mask.

    Query block i covers ``[i b, (i + 1) b)``; its keys run from the start of the document holding its first
    token to its own end, so it reads blocks ``floor(doc start / b) .. i``.
    """
    offsets = offsets_of(lens)
    num_blocks = (offsets[-1] + chunk - 1) // chunk
    times = np.empty(num_blocks, np.int64)
    doc = 0
    for i in range(num_blocks):
        while offsets[doc + 1] <= i * chunk:
            doc += 1
        times[i] = i - offsets[doc] // chunk + 1
    return times


@njit(cache=True)
def ptrr_kernel(lens, cp, chunk):
    """PyTorch's PTRR: blocks by decreasing process time, dealt to ranks in snake (boustrophedon) order."""
    offsets = offsets_of(lens)
    context_len = offsets[-1]
    quotas = token_quotas_kernel(context_len, cp)
    times = ptrr_process_times(lens, chunk)
    num_blocks = times.shape[0]
    # decreasing process time, ties: the earlier block first (torch's stable descending sort)
    order = order_of(times.max() - times)
    capacity = 2 * num_blocks + lens.shape[0] + 2 * cp + 4
    pdoc, pstart, plen, prank = new_pieces(capacity)
    load, tokens = new_rank_totals(cp)
    count = 0
    for p in range(num_blocks):
        i = order[p]
        col = p % cp
        rank = col if (p // cp) % 2 == 0 else cp - 1 - col
        count = place_span(offsets, i * chunk, min(context_len, (i + 1) * chunk), rank, quotas, tokens, load,
                       times[i], cp, pdoc, pstart, plen, prank, count)
    return finish_pieces(pdoc, pstart, plen, prank, count, lens)
