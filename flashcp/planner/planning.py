"""The one planning path: a strategy's batch kernel (or its Python ``rows``), then the optional CP-SAT polish.

``plan_flat`` plans flat arrays of sequences (``row_offsets`` (rows + 1,) indexing ``doc_lens``) as a strategy
plans them: its batch kernel (``flashcp.planner.batch``) or, for a strategy planned in Python (``dcp``), its
``rows``; then, for ``effort="ilp[:SECONDS]"``, the CP-SAT polish of every row (``flashcp.planner.ilp.polish``).
Everything that plans goes through it: ``plan_sequence`` (one sequence -> ``SequencePlan``), ``plan_rows``
(many sequences, validated, with their metrics -> ``PlannedRows``; what ``flashcp plan`` writes), the
pipeline's warm-up and the bench. The parameters come resolved by ``flashcp.planner.params``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from flashcp.costmodel.comm import comm_saving, exact_need_saving
from flashcp.costmodel.models import ModelSpec
from flashcp.costmodel.objective import batch_step_seconds, sequence_flops
from flashcp.costmodel.shape import AttentionShape
from flashcp.errors import FlashcpError, PlanError
from flashcp.planner import batch, check
from flashcp.planner.ilp.polish import parse_effort, polish_rows
from flashcp.planner.params import check_shape, kernel_args, model_params, resolve_params
from flashcp.planner.plan import SequencePlan
from flashcp.planner.plan_writer import plan_table
from flashcp.planner.registry import Strategy, get_strategy

__all__ = ["PlannedRows", "check_rows", "describe_error", "plan_flat", "plan_rows", "plan_sequence",
           "strategy_metrics", "summarize"]

_ERROR_TEXT = {
    check.NO_SHARDS: "has no shards",
    check.BAD_LENGTH: "has a shard shorter than 1 token",
    check.BAD_RANK: "names a rank outside [0, cp)",
    check.BAD_DOC: "names a document the sequence does not have",
    check.BAD_COVERAGE: "does not cover every token of every document exactly once",
    check.BAD_QUOTA: "does not give every rank its equal-token quota",
}


def plan_flat(strategy: Strategy, row_offsets: np.ndarray, doc_lens: np.ndarray, cp: int, params: dict, *,
              polish: bool = True, shape: AttentionShape | None = None):
    """Plan every row of flat contiguous int64 ``(row_offsets, doc_lens)``: the one planning path.

    The strategy's batch kernel (or its Python ``rows``), then, for ``effort="ilp[:SECONDS]"`` and ``polish``,
    the CP-SAT polish of every row. ``params``: resolved (``params.resolve_params``); ``shape``: the model
    shape a step-time objective prices (None: the parameters' own). Returns
    ``(shard_offsets, doc, start, len, rank)``; not validated (``plan_rows`` validates, ``plan_sequence``
    builds a ``SequencePlan``, which checks itself).
    """
    args = kernel_args(strategy, params, shape)
    if strategy.rows is not None:  # planned in Python (dcp)
        planned = strategy.rows(row_offsets, doc_lens, cp, params)
    else:
        planned = batch.plan_batch(row_offsets, doc_lens, cp, strategy, **args)
    seconds = parse_effort(params["effort"])[1] if polish and "effort" in params else None
    if seconds is not None:
        planned = polish_rows(row_offsets, doc_lens, cp, args["model"], seconds, *planned)
    return planned


def plan_sequence(strategy: str | Strategy, doc_lens, cp: int, *, target_imbalance: float | None = None,
                  model: ModelSpec | None = None, **overrides) -> SequencePlan:
    """Plan one packed sequence with a strategy (its name, or its registry entry).

    ``doc_lens``: (num_docs,) positive integers; ``target_imbalance`` and ``overrides`` (``chunk_size``,
    ``effort``, ``profile``, ...) default to the strategy's own. ``model``: the model a step-time objective
    prices (``flashcp plan --model``); None: the shape parameters (``num_heads``, ...) as given or defaulted.
    Raises ValueError for an unknown strategy, bad input, or a shape parameter conflicting with ``model``.
    """
    chosen = strategy if isinstance(strategy, Strategy) else get_strategy(strategy)
    if model is not None:
        overrides = model_params(chosen, overrides, model)
    params = resolve_params(chosen, target_imbalance, **overrides)
    lens = np.ascontiguousarray(doc_lens, dtype=np.int64)
    if lens.ndim != 1 or lens.size == 0 or (lens <= 0).any():
        raise ValueError("doc_lens must be a non-empty 1-D array of positive lengths")
    check_shape(int(lens.sum()), cp, params)
    _, doc, start, length, rank = plan_flat(chosen, np.array([0, lens.size], np.int64), lens, cp, params,
                                            shape=None if model is None else model.attention_shape())
    return SequencePlan(shard_doc=doc, shard_start=start, shard_len=length, shard_rank=rank, cp=cp)


@dataclass(frozen=True, kw_only=True, slots=True)
class PlannedRows:
    """Plans of many sequences as flat arrays, with their metrics recomputed by the cost model."""

    shard_offsets: np.ndarray
    """(rows + 1,) int64, indexes the flat shard arrays by row."""
    shard_doc: np.ndarray
    """(num_shards,) int64."""
    shard_start: np.ndarray
    """(num_shards,) int64."""
    shard_len: np.ndarray
    """(num_shards,) int64."""
    shard_rank: np.ndarray
    """(num_shards,) int64."""
    imbalance: np.ndarray
    """(rows,) float64."""
    ag_comm_tokens: np.ndarray
    """(rows,) int64, all-gather critical path."""
    a2a_comm_tokens: np.ndarray
    """(rows,) int64, exact-need critical path."""
    seq_cost: np.ndarray
    """(rows,) float64, each sequence's price (``objective.sequence_flops`` under the plan's shape)."""

    def row(self, i: int, cp: int) -> SequencePlan:
        """Row ``i``'s plan."""
        lo, hi = self.shard_offsets[i], self.shard_offsets[i + 1]
        return SequencePlan(shard_doc=self.shard_doc[lo:hi], shard_start=self.shard_start[lo:hi],
                            shard_len=self.shard_len[lo:hi], shard_rank=self.shard_rank[lo:hi], cp=cp)

    @property
    def num_rows(self) -> int:
        """Sequences planned."""
        return int(self.shard_offsets.size - 1)

    def take(self, rows: np.ndarray) -> PlannedRows:
        """The plans of ``rows`` (int indices, in that order) alone, copied."""
        rows = np.asarray(rows, dtype=np.int64)
        lo, hi = self.shard_offsets[rows], self.shard_offsets[rows + 1]
        offsets = np.zeros(rows.size + 1, np.int64)
        offsets[1:] = np.cumsum(hi - lo)
        index = np.repeat(lo - offsets[:-1], hi - lo) + np.arange(offsets[-1], dtype=np.int64)
        return PlannedRows(shard_offsets=offsets, shard_doc=self.shard_doc[index],
                           shard_start=self.shard_start[index], shard_len=self.shard_len[index],
                           shard_rank=self.shard_rank[index], imbalance=self.imbalance[rows],
                           ag_comm_tokens=self.ag_comm_tokens[rows], a2a_comm_tokens=self.a2a_comm_tokens[rows],
                           seq_cost=self.seq_cost[rows])

    def table(self):
        """The plans as a plan-file table (``flashcp.planner.plan_reader.PLAN_SCHEMA``)."""
        return plan_table(self.shard_offsets, self.shard_doc, self.shard_start, self.shard_len, self.shard_rank,
                          self.imbalance, self.ag_comm_tokens, self.a2a_comm_tokens, self.seq_cost)

    def step_seconds(self, cp: int, model: np.ndarray) -> np.ndarray:
        """(rows,) projected step time of every plan (``objective.batch_step_seconds``; ``model``: its vector)."""
        return batch_step_seconds(self.shard_offsets, self.shard_doc, self.shard_start, self.shard_len,
                                  self.shard_rank, cp, model)


