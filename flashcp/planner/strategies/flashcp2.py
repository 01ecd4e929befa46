"""Numba kernels of ``flashcp2``: a portfolio of candidate plans and a local search under the step-time
objective.

Rules in flashcp.planner.strategies; ``tests/naive.py`` holds the plain-Python reference of the search.
"""

from __future__ import annotations

import numpy as np

from flashcp._numba import njit
from flashcp.costmodel.comm import exact_need_received_kernel
from flashcp.costmodel.objective import GPUS_PER_NODE_SLOT, one_shard_seconds, shard_seconds, step_seconds_of
from flashcp.costmodel.sort import order_of
from flashcp.costmodel.workload import (
    imbalance_of,
    offsets_of,
    rank_workloads_kernel,
    slack_tokens,
    token_quotas_kernel,
    workload,
)
from flashcp.planner.strategies.baselines import llama3_within
from flashcp.planner.strategies.flashcp import flashcp_bounded
from flashcp.planner.strategies.flashcp_plus import flashcp_plus_bounded
from flashcp.planner.strategies.peers import magi_within, place_span
from flashcp.planner.strategies.pieces import finish_pieces, lightest_under, new_pieces
from flashcp.planner.strategies.topology import relabel_kernel, traffic_matrix

__all__ = ["affinity_kernel", "flashcp2_kernel", "local_search", "slack_tokens"]

SPLITS = (4, 8, 16)
"""Chunk sizes of the portfolio's chunked candidates, as fractions of a rank's quota: ``(C // N) // s``
(2048, 1024 and 512 tokens at C = 131072, N = 16)."""
PORTFOLIO_SPLITS = (16, 4)
"""``magi`` candidates at effort 2 and more, besides ``magi`` at ``(C // N) // 8`` (effort 1)."""
AFFINITY = ((4, 0.03), (8, 0.1), (8, 0.01), (16, 0.01), (8, 0.03), (4, 0.01), (16, 0.03), (16, 0.1))
"""The constructive candidates ``(split, tolerance)`` of ``affinity_kernel``, chunk ``(C // N) // split``,
the most often best first."""
FAST = 3
"""Affinity candidates at effort 0."""
EVALS_PER_EFFORT = 16
"""Objective evaluations of the local search per unit of ``effort``."""
RECEIVE_TIE = 0.02
"""Portfolio candidates within this share of the best step time count as equally fast: the one with the
lower largest receive wins (never one slower than ``flashcp+``). 2% closes the receive gap to ``flashcp+``
at cp 4 for about 0.5% of step time there (bench/RESULTS.md)."""
STEPS = (1024, 256, 64, 16)
"""Boundary shifts the local search tries, largest first."""
PLUS_TARGET = 1.01
"""``flashcp+``'s own target: the portfolio's first candidate runs at it (or at the ceiling when lower)."""
MAX_EXTRA_SHARDS = 32
"""Shards per rank a candidate may add beyond one per document (``N * 32`` in all): more are not taken."""
MAX_ZIGZAG = 8
"""Documents the ``flashcp+`` and Algorithm 1 candidates may zigzag (each adds about two shards per rank):
a bound on their planning time (each further document is one more plan built)."""


@njit(cache=True)
def _imbalance(start, length, rank, cp):
    return imbalance_of(rank_workloads_kernel(start, length, rank, cp))


@njit(cache=True)
def _boundaries(doc, start, length):
    """Pairs ``(left, right)`` of shard indices that touch inside one document on different ranks."""
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
def _shift(left, right, delta, start, length):
    """Move the boundary between touching shards ``left`` and ``right`` by ``delta`` tokens (> 0: right)."""
    length[left] += delta
    start[right] += delta
    length[right] -= delta


@njit(cache=True)
def _add_work(a, b, c, d, start, length, rank, work, sign):
    """Add (``sign`` 1) or take away (-1) the workloads of the distinct shards among ``a, b, c, d`` (-1: none)
    to ``work`` (per rank), so a move updates the ranks' workloads without summing every shard.
    """
    touched = (a, b, c, d)
    for k in range(4):
        i = touched[k]
        if i < 0 or (k > 0 and i == a) or (k > 1 and i == b) or (k > 2 and i == c):
            continue
        work[rank[i]] += sign * workload(start[i], length[i])


