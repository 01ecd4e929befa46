"""Per-rank metadata of the recurrent layers (RecurrentMeta), built on the host from a sequence's plan.

A recurrent layer needs, at the start of each piece of a document (a shard of the plan), the layer's state
and the last ``W - 1`` inputs of its short convolution; both come from the pieces before it in document order,
which may sit on other ranks. The meta says, for this rank:

- its pieces in local layout order (the plan's row order, the order of its tokens): document, start, length;
- which of them it *contributes*: every piece that is not the last of a document cut into several pieces
  (someone after it needs its state map);
- ``maps``: the route of the state maps (a ``Route``): each contributed piece's map goes to its
  *destinations*, the other ranks holding a later piece of its document, once per destination; a later piece
  on its own rank reads it locally, so nothing is sent to oneself and nothing is padded;
- for each piece with ``start > 0``, its predecessors: the rows of ``cat(this rank's contributed maps, the
  maps' receive buffer)`` holding the maps of the pieces before it, in document order;
- ``conv_tails(width)``: the route of the convolution inputs for ``width`` taps: each other rank gets, of each
  of this rank's pieces, the suffix that its next piece after it needs within ``width - 1`` tokens (the
  exact-need exchange of a sliding window, ``kind_exchange.kind_need``), each token once per rank.

Every rank builds its own meta from the same plan rows; ranks agree on the layout without talking: the
receive order is (sender, sender's local order), which is the order each sender packs its rows in. A document
held whole by one rank has one piece and appears in no exchange.

Index legend: ``T`` this rank's tokens, ``n`` its pieces, ``c`` its contributed pieces, ``m`` predecessor
entries of its pieces, ``s`` rows it sends, ``R`` rows it receives.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from flashcp.planner.plan import SequencePlan
from flashcp.runtime.index_arrays import cumsum0, ranges, within_rank_offsets
from flashcp.runtime.kind_exchange import key_start, kind_need
from flashcp.runtime.meta import RankLayout

__all__ = ["RecurrentMeta", "Route"]


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class Route:
    """One all-to-all of a recurrent layer: which local rows go to which rank, and which rows each reader takes."""

    active: bool
    """Some row crosses ranks somewhere in the plan: every rank issues the collective (False: none does)."""
    send_index: np.ndarray
    """(s,) int64: local rows packed into the send buffer, destination rank after rank (a row sent to several
    ranks appears once per rank)."""
    send_splits: tuple[int, ...]
    """(cp,) rows sent to each rank; 0 to this rank."""
    recv_splits: tuple[int, ...]
    """(cp,) rows received from each rank; 0 from this rank."""
    read_index: np.ndarray
    """int64: the rows the layer reads, in ``cat(local rows, receive buffer)`` (and for the convolution one zero
    row after them: the inputs before a document's start)."""

    @property
    def recv_rows(self) -> int:
        """R: rows of the receive buffer."""
        return sum(self.recv_splits)


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
    """(n,) bool: the piece is not the last of a document cut into several pieces; its state map is computed."""
    active: bool
    """Some document of the sequence is cut (on any rank): False on every rank alike, and then no collective."""
    pred_ptr: np.ndarray
    """(n + 1,) int64: the predecessors of piece i are entries ``pred_ptr[i]:pred_ptr[i + 1]``."""
    pred_shard: np.ndarray
    """(m,) int64: the plan row (shard) of each predecessor, document order within a piece."""
    maps: Route
    """The state maps' route: local rows are this rank's contributed maps (c, in local order); ``read_index``
    (m,) is each predecessor's map."""
    layout: RankLayout = field(repr=False)
    """This rank's share of the plan (the convolution's routes are built from it)."""
    _cache: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def from_plan(cls, plan: SequencePlan, doc_lens, rank: int) -> RecurrentMeta:
        """Build rank ``rank``'s meta from a valid plan of a sequence with documents ``doc_lens``."""
        layout = RankLayout(plan, doc_lens, rank)  # validates: any split of the tokens runs, as CPAttnMeta
        cp, mine = plan.cp, layout.shards
        destinations = _destinations(plan, layout.doc_lens.size)
        contributes = np.asarray(destinations.any(axis=1))
        destinations[np.arange(plan.num_shards), plan.shard_rank] = False  # its own later pieces read it locally
        position = within_rank_offsets(contributes.astype(np.int64), plan.shard_rank)  # among the rank's maps

        # receive: the maps sent here, by (sender, sender's local order)
        incoming = np.flatnonzero(destinations[:, rank])
        incoming = incoming[np.lexsort((incoming, plan.shard_rank[incoming]))]
        recv_row = np.full(plan.num_shards, -1, dtype=np.int64)
        recv_row[incoming] = np.arange(incoming.size)
        held = plan.shard_rank == rank
        num_mapped = int(contributes[mine].sum())
        row = np.where(held, position, num_mapped + recv_row)

        pred_ptr, pred_shard = _predecessors(plan, layout)
        assert (row[pred_shard] >= 0).all()
        mapped = mine[contributes[mine]]
        maps = Route(active=bool(destinations.any()),
                     send_index=position[np.concatenate([mapped[destinations[mapped, r]] for r in range(cp)])],
                     send_splits=tuple(int(n) for n in destinations[mapped].sum(axis=0)),
                     recv_splits=tuple(int(n) for n in np.bincount(plan.shard_rank[incoming], minlength=cp)),
                     read_index=row[pred_shard])
        lengths = plan.shard_len[mine]
        return cls(rank=rank, cp=cp, num_tokens=int(lengths.sum()), piece_doc=plan.shard_doc[mine],
                   piece_start=plan.shard_start[mine], piece_len=lengths,
                   cu_seqlens=[0, *np.cumsum(lengths).tolist()], contributes=contributes[mine],
                   active=bool(contributes.any()), pred_ptr=pred_ptr, pred_shard=pred_shard, maps=maps,
                   layout=layout)

    @property
    def num_pieces(self) -> int:
        """n: pieces on this rank."""
        return int(self.piece_len.shape[0])

    def predecessors(self, piece: int) -> np.ndarray:
        """The maps of the pieces before local piece ``piece``, in document order.

        Rows of ``cat(this rank's contributed maps, the maps' receive buffer)``.
        """
        return self.maps.read_index[self.pred_ptr[piece]:self.pred_ptr[piece + 1]]

    def piece_tokens(self, pieces: np.ndarray) -> tuple[torch.Tensor, list[int]]:
        """Local token positions of ``pieces`` (local piece indices), piece after piece, and their cu_seqlens."""
        starts = np.asarray(self.cu_seqlens[:-1], dtype=np.int64)[pieces]
        lengths = self.piece_len[pieces]
        return torch.from_numpy(ranges(starts, lengths)), [0, *np.cumsum(lengths).tolist()]

    def conv_tails(self, width: int) -> Route:
        """The route of the short convolution's inputs for a filter of ``width`` taps (``width >= 2``).

        Local rows are this rank's tokens (T); ``read_index`` is (n * (width - 1),): for each local piece the
        rows of ``cat(inputs (T), receive buffer (R), one zero row)`` holding the ``width - 1`` inputs before it,
        the zero row before its document's start.
        """
        if width not in self._cache:
            self._cache[width] = self._conv_tails(width)
        return self._cache[width]

    def _conv_tails(self, width: int) -> Route:
        layout, rank, tail = self.layout, self.rank, width - 1
        plan = layout.plan
        need = kind_need(layout, key_start(plan.shard_start, width, None))  # (num_shards, cp) suffixes
        mine = layout.shards
        amount = need[mine].T.reshape(-1)  # per destination rank, each local piece's suffix
        ends = np.tile(np.asarray(self.cu_seqlens[1:], dtype=np.int64), self.cp)
        wanted = need[:, rank]
        by_sender = np.lexsort((layout.shard_local, plan.shard_rank))
        first_row = np.empty(plan.num_shards, dtype=np.int64)
        first_row[by_sender] = cumsum0(wanted[by_sender])[:-1]
        # the row of each token of each shard ``pos - start`` tokens in: local, or in the receive buffer
        local_base = np.where(plan.shard_rank == rank, layout.shard_local, -1)
        recv_base = self.num_tokens + first_row - (plan.shard_len - wanted)
        zero_row = self.num_tokens + int(wanted.sum())
        read = np.full((self.num_pieces, tail), zero_row, dtype=np.int64)
        for piece in range(self.num_pieces):
            shards = self.pred_shard[self.pred_ptr[piece]:self.pred_ptr[piece + 1]]
            start = int(self.piece_start[piece])
            for j, pos in enumerate(range(max(start - tail, 0), start), start=max(tail - start, 0)):
                k = shards[np.searchsorted(layout.shard_end[shards], pos, side="right")]  # the shard holding pos
                offset = pos - plan.shard_start[k]
                if local_base[k] >= 0:
                    read[piece, j] = local_base[k] + offset
                else:
                    assert offset >= plan.shard_len[k] - wanted[k], "the inputs before a piece are in its need"
                    read[piece, j] = recv_base[k] + offset
        return Route(active=bool(need.any()), send_index=ranges(ends - amount, amount),
                     send_splits=tuple(int(n) for n in need[mine].sum(axis=0)),
                     recv_splits=tuple(int(n) for n in np.bincount(plan.shard_rank, weights=wanted, minlength=self.cp)),
                     read_index=read.reshape(-1))


def _destinations(plan: SequencePlan, num_docs: int) -> np.ndarray:
    """(num_shards, cp) bool: rank r holds a later shard of shard i's document (r may be i's own rank)."""
    last_on = np.full((num_docs, plan.cp), -1, dtype=np.int64)  # start of d's last shard on rank r
    np.maximum.at(last_on, (plan.shard_doc, plan.shard_rank), plan.shard_start)
    return last_on[plan.shard_doc] > plan.shard_start[:, None]


def _predecessors(plan: SequencePlan, layout: RankLayout) -> tuple[np.ndarray, np.ndarray]:
    """``(pred_ptr (n + 1,), pred_shard (m,))``: the shards before each of this rank's, document order."""
    by_pos, doc_first = layout.by_pos, layout.doc_first
    first = doc_first[plan.shard_doc[layout.shards]]
    # the shards of a document are contiguous in by_pos, ordered by start: a shard's predecessors precede it
    place = np.empty(plan.num_shards, dtype=np.int64)
    place[by_pos] = np.arange(plan.num_shards)
    count = place[layout.shards] - first
    return cumsum0(count), by_pos[ranges(first, count)]
