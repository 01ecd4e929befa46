"""The Ring-Attn layout: the packed sequence cut into ``N`` contiguous chunks, chunk ``i`` on rank ``i``.

This is the original Ring-Attn sharding (no balancing): chunk sizes are the equal-token quotas
(``cost.token_quotas``), and a chunk is cut into shards at document boundaries
(the ``ring`` strategy of the registry). Ring-Attn (zigzag) uses the
``perdoc`` assignment instead; both run with the ``ring`` comm mode of ``cp_attention``.
"""

from __future__ import annotations

import numpy as np

from flashcp.planner._kernels import ring_kernel
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
    if cp < 1:
        raise ValueError(f"cp must be at least 1, got {cp}")
    # the kernel directly, not plan_sequence: the runtime tests use cp > C (ranks with no tokens) too
    return SequencePlan.from_arrays(*ring_kernel(np.ascontiguousarray(doc_lens), cp), cp=cp)