@njit(cache=True)
def _reprice(a, b, c, d, start, length, model, sec_f, sec_b):
    """Re-price shards ``a, b, c, d`` (-1: none) after a move; returns their old seconds to ``_restore``."""
    saved = np.empty((2, 4), np.float64)
    touched = (a, b, c, d)
    for k in range(4):
        i = touched[k]
        if i >= 0:
            saved[0, k] = sec_f[i]
            saved[1, k] = sec_b[i]
            sec_f[i], sec_b[i] = one_shard_seconds(start[i], length[i], model)
    return saved


@njit(cache=True)
def _restore(a, b, c, d, saved, sec_f, sec_b):
    """Undo ``_reprice`` (in reverse order, so a shard touched twice gets its first saved value back)."""
    touched = (a, b, c, d)
    for k in range(3, -1, -1):
        i = touched[k]
        if i >= 0:
            sec_f[i] = saved[0, k]
            sec_b[i] = saved[1, k]


@njit(cache=True)
def local_search(doc, start, length, rank, cp, model, target, budget, window):
    """Improve a plan in place by paired boundary moves; returns (step seconds, evaluations used).

    A move shifts two document boundaries at once by the same ``delta`` so that tokens go from rank x to
    rank y at the first and back at the second (every rank keeps its tokens). With a token ``window`` > 0
    (token slack), each pass first tries single boundary moves that keep both ranks within ``window`` tokens
    of their quotas. Moves are tried for every pair
    of boundaries between the same two ranks, shifts from ``STEPS`` (largest first), and kept when the step
    time drops, the imbalance stays within ``target`` and the largest receive does not grow; a pass over all
    moves repeats while it improves,
    until ``budget`` objective evaluations are spent.
    """
    sec_f, sec_b = shard_seconds(start, length, model)
    return _local_search_priced(doc, start, length, rank, cp, model, target, budget, window, sec_f, sec_b)


@njit(cache=True)
def _local_search_priced(doc, start, length, rank, cp, model, target, budget, window, sec_f, sec_b):
    """``local_search`` given every shard's kernel seconds (``shard_seconds``; updated in place): the
    portfolio has them from pricing its best candidate.
    """
    # every shard's kernel seconds, re-priced only for the shards a move touches
    work = rank_workloads_kernel(start, length, rank, cp)
    best = step_seconds_of(doc, start, length, rank, cp, model, sec_f, sec_b, -1)
    received = exact_need_received_kernel(doc, start, length, rank, cp).max()
    used = 0
    left, right = _boundaries(doc, start, length)
    nb = left.shape[0]
    tokens = np.zeros(cp, np.int64)
    for i in range(doc.shape[0]):
        tokens[rank[i]] += length[i]
    quotas = token_quotas_kernel(tokens.sum(), cp)
    improved = True
    while improved and used < budget:
        improved = False
        for step in STEPS:
            # with a token window: single boundary moves that keep both ranks within it
            for i in range(nb if window > 0 else 0):
                a_l, a_r = left[i], right[i]
                for sign_i in (1, -1):
                    d_i = sign_i * step
                    if d_i > 0 and length[a_r] <= d_i or d_i < 0 and length[a_l] <= -d_i:
                        continue
                    gain, lose = rank[a_l], rank[a_r]  # +d: the earlier piece's rank gains d tokens
                    if d_i < 0:
                        gain, lose = lose, gain
                    if tokens[gain] + step > quotas[gain] + window or tokens[lose] - step < quotas[lose] - window:
                        continue
                    if used >= budget:
                        return best, used
                    _add_work(a_l, a_r, -1, -1, start, length, rank, work, -1)
                    _shift(a_l, a_r, d_i, start, length)
                    _add_work(a_l, a_r, -1, -1, start, length, rank, work, 1)
                    used += 1
                    if imbalance_of(work) <= target:
                        saved = _reprice(a_l, a_r, -1, -1, start, length, model, sec_f, sec_b)
                        got = step_seconds_of(doc, start, length, rank, cp, model, sec_f, sec_b, -1)
                        if got < best:
                            now = exact_need_received_kernel(doc, start, length, rank, cp).max()
                            if now <= received:
                                best = got
                                received = now
                                improved = True
                                tokens[gain] += step
                                tokens[lose] -= step
                                break
                        _restore(a_l, a_r, -1, -1, saved, sec_f, sec_b)
                    _add_work(a_l, a_r, -1, -1, start, length, rank, work, -1)
                    _shift(a_l, a_r, -d_i, start, length)
                    _add_work(a_l, a_r, -1, -1, start, length, rank, work, 1)
            for i in range(nb):
                a_l, a_r = left[i], right[i]
                for j in range(i + 1, nb):
                    b_l, b_r = left[j], right[j]
                    # boundary i: +d moves rank(a_r) -> rank(a_l); boundary j must move it back
                    x, y = rank[a_r], rank[a_l]
                    if rank[b_l] == x and rank[b_r] == y:
                        sign_j = 1
                    elif rank[b_l] == y and rank[b_r] == x:
                        sign_j = -1
                    else:
                        continue
                    for sign_i in (1, -1):
                        d_i = sign_i * step
                        d_j = sign_i * sign_j * step
                        if d_i > 0 and length[a_r] <= d_i or d_i < 0 and length[a_l] <= -d_i:
                            continue
                        if d_j > 0 and length[b_r] <= d_j or d_j < 0 and length[b_l] <= -d_j:
                            continue
                        if used >= budget:
                            return best, used
                        _add_work(a_l, a_r, b_l, b_r, start, length, rank, work, -1)
                        _shift(a_l, a_r, d_i, start, length)
                        _shift(b_l, b_r, d_j, start, length)
                        _add_work(a_l, a_r, b_l, b_r, start, length, rank, work, 1)
                        used += 1
                        if imbalance_of(work) <= target:
                            saved = _reprice(a_l, a_r, b_l, b_r, start, length, model, sec_f, sec_b)
                            got = step_seconds_of(doc, start, length, rank, cp, model, sec_f, sec_b, -1)
                            if got < best:
                                now = exact_need_received_kernel(doc, start, length, rank, cp).max()
                                if now <= received:
                                    best = got
                                    received = now
                                    improved = True
                                    break
                            _restore(a_l, a_r, b_l, b_r, saved, sec_f, sec_b)
                        _add_work(a_l, a_r, b_l, b_r, start, length, rank, work, -1)
                        _shift(b_l, b_r, -d_j, start, length)
                        _shift(a_l, a_r, -d_i, start, length)
                        _add_work(a_l, a_r, b_l, b_r, start, length, rank, work, 1)
    return best, used


