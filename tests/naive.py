"""Plain-Python references, written from the definitions in DESIGN.md section 2 without shortcuts."""

from __future__ import annotations


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


def naive_document_attention(q, k, v, doc_lens):
    """Dense attention over the whole packed sequence with a document-causal mask (torch, any dtype).

    q: (C, H, D); k, v: (C, K, D) with H % K == 0. Token i attends to token j iff both lie in the same
    document and j <= i. Scale 1 / sqrt(D).
    """
    import torch

    context_len, num_heads, head_dim = q.shape
    group = num_heads // k.shape[1]
    doc = torch.repeat_interleave(torch.arange(len(doc_lens)), torch.as_tensor(doc_lens))
    pos = torch.arange(context_len)
    keep = (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])
    k_full = k.repeat_interleave(group, dim=1)
    v_full = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("ihd,jhd->hij", q, k_full) / head_dim ** 0.5
    scores = scores.masked_fill(~keep.to(q.device), float("-inf"))
    return torch.einsum("hij,jhd->ihd", scores.softmax(-1), v_full)


def naive_ring_plan(doc_lens, cp: int) -> list[tuple[int, int, int, int]]:
    """(doc, start, len, rank) shards of the Ring-Attn layout, token by token.

    Token t of the packed sequence goes to the rank whose equal-token quota range holds it (quotas C // N, the
    first C % N ranks one more); a shard is a run of tokens of one document on one rank.
    """
    context_len = sum(doc_lens)
    quotas = [context_len // cp + (1 if r < context_len % cp else 0) for r in range(cp)]
    owner = [r for r, q in enumerate(quotas) for _ in range(q)]
    shards, t = [], 0
    for doc, length in enumerate(doc_lens):
        for pos in range(length):
            rank = owner[t + pos]
            if shards and shards[-1][0] == doc and shards[-1][3] == rank:
                d, s, n, r = shards[-1]
                shards[-1] = (d, s, n + 1, r)
            else:
                shards.append((doc, pos, 1, rank))
        t += length
    return shards


def naive_ring_step_work(shards, cp: int) -> dict[str, list[list[int]]]:
    """Per [rank][step] of the ring: pairs, query_tokens, key_tokens, sequences, counted query by query.

    At step s rank r hosts the block of rank b = (r - s) mod N. A query at position p of shard (d, st, n, r)
    sees the keys t <= p of document d that b holds, among the keys t < st + n (the shard's visible keys).
    """
    owner = {(d, s + i): r for d, s, n, r in shards for i in range(n)}
    work = {k: [[0] * cp for _ in range(cp)] for k in ("pairs", "query_tokens", "key_tokens", "sequences")}
    for rank in range(cp):
        for step in range(cp):
            block = (rank - step) % cp
            for doc, start, length, r in shards:
                if r != rank:
                    continue
                keys = [t for t in range(start + length) if owner[(doc, t)] == block]
                queries = range(start, start + length)
                work["pairs"][rank][step] += sum(1 for p in queries for t in keys if t <= p)
                work["key_tokens"][rank][step] += len(keys)
                if keys:
                    work["query_tokens"][rank][step] += length
                    work["sequences"][rank][step] += 1
    return work


def naive_ring_comm(rank_tokens: list[int]) -> tuple[list[int], list[int]]:
    """(sent, received) tokens per rank when every block goes round the ring once, hop by hop."""
    cp = len(rank_tokens)
    holding = list(range(cp))  # whose block each rank holds
    sent, received = [0] * cp, [0] * cp
    for _ in range(cp - 1):
        for r in range(cp):
            sent[r] += rank_tokens[holding[r]]
            received[(r + 1) % cp] += rank_tokens[holding[r]]
        holding = [holding[(r - 1) % cp] for r in range(cp)]
    return sent, received
