"""``--effort ilp``: polish heuristic plans with CP-SAT, warm-started from them, under a time limit.

Each sequence's ``flashcp2`` plan is handed to ``ilp.solve_sequence`` as the warm start, with the plan's own
cuts added to the block grid (so the plan itself is a solution), exact quotas, and every rank's workload
capped at the plan's own maximum (the audit's ``--match-imbalance``): CP-SAT then only lowers the
communication (the compacted all-gather critical path, its model's measure). The ILP plan replaces the
heuristic one only when it is strictly faster under the step-time objective, so polishing never makes a
sequence slower and never raises its imbalance.
"""

from __future__ import annotations

import numpy as np

from flashcp.costmodel.objective import step_seconds
from flashcp.costmodel.workload import rank_workloads
from flashcp.planner.plan import SequencePlan

__all__ = ["DEFAULT_ILP_SECONDS", "parse_effort", "polish_plan", "polish_rows"]

DEFAULT_ILP_SECONDS = 10.0
"""CP-SAT seconds per sequence for ``--effort ilp``."""


def parse_effort(value) -> tuple[int, float | None]:
    """``effort`` parameter -> (kernel effort, CP-SAT seconds per sequence or None).

    An integer is the local-search budget; ``"ilp"`` (or ``"ilp:SECONDS"``) is effort 1 then CP-SAT.
    """
    if isinstance(value, bool):
        raise ValueError(f"effort must be a non-negative integer or 'ilp[:SECONDS]', got {value}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"effort must be a non-negative integer or 'ilp[:SECONDS]', got {value}")
        return value, None
    text = str(value)
    if text.isdigit():
        return int(text), None
    head, _, seconds = text.partition(":")
    try:
        limit = float(seconds) if seconds else DEFAULT_ILP_SECONDS
    except ValueError:
        limit = -1.0
    if head != "ilp" or not limit > 0:
        raise ValueError(f"effort must be a non-negative integer or 'ilp[:SECONDS]', got {value}")
    return 1, limit


def polish_plan(doc_lens, plan: SequencePlan, model: np.ndarray, seconds: float, seed: int = 0) -> SequencePlan:
    """The faster of ``plan`` and CP-SAT's plan warm-started from it (see the module docstring)."""
    from flashcp.planner.ilp.model import IlpOptions, solve_sequence

    cap = int(rank_workloads(plan.shard_start, plan.shard_len, plan.shard_rank, plan.cp).max())
    options = IlpOptions(granularity=1024, hint_cuts=True, time_limit_s=seconds, num_workers=1, seed=seed)
    result = solve_sequence(doc_lens, plan.cp, options, hint=plan, quota_slack=0, workload_cap=cap)
    if result.plan is None or result.quota_slack != 0:
        return plan
    new = result.plan.sorted()

    def seconds_of(p: SequencePlan) -> float:
        return float(step_seconds(p.shard_doc, p.shard_start, p.shard_len, p.shard_rank, p.cp, model))

    return new if seconds_of(new) < seconds_of(plan) else plan


def polish_rows(row_offsets, doc_lens, cp, model, seconds, offsets, doc, start, length, rank):
    """``--effort ilp``: every row's plan of flat arrays polished (``polish_plan``); the same flat arrays back."""
    parts = []
    for i in range(row_offsets.size - 1):
        lo, hi = offsets[i], offsets[i + 1]
        plan = SequencePlan(shard_doc=doc[lo:hi], shard_start=start[lo:hi], shard_len=length[lo:hi],
                            shard_rank=rank[lo:hi], cp=cp)
        parts.append(polish_plan(doc_lens[row_offsets[i]:row_offsets[i + 1]], plan, model, seconds))
    new_offsets = np.zeros(len(parts) + 1, np.int64)
    new_offsets[1:] = np.cumsum([p.num_shards for p in parts])
    flat = [np.ascontiguousarray(np.concatenate([getattr(p, name) for p in parts]), dtype=np.int64)
            for name in ("shard_doc", "shard_start", "shard_len", "shard_rank")]
    return (new_offsets, *flat)