@njit(cache=True)
def affinity_kernel(lens, cp, chunk, tolerance):
    """Chunked assignment that keeps documents contiguous: MinHeap order with a preference for neighbours.

    Every document is cut into chunks of ``chunk`` tokens from its end (its first chunk is the shorter
    one). Chunks go by decreasing workload (ties: lower document, then later chunk) to the least-loaded
    rank with room for them (ties: lowest rank), except that the rank holding the chunk right after it in
    the same document takes it when it has room and stays within the mean workload: that rank then holds
    one contiguous piece and receives only the prefix before it. Quotas: when no rank has room for a chunk,
    the least-loaded rank with room takes its head and the rest goes on (as in ``magi``).
    """
    return _affinity_assign(lens, cp, _affinity_chunks(lens, chunk), tolerance, np.inf)


@njit(cache=True)
def _affinity_chunks(lens, chunk):
    """``affinity_kernel``'s chunks (document, start, length, workload), total workload and placing order:
    the same for every tolerance, so the portfolio cuts them once per chunk size.
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
def _affinity_assign(lens, cp, chunks, tolerance, limit):
    """``affinity_kernel`` on cut ``chunks``; no shards (empty arrays) when the ranks' workloads miss
    imbalance ``limit``, known before the pieces are sorted and merged (a shard's workload is the sum of its
    pieces', so the plan's imbalance is the one of ``load``).
    """
    cdoc, cstart, clen, cwork, total, order = chunks
    num_chunks = cdoc.shape[0]
    quotas = token_quotas_kernel(lens.sum(), cp)
    mean = total / cp
    owner = np.full(num_chunks, -1, np.int64)  # rank of each chunk, -1 until placed (or when split)
    offsets = offsets_of(lens)
    capacity = 2 * num_chunks + 4 * cp + 4
    pdoc, pstart, plen, prank = new_pieces(capacity)
    load = np.zeros(cp, np.int64)
    tokens = np.zeros(cp, np.int64)
    count = 0
    for j in range(num_chunks):
        i = order[j]
        size = clen[i]
        best = -1
        for r in range(cp):
            if quotas[r] - tokens[r] >= size and (best < 0 or load[r] < load[best]):
                best = r
        # chunk i - 1 is the one after it in the same document (chunks were cut from the end)
        if i > 0 and cdoc[i - 1] == cdoc[i] and owner[i - 1] >= 0:
            near = owner[i - 1]
            if quotas[near] - tokens[near] >= size and load[near] + cwork[i] <= mean and \
                    (best < 0 or load[near] <= load[best] + tolerance * mean):
                best = near
        if best >= 0:
            pdoc[count] = cdoc[i]
            pstart[count] = cstart[i]
            plen[count] = size
            prank[count] = best
            count += 1
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


@njit(cache=True)
def _chunk_of(lens, cp, split):
    """The chunk size ``(C // N) // split`` (at least 1 token)."""
    return max(np.int64(1), lens.sum() // cp // split)


# inlined into its one caller: compiled on its own, numba would optimise and emit every candidate's kernel once
# more (flashcp.planner.batch says why)
@njit(cache=True, inline="always")
def _candidate(lens, cp, c, num, cut, limit, target):
    """Portfolio candidate ``c``: Algorithm 1 (R = 1.05, at most ``MAX_ZIGZAG`` Per-Doc documents),
    ``flashcp+`` at the ceiling ``target`` (empty when that is its own ``PLUS_TARGET`` or lower, as the
    first plan is that plan), ``num`` chunked assignments of ``AFFINITY``, ``magi`` at ``(C // N) // 8``,
    ``llama3``, then ``magi`` at each of ``PORTFOLIO_SPLITS``. ``cut``: ``_affinity_chunks`` at each of
    ``SPLITS``. A candidate that misses imbalance ``limit`` comes back empty.
    """
    if c == 0:
        return flashcp_bounded(lens, cp, 1.05, limit, MAX_ZIGZAG)
    if c == 1:
        if target <= PLUS_TARGET:
            return lens[:0], lens[:0], lens[:0], lens[:0]
        return flashcp_plus_bounded(lens, cp, target, MAX_ZIGZAG)
    c -= 2
    if c < num:
        split = AFFINITY[c][0]
        return _affinity_assign(lens, cp, cut[0] if split == 4 else cut[1] if split == 8 else cut[2],
                                AFFINITY[c][1], limit)
    if c == num:
        return magi_within(lens, cp, _chunk_of(lens, cp, 8), limit)
    if c == num + 1:
        return llama3_within(lens, cp, limit)
    return magi_within(lens, cp, _chunk_of(lens, cp, PORTFOLIO_SPLITS[c - num - 2]), limit)


@njit(cache=True)
def _on_nodes(lens, doc, start, length, rank, cp, per_node):
    """The plan with its ranks placed on nodes (``topology.relabel_kernel``), sorted again; the plan itself
    without a topology (``per_node`` 0 or at least ``cp``).
    """
    if per_node <= 0 or per_node >= cp or doc.shape[0] == 0:
        return doc, start, length, rank
    tokens = np.zeros(cp, np.int64)
    for i in range(doc.shape[0]):
        tokens[rank[i]] += length[i]
    placed = relabel_kernel(rank, tokens, traffic_matrix(doc, start, length, rank, cp), cp, per_node)
    return finish_pieces(doc.copy(), start.copy(), length.copy(), placed, doc.shape[0], lens)


@njit(cache=True)
def flashcp2_kernel(lens, cp, target, effort, model, slack):
    """Portfolio of candidate plans, the best under the step time, then local search (see strategies.py)."""
    per_node = np.int64(model[GPUS_PER_NODE_SLOT])
    best_doc, best_start, best_len, best_rank = flashcp_plus_bounded(lens, cp, min(target, PLUS_TARGET),
                                                                     MAX_ZIGZAG)
    best_doc, best_start, best_len, best_rank = _on_nodes(lens, best_doc, best_start, best_len, best_rank, cp,
                                                          per_node)
    memo = _new_memo()
    best_f = np.empty(best_doc.shape[0], np.float64)
    best_b = np.empty(best_doc.shape[0], np.float64)
    _price_shards(best_start, best_len, best_rank, model, best_f, best_b, -1, False, memo)
    best_time = step_seconds_of(best_doc, best_start, best_len, best_rank, cp, model, best_f, best_b, -1)
    # every candidate must meet the ceiling, and flashcp+ sets the time to beat; when flashcp+ misses the
    # ceiling, the first candidate within it that is not slower replaces it
    best_imbalance = _imbalance(best_start, best_len, best_rank, cp)
    limit = target
    plus_time = best_time
    best_received = exact_need_received_kernel(best_doc, best_start, best_len, best_rank, cp).max()
    most_shards = lens.shape[0] + MAX_EXTRA_SHARDS * cp
    num = len(AFFINITY) if effort > 0 else FAST
    # FAST uses no split 16 (1 << 40 tokens: one chunk a document, cut for nothing)
    cut = (_affinity_chunks(lens, _chunk_of(lens, cp, 4)), _affinity_chunks(lens, _chunk_of(lens, cp, 8)),
           _affinity_chunks(lens, _chunk_of(lens, cp, 16) if effort > 0 else 1 << 40))
    count = num + 2
    if effort > 0:
        count += 2
    if effort > 1:
        count += len(PORTFOLIO_SPLITS)
    for c in range(count):
        doc, start, length, rank = _candidate(lens, cp, c, num, cut, limit, target)
        if doc.shape[0] == 0 or doc.shape[0] > most_shards:  # over the limit, or too many shards
            continue
        work = rank_workloads_kernel(start, length, rank, cp)
        imbalance = imbalance_of(work)
        if imbalance > limit:  # cheap test first
            continue
        doc, start, length, rank = _on_nodes(lens, doc, start, length, rank, cp, per_node)
        # the busiest rank's own time bounds the step time from below (``rank_floor``): skip what cannot
        # win; its shards' seconds then serve the step time too
        busiest = np.argmax(rank_workloads_kernel(start, length, rank, cp))
        sec_f = np.zeros(doc.shape[0], np.float64)
        sec_b = np.zeros(doc.shape[0], np.float64)
        _price_shards(start, length, rank, model, sec_f, sec_b, busiest, True, memo)
        floor = step_seconds_of(doc, start, length, rank, cp, model, sec_f, sec_b, busiest)
        within = best_imbalance <= target
        # Algorithm 1 (c == 0) sets the time to beat with flashcp+: it wins when it is faster
        if floor > plus_time or within and (floor >= best_time * (1.0 + RECEIVE_TIE) or c == 0 and
                                            floor >= best_time):
            continue
        _price_shards(start, length, rank, model, sec_f, sec_b, busiest, False, memo)
        t = step_seconds_of(doc, start, length, rank, cp, model, sec_f, sec_b, -1)
        if t > plus_time or within and (t >= best_time * (1.0 + RECEIVE_TIE) or c == 0 and t >= best_time):
            continue
        received = exact_need_received_kernel(doc, start, length, rank, cp).max()
        if c == 0:
            plus_time = t
        elif within:
            # not faster: never less balanced than the best
            if t >= best_time and imbalance > best_imbalance:
                continue
            # as fast within RECEIVE_TIE: the lower receive wins, then the faster
            if t >= best_time * (1.0 - RECEIVE_TIE) and (received > best_received or
                                                         received == best_received and t >= best_time):
                continue
        best_doc, best_start, best_len, best_rank, best_time = doc, start, length, rank, t
        best_f, best_b = sec_f, sec_b
        best_received = received
        best_imbalance = imbalance
    if effort > 0:
        start = best_start.copy()
        length = best_len.copy()
        _local_search_priced(best_doc, start, length, best_rank, cp, model, max(limit, best_imbalance),
                             effort * EVALS_PER_EFFORT, slack_tokens(slack, lens.sum(), cp), best_f, best_b)
        return finish_pieces(best_doc, start, length, best_rank, best_doc.shape[0], lens)
    return best_doc, best_start, best_len, best_rank


@njit(cache=True)
def _price_shards(start, length, rank, model, sec_f, sec_b, of_rank, on_rank, memo):
    """Kernel seconds (``one_shard_seconds``) of the shards on rank ``of_rank`` (``on_rank``) or of all the
    others, written into ``sec_f``/``sec_b``: ``shard_seconds``'s values, in two passes.

    ``memo`` (``_new_memo``) keeps the seconds of recently priced (start, length) pairs: candidates of one
    sequence share many shards (whole documents, the same chunks), and a hit returns the same values.
    """
    keys, seconds = memo
    mask = keys.shape[0] - 1
    for i in range(start.shape[0]):
        if (rank[i] == of_rank) == on_rank:
            s = start[i]
            n = length[i]
            slot = (s * 40503 + n) & mask
            if keys[slot, 0] == s and keys[slot, 1] == n:
                sec_f[i] = seconds[slot, 0]
                sec_b[i] = seconds[slot, 1]
                continue
            sec_f[i], sec_b[i] = one_shard_seconds(s, n, model)
            keys[slot, 0] = s
            keys[slot, 1] = n
            seconds[slot, 0] = sec_f[i]
            seconds[slot, 1] = sec_b[i]


@njit(cache=True)
def _new_memo():
    """An empty ``_price_shards`` memo: 1024 slots of (start, length) and their two seconds."""
    return np.full((1024, 2), -1, np.int64), np.empty((1024, 2), np.float64)
