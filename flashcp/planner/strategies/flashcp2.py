"""Numba kernels of ``flashcp2``: a portfolio of candidate plans and a local search under the step-time
objective.

Rules in flashcp.planner.strategies; ``tests/naive.py`` holds the plain-Python reference of the search.

Arrays as flashcp.planner.strategies describes them (a plan: ``doc, start, length, rank``, (num_shards,) int64
each, sorted by (rank, position) and merged as ``pieces.finish_pieces`` leaves them); besides, ``sec_f, sec_b``
(kinds * num_shards,) float64, every shard's forward and backward kernel seconds under each of the model's
layer kinds (``objective.shard_seconds``, kind-major), and
``model`` (num_params,) float64, the step-time model (``objective.model_vector``).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from flashcp._numba import njit
from flashcp.costmodel.comm import exact_need_received_kernel
from flashcp.costmodel.objective import GPUS_PER_NODE_SLOT, kind_count, price_shard, shard_seconds, step_seconds_of
from flashcp.costmodel.sort import order_of
from flashcp.costmodel.workload import (
    imbalance_of,
    offsets_of,
    rank_workloads_kernel,
    slack_tokens,
    token_quotas_kernel,
    workload,
)
from flashcp.planner.strategies.baselines import llama3_kernel, llama3_within
from flashcp.planner.strategies.flashcp import flashcp_bounded, flashcp_kernel
from flashcp.planner.strategies.flashcp_plus import flashcp_plus_bounded, flashcp_plus_kernel
from flashcp.planner.strategies.peers import magi_kernel, magi_within, place_span, ptrr_kernel
from flashcp.planner.strategies.pieces import (
    add_piece,
    finish_pieces,
    lightest_under,
    lightest_with_room,
    new_pieces,
    new_rank_totals,
)
from flashcp.planner.strategies.topology import relabel_kernel, traffic_matrix

__all__ = [
    "MAX_EXTRA_SHARDS",
    "MAX_ZIGZAG",
    "affinity_assign",
    "affinity_chunks",
    "affinity_kernel",
    "flashcp2_kernel",
    "local_search",
    "on_nodes",
]

# --- the portfolio's constants

ALGORITHM_1_TARGET = 1.05
"""Algorithm 1's R when it runs as a candidate: the paper's default (and ``flashcp``'s), so that the candidate
is exactly the ``flashcp`` plan whenever that plan needs at most ``MAX_ZIGZAG`` Per-Doc documents."""
PLUS_TARGET = 1.01
"""``flashcp+``'s own target: the portfolio's first candidate runs at it (or at the ceiling when lower)."""
MAX_ZIGZAG = 8
"""Documents the ``flashcp+`` and Algorithm 1 candidates may zigzag (each adds about two shards per rank):
a bound on their planning time (each further document is one more plan built)."""
MAX_EXTRA_SHARDS = 32
"""Shards per rank a candidate may add beyond one per document (``N * 32`` in all): more are not taken."""
RECEIVE_TIE = 0.02
"""Portfolio candidates within this share of the best step time count as equally fast: the one with the
lower largest receive wins (never one slower than ``flashcp+``). 2% closes the receive gap to ``flashcp+``
at cp 4 for about 0.5% of step time there (bench/RESULTS.md)."""
SPLITS = (4, 8, 16)
"""Chunk sizes of the chunked candidates, as fractions of a rank's quota: ``(C // N) // s`` (2048, 1024 and
512 tokens at C = 131072, N = 16). The affinity candidates' chunks are cut once per split."""
UNCUT = 1 << 40
"""The chunk size a split is cut at when no candidate of the effort uses it: longer than any document, so one
chunk a document, cut for nothing (the cuts are one tuple, each entry cut)."""

# --- the portfolio: a table of named candidates, tried in order after the first plan

ALGORITHM_1 = 0
"""``flashcp_bounded`` at ``ALGORITHM_1_TARGET``: with ``flashcp+`` it sets the time to beat."""
PLUS_AT_CEILING = 1
"""``flashcp_plus_bounded`` at the ceiling ``target`` (none when that is ``PLUS_TARGET`` or lower: the first
plan is that plan)."""
AFFINITY = 2
"""``affinity_assign``: chunks of ``(C // N) // split`` tokens, neighbours preferred within ``tolerance``."""
MAGI = 3
"""``magi_within`` at chunks of ``(C // N) // split`` tokens."""
LLAMA3 = 4
"""``llama3_within``."""


class Candidate(NamedTuple):
    """One entry of ``PORTFOLIO`` (numba reads the table as a tuple of these)."""

    kind: int
    """Which kernel builds it: ``ALGORITHM_1``, ``PLUS_AT_CEILING``, ``AFFINITY``, ``MAGI`` or ``LLAMA3``."""
    split: int
    """Chunk size as a fraction of a rank's quota, ``(C // N) // split`` (``AFFINITY`` and ``MAGI``; else 0)."""
    tolerance: float
    """Workload the neighbour of a chunk may hold above the least-loaded rank, as a share of the mean rank
    workload (``AFFINITY``; else 0.0)."""
    min_effort: int
    """The lowest ``effort`` that tries it."""


