"""Communication volume of a plan (definitions in flashcp.costmodel).

Every exchange volume of a plan comes from one kernel, ``exchange_volumes_kernel`` (``exchange_volumes`` in
Python): exact-need send and receive, their parts across nodes, all-gather contributions, in one pass over
dense (document, rank) tables. The objective, the projection, the runtime meta, the plan check and the
metrics read it; ``exact_need_received``, ``exact_need_sent`` and ``allgather_contributions`` are its rows.
Also here: wire rows, the busiest rank, bytes per K/V token, the ``auto`` comm rule, rows inside and across
nodes, the ring.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from flashcp._numba import njit
from flashcp.costmodel.sort import sort_range
from flashcp.costmodel.workload import (
    FULL,
    as_int64,
    imbalance_ratio,
    key_start,
    rank_tokens,
    rank_workloads,
)

__all__ = ["CONTRIBUTED", "ExchangeVolumes", "PlanMetrics", "RECEIVED", "RECEIVED_FAR", "RingStepWork", "SENT",
           "SENT_FAR", "allgather_contributions", "allgather_node_rows", "allgather_shard_mask", "allgather_wire",
           "auto_comm_a2a", "batch_node_received", "busiest_rows", "comm_saving", "exact_need_received",
           "exact_need_received_kernel", "exact_need_saving", "exact_need_sent", "exchange_volumes",
           "exchange_table_size", "exchange_volumes_into", "exchange_volumes_kernel",
           "grad_bytes_per_token", "kind_local_mask", "shard_is_local", "kv_bytes_per_token", "node_busiest",
           "node_receive_summary", "plan_metrics", "ring_comm_tokens", "ring_held_before", "ring_step_work"]

SENT, RECEIVED, SENT_FAR, RECEIVED_FAR, CONTRIBUTED = range(5)
"""Rows of ``exchange_volumes_kernel``'s (5, cp) result: exact-need rows each rank sends and receives, their
parts that cross a node boundary, and each rank's all-gather contribution."""


@njit(cache=True, inline="always")
def _num_docs(doc):
    """Documents of a plan: one past the largest document index."""
    num_docs = 0
    for i in range(doc.shape[0]):
        num_docs = max(num_docs, doc[i] + 1)
    return num_docs


@njit(cache=True, inline="always")
def exchange_table_size(num_docs, num_shards, cp):
    """int64 slots ``exchange_volumes_into`` needs in its ``table`` (the last ``num_shards``: ``shard_is_local``)."""
    return num_docs * (2 * cp + 3) + 2 + 3 * num_shards + cp


@njit(cache=True, inline="always")
def shard_is_local(table, num_docs, num_shards, cp):
    """Which shards need no other rank: a (num_shards,) view of ``table`` after ``exchange_volumes_into``.

    Filled under a window or chunk kind: 1 where every key the shard's queries see lies on its own rank.
    """
    at = exchange_table_size(num_docs, num_shards, cp) - num_shards
    return table[at:at + num_shards]


@njit(cache=True, inline="always")
def _document_holders(table, doc, start, length, rank, cp, num_docs, received, full):
    """What the exchange volumes are made of, in one pass over the shards.

    Written into ``table`` (zeros, ``exchange_table_size`` int64 slots); with ``full``, adds every rank's
    exact-need receive under full attention to ``received`` ((cp,) int64) on the way.
    ``max_end[d, r]``: end of the last token of document d that rank r holds (0: none); ``held[d, r]``: its
    tokens there; ``last_start[d]``: start of d's last shard; the ranks holding d are
    ``holders[holder_at[d]:holder_at[d + 1]]`` (a shard's sends then visit them only, not every rank).
    """
    num_shards = doc.shape[0]
    max_end = table[:num_docs * cp].reshape((num_docs, cp))
    held = table[num_docs * cp:2 * num_docs * cp].reshape((num_docs, cp))
    at = 2 * num_docs * cp
    last_start = table[at:at + num_docs]
    holder_at = table[at + num_docs:at + 2 * num_docs + 1]
    holders = table[at + 2 * num_docs + 1:at + 2 * num_docs + 1 + num_shards]
    last_start[:] = -1
    for i in range(num_shards):
        d, r = doc[i], rank[i]
        max_end[d, r] = max(max_end[d, r], start[i] + length[i])
        held[d, r] += length[i]
        last_start[d] = max(last_start[d], start[i])
    for d in range(num_docs):
        ranks = 0
        for r in range(cp):
            if held[d, r] > 0:
                holders[holder_at[d] + ranks] = r
                ranks += 1
                if full:
                    received[r] += max_end[d, r] - held[d, r]
        holder_at[d + 1] = holder_at[d] + ranks
    return max_end, held, last_start, holders, holder_at


