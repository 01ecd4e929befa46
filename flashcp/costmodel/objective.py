"""The step-time objective: one plan's projected step time, in Numba, for the planner's search.

This module holds the projection's formulas in one place: ``flashcp.costmodel.projection`` (``flashcp bench``)
imports the kernel time from here (the attention curve lives in ``flashcp.costmodel.curve``, the exchange
volumes in ``flashcp.costmodel.comm``), and :func:`step_seconds` assembles them exactly as
``projection.project_step(plan, shape, profile, "auto", overlap=True)`` does
(``tests/costmodel/test_objective.py`` checks that the two agree). The planner sees the model through one
float64 vector (:func:`model_vector`), so kernels compile once whatever the profile.

Per rank, one layer, forward and backward (docs/DESIGN.md cost model, ``flashcp.costmodel.projection``):

- attention: every shard is one sequence of a varlen kernel and computes whole query tiles; forward FLOPs
  ``4 W H D``, backward 2.5x, at the profile's throughput for the equivalent length ``sqrt(2 W)``; one call
  over the rank's local shards (whole key prefix on the rank) and one over its remote shards, each with
  ``kernel_overhead_us``, each shard with ``sequence_overhead_us``;
- exchange: ``auto`` (exact-need all-to-all when its busiest rank moves fewer bytes than an all-gather rank,
  else the compacted all-gather: ``comm.auto_comm_a2a``), ``tokens * bytes per token / link_gbps +
  collective_latency_us``; the backward moves dK/dV in the K/V dtype over all-to-all, in float32 over the
  all-gather's reduce-scatter; the local call runs while it is in flight, so only what the local part does
  not hide is paid;
- copies: the runtime's gathers, send buffer and merge at ``hbm_gbps``.

Step time: per layer kind of the model (``AttentionShape.layer_kinds``; all full by default), the slowest rank's
forward plus the slowest rank's backward of one layer of that kind (its own pairs, keys, exchange volumes,
``auto`` choice and local part), times that kind's layers, summed over the kinds. With token slack
(ranks holding unequal tokens), every rank also pays its tokens' per-token layers: ``token_flops`` FLOPs per
token and layer (projections and MLP, forward + backward: one third forward, two thirds backward) at the
profile's dense peak, ASSUMPTION (optimistic: real matmuls reach less, which makes tokens dearer and slack
worth less). A hybrid's recurrent layers (``AttentionShape.recurrent``) add their own slowest rank's forward and
backward per layer (:func:`recurrent_seconds`).
"""

from __future__ import annotations

import functools
import math

import numpy as np

from flashcp._numba import njit
from flashcp.costmodel.comm import (
    CONTRIBUTED,
    RECEIVED,
    RECEIVED_FAR,
    SENT,
    SENT_FAR,
    allgather_node_rows,
    auto_comm_a2a,
    busiest_rows,
    exchange_table_size,
    exchange_volumes_into,
    grad_bytes_per_token,
    kv_bytes_per_token,
    node_busiest,
    shard_is_local,
)
from flashcp.costmodel.curve import curve_at_length, curve_on_segment, curve_segment
from flashcp.costmodel.recurrent import contributed_kernel, conv_volumes_kernel, map_volumes_kernel
from flashcp.costmodel.shape import AttentionShape
from flashcp.costmodel.workload import FULL, key_start, kind_workload, kind_workloads

__all__ = ["BWD_FLOPS", "GPUS_PER_NODE_SLOT", "RECURRENT_BWD", "batch_step_seconds", "cached_model",
           "cached_shape_model", "exchange_seconds", "kind_count", "model_vector", "pair_flops", "pair_seconds",
           "plan_step_seconds", "price_shard", "rank_floor", "recurrent_exchange_seconds", "recurrent_seconds",
           "sequence_flops", "shard_seconds", "step_seconds", "step_seconds_of", "token_seconds"]


BWD_FLOPS = 2.5
"""Backward FLOPs per forward FLOP (the flash-attention benchmark convention the profile's curve uses)."""

RECURRENT_BWD = 2.0
"""Backward FLOPs per forward FLOP of a recurrent layer (ASSUMPTION: ``recurrent.py``'s module docstring)."""