PORTFOLIO = (
    Candidate(ALGORITHM_1, 0, 0.0, 0),
    Candidate(PLUS_AT_CEILING, 0, 0.0, 0),
    # the chunked assignments, the most often best first (the first three run at effort 0)
    Candidate(AFFINITY, 4, 0.03, 0),
    Candidate(AFFINITY, 8, 0.1, 0),
    Candidate(AFFINITY, 8, 0.01, 0),
    Candidate(AFFINITY, 16, 0.01, 1),
    Candidate(AFFINITY, 8, 0.03, 1),
    Candidate(AFFINITY, 4, 0.01, 1),
    Candidate(AFFINITY, 16, 0.03, 1),
    Candidate(AFFINITY, 16, 0.1, 1),
    Candidate(MAGI, 8, 0.0, 1),
    Candidate(LLAMA3, 0, 0.0, 1),
    Candidate(MAGI, 16, 0.0, 2),
    Candidate(MAGI, 4, 0.0, 2),
)
"""The candidates after the first plan (``flashcp+`` at ``PLUS_TARGET``), in the order they are tried (the order
decides ties): each is taken or not by ``flashcp2_kernel``'s rules (strategies' docstring)."""

# --- the peers the final plan is checked against, at their registry defaults (tests check they agree)

PEER_FLASHCP_TARGET = 1.05
"""``flashcp``'s default ``target_imbalance``."""
PEER_MAGI_CHUNK = 512
"""``magi``'s default ``chunk_size``."""
PEER_PTRR_CHUNK = 128
"""``ptrr``'s default ``chunk_size``."""
PEERS = ("flashcp+", "magi", "flashcp", "llama3", "ptrr")
"""The strategies whose default plans ``flashcp2`` is never slower than under its objective, in the order they
are tried (``_fastest_of_peers``)."""

# --- the local search's constants

EVALS_PER_EFFORT = 16
"""Objective evaluations of the local search per unit of ``effort``."""
STEPS = (1024, 256, 64, 16)
"""Boundary shifts the local search tries, largest first."""

# --- the shard-seconds memo

MEMO_SLOTS = 1024
"""Slots of ``_price_shards``'s memo: a power of two (a slot is the low bits of a hash), enough for the shards
that the few candidates of one sequence share (a collision only prices a shard again)."""
MEMO_MULTIPLIER = 40503
"""The memo's hash of a shard, ``start * MEMO_MULTIPLIER + length``: about 2**16 / golden ratio, odd
(Fibonacci hashing), so that starts on multiples of one chunk size spread over the slots instead of sharing
a few."""


# --- the local search


@njit(cache=True)
def local_search(doc, start, length, rank, cp, model, target, budget, window):
    """Improve a plan in place by boundary moves; returns (step seconds, evaluations used).

    A paired move shifts two document boundaries between the same two ranks at once by the same ``delta``
    so that tokens go from rank x to rank y at the first and back at the second (every rank keeps its
    tokens). With a token ``window`` > 0 (token slack), each pass first tries single boundary moves that keep
    both ranks within ``window`` tokens of their quotas. Shifts come from ``STEPS`` (largest first); a move is
    kept when the step time drops, the imbalance stays within ``target`` and the largest receive does not
    grow (``_try_move``); a pass over all moves repeats while it improves, until ``budget`` objective
    evaluations are spent.

    Args:
        doc, start, length, rank: the plan, (num_shards,) int64 each; ``start`` and ``length`` change in place.
        cp: number of CP ranks.
        model: (num_params,) float64, the step-time model (``objective.model_vector``).
        target: the largest imbalance (max / mean rank workload) a kept move may leave, float.
        budget: most objective evaluations, int.
        window: tokens a rank may hold above or below its quota, int (0: exact quotas, no single moves).
    """
    sec_f, sec_b = shard_seconds(start, length, model)
    return _local_search_priced(doc, start, length, rank, cp, model, target, budget, window, sec_f, sec_b)