@njit(cache=True, inline="always")
def _new_document_holders(doc, start, length, rank, cp):
    """``_document_holders`` in a table of its own."""
    num_docs = _num_docs(doc)
    table = np.zeros(exchange_table_size(num_docs, doc.shape[0], cp), np.int64)
    return _document_holders(table, doc, start, length, rank, cp, num_docs, np.zeros(cp, np.int64), True)


@njit(cache=True, inline="always")
def _contributes(i, doc, start, last_start, holder_at):
    """Whether shard i goes into the compacted all-gather: its document spans ranks and it is not the last."""
    d = doc[i]
    return holder_at[d + 1] - holder_at[d] > 1 and start[i] != last_start[d]


@njit(cache=True)
def exchange_volumes_kernel(shard_doc, shard_start, shard_len, shard_rank, cp, gpus_per_node, kind=FULL, size=0):
    """Every exchange volume of one plan in one pass (``exchange_volumes``), callable from other kernels.

    Returns (5, cp) int64 with rows ``SENT``, ``RECEIVED``, ``SENT_FAR``, ``RECEIVED_FAR``, ``CONTRIBUTED``;
    takes int64 arrays, no checks, no casts.

    ``gpus_per_node``: ranks per node (rank r on node ``r // gpus_per_node``); 0: one node, nothing is far.
    ``kind``, ``size``: the layer kind (``workload.FULL``, ``WINDOW``, ``CHUNK``) and its W or K.
    """
    num_docs = _num_docs(shard_doc)
    out = np.zeros((5, cp), np.int64)
    table = np.zeros(exchange_table_size(num_docs, shard_doc.shape[0], cp), np.int64)
    exchange_volumes_into(out, table, shard_doc, shard_start, shard_len, shard_rank, cp, gpus_per_node, num_docs,
                          True, kind, size)
    return out


@njit(cache=True, inline="always")
def exchange_volumes_into(out, table, shard_doc, shard_start, shard_len, shard_rank, cp, gpus_per_node, num_docs,
                          with_sends, kind, size):
    """``exchange_volumes_kernel`` into buffers the caller owns (the planner's search prices a plan per move).

    Args:
        out: (5, cp) int64, zeros; gets the rows of ``exchange_volumes_kernel`` (without ``with_sends`` only
            ``RECEIVED``).
        table: (``exchange_table_size(num_docs, num_shards, cp)``,) int64, zeros; scratch.
        shard_doc: (num_shards,) int64, each shard's document.
        shard_start: (num_shards,) int64, each shard's first token in its document.
        shard_len: (num_shards,) int64, each shard's tokens.
        shard_rank: (num_shards,) int64, each shard's rank.
        cp: number of CP ranks.
        gpus_per_node: ranks per node (0: one node, nothing is far).
        num_docs: one past the largest of ``shard_doc``.
        with_sends: False fills ``RECEIVED`` alone.
        kind: the layer kind, ``workload.FULL``, ``WINDOW`` or ``CHUNK``.
        size: its W or K in tokens (0 for full).

    A shard ``[start, end)`` of a document needs its keys ``[key_start, end)`` (``workload.key_start``); a rank
    receives once each key of its documents that one of its shards needs and another rank holds, and the
    holder sends it. The all-gather takes, of each shard of a document spread over several ranks, under full
    attention every shard but the last (paper Eq. 5), under a window or chunk the rows that the document's
    later shards on other ranks need.
    Under a window or chunk kind, ``shard_is_local(table, ...)`` then says which shards need no other rank.
    """
    full = kind == FULL
    max_end, held, last_start, holders, holder_at = _document_holders(table, shard_doc, shard_start, shard_len,
                                                                      shard_rank, cp, num_docs, out[RECEIVED], full)
    if not full:
        _bounded_volumes_into(out, table, shard_doc, shard_start, shard_len, shard_rank, cp, gpus_per_node,
                              num_docs, with_sends, kind, size, holders, holder_at)
        return
    if not with_sends:
        return
    split = gpus_per_node > 0 and cp > gpus_per_node
    for i in range(shard_doc.shape[0]):
        d, b = shard_doc[i], shard_rank[i]
        if holder_at[d + 1] - holder_at[d] < 2:  # on one rank: nothing to send
            continue
        if _contributes(i, shard_doc, shard_start, last_start, holder_at):
            out[CONTRIBUTED, b] += shard_len[i]
        node = b // gpus_per_node if split else 0
        for h in range(holder_at[d], holder_at[d + 1]):
            r = holders[h]
            if r != b:
                amount = min(shard_len[i], max(0, max_end[d, r] - shard_start[i]))
                out[SENT, b] += amount
                if split and r // gpus_per_node != node:
                    out[SENT_FAR, b] += amount
                    out[RECEIVED_FAR, r] += amount


