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


def naive_exact_need_sent(shards: list[tuple[int, int, int, int]], cp: int) -> list[int]:
    """Tokens each rank sends under exact-need exchange: for every other rank r and document d that r holds,
    the sender's tokens of d before the end of r's last shard of d."""
    sent = [0] * cp
    for doc, start, length, owner in shards:
        for rank in range(cp):
            ends = [s + n for d, s, n, r in shards if d == doc and r == rank]
            if rank != owner and ends:
                sent[owner] += sum(1 for t in range(start, start + length) if t < max(ends))
    return sent


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