@njit(cache=True)
def _local_search_priced(doc, start, length, rank, cp, model, target, budget, window, sec_f, sec_b):
    """``local_search`` given every shard's kernel seconds ``sec_f, sec_b`` ((kinds * num_shards,) float64, updated
    in place, re-priced only for the shards a move touches): the portfolio has them from pricing its best
    candidate.
    """
    work = rank_workloads_kernel(start, length, rank, cp)
    best = step_seconds_of(doc, start, length, rank, cp, model, sec_f, sec_b, -1)
    received = exact_need_received_kernel(doc, start, length, rank, cp).max()
    left, right = _boundaries(doc, start, length)
    tokens = _rank_tokens(length, rank, cp)
    quotas = token_quotas_kernel(tokens.sum(), cp)
    used = 0
    improved = True
    while improved and used < budget:
        improved = False
        for step in STEPS:
            if window > 0:
                best, received, used, kept = _single_moves(step, left, right, doc, start, length, rank, cp, model,
                                                           target, work, sec_f, sec_b, best, received, used,
                                                           budget, tokens, quotas, window)
                improved = improved or kept
            best, received, used, kept = _paired_moves(step, left, right, doc, start, length, rank, cp, model,
                                                       target, work, sec_f, sec_b, best, received, used, budget)
            improved = improved or kept
            if used >= budget:
                return best, used
    return best, used


@njit(cache=True)
def _single_moves(step, left, right, doc, start, length, rank, cp, model, target, work, sec_f, sec_b, best,
                  received, used, budget, tokens, quotas, window):
    """One pass of single boundary moves by ``step`` tokens, each keeping both ranks within ``window`` tokens
    of their ``quotas``; returns (step seconds, largest receive, evaluations used, whether a move was kept).

    Args:
        step: shift in tokens, > 0 (each boundary is tried at +step, then -step).
        left, right: (num_boundaries,) int64, the shard pairs of ``_boundaries``.
        tokens: (cp,) int64, every rank's tokens, updated when a move is kept.
        quotas: (cp,) int64, the equal-token quotas.
        window: tokens a rank may hold above or below its quota, int > 0.
        The others as ``_try_move``'s; ``used`` and ``budget`` as ``local_search``'s.
    """
    improved = False
    for i in range(left.shape[0]):
        a_l, a_r = left[i], right[i]
        for sign in (1, -1):
            delta = sign * step
            if not _keeps_both(a_l, a_r, delta, length):
                continue
            gain, lose = rank[a_l], rank[a_r]  # +delta: the earlier piece's rank gains delta tokens
            if delta < 0:
                gain, lose = lose, gain
            if tokens[gain] + step > quotas[gain] + window or tokens[lose] - step < quotas[lose] - window:
                continue
            if used >= budget:
                return best, received, used, improved
            used += 1
            kept, best, received = _try_move(a_l, a_r, delta, -1, -1, 0, doc, start, length, rank, cp, model,
                                             target, work, sec_f, sec_b, best, received)
            if kept:
                improved = True
                tokens[gain] += step
                tokens[lose] -= step
                break
    return best, received, used, improved


@njit(cache=True)
def _paired_moves(step, left, right, doc, start, length, rank, cp, model, target, work, sec_f, sec_b, best,
                  received, used, budget):
    """One pass of paired moves by ``step`` tokens over every two boundaries between the same two ranks;
    returns (step seconds, largest receive, evaluations used, whether a move was kept).

    Arguments as ``_single_moves``'s.
    """
    improved = False
    num_boundaries = left.shape[0]
    for i in range(num_boundaries):
        a_l, a_r = left[i], right[i]
        x, y = rank[a_r], rank[a_l]  # boundary i: +delta moves tokens of rank x to rank y
        for j in range(i + 1, num_boundaries):
            b_l, b_r = left[j], right[j]
            # boundary j must move them back
            if rank[b_l] == x and rank[b_r] == y:
                sign_j = 1
            elif rank[b_l] == y and rank[b_r] == x:
                sign_j = -1
            else:
                continue
            for sign in (1, -1):
                d_a = sign * step
                d_b = sign * sign_j * step
                if not _keeps_both(a_l, a_r, d_a, length) or not _keeps_both(b_l, b_r, d_b, length):
                    continue
                if used >= budget:
                    return best, received, used, improved
                used += 1
                kept, best, received = _try_move(a_l, a_r, d_a, b_l, b_r, d_b, doc, start, length, rank, cp,
                                                 model, target, work, sec_f, sec_b, best, received)
                if kept:
                    improved = True
                    break
    return best, received, used, improved