# layout of the model vector
_H, _HKV, _D, _BYTES, _LAYERS, _TILE, _SKIP, _LINK, _HBM, _KERNEL, _SEQ, _COLL, _PEAK, _TOKEN_FLOPS, \
    _TOKEN_TFLOPS, GPUS_PER_NODE_SLOT, _INTER, _K, _KINDS, _RECURRENT = range(20)
# GPUS_PER_NODE_SLOT is public: the planner reads the topology (CP ranks per node, 0: one node) from the vector
# after the header: the curve (3 k values), then the layer kinds, (kind, size, count) each, then when
# model[_RECURRENT] is 1 the recurrent layers: (count, forward FLOPs per token, bytes per state map, bytes per
# convolution input token, convolution taps, extra tokens per contributed token)

_HEADER = 20
_RECURRENT_SLOTS = 6


def model_vector(profile, shape: AttentionShape, *, with_tokens: bool = False,
                 gpus_per_node: int | None = None) -> np.ndarray:
    """The float64 vector the Numba objective reads: shape, profile scalars, the attention curve, layer kinds.

    ``with_tokens`` prices the per-token layers too (only unequal token counts make them differ by rank).
    ``gpus_per_node``: CP ranks per node (rank r on node ``r // gpus_per_node``; 0: all ranks in one node);
    None takes the profile's own.
    """
    k = len(profile.lengths)
    runs = shape.kind_runs()
    rec = shape.recurrent
    vec = np.zeros(_HEADER + 3 * k + 3 * len(runs) + (_RECURRENT_SLOTS if rec is not None else 0), np.float64)
    vec[_H], vec[_HKV], vec[_D], vec[_BYTES] = shape.num_heads, shape.num_kv_heads, shape.head_dim, \
        shape.dtype_bytes
    vec[_LAYERS], vec[_TILE], vec[_SKIP] = shape.layers, profile.query_tile, float(profile.causal_skip)
    vec[_LINK], vec[_HBM] = profile.link_gbps, profile.hbm_gbps
    vec[_KERNEL], vec[_SEQ], vec[_COLL] = profile.kernel_overhead_us, profile.sequence_overhead_us, \
        profile.collective_latency_us
    vec[_PEAK] = profile.peak_tflops
    vec[_TOKEN_FLOPS] = shape.token_flops() if with_tokens else 0.0
    vec[_TOKEN_TFLOPS] = profile.peak_tflops
    vec[GPUS_PER_NODE_SLOT] = profile.gpus_per_node if gpus_per_node is None else gpus_per_node
    vec[_INTER] = profile.inter_node_gbps
    vec[_K] = k
    vec[_KINDS] = len(runs)
    vec[_HEADER + 3 * k:_HEADER + 3 * k + 3 * len(runs)] = np.asarray(runs, np.float64).ravel()
    if rec is not None:
        vec[_RECURRENT] = 1.0
        vec[-_RECURRENT_SLOTS:] = rec.num_layers, rec.flops_per_token, rec.map_bytes, rec.conv_token_bytes, \
            rec.conv_width, rec.mapped_extra
    vec[_HEADER:_HEADER + k] = np.log(np.asarray(profile.lengths, np.float64))
    vec[_HEADER + k:_HEADER + 2 * k] = np.log(np.asarray(profile.forward_tflops, np.float64))
    vec[_HEADER + 2 * k:_HEADER + 3 * k] = np.log(np.asarray(profile.backward_tflops, np.float64))
    return vec


@njit(cache=True)
def kind_count(model):
    """How many layer kinds ``model`` (``model_vector``) prices.

    The kernel seconds of a plan of n shards are ``kind_count * n`` values, kind-major (``shard_seconds``).
    """
    return np.int64(model[_KINDS])


@njit(cache=True, inline="always")
def _kind_of(model, j):
    """``(kind code, size, layers)`` of the model's ``j``-th layer kind (``AttentionShape.kind_runs``)."""
    at = _HEADER + 3 * np.int64(model[_K]) + 3 * j
    return np.int64(model[at]), np.int64(model[at + 1]), model[at + 2]


