"""Plain-Python references, written from the definitions in docs/DESIGN.md section 2 without shortcuts."""

from __future__ import annotations

import math
from itertools import product


def naive_workload(start: int, length: int) -> int:
    """Count query-key pairs one query at a time: query at position p sees keys 0..p."""
    return sum(p + 1 for p in range(start, start + length))


def naive_first_key(kind: str, size: int | None, position: int) -> int:
    """The first key of its document the query at ``position`` sees under a layer kind (docs/DESIGN.md)."""
    if kind == "window":
        return max(0, position - size + 1)
    if kind == "chunk":
        return position - position % size
    return 0


def naive_kind_workload(kind: str, size: int | None, start: int, length: int) -> int:
    """Count query-key pairs one query at a time: query p sees keys ``naive_first_key(p)..p``."""
    return sum(p + 1 - naive_first_key(kind, size, p) for p in range(start, start + length))


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


def naive_exchange_volumes(shards: list[tuple[int, int, int, int]], cp: int, gpus_per_node: int = 0,
                           kind: str = "full", size: int | None = None) -> dict[str, list[int]]:
    """Every rank's exchange rows, token by token: exact-need ``sent`` and ``received``, their parts between
    nodes (rank r on node ``r // gpus_per_node``; 0: one node), and the all-gather ``contributed``.

    Under a layer ``kind`` each query sees the keys ``naive_first_key(p)..p`` of its document: a rank receives
    once every key some query it holds sees and another rank holds. A shard contributes to the all-gather,
    when its document spans ranks, its keys that some later shard of the document sees (under a window or
    chunk: a later shard on another rank).
    """
    def node(rank: int) -> int:
        return rank // gpus_per_node if gpus_per_node else 0

    owner = {(d, t): r for d, s, n, r in shards for t in range(s, s + n)}
    volumes = {name: [0] * cp for name in ("sent", "received", "sent_far", "received_far", "contributed")}
    for rank in range(cp):
        for doc in {s[0] for s in shards if s[3] == rank}:
            seen = {t for d, s, n, r in shards if d == doc and r == rank for p in range(s, s + n)
                    for t in range(naive_first_key(kind, size, p), p + 1)}
            for t in seen:
                sender = owner[(doc, t)]
                if sender != rank:
                    volumes["received"][rank] += 1
                    volumes["sent"][sender] += 1
                    if node(sender) != node(rank):
                        volumes["received_far"][rank] += 1
                        volumes["sent_far"][sender] += 1
    for doc, start, length, rank in shards:
        same_doc = [s for s in shards if s[0] == doc]
        if len({s[3] for s in same_doc}) < 2:
            continue
        # full attention: every later shard (paper Eq. 5); a window or chunk: later shards of other ranks
        later = {t for d, s, n, r in same_doc if s > start and (kind == "full" or r != rank)
                 for p in range(s, s + n) for t in range(naive_first_key(kind, size, p), p + 1)}
        volumes["contributed"][rank] += sum(1 for t in range(start, start + length) if t in later)
    return volumes


def naive_local_shards(shards: list[tuple[int, int, int, int]], kind: str = "full",
                       size: int | None = None) -> list[bool]:
    """Per shard: whether every key its queries see lies on its own rank (its kernel needs no exchange)."""
    owner = {(d, t): r for d, s, n, r in shards for t in range(s, s + n)}
    return [all(owner[(doc, t)] == rank for p in range(start, start + length)
                for t in range(naive_first_key(kind, size, p), p + 1)) for doc, start, length, rank in shards]


def naive_document_attention(q, k, v, doc_lens, scale=None, window=None, chunk=None, sinks=None, softcap=None):
    """Dense attention over the whole packed sequence with a document-causal mask (torch, any dtype).

    q: (C, H, D); k, v: (C, K, D) with H % K == 0. Token i attends to token j iff both lie in the same
    document and j <= i; with ``window`` W also ``j > i - W``; with ``chunk`` K, j in i's chunk of the document
    (positions counted from the document's first token). Scale ``scale``, by default 1 / sqrt(D); ``softcap``
    c turns scores s into ``c * tanh(s / c)``; ``sinks`` (H,) adds a column of per-head logits to the softmax
    that no value reads (gpt-oss).
    """
    import torch

    context_len, num_heads, head_dim = q.shape
    group = num_heads // k.shape[1]
    doc = torch.repeat_interleave(torch.arange(len(doc_lens)), torch.as_tensor(doc_lens))
    pos = torch.arange(context_len)
    starts = torch.repeat_interleave(torch.cumsum(torch.as_tensor(doc_lens), 0) - torch.as_tensor(doc_lens),
                                     torch.as_tensor(doc_lens))
    doc_pos = pos - starts
    keep = (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])
    if window is not None:
        keep &= pos[None, :] > pos[:, None] - window
    if chunk is not None:
        keep &= (doc_pos[None, :] // chunk) == (doc_pos[:, None] // chunk)
    k_full = k.repeat_interleave(group, dim=1)
    v_full = v.repeat_interleave(group, dim=1)
    scale = head_dim ** -0.5 if scale is None else scale
    scores = torch.einsum("ihd,jhd->hij", q, k_full) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~keep.to(q.device), float("-inf"))
    if sinks is not None:
        sink_column = sinks.to(scores.dtype)[:, None, None].expand(num_heads, context_len, 1)
        probs = torch.cat((scores, sink_column), -1).softmax(-1)[..., :-1]
    else:
        probs = scores.softmax(-1)
    return torch.einsum("hij,jhd->ihd", probs, v_full)


