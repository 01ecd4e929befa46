"""Documents cut into fixed-size blocks, and block assignments: the ILP audit's unit of placement.

A block assignment is one rank per block, shape (num_blocks,), int64. This module converts plans to block
assignments (rounding), block assignments to plans (merging), and repairs a rounded assignment so that every
rank holds exactly its equal-token quota, which CP-SAT on its own rarely finds (see ``repair_to_quotas``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from flashcp.costmodel.workload import workload
from flashcp.planner.plan import SequencePlan

__all__ = [
    "BlockGrid",
    "block_grid",
    "block_plan",
    "rank_sums",
    "repair_to_quotas",
    "round_plan_to_blocks",
    "sent_blocks",
]

# Largest (items x sums) table the quota repair builds; beyond it the repair gives up (returns None).
MAX_REPAIR_TABLE = 50_000_000


@dataclass(frozen=True, kw_only=True, slots=True)
class BlockGrid:
    """Documents cut into blocks; every array has shape (num_blocks,), int64, blocks in document order."""

    doc: np.ndarray
    """Document of each block."""
    start: np.ndarray
    """Start of the block inside its document."""
    length: np.ndarray
    """Block length in tokens, in ``[1, granularity]``."""
    doc_offsets: np.ndarray
    """Shape (num_docs + 1,): document ``d``'s blocks are ``doc_offsets[d]:doc_offsets[d + 1]``."""
    granularity: int
    """Block size in tokens."""
    uniform: bool = True
    """Every block is ``granularity`` tokens but a document's last (no extra cuts)."""

    @property
    def num_blocks(self) -> int:
        """Number of blocks."""
        return int(self.doc.shape[0])

    @property
    def workloads(self) -> np.ndarray:
        """Workload of each block (``cost.workload``). Shape (num_blocks,), int64."""
        return workload(self.start, self.length)

    @property
    def has_next(self) -> np.ndarray:
        """Whether block ``b + 1`` belongs to the same document as block ``b``. Shape (num_blocks,), bool."""
        return np.r_[self.doc[1:] == self.doc[:-1], False]


