"""The Ring-Attn layout: the packed sequence cut into ``N`` contiguous chunks, chunk ``i`` on rank ``i``.

This is the original Ring-Attn sharding (no balancing): chunk sizes are the equal-token quotas
(``cost.token_quotas``), and a chunk is cut into shards at document boundaries. Ring-Attn (zigzag) uses the
``perdoc`` assignment instead; both run with the ``ring`` comm mode of ``cp_attention``.
"""

from __future__ import annotations

import numpy as np

from flashcp.planner.cost import token_quotas
from flashcp.planner.plan import SequencePlan

__all__ = ["ring_plan"]


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
    context_len = int(doc_lens.sum())
    quotas = token_quotas(context_len, cp)
    doc_bounds = np.cumsum(doc_lens) - doc_lens
    rank_bounds = np.cumsum(quotas) - quotas
    cuts = np.union1d(doc_bounds, rank_bounds[quotas > 0])
    lengths = np.diff(np.r_[cuts, context_len])
    doc = np.searchsorted(doc_bounds, cuts, side="right") - 1
    # ranks with an empty quota share a bound with the next one; side="right" picks the non-empty one
    rank = np.searchsorted(rank_bounds, cuts, side="right") - 1
    return SequencePlan.from_arrays(doc, cuts - doc_bounds[doc], lengths, rank, cp)
