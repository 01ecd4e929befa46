"""Scenario 1, plan quality: every strategy on every source and CP size, with the cost model's metrics.

Per (source, cp, strategy), over the same packed sequences: imbalance ratio (mean, p50, max), comm saving
against the full-KV all-gather for the compacted all-gather (paper Eq. 5) and for exact-need exchange
(``cost.comm_saving``: critical path against ``C / N``; exact need can go below zero there, because a rank
receives what it needs from every other rank), the exact-need receive against what a full-KV all-gather
delivers to a rank (``(N-1) * C / N``), shards per sequence and mean shard length (tokens per shard; short
shards make slow kernels). All metrics come from ``SequencePlan.metrics`` (``flashcp.planner.cost``).
"""

from __future__ import annotations

import numpy as np

from flashcp.bench.systems import PlanBook
from flashcp.planner.cost import comm_saving

__all__ = ["plan_quality"]


def plan_quality(book: PlanBook, sources, strategies: list[str], cps: list[int], context_len: int,
                 num_seqs: int) -> dict:
    """Rows of plan metrics, one per (source, cp, strategy); see the module docstring."""
    rows = []
    for source in sources:
        c = source.dataset_context_len or context_len
        for cp in cps:
            for strategy in strategies:
                plans = book.plans(source, num_seqs, c, strategy, cp)
                metrics = [p.metrics() for p in plans]
                imbalance = np.array([m.imbalance for m in metrics])
                shards = np.array([p.num_shards for p in plans])
                rows.append({
                    "source": source.label, "context_len": c, "cp": cp, "strategy": strategy,
                    "num_seqs": len(plans),
                    "imbalance_mean": float(imbalance.mean()), "imbalance_p50": float(np.median(imbalance)),
                    "imbalance_max": float(imbalance.max()),
                    "allgather_saving_mean": float(np.mean([comm_saving(m.ag_comm_tokens, c, cp)
                                                            for m in metrics])),
                    "exact_need_saving_mean": float(np.mean([comm_saving(m.a2a_comm_tokens, c, cp)
                                                             for m in metrics])),
                    # what a rank receives, against the (N-1) * C / N tokens a full-KV all-gather delivers
                    "exact_need_recv_saving_mean": float(np.mean([
                        1.0 - m.a2a_comm_tokens / ((cp - 1) * c / cp) if cp > 1 else 0.0 for m in metrics])),
                    "shards_mean": float(shards.mean()),
                    "shard_len_mean": float(c * len(plans) / shards.sum()),
                })
    return {"rows": rows}