@njit(cache=True)
def pair_flops(heads, head_dim):
    """Forward FLOPs of one query-key pair of attention, one layer: ``4 H D`` (``QK^T`` and ``PV``)."""
    return 4.0 * heads * head_dim


def sequence_flops(row_offsets, doc_lens, shape: AttentionShape) -> np.ndarray:
    """Forward + backward FLOPs of each packed sequence under ``shape``: the price of a sequence.

    Per token and attention layer the per-token layers (``shape.token_flops()``); per document and attention
    layer its pairs under that layer's kind (``kind_workloads(kind, size, 0, n)``: full causal, window, chunk)
    at ``pair_flops`` forward and ``BWD_FLOPS`` times that backward; per token and recurrent layer
    (``shape.recurrent``) the recurrence at ``flops_per_token``, backward twice the forward (as
    ``recurrent_seconds`` prices it). How the sequence is sharded does not change it (a cut document's extra
    recurrent work is the plan's, not the sequence's); it is what a DP step balances.

    ``row_offsets`` (rows + 1,) int indexes the flat ``doc_lens`` (int) by row. Returns (rows,) float64.
    """
    row_offsets = np.asarray(row_offsets, dtype=np.int64)
    doc_lens = np.ascontiguousarray(doc_lens, dtype=np.int64)
    starts = np.zeros_like(doc_lens)
    doc_pairs = np.zeros(doc_lens.shape[0], np.int64)
    for kind, size, count in shape.kind_runs():
        doc_pairs += count * kind_workloads(kind, size, starts, doc_lens)
    pairs = np.concatenate([[0], np.cumsum(doc_pairs, dtype=np.int64)])
    tokens = np.concatenate([[0], np.cumsum(doc_lens, dtype=np.int64)])
    row_pairs = (pairs[row_offsets[1:]] - pairs[row_offsets[:-1]]).astype(np.float64)
    row_tokens = (tokens[row_offsets[1:]] - tokens[row_offsets[:-1]]).astype(np.float64)
    attention = pair_flops(shape.num_heads, shape.head_dim) * (1.0 + BWD_FLOPS)
    per_token = shape.layers * shape.token_flops()
    if shape.recurrent is not None:
        per_token += shape.recurrent.num_layers * shape.recurrent.flops_per_token * (1.0 + RECURRENT_BWD)
    return row_tokens * per_token + row_pairs * attention


@njit(cache=True)
def _pair_seconds_one(pairs, eq_len, heads, head_dim, backward, knots, values, peak):
    if pairs <= 0:
        return 0.0
    flops = pairs * pair_flops(heads, head_dim) * (BWD_FLOPS if backward else 1.0)
    return flops / (curve_at_length(eq_len, knots, values, peak) * 1e12)


@njit(cache=True)
def pair_seconds(pairs, eq_len, heads, head_dim, backward, knots, values, peak):
    """Kernel time of sequences computing ``pairs`` query-key pairs at equivalent length ``eq_len`` (1-D)."""
    out = np.empty(pairs.shape[0], np.float64)
    for i in range(pairs.shape[0]):
        out[i] = _pair_seconds_one(pairs[i], eq_len[i], heads, head_dim, backward, knots, values, peak)
    return out


@njit(cache=True)
def _shard_seconds_both(start, length, model, knots, fwd_curve, bwd_curve, kind, size):
    """Projected forward and backward kernel time of one shard under one layer kind (no call overhead), seconds.

    Its query count is rounded up to whole tiles; it runs at the curve's throughput for its equivalent
    length (``sqrt(2 W)`` of its pairs ``W = kind_workload`` when the kernel skips the masked part, else
    ``sqrt(W)`` of the rectangle of its queries by its keys ``[key_start, end)``).
    """
    tile = model[_TILE]
    padded = math.ceil(max(float(length), 1.0) / tile) * tile
    if model[_SKIP] > 0:
        pairs = float(kind_workload(kind, size, start, np.int64(padded)))
        eq_len = math.sqrt(2.0 * pairs)
    else:
        pairs = padded * (start - key_start(kind, size, start) + padded)
        eq_len = math.sqrt(pairs)
    if pairs <= 0:
        return model[_SEQ] * 1e-6, model[_SEQ] * 1e-6
    x = math.log(max(eq_len, 1.0))
    j = curve_segment(x, knots)
    flops = pairs * pair_flops(model[_H], model[_D])
    out_f = flops / (curve_on_segment(x, j, knots, fwd_curve, model[_PEAK]) * 1e12) + model[_SEQ] * 1e-6
    out_b = flops * BWD_FLOPS / (curve_on_segment(x, j, knots, bwd_curve, model[_PEAK]) * 1e12) \
        + model[_SEQ] * 1e-6
    return out_f, out_b


