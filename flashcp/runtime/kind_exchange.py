"""The exchange of one layer kind: what a sliding-window or chunk layer's queries see, and only that moved.

A query shard ``[start, end)`` of a document sees the keys ``[max(0, start - W + 1), end)`` under a window W
and ``[K * floor(start / K), end)`` under a chunk K (with both, the later start), where full attention sees
``[0, end)``. ``kind_meta`` builds a rank's ``CPAttnMeta`` for such a layer from its ``RankLayout`` (what
``CPAttnMeta.for_kind`` returns): the local/remote split, the parts (split at chunk boundaries under a chunk:
``kernels.library.chunk_segments``) and the ``allgather``, ``a2a`` and ``full`` exchanges with their volumes.
Like the full meta it works on the plan's shards, never on per-token maps: O(num_shards * cp) for the
plan-wide need, then O(what this rank holds, receives and sends).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import torch

from flashcp.costmodel.comm import allgather_wire, auto_comm_a2a, busiest_rows
from flashcp.costmodel.workload import CHUNK, WINDOW, key_starts
from flashcp.runtime.exchange_parts import Exchange, QueryPart
from flashcp.runtime.index_arrays import as_int32, as_long, cumsum0, ranges, within_rank_offsets
from flashcp.runtime.kernels.library import chunk_segments

__all__ = ["key_start", "kind_meta", "kind_need", "range_pieces"]


def key_start(start: np.ndarray, window: int | None, chunk: int | None) -> np.ndarray:
    """First document position the queries of a shard starting at ``start`` see under the kind (int64).

    The cost model's ``key_starts`` per kind (one formula for the planner and the runtime); with both a window
    and a chunk, the later of the two.
    """
    start = np.ascontiguousarray(start, dtype=np.int64)
    first = np.zeros_like(start)
    if chunk is not None:
        first = key_starts(CHUNK, int(chunk), start)
    if window is not None:
        first = np.maximum(first, key_starts(WINDOW, int(window), start))
    return first


def kind_need(layout: Any, first_key: np.ndarray) -> np.ndarray:
    """(num_shards, cp) int64: tokens of shard j that rank r needs and does not hold, a suffix of j.

    ``first_key``: (num_shards,) each shard's ``key_start``. Rank r's shards after j in j's document see
    ``[first_key, end)``, which meets j in a suffix of it; the first of them has the smallest first key (it
    grows with the shard's start), so it alone sets the need.
    """
    plan, cp = layout.plan, layout.plan.cp
    order = layout.by_pos
    rank, doc, start = plan.shard_rank[order], plan.shard_doc[order], plan.shard_start[order]
    end, first_key = layout.shard_end[order], first_key[order]
    need = np.zeros((plan.num_shards, cp), dtype=np.int64)
    position = np.arange(order.size)
    for r in range(cp):
        mine = np.flatnonzero(rank == r)
        if mine.size == 0:
            continue
        after = np.searchsorted(mine, position, side="right")
        nxt = mine[np.minimum(after, mine.size - 1)]
        sees = (after < mine.size) & (doc[nxt] == doc) & (rank != r)
        need[order, r] = np.where(sees, np.clip(end - np.maximum(start, first_key[nxt]), 0, end - start), 0)
    return need


def range_pieces(layout: Any, docs, starts, ends) -> tuple[np.ndarray, ...]:
    """The pieces of each range ``[starts[i], ends[i])`` of document ``docs[i]``, range after range.

    Returns ``(range, piece, offset, length)``: which range, the piece's shard, where the range enters the
    piece (tokens from the piece's start) and its tokens inside the range.
    """
    offset = layout.doc_offset[docs]
    first = np.searchsorted(layout.pos_sorted, offset + starts, side="right") - 1
    count = np.searchsorted(layout.pos_sorted, offset + ends) - first
    piece = layout.by_pos[ranges(first, count)]
    which = np.repeat(np.arange(docs.size), count)
    key_from = np.maximum(layout.plan.shard_start[piece], starts[which])
    length = np.minimum(layout.shard_end[piece], ends[which]) - key_from
    return which, piece, key_from - layout.plan.shard_start[piece], length


def _kind_part(layout: Any, shards, key_start, chunk) -> tuple[QueryPart, tuple[np.ndarray, ...]]:
    """The QueryPart of ``shards`` under the kind and the pieces of its keys ``(piece, offset, length)``."""
    plan = layout.plan
    start, end = plan.shard_start[shards], layout.shard_end[shards]
    first = key_start[shards]
    q_len, k_len = end - start, end - first
    if chunk is not None:  # one sequence per (shard, chunk): the chunk's keys up to the shard's queries in it
        _, q_len, k_len, _ = chunk_segments(q_len, k_len, first, chunk)
    part = QueryPart(q_index=as_long(ranges(layout.shard_local[shards], end - start)),
                     cu_seqlens_q=as_int32(cumsum0(q_len)), cu_seqlens_k=as_int32(cumsum0(k_len)),
                     max_seqlen_q=int(q_len.max(initial=0)), max_seqlen_k=int(k_len.max(initial=0)))
    _, piece, offset, length = range_pieces(layout, plan.shard_doc[shards], first, end)
    return part, (piece, offset, length)


def kind_meta(layout: Any, meta: Any, window: int | None, chunk: int | None) -> Any:
    """``meta`` (a ``CPAttnMeta`` of ``layout``, a ``meta.RankLayout``) for a window or chunk layer.

    The same shards; the parts and exchanges cover only what the kind's queries see. Typed loosely:
    ``flashcp.runtime.meta`` imports this module, not the other way round.
    """
    plan, cp, rank, shards = layout.plan, layout.plan.cp, layout.rank, layout.shards
    first_key = key_start(plan.shard_start, window, chunk)
    need = kind_need(layout, first_key)
    # a shard is local-only when this rank holds every key it sees
    which, piece, _, _ = range_pieces(layout, plan.shard_doc[shards], first_key[shards], layout.shard_end[shards])
    foreign = np.bincount(which, weights=plan.shard_rank[piece] != rank, minlength=shards.size)
    local_only = foreign == 0
    local, (local_piece, local_offset, local_len) = _kind_part(layout, shards[local_only], first_key, chunk)
    remote, (piece, offset, key_len) = _kind_part(layout, shards[~local_only], first_key, chunk)
    num_tokens = meta.num_tokens
    order = np.concatenate([local.q_index.numpy(), remote.q_index.numpy()])
    out_index = np.empty(num_tokens, dtype=np.int64)
    out_index[order] = np.arange(num_tokens)

    held = plan.shard_rank[piece] == rank
    shard_len = plan.shard_len

    def exchange(mode, active, send_index, send_rows, recv_rows, first_row, wire, splits=((), ())):
        # first_row[j]: the row shard j's first token would have in the receive buffer (its needed suffix
        # is there); held pieces read the local K/V
        row = np.where(held, layout.shard_local[piece], num_tokens + first_row[piece]) + offset
        return Exchange(mode=mode, active=active, send_index=as_long(send_index), send_rows=send_rows,
                        recv_rows=recv_rows, send_splits=splits[0], recv_splits=splits[1],
                        kv_index=as_long(ranges(row, key_len)), wire_send_tokens=wire[0], wire_recv_tokens=wire[1])

    # a2a: rank r receives need[:, r], by (owner, owner's local position); owners send peer after peer
    received = need.sum(axis=0)
    sent = np.bincount(plan.shard_rank, weights=need.sum(axis=1), minlength=cp).astype(np.int64)
    a2a_busiest = int(busiest_rows(sent, received))
    mine = need[:, rank]
    by_owner = np.lexsort((layout.shard_local, plan.shard_rank))
    rows = np.empty(plan.num_shards, dtype=np.int64)
    rows[by_owner] = cumsum0(mine[by_owner])[:-1]
    recv_splits = tuple(int(c) for c in np.bincount(plan.shard_rank, weights=mine, minlength=cp))
    amount = need[shards].T.reshape(-1)  # peer after peer, this rank's shards in local order
    ends = np.tile(layout.shard_local[shards] + shard_len[shards], cp)
    a2a_send = ranges(ends - amount, amount)
    send_splits = tuple(int(c) for c in need[shards].sum(axis=0))
    assert (offset[~held] >= (shard_len - mine)[piece[~held]]).all()

    # allgather: each shard contributes the suffix any other rank needs
    contribution = need.max(axis=1)
    per_rank = np.bincount(plan.shard_rank, weights=contribution, minlength=cp).astype(np.int64)
    ag_slot = int(per_rank.max(initial=0))
    ag_row = plan.shard_rank * ag_slot + within_rank_offsets(contribution, plan.shard_rank)
    ag_send = ranges(layout.shard_local[shards] + shard_len[shards] - contribution[shards], contribution[shards])
    ag_wire = int(allgather_wire(ag_slot, cp))
    full = meta.exchanges["full"]
    exchanges = {
        "allgather": exchange("allgather", ag_slot > 0, ag_send, ag_slot, cp * ag_slot,
                              ag_row - (shard_len - contribution), (ag_wire, ag_wire)),
        "a2a": exchange("a2a", bool(received.any()), a2a_send, sum(send_splits), sum(recv_splits),
                        rows - (shard_len - mine), (sum(send_splits), sum(recv_splits)),
                        (send_splits, recv_splits)),
        "full": exchange("full", full.active, full.send_index.numpy(), full.send_rows, full.recv_rows,
                         plan.shard_rank * layout.full_slot + layout.shard_local,
                         (full.wire_send_tokens, full.wire_recv_tokens)),
    }
    return replace(meta, shard_local_only=torch.from_numpy(local_only.copy()), local=local,
                   local_kv_index=as_long(ranges(layout.shard_local[local_piece] + local_offset, local_len)),
                   remote=remote, out_index=as_long(out_index), exchanges=exchanges,
                   auto_comm="a2a" if auto_comm_a2a(a2a_busiest, ag_slot, cp, 2) else "allgather",
                   ag_slot=ag_slot, a2a_busiest=a2a_busiest)
