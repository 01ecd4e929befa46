"""Per-rank metadata of the recurrent layers (RecurrentMeta), built on the host from a sequence's plan.

A recurrent layer needs, at the start of each piece of a document (a shard of the plan), the layer's state
and the last ``W - 1`` inputs of its short convolution; both come from the pieces before it in document order,
which may sit on other ranks. The meta says, for this rank:

- its pieces in local layout order (the plan's row order, the order of its tokens): document, start, length;
- which of them it *contributes*: every piece that is not the last of a document cut into several pieces
  (someone after it needs its state map and its last inputs); a rank contributes at most ``slot`` pieces,
  the largest count over the ranks, so each all-gather input is ``slot`` rows;
- for each piece with ``start > 0``, its predecessors: the rows of the all-gather output (``owner * slot +
  position among the owner's contributions``) of the pieces before it, in document order.

Every rank builds its own meta from the same plan rows; ranks agree on the layout without talking. A
document held whole by one rank has one piece and appears in no exchange.

Index legend: ``T`` this rank's tokens, ``n`` its pieces, ``m`` predecessor entries of its pieces.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from flashcp.planner.plan import SequencePlan

__all__ = ["RecurrentMeta"]


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class RecurrentMeta:
    """What the CP recurrent layers need for one rank and one packed sequence. Build with ``from_plan``."""

    rank: int
    """This rank."""
    cp: int
    """CP world size."""
    num_tokens: int
    """T: tokens this rank holds."""
    piece_doc: np.ndarray
    """(n,) int64: document of each local piece, in local layout order."""
    piece_start: np.ndarray
    """(n,) int64: start of each local piece inside its document."""
    piece_len: np.ndarray
    """(n,) int64: length of each local piece."""
    cu_seqlens: list[int]
    """(n + 1) offsets of the pieces in this rank's tokens."""
    contributes: np.ndarray
    """(n,) bool: the piece is not the last of a document cut into several pieces; it goes into the exchange."""
    slot: int
    """Rows of every rank's all-gather input: the most pieces any rank contributes (0: no exchange at all)."""
    pred_ptr: np.ndarray
    """(n + 1,) int64: the predecessors of piece i are entries ``pred_ptr[i]:pred_ptr[i + 1]``."""
    pred_row: np.ndarray
    """(m,) int64: row of each predecessor in the all-gather output, document order within a piece."""
    pred_end: np.ndarray
    """(m,) int64: end of each predecessor inside its document."""
    _cache: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def from_plan(cls, plan: SequencePlan, doc_lens, rank: int) -> RecurrentMeta:
        """Build rank ``rank``'s meta from a valid plan of a sequence with documents ``doc_lens``."""
        doc_lens = np.ascontiguousarray(doc_lens, dtype=np.int64)
        plan.validate(doc_lens, token_slack=int(doc_lens.sum()))  # any split of the tokens runs, as CPAttnMeta
        if not 0 <= rank < plan.cp:
            raise ValueError(f"rank {rank} is outside [0, {plan.cp})")
        pieces = np.zeros(doc_lens.size, dtype=np.int64)
        np.add.at(pieces, plan.shard_doc, 1)
        last_start = np.zeros(doc_lens.size, dtype=np.int64)
        np.maximum.at(last_start, plan.shard_doc, plan.shard_start)
        contributes = (pieces[plan.shard_doc] > 1) & (plan.shard_start < last_start[plan.shard_doc])
        # position of each contributing shard among its rank's contributions, in row (local) order
        position = np.zeros(plan.num_shards, dtype=np.int64)
        counts = np.zeros(plan.cp, dtype=np.int64)
        for shard in np.flatnonzero(contributes):
            position[shard] = counts[plan.shard_rank[shard]]
            counts[plan.shard_rank[shard]] += 1
        slot = int(counts.max())
        row = plan.shard_rank * slot + position

        mine = plan.rank_slice(rank)
        by_doc = np.lexsort((plan.shard_start, plan.shard_doc))
        doc_first = np.searchsorted(plan.shard_doc[by_doc], np.arange(doc_lens.size))
        pred_ptr, pred_row, pred_end = [0], [], []
        for shard in mine:
            first = doc_first[plan.shard_doc[shard]]
            before = by_doc[first:first + int(np.sum(
                (plan.shard_doc == plan.shard_doc[shard]) & (plan.shard_start < plan.shard_start[shard])))]
            pred_row += row[before].tolist()
            pred_end += (plan.shard_start[before] + plan.shard_len[before]).tolist()
            pred_ptr.append(len(pred_row))
        lengths = plan.shard_len[mine]
        return cls(rank=rank, cp=plan.cp, num_tokens=int(lengths.sum()), piece_doc=plan.shard_doc[mine],
                   piece_start=plan.shard_start[mine], piece_len=lengths,
                   cu_seqlens=[0, *np.cumsum(lengths).tolist()], contributes=contributes[mine], slot=slot,
                   pred_ptr=np.asarray(pred_ptr, dtype=np.int64), pred_row=np.asarray(pred_row, dtype=np.int64),
                   pred_end=np.asarray(pred_end, dtype=np.int64))

    @property
    def active(self) -> bool:
        """False when no document of the sequence is cut: every rank then skips the exchange alike."""
        return self.slot > 0

    @property
    def num_pieces(self) -> int:
        """n: pieces on this rank."""
        return int(self.piece_len.shape[0])

    def predecessors(self, piece: int) -> np.ndarray:
        """Rows of the all-gather output holding the pieces before local piece ``piece``, in document order."""
        return self.pred_row[self.pred_ptr[piece]:self.pred_ptr[piece + 1]]

    def piece_tokens(self, pieces: np.ndarray) -> tuple[torch.Tensor, list[int]]:
        """Local token positions of ``pieces`` (local piece indices), piece after piece, and their cu_seqlens."""
        starts = np.asarray(self.cu_seqlens[:-1], dtype=np.int64)[pieces]
        lengths = self.piece_len[pieces]
        index = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lengths)] or [np.zeros(0, np.int64)])
        return torch.from_numpy(index.astype(np.int64)), [0, *np.cumsum(lengths).tolist()]

    def conv_tails(self, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Where the short convolution's tails come from and go to, for a filter of ``width`` taps.

        Returns ``(send_index, recv_index)``:

        - ``send_index``: (slot * (width - 1),) int64: for each contributed piece (zero rows up to ``slot``),
          the local positions of its last ``width - 1`` tokens; ``T`` (a zero row after the tokens) where the
          piece is shorter;
        - ``recv_index``: (n * (width - 1),) int64: for each local piece, the rows of the flattened all-gather
          output ``(cp * slot * (width - 1))`` holding the ``width - 1`` inputs before it; the row after the
          output (zero) before the document's start.
        """
        key = ("tails", width)
        if key not in self._cache:
            self._cache[key] = self._conv_tails(width)
        return self._cache[key]

    def _conv_tails(self, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        tail = width - 1
        send = np.full((self.slot, tail), self.num_tokens, dtype=np.int64)
        ends = np.asarray(self.cu_seqlens[1:], dtype=np.int64)
        for position, sent in enumerate(np.flatnonzero(self.contributes)):
            last = ends[sent] - tail + np.arange(tail)
            send[position] = np.where(last >= ends[sent] - self.piece_len[sent], last, self.num_tokens)
        zero_row = self.cp * self.slot * tail
        recv = np.full((self.num_pieces, tail), zero_row, dtype=np.int64)
        for piece in range(self.num_pieces):
            entries = slice(self.pred_ptr[piece], self.pred_ptr[piece + 1])
            rows, pred_ends = self.pred_row[entries], self.pred_end[entries]
            start = int(self.piece_start[piece])
            for j, pos in enumerate(range(start - tail, start)):
                if pos < 0:
                    continue
                k = int(np.searchsorted(pred_ends, pos, side="right"))  # the predecessor holding pos
                recv[piece, j] = rows[k] * tail + pos - (pred_ends[k] - tail)
        return torch.from_numpy(send.reshape(-1)), torch.from_numpy(recv.reshape(-1))