@njit(cache=True)
def _bounded_volumes_into(out, table, doc, start, length, rank, cp, gpus_per_node, num_docs, with_sends, kind,
                          size, holders, holder_at):
    """``exchange_volumes_into`` under a window or chunk kind, where a shard needs a bounded span of keys.

    The shards of each document in order of position: the first key a shard needs never decreases along the
    document, so what shard j sends rank r is its tail from the first key that r's next shard after j needs,
    and its all-gather rows are the widest of those tails over the other ranks (what the runtime's per-kind
    all-gather moves: ``flashcp.runtime.kind_exchange``; a later shard on j's own rank reads j locally).
    A shard is local when its first key lies in the run of same-rank shards that ends with it.
    """
    num_shards = doc.shape[0]
    at = num_docs * (2 * cp + 2) + 1 + num_shards
    doc_at = table[at:at + num_docs + 1]
    order = table[at + num_docs + 1:at + num_docs + 1 + num_shards]
    next_key = table[at + num_docs + 1 + num_shards:at + num_docs + 1 + num_shards + cp]
    local = shard_is_local(table, num_docs, num_shards, cp)
    # the shards grouped by document (a counting sort), each group sorted by start
    bits = 1
    while (1 << bits) < num_shards:
        bits += 1
    mask = (1 << bits) - 1
    for i in range(num_shards):
        doc_at[doc[i] + 1] += 1
    for d in range(num_docs):
        doc_at[d + 1] += doc_at[d]
    for i in range(num_shards):
        order[doc_at[doc[i]]] = (start[i] << bits) | i
        doc_at[doc[i]] += 1
    for d in range(num_docs, 0, -1):
        doc_at[d] = doc_at[d - 1]
    doc_at[0] = 0
    split = gpus_per_node > 0 and cp > gpus_per_node
    for d in range(num_docs):
        lo, hi = doc_at[d], doc_at[d + 1]
        sort_range(order, lo, hi)
        run_rank = -1
        run_start = 0
        for k in range(lo, hi):
            i = order[k] & mask
            if rank[i] != run_rank:
                run_rank, run_start = rank[i], start[i]
            local[i] = 1 if key_start(kind, size, start[i]) >= run_start else 0
        if holder_at[d + 1] - holder_at[d] < 2:  # on one rank: nothing to send
            continue
        for h in range(holder_at[d], holder_at[d + 1]):
            next_key[holders[h]] = -1
        for k in range(hi - 1, lo - 1, -1):
            i = order[k] & mask
            b, s, e = rank[i], start[i], start[i] + length[i]
            node = b // gpus_per_node if split else 0
            widest = 0
            for h in range(holder_at[d], holder_at[d + 1]):
                r = holders[h]
                if r == b or next_key[r] < 0:
                    continue
                amount = e - max(s, min(e, next_key[r]))
                widest = max(widest, amount)
                out[RECEIVED, r] += amount
                if with_sends:
                    out[SENT, b] += amount
                    if split and r // gpus_per_node != node:
                        out[SENT_FAR, b] += amount
                        out[RECEIVED_FAR, r] += amount
            if with_sends:
                out[CONTRIBUTED, b] += widest
            next_key[b] = key_start(kind, size, s)