@njit(cache=True)
def shard_seconds(start, length, model):
    """Forward and backward kernel seconds of every shard under every layer kind (``_shard_seconds_both``).

    Two float64 arrays of ``kind_count(model) * n`` values, kind-major: kind j's seconds of shard i at
    ``j * n + i``.
    """
    k = np.int64(model[_K])
    knots = model[_HEADER:_HEADER + k]
    fwd_curve = model[_HEADER + k:_HEADER + 2 * k]
    bwd_curve = model[_HEADER + 2 * k:_HEADER + 3 * k]
    n = start.shape[0]
    sec_f = np.empty(kind_count(model) * n, np.float64)
    sec_b = np.empty(kind_count(model) * n, np.float64)
    for j in range(kind_count(model)):
        kind, size, _ = _kind_of(model, j)
        for i in range(n):
            sec_f[j * n + i], sec_b[j * n + i] = _shard_seconds_both(start[i], length[i], model, knots, fwd_curve,
                                                                     bwd_curve, kind, size)
    return sec_f, sec_b


@njit(cache=True)
def price_shard(start, length, model, sec_f, sec_b, i):
    """Write shard ``i``'s kernel seconds under every layer kind into ``sec_f``, ``sec_b`` (as :func:`shard_seconds`).

    ``start``, ``length``: the shard's; ``sec_f``, ``sec_b``: (``kind_count(model) * n``,) float64, kind-major.
    """
    k = np.int64(model[_K])
    kinds = kind_count(model)
    n = sec_f.shape[0] // kinds
    for j in range(kinds):
        kind, size, _ = _kind_of(model, j)
        sec_f[j * n + i], sec_b[j * n + i] = _shard_seconds_both(
            start, length, model, model[_HEADER:_HEADER + k], model[_HEADER + k:_HEADER + 2 * k],
            model[_HEADER + 2 * k:_HEADER + 3 * k], kind, size)


@njit(cache=True)
def token_seconds(tokens, token_flops, tflops):
    """Seconds of the per-token layers (projections and MLP) of ``tokens`` tokens, one layer.

    Forward + backward at ``tflops``, ``token_flops`` (``AttentionShape.token_flops``) per token; a third of
    it is the forward pass.
    """
    return tokens * token_flops / (tflops * 1e12)


@njit(cache=True)
def exchange_seconds(near_tokens, far_tokens, row_bytes, link_gbps, inter_node_gbps, latency_us):
    """Seconds of one collective whose busiest rank moves ``near_tokens`` rows in its node, ``far_tokens`` out.

    The rows come from ``cost.node_busiest`` or ``cost.allgather_node_rows``.

    The two links run at once: ``max(near * bytes / link, far * bytes / inter-node link) + latency``; 0 when
    nothing moves (every rank skips the exchange). Without a topology ``far`` is 0: ``near * bytes / link``.
    """
    if near_tokens <= 0 and far_tokens <= 0:
        return 0.0
    return max(near_tokens * row_bytes / (link_gbps * 1e9), far_tokens * row_bytes / (inter_node_gbps * 1e9)) \
        + latency_us * 1e-6


@njit(cache=True)
def step_seconds(doc, start, length, rank, cp, model):
    """Projected step time (seconds) of one plan: auto comm, local shards overlapping the exchange.

    ``doc, start, length, rank``: the plan's shard arrays (int64, any order); ``model``: ``model_vector``.
    """
    sec_f, sec_b = shard_seconds(start, length, model)
    return step_seconds_of(doc, start, length, rank, cp, model, sec_f, sec_b, -1)


