"""What a plan costs the recurrent layers under CP: the bytes of the state-map exchange and the extra runs.

The one home of these formulas; the runtime's scheme is ``flashcp.runtime.recurrent.cp`` (its docstring) and
its per-rank layout ``flashcp.runtime.recurrent.meta.RecurrentMeta``. This module recomputes the layout from
the plan's four shard arrays alone (the cost model imports no runtime):

- a piece (a shard) *contributes* when its document has more than one piece and it is not the document's last
  piece (the pieces of a cut document on one rank included: the runtime maps them too);
- its state map goes to its *destinations*: the other ranks holding a later piece of its document (a later
  piece on its own rank reads it locally); ``map_volumes_kernel``;
- the short convolution's inputs before a piece (``W - 1`` tokens, over as many earlier pieces as they span)
  go, token by token, to each other rank that holds a piece they precede: exactly the exact-need exchange of a
  sliding window of ``W`` keys (``comm.exchange_volumes`` with ``workload.WINDOW`` and ``W``), each token once
  per rank however many of its pieces need it.

Bytes per layer and pass (one ``all_to_all`` of the maps and one of the conv inputs; no padding; the
backward's reversed all-to-alls move the same bytes the other way), per rank:

- state maps: ``map_bytes`` per (contributed piece, destination), sent by the piece's rank and received by the
  destination; ``map_bytes`` per piece GDN ``b H K (K + V)`` (a K x K transition and a K x V state per head),
  SSD ``b H (1 + P S)`` (a scalar decay and a P x S state per head);
- convolution inputs: ``b F`` per token sent (``conv_token_bytes``; nothing when ``W == 1``);

``b``: bytes per element of the compute dtype (4: float32, as for float32 and bf16 inputs). A plan that cuts
no document moves nothing and the runtime issues no collective; an exchange in which no row crosses ranks is
skipped too (the same decision on every rank).

Extra recurrent work (per rank, per layer and pass, in tokens of the plain recurrence): the runtime runs each
contributed piece once for its map and runs every piece except the contributed first pieces of their documents
once from its true start; so the contributed pieces that do not start their document run twice
(``rerun_tokens``). GDN's map run carries ``K`` extra value columns (``[I | 0]`` start, values ``[0 | v]``)
over every contributed piece: ``K / V`` of a run per contributed token (``gdn_value_column_tokens``, at cost
linear in the value columns).

Shape legend: ``H`` heads (GDN: value heads), ``K`` GDN key dim, ``V`` GDN value dim, ``P`` SSD head dim,
``S`` SSD state size, ``G`` groups (GDN: key heads), ``W`` conv taps, ``F`` conv channels.

Compute (``RecurrentShape.flops_per_token``), ASSUMPTION: the FLOPs of the chunked algorithms with chunk
``C = CHUNK`` tokens, dense matmuls only (gates, norms and exponentials left out), per token and head,
forward: GDN (WY form, Yang et al. 2024) ``K K^T`` and ``Q K^T`` in the chunk ``2 C K`` each, the
triangular inverse ``C^2``, ``W = T (beta K)`` ``2 C K``, ``U = T (beta V)`` ``2 C V``, ``W S``, ``Q S``
and the state update ``K^T U`` ``2 K V`` each, the intra-chunk output ``2 C V``: ``6 C K + 4 C V + C^2 + 6
K V``; SSD (Mamba-2's chunked scan, Dao and Gu 2024) ``C B^T`` ``2 C S``, its masked product with ``X``
``2 C P``, the chunk state ``B^T X`` and the inter-chunk output ``C h`` ``2 P S`` each: ``2 C S + 2 C P + 4
P S``; plus the short convolution ``2 W F``. The backward costs twice the forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from flashcp._numba import njit
from flashcp.costmodel.comm import CONTRIBUTED, RECEIVED, RECEIVED_FAR, SENT, SENT_FAR, exchange_volumes_kernel
from flashcp.costmodel.workload import WINDOW

__all__ = [
    "CHUNK",
    "RECURRENT_KINDS",
    "RecurrentExchange",
    "RecurrentShape",
    "SplitWork",
    "conv_volumes_kernel",
    "map_volumes_kernel",
    "contributed_kernel",
    "recurrent_contributes",
    "recurrent_exchange",
    "split_work",
]

CHUNK = 64
"""Chunk length of the chunked recurrences the FLOP count assumes (fla's and mamba_ssm's default 64)."""

RECURRENT_KINDS = ("gdn", "ssd")
"""Gated DeltaNet (Qwen3-Next's linear attention) and Mamba-2's SSD (Nemotron-H)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RecurrentShape:
    """The recurrent layers of a hybrid model, as the CP runtime exchanges them."""

    kind: str
    """``"gdn"`` (Gated DeltaNet) or ``"ssd"`` (Mamba-2)."""
    num_heads: int
    """H: GDN value heads (``linear_num_value_heads``), SSD heads (``mamba_num_heads``)."""
    key_dim: int
    """GDN: K, the key head dim (``linear_key_head_dim``); SSD: S, the state size (``ssm_state_size``)."""
    value_dim: int
    """GDN: V, the value head dim (``linear_value_head_dim``); SSD: P, the head dim (``mamba_head_dim``)."""
    num_groups: int
    """GDN: key heads (``linear_num_key_heads``); SSD: B/C groups (``n_groups``)."""
    conv_width: int
    """W: taps of the short causal convolution (``linear_conv_kernel_dim``, ``conv_kernel``)."""
    num_layers: int
    """Recurrent layers in the model."""
    element_bytes: int = 4
    """Bytes per element of the exchanged maps and tails: the compute dtype, float32 at least."""

    def __post_init__(self):
        if self.kind not in RECURRENT_KINDS:
            raise ValueError(f"recurrent kind {self.kind!r} is not one of {', '.join(RECURRENT_KINDS)}")
        for name in ("num_heads", "key_dim", "value_dim", "num_groups", "conv_width", "element_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.num_layers < 0:
            raise ValueError(f"num_layers must be at least 0, got {self.num_layers}")

    @property
    def conv_channels(self) -> int:
        """F: channels of the short convolution: GDN ``[q | k | v]``, ``2 G K + H V``; SSD ``[x | B | C]``."""
        if self.kind == "gdn":
            return 2 * self.num_groups * self.key_dim + self.num_heads * self.value_dim
        return self.num_heads * self.value_dim + 2 * self.num_groups * self.key_dim

    @property
    def map_bytes(self) -> int:
        """Bytes of one piece's state map in one layer: GDN ``b H K (K + V)``, SSD ``b H (1 + P S)``."""
        if self.kind == "gdn":
            return self.element_bytes * self.num_heads * self.key_dim * (self.key_dim + self.value_dim)
        return self.element_bytes * self.num_heads * (1 + self.value_dim * self.key_dim)

    @property
    def conv_token_bytes(self) -> int:
        """Bytes of one token of the short convolution's input in one layer: ``b F`` (a piece needs ``W - 1``)."""
        return self.element_bytes * self.conv_channels

    @property
    def flops_per_token(self) -> float:
        """Forward FLOPs of one layer's recurrence and convolution per token (module docstring, ASSUMPTION)."""
        c, h = CHUNK, self.num_heads
        if self.kind == "gdn":
            k, v = self.key_dim, self.value_dim
            per_head = 6.0 * c * k + 4.0 * c * v + c * c + 6.0 * k * v
        else:
            s, p = self.key_dim, self.value_dim
            per_head = 2.0 * c * s + 2.0 * c * p + 4.0 * p * s
        return h * per_head + 2.0 * self.conv_width * self.conv_channels

    @property
    def mapped_extra(self) -> float:
        """Extra work per contributed token, in tokens of a plain run: GDN ``K / V`` (``SplitWork``), SSD 0."""
        return self.key_dim / self.value_dim if self.kind == "gdn" else 0.0


def _int64(*arrays):
    return tuple(np.ascontiguousarray(a, dtype=np.int64) for a in arrays)


def recurrent_contributes(shard_doc, shard_start, shard_len, shard_rank, cp: int) -> np.ndarray:
    """Which shards the recurrent layers map: (num_shards,) bool.

    A shard contributes when its document has more than one shard and it is not the document's last.
    """
    doc, start, _, rank = _int64(shard_doc, shard_start, shard_len, shard_rank)
    if doc.size == 0:
        return np.zeros(0, dtype=bool)
    if rank.min() < 0 or rank.max() >= cp:
        raise ValueError(f"shard ranks must lie in [0, {cp}), got {rank.min()}..{rank.max()}")
    return contributed_kernel(doc, start)


@njit(cache=True)
def contributed_kernel(doc, start):
    """``recurrent_contributes`` for the compiled callers: (num_shards,) bool, int64 arrays, no checks.

    A shard before its document's last starts before that last shard's start (so its document has several).
    """
    num_docs = 0
    for i in range(doc.shape[0]):
        num_docs = max(num_docs, doc[i] + 1)
    last_start = np.full(num_docs, -1, np.int64)
    for i in range(doc.shape[0]):
        last_start[doc[i]] = max(last_start[doc[i]], start[i])
    out = np.empty(doc.shape[0], np.bool_)
    for i in range(doc.shape[0]):
        out[i] = start[i] < last_start[doc[i]]
    return out


@njit(cache=True)
def map_volumes_kernel(doc, start, rank, cp, gpus_per_node):
    """Every rank's state-map rows of one plan, one layer and pass: (5, cp) int64, rows as ``comm``'s.

    ``SENT``, ``RECEIVED``: one row per (contributed shard, destination), the destinations being the other
    ranks that hold a later shard of its document; ``SENT_FAR``, ``RECEIVED_FAR``: their part between nodes
    (``gpus_per_node`` ranks per node; 0: one node); ``CONTRIBUTED``: the shards each rank maps (some rank, its
    own included, holds a later shard of their document). Takes int64 arrays, no checks.
    """
    num_docs = 0
    for i in range(doc.shape[0]):
        num_docs = max(num_docs, doc[i] + 1)
    last_on = np.full((num_docs, cp), -1, np.int64)  # start of the last shard of document d on rank r
    for i in range(doc.shape[0]):
        last_on[doc[i], rank[i]] = max(last_on[doc[i], rank[i]], start[i])
    out = np.zeros((5, cp), np.int64)
    split = gpus_per_node > 0 and cp > gpus_per_node
    for i in range(doc.shape[0]):
        b = rank[i]
        mapped = False
        for r in range(cp):
            if last_on[doc[i], r] <= start[i]:
                continue
            mapped = True
            if r == b:
                continue
            out[SENT, b] += 1
            out[RECEIVED, r] += 1
            if split and r // gpus_per_node != b // gpus_per_node:
                out[SENT_FAR, b] += 1
                out[RECEIVED_FAR, r] += 1
        if mapped:
            out[CONTRIBUTED, b] += 1
    return out


@njit(cache=True)
def conv_volumes_kernel(doc, start, length, rank, cp, gpus_per_node, width):
    """Every rank's convolution-input tokens of one plan, one layer and pass: (5, cp) int64, rows as ``comm``'s.

    The exact-need exchange of a sliding window of ``width`` keys (``comm.exchange_volumes_kernel``): a piece
    needs the ``width - 1`` tokens before it. Its ``CONTRIBUTED`` row is the window's all-gather, unused here.
    """
    return exchange_volumes_kernel(doc, start, length, rank, cp, gpus_per_node, WINDOW, width)


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class RecurrentExchange:
    """What one recurrent layer's two all-to-alls move for one plan, one pass (forward or backward)."""

    maps: np.ndarray
    """(5, cp) int64: state maps per rank (``map_volumes_kernel``), rows ``comm.SENT``, ``RECEIVED``,
    ``SENT_FAR``, ``RECEIVED_FAR``, ``CONTRIBUTED``."""
    conv: np.ndarray
    """(5, cp) int64: convolution-input tokens per rank (``conv_volumes_kernel``), rows as ``maps``."""
    map_bytes: int
    """Bytes of one state map (``RecurrentShape.map_bytes``)."""
    conv_token_bytes: int
    """Bytes of one token of convolution input (``RecurrentShape.conv_token_bytes``)."""

    @property
    def cp(self) -> int:
        """CP world size."""
        return int(self.maps.shape[1])

    @property
    def sent_bytes(self) -> np.ndarray:
        """(cp,) int64: bytes each rank sends, maps and convolution inputs."""
        return self.maps[SENT] * self.map_bytes + self.conv[SENT] * self.conv_token_bytes

    @property
    def received_bytes(self) -> np.ndarray:
        """(cp,) int64: bytes each rank receives, maps and convolution inputs."""
        return self.maps[RECEIVED] * self.map_bytes + self.conv[RECEIVED] * self.conv_token_bytes

    @property
    def busiest_bytes(self) -> int:
        """Bytes of the busiest rank: the largest of any rank's sent or received bytes (full-duplex links)."""
        return int(max(self.sent_bytes.max(initial=0), self.received_bytes.max(initial=0)))

    @property
    def total_bytes(self) -> int:
        """Bytes all ranks send together, maps and convolution inputs."""
        return int(self.sent_bytes.sum())


def recurrent_exchange(shape: RecurrentShape, shard_doc, shard_start, shard_len, shard_rank, cp: int,
                       gpus_per_node: int = 0) -> RecurrentExchange:
    """What one recurrent layer of ``shape`` exchanges for a plan, per pass (module docstring).

    ``gpus_per_node``: ranks per node for the parts between nodes (0: one node).
    """
    doc, start, length, rank = _int64(shard_doc, shard_start, shard_len, shard_rank)
    if rank.size and (rank.min() < 0 or rank.max() >= cp):
        raise ValueError(f"shard ranks must lie in [0, {cp}), got {rank.min()}..{rank.max()}")
    return RecurrentExchange(maps=map_volumes_kernel(doc, start, rank, cp, int(gpus_per_node)),
                             conv=conv_volumes_kernel(doc, start, length, rank, cp, int(gpus_per_node),
                                                      shape.conv_width),
                             map_bytes=shape.map_bytes, conv_token_bytes=shape.conv_token_bytes)


@dataclass(frozen=True, kw_only=True, slots=True)
class SplitWork:
    """Tokens of recurrent work per rank for one plan, one layer and one pass. Arrays are (cp,) int64."""

    tokens: np.ndarray
    """Tokens each rank holds (the work of a plain recurrence over them)."""
    rerun_tokens: np.ndarray
    """Tokens run twice: the contributed pieces that do not start their document."""
    mapped_tokens: np.ndarray
    """Tokens of the contributed pieces (GDN runs them with ``K`` extra value columns)."""

    def gdn_value_column_tokens(self, shape: RecurrentShape) -> np.ndarray:
        """GDN's extra work in tokens of a plain run: ``rerun + mapped * K / V`` (float64, (cp,))."""
        return self.rerun_tokens + self.mapped_tokens * (shape.key_dim / shape.value_dim)

    def extra_tokens(self, shape: RecurrentShape) -> np.ndarray:
        """The extra work of ``shape``'s layers in tokens of a plain run, per rank (float64, (cp,))."""
        if shape.kind == "gdn":
            return self.gdn_value_column_tokens(shape)
        return self.rerun_tokens.astype(np.float64)


def split_work(shard_doc, shard_start, shard_len, shard_rank, cp: int) -> SplitWork:
    """Per rank: tokens held, tokens rerun and tokens mapped by the recurrent layers (``SplitWork``)."""
    doc, start, length, rank = _int64(shard_doc, shard_start, shard_len, shard_rank)
    contributes = recurrent_contributes(doc, start, length, rank, cp)
    rerun = contributes & (start > 0)
    return SplitWork(tokens=np.bincount(rank, weights=length, minlength=cp).astype(np.int64),
                     rerun_tokens=np.bincount(rank[rerun], weights=length[rerun], minlength=cp).astype(np.int64),
                     mapped_tokens=np.bincount(rank[contributes], weights=length[contributes],
                                               minlength=cp).astype(np.int64))
