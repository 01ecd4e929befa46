"""The cost model: the single source of truth for workload, quotas, imbalance and communication volume.

Every other part of flashcp (strategies, kernels, audit, bench, runtime checks) imports these definitions.
A plan is described by four parallel integer arrays, one entry per shard:

    shard_doc    document index inside the packed sequence
    shard_start  first token of the shard inside its document (its prefix length)
    shard_len    number of tokens (> 0)
    shard_rank   CP rank that computes the shard

Definitions (DESIGN.md section 2, paper section 3):

- workload of a shard: ``(2*start + length + 1) * length / 2`` query-key pairs of causal attention;
  always an integer.
- equal-token quotas: every rank gets ``C // N`` tokens, the first ``C % N`` ranks one more.
- imbalance ratio: ``max_rank W / mean_rank W``.
- all-gather comm (paper Eq. 5, compacted): a rank contributes every shard of its that is not the last shard
  of its document and whose document has shards on more than one rank; the critical path is the largest
  contribution (an all-gather moves equal-sized buffers).
- exact-need comm: rank r receives, per document, the tokens of ``[0, max end of r's shards)`` it does not
  hold itself; the critical path is the largest receive.
- comm saving: ``1 - critical path / (C / N)``, against the full-KV all-gather of Llama3 / Per-Doc CP.
- exact-need saving: ``1 - max received / ((N - 1) * C / N)``, against the tokens every rank receives in
  that full-KV all-gather (the all-gather saving above is the same ratio, as a rank receives N - 1 buffers).
- K/V bytes per token for one layer and one pass: ``2 * H_kv * D * dtype_bytes``; backward moves as much
  again (dK/dV).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

__all__ = [
    "PlanMetrics",
    "allgather_contributions",
    "allgather_shard_mask",
    "comm_saving",
    "exact_need_received",
    "exact_need_saving",
    "exact_need_sent",
    "imbalance_ratio",
    "kv_bytes_per_token",
    "plan_metrics",
    "rank_tokens",
    "rank_workloads",
    "token_quotas",
    "workload",
]


@njit(cache=True)
def workload(start, length):
    """Query-key pairs of causal attention for ``length`` queries after a prefix of ``start`` keys.

    Works on integers and on integer arrays (elementwise); inside Numba kernels too.
    """
    return (2 * start + length + 1) * length // 2


def token_quotas(context_len: int, cp: int) -> np.ndarray:
    """Tokens each rank must hold: ``C // N``, the first ``C % N`` ranks one more. Shape (cp,), int64."""
    if cp < 1:
        raise ValueError(f"cp must be at least 1, got {cp}")
    quotas = np.full(cp, context_len // cp, dtype=np.int64)
    quotas[: context_len % cp] += 1
    return quotas


@njit(cache=True)
def _rank_sums(values, shard_rank, cp):
    out = np.zeros(cp, dtype=np.int64)
    for i in range(shard_rank.shape[0]):
        out[shard_rank[i]] += values[i]
    return out


@njit(cache=True)
def _rank_workloads(shard_start, shard_len, shard_rank, cp):
    out = np.zeros(cp, dtype=np.int64)
    for i in range(shard_rank.shape[0]):
        out[shard_rank[i]] += workload(shard_start[i], shard_len[i])
    return out


@njit(cache=True)
def _allgather_shard_mask(shard_doc, shard_start, shard_rank):
    num_docs = 0
    for i in range(shard_doc.shape[0]):
        num_docs = max(num_docs, shard_doc[i] + 1)
    last_start = np.full(num_docs, -1, dtype=np.int64)
    first_rank = np.full(num_docs, -1, dtype=np.int64)
    on_many_ranks = np.zeros(num_docs, dtype=np.bool_)
    for i in range(shard_doc.shape[0]):
        d = shard_doc[i]
        last_start[d] = max(last_start[d], shard_start[i])
        if first_rank[d] < 0:
            first_rank[d] = shard_rank[i]
        elif first_rank[d] != shard_rank[i]:
            on_many_ranks[d] = True
    mask = np.zeros(shard_doc.shape[0], dtype=np.bool_)
    for i in range(shard_doc.shape[0]):
        d = shard_doc[i]
        mask[i] = on_many_ranks[d] and shard_start[i] != last_start[d]
    return mask


@njit(cache=True)
def _allgather_contributions(shard_doc, shard_start, shard_rank, shard_len, cp):
    mask = _allgather_shard_mask(shard_doc, shard_start, shard_rank)
    out = np.zeros(cp, dtype=np.int64)
    for i in range(shard_doc.shape[0]):
        if mask[i]:
            out[shard_rank[i]] += shard_len[i]
    return out


@njit(cache=True)
def _exact_need_received(shard_doc, shard_start, shard_len, shard_rank, cp):
    num_shards = shard_doc.shape[0]
    key = shard_doc * cp + shard_rank
    order = np.argsort(key)
    out = np.zeros(cp, dtype=np.int64)
    i = 0
    while i < num_shards:
        group_key = key[order[i]]
        rank = shard_rank[order[i]]
        max_end = 0
        held = 0
        while i < num_shards and key[order[i]] == group_key:
            s = order[i]
            max_end = max(max_end, shard_start[s] + shard_len[s])
            held += shard_len[s]
            i += 1
        out[rank] += max_end - held
    return out


@njit(cache=True)
def _exact_need_sent(shard_doc, shard_start, shard_len, shard_rank, cp):
    num_docs = 0
    for i in range(shard_doc.shape[0]):
        num_docs = max(num_docs, shard_doc[i] + 1)
    max_end = np.zeros((num_docs, cp), dtype=np.int64)
    for i in range(shard_doc.shape[0]):
        d, r = shard_doc[i], shard_rank[i]
        max_end[d, r] = max(max_end[d, r], shard_start[i] + shard_len[i])
    out = np.zeros(cp, dtype=np.int64)
    for i in range(shard_doc.shape[0]):
        d, b = shard_doc[i], shard_rank[i]
        for r in range(cp):
            if r != b:
                out[b] += min(shard_len[i], max(0, max_end[d, r] - shard_start[i]))
    return out


def _as_int64(*arrays):
    return tuple(np.ascontiguousarray(a, dtype=np.int64) for a in arrays)


def rank_tokens(shard_len, shard_rank, cp: int) -> np.ndarray:
    """Tokens held by each rank. Shape (cp,), int64."""
    shard_len, shard_rank = _as_int64(shard_len, shard_rank)
    return _rank_sums(shard_len, shard_rank, cp)


def rank_workloads(shard_start, shard_len, shard_rank, cp: int) -> np.ndarray:
    """Attention workload (query-key pairs) of each rank. Shape (cp,), int64."""
    shard_start, shard_len, shard_rank = _as_int64(shard_start, shard_len, shard_rank)
    return _rank_workloads(shard_start, shard_len, shard_rank, cp)


def imbalance_ratio(workloads) -> float:
    """``max / mean`` of per-rank workloads; 1.0 for an all-zero vector."""
    workloads = np.asarray(workloads, dtype=np.float64)
    mean = workloads.mean()
    return float(workloads.max() / mean) if mean > 0 else 1.0


def allgather_contributions(shard_doc, shard_start, shard_len, shard_rank, cp: int) -> np.ndarray:
    """Tokens of K/V each rank contributes to the compacted all-gather (paper Eq. 5). Shape (cp,), int64."""
    shard_doc, shard_start, shard_len, shard_rank = _as_int64(shard_doc, shard_start, shard_len, shard_rank)
    if shard_doc.size == 0:
        return np.zeros(cp, dtype=np.int64)
    return _allgather_contributions(shard_doc, shard_start, shard_rank, shard_len, cp)


def allgather_shard_mask(shard_doc, shard_start, shard_rank) -> np.ndarray:
    """Which shards are contributed to the compacted all-gather (paper Eq. 5). Shape (num_shards,), bool.

    A shard contributes when it is not the last shard of its document and its document has shards on more
    than one rank; ``allgather_contributions`` sums these shards' lengths per rank.
    """
    shard_doc, shard_start, shard_rank = _as_int64(shard_doc, shard_start, shard_rank)
    if shard_doc.size == 0:
        return np.zeros(0, dtype=np.bool_)
    return _allgather_shard_mask(shard_doc, shard_start, shard_rank)


def exact_need_received(shard_doc, shard_start, shard_len, shard_rank, cp: int) -> np.ndarray:
    """Tokens of K/V each rank receives under exact-need exchange. Shape (cp,), int64."""
    shard_doc, shard_start, shard_len, shard_rank = _as_int64(shard_doc, shard_start, shard_len, shard_rank)
    if shard_doc.size == 0:
        return np.zeros(cp, dtype=np.int64)
    return _exact_need_received(shard_doc, shard_start, shard_len, shard_rank, cp)


def exact_need_sent(shard_doc, shard_start, shard_len, shard_rank, cp: int) -> np.ndarray:
    """Tokens of K/V each rank sends under exact-need exchange. Shape (cp,), int64.

    Rank b sends rank r the tokens b holds of each document's prefix ``[0, max end of r's shards)``: the
    sending side of ``exact_need_received`` (both sum to the same total).
    """
    shard_doc, shard_start, shard_len, shard_rank = _as_int64(shard_doc, shard_start, shard_len, shard_rank)
    if shard_doc.size == 0:
        return np.zeros(cp, dtype=np.int64)
    return _exact_need_sent(shard_doc, shard_start, shard_len, shard_rank, cp)


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


def kv_bytes_per_token(num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Bytes of K and V for one token, one layer, one pass: ``2 * H_kv * D * dtype_bytes``."""
    return 2 * num_kv_heads * head_dim * dtype_bytes


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
    return PlanMetrics(
        imbalance=imbalance_ratio(rank_workloads(shard_start, shard_len, shard_rank, cp)),
        ag_comm_tokens=int(allgather_contributions(shard_doc, shard_start, shard_len, shard_rank, cp).max()),
        a2a_comm_tokens=int(exact_need_received(shard_doc, shard_start, shard_len, shard_rank, cp).max()),
    )