@njit(cache=True)
def rank_floor(doc, start, length, rank, cp, model, of_rank):
    """A lower bound on :func:`step_seconds` that prices only rank ``of_rank``'s shards.

    It is that rank's own forward plus backward time: the step takes the slowest rank's of each, so never
    less; in floating point too, as both sum the same terms in the same order.
    """
    sec_f = np.zeros(kind_count(model) * start.shape[0], np.float64)
    sec_b = np.zeros(kind_count(model) * start.shape[0], np.float64)
    for i in range(start.shape[0]):
        if rank[i] == of_rank:
            price_shard(start[i], length[i], model, sec_f, sec_b, i)
    return step_seconds_of(doc, start, length, rank, cp, model, sec_f, sec_b, of_rank)


@njit(cache=True)
def step_seconds_of(doc, start, length, rank, cp, model, sec_f, sec_b, only):
    """:func:`step_seconds` given every shard's kernel seconds (``shard_seconds``, kind-major).

    A search that moves a few shards then prices only those. ``only`` >= 0: that rank's forward plus
    backward time alone (``rank_floor``; only its shards' seconds are read). Each layer kind is priced on its
    own (``_layer_seconds``) and counts once per layer of that kind.
    """
    num_shards = doc.shape[0]
    num_docs = 0
    for i in range(num_shards):
        num_docs = max(num_docs, doc[i] + 1)
    # one allocation for every integer table (this runs once per move of the search)
    scratch = exchange_table_size(num_docs, num_shards, cp)
    table = np.zeros(5 * cp + scratch + 3 * num_docs, np.int64)
    total = 0.0
    for j in range(kind_count(model)):
        kind, size, count = _kind_of(model, j)
        if j > 0:
            table[:5 * cp + scratch] = 0
        seconds = _layer_seconds(doc, start, length, rank, cp, model, sec_f[j * num_shards:(j + 1) * num_shards],
                                 sec_b[j * num_shards:(j + 1) * num_shards], only, kind, size, table, num_docs)
        total += count * seconds
    if model[_RECURRENT] > 0:
        total += recurrent_seconds(doc, start, length, rank, cp, model, only)
    return total


@njit(cache=True)
def recurrent_seconds(doc, start, length, rank, cp, model, only):
    """The model's recurrent layers under a plan, forward and backward, seconds (0 without recurrent layers).

    Per layer and pass: the slowest rank's recurrence over its tokens plus its rerun and mapped tokens
    (``recurrent.split_work``'s ``extra_tokens``) at ``flops_per_token`` (backward twice the forward) at the
    profile's dense peak, plus the two all-to-alls (``recurrent_exchange_seconds``), not hidden: the pieces
    wait for their start states. ``only`` >= 0: that rank's recurrence alone (the exchange is every rank's).
    """
    if model[_RECURRENT] <= 0:
        return 0.0
    at = model.shape[0] - _RECURRENT_SLOTS
    count, flops, mapped_extra = model[at], model[at + 1], model[at + 5]
    contributes = contributed_kernel(doc, start)
    work = np.zeros(cp, np.float64)
    for i in range(doc.shape[0]):
        r = rank[i]
        extra = 0.0
        if contributes[i]:
            extra = mapped_extra * length[i] + (length[i] if start[i] > 0 else 0.0)
        work[r] += length[i] + extra
    worst = 0.0
    for r in range(cp):
        if only < 0 or r == only:
            worst = max(worst, work[r])
    comm = recurrent_exchange_seconds(doc, start, length, rank, cp, model)
    forward = worst * flops / (model[_PEAK] * 1e12)
    return count * ((forward + comm) + (RECURRENT_BWD * forward + comm))