@njit(cache=True)
def exact_need_received_kernel(shard_doc, shard_start, shard_len, shard_rank, cp):
    """``exact_need_received`` inside a kernel: the ``RECEIVED`` row of ``exchange_volumes_kernel`` alone."""
    num_docs = _num_docs(shard_doc)
    out = np.zeros((5, cp), np.int64)
    table = np.zeros(exchange_table_size(num_docs, shard_doc.shape[0], cp), np.int64)
    exchange_volumes_into(out, table, shard_doc, shard_start, shard_len, shard_rank, cp, 0, num_docs, False, FULL,
                          0)
    return out[RECEIVED]


@njit(cache=True)
def _allgather_shard_mask(shard_doc, shard_start, shard_len, shard_rank, cp):
    _, _, last_start, _, holder_at = _new_document_holders(shard_doc, shard_start, shard_len, shard_rank, cp)
    mask = np.zeros(shard_doc.shape[0], dtype=np.bool_)
    for i in range(shard_doc.shape[0]):
        mask[i] = _contributes(i, shard_doc, shard_start, last_start, holder_at)
    return mask


@dataclass(frozen=True, kw_only=True, slots=True)
class ExchangeVolumes:
    """Every rank's K/V rows in one plan's exchanges, one forward pass; every array is (cp,) int64.

    The fields say what full attention moves; under a window or chunk kind a shard needs only the keys
    ``[key_start, end)`` of its document instead of ``[0, end)`` (``exchange_volumes_into``).
    """

    sent: np.ndarray
    """Exact-need rows each rank sends: to every other rank r, its tokens of each document's prefix
    ``[0, max end of r's shards)``."""
    received: np.ndarray
    """Exact-need rows each rank receives: per document it holds, the tokens of ``[0, max end of its
    shards)`` it does not hold."""
    sent_far: np.ndarray
    """The part of ``sent`` that crosses a node boundary (0 without a topology)."""
    received_far: np.ndarray
    """The part of ``received`` that crosses a node boundary (0 without a topology)."""
    contributed: np.ndarray
    """Rows each rank contributes to the compacted all-gather (paper Eq. 5): its shards that are not the last
    of a document spread over several ranks."""

    @property
    def ag_slot(self) -> int:
        """Rows every rank puts into the compacted all-gather: the largest contribution."""
        return int(self.contributed.max())

    @property
    def a2a_busiest(self) -> int:
        """Rows the busiest rank moves in the exact-need all-to-all (``busiest_rows``)."""
        return int(busiest_rows(self.sent, self.received))


def exchange_volumes(shard_doc, shard_start, shard_len, shard_rank, cp: int,
                     gpus_per_node: int = 0, kind: int = FULL, size: int = 0) -> ExchangeVolumes:
    """Every rank's exact-need and all-gather rows of one plan, computed once (``exchange_volumes_kernel``).

    ``gpus_per_node``: ranks per node (rank r on node ``r // gpus_per_node``) for the parts crossing nodes;
    0: one node. ``kind``, ``size``: one layer's kind (``workload.FULL``, ``WINDOW``, ``CHUNK``) and its W or K.
    """
    arrays = as_int64(shard_doc, shard_start, shard_len, shard_rank)
    out = exchange_volumes_kernel(*arrays, cp, int(gpus_per_node), int(kind), int(size))
    return ExchangeVolumes(sent=out[SENT], received=out[RECEIVED], sent_far=out[SENT_FAR],
                           received_far=out[RECEIVED_FAR], contributed=out[CONTRIBUTED])


@njit(cache=True)
def _kind_local_mask(shard_doc, shard_start, shard_len, shard_rank, cp, kind, size):
    num_docs = _num_docs(shard_doc)
    num_shards = shard_doc.shape[0]
    out = np.zeros((5, cp), np.int64)
    table = np.zeros(exchange_table_size(num_docs, num_shards, cp), np.int64)
    exchange_volumes_into(out, table, shard_doc, shard_start, shard_len, shard_rank, cp, 0, num_docs, False, kind,
                          size)
    return shard_is_local(table, num_docs, num_shards, cp) > 0


def kind_local_mask(shard_doc, shard_start, shard_len, shard_rank, cp: int, kind: int, size: int) -> np.ndarray:
    """Shards every key of which (``[key_start, end)``) lies on their own rank, under a window or chunk kind.

    Shape (num_shards,), bool; from ``exchange_volumes_into``'s pass (``shard_is_local``). Full attention's
    is ``projection.local_only_mask``.
    """
    arrays = as_int64(shard_doc, shard_start, shard_len, shard_rank)
    return _kind_local_mask(*arrays, cp, int(kind), int(size))


