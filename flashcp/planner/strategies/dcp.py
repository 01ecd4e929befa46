"""The ``dcp`` peer: DCP's hypergraph partitioning of attention blocks (SOSP'25, arXiv 2510.10620).

DCP places the blocks of each batch with a hypergraph partitioner so that ranks balance compute and send
only the K/V that is needed. flashcp's version, written from that formulation for one packed sequence:

- Vertices: every document is cut into blocks of ``chunk_size`` tokens from its start (its last block may
  be shorter; a shorter document is one block). A block's weight is its causal attention workload
  (``cost.workload``, query-key pairs): the compute it brings to the rank that holds it.
- Hyperedges: block b of a document is needed by every block at or after it in the document, so its net
  is ``{b, b+1, ..., last block}``, weighted by b's tokens. Under the connectivity objective (lambda - 1) a
  net spread over lambda ranks costs b's K/V sent to lambda - 1 of them: the partitioner's objective is the
  total exact-need K/V volume of the plan (docs/DESIGN.md section 2, summed over ranks).
- Partitioning: Mt-KaHyPar (``mtkahypar``, pip extra ``flashcp[hypergraph]``), k = N blocks, objective
  KM1, imbalance epsilon 0.01 on the vertex weights (scaled into its 32-bit range, ``vertex_weights``),
  deterministic preset, one thread, seed 0.
- Plan: each block goes to its part; then the equal-token quotas are restored as Algorithm 1's Whole-Doc
  step does (``_repair``): while a rank holds more than its quota, the rank most over it moves the head of its
  piece with the shortest prefix (``min(excess, deficit, piece length)`` tokens, ties: the lower document)
  to the under-filled rank with the least workload. The result is sorted and merged like every plan.

Without ``mtkahypar`` the strategy refuses with one sentence. It plans in Python (the partitioner is a C++
library behind a Python binding), one sequence at a time, so it is far slower than the Numba strategies.
"""

from __future__ import annotations

import functools

import numpy as np

from flashcp.costmodel.workload import token_quotas, workload

__all__ = [
    "DCP_EPSILON",
    "MISSING",
    "dcp_available",
    "dcp_blocks",
    "dcp_plan",
    "dcp_rows",
    "partition_blocks",
    "vertex_weights",
]

DCP_EPSILON = 0.01
"""Allowed imbalance of the partition's block workloads (mtkahypar's epsilon)."""
MISSING = "strategy 'dcp' needs the hypergraph partitioner mtkahypar: pip install 'flashcp[hypergraph]'"
WEIGHT_LIMIT = 2**30
"""Most total vertex weight handed to Mt-KaHyPar: its weights are 32-bit, and one 128K document alone has
8.6e9 query-key pairs, so larger totals are scaled down (half of int32's range, room for its part sums)."""

def dcp_available() -> bool:
    """Whether ``mtkahypar`` imports."""
    try:
        import mtkahypar  # noqa: F401
    except ImportError:
        return False
    return True


@functools.lru_cache(maxsize=1)
def _initializer():
    import mtkahypar

    return mtkahypar.initialize(1, False)  # one thread: deterministic, and beside the other planners' work


def _partitioner():
    try:
        import mtkahypar
    except ImportError:
        raise ValueError(MISSING) from None
    return mtkahypar, _initializer()


def dcp_blocks(lens: np.ndarray, chunk: int):
    """Blocks (doc, start, length) of every document, in document order."""
    doc, start, length = [], [], []
    for d, n in enumerate(lens.tolist()):
        for s in range(0, n, chunk):
            doc.append(d)
            start.append(s)
            length.append(min(chunk, n - s))
    return np.array(doc, np.int64), np.array(start, np.int64), np.array(length, np.int64)


