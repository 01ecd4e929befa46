"""Placing a plan's ranks on nodes: ``flashcp2``'s relabelling under a topology.

A plan's ranks are names: exchanging two ranks that hold the same number of tokens gives a plan with the
same workloads, tokens and exact-need volumes, only a different node for each rank's traffic. With a
topology (``gpus_per_node`` ranks per node, rank r on node ``r // gpus_per_node``), ``relabel_kernel`` swaps
ranks between nodes so that less exact-need traffic crosses them: first the largest cross-node rows of one
rank (sent or received, what the slow link's time follows), then the total crossing. Rules in
flashcp.planner.strategies; reference in ``tests/naive.py``. Arrays as flashcp.planner.strategies describes
them; ``traffic`` is (cp, cp) int64 (``traffic_matrix``).
"""

from __future__ import annotations

import numpy as np

from flashcp._numba import njit

__all__ = ["RELABEL_PASSES", "relabel_kernel", "traffic_matrix"]

RELABEL_PASSES = 4
"""Passes over all pairs of ranks at most (a pass that keeps no swap ends the search)."""


@njit(cache=True)
def traffic_matrix(doc, start, length, rank, cp):
    """``T[b, r]``: exact-need rows rank b sends rank r (``cost.exact_need_sent``'s terms). (cp, cp) int64."""
    num_docs = 0
    for i in range(doc.shape[0]):
        num_docs = max(num_docs, doc[i] + 1)
    max_end = np.zeros((num_docs, cp), np.int64)
    for i in range(doc.shape[0]):
        max_end[doc[i], rank[i]] = max(max_end[doc[i], rank[i]], start[i] + length[i])
    out = np.zeros((cp, cp), np.int64)
    for i in range(doc.shape[0]):
        b = rank[i]
        for r in range(cp):
            if r != b:
                out[b, r] += min(length[i], max(0, max_end[doc[i], r] - start[i]))
    return out


@njit(cache=True)
def _far_rows(traffic, node, cp):
    """Cross-node rows every rank sends and receives under ``node`` (two (cp,) arrays) and their total."""
    far_sent = np.zeros(cp, np.int64)
    far_received = np.zeros(cp, np.int64)
    total = 0
    for b in range(cp):
        for r in range(cp):
            if node[b] != node[r]:
                far_sent[b] += traffic[b, r]
                far_received[r] += traffic[b, r]
                total += traffic[b, r]
    return far_sent, far_received, total


@njit(cache=True)
def _swap_rows(traffic, node, a, b, far_sent, far_received, cp):
    """Add to ``far_sent``/``far_received`` what swapping the nodes of ranks a and b changes; returns the
    change of the total. Only pairs of a or b with the ranks of their two nodes change side.
    """
    change = 0
    for x in range(cp):
        if x == a or x == b:
            continue
        if node[x] == node[a]:
            lose, gain = a, b  # x shares a's node: a leaves it (a's pairs cross), b joins it
        elif node[x] == node[b]:
            lose, gain = b, a
        else:
            continue
        # pairs (x, lose) start crossing, pairs (x, gain) stop
        far_sent[x] += traffic[x, lose] - traffic[x, gain]
        far_received[lose] += traffic[x, lose]
        far_received[gain] -= traffic[x, gain]
        far_sent[lose] += traffic[lose, x]
        far_sent[gain] -= traffic[gain, x]
        far_received[x] += traffic[lose, x] - traffic[gain, x]
        change += traffic[x, lose] + traffic[lose, x] - traffic[x, gain] - traffic[gain, x]
    return change


@njit(cache=True)
def _copy(source, target):
    # a loop: numba's ``target[:] = source`` compiles a shape check that formats its error message
    for i in range(source.shape[0]):
        target[i] = source[i]


@njit(cache=True)
def relabel_kernel(rank, tokens, traffic, cp, gpus_per_node):
    """New rank of every shard (``rank`` (num_shards,)) after swapping ranks between nodes.

    Slot s is on node ``s // gpus_per_node``; every rank starts in its own slot. Pairs (a, b), a < b, of
    ranks in different nodes holding equal ``tokens`` are tried in order; a swap is kept when it lowers
    ``(largest cross-node rows of one rank, sent or received; total cross-node rows)`` of ``traffic``
    (``traffic_matrix``); passes repeat while one keeps a swap, at most ``RELABEL_PASSES``.
    """
    node = np.empty(cp, np.int64)
    slot = np.arange(cp)
    for r in range(cp):
        node[r] = r // gpus_per_node
    far_sent, far_received, best_total = _far_rows(traffic, node, cp)
    best_peak = max(far_sent.max(), far_received.max())
    trial_sent = far_sent.copy()
    trial_received = far_received.copy()
    for _ in range(RELABEL_PASSES):
        improved = False
        for a in range(cp):
            for b in range(a + 1, cp):
                if node[a] == node[b] or tokens[a] != tokens[b]:
                    continue
                _copy(far_sent, trial_sent)
                _copy(far_received, trial_received)
                total = best_total + _swap_rows(traffic, node, a, b, trial_sent, trial_received, cp)
                peak = max(trial_sent.max(), trial_received.max())
                if peak < best_peak or peak == best_peak and total < best_total:
                    best_peak, best_total = peak, total
                    _copy(trial_sent, far_sent)
                    _copy(trial_received, far_received)
                    node[a], node[b] = node[b], node[a]
                    slot[a], slot[b] = slot[b], slot[a]
                    improved = True
        if not improved:
            break
    out = np.empty(rank.shape[0], np.int64)
    for i in range(rank.shape[0]):
        out[i] = slot[rank[i]]
    return out
