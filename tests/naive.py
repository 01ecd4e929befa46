"""Plain-Python references, written from the definitions in DESIGN.md section 2 without shortcuts."""

from __future__ import annotations

from itertools import product


def naive_workload(start: int, length: int) -> int:
    """Count query-key pairs one query at a time: query at position p sees keys 0..p."""
    return sum(p + 1 for p in range(start, start + length))


def naive_metrics(shards: list[tuple[int, int, int, int]], cp: int) -> tuple[float, int, int]:
    """(imbalance, all-gather critical path, exact-need critical path) of (doc, start, len, rank) shards."""
    work = [0] * cp
    for _, start, length, rank in shards:
        work[rank] += naive_workload(start, length)
    mean = sum(work) / cp
    imbalance = max(work) / mean if mean else 1.0

    contribution = [0] * cp
    for doc, start, length, rank in shards:
        same_doc = [s for s in shards if s[0] == doc]
        ranks = {s[3] for s in same_doc}
        is_last = start == max(s[1] for s in same_doc)
        if len(ranks) > 1 and not is_last:
            contribution[rank] += length

    received = [0] * cp
    for rank in range(cp):
        for doc in {s[0] for s in shards if s[3] == rank}:
            held = {t for d, s, n, r in shards if d == doc and r == rank for t in range(s, s + n)}
            end = max(s + n for d, s, n, r in shards if d == doc and r == rank)
            received[rank] += sum(1 for t in range(end) if t not in held)
    return imbalance, max(contribution), max(received)


def naive_block_optimum(doc_lens: list[int], cp: int, granularity: int, *, comm_weight: float = 1.0,
                        lexicographic: bool = False, quota_slack: int = 0,
                        workload_cap: int | None = None) -> tuple[float, ...] | None:
    """Best objective of the ILP audit's block model over every assignment of blocks to ranks (brute force).

    Returns ``(imbalance + comm_weight * ag / (C / N),)`` for the weighted objective, ``(imbalance, ag)`` when
    lexicographic, ``(ag,)`` with a ``workload_cap``; None when no assignment meets the quotas (and the cap).
    """
    blocks = [(d, s, min(granularity, n - s))
              for d, n in enumerate(doc_lens) for s in range(0, n, granularity)]
    context_len = sum(doc_lens)
    quotas = [context_len // cp + (1 if r < context_len % cp else 0) for r in range(cp)]
    best = None
    for ranks in product(range(cp), repeat=len(blocks)):
        tokens = [0] * cp
        for (_, _, n), r in zip(blocks, ranks):
            tokens[r] += n
        if any(abs(t - q) > quota_slack for t, q in zip(tokens, quotas)):
            continue
        shards = []  # consecutive blocks of a document on one rank make one shard
        for (d, s, n), r in zip(blocks, ranks):
            if shards and shards[-1][0] == d and shards[-1][3] == r and shards[-1][1] + shards[-1][2] == s:
                shards[-1] = (d, shards[-1][1], shards[-1][2] + n, r)
            else:
                shards.append((d, s, n, r))
        if workload_cap is not None:
            work = [0] * cp
            for _, s, n, r in shards:
                work[r] += naive_workload(s, n)
            if max(work) > workload_cap:
                continue
        imbalance, ag, _ = naive_metrics(shards, cp)
        if workload_cap is not None:
            key = (ag,)
        elif lexicographic:
            key = (imbalance, ag)
        else:
            key = (imbalance + comm_weight * ag * cp / context_len,)
        if best is None or key < best:
            best = key
    return best