def allgather_contributions(shard_doc, shard_start, shard_len, shard_rank, cp: int) -> np.ndarray:
    """Tokens of K/V each rank contributes to the compacted all-gather (paper Eq. 5). Shape (cp,), int64.

    ``exchange_volumes(...).contributed``.
    """
    return exchange_volumes(shard_doc, shard_start, shard_len, shard_rank, cp).contributed


def allgather_shard_mask(shard_doc, shard_start, shard_len, shard_rank, cp: int) -> np.ndarray:
    """Which shards are contributed to the compacted all-gather (paper Eq. 5). Shape (num_shards,), bool.

    A shard contributes when it is not the last shard of its document and its document has shards on more
    than one rank; ``allgather_contributions`` sums these shards' lengths per rank.
    """
    arrays = as_int64(shard_doc, shard_start, shard_len, shard_rank)
    return _allgather_shard_mask(*arrays, cp)


def exact_need_received(shard_doc, shard_start, shard_len, shard_rank, cp: int) -> np.ndarray:
    """Tokens of K/V each rank receives under exact-need exchange. Shape (cp,), int64.

    ``exchange_volumes(...).received``.
    """
    return exchange_volumes(shard_doc, shard_start, shard_len, shard_rank, cp).received


def exact_need_sent(shard_doc, shard_start, shard_len, shard_rank, cp: int) -> np.ndarray:
    """Tokens of K/V each rank sends under exact-need exchange. Shape (cp,), int64.

    Rank b sends rank r the tokens b holds of each document's prefix ``[0, max end of r's shards)``: the
    sending side of ``exact_need_received`` (both sum to the same total). ``exchange_volumes(...).sent``.
    """
    return exchange_volumes(shard_doc, shard_start, shard_len, shard_rank, cp).sent


def comm_saving(comm_tokens: float, context_len: int, cp: int) -> float:
    """``1 - comm_tokens / (C / N)``: saving against the full-KV all-gather's critical path."""
    return 1.0 - comm_tokens / (context_len / cp)


def exact_need_saving(received_tokens: float, context_len: int, cp: int) -> float:
    """``1 - received / ((N - 1) * C / N)``: saving against what a rank receives in a full-KV all-gather.

    1.0 when ``cp == 1`` (nothing is ever received).
    """
    if cp == 1:
        return 1.0
    return 1.0 - received_tokens / ((cp - 1) * context_len / cp)


@njit(cache=True)
def kv_bytes_per_token(num_kv_heads, head_dim, dtype_bytes):
    """Bytes of K and V for one token, one layer, one pass: ``2 * H_kv * D * dtype_bytes``."""
    return 2 * num_kv_heads * head_dim * dtype_bytes


@njit(cache=True)
def grad_bytes_per_token(num_kv_heads, head_dim, dtype_bytes):
    """Bytes of dK and dV for one token in the all-gather's backward reduce-scatter.

    It sums inside the collective in float32 (or the K/V dtype when wider): ``2 * H_kv * D * max(dtype_bytes,
    4)``.
    """
    return 2 * num_kv_heads * head_dim * max(dtype_bytes, 4)


@njit(cache=True)
def auto_comm_a2a(a2a_busiest, ag_slot, cp, dtype_bytes):
    """Whether ``comm="auto"`` takes ``a2a``.

    It does when its busiest rank (max of sent and received tokens) moves fewer bytes per step than an
    all-gather rank, whose ``(cp - 1) * ag_slot`` rows go forward in the K/V dtype and back in float32
    (``grad_bytes_per_token``); ``a2a`` moves its rows in the K/V dtype both ways.
    """
    a2a_bytes = 2 * a2a_busiest * dtype_bytes
    ag_bytes = allgather_wire(ag_slot, cp) * (dtype_bytes + max(dtype_bytes, 4))
    return a2a_bytes < ag_bytes


@njit(cache=True)
def allgather_wire(slot, cp):
    """Rows one rank receives in an all-gather of ``slot`` rows per rank: ``(cp - 1) * slot``."""
    return (cp - 1) * slot


