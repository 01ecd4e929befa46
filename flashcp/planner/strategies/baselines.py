"""The baselines' kernels: ``llama3``, ``perdoc`` and ``ring`` (rules in flashcp.planner.strategies), and
``ring_plan``, the Ring-Attn layout as a plan (the packed sequence cut into ``N`` contiguous chunks, chunk ``i``
on rank ``i``; Ring-Attn (zigzag) uses ``perdoc``; both run with the ``ring`` comm mode of ``cp_attention``).
Arrays as flashcp.planner.strategies describes them.
"""

from __future__ import annotations

import numpy as np

from flashcp._numba import njit
from flashcp.costmodel.workload import offsets_of, token_quotas_kernel
from flashcp.planner.plan import SequencePlan
from flashcp.planner.strategies.pieces import emit_span, finish_pieces, finish_within, new_pieces, zigzag_sizes

__all__ = ["llama3_kernel", "llama3_within", "perdoc_kernel", "ring_kernel", "ring_plan"]


@njit(cache=True)
def llama3_kernel(lens, cp):
    """Llama 3's layout: 2N consecutive chunks of the sequence, rank i holding chunks i and 2N-1-i."""
    return llama3_within(lens, cp, np.inf)


@njit(cache=True)
def llama3_within(lens, cp, limit):
    """``llama3_kernel``, no shards when it misses imbalance ``limit`` (``finish_within``)."""
    offsets = offsets_of(lens)
    quotas = token_quotas_kernel(offsets[-1], cp)
    capacity = lens.shape[0] + 2 * cp + 1
    pdoc, pstart, plen, prank = new_pieces(capacity)
    count = 0
    doc = 0
    pos = 0
    for k in range(2 * cp):
        rank = k if k < cp else 2 * cp - 1 - k
        size = quotas[rank] // 2 if k < cp else quotas[rank] - quotas[rank] // 2
        doc, count = emit_span(offsets, doc, pos, pos + size, rank, pdoc, pstart, plen, prank, count)
        pos += size
    return finish_within(pdoc, pstart, plen, prank, count, lens, cp, limit)


@njit(cache=True)
def ring_kernel(lens, cp):
    """Ring-Attn layout: N contiguous chunks of the equal-token quotas, chunk i on rank i."""
    offsets = offsets_of(lens)
    quotas = token_quotas_kernel(offsets[-1], cp)
    capacity = lens.shape[0] + cp + 1
    pdoc, pstart, plen, prank = new_pieces(capacity)
    count = 0
    doc = 0
    pos = 0
    for rank in range(cp):
        doc, count = emit_span(offsets, doc, pos, pos + quotas[rank], rank, pdoc, pstart, plen, prank, count)
        pos += quotas[rank]
    return finish_pieces(pdoc, pstart, plen, prank, count, lens)


@njit(cache=True)
def perdoc_kernel(lens, cp):
    """Per-Doc: every document cut into 2N chunks, rank i holding chunks i and 2N-1-i of each."""
    # emitted directly in (rank, doc, start) order: rank i's early chunk of a document precedes its late
    # chunk, and only rank N-1's two chunks touch (they are merged)
    num_docs = lens.shape[0]
    early = np.empty((num_docs, cp), np.int64)
    late = np.empty((num_docs, cp), np.int64)
    zigzag_sizes(lens, cp, early, late)
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
    out_doc, out_start, out_len, out_rank = new_pieces(capacity)
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


def ring_plan(doc_lens, cp: int) -> SequencePlan:
    """Contiguous equal-token chunks, chunk ``i`` on rank ``i``; shards sorted by (rank, doc, start).

    Args:
        doc_lens: (num_docs,) document lengths of one packed sequence, each > 0.
        cp: number of CP ranks, >= 1.

    Rank ``i`` holds tokens ``[sum(quotas[:i]), sum(quotas[:i+1]))`` of the packed sequence.
    """
    doc_lens = np.asarray(doc_lens, dtype=np.int64)
    if doc_lens.ndim != 1 or doc_lens.size == 0 or (doc_lens <= 0).any():
        raise ValueError(f"doc_lens must be a non-empty list of positive lengths, got {doc_lens.tolist()}")
    if cp < 1:
        raise ValueError(f"cp must be at least 1, got {cp}")
    # the kernel directly, not plan_sequence: the runtime tests use cp > C (ranks with no tokens) too
    doc, start, length, rank = ring_kernel(np.ascontiguousarray(doc_lens), cp)
    return SequencePlan.from_arrays(doc, start, length, rank, cp=cp)
