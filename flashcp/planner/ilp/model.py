"""Exact sharding of one packed sequence with OR-Tools CP-SAT, at a block granularity (paper section 3.4).

The model (``flashcp audit --ilp``):

- Every document is cut into blocks of ``granularity`` tokens (the last block of a document may be shorter; a
  document shorter than the granularity is one block); with ``hint_cuts`` also at the warm-start plan's
  shard boundaries. Boolean ``x[b, r]``: block ``b`` is on rank ``r``; each
  block is on exactly one rank.
- Each rank holds exactly its equal-token quota (``cost.token_quotas``), or, with ``quota_slack > 0``, within
  ``quota_slack`` tokens of it (the audit relaxes to one block when the granularity makes the exact quotas
  impossible; such a plan is not a valid flashcp plan).
- A block's workload is fixed by its position: ``cost.workload(start, length)``; workloads add up over
  consecutive blocks, so a rank's workload is the sum over its blocks.
- All-gather comm (docs/DESIGN.md section 2): a shard is contributed when it is not the last shard of its document
  and the document spans several ranks. In block terms a block is contributed ("sent") iff a later block of
  its document is on another rank. Linearised as clauses, for consecutive blocks ``b, b+1`` of one document:
  ``x[b,r] and not x[b+1,r] -> sent[b]``, ``sent[b+1] -> sent[b]``, and ``x[b,r] and sent[b] -> z[b,r]``;
  rank ``r`` contributes ``sum_b len[b] * z[b,r]``. Minimisation keeps ``sent``/``z`` at their true values on
  the critical rank; the extracted plan's metrics are always recomputed with ``cost.plan_metrics``.
- Objective, normalised so that each term reads as a familiar ratio (N ranks, C tokens, W total workload):

      imbalance + comm_weight * comm_ratio,   imbalance = max_W / (W / N),   comm_ratio = max_comm / (C / N)

  i.e. imbalance ratio plus ``comm_weight`` times (1 - comm saving). CP-SAT gets the integer form
  ``C * max_W + round(comm_weight * W) * max_comm`` (the same objective times ``W * C / N``; the weight is
  exact to ``1 / W``). ``lexicographic`` instead minimises ``max_W`` first, then ``max_comm`` with ``max_W``
  held at the value found. With a ``workload_cap`` (the audit's ``--match-imbalance``) every rank's workload
  is capped and only ``comm_ratio`` is minimised; when the warm start exceeds the cap, a first stage
  minimises ``max_W`` until it is within the cap, because CP-SAT rarely finds a capped plan unguided.
- Ranks with equal quotas are interchangeable; the model orders them by the first block they hold, which
  removes the ``N!`` relabellings of every plan without cutting off any plan's metrics.

Reported objective and bound are normalised as above; the gap is ``(objective - bound) / max(1, objective)``:
relative for the weighted objective (which is at least 1), percentage points of comm saving for comm-only
stages, CP-SAT's own convention.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import numpy as np
from ortools.sat.python import cp_model

from flashcp.costmodel.comm import PlanMetrics
from flashcp.costmodel.workload import token_quotas
from flashcp.planner.ilp.blocks import (
    BlockGrid,
    block_grid,
    block_plan,
    rank_sums,
    repair_to_quotas,
    round_plan_to_blocks,
    sent_blocks,
)
from flashcp.planner.plan import SequencePlan

__all__ = [
    "IlpOptions",
    "IlpResult",
    "StageResult",
    "normalised_objective",
    "solve_sequence",
]

# CP-SAT needs every linear expression's extreme value to fit in 62 bits.
_MAX_ACTIVITY = 2**62


def normalised_objective(metrics: PlanMetrics, context_len: int, cp: int, comm_weight: float) -> float:
    """``imbalance + comm_weight * max_comm / (C / N)``: the weighted objective of a plan with ``metrics``."""
    return metrics.imbalance + comm_weight * metrics.ag_comm_tokens * cp / context_len


@dataclass(frozen=True, kw_only=True, slots=True)
class IlpOptions:
    """How to solve: granularity, objective and CP-SAT limits."""

    granularity: int = 1024
    """Block size in tokens."""
    comm_weight: float = 1.0
    """Weight of ``max_comm / (C / N)`` against ``max_W / mean_W`` in the weighted objective."""
    lexicographic: bool = False
    """Minimise max workload first, then max comm at that workload (two CP-SAT stages)."""
    time_limit_s: float = 60.0
    """Wall-clock limit for all CP-SAT stages of one sequence together."""
    num_workers: int = 0
    """CP-SAT search workers; 0 uses every core."""
    seed: int = 0
    """CP-SAT random seed."""
    break_symmetry: bool = True
    """Order interchangeable ranks by their first block."""
    hint_cuts: bool = False
    """Cut blocks at the warm-start plan's shard boundaries too: the plan is then on the grid exactly, so
    the warm start is the plan itself and the result is never worse than it."""

    def __post_init__(self):
        if self.granularity < 1:
            raise ValueError(f"granularity must be at least 1 token, got {self.granularity}")
        if not self.comm_weight >= 0:
            raise ValueError(f"comm_weight must be 0 or more, got {self.comm_weight}")
        if not self.time_limit_s > 0:
            raise ValueError(f"time_limit_s must be positive, got {self.time_limit_s}")
        if self.num_workers < 0:
            raise ValueError(f"num_workers must be 0 (every core) or more, got {self.num_workers}")


@dataclass(frozen=True, kw_only=True, slots=True)
class StageResult:
    """One CP-SAT solve."""

    name: str
    """``weighted``, ``balance``, ``comm`` (lexicographic second stage) or ``capped-comm``."""
    status: str
    """CP-SAT status name: OPTIMAL, FEASIBLE, INFEASIBLE, UNKNOWN or MODEL_INVALID."""
    objective: float | None
    """Normalised objective of the best solution (None without one)."""
    bound: float | None
    """Normalised proven lower bound (None when infeasible)."""
    wall_s: float
    """CP-SAT wall time."""


@dataclass(frozen=True, kw_only=True, slots=True)
class IlpResult:
    """The outcome of ``solve_sequence``."""

    status: str
    """OPTIMAL when every stage was proven optimal, FEASIBLE with a solution, else INFEASIBLE or UNKNOWN."""
    plan: SequencePlan | None
    """The solution as a plan (None without a solution)."""
    metrics: PlanMetrics | None
    """The plan's metrics, recomputed by ``cost.plan_metrics``."""
    objective: float | None
    """Normalised objective of the last stage (see the module docstring)."""
    bound: float | None
    """Normalised proven bound of the last stage."""
    gap: float | None
    """Largest stage gap ``(objective - bound) / max(1, objective)``; 0 when proven optimal."""
    wall_s: float
    """Wall time of model building and every stage."""
    quota_slack: int
    """0: exact equal-token quotas; otherwise ranks were allowed this many tokens off their quota."""
    exact_status: str | None
    """When the exact-quota model was given up for a relaxed one: its status (INFEASIBLE: the quotas are
    impossible at this granularity; UNKNOWN: no exact plan was found in time). None otherwise."""
    num_blocks: int
    """Blocks in the model."""
    hint_metrics: PlanMetrics | None = None
    """Metrics of the warm start (the hint rounded to blocks, repaired to the quotas) when it met them."""
    stages: tuple[StageResult, ...] = field(default=())
    """Every CP-SAT solve, in order."""

    @property
    def has_solution(self) -> bool:
        """Whether a plan was found."""
        return self.plan is not None


