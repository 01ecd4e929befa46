"""The ILP audit of a stored plan: sample sequences, solve each with CP-SAT, compare (paper Table 2), write.

``audit_plan`` samples sequences of a dataset, solves each with ``ilp.solve_sequence`` warm-started from the
stored (heuristic) plan, and returns one ``SequenceAudit`` per sample. ``summarize`` reduces them to the
paper's Table 2 numbers; ``write_audit_plan`` writes the ILP plans as a plan folder of their own.

Means over samples are taken over the sequences whose ILP plan is a valid flashcp plan (exact equal-token
quotas); the heuristic's means are over the same sequences, so the two columns compare like with like.
Sequences solved only with relaxed quotas, or not at all, are counted and listed, never averaged in.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from flashcp.costmodel.comm import PlanMetrics, comm_saving, exact_need_saving
from flashcp.costmodel.workload import rank_workloads
from flashcp.data.dataset import Dataset
from flashcp.errors import FlashcpError
from flashcp.planner.ilp.model import IlpOptions, IlpResult, solve_sequence
from flashcp.planner.plan import SequencePlan
from flashcp.planner.plan_reader import PlanStore
from flashcp.planner.plan_writer import PlanSlot, plan_table, write_plan_file, write_plan_json
from flashcp.planner.planning import summarize as summarize_plans

__all__ = ["SequenceAudit", "audit_plan", "sample_rows", "summarize", "write_audit_plan"]


@dataclass(frozen=True, kw_only=True, slots=True)
class SequenceAudit:
    """One sampled sequence: its heuristic plan's metrics and the ILP's result."""

    row: int
    """Row index over the whole dataset (data files in manifest order)."""
    num_docs: int
    """Documents in the sequence."""
    heuristic: PlanMetrics
    """Metrics of the stored plan (verified against its shards)."""
    result: IlpResult
    """The CP-SAT result."""

    @property
    def valid(self) -> bool:
        """Whether the ILP found a valid flashcp plan (exact equal-token quotas)."""
        return self.result.plan is not None and self.result.quota_slack == 0

    @property
    def ilp_plan(self) -> SequencePlan:
        """The ILP's plan of a ``valid`` audit."""
        assert self.result.plan is not None, "only a valid audit has an ILP plan"
        return self.result.plan

    @property
    def ilp_metrics(self) -> PlanMetrics:
        """The metrics of the ILP's plan of a ``valid`` audit."""
        assert self.result.metrics is not None, "only a valid audit has ILP metrics"
        return self.result.metrics

    def note(self, granularity: int) -> str:
        """One sentence about a sequence whose ILP plan is not a valid plan, else ''."""
        r = self.result
        if self.valid:
            return ""
        reason = {
            "INFEASIBLE": f"the equal-token quotas are impossible at granularity {granularity}",
            "UNKNOWN": "no plan meeting the exact quotas was found in the time limit",
        }
        if r.plan is not None:
            return (f"{reason.get(r.exact_status or '', 'the exact-quota model failed')}; solved with each rank "
                    f"within {r.quota_slack} tokens (one block) of its quota, which is not a valid plan")
        capped = any(s.name == "capped-comm" for s in r.stages)
        within = " within the heuristic's largest rank workload" if capped else ""
        if r.status == "INFEASIBLE":
            return f"no block plan exists at granularity {granularity}{within}"
        return f"CP-SAT found no plan{within} in the time limit (status {r.status})"

    def to_json(self, context_len: int, cp: int, granularity: int) -> dict:
        """The per-sequence record written by ``flashcp audit --json``."""
        r = self.result

        def metrics(m: PlanMetrics | None) -> dict | None:
            if m is None:
                return None
            return {"imbalance": m.imbalance, "ag_comm_tokens": m.ag_comm_tokens,
                    "a2a_comm_tokens": m.a2a_comm_tokens,
                    "comm_saving": comm_saving(m.ag_comm_tokens, context_len, cp),
                    "a2a_comm_saving": exact_need_saving(m.a2a_comm_tokens, context_len, cp)}

        return {
            "row": self.row, "num_docs": self.num_docs, "num_blocks": r.num_blocks,
            "status": r.status, "valid_plan": self.valid, "quota_slack": r.quota_slack,
            "exact_status": r.exact_status, "note": self.note(granularity),
            "objective": r.objective, "bound": r.bound, "gap": r.gap, "wall_s": r.wall_s,
            "ilp": metrics(r.metrics), "heuristic": metrics(self.heuristic),
            "warm_start": metrics(r.hint_metrics),
            "stages": [{"name": s.name, "status": s.status, "objective": s.objective, "bound": s.bound,
                        "wall_s": s.wall_s} for s in r.stages],
        }