def vertex_weights(work: np.ndarray) -> np.ndarray:
    """Block workloads as Mt-KaHyPar's vertex weights, their total at most about ``WEIGHT_LIMIT``.

    Unchanged while the total fits, else divided by the smallest whole factor that brings it there (rounded,
    at least 1).
    """
    work = np.asarray(work, np.int64)
    total = int(work.sum())
    if total <= WEIGHT_LIMIT:
        return work
    scale = -(-total // WEIGHT_LIMIT)
    return np.maximum(1, (work + scale // 2) // scale)


def partition_blocks(doc, start, length, cp: int) -> np.ndarray:
    """Part (rank) of every block from Mt-KaHyPar: KM1 over the need nets, balanced workloads."""
    mtkahypar, init = _partitioner()
    nets, weights = [], []
    for b in range(doc.size):
        end = b + 1
        while end < doc.size and doc[end] == doc[b]:
            end += 1
        if end - b > 1:  # a document's last block is needed by no other block
            nets.append(list(range(b, end)))
            weights.append(int(length[b]))
    work = vertex_weights(workload(start, length))
    if not nets:
        nets, weights = [[0]], [1]  # the partitioner wants at least one net; a single pin costs nothing
    context = init.context_from_preset(mtkahypar.PresetType.DETERMINISTIC)
    context.set_partitioning_parameters(cp, DCP_EPSILON, mtkahypar.Objective.KM1)
    context.logging = False
    mtkahypar.set_seed(0)
    graph = init.create_hypergraph(context, int(doc.size), len(nets), nets, [int(w) for w in work], weights)
    return np.asarray(graph.partition(context).get_partition(), np.int64)


def _repair(lens: np.ndarray, pieces: list[list[int]], cp: int) -> list[list[int]]:
    """Give every rank its equal-token quota by moving heads of pieces (see the module docstring)."""
    quotas = token_quotas(int(lens.sum()), cp)
    tokens = np.zeros(cp, np.int64)
    work = np.zeros(cp, np.int64)
    for _, s, n, r in pieces:
        tokens[r] += n
        work[r] += workload(s, n)
    while (tokens > quotas).any():
        excess = tokens - quotas
        over = int(np.argmax(excess))  # ties: the lower rank
        under = min((r for r in range(cp) if tokens[r] < quotas[r]), key=lambda r: (work[r], r))
        i = min((i for i, p in enumerate(pieces) if p[3] == over and p[2] > 0),
                key=lambda i: (pieces[i][1], pieces[i][0]))
        d, s, n, _ = pieces[i]
        moved = int(min(excess[over], quotas[under] - tokens[under], n))
        pieces.append([d, s, moved, under])
        pieces[i] = [d, s + moved, n - moved, over]
        shift = int(workload(s, moved))
        tokens[over] -= moved
        tokens[under] += moved
        work[over] -= shift
        work[under] += shift
    return [p for p in pieces if p[2] > 0]


def dcp_plan(lens, cp: int, chunk: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """DCP's plan of one sequence (``lens`` (num_docs,)): the four shard arrays, sorted and merged."""
    lens = np.asarray(lens, np.int64)
    doc, start, length = dcp_blocks(lens, chunk)
    part = partition_blocks(doc, start, length, cp) if cp > 1 else np.zeros(doc.size, np.int64)
    pieces = _repair(lens, [[int(d), int(s), int(n), int(r)] for d, s, n, r in zip(doc, start, length, part)], cp)
    # sort by (rank, position) and merge touching pieces of one document on one rank, as every plan
    pieces.sort(key=lambda p: (p[3], p[0], p[1]))
    merged: list[list[int]] = []
    for d, s, n, r in pieces:
        if merged and merged[-1][3] == r and merged[-1][0] == d and merged[-1][1] + merged[-1][2] == s:
            merged[-1][2] += n
        else:
            merged.append([d, s, n, r])
    out = np.array(merged, np.int64).reshape(-1, 4)
    return out[:, 0].copy(), out[:, 1].copy(), out[:, 2].copy(), out[:, 3].copy()


def dcp_rows(row_offsets: np.ndarray, doc_lens: np.ndarray, cp: int, params: dict):
    """``batch.plan_batch``'s result for ``dcp``: every row planned by :func:`dcp_plan`."""
    chunk = int(params.get("chunk_size", 1024))
    parts = [dcp_plan(doc_lens[row_offsets[i]:row_offsets[i + 1]], cp, chunk) for i in range(row_offsets.size - 1)]
    offsets = np.zeros(len(parts) + 1, np.int64)
    offsets[1:] = np.cumsum([p[0].size for p in parts])
    flat = [np.ascontiguousarray(np.concatenate([p[k] for p in parts]) if parts else np.zeros(0, np.int64),
                                 dtype=np.int64) for k in range(4)]
    return (offsets, *flat)