@njit(cache=True)
def busiest_rows(sent, received):
    """Rows the busiest rank of an all-to-all moves: the largest of every rank's ``max(sent, received)``.

    ``sent``, ``received`` (cp,): every rank's rows (the links are full duplex, so the larger side counts).
    """
    most = 0
    for r in range(sent.shape[0]):
        most = max(most, sent[r], received[r])
    return most


@njit(cache=True)
def node_busiest(sent, received, sent_far, received_far):
    """``(near, far)``: the most rows one rank moves inside its node and across nodes (exact-need).

    Each is the larger of the rank's sending and receiving side (the links are full duplex).

    ``sent``, ``received`` (cp,): every rank's totals; ``sent_far``, ``received_far``: their parts that cross
    a node boundary (``exchange_volumes``).
    """
    near = 0
    far = 0
    for r in range(sent.shape[0]):
        near = max(near, sent[r] - sent_far[r], received[r] - received_far[r])
        far = max(far, sent_far[r], received_far[r])
    return near, far


@njit(cache=True)
def allgather_node_rows(slot, cp, gpus_per_node):
    """``(near, far)`` rows of the busiest rank in an all-gather of ``slot`` rows per rank.

    Every rank receives every other rank's slot, from its node peers over the node's link, from the others
    across nodes.

    ``gpus_per_node`` 0 (or at least ``cp``): one node, ``((cp - 1) * slot, 0)``.
    """
    if gpus_per_node <= 0 or gpus_per_node >= cp:
        return allgather_wire(slot, cp), 0
    near = 0
    far = 0
    for first in range(0, cp, gpus_per_node):
        size = min(gpus_per_node, cp - first)
        near = max(near, (size - 1) * slot)
        far = max(far, (cp - size) * slot)
    return near, far


@njit(cache=True)
def batch_node_received(shard_offsets, shard_doc, shard_start, shard_len, shard_rank, cp, gpus_per_node):
    """Per row of flat plans: the largest exact-need receive inside a node and across nodes, (rows, 2) int64.

    Column 0 is the largest of a rank's received rows less ``received_far``, column 1 the largest
    ``received_far``.
    """
    rows = shard_offsets.shape[0] - 1
    out = np.zeros((rows, 2), np.int64)
    for row in range(rows):
        lo = shard_offsets[row]
        hi = shard_offsets[row + 1]
        if hi == lo:
            continue
        v = exchange_volumes_kernel(shard_doc[lo:hi], shard_start[lo:hi], shard_len[lo:hi], shard_rank[lo:hi],
                                    cp, gpus_per_node)
        out[row, 0] = (v[RECEIVED] - v[RECEIVED_FAR]).max()
        out[row, 1] = v[RECEIVED_FAR].max()
    return out


def node_receive_summary(node_received: np.ndarray, context_len: int, cp: int, gpus_per_node: int) -> dict:
    """plan.json's intra- and inter-node receive of plans made for a topology.

    The means over sequences of ``batch_node_received``'s columns (tokens), each also as a share of
    ``(N - 1) C / N``.
    """
    full = max(1.0, (cp - 1) * context_len / cp)
    intra, inter = (float(node_received[:, k].mean()) if node_received.size else 0.0 for k in (0, 1))
    return {"gpus_per_node": int(gpus_per_node), "a2a_intra_node_tokens_mean": intra,
            "a2a_inter_node_tokens_mean": inter, "a2a_intra_node_received_pct": 100 * intra / full,
            "a2a_inter_node_received_pct": 100 * inter / full}


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanMetrics:
    """The metrics stored with every sequence's plan."""

    imbalance: float
    """``max_rank W / mean_rank W``."""
    ag_comm_tokens: int
    """All-gather critical path: the largest per-rank contribution, 0 when nothing is shared."""
    a2a_comm_tokens: int
    """Exact-need critical path: the largest per-rank receive."""


def plan_metrics(shard_doc, shard_start, shard_len, shard_rank, cp: int) -> PlanMetrics:
    """Recompute a plan's stored metrics from its shards."""
    volumes = exchange_volumes(shard_doc, shard_start, shard_len, shard_rank, cp)
    return PlanMetrics(imbalance=imbalance_ratio(rank_workloads(shard_start, shard_len, shard_rank, cp)),
                       ag_comm_tokens=volumes.ag_slot, a2a_comm_tokens=int(volumes.received.max()))


