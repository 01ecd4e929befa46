"""The exact-need receive of one packed sequence, minimised with OR-Tools CP-SAT at a block granularity.

``flashcp audit --ilp`` minimises the compacted all-gather's critical path (``flashcp.planner.ilp.model``); this
model minimises the other exchange's: the largest exact-need receive over ranks (docs/DESIGN.md section 2). It
measures how much room a heuristic leaves (``scripts/cpsat_room.py``). The model:

- Every document is cut into blocks of ``granularity`` tokens and at the warm-start plan's shard boundaries
  (``blocks.block_grid`` with the plan's cuts), so the warm start is a solution. Boolean ``x[b, r]``: block
  ``b`` is on rank ``r``; each block is on exactly one rank; every rank holds its equal-token quota, or with
  ``quota_slack`` within that many tokens of it (as the CP-SAT runs of issue 13: a window of 512 tokens lets
  the search move blocks freely; such a plan is not a valid flashcp plan, but restoring the quotas takes a
  few head moves of at most that many tokens).
- Every rank's workload is at most ``workload_cap`` (by default the warm start's own largest: the audit's
  ``--match-imbalance``), so the result is never less balanced than the warm start.
- Need: ``y[b, r]`` = rank ``r`` holds block ``b`` or a later block of its document (``y >= x`` and
  ``y[b] >= y[b + 1]``; minimisation keeps it at that value). Rank ``r`` receives
  ``sum_b len[b] * (y[b, r] - x[b, r])``: the prefix of every document up to its last token on ``r``,
  less what ``r`` holds itself, which is ``cost.exact_need_received``.
- Objective: the largest receive. The plan found is checked and its metrics recomputed by the cost model.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import numpy as np
from ortools.sat.python import cp_model

from flashcp.costmodel.comm import PlanMetrics
from flashcp.costmodel.workload import rank_workloads, token_quotas
from flashcp.planner.ilp.blocks import block_grid, block_plan, rank_sums, round_plan_to_blocks
from flashcp.planner.plan import SequencePlan

__all__ = ["ReceiveResult", "minimise_receive"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ReceiveResult:
    """The outcome of :func:`minimise_receive`."""

    status: str
    """CP-SAT status name: OPTIMAL or FEASIBLE (a plan was found), else INFEASIBLE or UNKNOWN."""
    plan: SequencePlan
    """The best plan found (the warm start when CP-SAT found none better)."""
    metrics: PlanMetrics
    """Its metrics, recomputed by ``cost.plan_metrics``."""
    bound: int
    """CP-SAT's proven lower bound on the largest receive, tokens (0 when it proved none)."""
    wall_s: float
    """Model building and solving."""
    num_blocks: int
    """Blocks in the model."""


def minimise_receive(doc_lens, hint: SequencePlan, *, granularity: int = 1024, time_limit_s: float = 60.0,
                     workload_cap: int | None = None, quota_slack: int = 0, num_workers: int = 0,
                     seed: int = 0) -> ReceiveResult:
    """The plan with the smallest largest exact-need receive CP-SAT finds within ``time_limit_s``.

    ``doc_lens`` (num_docs,): the sequence; ``hint``: a valid plan of it (exact quotas) to warm-start from;
    ``workload_cap``: largest workload a rank may take (default: the hint's own largest); ``quota_slack``:
    tokens a rank may be off its quota; ``num_workers``: CP-SAT workers (0: every core). See the module
    docstring for the model.
    """
    began = time.perf_counter()
    doc_lens = np.asarray(doc_lens, dtype=np.int64)
    cp = hint.cp
    grid = block_grid(doc_lens, granularity, hint)
    quotas = token_quotas(int(doc_lens.sum()), cp)
    hint_rank = round_plan_to_blocks(hint, grid)
    if (rank_sums(grid.length, hint_rank, cp) != quotas).any():
        raise ValueError("the warm-start plan does not give every rank its equal-token quota")
    if workload_cap is None:
        workload_cap = int(rank_workloads(hint.shard_start, hint.shard_len, hint.shard_rank, cp).max())
    num_blocks = grid.num_blocks
    lengths, works = grid.length.tolist(), grid.workloads.tolist()
    has_next = grid.has_next.tolist()

    m = cp_model.CpModel()
    x = [[m.new_bool_var(f"x_{b}_{r}") for r in range(cp)] for b in range(num_blocks)]
    for b in range(num_blocks):
        m.add_exactly_one(x[b])
    for r in range(cp):
        column = [x[b][r] for b in range(num_blocks)]
        m.add_linear_constraint(cp_model.LinearExpr.weighted_sum(column, lengths), int(quotas[r]) - quota_slack,
                                int(quotas[r]) + quota_slack)
        m.add(cp_model.LinearExpr.weighted_sum(column, works) <= workload_cap)
    # y[b][r] for blocks with a later block in their document (a document's last block needs y = x)
    y: dict[int, list] = {}
    for b in range(num_blocks - 1, -1, -1):
        if not has_next[b]:
            continue
        y[b] = [m.new_bool_var(f"y_{b}_{r}") for r in range(cp)]
        for r in range(cp):
            m.add_implication(x[b][r], y[b][r])
            later = y[b + 1][r] if b + 1 in y else x[b + 1][r]
            m.add_implication(later, y[b][r])
    max_received = m.new_int_var(0, int(doc_lens.sum()), "max_received")
    needed = sorted(y)
    for r in range(cp):
        received = cp_model.LinearExpr.weighted_sum([y[b][r] for b in needed], [lengths[b] for b in needed]) \
            - cp_model.LinearExpr.weighted_sum([x[b][r] for b in needed], [lengths[b] for b in needed])
        m.add(received <= max_received)

    # warm start: the hint, with its need variables
    for b, rank in enumerate(hint_rank.tolist()):
        for r in range(cp):
            m.add_hint(x[b][r], rank == r)
    need = _need(grid, hint_rank, cp)
    for b in needed:
        for r in range(cp):
            m.add_hint(y[b][r], bool(need[b, r]))
    m.add_hint(max_received, int(hint.metrics().a2a_comm_tokens))
    m.minimize(max_received)

    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(0.01, time_limit_s - (time.perf_counter() - began))
    solver.parameters.num_workers = num_workers or os.cpu_count() or 1
    solver.parameters.random_seed = seed
    # CP-SAT's own symmetry breaking fixes rank labels the warm start does not follow, and the hint is lost
    solver.parameters.symmetry_level = 0
    status = solver.solve(m)
    plan = hint.sorted()
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        block_rank = np.array([next(r for r in range(cp) if solver.boolean_value(xb[r])) for xb in x], np.int64)
        found = block_plan(grid, block_rank, cp)
        if quota_slack == 0:
            found.validate(doc_lens)
        if found.metrics().a2a_comm_tokens <= plan.metrics().a2a_comm_tokens:
            plan = found
    bound = 0 if status == cp_model.INFEASIBLE else max(0, int(np.ceil(solver.best_objective_bound - 1e-9)))
    return ReceiveResult(status=solver.status_name(status), plan=plan, metrics=plan.metrics(), bound=bound,
                         wall_s=time.perf_counter() - began, num_blocks=num_blocks)


def _need(grid, block_rank: np.ndarray, cp: int) -> np.ndarray:
    """``need[b, r]``: rank ``r`` holds block ``b`` or a later block of its document. Shape (blocks, cp)."""
    need = np.zeros((grid.num_blocks, cp), dtype=bool)
    has_next = grid.has_next
    for b in range(grid.num_blocks - 1, -1, -1):
        need[b, block_rank[b]] = True
        if has_next[b]:
            need[b] |= need[b + 1]
    return need
