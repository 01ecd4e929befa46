"""The reference of the per-rank attention meta: every rank's meta from whole-sequence per-token maps.

This is how ``flashcp.runtime.meta`` built metas before each rank built only its own: per token of the packed
sequence its owner and local position, every rank's exact need, then each rank's meta read off those maps.
O(cp * C) per rank, written from the definitions (docs/DESIGN.md section 2); ``naive_rank_metas`` must equal
``CPAttnMeta.from_plan`` field by field.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from flashcp.costmodel.comm import (
    allgather_contributions,
    allgather_shard_mask,
    allgather_wire,
    auto_comm_a2a,
    busiest_rows,
    exact_need_received,
)
from flashcp.planner.plan import SequencePlan
from flashcp.runtime.meta import CPAttnMeta, Exchange, QueryPart, RingSchedule, RingStep


def naive_rank_metas(plan: SequencePlan, doc_lens) -> list[CPAttnMeta]:
    """Every rank's meta of ``plan``, from the whole-sequence maps."""
    layout = _SequenceLayout(plan, doc_lens)
    return [layout.rank_meta(r) for r in range(plan.cp)]


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    return np.concatenate([np.arange(s, s + n, dtype=np.int64) for s, n in zip(starts.tolist(), lengths.tolist())]
                          + [np.zeros(0, np.int64)])


def _cumsum0(values: np.ndarray) -> np.ndarray:
    return np.concatenate([np.zeros(1, np.int64), np.cumsum(values, dtype=np.int64)])


def _within_rank_offsets(lengths: np.ndarray, shard_rank: np.ndarray) -> np.ndarray:
    out = np.zeros(lengths.size, dtype=np.int64)
    held: dict[int, int] = {}
    for i, (n, r) in enumerate(zip(lengths.tolist(), shard_rank.tolist())):
        out[i] = held.get(r, 0)
        held[r] = out[i] + n
    return out


def _as_range(index: np.ndarray) -> tuple[int, int] | None:
    if index.size == 0 or index.tolist() != list(range(int(index[0]), int(index[0]) + index.size)):
        return None
    return int(index[0]), int(index[-1]) + 1


def _long(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))


def _int32(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32))