def describe_error(code: int) -> str:
    """The sentence ending for a :func:`flashcp.planner.check.check_batch` error code."""
    return _ERROR_TEXT[code]


def check_rows(row_offsets: np.ndarray, doc_lens: np.ndarray, context_len: int, where: str, *,
               first_row: int = 0) -> None:
    """FlashcpError unless every row's document lengths are positive and sum to ``context_len``.

    Rows are named ``first_row`` + their index (their row in the data file).
    """
    if row_offsets.size < 2:
        return
    if (doc_lens <= 0).any():
        raise FlashcpError(f"{where} holds a document of length 0 or less; re-create the dataset")
    counts = np.diff(row_offsets)
    if (counts == 0).any():
        bad = first_row + int(np.argmax(counts == 0))
        raise FlashcpError(f"{where}, row {bad}, has no documents; re-create the dataset")
    sums = np.add.reduceat(doc_lens, row_offsets[:-1])
    if (sums != context_len).any():
        bad = int(np.argmax(sums != context_len))
        raise FlashcpError(f"{where}, row {first_row + bad}: document lengths sum to {int(sums[bad])}, not the context "
                           f"length {context_len}; re-create the dataset")


def plan_rows(row_offsets: np.ndarray, doc_lens: np.ndarray, cp: int, strategy: str | Strategy,
              params: dict | None = None, *, where: str = "sequences", first_row: int = 0,
              shape: AttentionShape | None = None) -> PlannedRows:
    """Plan every row of flat ``(row_offsets, doc_lens)``, validate the plans; PlanError names a bad row.

    Rows are named ``first_row`` + their index. ``shape``: the model shape every price uses (the step-time
    objective and ``seq_cost``; a model's ``attention_shape()``); None: the parameters' own
    (``AttentionShape.from_params``).
    """
    chosen = strategy if isinstance(strategy, Strategy) else get_strategy(strategy)
    params = resolve_params(chosen) if params is None else params
    row_offsets = np.ascontiguousarray(row_offsets, dtype=np.int64)
    doc_lens = np.ascontiguousarray(doc_lens, dtype=np.int64)
    offsets, doc, start, length, rank = plan_flat(chosen, row_offsets, doc_lens, cp, params, shape=shape)
    slack = float(params.get("token_slack", 0.0))
    errors, imbalance, ag, a2a = check.check_batch(row_offsets, doc_lens, offsets, doc, start, length, rank, cp,
                                                    slack)
    if errors.any():
        bad = int(np.flatnonzero(errors)[0])
        raise PlanError(f"the {chosen.name} plan of {where}, row {first_row + bad}, "
                        f"{_ERROR_TEXT[int(errors[bad])]}")
    return PlannedRows(shard_offsets=offsets, shard_doc=doc, shard_start=start, shard_len=length,
                       shard_rank=rank, imbalance=imbalance, ag_comm_tokens=ag, a2a_comm_tokens=a2a,
                       seq_cost=sequence_flops(row_offsets, doc_lens, shape or AttentionShape.from_params(params)))