@njit(cache=True)
def _try_move(a_l, a_r, d_a, b_l, b_r, d_b, doc, start, length, rank, cp, model, target, work, sec_f, sec_b,
              best, received):
    """Shift boundary ``(a_l, a_r)`` by ``d_a`` tokens and boundary ``(b_l, b_r)`` by ``d_b`` (none when
    ``b_l`` is -1), and keep the move when the imbalance stays within ``target``, the step time drops below
    ``best`` and the largest receive stays at most ``received``; else undo it. Returns (kept, step seconds,
    largest receive): the plan's new ones when kept, else ``best`` and ``received``.

    Args:
        a_l, a_r, b_l, b_r: shard indices of two touching shards of one document on different ranks (``_boundaries``).
        d_a, d_b: shifts in tokens (> 0: the boundary moves right); each leaves both its shards non-empty.
        doc, start, length, rank: the plan, (num_shards,) int64 each; ``start`` and ``length`` change in place.
        cp: number of CP ranks.
        model: (num_params,) float64, the step-time model.
        target: the largest imbalance a kept move may leave, float.
        work: (cp,) int64, every rank's workload, kept up to date.
        sec_f, sec_b: (kinds * num_shards,) float64, every shard's kernel seconds, kept up to date.
        best: the plan's step seconds, float.
        received: the plan's largest exact-need receive (rows), int.
    """
    _add_work(a_l, a_r, b_l, b_r, start, length, rank, work, -1)
    _shift(a_l, a_r, d_a, start, length)
    if b_l >= 0:
        _shift(b_l, b_r, d_b, start, length)
    _add_work(a_l, a_r, b_l, b_r, start, length, rank, work, 1)
    if imbalance_of(work) <= target:
        saved = _reprice(a_l, a_r, b_l, b_r, start, length, model, sec_f, sec_b)
        got = step_seconds_of(doc, start, length, rank, cp, model, sec_f, sec_b, -1)
        if got < best:
            now = exact_need_received_kernel(doc, start, length, rank, cp).max()
            if now <= received:
                return True, got, now
        _restore(a_l, a_r, b_l, b_r, saved, sec_f, sec_b)
    _add_work(a_l, a_r, b_l, b_r, start, length, rank, work, -1)
    if b_l >= 0:
        _shift(b_l, b_r, -d_b, start, length)
    _shift(a_l, a_r, -d_a, start, length)
    _add_work(a_l, a_r, b_l, b_r, start, length, rank, work, 1)
    return False, best, received


@njit(cache=True)
def _boundaries(doc, start, length):
    """Pairs ``(left, right)`` of shard indices that touch inside one document on different ranks: two
    (num_boundaries,) int64 arrays, by (document, position)."""
    n = doc.shape[0]
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    order = order_of(doc * (start.max() + 1) + start)  # (doc, start) pairs are unique
    left = np.empty(n, np.int64)
    right = np.empty(n, np.int64)
    m = 0
    for j in range(1, n):
        a = order[j - 1]
        b = order[j]
        if doc[a] == doc[b] and start[a] + length[a] == start[b]:
            left[m] = a
            right[m] = b
            m += 1
    return left[:m], right[:m]


@njit(cache=True)
def _keeps_both(left, right, delta, length):
    """Whether moving the boundary between touching shards ``left`` and ``right`` by ``delta`` tokens leaves
    both non-empty."""
    return not (delta > 0 and length[right] <= delta or delta < 0 and length[left] <= -delta)


@njit(cache=True)
def _shift(left, right, delta, start, length):
    """Move the boundary between touching shards ``left`` and ``right`` by ``delta`` tokens (> 0: right)."""
    length[left] += delta
    start[right] += delta
    length[right] -= delta


@njit(cache=True)
def _add_work(a, b, c, d, start, length, rank, work, sign):
    """Add (``sign`` 1) or take away (-1) the workloads of the distinct shards among ``a, b, c, d`` (-1: none)
    to ``work`` ((cp,) int64), so a move updates the ranks' workloads without summing every shard.
    """
    touched = (a, b, c, d)
    for k in range(4):
        i = touched[k]
        if i < 0 or (k > 0 and i == a) or (k > 1 and i == b) or (k > 2 and i == c):
            continue
        work[rank[i]] += sign * workload(start[i], length[i])


@njit(cache=True)
def _reprice(a, b, c, d, start, length, model, sec_f, sec_b):
    """Re-price shards ``a, b, c, d`` (-1: none) after a move; returns their old seconds to ``_restore``
    ((2, 4, kinds) float64: forward, backward)."""
    n = start.shape[0]
    kinds = sec_f.shape[0] // n
    saved = np.empty((2, 4, kinds), np.float64)
    touched = (a, b, c, d)
    for k in range(4):
        i = touched[k]
        if i >= 0:
            for j in range(kinds):
                saved[0, k, j] = sec_f[j * n + i]
                saved[1, k, j] = sec_b[j * n + i]
            price_shard(start[i], length[i], model, sec_f, sec_b, i)
    return saved


@njit(cache=True)
def _restore(a, b, c, d, saved, sec_f, sec_b):
    """Undo ``_reprice`` (in reverse order, so a shard touched twice gets its first saved value back)."""
    touched = (a, b, c, d)
    kinds = saved.shape[2]
    n = sec_f.shape[0] // kinds
    for k in range(3, -1, -1):
        i = touched[k]
        if i >= 0:
            for j in range(kinds):
                sec_f[j * n + i] = saved[0, k, j]
                sec_b[j * n + i] = saved[1, k, j]


@njit(cache=True)
def _rank_tokens(length, rank, cp):
    """Tokens of every rank, (cp,) int64."""
    tokens = np.zeros(cp, np.int64)
    for i in range(rank.shape[0]):
        tokens[rank[i]] += length[i]
    return tokens