class _SequenceLayout:
    """Whole-sequence token maps shared by the metas of all ranks of one plan (host, numpy)."""

    def __init__(self, plan: SequencePlan, doc_lens):
        self.doc_lens = np.ascontiguousarray(doc_lens, dtype=np.int64)
        # any split of the tokens over ranks runs (token slack); the planner and verify check the quotas
        plan.validate(self.doc_lens, token_slack=int(self.doc_lens.sum()))
        self.plan, cp = plan, plan.cp
        self.doc_offset = _cumsum0(self.doc_lens)[:-1]
        self.context_len = int(self.doc_lens.sum())
        self.shard_end = plan.shard_start + plan.shard_len
        self.shard_global = self.doc_offset[plan.shard_doc] + plan.shard_start
        self.shard_local = _within_rank_offsets(plan.shard_len, plan.shard_rank)
        self.rank_tokens = np.bincount(plan.shard_rank, weights=plan.shard_len, minlength=cp).astype(np.int64)

        # per token of the packed sequence: owning rank and position in the owner's local layout
        by_pos = np.argsort(self.shard_global)
        self.owner = np.repeat(plan.shard_rank[by_pos], plan.shard_len[by_pos])
        self.local_pos = _ranges(self.shard_local[by_pos], plan.shard_len[by_pos])

        # allgather: row of each contributed token in the all-gather output
        self.contributes = allgather_shard_mask(plan.shard_doc, plan.shard_start, plan.shard_len, plan.shard_rank,
                                                 cp)
        contrib_len = np.where(self.contributes, plan.shard_len, 0)
        contributions = np.bincount(plan.shard_rank, weights=contrib_len, minlength=cp).astype(np.int64)
        assert (contributions == allgather_contributions(plan.shard_doc, plan.shard_start, plan.shard_len,
                                                         plan.shard_rank, cp)).all()
        self.ag_slot = int(contributions.max())
        contrib_offset = _within_rank_offsets(contrib_len, plan.shard_rank)
        picked = np.flatnonzero(self.contributes)
        self.ag_row = np.full(self.context_len, -1, dtype=np.int64)
        self.ag_row[_ranges(self.shard_global[picked], plan.shard_len[picked])] = _ranges(
            plan.shard_rank[picked] * self.ag_slot + contrib_offset[picked], plan.shard_len[picked])

        # full: every token, padded to the largest quota
        self.full_slot = int(self.rank_tokens.max())

        # exact need: tokens each rank needs and does not hold, sorted by (owner, owner's local position)
        self.need = [self._exact_need(r) for r in range(cp)]
        received = np.array([n.size for n in self.need], dtype=np.int64)
        assert (received == exact_need_received(plan.shard_doc, plan.shard_start, plan.shard_len,
                                                plan.shard_rank, cp)).all()
        all_need = np.concatenate(self.need) if cp else np.zeros(0, np.int64)
        sent = np.bincount(self.owner[all_need], minlength=cp)
        self.a2a_busiest = int(busiest_rows(sent, received))
        self.a2a_active = bool(received.any())

        # ring: each rank's tokens by packed-sequence position (= document order inside a document)
        by_owner = np.argsort(self.owner, kind="stable")
        self.owned_globals = np.split(by_owner, np.cumsum(self.rank_tokens)[:-1])
        # the rule for 16-bit K/V (what training exchanges), as flashcp bench and the planner price it
        self.auto_comm = "a2a" if auto_comm_a2a(self.a2a_busiest, self.ag_slot, cp, 2) else "allgather"

    def _exact_need(self, rank: int) -> np.ndarray:
        plan = self.plan
        mine = plan.shard_rank == rank
        max_end = np.zeros(self.doc_lens.size, dtype=np.int64)
        np.maximum.at(max_end, plan.shard_doc[mine], self.shard_end[mine])
        docs = np.flatnonzero(max_end)
        prefix = _ranges(self.doc_offset[docs], max_end[docs])
        need = prefix[self.owner[prefix] != rank]
        return need[np.lexsort((self.local_pos[need], self.owner[need]))]

    def _part(self, shards: np.ndarray) -> tuple[QueryPart, np.ndarray]:
        """The QueryPart of ``shards`` and the packed-sequence positions of its keys."""
        plan = self.plan
        length, end = plan.shard_len[shards], self.shard_end[shards]
        part = QueryPart(q_index=_long(_ranges(self.shard_local[shards], length)),
                         cu_seqlens_q=_int32(_cumsum0(length)), cu_seqlens_k=_int32(_cumsum0(end)),
                         max_seqlen_q=int(length.max(initial=0)), max_seqlen_k=int(end.max(initial=0)))
        return part, _ranges(self.doc_offset[plan.shard_doc[shards]], end)

    def _ring_schedule(self, rank: int, shards: np.ndarray) -> RingSchedule:
        plan, cp = self.plan, self.plan.cp
        length = plan.shard_len[shards]
        doc_start = self.doc_offset[plan.shard_doc[shards]]
        steps = []
        for step in range(cp):
            source = (rank - step) % cp
            owned = self.owned_globals[source]
            # the visible keys of shard i: source's tokens of its document before its end, a run of `owned`
            first = np.searchsorted(owned, doc_start)
            count = np.searchsorted(owned, doc_start + self.shard_end[shards]) - first
            seen = count > 0
            assert step > 0 or (count >= length).all()
            part = QueryPart(q_index=_long(_ranges(self.shard_local[shards[seen]], length[seen])),
                             cu_seqlens_q=_int32(_cumsum0(length[seen])),
                             cu_seqlens_k=_int32(_cumsum0(count[seen])),
                             max_seqlen_q=int(length[seen].max(initial=0)),
                             max_seqlen_k=int(count[seen].max(initial=0)))
            kv_index = self.local_pos[owned[_ranges(first[seen], count[seen])]]
            steps.append(RingStep(source=source, causal=step == 0, part=part, kv_index=_long(kv_index),
                                  q_range=_as_range(part.q_index.numpy()), kv_range=_as_range(kv_index)))
        total = self.context_len
        return RingSchedule(rank=rank, steps=tuple(steps), block_rows=tuple(int(t) for t in self.rank_tokens),
                            wire_send_tokens=total - int(self.rank_tokens[(rank + 1) % cp]),
                            wire_recv_tokens=total - int(self.rank_tokens[rank]))

    def rank_meta(self, rank: int) -> CPAttnMeta:
        """The meta of ``rank``."""
        plan, cp = self.plan, self.plan.cp
        if not 0 <= rank < cp:
            raise ValueError(f"rank {rank} is outside [0, {cp})")
        shards = plan.rank_slice(rank)
        num_tokens = int(self.rank_tokens[rank])
        foreign = _cumsum0(self.owner != rank)
        prefix_start = self.doc_offset[plan.shard_doc[shards]]
        local_only = foreign[prefix_start + self.shard_end[shards]] == foreign[prefix_start]

        local, local_keys = self._part(shards[local_only])
        remote, remote_keys = self._part(shards[~local_only])
        order = np.concatenate([local.q_index.numpy(), remote.q_index.numpy()])
        out_index = np.empty(num_tokens, dtype=np.int64)
        out_index[order] = np.arange(num_tokens)

        held = self.owner[remote_keys] == rank
        base_row = np.where(held, self.local_pos[remote_keys], num_tokens)

        def exchange(mode, active, send_index, send_rows, recv_rows, remote_row, wire, splits=((), ())):
            assert (remote_row[~held] >= 0).all()
            kv_index = base_row + np.where(held, 0, remote_row)
            return Exchange(mode=mode, active=active, send_index=_long(send_index), send_rows=send_rows,
                            recv_rows=recv_rows, send_splits=splits[0], recv_splits=splits[1],
                            kv_index=_long(kv_index), wire_send_tokens=wire[0], wire_recv_tokens=wire[1])

        ag_send = _ranges(self.shard_local[shards], plan.shard_len[shards])[
            np.repeat(self.contributes[shards], plan.shard_len[shards])]
        ag_wire = int(allgather_wire(self.ag_slot, cp))
        full_wire = int(allgather_wire(self.full_slot, cp))
        a2a_row = np.full(self.context_len, -1, dtype=np.int64)
        a2a_row[self.need[rank]] = np.arange(self.need[rank].size)
        to_peer = [need[self.owner[need] == rank] for need in self.need]
        send_splits = tuple(int(t.size) for t in to_peer)
        recv_splits = tuple(int(c) for c in np.bincount(self.owner[self.need[rank]], minlength=cp))
        exchanges = {
            "allgather": exchange("allgather", self.ag_slot > 0, ag_send, self.ag_slot, cp * self.ag_slot,
                                  self.ag_row[remote_keys], (ag_wire, ag_wire)),
            "a2a": exchange("a2a", self.a2a_active, self.local_pos[np.concatenate(to_peer)], sum(send_splits),
                            sum(recv_splits), a2a_row[remote_keys], (sum(send_splits), sum(recv_splits)),
                            (send_splits, recv_splits)),
            "full": exchange("full", cp > 1, np.arange(num_tokens), self.full_slot, cp * self.full_slot,
                             self.owner[remote_keys] * self.full_slot + self.local_pos[remote_keys],
                             (full_wire, full_wire)),
        }
        return CPAttnMeta(rank=rank, cp=cp, num_tokens=num_tokens, shard_doc=_long(plan.shard_doc[shards]),
                          shard_start=_long(plan.shard_start[shards]),
                          shard_len=_long(plan.shard_len[shards]),
                          shard_local_only=torch.from_numpy(local_only.copy()), local=local,
                          local_kv_index=_long(self.local_pos[local_keys]), remote=remote,
                          out_index=_long(out_index), exchanges=exchanges,
                          ring=self._ring_schedule(rank, shards), auto_comm=self.auto_comm,
                          ag_slot=self.ag_slot, a2a_busiest=self.a2a_busiest)


