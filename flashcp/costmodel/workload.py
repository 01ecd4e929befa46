"""Workload, equal-token quotas and imbalance: what a rank computes (definitions in flashcp.costmodel)."""

from __future__ import annotations

from typing import Protocol

import numpy as np

from flashcp._numba import njit

FULL, WINDOW, CHUNK = range(3)
"""Codes of the layer kinds inside kernels: full causal attention, a sliding window of W tokens, chunks of K."""
KIND_CODES = {"full": FULL, "window": WINDOW, "chunk": CHUNK}
"""The code of each kind's name (``flashcp.costmodel.models.KINDS``)."""

__all__ = ["CHUNK", "FULL", "KIND_CODES", "PlanArrays", "WINDOW", "as_int64", "imbalance_of", "imbalance_ratio",
           "key_start", "key_starts", "kind_workload", "kind_workloads", "max_over_mean", "offsets_of", "rank_tokens",
           "rank_workloads", "rank_workloads_kernel", "slack_tokens", "token_quotas", "token_quotas_kernel", "workload"]


class PlanArrays(Protocol):
    """A plan as the cost model reads it: four parallel int64 arrays, one entry per shard, and the CP size.

    ``flashcp.planner.plan.SequencePlan`` is one.
    """

    @property
    def shard_doc(self) -> np.ndarray:
        """(n,) document of each shard."""
        ...

    @property
    def shard_start(self) -> np.ndarray:
        """(n,) first token of each shard inside its document."""
        ...

    @property
    def shard_len(self) -> np.ndarray:
        """(n,) tokens of each shard."""
        ...

    @property
    def shard_rank(self) -> np.ndarray:
        """(n,) rank of each shard."""
        ...

    @property
    def cp(self) -> int:
        """CP size."""
        ...


@njit(cache=True)
def workload(start, length):
    """Query-key pairs of causal attention for ``length`` queries after a prefix of ``start`` keys.

    Works on integers and on integer arrays (elementwise); inside Numba kernels too.
    """
    return (2 * start + length + 1) * length // 2


@njit(cache=True)
def _chunk_prefix_pairs(n, size):
    """Pairs of the first ``n`` queries of a document under chunks of ``size``: each chunk a causal triangle."""
    return (n // size) * (size * (size + 1) // 2) + (n % size) * (n % size + 1) // 2


@njit(cache=True)
def kind_workload(kind, size, start, length):
    """Query-key pairs of the queries at positions ``[start, start + length)`` of a document, one layer of ``kind``.

    ``FULL``: query p sees keys ``0..p`` (``workload``); ``WINDOW`` of ``size`` W: ``min(p + 1, W)`` keys;
    ``CHUNK`` of ``size`` K: ``p mod K + 1`` keys (its chunk up to itself). Closed forms; integers only.
    """
    if kind == FULL:
        return workload(start, length)
    if kind == WINDOW:
        ramp = max(0, min(start + length, size) - start)  # queries p < W still see every key before them
        return workload(start, ramp) + (length - ramp) * size
    return _chunk_prefix_pairs(start + length, size) - _chunk_prefix_pairs(start, size)


@njit(cache=True)
def key_start(kind, size, start):
    """The first key of its document that a shard starting at ``start`` needs under ``kind``.

    ``FULL``: 0; ``WINDOW`` W: ``max(0, start - W + 1)``; ``CHUNK`` K: ``K * floor(start / K)``. Its later
    queries need no key before that either (the bound only grows with the position), so the shard's keys
    are ``[key_start, end)``.
    """
    if kind == FULL:
        return 0
    if kind == WINDOW:
        return max(0, start - size + 1)
    return size * (start // size)


@njit(cache=True)
def kind_workloads(kind, size, start, length):
    """``kind_workload`` of every shard: ``start``, ``length`` (n,) int64; returns (n,) int64."""
    out = np.empty(start.shape[0], np.int64)
    for i in range(start.shape[0]):
        out[i] = kind_workload(kind, size, start[i], length[i])
    return out


@njit(cache=True)
def key_starts(kind, size, start):
    """``key_start`` of every shard: ``start`` (n,) int64; returns (n,) int64."""
    out = np.empty(start.shape[0], np.int64)
    for i in range(start.shape[0]):
        out[i] = key_start(kind, size, start[i])
    return out


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
def rank_workloads_kernel(shard_start, shard_len, shard_rank, cp):
    """``rank_workloads`` on int64 arrays, callable from other kernels (no checks, no casts)."""
    out = np.zeros(cp, dtype=np.int64)
    for i in range(shard_rank.shape[0]):
        out[shard_rank[i]] += workload(shard_start[i], shard_len[i])
    return out


def as_int64(*arrays):
    """Each array as a C-contiguous int64 array (a view where it already is one)."""
    return tuple(np.ascontiguousarray(a, dtype=np.int64) for a in arrays)


def rank_tokens(shard_len, shard_rank, cp: int) -> np.ndarray:
    """Tokens held by each rank. Shape (cp,), int64."""
    shard_len, shard_rank = as_int64(shard_len, shard_rank)
    return _rank_sums(shard_len, shard_rank, cp)


def rank_workloads(shard_start, shard_len, shard_rank, cp: int) -> np.ndarray:
    """Attention workload (query-key pairs) of each rank. Shape (cp,), int64."""
    shard_start, shard_len, shard_rank = as_int64(shard_start, shard_len, shard_rank)
    return rank_workloads_kernel(shard_start, shard_len, shard_rank, cp)


def imbalance_ratio(workloads) -> float:
    """``max / mean`` of per-rank workloads (1-D, whole numbers); 1.0 for an all-zero vector (``imbalance_of``)."""
    (workloads,) = as_int64(workloads)
    if workloads.ndim != 1 or workloads.size == 0:
        raise ValueError(f"imbalance_ratio needs one workload per rank (a non-empty 1-D array), got shape "
                         f"{workloads.shape}")
    return float(imbalance_of(workloads))


@njit(cache=True)
def token_quotas_kernel(context_len, cp):
    """``token_quotas`` inside a kernel: rank r holds ``context_len // cp`` tokens, one more for r < the remainder."""
    quotas = np.empty(cp, np.int64)
    for r in range(cp):
        quotas[r] = context_len // cp + (1 if r < context_len % cp else 0)
    return quotas


@njit(cache=True)
def max_over_mean(max_work, total_work, cp):
    """``max / mean`` as float64, the one way kernels and references compute it (1.0 when all is zero)."""
    if total_work == 0:
        return 1.0
    return float(max_work) / (float(total_work) / float(cp))


@njit(cache=True)
def imbalance_of(work):
    """The imbalance ratio ``max_rank W / mean_rank W`` of per-rank workloads ``work`` (cp,) (``max_over_mean``)."""
    return max_over_mean(work.max(), work.sum(), work.shape[0])


@njit(cache=True)
def offsets_of(lens):
    """Document start offsets: ``[0, cumsum(lens)]`` as int64 (len(lens) + 1 values)."""
    offsets = np.zeros(lens.shape[0] + 1, np.int64)
    for i in range(lens.shape[0]):
        offsets[i + 1] = offsets[i] + lens[i]
    return offsets


@njit(cache=True)
def slack_tokens(share, context_len, cp):
    """Tokens a rank may be off its quota under token slack ``share``: ``floor(share * C / N)``."""
    return np.int64(np.floor(share * context_len / cp))