# --- the chunked assignment that keeps documents contiguous


@njit(cache=True)
def affinity_kernel(lens, cp, chunk, tolerance):
    """Chunked assignment that keeps documents contiguous: MinHeap order with a preference for neighbours.

    Every document is cut into chunks of ``chunk`` tokens from its end (its first chunk is the shorter
    one). Chunks go by decreasing workload (ties: lower document, then later chunk) to the least-loaded
    rank with room for them (ties: lowest rank), except that the rank holding the chunk right after it in
    the same document takes it when it has room and stays within the mean workload: that rank then holds
    one contiguous piece and receives only the prefix before it. Quotas: when no rank has room for a chunk,
    the least-loaded rank with room takes its head and the rest goes on (as in ``magi``).

    Args:
        lens: (num_docs,) int64 document lengths, each > 0.
        cp: number of CP ranks.
        chunk: chunk size in tokens, int > 0.
        tolerance: workload the neighbour may hold above the least-loaded rank, as a share of the mean rank
            workload, float.

    Returns the plan: ``doc, start, length, rank``, (num_shards,) int64 each.
    """
    return affinity_assign(lens, cp, affinity_chunks(lens, chunk), tolerance, np.inf)


@njit(cache=True)
def affinity_chunks(lens, chunk):
    """``affinity_kernel``'s chunks, the same for every tolerance (so the portfolio cuts them once per size).

    Args:
        lens: (num_docs,) int64 document lengths.
        chunk: chunk size in tokens, int > 0.

    Returns ``(cdoc, cstart, clen, cwork, total, order)``: every chunk's document, start, length and
    workload ((num_chunks,) int64 each, by document, each document's chunks from its end), the total workload
    (int) and the placing order ((num_chunks,) int64: by decreasing workload, ties by index).
    """
    num_docs = lens.shape[0]
    num_chunks = 0
    for d in range(num_docs):
        num_chunks += (lens[d] + chunk - 1) // chunk
    cdoc = np.empty(num_chunks, np.int64)
    cstart = np.empty(num_chunks, np.int64)
    clen = np.empty(num_chunks, np.int64)
    cwork = np.empty(num_chunks, np.int64)
    total = 0
    k = 0
    for d in range(num_docs):
        end = lens[d]
        while end > 0:
            take = min(chunk, end)
            cdoc[k] = d
            cstart[k] = end - take
            clen[k] = take
            cwork[k] = workload(end - take, take)
            total += cwork[k]
            end -= take
            k += 1
    # by decreasing workload, ties by index (a stable sort)
    return cdoc, cstart, clen, cwork, total, order_of(cwork.max() - cwork if num_chunks else cwork)


@njit(cache=True)
def affinity_assign(lens, cp, chunks, tolerance, limit):
    """``affinity_kernel`` on cut ``chunks`` (``affinity_chunks``); no shards (empty arrays) when the ranks'
    workloads miss imbalance ``limit`` (float; ``np.inf``: none), known before the pieces are sorted and
    merged (a shard's workload is the sum of its pieces', so the plan's imbalance is the one of ``load``).
    """
    cdoc, cstart, clen, cwork, total, order = chunks
    num_chunks = cdoc.shape[0]
    quotas = token_quotas_kernel(lens.sum(), cp)
    mean = total / cp
    owner = np.full(num_chunks, -1, np.int64)  # rank of each chunk, -1 until placed (or when split)
    offsets = offsets_of(lens)
    capacity = 2 * num_chunks + 4 * cp + 4
    pdoc, pstart, plen, prank = new_pieces(capacity)
    load, tokens = new_rank_totals(cp)
    count = 0
    for j in range(num_chunks):
        i = order[j]
        size = clen[i]
        best = lightest_with_room(tokens, quotas, load, size, cp)
        # chunk i - 1 is the one after it in the same document (chunks were cut from the end)
        if i > 0 and cdoc[i - 1] == cdoc[i] and owner[i - 1] >= 0:
            near = owner[i - 1]
            if quotas[near] - tokens[near] >= size and load[near] + cwork[i] <= mean and \
                    (best < 0 or load[near] <= load[best] + tolerance * mean):
                best = near
        if best >= 0:
            count = add_piece(cdoc[i], cstart[i], size, best, pdoc, pstart, plen, prank, count)
            load[best] += cwork[i]
            tokens[best] += size
            owner[i] = best
            continue
        pos = offsets[cdoc[i]] + cstart[i]  # no rank has room for all of it: split, head first
        count = place_span(offsets, pos, pos + size, lightest_under(tokens, quotas, load, cp), quotas, tokens, load,
                           -1, cp, pdoc, pstart, plen, prank, count)
    if imbalance_of(load) > limit:
        return pdoc[:0], pstart[:0], plen[:0], prank[:0]
    return finish_pieces(pdoc, pstart, plen, prank, count, lens)