@njit(cache=True)
def recurrent_exchange_seconds(doc, start, length, rank, cp, model):
    """Seconds of one recurrent layer's exchange in one pass: the state maps' all-to-all and the inputs'.

    Each (``recurrent.map_volumes_kernel``, ``conv_volumes_kernel``) at its busiest rank's rows inside and
    between nodes (``comm.node_busiest``) plus the collective latency; the backward's reversed all-to-alls
    move as many bytes. 0 for an exchange in which no row crosses ranks (the runtime skips it).
    """
    at = model.shape[0] - _RECURRENT_SLOTS
    map_bytes, token_bytes, width = model[at + 2], model[at + 3], np.int64(model[at + 4])
    per_node = np.int64(model[GPUS_PER_NODE_SLOT])
    maps = map_volumes_kernel(doc, start, rank, cp, per_node)
    conv = conv_volumes_kernel(doc, start, length, rank, cp, per_node, width)
    near, far = node_busiest(maps[SENT], maps[RECEIVED], maps[SENT_FAR], maps[RECEIVED_FAR])
    seconds = exchange_seconds(near, far, map_bytes, model[_LINK], model[_INTER], model[_COLL])
    near, far = node_busiest(conv[SENT], conv[RECEIVED], conv[SENT_FAR], conv[RECEIVED_FAR])
    return seconds + exchange_seconds(near, far, token_bytes, model[_LINK], model[_INTER], model[_COLL])


@njit(cache=True, inline="always")
def _layer_seconds(doc, start, length, rank, cp, model, sec_f, sec_b, only, kind, size, table, num_docs):
    """One layer of ``kind`` (``size`` W or K): the slowest rank's forward plus the slowest rank's backward.

    ``sec_f, sec_b``: (num_shards,) this kind's kernel seconds; ``table``: zeros but for its last
    ``3 * num_docs`` slots. The exchange volumes are ``comm.exchange_volumes_into``'s for the kind
    (all-gather contributions, exact-need sent and received, their parts across nodes).
    """
    kv_row = 1.0 * kv_bytes_per_token(model[_HKV], model[_D], model[_BYTES])
    q_row = model[_H] * model[_D] * model[_BYTES]
    hbm = model[_HBM] * 1e9
    per_node = np.int64(model[GPUS_PER_NODE_SLOT])
    num_shards = doc.shape[0]
    scratch = exchange_table_size(num_docs, num_shards, cp)
    volumes = table[:5 * cp].reshape((5, cp))
    exchange_volumes_into(volumes, table[5 * cp:5 * cp + scratch], doc, start, length, rank, cp, per_node,
                          num_docs, True, kind, size)
    sent = volumes[SENT]
    received = volumes[RECEIVED]
    full = kind == FULL
    local = shard_is_local(table[5 * cp:5 * cp + scratch], num_docs, num_shards, cp)
    # full attention: a document's prefix is local to its first shard's rank up to the first start of its
    # shards elsewhere (``projection.local_only_mask``); found in one pass: when a shard on another rank takes
    # the first place, the old first shard is the earliest elsewhere (other kinds: ``comm.shard_is_local``)
    big = np.iinfo(np.int64).max
    at = 5 * cp + scratch
    first_start = table[at:at + num_docs]
    first_rank = table[at + num_docs:at + 2 * num_docs]
    switch = table[at + 2 * num_docs:at + 3 * num_docs]
    if full:
        first_start[:] = big
        first_rank[:] = -1
        switch[:] = big
        for i in range(num_shards):
            d, r = doc[i], rank[i]
            if start[i] < first_start[d]:
                if first_rank[d] >= 0 and first_rank[d] != r:
                    switch[d] = first_start[d]
                first_start[d] = start[i]
                first_rank[d] = r
            elif r != first_rank[d]:
                switch[d] = min(switch[d], start[i])
    slot = volumes[CONTRIBUTED].max()
    busiest = busiest_rows(sent, received)
    use_a2a = auto_comm_a2a(busiest, slot, cp, np.int64(model[_BYTES]))
    if use_a2a:
        near, far = node_busiest(sent, received, volumes[SENT_FAR], volumes[RECEIVED_FAR])
        grad_row = kv_row
    else:
        near, far = allgather_node_rows(slot, cp, per_node)
        grad_row = 1.0 * grad_bytes_per_token(model[_HKV], model[_D], model[_BYTES])  # reduce-scatter: float32
    comm = exchange_seconds(near, far, kv_row, model[_LINK], model[_INTER], model[_COLL])
    comm_b = exchange_seconds(near, far, grad_row, model[_LINK], model[_INTER], model[_COLL])

    # per rank and part (0 local: the whole key prefix on the shard's own rank, 1 remote): forward,
    # backward kernel seconds, query rows, key rows, busy
    sums = np.zeros((5, 2, cp), np.float64)
    kern_f = sums[0]
    kern_b = sums[1]
    rows = sums[2]
    keys = sums[3]
    busy = sums[4]
    for i in range(num_shards):
        r = rank[i]
        if only >= 0 and r != only:
            continue
        if full:
            part = 0 if r == first_rank[doc[i]] and start[i] + length[i] <= switch[doc[i]] else 1
        else:
            part = 0 if local[i] else 1
        kern_f[part, r] += sec_f[i]
        kern_b[part, r] += sec_b[i]
        rows[part, r] += length[i]
        keys[part, r] += start[i] + length[i] - key_start(kind, size, start[i])
        busy[part, r] = 1.0
    overhead = model[_KERNEL] * 1e-6
    worst_f = 0.0
    worst_b = 0.0
    for r in range(cp):
        if only >= 0 and r != only:
            continue
        send = float(sent[r]) if use_a2a else float(slot)
        recv = float(received[r]) if use_a2a else float(cp * slot)
        local_f = kern_f[0, r] + overhead * busy[0, r]
        remote_f = kern_f[1, r] + overhead * busy[1, r]
        local_b = kern_b[0, r] + overhead * busy[0, r]
        remote_b = kern_b[1, r] + overhead * busy[1, r]
        tokens = rows[0, r] + rows[1, r]  # whole numbers: exact in float64
        local_copy = 2.0 * (rows[0, r] * q_row + keys[0, r] * kv_row) / hbm
        remote_copy = 2.0 * (rows[1, r] * q_row + keys[1, r] * kv_row
                             + busy[1, r] * (tokens + recv) * kv_row) / hbm
        other = 2.0 * (send * kv_row + 2.0 * tokens * q_row) / hbm
        token_time = token_seconds(tokens, model[_TOKEN_FLOPS], model[_TOKEN_TFLOPS])
        # forward: local first (overlapping the exchange), then remote; backward: remote, then local
        fwd = (local_f + remote_f) + (local_copy + remote_copy + other) \
            + max(comm - (local_f + local_copy), 0.0)
        bwd = (remote_b + local_b) + (remote_copy + local_copy + other) \
            + max(comm_b - (local_b + local_copy), 0.0)
        worst_f = max(worst_f, fwd + token_time / 3.0)
        worst_b = max(worst_b, bwd + 2.0 * token_time / 3.0)
    return worst_f + worst_b