def naive_pack(docs: list[list[int]], context_len: int, overflow: str):
    """Pack documents one token at a time, as docs/DESIGN.md and ``flashcp pack`` describe it.

    Returns ``(rows, tail_len, num_split, num_truncated, tokens_truncated)``; a row is
    ``(tokens, [(doc_source, doc_offset, length), ...])``. ``split`` continues a document in the next
    sequence; ``truncate`` drops the rest of a document once the sequence it is in is full.
    """
    rows, window, pieces = [], [], []
    split_docs, truncated_docs, tokens_truncated = set(), 0, 0
    for source, doc in enumerate(docs):
        for offset, token in enumerate(doc):
            if not pieces or pieces[-1][0] != source:
                pieces.append([source, offset, 0])
                if offset > 0:
                    split_docs.add(source)
            window.append(token)
            pieces[-1][2] += 1
            if len(window) == context_len:
                rows.append((window, [tuple(p) for p in pieces]))
                window, pieces = [], []
                if overflow == "truncate":
                    rest = len(doc) - offset - 1
                    truncated_docs += rest > 0
                    tokens_truncated += rest
                    break
    return rows, len(window), len(split_docs), truncated_docs, tokens_truncated


# ---------------------------------------------------------------------------------------------------------
# Strategy references: plain Python lists and tuples, written from the rules in flashcp/planner/strategies/__init__.py.
# Each returns a list of (doc, start, length, rank) shards sorted by (rank, doc, start), with touching shards
# of one document on one rank merged.


def naive_ratio(max_work: int, total_work: int, cp: int) -> float:
    """max / mean in float64, computed the way the kernels do."""
    return 1.0 if total_work == 0 else float(max_work) / (float(total_work) / float(cp))