# --- the portfolio


@njit(cache=True)
def _chunk_of(lens, cp, split):
    """The chunk size ``(C // N) // split`` (at least 1 token)."""
    return max(np.int64(1), lens.sum() // cp // split)


@njit(cache=True)
def _affinity_cuts(lens, cp, effort):
    """``affinity_chunks`` at each of ``SPLITS``, in that order (a split no candidate of ``effort`` uses is cut
    at ``UNCUT``)."""
    return (affinity_chunks(lens, _cut_size(lens, cp, SPLITS[0], effort)),
            affinity_chunks(lens, _cut_size(lens, cp, SPLITS[1], effort)),
            affinity_chunks(lens, _cut_size(lens, cp, SPLITS[2], effort)))


@njit(cache=True)
def _cut_size(lens, cp, split, effort):
    """``_chunk_of`` ``split`` when an ``AFFINITY`` candidate of ``effort`` uses it, else ``UNCUT``."""
    for candidate in PORTFOLIO:
        if candidate.kind == AFFINITY and candidate.split == split and candidate.min_effort <= effort:
            return _chunk_of(lens, cp, split)
    return np.int64(UNCUT)


# inlined into its one caller: compiled on its own, numba would optimise and emit every candidate's kernel once
# more (flashcp.planner.batch says why)
@njit(cache=True, inline="always")
def _candidate(lens, cp, candidate, cuts, target):
    """The plan of ``PORTFOLIO`` entry ``candidate``, or no shards (empty arrays) when it misses imbalance
    ``target`` (the ceiling, float) or has no plan. ``cuts``: ``_affinity_cuts``.
    """
    kind = candidate.kind
    if kind == ALGORITHM_1:
        return flashcp_bounded(lens, cp, ALGORITHM_1_TARGET, target, MAX_ZIGZAG)
    if kind == PLUS_AT_CEILING:
        if target <= PLUS_TARGET:
            return lens[:0], lens[:0], lens[:0], lens[:0]
        return flashcp_plus_bounded(lens, cp, target, MAX_ZIGZAG)
    if kind == AFFINITY:
        split = candidate.split
        return affinity_assign(lens, cp, cuts[0] if split == SPLITS[0] else cuts[1] if split == SPLITS[1] else
                               cuts[2], candidate.tolerance, target)
    if kind == MAGI:
        return magi_within(lens, cp, _chunk_of(lens, cp, candidate.split), target)
    return llama3_within(lens, cp, target)


@njit(cache=True)
def on_nodes(lens, doc, start, length, rank, cp, per_node):
    """The plan with its ranks placed on nodes (``topology.relabel_kernel``), sorted again; the plan itself
    without a topology.

    Args:
        lens: (num_docs,) int64 document lengths.
        doc, start, length, rank: the plan, (num_shards,) int64 each.
        cp: number of CP ranks.
        per_node: ranks per node, int (0 or at least ``cp``: no topology).
    """
    if per_node <= 0 or per_node >= cp or doc.shape[0] == 0:
        return doc, start, length, rank
    tokens = _rank_tokens(length, rank, cp)
    placed = relabel_kernel(rank, tokens, traffic_matrix(doc, start, length, rank, cp), cp, per_node)
    return finish_pieces(doc.copy(), start.copy(), length.copy(), placed, doc.shape[0], lens)


@njit(cache=True)
def flashcp2_kernel(lens, cp, target, effort, model, slack):
    """The ``flashcp2`` plan of one sequence: the first plan, the best of ``PORTFOLIO`` under the step time,
    then local search (rules in flashcp.planner.strategies).

    Args:
        lens: (num_docs,) int64 document lengths, each > 0.
        cp: number of CP ranks.
        target: the imbalance ceiling (max / mean rank workload), float.
        effort: int >= 0; which candidates run (``Candidate.min_effort``) and ``EVALS_PER_EFFORT`` search
            evaluations per unit.
        model: (num_params,) float64, the step-time model (``objective.model_vector``; its topology too).
        slack: token slack, a share of a rank's quota (``slack_tokens``), float >= 0.

    Returns the plan: ``doc, start, length, rank``, (num_shards,) int64 each, sorted and merged.
    """
    per_node = np.int64(model[GPUS_PER_NODE_SLOT])
    memo = _new_memo(kind_count(model))
    best_doc, best_start, best_len, best_rank = flashcp_plus_bounded(lens, cp, min(target, PLUS_TARGET), MAX_ZIGZAG)
    best_doc, best_start, best_len, best_rank = on_nodes(lens, best_doc, best_start, best_len, best_rank, cp,
                                                         per_node)
    best_f = np.empty(kind_count(model) * best_doc.shape[0], np.float64)
    best_b = np.empty(kind_count(model) * best_doc.shape[0], np.float64)
    _price_shards(best_start, best_len, best_rank, model, best_f, best_b, -1, False, memo)
    best_time = step_seconds_of(best_doc, best_start, best_len, best_rank, cp, model, best_f, best_b, -1)
    # every candidate must meet the ceiling, and flashcp+ sets the time to beat; when flashcp+ misses the
    # ceiling, the first candidate within it that is not slower replaces it
    work = rank_workloads_kernel(best_start, best_len, best_rank, cp)
    best_imbalance = imbalance_of(work)
    plus_time = best_time
    best_received = exact_need_received_kernel(best_doc, best_start, best_len, best_rank, cp).max()
    most_shards = lens.shape[0] + MAX_EXTRA_SHARDS * cp
    cuts = _affinity_cuts(lens, cp, effort)
    for c in range(len(PORTFOLIO)):
        candidate = PORTFOLIO[c]
        if candidate.min_effort > effort:
            continue
        doc, start, length, rank = _candidate(lens, cp, candidate, cuts, target)
        if doc.shape[0] == 0 or doc.shape[0] > most_shards:  # over the ceiling, or too many shards
            continue
        work = rank_workloads_kernel(start, length, rank, cp)
        imbalance = imbalance_of(work)
        if imbalance > target:  # cheap test first
            continue
        doc, start, length, rank = on_nodes(lens, doc, start, length, rank, cp, per_node)
        # Algorithm 1 sets the time to beat with flashcp+: it wins when it is faster
        sets_pace = candidate.kind == ALGORITHM_1
        within = best_imbalance <= target
        # the busiest rank's own time bounds the step time from below (``rank_floor``): skip what cannot
        # win unpriced; its shards' seconds then serve the step time too
        sec_f, sec_b, busiest = _price_busiest(start, length, rank, cp, model, memo)
        floor = step_seconds_of(doc, start, length, rank, cp, model, sec_f, sec_b, busiest)
        if not _may_win(floor, sets_pace, within, plus_time, best_time):
            continue
        _price_shards(start, length, rank, model, sec_f, sec_b, busiest, False, memo)
        t = step_seconds_of(doc, start, length, rank, cp, model, sec_f, sec_b, -1)
        if not _may_win(t, sets_pace, within, plus_time, best_time):
            continue
        received = exact_need_received_kernel(doc, start, length, rank, cp).max()
        if sets_pace:
            plus_time = t
        elif within and not _wins_tie(t, imbalance, received, best_time, best_imbalance, best_received):
            continue
        best_doc, best_start, best_len, best_rank, best_time = doc, start, length, rank, t
        best_f, best_b = sec_f, sec_b
        best_received = received
        best_imbalance = imbalance
    if effort > 0:
        start = best_start.copy()
        length = best_len.copy()
        _local_search_priced(best_doc, start, length, best_rank, cp, model, max(target, best_imbalance),
                             effort * EVALS_PER_EFFORT, slack_tokens(slack, lens.sum(), cp), best_f, best_b)
        best_doc, best_start, best_len, best_rank = finish_pieces(best_doc, start, length, best_rank,
                                                                  best_doc.shape[0], lens)
        # merged pieces price as one shard: the finished plan's own time is the one to beat
        best_f = np.empty(kind_count(model) * best_doc.shape[0], np.float64)
        best_b = np.empty(kind_count(model) * best_doc.shape[0], np.float64)
        _price_shards(best_start, best_len, best_rank, model, best_f, best_b, -1, False, memo)
        best_time = step_seconds_of(best_doc, best_start, best_len, best_rank, cp, model, best_f, best_b, -1)
    return _fastest_of_peers(lens, cp, model, memo, best_doc, best_start, best_len, best_rank, best_time)


@njit(cache=True)
def _fastest_of_peers(lens, cp, model, memo, doc, start, length, rank, seconds):
    """The plan, or the first of the ``PEERS``' default plans that is faster under the step time (``seconds``:
    the plan's): whatever the ceiling and the ties chose, ``flashcp2`` is never slower than any of them.

    A peer whose busiest rank alone is not faster (``rank_floor``) is not priced further.
    """
    for peer in range(len(PEERS)):
        if peer == 0:
            p_doc, p_start, p_len, p_rank = flashcp_plus_kernel(lens, cp, PLUS_TARGET)
        elif peer == 1:
            p_doc, p_start, p_len, p_rank = magi_kernel(lens, cp, PEER_MAGI_CHUNK)
        elif peer == 2:
            p_doc, p_start, p_len, p_rank = flashcp_kernel(lens, cp, PEER_FLASHCP_TARGET)
        elif peer == 3:
            p_doc, p_start, p_len, p_rank = llama3_kernel(lens, cp)
        else:
            p_doc, p_start, p_len, p_rank = ptrr_kernel(lens, cp, PEER_PTRR_CHUNK)
        sec_f, sec_b, busiest = _price_busiest(p_start, p_len, p_rank, cp, model, memo)
        if step_seconds_of(p_doc, p_start, p_len, p_rank, cp, model, sec_f, sec_b, busiest) >= seconds:
            continue
        _price_shards(p_start, p_len, p_rank, model, sec_f, sec_b, busiest, False, memo)
        t = step_seconds_of(p_doc, p_start, p_len, p_rank, cp, model, sec_f, sec_b, -1)
        if t < seconds:
            doc, start, length, rank, seconds = p_doc, p_start, p_len, p_rank, t
    return doc, start, length, rank


@njit(cache=True)
def _price_busiest(start, length, rank, cp, model, memo):
    """The kernel seconds of the busiest rank's shards (``_price_shards``): ``(sec_f, sec_b, busiest)``, the
    seconds (kinds * num_shards,) float64 (0.0 on the other ranks' shards) and the rank (the lowest of the
    busiest)."""
    busiest = np.argmax(rank_workloads_kernel(start, length, rank, cp))
    sec_f = np.zeros(kind_count(model) * start.shape[0], np.float64)
    sec_b = np.zeros(kind_count(model) * start.shape[0], np.float64)
    _price_shards(start, length, rank, model, sec_f, sec_b, busiest, True, memo)
    return sec_f, sec_b, busiest


@njit(cache=True)
def _may_win(seconds, sets_pace, within, plus_time, best_time):
    """Whether a candidate of step time ``seconds`` (or a lower bound of it) may replace the best plan.

    Never when slower than ``flashcp+`` (``plus_time``). While the best plan meets the ceiling (``within``):
    only when faster than ``best_time`` by more than ``RECEIVE_TIE`` of it, or (``_wins_tie``) within that
    share; the pace-setting candidate (Algorithm 1) only when faster.
    """
    if seconds > plus_time:
        return False
    return not (within and (seconds >= best_time * (1.0 + RECEIVE_TIE) or sets_pace and seconds >= best_time))


@njit(cache=True)
def _wins_tie(seconds, imbalance, received, best_time, best_imbalance, best_received):
    """Whether a candidate that ``_may_win`` replaces the best plan: not when it is not faster and less
    balanced; within ``RECEIVE_TIE`` of the best time, only with a lower largest receive, or an equal one and
    faster.
    """
    if seconds >= best_time and imbalance > best_imbalance:
        return False
    return not (seconds >= best_time * (1.0 - RECEIVE_TIE) and (received > best_received or
                                                                 received == best_received and seconds >= best_time))


@njit(cache=True)
def _price_shards(start, length, rank, model, sec_f, sec_b, of_rank, on_rank, memo):
    """Kernel seconds (``price_shard``) of the shards on rank ``of_rank`` (``on_rank``) or of all the
    others, written into ``sec_f``/``sec_b``: ``shard_seconds``'s values, in two passes.

    ``memo`` (``_new_memo``) keeps the seconds of recently priced (start, length) pairs: candidates of one
    sequence share many shards (whole documents, the same chunks), and a hit returns the same values.

    Args:
        start, length, rank: the plan's, (num_shards,) int64 each.
        model: (num_params,) float64, the step-time model.
        sec_f, sec_b: (kinds * num_shards,) float64, kind-major, written for the shards priced.
        of_rank: a rank (int; -1: none).
        on_rank: True: price the shards on ``of_rank``; False: all the others.
        memo: ``(keys, seconds)``, (MEMO_SLOTS, 2) int64 (start, length) and (MEMO_SLOTS, 2, kinds) float64.
    """
    keys, seconds = memo
    mask = keys.shape[0] - 1
    num_shards = start.shape[0]
    kinds = seconds.shape[2]
    for i in range(num_shards):
        if (rank[i] == of_rank) == on_rank:
            s = start[i]
            n = length[i]
            slot = (s * MEMO_MULTIPLIER + n) & mask
            if keys[slot, 0] == s and keys[slot, 1] == n:
                for j in range(kinds):
                    sec_f[j * num_shards + i] = seconds[slot, 0, j]
                    sec_b[j * num_shards + i] = seconds[slot, 1, j]
                continue
            price_shard(s, n, model, sec_f, sec_b, i)
            keys[slot, 0] = s
            keys[slot, 1] = n
            for j in range(kinds):
                seconds[slot, 0, j] = sec_f[j * num_shards + i]
                seconds[slot, 1, j] = sec_b[j * num_shards + i]


@njit(cache=True)
def _new_memo(kinds):
    """An empty ``_price_shards`` memo: ``MEMO_SLOTS`` slots of (start, length), -1 when empty, and their
    two seconds under each of ``kinds`` layer kinds."""
    return np.full((MEMO_SLOTS, 2), -1, np.int64), np.empty((MEMO_SLOTS, 2, kinds), np.float64)