@functools.lru_cache(maxsize=16)
def cached_model(profile: str | None, num_heads: int, num_kv_heads: int, head_dim: int,
                 layers: int, with_tokens: bool = False, gpus_per_node: int | None = None) -> np.ndarray:
    """``model_vector`` of a profile file (None: the default profile) and a model shape; do not modify.

    ``gpus_per_node``: the topology (None: the profile's own).
    """
    shape = AttentionShape(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, layers=layers)
    return cached_shape_model(profile, shape, with_tokens, gpus_per_node)


@functools.lru_cache(maxsize=16)
def cached_shape_model(profile: str | None, shape: AttentionShape, with_tokens: bool = False,
                       gpus_per_node: int | None = None) -> np.ndarray:
    """``model_vector`` of a profile file (None: the default profile) and ``shape``; do not modify."""
    from flashcp.costmodel.profile import load_profile

    return model_vector(load_profile(profile), shape, with_tokens=with_tokens, gpus_per_node=gpus_per_node)


def plan_step_seconds(plan, model: np.ndarray) -> float:
    """:func:`step_seconds` of a :class:`~flashcp.planner.plan.SequencePlan`."""
    return float(step_seconds(plan.shard_doc, plan.shard_start, plan.shard_len, plan.shard_rank, plan.cp,
                              model))


@njit(cache=True)
def batch_step_seconds(shard_offsets, doc, start, length, rank, cp, model):
    """:func:`step_seconds` of every row of flat plans (``shard_offsets`` (rows + 1,)). Shape (rows,)."""
    rows = shard_offsets.shape[0] - 1
    out = np.empty(rows, np.float64)
    for row in range(rows):
        lo = shard_offsets[row]
        hi = shard_offsets[row + 1]
        out[row] = step_seconds(doc[lo:hi], start[lo:hi], length[lo:hi], rank[lo:hi], cp, model)
    return out