def assert_same_meta(got, expected, where="meta"):
    """``got`` equals ``expected`` field by field: tensors in dtype, shape and value, every nested field."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == expected.dtype, where
        assert got.shape == expected.shape and torch.equal(got, expected), f"{where}: {got} != {expected}"
    elif isinstance(expected, dict):
        assert got.keys() == expected.keys(), where
        for key in expected:
            assert_same_meta(got[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, tuple):
        assert isinstance(got, tuple) and len(got) == len(expected), where
        for i, (a, b) in enumerate(zip(got, expected)):
            assert_same_meta(a, b, f"{where}[{i}]")
    elif dataclasses.is_dataclass(expected):
        assert type(got) is type(expected), where
        for f in dataclasses.fields(expected):
            if f.init:
                assert_same_meta(getattr(got, f.name), getattr(expected, f.name), f"{where}.{f.name}")
    else:
        assert type(got) is type(expected) and got == expected, f"{where}: {got!r} != {expected!r}"


def assert_same_batches(got, expected):
    """Two lists of CPLoader batches hold the same sequences, tokens, labels and metas."""
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert (a.file_index, a.row) == (b.file_index, b.row)
        for name in ("input_ids", "position_ids", "labels"):
            assert getattr(a, name).tolist() == getattr(b, name).tolist(), name
        assert a.num_label_tokens == b.num_label_tokens
        assert_same_meta(a.attn, b.attn, f"file {a.file_index} row {a.row} rank {a.attn.rank}")