class _Model:
    """The CP-SAT model of one sequence and the helpers to hint and read it."""

    def __init__(self, grid: BlockGrid, cp: int, quotas: np.ndarray, quota_slack: int, break_symmetry: bool):
        self.grid, self.cp = grid, cp
        num_blocks = grid.num_blocks
        lengths, works = grid.length.tolist(), grid.workloads.tolist()
        self.total_work = int(sum(works))
        self.context_len = int(grid.length.sum())
        m = self.model = cp_model.CpModel()
        self.x = [[m.new_bool_var(f"x_{b}_{r}") for r in range(cp)] for b in range(num_blocks)]
        for b in range(num_blocks):
            m.add_exactly_one(self.x[b])
        for r in range(cp):
            tokens = cp_model.LinearExpr.weighted_sum([self.x[b][r] for b in range(num_blocks)], lengths)
            m.add_linear_constraint(tokens, int(quotas[r]) - quota_slack, int(quotas[r]) + quota_slack)

        lower_w = max(-(-self.total_work // cp), max(works))
        self.max_work = m.new_int_var(0, self.total_work, "max_work")
        m.add(self.max_work >= lower_w)
        for r in range(cp):
            m.add(cp_model.LinearExpr.weighted_sum([self.x[b][r] for b in range(num_blocks)], works)
                  <= self.max_work)

        # sent[b]: block b is contributed to the all-gather; z[b][r]: ... by rank r.
        has_next = grid.has_next
        self.sent: dict[int, cp_model.IntVar] = {
            b: m.new_bool_var(f"sent_{b}") for b in np.flatnonzero(has_next).tolist()}
        self.z: dict[int, list] = {}
        for b, sent in self.sent.items():
            nxt = self.sent.get(b + 1)
            if nxt is not None:
                m.add_implication(nxt, sent)
            self.z[b] = [m.new_bool_var(f"z_{b}_{r}") for r in range(cp)]
            for r in range(cp):
                m.add_bool_or([~self.x[b][r], self.x[b + 1][r], sent])
                m.add_bool_or([~self.x[b][r], ~sent, self.z[b][r]])
                m.add_implication(self.z[b][r], self.x[b][r])
                m.add_implication(self.z[b][r], sent)
            m.add(sum(self.z[b]) == sent)  # with the clauses: z[b][r] == x[b][r] and sent[b]
        self.max_comm = m.new_int_var(0, self.context_len, "max_comm")
        sendable = list(self.z)
        for r in range(cp):
            m.add(cp_model.LinearExpr.weighted_sum([self.z[b][r] for b in sendable],
                                                   [lengths[b] for b in sendable]) <= self.max_comm)
        # Redundant cuts that tie comm to balance (they tighten CP-SAT's bound): the blocks of a document
        # that are not sent form its last shard, on one rank, so their tokens fit a quota and their
        # workload is at most max_work; and the largest contribution is at least the mean one.
        sent_tokens = cp_model.LinearExpr.weighted_sum([self.sent[b] for b in sendable],
                                                       [lengths[b] for b in sendable])
        m.add(cp * self.max_comm >= sent_tokens)
        max_quota = int(quotas.max()) + quota_slack
        for d in range(grid.doc_offsets.size - 1):
            first, end = int(grid.doc_offsets[d]), int(grid.doc_offsets[d + 1])
            if end - first < 2:
                continue
            doc_sent = [self.sent[b] for b in range(first, end - 1)]
            sent_work = cp_model.LinearExpr.weighted_sum(doc_sent, works[first:end - 1])
            m.add(sum(works[first:end]) - sent_work <= self.max_work)
            sent_tokens = cp_model.LinearExpr.weighted_sum(doc_sent, lengths[first:end - 1])
            m.add(sum(lengths[first:end]) - sent_tokens <= max_quota)

        # Interchangeable ranks (equal quotas) appear in rank order: rank r's first block comes after rank
        # r-1's. seen[b][r]: rank r holds one of blocks 0..b.
        self.seen: dict[int, list] = {}
        self.symmetric_pairs = [r for r in range(1, cp) if break_symmetry and quotas[r] == quotas[r - 1]]
        for r in self.symmetric_pairs:
            prev = r - 1
            seen = self.seen.setdefault(prev, [m.new_bool_var(f"seen_{b}_{prev}") for b in range(num_blocks)])
            m.add(seen[0] == self.x[0][prev])
            for b in range(1, num_blocks):
                m.add_bool_or([~seen[b], seen[b - 1], self.x[b][prev]])
                m.add_implication(seen[b - 1], seen[b])
                m.add_implication(self.x[b][prev], seen[b])
            m.add(self.x[0][r] == 0)
            for b in range(1, num_blocks):
                m.add_implication(self.x[b][r], seen[b - 1])

    def canonical_ranks(self, block_rank: np.ndarray) -> np.ndarray:
        """Relabel interchangeable ranks of an assignment so that it meets the symmetry-breaking order."""
        block_rank = block_rank.copy()
        pairs = set(self.symmetric_pairs)
        group_start = 0
        for r in range(1, self.cp + 1):
            if r in pairs:
                continue
            group = list(range(group_start, r))  # ranks group_start..r-1 are interchangeable
            if len(group) > 1:
                first_seen = {g: np.flatnonzero(block_rank == g) for g in group}
                order = sorted(group, key=lambda g: first_seen[g][0] if first_seen[g].size else np.inf)
                relabel = np.arange(self.cp)
                relabel[order] = group
                block_rank = relabel[block_rank]
            group_start = r
        return block_rank

    def add_hint(self, block_rank: np.ndarray) -> None:
        """Hint a complete assignment derived from ``block_rank`` (shape (num_blocks,))."""
        m, grid, cp = self.model, self.grid, self.cp
        m.clear_hints()
        block_rank = self.canonical_ranks(block_rank)
        for b, rank in enumerate(block_rank.tolist()):
            for r in range(cp):
                m.add_hint(self.x[b][r], rank == r)
        sent = sent_blocks(grid, block_rank)
        for b, var in self.sent.items():
            m.add_hint(var, bool(sent[b]))
            for r in range(cp):
                m.add_hint(self.z[b][r], bool(sent[b]) and block_rank[b] == r)
        for prev, seen in self.seen.items():
            for b, value in enumerate(np.maximum.accumulate(block_rank == prev).tolist()):
                m.add_hint(seen[b], value)
        m.add_hint(self.max_work, int(rank_sums(grid.workloads, block_rank, cp).max()))
        m.add_hint(self.max_comm, int(rank_sums(grid.length[sent], block_rank[sent], cp).max()))

    def block_ranks(self, solver: cp_model.CpSolver) -> np.ndarray:
        """The solver's assignment: rank of each block, shape (num_blocks,)."""
        return np.array([next(r for r in range(self.cp) if solver.boolean_value(xb[r])) for xb in self.x],
                        dtype=np.int64)


class _StopAtWorkload(cp_model.CpSolverSolutionCallback):
    """Stops the search at the first solution whose largest rank workload is at most ``cap``."""

    def __init__(self, max_work: cp_model.IntVar, cap: int):
        super().__init__()
        self.max_work, self.cap = max_work, cap

    def on_solution_callback(self) -> None:
        if self.value(self.max_work) <= self.cap:
            self.stop_search()


def _solve_stage(model: _Model, name: str, objective, scale: float, deadline: float, options: IlpOptions,
                 callback: cp_model.CpSolverSolutionCallback | None = None
                 ) -> tuple[StageResult, cp_model.CpSolver, cp_model.CpSolverStatus]:
    model.model.minimize(objective)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(0.01, deadline - time.perf_counter())
    solver.parameters.num_workers = options.num_workers or os.cpu_count() or 1
    solver.parameters.random_seed = options.seed
    status = solver.solve(model.model, callback)
    has_solution = status in (cp_model.OPTIMAL, cp_model.FEASIBLE)
    infeasible = status == cp_model.INFEASIBLE
    result = StageResult(name=name, status=solver.status_name(status),
                         objective=solver.objective_value * scale if has_solution else None,
                         bound=None if infeasible else max(0.0, solver.best_objective_bound * scale),
                         wall_s=solver.wall_time)
    return result, solver, status


@dataclass(frozen=True, kw_only=True, slots=True)
class _Attempt:
    stages: tuple[StageResult, ...]
    block_rank: np.ndarray | None  # the best assignment of the last stage that found one
    solved: bool  # every stage found a solution
    hint_metrics: PlanMetrics | None
    no_plan_at_all: bool = False  # the first stage found no solution: the quotas themselves failed


def _attempt(grid: BlockGrid, quotas: np.ndarray, cp: int, options: IlpOptions, quota_slack: int,
             workload_cap: int | None, hint_rank: np.ndarray | None, deadline: float) -> _Attempt:
    """Build the model for one quota setting and run its stages until ``deadline``.

    Stages: ``weighted``; or ``balance`` then ``comm`` (lexicographic, half the time each at most); or, with a
    workload cap, ``reach-cap`` (minimise the largest workload until it is within the cap; skipped when the
    warm start already is) then ``capped-comm``. A stage that finds no solution ends the attempt.
    """
    model = _Model(grid, cp, quotas, quota_slack, options.break_symmetry)
    total_work, context_len = model.total_work, model.context_len
    work_scale, comm_scale = cp / total_work, cp / context_len
    hint_metrics, hint_max_work = None, None
    if hint_rank is not None:
        model.add_hint(hint_rank)
        hint_max_work = int(rank_sums(grid.workloads, hint_rank, cp).max())
        if ((np.abs(rank_sums(grid.length, hint_rank, cp) - quotas) <= quota_slack).all()
                and (workload_cap is None or hint_max_work <= workload_cap)):
            hint_metrics = block_plan(grid, hint_rank, cp).metrics()

    if workload_cap is None and not options.lexicographic:
        comm_coeff = round(options.comm_weight * total_work)
        if context_len * total_work + comm_coeff * context_len >= _MAX_ACTIVITY:
            raise ValueError(f"the weighted objective of a {context_len}-token sequence overflows CP-SAT's "
                             "integers; use the lexicographic objective")
        stage, solver, status = _solve_stage(
            model, "weighted", context_len * model.max_work + comm_coeff * model.max_comm,
            cp / (total_work * context_len), deadline, options)
        block_rank = model.block_ranks(solver) if stage.objective is not None else None
        return _Attempt(stages=(stage,), block_rank=block_rank, solved=block_rank is not None,
                        hint_metrics=hint_metrics, no_plan_at_all=block_rank is None)

    stages: list[StageResult] = []
    block_rank = None
    if workload_cap is None or hint_max_work is None or hint_max_work > workload_cap:
        name = "balance" if workload_cap is None else "reach-cap"
        callback = None if workload_cap is None else _StopAtWorkload(model.max_work, workload_cap)
        half = time.perf_counter() + (deadline - time.perf_counter()) / 2
        stage, solver, status = _solve_stage(model, name, model.max_work, work_scale, half, options, callback)
        stages.append(stage)
        if stage.objective is None:
            return _Attempt(stages=tuple(stages), block_rank=None, solved=False, hint_metrics=hint_metrics,
                            no_plan_at_all=True)
        block_rank = model.block_ranks(solver)
        reached = int(rank_sums(grid.workloads, block_rank, cp).max())
        if workload_cap is not None and reached > workload_cap:
            # OPTIMAL here proves the cap unreachable; otherwise it was not reached in time
            final = "INFEASIBLE" if status == cp_model.OPTIMAL else "UNKNOWN"
            stages.append(StageResult(name="capped-comm", status=final, objective=None, bound=None,
                                      wall_s=0.0))
            return _Attempt(stages=tuple(stages), block_rank=None, solved=False, hint_metrics=hint_metrics)
        model.add_hint(block_rank)
        workload_cap = reached if workload_cap is None else workload_cap
    model.model.add(model.max_work <= int(workload_cap))
    name = "comm" if stages and stages[0].name == "balance" else "capped-comm"
    stage, solver, status = _solve_stage(model, name, model.max_comm, comm_scale, deadline, options)
    stages.append(stage)
    if stage.objective is None and len(stages) == 1:  # capped-comm from the warm start found nothing
        return _Attempt(stages=tuple(stages), block_rank=None, solved=False, hint_metrics=hint_metrics,
                        no_plan_at_all=True)
    if stage.objective is not None:
        block_rank = model.block_ranks(solver)
    elif stages[0].name == "reach-cap":
        block_rank = None  # the reach-cap solution is not a comm-minimised answer
    return _Attempt(stages=tuple(stages), block_rank=block_rank, solved=stage.objective is not None,
                    hint_metrics=hint_metrics)


def solve_sequence(doc_lens, cp: int, options: IlpOptions, *, hint: SequencePlan | None = None,
                   quota_slack: int | None = None, workload_cap: int | None = None) -> IlpResult:
    """Solve the sharding of one sequence (``doc_lens``: (num_docs,)) over ``cp`` ranks with CP-SAT.

    ``hint``: a plan to warm-start from; it is rounded to blocks (``round_plan_to_blocks``) and, for exact
    quotas, repaired to meet them (``repair_to_quotas``).
    ``quota_slack``: tokens a rank may be off its quota. 0: exact quotas only. None (default): exact quotas,
    falling back to within one block (the longest block's length) when the exact model yields no plan at
    all: proven impossible, or none found in the first half of the time limit when the warm start could not
    be repaired to meet the quotas (``IlpResult.exact_status`` then says which).
    ``workload_cap``: largest workload any rank may take; when given, only comm is minimised (after a stage
    that brings the largest workload within the cap, unless the warm start already is).
    The model and the objective are described in the module docstring.
    """
    began = time.perf_counter()
    deadline = began + options.time_limit_s
    doc_lens = np.asarray(doc_lens, dtype=np.int64)
    if cp < 1:
        raise ValueError(f"cp must be at least 1, got {cp}")
    if quota_slack is not None and quota_slack < 0:
        raise ValueError(f"quota_slack must be 0 or more, got {quota_slack}")
    if hint is not None and hint.cp != cp:
        raise ValueError(f"the hint plan is for {hint.cp} ranks, not {cp}")
    grid = block_grid(doc_lens, options.granularity, hint if options.hint_cuts else None)
    quotas = token_quotas(int(doc_lens.sum()), cp)
    hint_rank = exact_hint = None
    if hint is not None:
        hint_rank = round_plan_to_blocks(hint, grid)
        exact_hint = hint_rank
        if (rank_sums(grid.length, hint_rank, cp) != quotas).any():
            exact_hint = repair_to_quotas(grid, hint_rank, quotas)

    exact_status = None
    if quota_slack is None:
        exact_deadline = deadline if exact_hint is not None else began + options.time_limit_s / 2
        attempt = _attempt(grid, quotas, cp, options, 0, workload_cap, _or(exact_hint, hint_rank),
                           exact_deadline)
        if attempt.no_plan_at_all:
            exact_status = attempt.stages[-1].status
            quota_slack = int(grid.length.max())
            attempt = _attempt(grid, quotas, cp, options, quota_slack, workload_cap, hint_rank, deadline)
        else:
            quota_slack = 0
    else:
        attempt = _attempt(grid, quotas, cp, options, quota_slack, workload_cap,
                           _or(exact_hint, hint_rank) if quota_slack == 0 else hint_rank, deadline)

    stages = attempt.stages
    counted = [s for s in stages if s.name != "reach-cap"]  # finding a plan within the cap is a means only
    plan = metrics = None
    if attempt.block_rank is None:
        status = stages[-1].status
    else:
        status = "OPTIMAL" if attempt.solved and all(s.status == "OPTIMAL" for s in counted) else "FEASIBLE"
        plan = block_plan(grid, attempt.block_rank, cp)
        metrics = plan.metrics()
    gaps = [(s.objective - s.bound) / max(1.0, s.objective) for s in counted
            if s.objective is not None and s.bound is not None]
    return IlpResult(status=status, plan=plan, metrics=metrics,
                     objective=stages[-1].objective if attempt.solved else None, bound=stages[-1].bound,
                     gap=max(0.0, *gaps) if gaps and plan is not None else None,
                     wall_s=time.perf_counter() - began, quota_slack=quota_slack, exact_status=exact_status,
                     num_blocks=grid.num_blocks, hint_metrics=attempt.hint_metrics, stages=stages)


def _or(value, default):
    return default if value is None else value
