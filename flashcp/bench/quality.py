"""Scenario 1, plan quality: every strategy on every source and CP size, with the cost model's metrics.

Per (source, cp, strategy), over the same packed sequences, the planner's own summary
(``flashcp.planner.pipeline.summarize``, what ``plan.json`` stores): imbalance ratio (mean, p50, max), the
all-gather comm saving against a full-KV all-gather (paper Eq. 5, ``cost.comm_saving``) and the exact-need
saving against what a rank receives in that all-gather (``cost.exact_need_saving``); plus shards per
sequence and mean shard length (tokens per shard; short shards make slow kernels).
"""

from __future__ import annotations

import numpy as np

from flashcp.bench.systems import PlanBook

__all__ = ["plan_quality"]


def plan_quality(book: PlanBook, sources, strategies: list[str], cps: list[int], context_len: int,
                 num_seqs: int) -> dict:
    """Rows of plan metrics, one per (source, cp, strategy); see the module docstring."""
    from flashcp.planner.pipeline import summarize

    rows = []
    for source in sources:
        c = source.dataset_context_len or context_len
        for cp in cps:
            for strategy in strategies:
                plans = book.plans(source, num_seqs, c, strategy, cp)
                metrics = [p.metrics() for p in plans]
                summary = summarize(np.array([m.imbalance for m in metrics]),
                                    np.array([m.ag_comm_tokens for m in metrics], dtype=np.int64),
                                    np.array([m.a2a_comm_tokens for m in metrics], dtype=np.int64), c, cp)
                shards = np.array([p.num_shards for p in plans])
                rows.append({"source": source.label, "context_len": c, "cp": cp, "strategy": strategy,
                             "num_seqs": len(plans), **summary, "shards_mean": float(shards.mean()),
                             "shard_len_mean": float(c * len(plans) / shards.sum())})
    return {"rows": rows}