def block_grid(doc_lens, granularity: int, extra_cuts: SequencePlan | None = None) -> BlockGrid:
    """Cut documents of lengths ``doc_lens`` (num_docs,) into blocks of ``granularity`` tokens.

    ``extra_cuts``: a plan whose shard boundaries cut blocks too (the grid then holds that plan exactly).
    """
    if granularity < 1:
        raise ValueError(f"granularity must be at least 1 token, got {granularity}")
    doc_lens = np.asarray(doc_lens, dtype=np.int64)
    if doc_lens.size == 0 or (doc_lens <= 0).any():
        raise ValueError("every sequence needs at least one document and every document at least one token")
    counts = -(-doc_lens // granularity)
    doc = np.repeat(np.arange(doc_lens.size, dtype=np.int64), counts)
    first_block = np.r_[0, np.cumsum(counts)[:-1]]
    start = (np.arange(doc.size, dtype=np.int64) - first_block[doc]) * granularity
    if extra_cuts is not None:
        cut = extra_cuts.shard_start > 0
        doc = np.r_[doc, extra_cuts.shard_doc[cut]]
        start = np.r_[start, extra_cuts.shard_start[cut]]
        keys = np.unique(doc * (int(doc_lens.max()) + 1) + start)  # sorted by (doc, start), no duplicates
        doc, start = keys // (int(doc_lens.max()) + 1), keys % (int(doc_lens.max()) + 1)
    end = np.r_[start[1:], 0]
    last = np.r_[doc[1:] != doc[:-1], True]
    length = np.where(last, doc_lens[doc] - start, end - start)
    doc_offsets = np.searchsorted(doc, np.arange(doc_lens.size + 1)).astype(np.int64)
    return BlockGrid(doc=doc, start=start, length=length, doc_offsets=doc_offsets, granularity=granularity,
                     uniform=extra_cuts is None)


def round_plan_to_blocks(plan: SequencePlan, grid: BlockGrid) -> np.ndarray:
    """Rank of each block under ``plan``: the rank holding most of the block's tokens (lowest on ties).

    Returns shape (num_blocks,), int64. Exact when every shard boundary lies on the block grid.
    """
    overlap = np.zeros((grid.num_blocks, plan.cp), dtype=np.int64)
    for d, s, n, r in zip(plan.shard_doc.tolist(), plan.shard_start.tolist(), plan.shard_len.tolist(),
                          plan.shard_rank.tolist()):
        e = s + n
        first, end = grid.doc_offsets[d], grid.doc_offsets[d + 1]
        starts = grid.start[first:end]
        lo = first + np.searchsorted(starts, s, side="right") - 1
        hi = first + np.searchsorted(starts, e, side="left")
        block_start = grid.start[lo:hi]
        overlap[lo:hi, r] += np.minimum(e, block_start + grid.length[lo:hi]) - np.maximum(s, block_start)
    return np.argmax(overlap, axis=1).astype(np.int64)


def block_plan(grid: BlockGrid, block_rank: np.ndarray, cp: int) -> SequencePlan:
    """The plan putting block ``b`` on ``block_rank[b]``; consecutive blocks on one rank merge into a shard.

    ``block_rank``: shape (num_blocks,). The plan is in canonical (rank, doc, start) order.
    """
    block_rank = np.asarray(block_rank, dtype=np.int64)
    first = np.flatnonzero(np.r_[True, (grid.doc[1:] != grid.doc[:-1]) | (block_rank[1:] != block_rank[:-1])])
    return SequencePlan.from_arrays(grid.doc[first], grid.start[first], np.add.reduceat(grid.length, first),
                                    block_rank[first], cp).sorted()


def rank_sums(values: np.ndarray, block_rank: np.ndarray, cp: int) -> np.ndarray:
    """Per-rank sums of per-block ``values`` (num_blocks,) under ``block_rank``. Shape (cp,), int64."""
    sums = np.zeros(cp, dtype=np.int64)
    np.add.at(sums, block_rank, values)
    return sums


def sent_blocks(grid: BlockGrid, block_rank: np.ndarray) -> np.ndarray:
    """Whether each block is contributed to the all-gather, shape (num_blocks,), bool.

    A block is contributed iff a later block of its document is on another rank: exactly the blocks of the
    shards that are not their document's last shard, in a document spread over several ranks.
    """
    sent = np.zeros(grid.num_blocks, dtype=bool)
    has_next = grid.has_next
    for b in range(grid.num_blocks - 2, -1, -1):
        if has_next[b]:
            sent[b] = block_rank[b + 1] != block_rank[b] or sent[b + 1]
    return sent


def repair_to_quotas(grid: BlockGrid, block_rank: np.ndarray, quotas: np.ndarray, *,
                     tries: int = 24) -> np.ndarray | None:
    """Move blocks of ``block_rank`` so that rank ``r`` holds exactly ``quotas[r]`` tokens (a greedy).

    Returns a new assignment (num_blocks,), or None when the greedy finds none (there may still be one) or
    the grid is not uniform.

    Full blocks (``granularity`` tokens) only shift a rank's tokens by multiples of the granularity, so the
    short blocks (ends of documents, short documents) decide feasibility: rank after rank, a knapsack over
    exact sums picks short blocks whose total is the quota minus a multiple of the granularity, moving as
    little workload as it can (a short block moves with the rest of its shard, so that no cut is made); the
    last rank takes the rest. Full blocks are then moved from ranks with too many to ranks with too few,
    preferring blocks whose move adds the fewest cuts, then the lightest (document heads: Whole-Doc moves).
    The greedy depends on the order of the ranks: up to ``tries`` orders are tried (the natural one first,
    then seeded random ones) and the result with the least ``imbalance + max_comm / (C / N)`` is kept.
    """
    cp = quotas.shape[0]
    block_rank = np.asarray(block_rank, dtype=np.int64)
    if np.array_equal(rank_sums(grid.length, block_rank, cp), quotas):
        return block_rank.copy()
    if not grid.uniform:
        return None
    rng = np.random.default_rng(0)
    orders = [np.arange(cp)] + [rng.permutation(cp) for _ in range(tries - 1)] if cp > 1 else [np.arange(cp)]
    best, best_score = None, np.inf
    seen = set()
    for order in orders:
        if tuple(order[:-1]) in seen:  # the last rank takes the rest: only the others' order matters
            continue
        seen.add(tuple(order[:-1]))
        for by_tokens, full_weight in ((False, 1), (True, 1), (True, 4), (True, 16)):
            repaired = _repair_in_order(grid, block_rank, quotas, order, by_tokens, full_weight)
            if repaired is None:
                continue
            metrics = block_plan(grid, repaired, cp).metrics()
            score = metrics.imbalance + metrics.ag_comm_tokens * cp / int(quotas.sum())
            if score < best_score:
                best, best_score = repaired, score
    return best


def _repair_in_order(grid: BlockGrid, block_rank: np.ndarray, quotas: np.ndarray, order: np.ndarray,
                     by_tokens: bool, full_weight: int) -> np.ndarray | None:
    """``repair_to_quotas`` with the ranks' short blocks picked in ``order``.

    Moves cost workload, or tokens with ``by_tokens``; each full block moved to fix a rank's count costs
    ``full_weight`` times a document head's workload (or its tokens: the K/V its new rank must send).
    """
    g, cp = grid.granularity, quotas.shape[0]
    block_rank = block_rank.copy()
    full = grid.length == g
    full_count = rank_sums(full.astype(np.int64), block_rank, cp)
    short = np.flatnonzero(~full)
    # A short block is a document's last block; it moves together with the rest of its shard (the run of
    # blocks on its rank before it), so a move cuts nothing. Moving costs the workload that moves.
    run_start = short.copy()
    for i, b in enumerate(short.tolist()):
        while run_start[i] > grid.doc_offsets[grid.doc[b]] and block_rank[run_start[i] - 1] == block_rank[b]:
            run_start[i] -= 1
    cum = np.r_[0, np.cumsum(grid.length if by_tokens else grid.workloads)]
    move_cost = cum[short + 1] - cum[run_start]
    full_move_cost = full_weight * (g if by_tokens else g * (g + 1) // 2)
    remaining = np.arange(short.size)
    short_sum = np.zeros(cp, dtype=np.int64)
    moves = []
    for i, r in enumerate(order.tolist()):
        if i == cp - 1:
            chosen = short[remaining]
        else:
            on_rank = block_rank[short[remaining]] == r
            picked = _pick_short_blocks(grid.length[short[remaining]], move_cost[remaining], on_rank,
                                        int(quotas[r]), int(full_count[r]), g, full_move_cost)
            if picked is None:
                return None
            chosen = short[remaining[picked]]
            remaining = np.delete(remaining, picked)
        short_sum[r] = grid.length[chosen].sum()
        moves += [(b, r) for b in chosen.tolist()]
    last = int(order[-1])
    if short_sum[last] > quotas[last] or (quotas[last] - short_sum[last]) % g:
        return None
    for b, r in moves:
        block_rank[run_start[np.searchsorted(short, b)]:b + 1] = r

    need = (quotas - short_sum) // g - rank_sums(full.astype(np.int64), block_rank, cp)
    while (need != 0).any():
        giver, taker = int(np.argmin(need)), int(np.argmax(need))
        candidates = np.flatnonzero(full & (block_rank == giver))
        block_rank[_best_block_to_move(grid, block_rank, candidates, taker)] = taker
        need[giver] += 1
        need[taker] -= 1
    return block_rank


def _pick_short_blocks(lengths: np.ndarray, move_cost: np.ndarray, on_rank: np.ndarray, quota: int,
                       full_blocks: int, g: int, full_move_cost: int) -> np.ndarray | None:
    """Indices of a subset of ``lengths`` summing to ``quota - k*g`` (k >= 0) that moves the least.

    Taking a block already on this rank gains its ``move_cost``, taking another rank's block loses it; each
    full block the rank must gain or give to reach ``k`` (it holds ``full_blocks``) loses ``full_move_cost``.
    """
    n = lengths.shape[0]
    if n * (quota + 1) > MAX_REPAIR_TABLE:
        return None
    values = np.where(on_rank, move_cost, -move_cost)
    unreachable = np.iinfo(np.int64).min // 2
    best = np.full(quota + 1, unreachable, dtype=np.int64)
    best[0] = 0
    take = np.zeros((n, quota + 1), dtype=bool)
    for i in range(n):
        length = int(lengths[i])
        if length > quota:
            continue
        candidate = np.full(quota + 1, unreachable, dtype=np.int64)
        candidate[length:] = best[:quota + 1 - length] + values[i]
        take[i] = candidate > best
        best = np.maximum(best, candidate)
    targets = np.arange(quota % g, quota + 1, g)
    full_moves = np.abs((quota - targets) // g - full_blocks)
    target = int(targets[np.argmax(best[targets] - full_move_cost * full_moves)])
    if best[target] <= unreachable // 2:
        return None
    chosen = []
    for i in range(n - 1, -1, -1):
        if take[i, target]:
            chosen.append(i)
            target -= int(lengths[i])
    assert target == 0, "knapsack reconstruction must end at sum 0"
    return np.array(chosen[::-1], dtype=np.int64)


def _best_block_to_move(grid: BlockGrid, block_rank: np.ndarray, candidates: np.ndarray, taker: int) -> int:
    """The candidate block whose move to ``taker`` adds the fewest cuts (the lightest block on ties)."""
    has_next, last = grid.has_next[candidates], grid.num_blocks - 1
    has_prev = np.r_[False, grid.has_next[:-1]][candidates]
    prev_rank = np.where(has_prev, block_rank[np.maximum(candidates - 1, 0)], -1)
    next_rank = np.where(has_next, block_rank[np.minimum(candidates + 1, last)], -1)

    def cuts(rank):  # neighbours of the same document on another rank than ``rank``
        return (has_prev & (prev_rank != rank)).astype(np.int64) + (has_next & (next_rank != rank))

    before, after = cuts(block_rank[candidates]), cuts(taker)
    order = np.lexsort((grid.workloads[candidates], after - before))
    return int(candidates[order[0]])
