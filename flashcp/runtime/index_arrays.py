"""Index arithmetic on host arrays that the per-rank metas are built from (numpy, int64)."""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["as_int32", "as_long", "cumsum0", "ranges", "within_rank_offsets"]


def ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenated ``arange(start, start + length)`` for each pair. int64."""
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    offsets = np.cumsum(lengths) - lengths
    return np.repeat(starts - offsets, lengths) + np.arange(total, dtype=np.int64)


def cumsum0(values: np.ndarray) -> np.ndarray:
    """``[0, v0, v0 + v1, ...]``: the running sum of ``values`` with a leading zero. int64."""
    return np.concatenate([np.zeros(1, np.int64), np.cumsum(values, dtype=np.int64)])


def within_rank_offsets(lengths: np.ndarray, shard_rank: np.ndarray) -> np.ndarray:
    """For each shard, the sum of ``lengths`` of earlier shards (row order) of the same rank."""
    order = np.argsort(shard_rank, kind="stable")
    sorted_len = lengths[order]
    cum = np.cumsum(sorted_len) - sorted_len
    group_first = np.r_[True, shard_rank[order][1:] != shard_rank[order][:-1]]
    cum -= np.maximum.accumulate(np.where(group_first, cum, 0))
    out = np.empty_like(cum)
    out[order] = cum
    return out


def as_long(a: np.ndarray) -> torch.Tensor:
    """``a`` as a contiguous int64 tensor (sharing memory when it can)."""
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))


def as_int32(a: np.ndarray) -> torch.Tensor:
    """``a`` as a contiguous int32 tensor (what the kernels take for ``cu_seqlens``)."""
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32))