def ring_comm_tokens(shard_len, shard_rank, cp: int) -> tuple[np.ndarray, np.ndarray]:
    """``(sent, received)`` tokens of K/V per rank for one forward pass of ring comm, each (cp,) int64.

    Step ``s = 1 .. N-1`` brings rank r the block of rank ``(r - s) mod N`` (that rank's ``T`` tokens) and
    sends rank ``r + 1`` the block r held at step ``s - 1``: r receives every block but its own (``C - T_r``)
    and sends every block but that of rank ``r + 1`` (``C - T_{r+1}``). With ``C % N == 0`` both are
    ``(N - 1) / N`` of the sequence's K/V. One step takes as long as its largest block, so the critical path
    is ``(N - 1) * max_r T_r``. The backward pass moves the K/V blocks round once more and the dK/dV blocks
    round once (``N - 1`` steps each), i.e. twice the forward's tokens.
    """
    tokens = rank_tokens(shard_len, shard_rank, cp)
    total = int(tokens.sum())
    return total - np.roll(tokens, -1), total - tokens


@dataclass(frozen=True, kw_only=True, slots=True)
class RingStepWork:
    """What the ring computes at each step; every array is (cp, cp) int64 indexed ``[rank, step]``.

    At step ``s`` rank ``r`` hosts the block of rank ``(r - s) mod N``; each of its query shards attends to
    the block's tokens of the same document before the shard's end (step 0: its own block, causal).
    """

    pairs: np.ndarray
    """Query-key pairs computed; summed over steps it is the rank's workload."""
    query_tokens: np.ndarray
    """Query tokens that attend to the visiting block: rows of partial output merged by log-sum-exp."""
    key_tokens: np.ndarray
    """Keys the step's kernel reads, summed over its query shards."""
    sequences: np.ndarray
    """Query shards with at least one visible key: the sequences of the step's varlen kernel call."""

    @property
    def kernel_calls(self) -> np.ndarray:
        """Varlen kernel calls of each rank (steps with work). Shape (cp,), int64."""
        return (self.sequences > 0).sum(axis=1).astype(np.int64)


def ring_held_before(shard_doc, shard_start, shard_len, shard_rank, cp: int) -> np.ndarray:
    """``held[b, i]``: tokens of shard i's document that rank b holds before the end of shard i.

    Shape (cp, num_shards), int64. Shard i's own tokens count for its own rank.
    """
    shard_doc, shard_start, shard_len, shard_rank = as_int64(shard_doc, shard_start, shard_len, shard_rank)
    order = np.lexsort((shard_start, shard_doc))
    doc_sorted = shard_doc[order]
    first_of_doc = np.r_[True, doc_sorted[1:] != doc_sorted[:-1]] if order.size else np.zeros(0, bool)
    held = np.zeros((cp, shard_doc.size), dtype=np.int64)
    for b in range(cp):
        mine = np.where(shard_rank[order] == b, shard_len[order], 0)
        cum = np.cumsum(mine)
        # restart the running sum at every document: subtract the total of the documents before
        before_doc = np.maximum.accumulate(np.where(first_of_doc, cum - mine, 0))
        held[b, order] = cum - before_doc
    return held


def ring_step_work(shard_doc, shard_start, shard_len, shard_rank, cp: int) -> RingStepWork:
    """Per rank and ring step: pairs, merged query rows, gathered keys and kernel sequences (RingStepWork)."""
    shard_doc, shard_start, shard_len, shard_rank = as_int64(shard_doc, shard_start, shard_len, shard_rank)
    held = ring_held_before(shard_doc, shard_start, shard_len, shard_rank, cp)
    shape = (cp, cp)
    work = {name: np.zeros(shape, dtype=np.int64) for name in ("pairs", "query_tokens", "key_tokens",
                                                                 "sequences")}
    for rank in range(cp):
        mine = np.flatnonzero(shard_rank == rank)
        length = shard_len[mine]
        for step in range(cp):
            keys = held[(rank - step) % cp, mine]
            seen = keys > 0
            if step == 0:  # own block: the keys before the shard, then the shard itself (causal)
                pairs = length * (keys - length) + length * (length + 1) // 2
            else:
                pairs = length * keys
            work["pairs"][rank, step] = pairs.sum()
            work["query_tokens"][rank, step] = length[seen].sum()
            work["key_tokens"][rank, step] = keys.sum()
            work["sequences"][rank, step] = seen.sum()
    return RingStepWork(**work)
