"""Per-rank attention metadata (CPAttnMeta), built once on the host from a sequence's sharding plan.

Every rank builds its own meta from the same plan, so ranks agree on who sends what without talking. The
meta splits the rank's query shards into two kernel calls:

- the *local* part: shards whose whole key prefix ``[0, end)`` of their document lies on this rank (for
  instance a document kept whole on one rank); computed while the K/V exchange is in flight;
- the *remote* part: every other shard; computed after the exchange, over keys gathered from
  ``cat(local K/V, receive buffer)``.

and describes, for each comm mode, the exchange (docs/DESIGN.md section 2):

- ``allgather`` (paper Eq. 5, compacted): each rank contributes the shards that are not the last shard of a
  document spread over several ranks (``cost.allgather_shard_mask``), in its local order, padded to the
  largest contribution ``P``; the receive buffer is the all-gather output, ``cp * P`` rows, rank ``q``'s
  contribution at rows ``[q*P, q*P + c_q)``.
- ``a2a`` (exact need): rank ``r`` receives, per document it holds, the tokens of ``[0, max end of its
  shards)`` it does not hold; rows are ordered by (owner rank, owner's local position), which is also the
  order the owner sends them in; ``all_to_all_single`` with uneven splits.
- ``full`` (Llama3 / Per-Doc baseline): every rank contributes all its tokens, padded to the largest quota
  ``Q``; receive buffer ``cp * Q`` rows.

A layer of sliding window W or chunk K sees less: ``for_kind(window=, chunk=)`` builds (once, cached) the
rank's meta for that kind, whose parts and exchanges cover only the keys ``[max(0, start - W + 1), end)`` or
``[K*floor(start/K), end)`` of each shard ``[start, end)`` (the parts then split shards at chunk boundaries);
each exchange moves what it did for full attention, restricted to those keys (``full`` still moves every
token). The ``ring`` schedule stays full-causal.

The ``ring`` mode (Ring-Attn baseline) has no collective: each rank's whole K/V block (its tokens in local
order) travels around the ring point-to-point. Its ``RingSchedule`` lists, for each of the ``cp`` steps, the
visiting block's source rank and one varlen kernel call: every local query shard attends to the block's
tokens of its document that lie before the shard's end. Step 0 is the rank's own block (causal, bottom-right
aligned: the shard's own tokens are the last keys); at later steps every visiting key precedes the shard
(ranks hold disjoint tokens), so the call is not causal. Shards with no such key sit the step out.

Index legend: ``T`` this rank's tokens (its shards in plan row order), ``C`` the packed sequence's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import numpy as np
import torch

from flashcp.costmodel.comm import allgather_shard_mask, allgather_wire, auto_comm_a2a, exchange_volumes
from flashcp.planner.plan import SequencePlan
from flashcp.runtime.exchange_parts import Exchange, QueryPart
from flashcp.runtime.index_arrays import as_int32, as_long, cumsum0, ranges, within_rank_offsets
from flashcp.runtime.kind_exchange import kind_meta

__all__ = ["COLLECTIVE_MODES", "COMM_MODES", "CPAttnMeta", "Exchange", "QueryPart", "RankLayout", "RingSchedule",
           "RingStep", "build_rank_metas", "rank_token_positions"]

COLLECTIVE_MODES = ("allgather", "a2a", "full")
"""Comm modes that move K/V with one collective (an ``Exchange``)."""
COMM_MODES = (*COLLECTIVE_MODES, "ring")
"""Comm modes every meta describes; ``ring`` rotates K/V point-to-point (a ``RingSchedule``)."""


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class RingStep:
    """One ring step on this rank: the visiting block and the varlen kernel call over it."""

    source: int
    """Rank whose K/V block visits at this step: ``(rank - step) mod cp``."""
    causal: bool
    """True at step 0 only (the rank's own block, bottom-right causal); later blocks are seen whole."""
    part: QueryPart
    """The queries attending to the block (shards with at least one visible key) and the key offsets; its
    ``cu_seqlens_k`` counts the visible keys of each shard."""
    kv_index: torch.Tensor
    """(Sk,) int64: for each key of ``part`` (shard after shard, in document order), its row in the block."""
    q_range: tuple[int, int] | None
    """``(a, b)`` when ``part.q_index`` is ``arange(a, b)``: the kernel then reads a slice, not a copy."""
    kv_range: tuple[int, int] | None
    """``(a, b)`` when ``kv_index`` is ``arange(a, b)`` (e.g. every step of the ``ring`` layout)."""


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class RingSchedule:
    """How the ``ring`` comm mode runs on this rank: ``cp`` steps, N - 1 point-to-point transfers."""

    rank: int
    """This rank."""
    steps: tuple[RingStep, ...]
    """Step s hosts the block of rank ``(rank - s) mod cp``; step 0 covers every local query."""
    block_rows: tuple[int, ...]
    """Tokens of every rank's block (its token count), indexed by rank."""
    wire_send_tokens: int
    """Tokens of K/V leaving this rank per pass: every block but that of rank ``rank + 1``."""
    wire_recv_tokens: int
    """Tokens of K/V that arrive at this rank per pass: every block but its own."""

    @property
    def active(self) -> bool:
        """False with one rank: nothing travels."""
        return len(self.steps) > 1


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class CPAttnMeta:
    """Everything ``cp_attention`` needs for one rank and one packed sequence. Build with ``from_plan``."""

    rank: int
    """This rank."""
    cp: int
    """CP world size."""
    num_tokens: int
    """T: tokens this rank holds."""
    shard_doc: torch.Tensor
    """(n,) int64: document of each local shard, in local layout order."""
    shard_start: torch.Tensor
    """(n,) int64: start of each local shard inside its document."""
    shard_len: torch.Tensor
    """(n,) int64: length of each local shard."""
    shard_local_only: torch.Tensor
    """(n,) bool: the shard's whole key prefix is on this rank (it needs no remote K/V)."""
    local: QueryPart
    """The local-only shards."""
    local_kv_index: torch.Tensor
    """(Sl,) int64: for each key of the local part, its row in the local K/V."""
    remote: QueryPart
    """The shards that need K/V from other ranks."""
    out_index: torch.Tensor
    """(T,) int64: ``out = cat(out_local, out_remote)[out_index]`` restores local layout order."""
    exchanges: dict[str, Exchange]
    """Collective comm mode -> its exchange."""
    ring: RingSchedule
    """The ``ring`` comm mode's schedule."""
    auto_comm: str
    """The mode ``comm="auto"`` uses for 16-bit K/V (what training exchanges): ``auto_comm_for(2)``."""
    ag_slot: int
    """Rows every rank contributes to the compacted all-gather (the largest contribution)."""
    a2a_busiest: int
    """Rows the busiest rank moves in the exact-need all-to-all (``comm.busiest_rows``)."""
    _moved: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _on: torch.device | None = field(default=None, init=False, repr=False, compare=False)
    _comm: str | None = field(default=None, init=False, repr=False, compare=False)
    _host: CPAttnMeta | None = field(default=None, init=False, repr=False, compare=False)
    _layout: RankLayout | None = field(default=None, init=False, repr=False, compare=False)
    _kinds: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def from_plan(cls, plan: SequencePlan, doc_lens, rank: int) -> CPAttnMeta:
        """Build rank ``rank``'s meta from a validated plan of a sequence with documents ``doc_lens``."""
        layout = RankLayout(plan, doc_lens, rank)
        meta = layout.meta()
        object.__setattr__(meta, "_layout", layout)
        return meta

    def for_kind(self, window: int | None = None, chunk: int | None = None) -> CPAttnMeta:
        """The rank's meta for a layer of sliding ``window`` W or ``chunk`` K: its exchanges move only those keys.

        A query shard ``[start, end)`` of a document needs the keys ``[max(0, start - W + 1), end)`` under a
        window and ``[K * floor(start / K), end)`` under a chunk (with both, the later start). The returned
        meta has the same shards, but its local/remote split, parts, ``kv_index`` and the exchanges of
        ``allgather``, ``a2a`` and ``full`` (its ``wire_tokens``, ``ag_slot``, ``a2a_busiest`` and
        ``auto_comm``) are those of the kind. Under a chunk every shard is also split at chunk boundaries: its
        parts' sequences are the pieces of a shard inside one chunk, each with the keys of its chunk up to its
        last query, so a plain bottom-right causal varlen call (with the window, if any) computes the chunk
        layer on every backend, and no kernel needs a key's position in its document. ``ring`` keeps the
        full-causal schedule (it runs plain causal attention only). Both None: this meta. Built on first use
        and cached on the host meta, so calling it per layer is cheap; the result moves with ``to`` as usual.
        """
        host = self._host if self._host is not None else self
        if window is None and chunk is None:
            return self
        key = (None if window is None else int(window), None if chunk is None else int(chunk))
        if min(value for value in key if value is not None) < 1:
            raise ValueError(f"window and chunk must be positive numbers of tokens, got {window!r}, {chunk!r}")
        if key not in host._kinds:
            if host._layout is None:
                raise ValueError("this meta was not built by CPAttnMeta.from_plan; it has no per-kind exchanges")
            kind = kind_meta(host._layout, host, *key)
            object.__setattr__(kind, "_layout", host._layout)
            object.__setattr__(kind, "_kinds", host._kinds)  # for_kind of a kind's meta finds the others
            host._kinds[key] = kind
        return host._kinds[key]

    @property
    def device(self) -> torch.device:
        """Where the index tensors live (those of ``comm`` when the meta was moved with ``to(device, comm)``)."""
        return self._on if self._on is not None else self.out_index.device

    def auto_comm_for(self, kv_bytes: int) -> str:
        """The mode ``comm="auto"`` uses for K/V of ``kv_bytes`` bytes per element.

        ``a2a`` when its busiest rank moves fewer bytes than an all-gather rank does, forward plus backward
        (``comm.auto_comm_a2a``: the all-gather's reduce-scatter carries float32 dK/dV), else ``allgather``.
        Decided from the whole plan, so every rank picks the same. Never ``ring`` or ``full``: those are
        baselines, chosen only by name.
        """
        return "a2a" if auto_comm_a2a(self.a2a_busiest, self.ag_slot, self.cp, kv_bytes) else "allgather"

    def resolve_comm(self, comm: str, kv_bytes: int = 2) -> str:
        """The comm mode ``comm`` names (``"auto"``: ``auto_comm_for(kv_bytes)``); ValueError for an unknown name."""
        mode = self.auto_comm_for(kv_bytes) if comm == "auto" else comm
        if mode not in COMM_MODES:
            raise ValueError(f"unknown comm mode '{comm}' (choose from auto, {', '.join(COMM_MODES)})")
        return mode

    def exchange(self, comm: str, kv_bytes: int = 2) -> Exchange:
        """The exchange for collective mode ``comm`` (``"auto"``: ``auto_comm_for(kv_bytes)``)."""
        mode = self.resolve_comm(comm, kv_bytes)
        if mode not in self.exchanges:
            raise ValueError(f"comm mode '{mode}' moves K/V point-to-point and has no collective exchange; "
                             f"its schedule is meta.ring")
        return self.exchanges[mode]

    def wire_tokens(self, comm: str, kv_bytes: int = 2) -> tuple[int, int]:
        """``(sent, received)`` tokens of K/V per forward pass on this rank with ``comm``.

        ``kv_bytes``: as for ``resolve_comm``.
        """
        mode = self.resolve_comm(comm, kv_bytes)
        ex = self.ring if mode == "ring" else self.exchanges[mode]
        return ex.wire_send_tokens, ex.wire_recv_tokens

    def to(self, device: torch.device | str, comm: str | None = None, kv_bytes: int = 2) -> CPAttnMeta:
        """Return this meta with its index tensors on ``device``; cached, so calling it per layer is cheap.

        ``comm`` (a mode, or ``"auto"`` resolved for K/V of ``kv_bytes`` bytes) moves only what that mode
        reads: the shard arrays and either the local and remote parts with the mode's exchange, or the ring
        schedule; the other modes' tensors stay on the host. None moves everything. The tensors travel as one
        buffer, pinned when CUDA is available: one host-to-device copy per meta and mode, no per-tensor
        pageable copies.
        """
        device = torch.device(device)
        mode = None if comm is None else self.resolve_comm(comm, kv_bytes)
        if device == self.device and self._comm in (None, mode):
            return self
        host = self._host if self._host is not None else self
        if device == host.device and host._comm is None:
            return host
        key = (str(device), mode)
        if key not in host._moved:
            host._moved[key] = _moved_meta(host, device, mode)
        return host._moved[key]


def _moved_meta(meta: CPAttnMeta, device: torch.device, mode: str | None) -> CPAttnMeta:
    """``meta`` with the tensors ``mode`` reads (all when None) on ``device``, copied as one buffer."""
    moved = {"shard_doc", "shard_start", "shard_len", "shard_local_only"}
    if mode is None:
        moved = {f.name for f in fields(meta) if f.init}
    elif mode == "ring":
        moved.add("ring")
    else:
        moved |= {"local", "local_kv_index", "remote", "out_index", "exchanges"}
    parts = {name: getattr(meta, name) for name in moved}
    if mode is not None and "exchanges" in parts:
        parts["exchanges"] = {mode: meta.exchanges[mode]}
    tensors: list[torch.Tensor] = []
    _map_tensors(parts, tensors.append)
    on_device = iter(_copy_as_one(tensors, device))
    parts = _map_tensors(parts, lambda _: next(on_device))
    if mode is not None and "exchanges" in parts:
        parts["exchanges"] = {**meta.exchanges, **parts["exchanges"]}
    result = replace(meta, **parts)
    object.__setattr__(result, "_on", device)
    object.__setattr__(result, "_comm", mode)
    object.__setattr__(result, "_host", meta)
    return result


def _map_tensors(obj, fn):
    """``obj`` with every tensor ``t`` inside it (dicts, tuples, the meta dataclasses) replaced by ``fn(t)``."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, tuple):
        return tuple(_map_tensors(v, fn) for v in obj)
    if isinstance(obj, (QueryPart, Exchange, RingStep, RingSchedule)):
        return replace(obj, **{f.name: _map_tensors(getattr(obj, f.name), fn) for f in fields(obj) if f.init})
    return obj


def _copy_as_one(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """``tensors`` on ``device``: packed into one byte buffer (8-byte aligned), one copy, then viewed apart."""
    sizes = [t.numel() * t.element_size() for t in tensors]
    offsets = np.cumsum([0] + [-(-n // 8) * 8 for n in sizes])
    pinned = device.type == "cuda" and torch.cuda.is_available()
    buffer = torch.empty(int(offsets[-1]), dtype=torch.uint8, pin_memory=pinned)
    for t, start, n in zip(tensors, offsets, sizes):
        if n:
            buffer[start:start + n].copy_(t.contiguous().view(-1).view(torch.uint8))
    buffer = buffer.to(device, non_blocking=pinned)
    return [buffer[start:start + n].view(t.dtype).view(t.shape) for t, start, n in zip(tensors, offsets, sizes)]


def _as_range(index: np.ndarray) -> tuple[int, int] | None:
    """``(a, b)`` when ``index`` is ``arange(a, b)`` with ``b > a``, else None."""
    if index.size == 0 or index[-1] - index[0] + 1 != index.size or (np.diff(index) != 1).any():
        return None
    return int(index[0]), int(index[-1]) + 1


class RankLayout:
    """One rank's share of a sequence's plan (host, numpy), built from the plan rows alone.

    Everything is derived from the shards, never from per-token maps of the whole sequence: a key prefix
    ``[0, end)`` of a document is a run of *pieces* (the document's shards by start, each clipped at ``end``),
    and each piece is a run of its owner's local layout. The work is O(num_shards * cp) integer steps in the
    cost model's compiled kernels (the plan-wide numbers every rank must agree on: the all-gather slot and the
    a2a busiest rank) plus O(what this rank holds, receives and sends); no loop over the other ranks' metas.
    The meta keeps it: ``CPAttnMeta.for_kind`` builds the exchange of a window or chunk layer from it
    (``flashcp.runtime.kind_exchange``).
    """

    def __init__(self, plan: SequencePlan, doc_lens, rank: int):
        self.doc_lens = np.ascontiguousarray(doc_lens, dtype=np.int64)
        # any split of the tokens over ranks runs (token slack); the planner and verify check the quotas
        plan.validate(self.doc_lens, token_slack=int(self.doc_lens.sum()))
        cp = plan.cp
        if not 0 <= rank < cp:
            raise ValueError(f"rank {rank} is outside [0, {cp})")
        self.plan, self.rank = plan, rank
        self.doc_offset = cumsum0(self.doc_lens)[:-1]
        self.context_len = int(self.doc_lens.sum())
        self.shard_end = plan.shard_start + plan.shard_len
        self.shard_local = within_rank_offsets(plan.shard_len, plan.shard_rank)
        self.rank_tokens = np.bincount(plan.shard_rank, weights=plan.shard_len, minlength=cp).astype(np.int64)
        self.shards = plan.rank_slice(rank)

        # the pieces: every shard in packed-sequence order; a document's pieces are contiguous
        self.by_pos = np.argsort(self.doc_offset[plan.shard_doc] + plan.shard_start, kind="stable")
        self.pos_sorted = (self.doc_offset[plan.shard_doc] + plan.shard_start)[self.by_pos]
        self.doc_first = np.searchsorted(plan.shard_doc[self.by_pos], np.arange(self.doc_lens.size))

        # allgather: what each shard contributes and where it lands in the all-gather output
        args = (plan.shard_doc, plan.shard_start, plan.shard_len, plan.shard_rank, cp)
        volumes = exchange_volumes(*args)
        self.contributes = allgather_shard_mask(*args)
        self.ag_slot = volumes.ag_slot
        contrib_len = np.where(self.contributes, plan.shard_len, 0)
        self.ag_base = plan.shard_rank * self.ag_slot + within_rank_offsets(contrib_len, plan.shard_rank)

        # full: every token, padded to the largest quota
        self.full_slot = int(self.rank_tokens.max())

        # exact need: the plan-wide busiest rank, then this rank's receive runs
        self.a2a_busiest = volumes.a2a_busiest
        self.a2a_active = bool(volumes.received.any())
        # the rule for 16-bit K/V (what training exchanges), as flashcp bench and the planner price it
        self.auto_comm = "a2a" if auto_comm_a2a(self.a2a_busiest, self.ag_slot, cp, 2) else "allgather"

    def _prefix_pieces(self, docs: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, ...]:
        """The pieces of each prefix ``[0, ends[i])`` of document ``docs[i]``, prefix after prefix, in order.

        Returns ``(prefix, piece, length)``: which prefix, the piece's shard, and its tokens inside the prefix.
        """
        first = self.doc_first[docs]
        count = np.searchsorted(self.pos_sorted, self.doc_offset[docs] + ends) - first
        piece = self.by_pos[ranges(first, count)]
        prefix = np.repeat(np.arange(docs.size), count)
        length = np.minimum(self.shard_end[piece], ends[prefix]) - self.plan.shard_start[piece]
        return prefix, piece, length

    def _need_rows(self) -> tuple[np.ndarray, tuple[int, ...]]:
        """Receive-buffer row of the first token of each shard this rank needs (-1: none), and recv splits.

        The need is, per document this rank holds, the pieces of ``[0, max end of its shards)`` it does not
        hold, in (owner, owner's local position) order: the order the owners send them in.
        """
        plan, shards = self.plan, self.shards
        max_end = np.zeros(self.doc_lens.size, dtype=np.int64)
        np.maximum.at(max_end, plan.shard_doc[shards], self.shard_end[shards])
        docs = np.flatnonzero(max_end)
        _, piece, length = self._prefix_pieces(docs, max_end[docs])
        foreign = plan.shard_rank[piece] != self.rank
        piece, length = piece[foreign], length[foreign]
        order = np.lexsort((self.shard_local[piece], plan.shard_rank[piece]))
        rows = np.full(plan.num_shards, -1, dtype=np.int64)
        rows[piece[order]] = cumsum0(length[order])[:-1]
        splits = np.bincount(plan.shard_rank[piece], weights=length, minlength=plan.cp).astype(np.int64)
        return rows, tuple(int(c) for c in splits)

    def _send(self) -> tuple[np.ndarray, tuple[int, ...]]:
        """Local positions this rank sends in the a2a, peer after peer, and the send splits.

        Peer ``r`` gets this rank's tokens of each document's prefix ``[0, max end of r's shards)``, in local
        order (the order ``r``'s need lists them).
        """
        plan, shards, cp = self.plan, self.shards, self.plan.cp
        docs, doc_row = np.unique(plan.shard_doc[shards], return_inverse=True)
        row_of_doc = np.full(self.doc_lens.size, -1, dtype=np.int64)
        row_of_doc[docs] = np.arange(docs.size)
        touching = np.flatnonzero(row_of_doc[plan.shard_doc] >= 0)
        peer_end = np.zeros((docs.size, cp), dtype=np.int64)
        np.maximum.at(peer_end, (row_of_doc[plan.shard_doc[touching]], plan.shard_rank[touching]),
                      self.shard_end[touching])
        start, length = plan.shard_start[shards, None], plan.shard_len[shards, None]
        amount = np.clip(peer_end[doc_row.reshape(-1)] - start, 0, length)  # (n_mine, cp)
        amount[:, self.rank] = 0
        send = ranges(np.tile(self.shard_local[shards], cp), amount.T.reshape(-1))
        return send, tuple(int(c) for c in amount.sum(axis=0))

    def _part(self, shards: np.ndarray) -> tuple[QueryPart, tuple[np.ndarray, np.ndarray]]:
        """The QueryPart of ``shards`` and the pieces of its keys: ``(piece, length)``, shard after shard."""
        plan = self.plan
        length, end = plan.shard_len[shards], self.shard_end[shards]
        part = QueryPart(q_index=as_long(ranges(self.shard_local[shards], length)),
                         cu_seqlens_q=as_int32(cumsum0(length)), cu_seqlens_k=as_int32(cumsum0(end)),
                         max_seqlen_q=int(length.max(initial=0)), max_seqlen_k=int(end.max(initial=0)))
        _, piece, key_len = self._prefix_pieces(plan.shard_doc[shards], end)
        return part, (piece, key_len)

    def _ring_schedule(self) -> RingSchedule:
        plan, cp, rank, shards = self.plan, self.plan.cp, self.rank, self.shards
        length = plan.shard_len[shards]
        query, piece, key_len = self._prefix_pieces(plan.shard_doc[shards], self.shard_end[shards])
        # the keys of each step: the visiting rank's pieces, shard after shard, each in document order
        by_source = np.argsort(plan.shard_rank[piece], kind="stable")
        bounds = np.searchsorted(plan.shard_rank[piece][by_source], np.arange(cp + 1))
        steps = []
        for step in range(cp):
            source = (rank - step) % cp
            runs = by_source[bounds[source]:bounds[source + 1]]
            count = np.bincount(query[runs], weights=key_len[runs], minlength=shards.size).astype(np.int64)
            seen = count > 0
            assert step > 0 or (count >= length).all()
            part = QueryPart(q_index=as_long(ranges(self.shard_local[shards[seen]], length[seen])),
                             cu_seqlens_q=as_int32(cumsum0(length[seen])),
                             cu_seqlens_k=as_int32(cumsum0(count[seen])),
                             max_seqlen_q=int(length[seen].max(initial=0)),
                             max_seqlen_k=int(count[seen].max(initial=0)))
            kv_index = ranges(self.shard_local[piece[runs]], key_len[runs])
            steps.append(RingStep(source=source, causal=step == 0, part=part, kv_index=as_long(kv_index),
                                  q_range=_as_range(part.q_index.numpy()), kv_range=_as_range(kv_index)))
        total = self.context_len
        return RingSchedule(rank=rank, steps=tuple(steps), block_rows=tuple(int(t) for t in self.rank_tokens),
                            wire_send_tokens=total - int(self.rank_tokens[(rank + 1) % cp]),
                            wire_recv_tokens=total - int(self.rank_tokens[rank]))

    def meta(self) -> CPAttnMeta:
        """The meta of the layout's rank."""
        plan, cp, rank, shards = self.plan, self.plan.cp, self.rank, self.shards
        num_tokens = int(self.rank_tokens[rank])
        # a shard is local-only when no other rank holds a token of its document before its end
        foreign_start = np.full(self.doc_lens.size, self.doc_lens.max(initial=0), dtype=np.int64)
        others = plan.shard_rank != rank
        np.minimum.at(foreign_start, plan.shard_doc[others], plan.shard_start[others])
        local_only = foreign_start[plan.shard_doc[shards]] >= self.shard_end[shards]

        local, (local_piece, local_len) = self._part(shards[local_only])
        remote, (piece, key_len) = self._part(shards[~local_only])
        order = np.concatenate([local.q_index.numpy(), remote.q_index.numpy()])
        out_index = np.empty(num_tokens, dtype=np.int64)
        out_index[order] = np.arange(num_tokens)

        held = plan.shard_rank[piece] == rank
        held_key = np.repeat(held, key_len)
        base_row = np.where(held_key, ranges(self.shard_local[piece], key_len), num_tokens)

        def exchange(mode, active, send_index, send_rows, recv_rows, piece_row, wire, splits=((), ())):
            assert (piece_row[~held] >= 0).all()
            kv_index = base_row + np.where(held_key, 0, ranges(np.where(held, 0, piece_row), key_len))
            return Exchange(mode=mode, active=active, send_index=as_long(send_index), send_rows=send_rows,
                            recv_rows=recv_rows, send_splits=splits[0], recv_splits=splits[1],
                            kv_index=as_long(kv_index), wire_send_tokens=wire[0], wire_recv_tokens=wire[1])

        ag_send = ranges(self.shard_local[shards], plan.shard_len[shards])[
            np.repeat(self.contributes[shards], plan.shard_len[shards])]
        ag_row = np.where(self.contributes, self.ag_base, -1)
        ag_wire = int(allgather_wire(self.ag_slot, cp))
        full_wire = int(allgather_wire(self.full_slot, cp))
        need_row, recv_splits = self._need_rows()
        send_index, send_splits = self._send()
        exchanges = {
            "allgather": exchange("allgather", self.ag_slot > 0, ag_send, self.ag_slot, cp * self.ag_slot,
                                  ag_row[piece], (ag_wire, ag_wire)),
            "a2a": exchange("a2a", self.a2a_active, send_index, sum(send_splits), sum(recv_splits),
                            need_row[piece], (sum(send_splits), sum(recv_splits)), (send_splits, recv_splits)),
            "full": exchange("full", cp > 1, np.arange(num_tokens), self.full_slot, cp * self.full_slot,
                             plan.shard_rank[piece] * self.full_slot + self.shard_local[piece],
                             (full_wire, full_wire)),
        }
        return CPAttnMeta(rank=rank, cp=cp, num_tokens=num_tokens, shard_doc=as_long(plan.shard_doc[shards]),
                          shard_start=as_long(plan.shard_start[shards]),
                          shard_len=as_long(plan.shard_len[shards]),
                          shard_local_only=torch.from_numpy(local_only.copy()), local=local,
                          local_kv_index=as_long(ranges(self.shard_local[local_piece], local_len)),
                          remote=remote, out_index=as_long(out_index), exchanges=exchanges,
                          ring=self._ring_schedule(), auto_comm=self.auto_comm,
                          ag_slot=self.ag_slot, a2a_busiest=self.a2a_busiest)


def build_rank_metas(plan: SequencePlan, doc_lens) -> list[CPAttnMeta]:
    """The metas of every rank of ``plan``, each built as that rank builds it alone; for emulation and checks."""
    return [CPAttnMeta.from_plan(plan, doc_lens, r) for r in range(plan.cp)]


def rank_token_positions(plan: SequencePlan, doc_lens, rank: int) -> tuple[np.ndarray, ...]:
    """``(global_pos, doc_pos, doc)`` of ``rank``'s tokens in local layout order, each (T,) int64.

    ``global_pos`` indexes the packed sequence, ``doc_pos`` is the position inside the token's document and
    ``doc`` that document's index.
    """
    doc_lens = np.asarray(doc_lens, dtype=np.int64)
    shards = plan.rank_slice(rank)
    lengths = plan.shard_len[shards]
    doc_pos = ranges(plan.shard_start[shards], lengths)
    doc = np.repeat(plan.shard_doc[shards], lengths)
    return cumsum0(doc_lens)[:-1][doc] + doc_pos, doc_pos, doc