def strategy_metrics(sequences: Sequence[np.ndarray], cp: int, strategy: str,
                     target_imbalance: float | None = None, **overrides) -> dict[str, np.ndarray]:
    """Per-sequence ``imbalance``, ``ag_comm_tokens`` and ``a2a_comm_tokens`` of a strategy's plans.

    ``sequences`` is a list of ``doc_lens`` arrays; every plan is validated on the way.
    """
    chosen = get_strategy(strategy)
    lens = [np.asarray(s, dtype=np.int64) for s in sequences]
    row_offsets = np.zeros(len(lens) + 1, np.int64)
    row_offsets[1:] = np.cumsum([s.size for s in lens])
    flat = np.concatenate(lens) if lens else np.zeros(0, np.int64)
    planned = plan_rows(row_offsets, flat, cp, chosen, resolve_params(chosen, target_imbalance, **overrides))
    return {"imbalance": planned.imbalance, "ag_comm_tokens": planned.ag_comm_tokens,
            "a2a_comm_tokens": planned.a2a_comm_tokens}


def summarize(imbalance: np.ndarray, ag: np.ndarray, a2a: np.ndarray, context_len: int, cp: int) -> dict:
    """Mean/p50/max imbalance and mean comm savings of a set of plans (plan.json ``summary``)."""
    if imbalance.size == 0:
        return {"sequences": 0}
    return {
        "sequences": int(imbalance.size),
        "imbalance_mean": float(imbalance.mean()),
        "imbalance_p50": float(np.median(imbalance)),
        "imbalance_max": float(imbalance.max()),
        "ag_comm_tokens_mean": float(ag.mean()),
        "a2a_comm_tokens_mean": float(a2a.mean()),
        "ag_saving_mean": comm_saving(float(ag.mean()), context_len, cp),
        "a2a_saving_mean": exact_need_saving(float(a2a.mean()), context_len, cp),
    }
