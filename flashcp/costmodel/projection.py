"""Projected latency of one attention layer's forward + backward under a sharding plan (per rank, then step).

The model (every number from a ``HardwareProfile``; every formula for work and volume from
``flashcp.costmodel``):

- Attention: each shard is one sequence of a varlen kernel and computes whole query tiles, so its work is
  ``W = workload(start, Q)`` with its query count rounded up to the tile (``Q``); forward FLOPs
  ``4 * W * H * D``, backward 2.5x that. It runs at the profile's throughput for the *equivalent length*
  ``sqrt(2 * W)`` (a causal sequence of that length has the same work, and the curve was measured on such
  sequences). A kernel that does not skip the masked triangle (profile ``causal_skip`` 0, the CPU
  reference) computes the rectangle ``W = Q * (start + Q)`` instead, at equivalent length ``sqrt(W)``.
  Time is then non-decreasing in a shard's length and in its prefix. As in the runtime
  (``flashcp.runtime.attention``), a rank makes at most two kernel calls per pass, one over its *local*
  shards (whole key prefix on the rank) and one over its *remote* shards; each call adds
  ``kernel_overhead_us`` and each shard ``sequence_overhead_us`` (0 for FlashAttention on a GPU; the CPU
  reference kernels loop over shards).
- Communication: K/V bytes per token from ``kv_bytes_per_token``. A collective takes
  ``busiest rank's tokens * bytes / link_gbps + collective_latency_us``: ``(N-1) * max quota`` tokens for
  ``full``, ``(N-1) * max contribution`` for ``allgather``, ``max(sent, received)`` of the busiest rank for
  ``a2a``; the backward moves as many rows: the reversed all-to-all in the K/V dtype, the reduce-scatter
  (``allgather``, ``full``) in float32 (``grad_bytes_per_token``: it sums inside the collective).
  ``auto`` resolves with the runtime's own rule (``auto_comm_a2a``, ``CPAttnMeta.auto_comm``).
  With a topology (``gpus_per_node``: rank r on node ``r // gpus_per_node``; the profile's by default),
  rows inside a node move over ``link_gbps`` and rows between nodes over ``inter_node_gbps`` at once:
  ``objective.exchange_seconds`` of the busiest rank's rows on each link (``node_busiest``,
  ``allgather_node_rows``); the ring's block transfer then crosses nodes.
- Other: the runtime's copies (query and key/value gathers, the send buffer, the concatenation with the
  receive buffer, the output merge), each read and written once at ``hbm_gbps``; the backward's scatters
  are taken to cost the same as the forward's gathers.
- Step: without overlap, ``comm + attention + other`` per pass; with overlap (the runtime computes local
  shards while the exchange is in flight), forward ``max(comm, local) + remote`` and backward
  ``remote + max(comm, local)``. Collectives synchronise ranks, so each pass takes its slowest rank's time.
- Ring (``comm == "ring"``): ``N`` steps per pass, each as slow as its slowest rank's kernel on the visiting
  block or the block's transfer, whichever is longer (``ring_step_work``); steps after the first merge
  partial outputs in float32; the backward moves K/V and dK/dV blocks (twice the bytes).

- Layer kinds (``AttentionShape.layer_kinds``): each kind's layer is projected on its own, with its pairs
  (``workload.kind_workload``), its keys ``[key_start, end)``, its exchange volumes and local shards
  (``comm.exchange_volumes``, ``comm.kind_local_mask``) and its own ``auto`` choice; the result is the mean
  layer.

Per-rank times can instead be measured (``RankWork`` from ``flashcp.bench.measure``); communication is
then still projected. All results are *projected* unless a ``RankWork`` came from a measurement.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from flashcp.costmodel.comm import (
    RECEIVED,
    RECEIVED_FAR,
    SENT,
    SENT_FAR,
    allgather_node_rows,
    allgather_wire,
    auto_comm_a2a,
    busiest_rows,
    exchange_volumes,
    grad_bytes_per_token,
    kind_local_mask,
    node_busiest,
    ring_comm_tokens,
    ring_step_work,
)
from flashcp.costmodel.objective import RECURRENT_BWD, exchange_seconds, pair_seconds, token_seconds
from flashcp.costmodel.profile import HardwareProfile
from flashcp.costmodel.recurrent import recurrent_exchange, split_work
from flashcp.costmodel.shape import AttentionShape
from flashcp.costmodel.workload import FULL, PlanArrays, key_starts, kind_workloads, rank_tokens

__all__ = ["COMM_CHOICES", "RankWork", "StepLatency", "comm_volumes", "local_only_mask", "project_step", "rank_work",
           "recurrent_step_seconds", "resolve_comm", "shard_seconds"]


COMM_CHOICES = ("full", "allgather", "a2a", "auto", "ring")


@dataclass(frozen=True, kw_only=True, slots=True)
class RankWork:
    """Per-rank work of one layer, seconds; every array has shape (cp,).

    Kernel times include the per-call overhead. Copy times are per pass (the backward's scatters are taken
    to cost what the forward's gathers do). When ``measured``, the kernel times were timed on a GPU with the
    gathers inside them and the part copies are zero.
    """

    local_fwd: np.ndarray
    """Forward kernel over the local shards (whole key prefix on this rank)."""
    remote_fwd: np.ndarray
    """Forward kernel over the remote shards."""
    local_bwd: np.ndarray
    """Backward kernel over the local shards."""
    remote_bwd: np.ndarray
    """Backward kernel over the remote shards."""
    local_copy: np.ndarray
    """Gathers feeding the local kernel (queries, key prefixes)."""
    remote_copy: np.ndarray
    """Gathers feeding the remote kernel (queries, key prefixes, concatenation with the receive buffer)."""
    other_copy: np.ndarray
    """Send-buffer packing and the output merge."""
    kernels: np.ndarray
    """Attention kernel calls, forward + backward, (cp,) int64."""
    measured: bool = False
    """True when the kernel times were measured, not projected."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StepLatency:
    """One layer's forward + backward on the critical path, seconds, split like the paper's Figure 6."""

    total: float
    """Forward pass of the slowest rank plus backward pass of the slowest rank."""
    attn_fwd: float
    """Attention forward on the slowest forward rank (kernel overheads included)."""
    attn_bwd: float
    """Attention backward on the slowest backward rank."""
    comm: float
    """Communication not hidden behind compute, forward + backward."""
    other: float
    """Copies (gathers, merges) on the slowest ranks."""
    comm_mode: str
    """The exchange used (``auto`` resolved)."""
    comm_seconds: float
    """Time of the collectives themselves, forward + backward, hidden or not."""
    comm_bytes: int
    """Bytes the busiest rank sends per layer, forward + backward."""
    kernels: int
    """Most attention kernel calls on one rank per layer, forward + backward."""
    measured: bool
    """True when per-rank attention was measured (communication is always projected)."""
    recurrent: float = 0.0
    """A hybrid's recurrent layers (``recurrent_step_seconds``) spread over its attention layers: their step
    seconds over ``shape.layers``; included in ``total``."""

    def as_dict(self) -> dict:
        """Plain dict for JSON output."""
        return {name: getattr(self, name) for name in self.__slots__}


def _arrays(plan: PlanArrays) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    return plan.shard_doc, plan.shard_start, plan.shard_len, plan.shard_rank


def local_only_mask(plan: PlanArrays) -> np.ndarray:
    """Shards whose whole key prefix ``[0, end)`` lies on their own rank. Shape (num_shards,), bool.

    Matches ``CPAttnMeta.shard_local_only``: a document's prefix is all on rank r up to the start of its
    first shard on another rank, when its first shard is on r; otherwise no prefix of it is.
    """
    order = np.lexsort((plan.shard_start, plan.shard_doc))
    doc, rank, start = plan.shard_doc[order], plan.shard_rank[order], plan.shard_start[order]
    num_docs = int(doc.max()) + 1 if doc.size else 0
    first = np.r_[True, doc[1:] != doc[:-1]] if doc.size else np.zeros(0, bool)
    first_rank = np.full(num_docs, -1, np.int64)
    first_rank[doc[first]] = rank[first]
    foreign = rank != first_rank[doc]
    switch = np.full(num_docs, np.iinfo(np.int64).max, np.int64)
    np.minimum.at(switch, doc[foreign], start[foreign])
    end = plan.shard_start + plan.shard_len
    return (plan.shard_rank == first_rank[plan.shard_doc]) & (end <= switch[plan.shard_doc])


def shard_seconds(shard_start, shard_len, shape: AttentionShape, profile: HardwareProfile,
                  backward: bool = False, kind: int = FULL, size: int = 0) -> np.ndarray:
    """Projected kernel time of each shard (no call overhead), seconds. Shape (num_shards,), float64.

    ``kind``, ``size``: the layer kind (``workload.FULL``, ``WINDOW``, ``CHUNK``) and its W or K: the pairs
    are ``kind_workload``'s, the rectangle (no causal skip) spans the keys ``[key_start, end)``.
    """
    shard_start = np.ascontiguousarray(shard_start, dtype=np.int64)
    padded = profile.padded_rows(shard_len)
    if profile.causal_skip:
        pairs = kind_workloads(kind, size, shard_start, padded.astype(np.int64)).astype(np.float64)
        eq_len = np.sqrt(2.0 * pairs)
    else:
        pairs = padded * (shard_start - key_starts(kind, size, shard_start) + padded)
        eq_len = np.sqrt(pairs)
    return _pair_seconds(pairs, eq_len, shape, profile, backward) + profile.sequence_overhead_us * 1e-6


def _pair_seconds(pairs, eq_len, shape: AttentionShape, profile: HardwareProfile, backward: bool) -> np.ndarray:
    """Kernel time of sequences computing ``pairs`` query-key pairs each, at equivalent length ``eq_len``."""
    pairs = np.asarray(pairs, dtype=np.float64)
    eq_len = np.broadcast_to(np.asarray(eq_len, dtype=np.float64), pairs.shape)
    knots, values = profile.log_curve(backward)
    seconds = pair_seconds(np.ascontiguousarray(pairs.ravel()), np.ascontiguousarray(eq_len.ravel()),
                           float(shape.num_heads), float(shape.head_dim), backward, knots, values,
                           float(profile.peak_tflops))
    return seconds.reshape(pairs.shape)


def comm_volumes(plan: PlanArrays, gpus_per_node: int = 0, kind: int = FULL,
                 size: int = 0) -> dict[str, dict[str, np.ndarray]]:
    """Per comm mode, the rows each rank sends and receives in its forward collective (``send``, ``recv``).

    Each is (cp,) int64; all-gather rows include the padding to the largest slot, as the runtime sends them.
    ``near`` and ``far``: the busiest rank's rows inside its node and across nodes (``gpus_per_node`` ranks
    per node, 0: one node), which set the collective's time. ``kind``, ``size``: one layer's kind and W or K
    (``comm.exchange_volumes``); ``full`` gathers every rank's tokens whatever the kind.
    """
    cp = plan.cp
    tokens = rank_tokens(plan.shard_len, plan.shard_rank, cp)
    volumes = exchange_volumes(*_arrays(plan), cp, gpus_per_node, kind, size)
    quota = int(tokens.max())

    def gathered(rows):
        near, far = allgather_node_rows(rows, cp, gpus_per_node)
        return {"send": np.full(cp, rows), "recv": np.full(cp, cp * rows),
                "wire": np.full(cp, allgather_wire(rows, cp)), "near": int(near), "far": int(far)}

    near, far = node_busiest(volumes.sent, volumes.received, volumes.sent_far, volumes.received_far)
    return {"full": gathered(quota), "allgather": gathered(volumes.ag_slot),
            "a2a": {"send": volumes.sent, "recv": volumes.received, "recv_far": volumes.received_far,
                    "near": int(near), "far": int(far)}}


def resolve_comm(comm: str, volumes: dict, dtype_bytes: int = 2) -> str:
    """``auto`` -> ``a2a`` if its busiest rank moves fewer bytes than an all-gather rank, else ``allgather``.

    Bytes are forward K/V plus backward dK/dV, float32 in the reduce-scatter (``auto_comm_a2a``): the
    runtime's rule (``CPAttnMeta.auto_comm``), applied to ``comm_volumes``.
    """
    if comm != "auto":
        return comm
    a2a = volumes["a2a"]
    busiest = int(busiest_rows(a2a["send"], a2a["recv"]))
    cp = len(a2a["send"])
    slot = int(volumes["allgather"]["send"].max())
    return "a2a" if auto_comm_a2a(busiest, slot, cp, dtype_bytes) else "allgather"


def _row_bytes(mode: str, shape: AttentionShape, backward: bool) -> int:
    """Bytes of one row on the wire: K/V forward; dK/dV backward, in float32 for a reduce-scatter."""
    if backward and mode != "a2a":
        return grad_bytes_per_token(shape.num_kv_heads, shape.head_dim, shape.dtype_bytes)
    return shape.kv_row_bytes


def _collective_seconds(mode: str, volumes: dict, shape: AttentionShape, profile: HardwareProfile,
                        backward: bool = False) -> float:
    vol = volumes[mode]
    return exchange_seconds(vol["near"], vol["far"], float(_row_bytes(mode, shape, backward)), profile.link_gbps,
                            profile.inter_node_gbps, profile.collective_latency_us)


def _wire_bytes(mode: str, volumes: dict, shape: AttentionShape) -> int:
    vol = volumes[mode]
    tokens = int(vol["wire"].max()) if mode != "a2a" else int(vol["send"].max())
    return tokens * (_row_bytes(mode, shape, False) + _row_bytes(mode, shape, True))  # K/V + dK/dV


def rank_work(plan: PlanArrays, shape: AttentionShape, profile: HardwareProfile, mode: str,
              volumes: dict | None = None, kind: int = FULL, size: int = 0) -> RankWork:
    """Projected per-rank work of ``plan`` when K/V moves with ``mode`` (``full``, ``allgather``, ``a2a``).

    One layer of ``kind`` (``workload.FULL``, ``WINDOW``, ``CHUNK``; ``size`` its W or K): its shards' pairs,
    their keys ``[key_start, end)``, local when all of those are on the shard's rank (``comm.kind_local_mask``).
    """
    cp = plan.cp
    volumes = comm_volumes(plan, 0, kind, size) if volumes is None else volumes
    local = local_only_mask(plan) if kind == FULL else kind_local_mask(*_arrays(plan), cp, kind, size)
    overhead = profile.kernel_overhead_us * 1e-6
    hbm = profile.hbm_gbps * 1e9
    shard_start = np.ascontiguousarray(plan.shard_start, dtype=np.int64)
    keys = (plan.shard_start + plan.shard_len - key_starts(kind, size, shard_start)).astype(np.float64)
    tokens = rank_tokens(plan.shard_len, plan.shard_rank, cp).astype(np.float64)
    parts, copies, calls = {}, {}, np.zeros(cp, np.int64)
    for name, mask in (("local", local), ("remote", ~local)):
        ranks = plan.shard_rank[mask]
        busy = np.bincount(ranks, minlength=cp) > 0
        calls += 2 * busy
        for backward in (False, True):
            seconds = shard_seconds(plan.shard_start[mask], plan.shard_len[mask], shape, profile, backward, kind,
                                    size)
            parts[(name, backward)] = np.bincount(ranks, weights=seconds, minlength=cp) + overhead * busy
        # each copy reads and writes its bytes once
        copied = (np.bincount(ranks, weights=plan.shard_len[mask], minlength=cp) * shape.q_row_bytes
                  + np.bincount(ranks, weights=keys[mask], minlength=cp) * shape.kv_row_bytes)
        if name == "remote":
            copied = copied + busy * (tokens + volumes[mode]["recv"]) * shape.kv_row_bytes
        copies[name] = 2.0 * copied / hbm
    other = 2.0 * (volumes[mode]["send"] * shape.kv_row_bytes + 2.0 * tokens * shape.q_row_bytes) / hbm
    return RankWork(local_fwd=parts[("local", False)], remote_fwd=parts[("remote", False)],
                    local_bwd=parts[("local", True)], remote_bwd=parts[("remote", True)],
                    local_copy=copies["local"], remote_copy=copies["remote"], other_copy=other, kernels=calls)


def _pass(comm: float, first_kernel, first_copy, second_kernel, second_copy, other, overlap: bool,
          local_first: bool):
    """Per-rank ``(time, attention, copies, exposed comm)`` of one pass; ``time`` is the sum of the rest.

    Forward: local part (maybe overlapped with the exchange), then remote. Backward: remote part, then local
    (maybe overlapped with the reverse exchange).
    """
    local_time = first_kernel + first_copy if local_first else second_kernel + second_copy
    exposed = np.maximum(comm - local_time, 0.0) if overlap else np.full(local_time.shape, comm)
    attention = first_kernel + second_kernel
    copies = first_copy + second_copy + other
    return attention + copies + exposed, attention, copies, exposed


def project_step(plan: PlanArrays, shape: AttentionShape, profile: HardwareProfile, comm: str, overlap: bool,
                 work: RankWork | None = None, gpus_per_node: int | None = None,
                 token_layers: bool = False) -> StepLatency:
    """Latency of one layer's attention forward + backward under ``plan``, exchanging K/V with ``comm``.

    A shape with several layer kinds (``AttentionShape.layer_kinds``) prices each kind's layer on its own
    (its pairs, its exchange, its ``auto`` choice, its local part) and returns the mean layer: every field
    weighted by the kind's share of the layers (``comm_mode`` joins the kinds' modes with ``+``); times
    ``shape.layers`` it is ``objective.step_seconds``. ``ring`` prices every layer as full attention (its
    blocks visit every rank whatever a layer needs). Measured ``work`` is for full attention alone.

    ``comm`` is ``full``, ``allgather``, ``a2a``, ``auto`` or ``ring``; ``overlap`` computes local shards
    while the exchange is in flight (ignored for ``ring``, which always overlaps step by step). ``work``
    replaces the projected per-rank compute (e.g. with measured kernel times). ``gpus_per_node``: ranks per
    node (0: one node; None: the profile's). ``token_layers`` adds every rank's per-token layers to its
    passes (``objective.token_seconds``: a third forward, two thirds backward), which plans with token slack
    make unequal; ``total`` then holds them too, beside attention, exposed comm and copies. A hybrid's
    recurrent layers (``shape.recurrent``) add ``recurrent_step_seconds / shape.layers`` to ``total`` (and
    to the field ``recurrent``).
    """
    if comm not in COMM_CHOICES:
        raise ValueError(f"unknown comm mode '{comm}' (choose from {', '.join(COMM_CHOICES)})")
    per_node = profile.gpus_per_node if gpus_per_node is None else gpus_per_node
    step = _project_attention(plan, shape, profile, comm, overlap, work, per_node, token_layers)
    if shape.recurrent is None:
        return step
    spread = recurrent_step_seconds(plan, shape, profile, per_node) / shape.layers
    return replace(step, total=step.total + spread, recurrent=spread)


def recurrent_step_seconds(plan: PlanArrays, shape: AttentionShape, profile: HardwareProfile,
                           gpus_per_node: int) -> float:
    """Seconds of the step's recurrent layers (``shape.recurrent``; 0 without) under ``plan``, all layers.

    Per layer: the slowest rank's tokens plus its extra split work (``recurrent.split_work``) at
    ``flops_per_token`` on the profile's dense peak, forward, and twice that backward; each pass also waits
    for the all-to-all of the state maps and the one of the convolution inputs (``recurrent.recurrent_exchange``;
    the backward's reversed ones move as many bytes), each priced as an all-to-all's busiest rank inside and
    between nodes (``comm.node_busiest``), as the attention's ``a2a``.
    """
    rec = shape.recurrent
    if rec is None:
        return 0.0
    arrays = (*_arrays(plan), plan.cp)
    split = split_work(*arrays)
    work = split.tokens + split.extra_tokens(rec)
    forward = float(work.max()) * rec.flops_per_token / (profile.peak_tflops * 1e12)
    exchange = recurrent_exchange(rec, *arrays, gpus_per_node)
    comm = 0.0
    for rows, row_bytes in ((exchange.maps, exchange.map_bytes), (exchange.conv, exchange.conv_token_bytes)):
        near, far = node_busiest(rows[SENT], rows[RECEIVED], rows[SENT_FAR], rows[RECEIVED_FAR])
        comm += exchange_seconds(near, far, float(row_bytes), profile.link_gbps, profile.inter_node_gbps,
                                 profile.collective_latency_us)
    return rec.num_layers * ((forward + comm) + (RECURRENT_BWD * forward + comm))


def _project_attention(plan: PlanArrays, shape: AttentionShape, profile: HardwareProfile, comm: str, overlap: bool,
                       work: RankWork | None, per_node: int, token_layers: bool) -> StepLatency:
    """``project_step`` of the attention layers (and per-token layers) alone."""
    layers = _token_layer_seconds(plan, shape, profile) if token_layers else np.zeros(plan.cp)
    if comm == "ring":
        ring = _project_ring(plan, shape, profile, per_node)
        return replace(ring, total=ring.total + float(layers.max())) if token_layers else ring
    runs = shape.kind_runs()
    if work is not None and runs[0][0] != FULL:
        raise ValueError(f"measured per-rank work prices full attention only, but the shape has the layer kinds "
                         f"{shape.layer_kinds}: project it without measured work")
    steps = [_project_kind(plan, shape, profile, comm, overlap, work, per_node, layers, kind, size)
             for kind, size, _ in runs]
    if len(steps) == 1:
        return steps[0]
    # the mean layer: each kind weighted by its share of the layers
    weights = [count / shape.layers for _, _, count in runs]

    def mean(name: str) -> float:
        return sum(w * getattr(step, name) for w, step in zip(weights, steps))

    modes = dict.fromkeys(step.comm_mode for step in steps)
    return StepLatency(total=mean("total"), attn_fwd=mean("attn_fwd"), attn_bwd=mean("attn_bwd"), comm=mean("comm"),
                       other=mean("other"), comm_mode="+".join(modes), comm_seconds=mean("comm_seconds"),
                       comm_bytes=round(mean("comm_bytes")), kernels=max(step.kernels for step in steps),
                       measured=False)


def _project_kind(plan: PlanArrays, shape: AttentionShape, profile: HardwareProfile, comm: str, overlap: bool,
                  work: RankWork | None, per_node: int, layers: np.ndarray, kind: int, size: int) -> StepLatency:
    """``project_step`` of one layer of ``kind`` (``size`` its W or K), ``layers`` the per-token layers' seconds."""
    volumes = comm_volumes(plan, per_node, kind, size)
    mode = resolve_comm(comm, volumes, shape.dtype_bytes)
    work = rank_work(plan, shape, profile, mode, volumes, kind, size) if work is None else work
    seconds = _collective_seconds(mode, volumes, shape, profile)
    seconds_bwd = _collective_seconds(mode, volumes, shape, profile, backward=True)
    fwd, fwd_attn, fwd_copy, fwd_comm = _pass(seconds, work.local_fwd, work.local_copy, work.remote_fwd,
                                              work.remote_copy, work.other_copy, overlap, local_first=True)
    bwd, bwd_attn, bwd_copy, bwd_comm = _pass(seconds_bwd, work.remote_bwd, work.remote_copy, work.local_bwd,
                                              work.local_copy, work.other_copy, overlap, local_first=False)
    fwd, bwd = fwd + layers / 3.0, bwd + 2.0 * layers / 3.0
    f, b = int(np.argmax(fwd)), int(np.argmax(bwd))
    return StepLatency(total=float(fwd[f] + bwd[b]), attn_fwd=float(fwd_attn[f]), attn_bwd=float(bwd_attn[b]),
                       comm=float(fwd_comm[f] + bwd_comm[b]), other=float(fwd_copy[f] + bwd_copy[b]),
                       comm_mode=mode,
                       comm_seconds=seconds + seconds_bwd, comm_bytes=_wire_bytes(mode, volumes, shape),
                       kernels=int(work.kernels.max()), measured=work.measured)


def _token_layer_seconds(plan: PlanArrays, shape: AttentionShape, profile: HardwareProfile) -> np.ndarray:
    """(cp,) seconds of every rank's per-token layers, one layer, forward + backward."""
    tokens = rank_tokens(plan.shard_len, plan.shard_rank, plan.cp).astype(np.float64)
    return token_seconds(tokens, shape.token_flops(), profile.peak_tflops)


def _project_ring(plan: PlanArrays, shape: AttentionShape, profile: HardwareProfile,
                  gpus_per_node: int = 0) -> StepLatency:
    cp = plan.cp
    steps = ring_step_work(*_arrays(plan), cp)
    tokens = rank_tokens(plan.shard_len, plan.shard_rank, cp)
    sequences = np.maximum(steps.sequences, 1)
    pair_mean = steps.pairs / sequences
    row_mean = steps.query_tokens / sequences
    hbm = profile.hbm_gbps * 1e9
    busy = steps.sequences > 0
    # partial outputs (and dq in the backward) merge in float32 with their log-sum-exp: read two, write one
    merge = np.where(np.arange(cp)[None, :] > 0, 3.0 * steps.query_tokens * shape.num_heads
                     * (shape.head_dim + 1) * 4, 0.0)
    gathers = 2.0 * (steps.key_tokens * shape.kv_row_bytes + steps.query_tokens * shape.q_row_bytes)
    copy = (gathers + merge) / hbm
    # every step, rank r sends to r + 1: some pair crosses a node boundary when there are several nodes
    crosses = 0 < gpus_per_node < cp
    block = exchange_seconds(0 if crosses else int(tokens.max()), int(tokens.max()) if crosses else 0,
                             float(shape.kv_row_bytes), profile.link_gbps, profile.inter_node_gbps,
                             profile.collective_latency_us)
    sends = np.arange(cp) < cp - 1  # step s overlaps the transfer of the block used at step s + 1
    totals, attn, copies = [], [], []
    for backward, transfer in ((False, block), (True, 2 * block)):
        padded = pair_mean * profile.padded_rows(row_mean) / np.maximum(row_mean, 1.0)
        eq_len = np.sqrt(2.0 * np.maximum(padded, 1.0))
        each = _pair_seconds(padded, eq_len, shape, profile, backward) + profile.sequence_overhead_us * 1e-6
        kernel = sequences * each
        kernel = np.where(busy, kernel + profile.kernel_overhead_us * 1e-6, 0.0)
        compute = kernel + copy
        slowest = np.argmax(compute, axis=0)
        step_time = np.maximum(compute.max(axis=0), np.where(sends, transfer, 0.0))
        totals.append(float(step_time.sum()))
        attn.append(float(kernel[slowest, np.arange(cp)].sum()))
        copies.append(float(copy[slowest, np.arange(cp)].sum()))
    total = sum(totals)
    sent, _ = ring_comm_tokens(plan.shard_len, plan.shard_rank, cp)
    wire = 3 * int(sent.max()) * shape.kv_row_bytes  # K/V forward, K/V + dK/dV backward
    return StepLatency(total=total, attn_fwd=attn[0], attn_bwd=attn[1],
                       comm=max(0.0, total - sum(attn) - sum(copies)), other=sum(copies), comm_mode="ring",
                       comm_seconds=3 * (cp - 1) * block, comm_bytes=wire,
                       kernels=int(2 * busy.sum(axis=1).max()), measured=False)