def sample_rows(num_sequences: int, samples: int, seed: int) -> np.ndarray:
    """``min(samples, num_sequences)`` distinct row indices drawn with ``seed``, sorted. Shape (k,), int64."""
    if samples < 1:
        raise FlashcpError(f"--samples must be at least 1, got {samples}")
    rng = np.random.default_rng(seed)
    k = min(samples, num_sequences)
    return np.sort(rng.choice(num_sequences, size=k, replace=False)).astype(np.int64)


def _iter_sampled(dataset: Dataset, store: PlanStore, rows: np.ndarray
                  ) -> Iterator[tuple[int, np.ndarray, SequencePlan, PlanMetrics]]:
    """Yield ``(row, doc_lens, heuristic plan, its metrics)`` for the sampled rows, verifying each plan."""
    wanted = set(rows.tolist())
    base = 0
    for i, data_file in enumerate(dataset.files):
        if not any(base <= r < base + data_file.rows for r in wanted):
            base += data_file.rows
            continue
        offsets, lens = dataset.read_doc_lens(i)
        for j, stored in enumerate(store.iter_plans(i)):
            row = base + j
            if row in wanted:
                doc_lens = lens[offsets[j]:offsets[j + 1]]
                store.check_row(stored, doc_lens, i, j)
                yield row, doc_lens, stored.plan, stored.plan.metrics()
        base += data_file.rows


def audit_plan(dataset: Dataset, store: PlanStore, rows: np.ndarray, options: IlpOptions, *,
               match_imbalance: bool = False,
               on_done: Callable[[SequenceAudit], None] | None = None) -> list[SequenceAudit]:
    """Solve every sampled row with CP-SAT, warm-started from the stored plan.

    ``match_imbalance``: cap every rank's workload at the stored plan's largest and minimise comm only, so
    that the ILP is compared with the heuristic at (at most) the heuristic's imbalance.
    ``on_done`` is called after each sequence (for progress output).
    """
    audits = []
    for row, doc_lens, plan, metrics in _iter_sampled(dataset, store, rows):
        cap = None
        if match_imbalance:
            cap = int(rank_workloads(plan.shard_start, plan.shard_len, plan.shard_rank, plan.cp).max())
        result = solve_sequence(doc_lens, store.cp, options, hint=plan, workload_cap=cap)
        if result.plan is not None and result.quota_slack == 0:
            result.plan.validate(doc_lens)  # the same checks as a stored plan gets
        audit = SequenceAudit(row=row, num_docs=int(doc_lens.size), heuristic=metrics, result=result)
        audits.append(audit)
        if on_done is not None:
            on_done(audit)
    return audits


def summarize(audits: list[SequenceAudit], context_len: int, cp: int) -> dict:
    """The Table 2 numbers: means over the sequences with a valid ILP plan, plus solver statistics."""
    valid = [a for a in audits if a.valid]

    def mean(values) -> float | None:
        values = list(values)
        return float(np.mean(values)) if values else None

    def saving(m: PlanMetrics) -> float:
        return comm_saving(m.ag_comm_tokens, context_len, cp)

    def a2a_saving(m: PlanMetrics) -> float:
        return exact_need_saving(m.a2a_comm_tokens, context_len, cp)

    gaps = [a.result.gap for a in valid if a.result.gap is not None]
    return {
        "samples": len(audits),
        "valid": len(valid),
        "quota_relaxed": sum(1 for a in audits if a.result.plan is not None and a.result.quota_slack > 0),
        "no_solution": sum(1 for a in audits if a.result.plan is None),
        "ilp": {"comm_saving": mean(saving(a.ilp_metrics) for a in valid),
                "imbalance": mean(a.ilp_metrics.imbalance for a in valid),
                "a2a_comm_saving": mean(a2a_saving(a.ilp_metrics) for a in valid)},
        "heuristic": {"comm_saving": mean(saving(a.heuristic) for a in valid),
                      "imbalance": mean(a.heuristic.imbalance for a in valid),
                      "a2a_comm_saving": mean(a2a_saving(a.heuristic) for a in valid)},
        "comm_saving_gap_pp": mean(100 * (saving(a.ilp_metrics) - saving(a.heuristic)) for a in valid),
        "solve_s_mean": mean(a.result.wall_s for a in audits),
        "solve_s_max": max((a.result.wall_s for a in audits), default=None),
        "gap_mean": mean(gaps),
        "gap_max": max(gaps, default=None),
        "optimal": sum(1 for a in valid if a.result.status == "OPTIMAL"),
    }


