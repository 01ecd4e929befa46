"""The records a per-rank meta is made of: a kernel call's queries and a comm mode's K/V exchange.

``QueryPart`` and ``Exchange``: ``flashcp.runtime.meta`` builds them for full attention and
``flashcp.runtime.kind_exchange`` for a window or chunk layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Exchange", "QueryPart"]


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class QueryPart:
    """A group of query shards computed by one varlen kernel call."""

    q_index: torch.Tensor
    """(Tq,) int64: local token positions of the queries, shard after shard."""
    cu_seqlens_q: torch.Tensor
    """(B + 1,) int32: offsets of each sequence's queries in the gathered queries. A sequence is a shard, or
    in a chunk layer's meta (``CPAttnMeta.for_kind``) a shard's piece inside one chunk."""
    cu_seqlens_k: torch.Tensor
    """(B + 1,) int32: offsets of each sequence's keys in the gathered keys: the document's ``[0, end)``, or
    the range the layer kind sees (``CPAttnMeta.for_kind``); they end with the sequence's last query."""
    max_seqlen_q: int
    """Longest query sequence (0 when the part is empty)."""
    max_seqlen_k: int
    """Longest key sequence (0 when the part is empty)."""

    @property
    def num_tokens(self) -> int:
        """Query tokens in this part."""
        return int(self.q_index.shape[0])


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class Exchange:
    """How one comm mode moves K/V for this rank, and where the remote part finds its keys."""

    mode: str
    """``allgather``, ``a2a`` or ``full``."""
    active: bool
    """False when no rank moves anything in this mode; every rank then skips the collective alike."""
    send_index: torch.Tensor
    """(num_payload,) int64: local tokens this rank puts into its collective input, in order (no padding)."""
    send_rows: int
    """Rows of this rank's collective input: ``P`` / ``Q`` (with zero padding) or the a2a send total."""
    recv_rows: int
    """Rows of the receive buffer: ``cp * P`` / ``cp * Q`` (all-gather output) or the a2a receive total."""
    send_splits: tuple[int, ...]
    """a2a only: rows sent to each rank; empty for the all-gather modes."""
    recv_splits: tuple[int, ...]
    """a2a only: rows received from each rank; empty for the all-gather modes."""
    kv_index: torch.Tensor
    """(Sk,) int64: for each key of the remote part (shard after shard, prefix ``[0, end)``), its row in
    ``cat(local K/V (T rows), receive buffer)``."""
    wire_send_tokens: int
    """Tokens of K/V leaving this rank per pass: ``(cp-1) * P`` for an all-gather, the send total for a2a."""
    wire_recv_tokens: int
    """Tokens of K/V that arrive at this rank per pass."""

    @property
    def num_payload(self) -> int:
        """Real (non-padding) tokens in this rank's collective input."""
        return int(self.send_index.shape[0])