def naive_quotas(context_len: int, cp: int) -> list[int]:
    return [context_len // cp + (1 if r < context_len % cp else 0) for r in range(cp)]


def naive_finish(pieces: list[tuple[int, int, int, int]]) -> list[tuple[int, int, int, int]]:
    """Drop empty pieces, sort by (rank, doc, start), merge touching pieces of one document on one rank."""
    out: list[list[int]] = []
    for doc, start, length, rank in sorted((p for p in pieces if p[2] > 0), key=lambda p: (p[3], p[0], p[1])):
        if out and out[-1][3] == rank and out[-1][0] == doc and out[-1][1] + out[-1][2] == start:
            out[-1][2] += length
        else:
            out.append([doc, start, length, rank])
    return [tuple(p) for p in out]


def naive_llama3(doc_lens: list[int], cp: int) -> list[tuple[int, int, int, int]]:
    """2N consecutive chunks of the whole sequence; rank i gets chunks i and 2N-1-i (sizes q_i//2, rest)."""
    quotas = naive_quotas(sum(doc_lens), cp)
    chunk_rank, chunk_size = [], []
    for k in range(2 * cp):
        rank = k if k < cp else 2 * cp - 1 - k
        chunk_rank.append(rank)
        chunk_size.append(quotas[rank] // 2 if k < cp else quotas[rank] - quotas[rank] // 2)
    # token t of the sequence -> its chunk's rank, then group runs by document
    owner = [r for r, size in zip(chunk_rank, chunk_size) for _ in range(size)]
    pieces, pos = [], 0
    for doc, length in enumerate(doc_lens):
        for t in range(length):
            pieces.append((doc, t, 1, owner[pos + t]))
        pos += length
    return naive_finish(pieces)


def naive_perdoc_pieces(doc_lens: list[int], docs: list[int], cp: int) -> list[tuple[int, int, int, int]]:
    """Zigzag pieces of ``docs`` (in the given order), remainder tokens dealt round-robin from rank 0."""
    pieces, pointer = [], 0
    for doc in docs:
        length = doc_lens[doc]
        base, extra = divmod(length, 2 * cp)
        extras = [0] * cp
        for _ in range(extra):
            extras[pointer] += 1
            pointer = (pointer + 1) % cp
        start = 0
        for k in range(2 * cp):
            rank = k if k < cp else 2 * cp - 1 - k
            size = base + (1 if (extras[rank] >= 1 if k < cp else extras[rank] >= 2) else 0)
            pieces.append((doc, start, size, rank))
            start += size
        assert start == length
    return pieces


def naive_perdoc(doc_lens: list[int], cp: int) -> list[tuple[int, int, int, int]]:
    return naive_finish(naive_perdoc_pieces(doc_lens, list(range(len(doc_lens))), cp))


def naive_flashcp(doc_lens: list[int], cp: int, target: float = 1.05,
                  max_perdoc: int | None = None) -> list[tuple[int, int, int, int]] | None:
    """Algorithm 1 as documented in flashcp/planner/strategies/__init__.py; None when it needs more than
    ``max_perdoc`` Per-Doc documents (flashcp2's bounded candidate)."""
    quotas = naive_quotas(sum(doc_lens), cp)
    order = sorted(range(len(doc_lens)), key=lambda d: (-doc_lens[d], d))
    for num_perdoc in range(len(order) + 1):
        if max_perdoc is not None and num_perdoc > max_perdoc:
            return None
        fixed = naive_perdoc_pieces(doc_lens, sorted(order[:num_perdoc]), cp)
        work, tokens = [0] * cp, [0] * cp
        for _, start, length, rank in fixed:
            work[rank] += naive_workload(start, length)
            tokens[rank] += length
        stacks: list[list[list[int]]] = [[] for _ in range(cp)]
        for doc in order[num_perdoc:]:
            rank = min(range(cp), key=lambda r: (work[r], r))
            stacks[rank].append([doc, 0, doc_lens[doc]])
            work[rank] += naive_workload(0, doc_lens[doc])
            tokens[rank] += doc_lens[doc]
        while any(tokens[r] > quotas[r] for r in range(cp)):
            over = min(range(cp), key=lambda r: (quotas[r] - tokens[r], r))
            under = min((r for r in range(cp) if tokens[r] < quotas[r]), key=lambda r: (work[r], r))
            doc, start, length = stacks[over][-1]
            moved = min(tokens[over] - quotas[over], quotas[under] - tokens[under], length)
            stacks[under].append([doc, start, moved])
            if moved == length:
                stacks[over].pop()
            else:
                stacks[over][-1] = [doc, start + moved, length - moved]
            shift = naive_workload(start, moved)
            work[over] -= shift
            work[under] += shift
            tokens[over] -= moved
            tokens[under] += moved
        pieces = fixed + [(doc, start, length, rank)
                          for rank in range(cp) for doc, start, length in stacks[rank]]
        if naive_ratio(max(work), sum(work), cp) <= target or num_perdoc == len(order):
            return naive_finish(pieces)
    raise AssertionError("unreachable")


def _sign_round(x: int, unit: int) -> int:
    """x / unit rounded half away from zero, integers only."""
    q = (abs(x) + unit // 2) // unit
    return q if x >= 0 else -q


def naive_flashcp_plus(doc_lens: list[int], cp: int, target: float = 1.01,
                       max_zigzag: int | None = None) -> list[tuple[int, int, int, int]]:
    """flashcp+ as documented in flashcp/planner/strategies/__init__.py; with ``max_zigzag``, its search for the
    target stops there (flashcp2's bounded candidate)."""
    n = len(doc_lens)
    quotas = naive_quotas(sum(doc_lens), cp)
    order = sorted(range(n), key=lambda d: (-doc_lens[d], d))
    mean = sum(naive_workload(0, d) for d in doc_lens) // cp
    heavy = sum(1 for d in doc_lens if naive_workload(0, d) > mean)
    ratio, pieces = _plus_candidate(doc_lens, cp, quotas, order, heavy, True, mean, target)
    if ratio <= target:
        return naive_finish(pieces)
    best_ratio, best = ratio, pieces
    for popped in range(max(1, heavy), (n if max_zigzag is None else min(n, max_zigzag)) + 1):
        ratio, pieces = _plus_candidate(doc_lens, cp, quotas, order, popped, False, mean, target)
        if ratio < best_ratio:
            best_ratio, best = ratio, pieces
        if ratio <= target:
            break
    return naive_finish(best)


def _plus_candidate(doc_lens, cp, quotas, order, popped, anchored, mean, target):
    W = naive_workload
    work, tokens, estimate = [0] * cp, [0] * cp, [0] * cp
    pieces: list[list[int]] = []  # [doc, start, len, rank], zigzag chunks excluded
    head = {}
    for doc in order[:popped]:
        d = doc_lens[doc]
        tail = 0
        if anchored:
            anchor = min(range(cp), key=lambda r: (estimate[r], r))
            room = quotas[anchor] - tokens[anchor]
            def fits(t):
                head_share = W(0, d - t) // cp
                return W(d - t, t) + head_share <= mean - estimate[anchor] and t + -(-(d - t) // cp) <= room

            # fits() holds for small t and fails beyond some t: search the boundary by halving
            lo, hi = 0, d
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
            tail = lo
            if tail:
                pieces.append([doc, d - tail, tail, anchor])
                work[anchor] += W(d - tail, tail)
                tokens[anchor] += tail
                estimate[anchor] += W(d - tail, tail)
        head[doc] = d - tail
        for r in range(cp):
            estimate[r] += W(0, d - tail) // cp
    zig_docs = sorted(doc for doc in head if head[doc] > 0)
    zig = {}
    chunks = naive_perdoc_pieces([head.get(i, 0) for i in range(len(doc_lens))], zig_docs, cp)
    for doc in zig_docs:
        mine = [c for c in chunks if c[0] == doc]  # 2N chunks in position order: early 0..N-1, late N-1..0
        zig[doc] = ([mine[i][2] for i in range(cp)], [mine[2 * cp - 1 - i][2] for i in range(cp)])
        for _, start, length, rank in mine:
            work[rank] += W(start, length)
            tokens[rank] += length
    for doc in order[popped:]:
        d = doc_lens[doc]
        room = [r for r in range(cp) if tokens[r] + d <= quotas[r]]
        rank = min(room or range(cp), key=lambda r: (work[r], r))
        pieces.append([doc, 0, d, rank])
        work[rank] += W(0, d)
        tokens[rank] += d

    def whole(p):
        return p[2] == doc_lens[p[0]]

    # token repair: whole documents first, then heads
    while any(tokens[r] > quotas[r] for r in range(cp)):
        over = min(range(cp), key=lambda r: (quotas[r] - tokens[r], r))
        excess = tokens[over] - quotas[over]
        unders = [r for r in range(cp) if tokens[r] < quotas[r]]
        moves = [(-p[2], p[0], work[u], u, i) for i, p in enumerate(pieces) if p[3] == over and whole(p)
                 for u in unders if p[2] <= min(excess, quotas[u] - tokens[u])]
        if moves:
            _, _, _, u, i = min(moves)
            pieces[i][3] = u
            shift, moved = W(0, pieces[i][2]), pieces[i][2]
            work[over] -= shift
            work[u] += shift
            tokens[over] -= moved
            tokens[u] += moved
            continue
        u = min(unders, key=lambda r: (work[r], r))
        mine = [i for i, p in enumerate(pieces) if p[3] == over]
        i = min(mine, key=lambda i: (not whole(pieces[i]), -pieces[i][2], pieces[i][0], pieces[i][1]))
        doc, start, length, _ = pieces[i]
        moved = min(excess, quotas[u] - tokens[u], length)
        if moved == length:
            pieces[i][3] = u
        else:
            pieces.append([doc, start, moved, u])
            pieces[i] = [doc, start + moved, length - moved, over]
        work[over] -= W(start, moved)
        work[u] += W(start, moved)
        tokens[over] -= moved
        tokens[u] += moved

    # levers along the rank chain, longest popped document first
    for doc in order[:popped]:
        if doc not in zig:
            continue
        early, late = zig[doc]
        total = sum(work)
        reach_lo, reach_hi = [0] * cp, [0] * cp
        if cp >= 2:
            reach_lo[cp - 2], reach_hi[cp - 2] = -late[cp - 1], early[cp - 1]
        for i in range(cp - 3, -1, -1):
            reach_lo[i], reach_hi[i] = reach_lo[i + 1] - late[i + 1], reach_hi[i + 1] + early[i + 1]
        deltas, gaps, prev, inflow = [0] * cp, [0] * cp, 0, 0
        for i in range(cp - 1):
            gap = (head[doc] - sum(late[:i + 1])) - sum(early[:i + 1])
            surplus = work[i] * cp - total + inflow
            delta = _sign_round(surplus, gap * cp) if gap > 0 else 0
            delta = max(max(prev - early[i], reach_lo[i]), min(min(prev + late[i], reach_hi[i]), delta))
            deltas[i], gaps[i] = delta, gap
            inflow = delta * gap * cp
            prev = delta
        for i in range(cp):
            before = deltas[i - 1] if i else 0
            early[i] += deltas[i] - before
            late[i] -= deltas[i] - before
            work[i] += before * (gaps[i - 1] if i else 0) - deltas[i] * gaps[i]

    # window swaps
    for _ in range(4 * cp):
        total = sum(work)
        a = min(range(cp), key=lambda r: (-work[r], r))
        if naive_ratio(work[a], total, cp) <= target:
            break
        done = False
        for b in sorted(range(cp), key=lambda r: (work[r], r)):
            if b == a or work[b] * cp >= total:
                break
            need = min(work[a] * cp - total, total - work[b] * cp) // cp
            mine = [i for i, p in enumerate(pieces) if p[3] == a and whole(p)]
            if not mine:
                continue
            x = min(mine, key=lambda i: (-pieces[i][2], pieces[i][0]))
            options = []
            for i, p in enumerate(pieces):
                if p[3] == b and whole(p):
                    t = p[2]
                    w = need // t
                    if w >= 1 and w + t <= pieces[x][2]:
                        options.append((max(w, t), p[0], i, w))
            if not options:
                continue
            _, _, y, w = min(options)
            doc, _, length, _ = pieces[x]
            t = pieces[y][2]
            pieces[x] = [doc, 0, w, a]
            pieces.append([doc, w, t, b])
            pieces.append([doc, w + t, length - w - t, a])
            pieces[y][3] = a
            work[a] -= w * t
            work[b] += w * t
            done = True
            break
        if not done:
            break

    out = [tuple(p) for p in pieces]
    for doc in zig_docs:
        early, late = zig[doc]
        start = 0
        for i in range(cp):
            out.append((doc, start, early[i], i))
            start += early[i]
        for i in range(cp - 1, -1, -1):
            out.append((doc, start, late[i], i))
            start += late[i]
    return naive_ratio(max(work), sum(work), cp), out


def naive_sequence_views(tokens, doc_lens, vocab_size):
    """Whole-sequence (input_ids, position_ids, labels), token by token; ids folded into ``vocab_size``."""
    import torch

    ids, positions, labels = [], [], []
    offset = 0
    for n in doc_lens:
        for p in range(int(n)):
            ids.append(int(tokens[offset + p]) % vocab_size)
            positions.append(p)
            labels.append(int(tokens[offset + p + 1]) % vocab_size if p + 1 < n else -100)
        offset += int(n)
    return torch.tensor(ids), torch.tensor(positions), torch.tensor(labels)


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


def _naive_span_pieces(doc_lens: list[int], pos: int, end: int) -> list[tuple[int, int, int]]:
    """(doc, start, len) pieces of sequence span [pos, end): its overlap with every document, in order."""
    pieces, first = [], 0
    for doc, n in enumerate(doc_lens):
        lo, hi = max(pos, first), min(end, first + n)
        if lo < hi:
            pieces.append((doc, lo - first, hi - lo))
        first += n
    return pieces


def _naive_place(doc_lens, pos, end, rank, quotas, tokens, load, weight, pieces):
    """The peers' placement rule: the preferred rank takes what fits, the rest goes head first to the rank
    with room and the least load (ties: lowest rank)."""
    cp = len(quotas)
    while pos < end:
        take = min(quotas[rank] - tokens[rank], end - pos)
        if take > 0:
            for doc, start, length in _naive_span_pieces(doc_lens, pos, pos + take):
                pieces.append((doc, start, length, rank))
                if weight is None:
                    load[rank] += naive_workload(start, length)
            if weight is not None:
                load[rank] += weight
            tokens[rank] += take
            pos += take
        if pos < end:
            rank = min((r for r in range(cp) if tokens[r] < quotas[r]), key=lambda r: (load[r], r))


def naive_magi(doc_lens: list[int], cp: int, chunk: int = 512) -> list[tuple[int, int, int, int]]:
    """MagiAttention's MinHeap dispatch: chunks by decreasing workload (ties: later chunk first), each to the
    least-loaded rank with room for all of it, else the least-loaded rank with any room takes its head."""
    context_len = sum(doc_lens)
    quotas = naive_quotas(context_len, cp)
    bounds = [(s, min(context_len, s + chunk)) for s in range(0, context_len, chunk)]
    work = [sum(naive_workload(s, n) for _, s, n in _naive_span_pieces(doc_lens, a, b)) for a, b in bounds]
    order = sorted(range(len(bounds)), key=lambda i: (-work[i], -i))
    tokens, load, pieces = [0] * cp, [0] * cp, []
    for i in order:
        a, b = bounds[i]
        fits = [r for r in range(cp) if quotas[r] - tokens[r] >= b - a]
        some = fits or [r for r in range(cp) if tokens[r] < quotas[r]]
        best = min(some, key=lambda r: (load[r], r))
        _naive_place(doc_lens, a, b, best, quotas, tokens, load, None, pieces)
    return naive_finish(pieces)


def naive_ptrr_times(doc_lens: list[int], chunk: int) -> list[int]:
    """Key blocks each query block reads under the document-causal mask: query q reads keys from its
    document's first token to q, so block i reads the union of those keys' blocks over its queries."""
    context_len = sum(doc_lens)
    doc_start = [sum(doc_lens[:d]) for d, n in enumerate(doc_lens) for _ in range(n)]
    times = []
    for i in range((context_len + chunk - 1) // chunk):
        read = set()
        for q in range(i * chunk, min(context_len, (i + 1) * chunk)):
            read.update(range(doc_start[q] // chunk, q // chunk + 1))
        times.append(len(read))
    return times


def naive_ptrr(doc_lens: list[int], cp: int, chunk: int = 128) -> list[tuple[int, int, int, int]]:
    """PyTorch's PTRR: blocks sorted by decreasing process time (stable), row k of cp blocks dealt to ranks
    0..cp-1 (k even) or cp-1..0 (k odd); a rank without room passes the rest on (see ``_naive_place``)."""
    context_len = sum(doc_lens)
    quotas = naive_quotas(context_len, cp)
    times = naive_ptrr_times(doc_lens, chunk)
    order = sorted(range(len(times)), key=lambda i: -times[i])
    tokens, load, pieces = [0] * cp, [0] * cp, []
    for p, i in enumerate(order):
        rank = p % cp if (p // cp) % 2 == 0 else cp - 1 - p % cp
        _naive_place(doc_lens, i * chunk, min(context_len, (i + 1) * chunk), rank, quotas, tokens, load,
                     times[i], pieces)
    return naive_finish(pieces)


def naive_affinity(doc_lens: list[int], cp: int, chunk: int, tolerance: float) -> list[tuple[int, int, int, int]]:
    """flashcp2's constructive candidate: per-document chunks cut from the end, by decreasing workload
    (ties: lower document, then later chunk), to the least-loaded rank with room, unless the rank holding the
    next chunk of the same document has room, stays within the mean and is within ``tolerance * mean`` of
    that rank's load; a chunk no rank has room for is split head first over the least-loaded ranks."""
    quotas = naive_quotas(sum(doc_lens), cp)
    chunks = []  # (doc, start, len) in cut order: a document's later chunk comes first
    for d, n in enumerate(doc_lens):
        end = n
        while end > 0:
            take = min(chunk, end)
            chunks.append((d, end - take, take))
            end -= take
    work = [naive_workload(s, n) for _, s, n in chunks]
    mean = sum(work) / cp
    order = sorted(range(len(chunks)), key=lambda i: -work[i])
    owner = [-1] * len(chunks)
    load, tokens, pieces = [0] * cp, [0] * cp, []
    for i in order:
        d, s, n = chunks[i]
        fits = [r for r in range(cp) if quotas[r] - tokens[r] >= n]
        best = min(fits, key=lambda r: (load[r], r)) if fits else -1
        if i > 0 and chunks[i - 1][0] == d and owner[i - 1] >= 0:
            near = owner[i - 1]
            if quotas[near] - tokens[near] >= n and load[near] + work[i] <= mean and \
                    (best < 0 or load[near] <= load[best] + tolerance * mean):
                best = near
        if best >= 0:
            pieces.append((d, s, n, best))
            load[best] += work[i]
            tokens[best] += n
            owner[i] = best
            continue
        pos = s
        while pos < s + n:
            r = min((r for r in range(cp) if tokens[r] < quotas[r]), key=lambda r: (load[r], r))
            take = min(s + n - pos, quotas[r] - tokens[r])
            pieces.append((d, pos, take, r))
            load[r] += naive_workload(pos, take)
            tokens[r] += take
            pos += take
    return naive_finish(pieces)


def naive_local_search(shards: list[tuple[int, int, int, int]], cp: int, step_time, target: float,
                       budget: int, steps=(1024, 256, 64, 16), window: int = 0) -> list[tuple[int, int, int, int]]:
    """flashcp2's local search, move by move: for each shift (largest first) and each pair of boundaries
    (i < j) between the same two ranks, shift boundary i by +-shift and boundary j so that the tokens go
    back; keep the first move that lowers ``step_time(shards)`` while the imbalance stays within ``target``
    and the largest exact-need receive does not grow; repeat while a pass improves, within ``budget``
    evaluations. Boundaries: touching shards of one document on different ranks, in (doc, start) order.
    With a token ``window`` > 0, each shift first tries every single boundary moved by +-shift that keeps
    both ranks within ``window`` tokens of their quotas (same acceptance)."""
    shards = [list(s) for s in shards]
    order = sorted(range(len(shards)), key=lambda i: (shards[i][0], shards[i][1]))
    bounds = [(a, b) for a, b in zip(order, order[1:])
              if shards[a][0] == shards[b][0] and shards[a][1] + shards[a][2] == shards[b][1]]

    def shift(pair, delta):
        a, b = pair
        shards[a][2] += delta
        shards[b][1] += delta
        shards[b][2] -= delta

    def received():
        return naive_metrics([tuple(s) for s in shards], cp)[2]

    def tokens(rank):
        return sum(n for _, _, n, r in shards if r == rank)

    quotas = naive_quotas(sum(n for _, _, n, _ in shards), cp)
    best, recv, used = step_time(shards), received(), 0
    improved = True
    while improved and used < budget:
        improved = False
        for step in steps:
            for al, ar in (bounds if window > 0 else []):
                for sign in (1, -1):
                    if (sign > 0 and shards[ar][2] <= step) or (sign < 0 and shards[al][2] <= step):
                        continue
                    gain, lose = (shards[al][3], shards[ar][3]) if sign > 0 else (shards[ar][3], shards[al][3])
                    if tokens(gain) + step > quotas[gain] + window or tokens(lose) - step < quotas[lose] - window:
                        continue
                    if used >= budget:
                        return [tuple(s) for s in shards]  # type: ignore[misc]
                    shift((al, ar), sign * step)
                    used += 1
                    imbalance = naive_metrics([tuple(s) for s in shards], cp)[0]
                    if imbalance <= target and step_time(shards) < best and received() <= recv:
                        best, recv, improved = step_time(shards), received(), True
                        break
                    shift((al, ar), -sign * step)
            for i, (al, ar) in enumerate(bounds):
                for bl, br in bounds[i + 1:]:
                    x, y = shards[ar][3], shards[al][3]
                    if (shards[bl][3], shards[br][3]) == (x, y):
                        sign_j = 1
                    elif (shards[bl][3], shards[br][3]) == (y, x):
                        sign_j = -1
                    else:
                        continue
                    for sign_i in (1, -1):
                        d_i, d_j = sign_i * step, sign_i * sign_j * step
                        if (d_i > 0 and shards[ar][2] <= d_i) or (d_i < 0 and shards[al][2] <= -d_i):
                            continue
                        if (d_j > 0 and shards[br][2] <= d_j) or (d_j < 0 and shards[bl][2] <= -d_j):
                            continue
                        if used >= budget:
                            return [tuple(s) for s in shards]  # type: ignore[misc]
                        shift((al, ar), d_i)
                        shift((bl, br), d_j)
                        used += 1
                        got = step_time(shards)
                        imbalance = naive_metrics([tuple(s) for s in shards], cp)[0]
                        if got < best and imbalance <= target and received() <= recv:
                            best, recv, improved = got, received(), True
                            break
                        shift((bl, br), -d_j)
                        shift((al, ar), -d_i)
    return [tuple(s) for s in shards]  # type: ignore[misc]


def naive_step_time(cp: int, gpus_per_node: int = 0):
    """The step time as ``flashcp bench`` computes it (numpy projection: default profile, H = H_kv = 32,
    D = 128, auto comm, overlap, ``gpus_per_node`` ranks per node), for plans given as (doc, start, len, rank)
    shards."""
    from flashcp.costmodel.profile import load_profile
    from flashcp.costmodel.projection import project_step
    from flashcp.costmodel.shape import AttentionShape
    from flashcp.planner.plan import SequencePlan

    profile = load_profile()
    shape = AttentionShape(num_heads=32, num_kv_heads=32, head_dim=128)

    def step_time(shards):
        plan = SequencePlan.from_arrays(*zip(*shards), cp=cp)
        return project_step(plan, shape, profile, "auto", True, gpus_per_node=gpus_per_node).total

    return step_time


def naive_traffic(shards, cp: int) -> list[list[int]]:
    """``T[b][r]``: exact-need tokens rank b sends rank r (the prefix of each document up to r's last token)."""
    max_end: dict[tuple[int, int], int] = {}
    for d, s, n, r in shards:
        max_end[d, r] = max(max_end.get((d, r), 0), s + n)
    traffic = [[0] * cp for _ in range(cp)]
    for d, s, n, b in shards:
        for r in range(cp):
            if r != b:
                traffic[b][r] += min(n, max(0, max_end.get((d, r), 0) - s))
    return traffic


def naive_relabel(shards, cp: int, gpus_per_node: int) -> list[tuple[int, int, int, int]]:
    """flashcp2's placement of ranks on nodes: swap ranks of equal tokens between nodes (pairs a < b in
    order, passes until none helps, at most 4) while ``(largest cross-node tokens of one rank, sent or
    received; total cross-node tokens)`` drops."""
    if gpus_per_node <= 0 or gpus_per_node >= cp:
        return list(shards)
    traffic = naive_traffic(shards, cp)
    tokens = [sum(n for _, _, n, r in shards if r == rank) for rank in range(cp)]
    node = [r // gpus_per_node for r in range(cp)]
    slot = list(range(cp))

    def score():
        sent = [sum(traffic[b][r] for r in range(cp) if node[r] != node[b]) for b in range(cp)]
        got = [sum(traffic[b][r] for b in range(cp) if node[r] != node[b]) for r in range(cp)]
        return max(max(sent), max(got)), sum(sent)

    best = score()
    for _ in range(4):
        improved = False
        for a in range(cp):
            for b in range(a + 1, cp):
                if node[a] == node[b] or tokens[a] != tokens[b]:
                    continue
                node[a], node[b] = node[b], node[a]
                got = score()
                if got < best:
                    best, improved = got, True
                    slot[a], slot[b] = slot[b], slot[a]
                else:
                    node[a], node[b] = node[b], node[a]
        if not improved:
            break
    return naive_finish([(d, s, n, slot[r]) for d, s, n, r in shards])


def naive_flashcp2(doc_lens: list[int], cp: int, step_time=None, target: float = 1.05,
                   effort: int = 1, token_slack: float = 0.0, tie: float = 0.02,
                   gpus_per_node: int = 0) -> list[tuple[int, int, int, int]]:
    """flashcp2 from the references: flashcp+ (at most 8 zigzagged documents) at min(target, 1.01) first,
    then Algorithm 1 (when it needs at most 8 Per-Doc documents) if faster, then the portfolio in the
    kernel's order (flashcp+ at the ceiling ``target`` when above 1.01, the chunked assignments, ...), each
    placed on nodes under a topology. A candidate with more than ``num_docs + 32 N`` shards or over the
    ceiling or slower than flashcp+ is not taken; one within it replaces a first plan over it; otherwise a
    candidate not slower than flashcp+ and Algorithm 1 (when it meets the ceiling) under ``step_time``
    (default ``naive_step_time``) wins when it is faster
    by more than ``tie`` (a share of the best time), or not faster but no less balanced and within ``tie``
    with a lower largest receive (equal receive: faster); then the local search with 16 evaluations per
    unit of effort; last, the first default plan of flashcp+, magi, flashcp, llama3 and ptrr that is faster
    replaces it. (The kernel also skips candidates whose busiest rank alone is too slow to win: that
    must not change the plan.)"""
    step_time = step_time or naive_step_time(cp, gpus_per_node)
    zigzag = 8

    def place(plan):
        return naive_relabel(plan, cp, gpus_per_node)

    best = place(naive_flashcp_plus(doc_lens, cp, min(target, 1.01), zigzag))
    best_time = step_time(best)
    best_imbalance, _, best_received = naive_metrics(best, cp)
    plus_time = best_time
    quota = sum(doc_lens) // cp
    most_shards = len(doc_lens) + 32 * cp

    def chunk(split):
        return max(1, quota // split)

    affinity = [(4, 0.03), (8, 0.1), (8, 0.01), (16, 0.01), (8, 0.03), (4, 0.01), (16, 0.03), (16, 0.1)]
    anchor = naive_flashcp(doc_lens, cp, 1.05, zigzag)  # Algorithm 1 sets the time to beat with flashcp+
    if anchor is not None and len(anchor) <= most_shards and naive_metrics(anchor, cp)[0] <= target:
        plan = place(anchor)
        t = step_time(plan)
        if t < best_time or best_imbalance > target and t <= best_time:
            best, best_time, plus_time = plan, t, t
            best_imbalance, _, best_received = naive_metrics(plan, cp)
    candidates = [lambda: naive_flashcp_plus(doc_lens, cp, target, zigzag) if target > 1.01 else None]
    candidates += [lambda s=s, t=t: naive_affinity(doc_lens, cp, chunk(s), t) for s, t in affinity[:8 if effort else 3]]
    if effort:
        candidates += [lambda: naive_magi(doc_lens, cp, chunk(8)), lambda: naive_llama3(doc_lens, cp)]
    if effort > 1:
        candidates += [lambda: naive_magi(doc_lens, cp, chunk(16)), lambda: naive_magi(doc_lens, cp, chunk(4))]
    for make in candidates:
        plan = make()
        if plan is None or len(plan) > most_shards:
            continue
        imbalance, _, received = naive_metrics(plan, cp)
        if imbalance > target:
            continue
        plan = place(plan)
        t = step_time(plan)
        if t > plus_time:
            continue
        if best_imbalance <= target:
            if t >= best_time * (1 + tie):
                continue
            if t >= best_time and imbalance > best_imbalance:
                continue
            # within ``tie`` of the best time: the lower receive wins, then the faster
            if t >= best_time * (1 - tie) and (received, t) >= (best_received, best_time):
                continue
        best, best_time, best_received, best_imbalance = plan, t, received, imbalance
    if effort:
        window = math.floor(token_slack * sum(doc_lens) / cp)
        best = naive_finish(naive_local_search(best, cp, step_time, max(target, best_imbalance), 16 * effort,
                                               window=window))
    # never slower than a peer's default plan: the first faster one replaces it
    best_time = step_time(best)
    for peer in (naive_flashcp_plus(doc_lens, cp, 1.01), naive_magi(doc_lens, cp, 512),
                 naive_flashcp(doc_lens, cp, 1.05), naive_llama3(doc_lens, cp), naive_ptrr(doc_lens, cp, 128)):
        t = step_time(peer)
        if t < best_time:
            best, best_time = peer, t
    return best


def naive_sequence_flops(doc_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int, layers: int,
                         hidden_mult: float = 4.0, kinds: list[tuple[str, int]] | None = None,
                         recurrent_layers: int = 0, recurrent_flops: float = 0.0) -> float:
    """FLOPs of one packed sequence, forward + backward, counted token by token and pair by pair.

    Per token and layer: the projections Q, K, V, O and the two MLP matrices, 2 FLOPs per multiply-add, three
    times (forward, and backward's two products). Per query-key pair and layer: ``QK^T`` and ``PV`` (4 H D
    forward), backward 2.5 times that (the flash-attention convention the cost model uses). ``kinds``: each
    attention layer's ``(kind, size)`` (None: all full); a query at position p sees p + 1 keys (full),
    ``min(p + 1, W)`` (window W), ``p mod K + 1`` (chunk K). Per token and recurrent layer ``recurrent_flops``
    forward, twice that backward.
    """
    d, d_kv = num_heads * head_dim, num_kv_heads * head_dim
    per_token = 3 * (2 * d * d + 2 * d * d_kv + 2 * d * d_kv + 2 * d * d + 2 * 2 * d * hidden_mult * d)
    per_pair = 4 * num_heads * head_dim * (1 + 2.5)
    seen = {"full": lambda p, _: p + 1, "window": lambda p, w: min(p + 1, w), "chunk": lambda p, k: p % k + 1}
    total = 0.0
    for kind, size in kinds or [("full", 0)] * layers:
        for n in doc_lens:
            for query in range(n):
                total += per_token + per_pair * seen[kind](query, size)
    return total + sum(doc_lens) * recurrent_layers * recurrent_flops * 3


def naive_recurrent_volumes(shards: list[tuple[int, int, int, int]], cp: int, width: int,
                            gpus_per_node: int = 0) -> dict[str, dict[str, list[int]]]:
    """Every rank's rows in a recurrent layer's two all-to-alls, from the definitions (docs/DESIGN.md section 6).

    ``maps``: a shard that is not the last of its document sends its state map once to each other rank that
    holds a later shard of the document; ``contributed`` counts the shards that are not their document's last.
    ``conv``: a rank receives once each input token ``t`` of a document such that one of its shards starts in
    ``(t, t + width - 1]`` and another rank holds ``t``; that rank sends it. Parts between nodes as
    ``naive_exchange_volumes``.
    """
    def node(rank: int) -> int:
        return rank // gpus_per_node if gpus_per_node else 0

    def add(table, sender, receiver):
        table["sent"][sender] += 1
        table["received"][receiver] += 1
        if node(sender) != node(receiver):
            table["sent_far"][sender] += 1
            table["received_far"][receiver] += 1

    names = ("sent", "received", "sent_far", "received_far", "contributed")
    maps = {name: [0] * cp for name in names}
    conv = {name: [0] * cp for name in names}
    for doc, start, _, owner in shards:
        later = {r for d, s, _, r in shards if d == doc and s > start}
        maps["contributed"][owner] += 1 if later else 0
        for rank in later - {owner}:
            add(maps, owner, rank)
    holder = {(d, t): r for d, s, n, r in shards for t in range(s, s + n)}
    for rank in range(cp):
        needed = {(d, t) for d, s, _, r in shards if r == rank for t in range(max(0, s - width + 1), s)}
        for doc, t in needed:
            if holder[(doc, t)] != rank:
                add(conv, holder[(doc, t)], rank)
    return {"maps": maps, "conv": conv}


def _naive_l2norm(x, eps: float = 1e-6):
    """``x / sqrt(sum(x^2) + eps)`` over the last dim: the normalisation of fla and transformers' l2norm."""
    import torch

    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def naive_causal_conv1d(x, weight, bias, doc_lens, activation="silu"):
    """Depthwise causal convolution of each document alone, one output token at a time (torch, any dtype).

    x: (C, F) packed tokens; weight: (F, W) (``nn.Conv1d(groups=F).weight.squeeze(1)``); bias: (F,) or None.
    Token t of a document gets ``bias + sum_j weight[:, j] * x[t - (W-1) + j]``, where tokens before the
    document's first count as zero (transformers' ``causal_conv1d_fn`` on the document alone), then SiLU when
    ``activation == "silu"``.
    """
    import torch

    width = weight.shape[1]
    out, start = [], 0
    for n in doc_lens:
        doc = x[start:start + int(n)]
        y = torch.zeros_like(doc) if bias is None else bias.expand_as(doc).clone()
        for j in range(width):  # tap j reads the token (W-1-j) places back; none before the document's first
            back = width - 1 - j
            y[back:] = y[back:] + weight[:, j] * doc[:doc.shape[0] - back]
        out.append(torch.nn.functional.silu(y) if activation == "silu" else y)
        start += int(n)
    return torch.cat(out)


def naive_gated_delta_rule(q, k, v, g, beta, doc_lens, scale=None, use_qk_l2norm=True, initial_states=None):
    """Gated DeltaNet (Qwen3-Next) token by token, the state reset at each document start (torch, any dtype).

    q, k: (C, Hk, K); v: (C, H, V) with ``H % Hk == 0`` (value head h reads key head ``h // (H // Hk)``);
    g (log decay, <= 0), beta: (C, H). With ``use_qk_l2norm`` q and k are L2-normalised first; q is scaled by
    ``scale`` (default ``K ** -0.5``). Per head, with the state S (K, V):

        S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,    o_t = S_t^T q_t

    the definition of transformers' ``torch_recurrent_gated_delta_rule`` (which decays first, then writes the
    delta ``beta (v - S^T k)``). ``initial_states``: (N, H, K, V) per document, or None (zeros).
    Returns (out (C, H, V), final states (N, H, K, V)).
    """
    import torch

    num_heads, head_k = v.shape[1], k.shape[2]
    group = num_heads // k.shape[1]
    q, k = q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)
    if use_qk_l2norm:
        q, k = _naive_l2norm(q), _naive_l2norm(k)
    q = q * (head_k ** -0.5 if scale is None else scale)
    eye = torch.eye(head_k, dtype=v.dtype)
    out, finals, start = [], [], 0
    for i, n in enumerate(doc_lens):
        state = v.new_zeros(num_heads, head_k, v.shape[2]) if initial_states is None else initial_states[i]
        for t in range(start, start + int(n)):
            kt = k[t][:, :, None]  # (H, K, 1)
            transition = g[t].exp()[:, None, None] * (eye - beta[t][:, None, None] * kt @ kt.transpose(1, 2))
            state = transition @ state + beta[t][:, None, None] * kt @ v[t][:, None, :]
            out.append((state.transpose(1, 2) @ q[t][:, :, None])[..., 0])
        finals.append(state)
        start += int(n)
    return torch.stack(out), torch.stack(finals)


def naive_ssd(x, dt, A, B, C, D, doc_lens, initial_states=None):
    """Mamba-2 SSD token by token, the state reset at each document start (torch, any dtype).

    x: (C, H, P); dt (after softplus and clamping, > 0): (C, H); A: (H,) (negative); B, C: (C, G, N) with
    ``H % G == 0`` (head h reads group ``h // (H // G)``); D: (H,) or None. Per head, with the state h (P, N):

        h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T,    y_t = h_t C_t + D x_t

    as transformers' Mamba2 / NemotronH ``mamba2_chunk_scan`` and ``mamba2_selective_state_update``.
    ``initial_states``: (N, H, P, N) per document, or None (zeros). Returns (y (C, H, P), finals (N, H, P, N)).
    """
    import torch

    num_heads = x.shape[1]
    group = num_heads // B.shape[1]
    B, C = B.repeat_interleave(group, dim=1), C.repeat_interleave(group, dim=1)
    out, finals, start = [], [], 0
    for i, n in enumerate(doc_lens):
        state = x.new_zeros(num_heads, x.shape[2], B.shape[2]) if initial_states is None else initial_states[i]
        for t in range(start, start + int(n)):
            decay = (dt[t] * A).exp()[:, None, None]
            state = decay * state + dt[t][:, None, None] * x[t][:, :, None] * B[t][:, None, :]
            y = (state @ C[t][:, :, None])[..., 0]
            out.append(y if D is None else y + D[:, None] * x[t])
        finals.append(state)
        start += int(n)
    return torch.stack(out), torch.stack(finals)