def write_audit_plan(dataset: Dataset, store: PlanStore, audits: list[SequenceAudit], name: str, *,
                     params: dict, force: bool = False) -> dict:
    """Write ``plans/<name>``: the ILP plan for every audited row with a valid one, the stored plan elsewhere.

    A plan folder has one row per data row, so rows that were not sampled (or whose ILP plan is not valid)
    keep the stored plan; ``plan.json`` lists the ILP rows under ``params.ilp_rows``. The written rows are
    read back and verified like any stored plan. Returns the plan.json contents.
    """
    if name == store.name:
        raise FlashcpError(f"--write-plan {name} would overwrite the plan being audited; choose another name")
    with PlanSlot(dataset, name, force=force, what="--write-plan") as slot:
        try:
            meta = _write_audit_plan(dataset, store, audits, name, slot.staging(), params)
            slot.commit()
        except OSError as e:
            raise FlashcpError(f"cannot write plan '{name}' in {dataset.root}: {e.strerror or e}") from None
    return meta


def _write_audit_plan(dataset: Dataset, store: PlanStore, audits: list[SequenceAudit], name: str,
                      plan_dir: Path, params: dict) -> dict:
    ilp_plans = {a.row: a.ilp_plan for a in audits if a.valid}
    plan_files, all_metrics = [], []
    base = 0
    for i, data_file in enumerate(dataset.files):
        plans, metrics, costs = [], [], []
        for j, stored in enumerate(store.iter_plans(i)):
            plan = ilp_plans.get(base + j, stored.plan)
            m = plan.metrics()
            plans.append(plan)
            metrics.append(m)
            costs.append(stored.seq_cost)  # the sequence's price does not depend on its sharding
        base += data_file.rows
        all_metrics += metrics
        shard_offsets = np.r_[0, np.cumsum([p.num_shards for p in plans])].astype(np.int64)

        def flat(field: str, plans=plans) -> np.ndarray:
            return np.concatenate([getattr(p, field) for p in plans]) if plans else np.zeros(0, np.int64)

        table = plan_table(shard_offsets, flat("shard_doc"), flat("shard_start"), flat("shard_len"),
                           flat("shard_rank"), np.array([m.imbalance for m in metrics], np.float64),
                           np.array([m.ag_comm_tokens for m in metrics], np.int64),
                           np.array([m.a2a_comm_tokens for m in metrics], np.int64),
                           None if None in costs else np.array(costs, np.float64))
        plan_files.append(write_plan_file(plan_dir, i, table, store.cp))
    summary = {
        **summarize_plans(np.array([m.imbalance for m in all_metrics], np.float64),
                          np.array([m.ag_comm_tokens for m in all_metrics], np.int64),
                          np.array([m.a2a_comm_tokens for m in all_metrics], np.int64),
                          dataset.context_len, store.cp),
        "ilp_sequences": len(ilp_plans),
    }
    params = {**params, "base_plan": store.name, "ilp_rows": sorted(ilp_plans),
              "other_rows": "keep the base plan"}
    meta = write_plan_json(plan_dir, dataset=dataset, strategy="ilp", params=params, cp=store.cp,
                           plan_files=plan_files, summary=summary, name=name)
    _verify_written(dataset, name, ilp_plans, plan_dir)
    return meta


def _verify_written(dataset: Dataset, name: str, ilp_plans: dict[int, SequencePlan], plan_dir: Path) -> None:
    """Read the written plan back; every ILP row must equal what was written and pass the plan checks."""
    store = PlanStore(dataset, name, folder=plan_dir)
    for row, doc_lens, plan, _ in _iter_sampled(dataset, store, np.array(sorted(ilp_plans), dtype=np.int64)):
        expected = ilp_plans[row]
        if not all(np.array_equal(getattr(plan, f), getattr(expected, f))
                   for f in ("shard_doc", "shard_start", "shard_len", "shard_rank")):
            raise FlashcpError(f"plan '{name}' row {row} does not read back as written")

