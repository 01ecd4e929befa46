"""One packed sequence's sharding plan, its validation, and the row it is stored as.

A plan row (docs/DESIGN.md section 4) lists shards as four parallel arrays. A rank's local token layout is its
shards in row order; strategies emit rows sorted by (rank, doc, start), but readers accept any order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from flashcp.costmodel.comm import PlanMetrics, plan_metrics
from flashcp.costmodel.workload import rank_tokens, token_quotas
from flashcp.errors import PlanError

__all__ = ["SequencePlan", "check_metrics"]


@dataclass(frozen=True, kw_only=True, slots=True)
class SequencePlan:
    """The shards of one packed sequence over ``cp`` ranks. All arrays have shape (num_shards,), int64."""

    shard_doc: np.ndarray
    """Document index inside the sequence."""
    shard_start: np.ndarray
    """Start of the shard inside its document."""
    shard_len: np.ndarray
    """Shard length, > 0."""
    shard_rank: np.ndarray
    """Rank that computes the shard, in ``[0, cp)``."""
    cp: int
    """Number of CP ranks."""

    @classmethod
    def from_arrays(cls, shard_doc, shard_start, shard_len, shard_rank, cp: int) -> SequencePlan:
        """Build a plan from any integer sequences (copied to contiguous int64)."""
        def as_i64(a):
            return np.ascontiguousarray(a, dtype=np.int64)

        return cls(shard_doc=as_i64(shard_doc), shard_start=as_i64(shard_start), shard_len=as_i64(shard_len),
                   shard_rank=as_i64(shard_rank), cp=int(cp))

    @property
    def num_shards(self) -> int:
        """Number of shards."""
        return int(self.shard_doc.shape[0])

    def sorted(self) -> SequencePlan:
        """The same shards in canonical order: by rank, then document, then start."""
        order = np.lexsort((self.shard_start, self.shard_doc, self.shard_rank))
        return SequencePlan(shard_doc=self.shard_doc[order], shard_start=self.shard_start[order],
                            shard_len=self.shard_len[order], shard_rank=self.shard_rank[order], cp=self.cp)

    def rank_slice(self, rank: int) -> np.ndarray:
        """Indices of ``rank``'s shards in row order (its local token layout)."""
        return np.flatnonzero(self.shard_rank == rank)

    def metrics(self) -> PlanMetrics:
        """Imbalance and comm critical paths recomputed from the shards."""
        return plan_metrics(self.shard_doc, self.shard_start, self.shard_len, self.shard_rank, self.cp)

    def validate(self, doc_lens, token_slack: int = 0) -> None:
        """Raise PlanError unless the plan covers every token of ``doc_lens`` once and gives equal tokens.

        ``token_slack``: tokens a rank may hold above or below its quota (plans made with token slack).
        """
        doc_lens = np.asarray(doc_lens, dtype=np.int64)
        if self.num_shards == 0:
            raise PlanError("the plan has no shards")
        if (self.shard_len <= 0).any():
            raise PlanError(f"shard {int(np.argmax(self.shard_len <= 0))} has a length below 1")
        if (self.shard_rank < 0).any() or (self.shard_rank >= self.cp).any():
            raise PlanError(f"a shard names a rank outside [0, {self.cp})")
        if (self.shard_doc < 0).any() or (self.shard_doc >= doc_lens.size).any():
            raise PlanError(f"a shard names a document outside [0, {doc_lens.size})")
        order = np.lexsort((self.shard_start, self.shard_doc))
        doc, start, length = self.shard_doc[order], self.shard_start[order], self.shard_len[order]
        first_of_doc = np.r_[True, doc[1:] != doc[:-1]]
        expected_start = np.where(first_of_doc, 0, np.r_[0, start[:-1] + length[:-1]])
        if (start != expected_start).any():
            bad = int(np.argmax(start != expected_start))
            raise PlanError(f"document {doc[bad]} is not covered exactly once: a shard starts at {start[bad]} "
                            f"where {expected_start[bad]} was expected")
        last_of_doc = np.r_[doc[1:] != doc[:-1], True]
        ends = (start + length)[last_of_doc]
        covered_docs = doc[last_of_doc]
        if covered_docs.size != doc_lens.size or (ends != doc_lens[covered_docs]).any():
            missing = np.setdiff1d(np.arange(doc_lens.size), covered_docs)
            wrong_end = covered_docs[np.argmax(ends != doc_lens[covered_docs])]
            which = int(missing[0]) if missing.size else int(wrong_end)
            raise PlanError(f"document {which} (length {doc_lens[which]}) is not covered exactly once")
        tokens = rank_tokens(self.shard_len, self.shard_rank, self.cp)
        quotas = token_quotas(int(doc_lens.sum()), self.cp)
        off = np.abs(tokens - quotas) > token_slack
        if off.any():
            rank = int(np.argmax(off))
            allowed = f" (+-{token_slack} tokens of token slack)" if token_slack else ""
            raise PlanError(f"rank {rank} holds {tokens[rank]} tokens but its equal-token quota is "
                            f"{quotas[rank]}{allowed}")


def check_metrics(plan: SequencePlan, imbalance: float, ag_comm_tokens: int, a2a_comm_tokens: int) -> None:
    """Raise PlanError unless stored metrics equal the ones recomputed from the plan's shards."""
    got = plan.metrics()
    if not np.isclose(got.imbalance, imbalance, rtol=1e-12, atol=0):
        raise PlanError(f"stored imbalance {imbalance} differs from the recomputed {got.imbalance}")
    if got.ag_comm_tokens != ag_comm_tokens:
        raise PlanError(f"stored all-gather comm {ag_comm_tokens} differs from the recomputed "
                        f"{got.ag_comm_tokens}")
    if got.a2a_comm_tokens != a2a_comm_tokens:
        raise PlanError(f"stored exact-need comm {a2a_comm_tokens} differs from the recomputed "
                        f"{got.a2a_comm_tokens}")
